"""Faults of a remote prefill at the worker level: a ``DecodeSide`` and a ``PrefillSide`` on
their own engine threads, joined by real pyzmq sockets on 127.0.0.1 (``docs/pd.md``,
"Frames").

- frames delayed and duplicated by the prefill side's ``FaultInjector`` still give the
  co-located output, land (no recompute) and are counted where the decode side counts frames
  (``phasewise:kv_frames_total`` by outcome); corrupted and dropped ones are counted too;
- rogue peers (no handshake, a wrong key with or without the right layout, and one holding
  the key but not bound to the attempt) that send K/V for a request in flight are refused and
  counted, and no block of that request changes;
- a client abort in each phase (queued, prefilling remotely, transferring, decoding) leaves
  both KV pools and every request table empty.

Phases are reached by holding threads, never by timing: ``Valve`` (a ``FaultInjector``)
holds the prefill engine's thread just before it sends a given frame; ``Hold`` (an engine
observer) holds the decode engine's thread at a chosen notification. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import zmq
from zmq.utils import z85

from conftest import collect
from faults import Fault, FaultInjector

from phasewise import EngineConfig, SamplingParams
from phasewise.disagg.metrics import DisaggCollector
from phasewise.disagg.transport import KVClient
from phasewise.disagg.wire import (Challenge, Error, FirstToken, KVLayout, Open, Refuse,
                                   curve_secret_key, decode_message, encode_kv_frame,
                                   encode_message, make_hello)
from phasewise.disagg.worker import DecodeSide, PrefillSide
from phasewise.engine.async_engine import AsyncEngine, PromptSpec
from phasewise.engine.engine import LLMEngine
from phasewise.engine.kv_bytes import kv_to_bytes
from phasewise.engine.request import RequestStatus

SECRET = b"test-secret-of-enough-bytes-0123"
WRONG = b"a-wrong-secret-of-enough-bytes!!"
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPT = [(5 * i + 2) % 250 + 1 for i in range(41)]  # 3 blocks of 16: 16 + 16 + 9 tokens
CHUNKED = {"max_num_batched_tokens": 16}  # one block per step: three K/V frames per PROMPT
WAIT = 30.0  # seconds any single wait may take before the test fails


# --------------------------------------------------------------------------------------------
# helpers


def greedy(max_tokens: int) -> SamplingParams:
    return dataclasses.replace(GREEDY, max_tokens=max_tokens)


def prompt_kv(engine: LLMEngine, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """The K/V of a request's first ``num_tokens`` tokens: [layers, 2, tokens, kv, hd]."""
    return engine.runner.read_blocks(block_ids).flatten(2, 3)[:, :, :num_tokens]


def colocated(path, prompt, params=GREEDY, **kw) -> tuple[list[int], torch.Tensor]:
    """Greedy output of one co-located engine, and its prompt's K/V (read right after the
    step that finished the prompt)."""
    eng = LLMEngine(EngineConfig(model=str(path), **kw))
    eng.add_request(prompt, params, request_id="r")
    kv = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if kv is None:
                kv = prompt_kv(eng, eng.kv.block_table("r"), len(prompt))
            if out.finished:
                return out.token_ids, kv
    raise AssertionError("no output")


async def until(cond: Callable[[], bool], what: str) -> None:
    """Poll ``cond`` until it holds; fail (saying ``what``) after WAIT seconds."""
    deadline = time.monotonic() + WAIT
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def reached(event: threading.Event, what: str) -> None:
    assert await asyncio.to_thread(event.wait, WAIT), what


def exported(decode: DecodeSide) -> dict[tuple[str, str], float]:
    """What /metrics shows for the decode side: (sample name, outcome or reason) -> value."""
    out = {}
    for family in DisaggCollector(decode, "m").collect():
        for s in family.samples:
            out[(s.name, s.labels.get("outcome", s.labels.get("reason", "")))] = s.value
    return out


def prefill_tokens(engine: LLMEngine) -> int:
    """Prompt tokens an engine computed itself (over all its steps)."""
    return sum(s.num_prefill_tokens for s in engine.step_stats)


class Valve(FaultInjector):
    """A fault injector that, before frame ``hold_at`` of an attempt goes out, holds the
    prefill engine's thread (which ships frames right after each forward pass) until
    ``open()``. ``seen`` lists (request id, seq) of every frame that reached it."""

    def __init__(self, hold_at: int | None, plan: Any = None):
        super().__init__(plan)
        self.hold_at = hold_at
        self.reached = threading.Event()
        self._open = threading.Event()
        self.seen: list[tuple[str, int]] = []

    def open(self) -> None:
        self._open.set()

    def outgoing(self, seq: int, parts: list[Any]) -> list[list[Any]]:
        self.seen.append((decode_message(parts[0]).request_id, seq))
        if seq == self.hold_at and not self._open.is_set():
            self.reached.set()
            self._open.wait(WAIT)
        return super().outgoing(seq, parts)


@dataclasses.dataclass
class HoldPoint:
    when: Callable[[Any, Any], bool]  # (outputs, snapshot) -> hold here?
    reached: threading.Event = dataclasses.field(default_factory=threading.Event)
    released: threading.Event = dataclasses.field(default_factory=threading.Event)


class Hold:
    """An engine observer: holds the engine's thread once at each point's first matching
    notification until the point is released. ``finished`` collects every request's end."""

    def __init__(self) -> None:
        self.points: list[HoldPoint] = []
        self.finished: list[Any] = []
        self.snapshots: list[Any] = []

    def at(self, when: Callable[[Any, Any], bool]) -> HoldPoint:
        point = HoldPoint(when)
        self.points.append(point)
        return point

    def release_all(self) -> None:
        for p in self.points:
            p.released.set()

    def on_step(self, step, outputs, finished, snapshot) -> None:
        self.finished.extend(finished)
        self.snapshots.append(snapshot)
        for p in list(self.points):
            if not p.reached.is_set() and p.when(outputs, snapshot):
                p.reached.set()
                p.released.wait(WAIT)


def output_of(rid: str, min_tokens: int) -> Callable[[Any, Any], bool]:
    """A hold condition: a step produced ``rid``'s ``min_tokens``-th token (still running)."""
    return lambda outputs, _: any(o.request_id == rid and not o.finished
                                  and len(o.token_ids) >= min_tokens for o in outputs)


@dataclasses.dataclass
class Pair:
    decode: DecodeSide
    prefill: PrefillSide
    d: AsyncEngine  # the decode engine
    p: AsyncEngine  # the prefill engine


@contextlib.asynccontextmanager
async def pair(path, *, decode_kw=None, prefill_kw=None, faults=None, hold=None):
    """Both sides, the prefill worker connected; everything stopped (and every held thread
    let go) on the way out."""
    d = AsyncEngine(LLMEngine(EngineConfig(model=str(path), **(decode_kw or {}))))
    if hold is not None:
        d.add_observer(hold)
    p = AsyncEngine(LLMEngine(EngineConfig(model=str(path), **(prefill_kw or {}))))
    d.start()
    decode = DecodeSide(d, secret=SECRET)
    prefill = None
    try:
        prefill = PrefillSide(p, decode.endpoint, secret=SECRET, frame_hook=faults,
                              heartbeat_interval=0.2)
        prefill.start()  # on a loop of its own, on a thread
        await until(lambda: decode.num_live_peers == 1, "the prefill worker never connected")
        yield Pair(decode, prefill, d, p)
    finally:
        if isinstance(faults, Valve):
            faults.open()
        if hold is not None:
            hold.release_all()
        if prefill is not None:
            prefill.close()
        decode.close()
        await asyncio.to_thread(d.shutdown)


async def settle(d: AsyncEngine, tag: str) -> None:
    """Run a one-token local request through the decode engine: its answer comes after every
    command queued before it (K/V to load included) was handled."""
    await asyncio.wait_for(collect(await d.add([PromptSpec([3], greedy(1))], f"settle-{tag}")),
                           WAIT)


async def all_clear(s: Pair) -> None:
    """Wait until neither side holds a request, then check both pools are empty."""
    de, pe = s.d.engine, s.p.engine
    await until(lambda: not (de.requests or pe.requests or s.decode.num_attempts
                             or s.d.num_open_groups or s.p.num_open_groups),
                f"requests left behind: decode {sorted(de.requests)}, prefill "
                f"{sorted(pe.requests)}, attempts {s.decode.num_attempts}")
    assert s.decode.server.gate.pending() == []
    for eng in (de, pe):
        assert not (eng.scheduler.remote or eng.scheduler.waiting or eng.scheduler.running)
    # every block free again (blocks only the prefix cache remembers count as free)
    await until(lambda: de.kv.num_free_blocks == de.kv.num_blocks
                and pe.kv.num_free_blocks == pe.kv.num_blocks, "a KV pool is not empty")
    assert de.kv.usage == 0 and pe.kv.usage == 0


def serve(path, prompts, *, faults, prefill_kw=None, decode_kw=None):
    """Serve ``prompts`` through both sides; (outputs, /metrics of the decode side, the
    decode side's server counters, decode engine, remote outcomes)."""
    async def main():
        async with pair(path, decode_kw=decode_kw, prefill_kw=prefill_kw,
                        faults=faults) as s:
            groups = [await s.decode.add([PromptSpec(p, GREEDY)], f"r{i}")
                      for i, p in enumerate(prompts)]
            outs = [(await asyncio.wait_for(collect(g), WAIT))[0].token_ids for g in groups]
            await all_clear(s)
            return outs, exported(s.decode), s.decode.server.counters(), s.d

    outs, metrics, counters, d = asyncio.run(main())
    return outs, metrics, counters, d.engine, dict(d.remote_outcomes)


FRAMES = "phasewise:kv_frames_total"
OUTCOMES = "phasewise:remote_prefills_total"
REFUSED = "phasewise:kv_peers_refused_total"
STRANGERS = "phasewise:kv_unauthenticated_messages_total"


# --------------------------------------------------------------------------------------------
# 1. frames delayed, duplicated, corrupted, dropped


def test_duplicated_frames_are_counted_and_change_nothing(llama_dir):
    """Frames 0 and 2 of three go out twice: each second copy is refused as a duplicate and
    counted; the request decodes on from the remote K/V with the co-located output."""
    faults = FaultInjector({0: "duplicate", 2: "duplicate"})
    outs, metrics, counters, eng, outcomes = serve(llama_dir, [PROMPT], faults=faults,
                                                   prefill_kw=CHUNKED, decode_kw=CHUNKED)
    assert outs == [colocated(llama_dir, PROMPT, **CHUNKED)[0]]
    assert faults.applied["duplicate"] == 2
    assert metrics[(FRAMES, "duplicate")] == 2 == counters["frames.duplicate"]
    assert metrics[(FRAMES, "ok")] == 3
    assert outcomes == {"done": 1} and metrics[(OUTCOMES, "done")] == 1
    assert prefill_tokens(eng) == 0  # nothing of the prompt was computed on the decode side


@pytest.mark.parametrize("prefill_kw, plan", [
    # three frames: frame 0 goes out after frame 1, frame 2 only when the attempt is done
    (CHUNKED, {0: Fault("delay", 1), 2: Fault("delay", 5)}),
    # one frame (the whole prompt in one step), held until the attempt is done
    ({}, {0: Fault("delay", 5)}),
], ids=["reordered-and-held", "single-frame-held"])
def test_delayed_frames_still_land(llama_dir, prefill_kw, plan):
    """A delayed frame lands late (out of order, or just before Done): it is admitted (no
    frame refused), the remote prefill is "done", not computed on the decode side, and the
    output is the co-located one."""
    faults = FaultInjector(plan)
    outs, metrics, counters, eng, outcomes = serve(llama_dir, [PROMPT], faults=faults,
                                                   prefill_kw=prefill_kw, decode_kw=prefill_kw)
    assert outs == [colocated(llama_dir, PROMPT, **prefill_kw)[0]]
    assert faults.applied["delay"] == len(plan)
    num_frames = 3 if prefill_kw else 1
    assert metrics[(FRAMES, "ok")] == num_frames == counters["frames.ok"]
    assert sum(v for (name, o), v in metrics.items() if name == FRAMES and o != "ok") == 0
    assert outcomes == {"done": 1} and metrics[(OUTCOMES, "incomplete")] == 0
    assert prefill_tokens(eng) == 0


def test_corrupted_and_dropped_frames_are_counted(llama_dir):
    """test_disagg_worker checks these are recomputed; here, that /metrics counts them: a
    corrupted frame as a checksum failure, a dropped one as missing, and each fallback as an
    incomplete remote prefill that the decode side computed."""
    faults = FaultInjector({1: "corrupt"})
    outs, metrics, counters, eng, outcomes = serve(llama_dir, [PROMPT], faults=faults,
                                                   prefill_kw=CHUNKED, decode_kw=CHUNKED)
    assert outs == [colocated(llama_dir, PROMPT, **CHUNKED)[0]]
    assert faults.applied["corrupt"] == 1
    assert metrics[(FRAMES, "checksum")] == 1 == counters["frame_errors.checksum"]
    assert metrics[(FRAMES, "ok")] == 2
    assert outcomes == {"incomplete": 1} and metrics[(OUTCOMES, "incomplete")] == 1
    assert prefill_tokens(eng) == len(PROMPT) - 16  # block 0 kept, the rest computed here

    faults = FaultInjector({1: "drop"})
    outs, metrics, counters, eng, outcomes = serve(llama_dir, [PROMPT], faults=faults,
                                                   prefill_kw=CHUNKED, decode_kw=CHUNKED)
    assert outs == [colocated(llama_dir, PROMPT, **CHUNKED)[0]]
    assert faults.applied["drop"] == 1
    assert metrics[(FRAMES, "ok")] == 2
    # The one dropped frame: the prefill worker's Done counted it, it never landed.
    assert metrics[(FRAMES, "missing")] == 1
    assert sum(v for (name, o), v in metrics.items()
               if name == FRAMES and o not in ("ok", "missing")) == 0
    assert outcomes == {"incomplete": 1} and metrics[(OUTCOMES, "incomplete")] == 1
    assert prefill_tokens(eng) == len(PROMPT) - 16


# --------------------------------------------------------------------------------------------
# 2. rogue peers during a remote prefill


def rogue_frames(layout: KVLayout, rid: str, epoch: int = 1) -> list[list[bytes]]:
    """Well-formed K/V frames (valid checksums) for all of PROMPT's blocks, full of 7.25."""
    frames = []
    for b in range(3):
        n = min(16, len(PROMPT) - 16 * b)
        kw = dict(request_id=rid, epoch=epoch, seq=b, first_block=b, num_blocks=1,
                  first_token=16 * b, num_tokens=n, layer_start=0,
                  layer_end=layout.num_layers, dtype=layout.dtype)
        shape = (layout.num_layers, 2, 1, layout.block_size, layout.num_kv_heads,
                 layout.head_dim)
        payload = kv_to_bytes(torch.full(shape, 7.25))
        frames.append([bytes(p) for p in encode_kv_frame(payload=payload, **kw)])
    return frames


def test_rogue_peers_are_refused_and_leave_the_request_untouched(llama_dir):
    """While the victim's remote prefill is held after its first frame landed, peers try to
    write its blocks: one without CURVE and one with the CURVE keys of a wrong secret (both
    refused by zmq's security handshake: no message of theirs is taken), two through CURVE
    that sign their hello with a wrong key (one with the right layout, one with a wrong
    layout, told only "auth"), and one holding the key whose frames are not bound to the
    attempt (foreign). Each is refused and counted;
    the victim's blocks are byte-identical before and after, it decodes on from the real
    worker's K/V, and its prompt K/V and output equal the co-located engine's."""
    valve = Valve(hold_at=1)
    want_out, want_kv = colocated(llama_dir, PROMPT, **CHUNKED)

    async def main():
        async with pair(llama_dir, prefill_kw=CHUNKED, decode_kw=CHUNKED,
                        faults=valve) as s:
            group = await s.decode.add([PromptSpec(PROMPT, GREEDY)], "victim")
            await reached(valve.reached, "the prefill worker never got to frame 1")
            await until(lambda: s.decode.server.counters().get("frames.ok") == 1,
                        "frame 0 never landed")
            await settle(s.d, "before")
            de = s.d.engine
            table = de.kv.block_table("victim")
            assert len(table) == 3
            before = de.runner.read_blocks(table)
            # block 0 holds the real worker's K/V for tokens 0..15
            assert torch.equal(prompt_kv(de, table[:1], 16), want_kv[:, :, :16])
            frames = rogue_frames(s.decode.layout, "victim")
            assert not torch.equal(before[:, :, 1:], torch.full_like(before[:, :, 1:], 7.25))
            base = s.decode.server.counters()

            ctx = zmq.Context()
            socks = []  # each stays referenced: a collected socket drops what it queued
            try:
                def dealer(secret):
                    """Through zmq's security handshake with the keys of ``secret`` (None: no
                    CURVE); sends give up rather than wait for a connection zmq refused."""
                    sock = ctx.socket(zmq.DEALER)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.setsockopt(zmq.SNDTIMEO, 1000)
                    if secret is not None:
                        sk = z85.encode(curve_secret_key(secret, "client"))
                        server = z85.encode(curve_secret_key(secret, "server"))
                        sock.setsockopt(zmq.CURVE_SERVERKEY, zmq.curve_public(server))
                        sock.setsockopt(zmq.CURVE_PUBLICKEY, zmq.curve_public(sk))
                        sock.setsockopt(zmq.CURVE_SECRETKEY, sk)
                    sock.connect(s.decode.endpoint)
                    socks.append(sock)
                    return sock

                def reply(sock):
                    assert sock.poll(int(WAIT * 1000)), "the decode worker did not answer"
                    return decode_message(sock.recv())

                # (a) no CURVE, and CURVE with a wrong secret's keys: frames and a first
                # token, straight away; zmq takes none of them
                for secret in (None, WRONG):
                    raw = dealer(secret)
                    with contextlib.suppress(zmq.Again):
                        for f in frames:
                            raw.send_multipart(f)
                        raw.send(encode_message(FirstToken("victim", 1, 5)))
                sent_unauth = 0

                # (b) the right layout (so the right compatibility hash), a wrong key;
                # (c) a wrong key and a wrong layout: refused for the key, nothing else said
                other = dataclasses.replace(s.decode.layout, block_size=32)
                for layout in (s.decode.layout, other):
                    sock = dealer(SECRET)
                    sock.send(encode_message(Open(identity="rogue" + "0" * 27)))
                    ch = reply(sock)
                    assert isinstance(ch, Challenge)
                    hello = make_hello(ch, secret=WRONG, identity="rogue" + "1" * 27,
                                       role="prefill", layout=layout, name="rogue")
                    sock.send(encode_message(hello))
                    refused = reply(sock)
                    assert isinstance(refused, Refuse) and refused.field == "auth"
                    if layout is s.decode.layout:  # refused, it sends anyway
                        for f in frames:
                            sock.send_multipart(f)
                        sock.send(encode_message(FirstToken("victim", 1, 5)))
                        sock.send(encode_message(Error("victim", 1, "RuntimeError")))
                        sent_unauth += len(frames) + 2

                # (d) holds the key and the layout, but the attempt is bound to the real
                # prefill worker: its frames are foreign, and so are its first token and error
                holder = KVClient(s.decode.endpoint, secret=SECRET, layout=s.decode.layout,
                                  name="key-holder", heartbeat_interval=0.2)
                try:
                    payload = frames[0][1]
                    for b in range(3):
                        n = min(16, len(PROMPT) - 16 * b)
                        holder.send_kv("victim", 1, first_block=b, num_blocks=1,
                                       first_token=16 * b, num_tokens=n, layer_start=0,
                                       layer_end=s.decode.layout.num_layers, payload=payload)
                    holder.send(FirstToken("victim", 1, 5))
                    holder.send(Error("victim", 1, "RuntimeError", "rogue"))

                    def delta(key):
                        return s.decode.server.counters().get(key, 0) - base.get(key, 0)

                    await until(lambda: delta("unauthenticated") == sent_unauth
                                and delta("unauthenticated.curve") >= 2
                                and delta("refused.auth") == 2
                                and delta("frames.foreign") == 3
                                and delta("messages.foreign") == 2,
                                f"rogue messages not all counted: {s.decode.server.counters()}")
                    await settle(s.d, "after")
                    after = de.runner.read_blocks(table)
                    assert torch.equal(before, after), "a rogue peer changed the victim's K/V"
                    for key in ("frames.ok", "frames.duplicate", "frames.stale",
                                "messages.ok"):
                        assert delta(key) == 0, key
                    m = exported(s.decode)
                    assert m[(REFUSED, "auth")] == 2 and m[(FRAMES, "foreign")] == 3
                    assert m[(FRAMES, "unauthenticated")] == sent_unauth > 0
                    assert sum(v for (name, r), v in m.items()
                               if name == STRANGERS and r != "curve") == sent_unauth
                    assert m[(STRANGERS, "curve")] >= 2  # connections, not messages
                    # the victim is still waiting for the real worker, which is still alive
                    assert s.decode.num_attempts == 1 and "victim" in de.scheduler.remote
                    assert s.d.remote_outcomes == {}
                finally:
                    holder.close()
            finally:
                ctx.destroy(linger=0)

            valve.open()
            outs = await asyncio.wait_for(collect(group), WAIT)
            assert outs[0].token_ids == want_out
            assert s.d.remote_outcomes == {"done": 1}  # decoded on from the remote K/V
            # the prompt's K/V in the victim's blocks (freed, not reused since) is the
            # co-located engine's
            assert torch.equal(prompt_kv(de, table, len(PROMPT)), want_kv)
            await all_clear(s)

    asyncio.run(main())


# --------------------------------------------------------------------------------------------
# 3. a client abort in each phase


def test_abort_while_queued_on_the_decode_side(llama_dir):
    """The decode engine has one seat, taken by a decoding request: the next request queues
    there (no blocks reserved, never sent to the prefill worker). Its client goes away while
    it waits; the first request goes on to the co-located output, and nothing is left."""
    hold = Hold()
    decoding = hold.at(output_of("first", 2))
    queued = hold.at(lambda _, snap: snap.num_waiting >= 1)
    long = greedy(48)

    async def main():
        async with pair(llama_dir, decode_kw={"max_num_seqs": 1}, hold=hold) as s:
            first = await s.decode.add([PromptSpec(PROMPT, long)], "first")
            await reached(decoding.reached, "the first request never decoded")
            # the decode engine is held after a decode step of "first": queue "second"
            add = asyncio.ensure_future(s.decode.add([PromptSpec(PROMPT[2:], long)],
                                                     "second"))
            for _ in range(5):  # let the add reach the engine's command queue
                await asyncio.sleep(0)
            decoding.released.set()
            await reached(queued.reached, "the second request never queued")
            second = await asyncio.wait_for(add, WAIT)
            de = s.d.engine  # held: its state stands still
            assert second.remote_hits == [None]  # no room to reserve: it waits here
            assert de.requests["second"].status is RequestStatus.WAITING
            assert [r.request_id for r in de.scheduler.running] == ["first"]
            assert de.kv.block_table("second") == [] and s.decode.num_attempts == 0
            assert "second" not in s.p.engine.requests
            second.close()  # the client hangs up while queued
            queued.released.set()
            await until(lambda: "second" not in de.requests, "the queued request stayed")
            outs = await asyncio.wait_for(collect(first), WAIT)
            assert outs[0].token_ids == colocated(llama_dir, PROMPT, long)[0]
            await all_clear(s)
            ends = {f.request_id: f for f in hold.finished}
            assert ends["second"].finish_reason == "abort"
            assert ends["second"].num_output_tokens == 0
            # the prefill worker only ever saw the first request
            assert s.decode.server.counters()["frames.ok"] == 1

    asyncio.run(main())


@pytest.mark.parametrize("phase, hold_at", [("prefilling", 0), ("transferring", 1)])
def test_abort_during_a_remote_prefill(llama_dir, phase, hold_at):
    """The prefill worker computes the prompt in three 16-token steps, one frame each.
    prefilling: the client goes away after its first chunk was computed but before any frame
    was sent; transferring: after frame 0 landed on the decode side, before frame 1 left.
    The decode side frees the reservation and tells the prefill worker, which stops before
    its next chunk; the frame it was sending is refused as foreign. Nothing is left."""
    valve = Valve(hold_at=hold_at)

    async def main():
        async with pair(llama_dir, prefill_kw=CHUNKED, faults=valve) as s:
            group = await s.decode.add([PromptSpec(PROMPT, greedy(64))], "a")
            await reached(valve.reached, f"the prefill worker never got to frame {hold_at}")
            await until(lambda: s.decode.server.counters().get("frames.ok", 0) == hold_at,
                        f"{hold_at} frame(s) should have landed")
            assert "a" in s.d.engine.scheduler.remote and s.decode.num_attempts == 1
            group.close()  # the client hangs up
            # the prefill worker has heard and closed its group: its engine aborts the
            # request before its next step
            await until(lambda: s.p.num_open_groups == 0, "the prefill worker never stopped")
            valve.open()
            await until(lambda: s.decode.server.counters().get("frames.foreign", 0) == 1,
                        "the frame in flight was not refused as foreign")
            await all_clear(s)
            counters = s.decode.server.counters()
            assert counters.get("frames.ok", 0) == hold_at
            assert valve.seen == [("a", i) for i in range(hold_at + 1)]
            assert prefill_tokens(s.p.engine) == 16 * (hold_at + 1)  # stopped early
            assert prefill_tokens(s.d.engine) == 0  # and nothing was computed here instead
            assert s.d.remote_outcomes == {}  # an abort is no fallback

    asyncio.run(main())


def test_abort_while_decoding(llama_dir):
    """The first token came back and the request decodes on the decode side: the client goes
    away mid-stream. The request ends as aborted and neither pool keeps a block."""
    hold = Hold()
    decoding = hold.at(output_of("d", 3))
    params = greedy(200)

    async def main():
        async with pair(llama_dir, hold=hold) as s:
            group = await s.decode.add([PromptSpec(PROMPT, params)], "d")
            _, first = await asyncio.wait_for(group.__anext__(), WAIT)
            assert len(first.token_ids) == 1 and not first.finished
            await reached(decoding.reached, "the request never decoded")
            de = s.d.engine  # held after a decode step
            req = de.requests["d"]
            assert req.status is RequestStatus.RUNNING and req.num_output_tokens == 3
            assert de.kv.usage > 0
            group.close()  # the client hangs up
            decoding.released.set()
            await all_clear(s)
            ends = {f.request_id: f for f in hold.finished}
            assert ends["d"].finish_reason == "abort"
            assert ends["d"].num_output_tokens == 3 < params.max_tokens
            assert s.d.remote_outcomes == {"done": 1}

    asyncio.run(main())


def test_a_request_waiting_for_remote_kv_keeps_its_seat(llama_dir):
    """max_num_seqs=1: the first request holds the seat while its prefill worker is held, so
    the second is not reserved (it queues to prefill here). It must wait for the seat: at no
    point may the decode engine hold more than one sequence (admission once ignored the
    requests waiting for remote K/V and ran both). Both outputs are co-located."""
    valve = Valve(hold_at=0)
    hold = Hold()
    seats = lambda snap: snap.num_running + snap.num_waiting_remote  # noqa: E731
    waits = []

    def decided(_, snap) -> bool:  # the second either took a seat, or waited three times
        waits.append(snap.num_waiting >= 1 and snap.num_waiting_remote == 1)
        return seats(snap) >= 2 or sum(waits) >= 3

    point = hold.at(decided)

    async def main():
        async with pair(llama_dir, decode_kw={"max_num_seqs": 1}, faults=valve,
                        hold=hold) as s:
            first = await s.decode.add([PromptSpec(PROMPT, GREEDY)], "first")
            await reached(valve.reached, "the prefill worker never got the first request")
            second = await s.decode.add([PromptSpec(PROMPT[2:], GREEDY)], "second")
            assert second.remote_hits == [None]
            await reached(point.reached, "the second request neither ran nor waited")
            # While the seat stays held, the decode engine waits for a command instead of
            # spinning on empty steps (it would make thousands in the half second below).
            engine, calls = s.d.engine, []
            real_step = engine.step
            engine.step = lambda: calls.append(1) or real_step()
            point.released.set()
            await asyncio.sleep(0.5)
            valve.open()
            outs = [(await asyncio.wait_for(collect(g), WAIT))[0].token_ids
                    for g in (first, second)]
            assert outs == [colocated(llama_dir, PROMPT)[0], colocated(llama_dir, PROMPT[2:])[0]]
            await all_clear(s)
            assert max(seats(snap) for snap in hold.snapshots) <= 1
            assert len(calls) < 50, len(calls)

    asyncio.run(main())
