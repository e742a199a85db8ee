"""The KV transport over real pyzmq sockets on 127.0.0.1 (free ports only).

Faults are injected deterministically (a plan keyed by frame seq); every wait is bounded and
generous, and no assertion is about how long anything took.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import socket
import threading
import time

import pytest
import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from faults import FAULT_KINDS, Fault, FaultInjector
from phasewise.disagg import transport as t
from phasewise.disagg import wire as w

LAYOUT = w.KVLayout(model_id="LlamaForCausalLM:abc123", dtype="float32", num_layers=2,
                    num_kv_heads=2, head_dim=4, block_size=4)
SECRET = os.urandom(32)
BLOCK = LAYOUT.block_layer_bytes() * LAYOUT.num_layers  # bytes of one block, all layers
WAIT = 10.0  # generous bound on any wait; never an assertion about duration

OTHER = {"model_id": "LlamaForCausalLM:def456", "dtype": "bfloat16", "num_layers": 3,
         "num_kv_heads": 4, "head_dim": 8, "block_size": 16,
         "cache_layout": "kv,layers,blocks,block_size,kv_heads,head_dim",
         "block_hash_scheme": "sha256/int64le"}


def _kv_threads():
    return [th for th in threading.enumerate() if th.name.startswith("phasewise-kv-")]


@pytest.fixture(autouse=True)
def no_leaked_threads():
    assert _kv_threads() == []
    yield
    assert _kv_threads() == [], "an endpoint was not closed"


@pytest.fixture
def server():
    with t.KVServer("tcp://127.0.0.1:0", secret=SECRET, layout=LAYOUT,
                    heartbeat_deadline=60.0) as srv:
        yield srv


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _client(srv, **kw):
    kw.setdefault("secret", SECRET)
    kw.setdefault("layout", LAYOUT)
    kw.setdefault("heartbeat_interval", 30.0)
    return t.KVClient(srv.endpoint, **kw)


def _wait(pred, timeout=WAIT):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.005)
    return pred()


def _events_until(srv, pred, timeout=WAIT):
    """Every event up to and including the first that satisfies ``pred``."""
    out = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ev = srv.next_event(timeout=0.05)
        if ev is None:
            continue
        out.append(ev)
        if pred(ev):
            return out
    raise AssertionError(f"no matching event within {timeout}s; got {out}")


def _is_done(ev):
    return isinstance(ev, t.MessageEvent) and isinstance(ev.message, w.Done)


def _accepted(srv, client):
    _events_until(srv, lambda e: isinstance(e, t.PeerEvent) and e.peer == client.identity
                  and e.state == "accepted")


def _request(rid="r1", epoch=1, num_blocks=4, first_block=0):
    return w.PrefillRequest(request_id=rid, epoch=epoch, token_ids=tuple(range(4 * num_blocks)),
                            params={"temperature": 0.0}, num_blocks=num_blocks,
                            first_block=first_block)


def _send_block(client, block, rid="r1", epoch=1, payload=None):
    return client.send_kv(rid, epoch, first_block=block, num_blocks=1, first_token=4 * block,
                          num_tokens=4, layer_start=0, layer_end=2,
                          payload=os.urandom(BLOCK) if payload is None else payload)


# ---- raw sockets, to play a misbehaving peer


def _keys(secret, side):
    """(public, secret) Z85 CURVE keys of ``side``, derived as the protocol says: the secret
    key is HMAC-SHA256(secret, "phasewise kv curve <side>")."""
    raw = hmac.new(secret, b"phasewise kv curve " + side.encode(), hashlib.sha256).digest()
    assert raw == w.curve_secret_key(secret, side)
    sk = z85.encode(raw)
    return zmq.curve_public(sk), sk


def _raw(ctx, endpoint, secret=SECRET):
    """A DEALER that gets through the security handshake with the keys of ``secret`` (the
    port's own, unless told otherwise; None: no CURVE at all) and then does as told."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if secret is not None:
        s.setsockopt(zmq.CURVE_SERVERKEY, _keys(secret, "server")[0])
        s.setsockopt(zmq.CURVE_PUBLICKEY, _keys(secret, "client")[0])
        s.setsockopt(zmq.CURVE_SECRETKEY, _keys(secret, "client")[1])
    s.connect(endpoint)
    return s


def _curve_router(ctx, secret=SECRET):
    """A ROUTER that speaks CURVE as a K/V port of ``secret`` would (no ZAP handler: it takes
    any client key), to play a server."""
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.CURVE_SERVER, 1)
    s.setsockopt(zmq.CURVE_SECRETKEY, _keys(secret, "server")[1])
    return s


def _recv(sock):
    assert sock.poll(int(WAIT * 1000)), "no reply"
    return w.decode_message(sock.recv())


def _raw_handshake(sock, identity="raw-peer", secret=SECRET):
    sock.send(w.encode_message(w.Open(identity=identity)))
    ch = _recv(sock)
    hello = w.make_hello(ch, secret=secret, identity=identity, role="prefill", layout=LAYOUT)
    sock.send(w.encode_message(hello))
    return ch, hello, _recv(sock)


# ---- handshake


def test_handshake_then_messages_flow_both_ways(server):
    with _client(server, name="prefill-0") as c:
        _accepted(server, c)
        assert c.server_identity == server.identity
        info = server.peers()[c.identity]
        assert (info.name, info.role, info.state) == ("prefill-0", "prefill", "alive")
        req = _request()
        server.request_prefill(c.identity, req)
        assert c.recv(timeout=WAIT) == req
        c.send(w.FirstToken(request_id="r1", epoch=1, token_id=7, logprobs={"7": -0.5}))
        (ev,) = _events_until(server, lambda e: isinstance(e, t.MessageEvent))
        assert ev.outcome == "ok" and ev.peer == c.identity
        assert ev.message == w.FirstToken(request_id="r1", epoch=1, token_id=7,
                                          logprobs={"7": -0.5})


@pytest.mark.parametrize("mode", ["queue", "callback"])
def test_frames_round_trip_with_payload_intact(mode):
    landed = {}

    def on_frame(peer, header, payload):
        assert header.num_blocks == 2
        landed[header.first_block] = bytes(payload)

    with t.KVServer(secret=SECRET, layout=LAYOUT,
                    on_frame=on_frame if mode == "callback" else None) as srv:
        with _client(srv) as c:
            srv.request_prefill(c.identity, _request(num_blocks=4))
            sent = {b: os.urandom(2 * BLOCK) for b in (0, 2)}
            for b, data in sent.items():
                c.send_kv("r1", 1, first_block=b, num_blocks=2, first_token=4 * b,
                          num_tokens=8 if b == 0 else 5, layer_start=0, layer_end=2,
                          payload=data)
            assert c.send_done("r1", 1) == 2
            events = _events_until(srv, _is_done)
        frames = [e for e in events if isinstance(e, t.FrameEvent)]
        assert [f.outcome for f in frames] == ["ok", "ok"]
        if mode == "queue":
            landed = {f.header.first_block: bytes(f.payload) for f in frames}
        else:
            assert all(f.payload is None for f in frames)
        assert landed == sent
        assert srv.gate.complete("r1") and srv.gate.missing_seqs("r1") == []
        assert srv.counters()["frames.ok"] == 2


class _Tap:
    """A TCP relay in front of a K/V port that keeps every byte the client sends."""

    def __init__(self, endpoint):
        self.target = endpoint[len("tcp://"):].rsplit(":", 1)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.seen = bytearray()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        try:
            down, _ = self.listener.accept()
        except OSError:
            return
        up = socket.create_connection((self.target[0], int(self.target[1])))
        back = threading.Thread(target=self._pump, args=(up, down, None), daemon=True)
        back.start()
        self._pump(down, up, self.seen)
        back.join(WAIT)
        down.close()
        up.close()

    @staticmethod
    def _pump(src, dst, keep):
        try:
            while data := src.recv(1 << 16):
                if keep is not None:
                    keep += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(2)

    def close(self):
        self.listener.close()
        self._thread.join(WAIT)


def test_k_v_frames_cross_the_wire_encrypted_in_parts(server):
    """A frame several message parts long lands intact, and neither its payload nor its
    header's request id is to be seen on the wire."""
    marker = b"plain K/V bytes!"
    nblocks = w.KV_PART_BYTES * 5 // 2 // BLOCK  # two and a half parts
    payload = marker * (nblocks * BLOCK // len(marker))
    assert len(payload) == nblocks * BLOCK
    tap = _Tap(server.endpoint)
    try:
        with t.KVClient(tap.endpoint, secret=SECRET, layout=LAYOUT,
                        heartbeat_interval=30.0) as c:
            server.gate.expect("request-in-clear?", 1, nblocks, peer=c.identity)
            c.send_kv("request-in-clear?", 1, first_block=0, num_blocks=nblocks,
                      first_token=0, num_tokens=4 * nblocks, layer_start=0, layer_end=2,
                      payload=payload)
            frame = _events_until(server, lambda e: isinstance(e, t.FrameEvent))[-1]
            assert frame.outcome == "ok" and bytes(frame.payload) == payload
    finally:
        tap.close()
    assert len(tap.seen) > len(payload)
    assert marker not in tap.seen and b"request-in-clear?" not in tap.seen


def test_rogue_peer_without_the_key_is_refused_and_lands_nothing(server, ctx, caplog):
    caplog.set_level(logging.WARNING, logger="phasewise.disagg.transport")
    server.gate.expect("r1", 1, 4)
    with pytest.raises(w.HandshakeError) as e:
        _client(server, secret=os.urandom(32), identity="rogue-1")
    assert e.value.field == "security"
    assert "secret" in e.value.reason and "version" in e.value.reason
    assert _wait(lambda: server.counters().get("unauthenticated.curve", 0) >= 1)
    assert _wait(lambda: [r for r in caplog.records if "CURVE" in r.getMessage()])
    lines = [r.getMessage() for r in caplog.records if "CURVE" in r.getMessage()]
    assert len(lines) == 1 and "secret" in lines[0]

    # Under it, the port's own handshake still checks the secret: a peer through CURVE (the
    # keys of this secret) signing its hello with another, then pushing frames anyway.
    rogue = _raw(ctx, server.endpoint)
    ch, hello, reply = _raw_handshake(rogue, identity="rogue-2", secret=os.urandom(32))
    assert isinstance(reply, w.Refuse) and reply.field == "auth"
    lines = [r.getMessage() for r in caplog.records if "rogue-2" in r.getMessage()]
    assert len(lines) == 1 and "auth" in lines[0]
    for b in range(4):
        rogue.send_multipart(w.encode_kv_frame(
            request_id="r1", epoch=1, seq=b, first_block=b, num_blocks=1, first_token=4 * b,
            num_tokens=4, layer_start=0, layer_end=2, dtype="float32",
            payload=os.urandom(BLOCK)))
    rogue.send(w.encode_message(w.Done(request_id="r1", epoch=1, num_frames=4)))
    assert _wait(lambda: server.counters().get("unauthenticated", 0) == 5)
    c = server.counters()
    assert c["refused.auth"] == 1 and c["frames.ok"] == 0
    assert server.gate.missing_blocks("r1") == [0, 1, 2, 3]
    assert server.gate.missing_seqs("r1") is None
    assert not [e for e in iter(lambda: server.next_event(0), None)
                if not isinstance(e, t.PeerEvent)]
    assert server.peers() == {}


def test_a_replayed_hello_is_refused(server, ctx):
    a = _raw(ctx, server.endpoint)
    ch, hello, reply = _raw_handshake(a, identity="legit")
    assert isinstance(reply, w.Accept)
    w.verify_accept(reply, hello, ch, secret=SECRET)
    replay = w.encode_message(hello)
    # straight onto a new connection
    b = _raw(ctx, server.endpoint)
    b.send(replay)
    reply = _recv(b)
    assert isinstance(reply, w.Refuse) and reply.field == "nonce"
    # after asking for (and being given) a fresh challenge
    c = _raw(ctx, server.endpoint)
    c.send(w.encode_message(w.Open(identity="legit")))
    assert isinstance(_recv(c), w.Challenge)
    c.send(replay)
    reply = _recv(c)
    assert isinstance(reply, w.Refuse) and reply.field == "nonce"
    assert server.counters()["refused.nonce"] == 2
    assert server.counters()["peers.accepted"] == 1


def test_version_mismatch_is_refused(server):
    with pytest.raises(w.HandshakeError) as e:
        _client(server, protocol_version=w.PROTOCOL_VERSION + 1)
    assert e.value.field == "version"
    assert server.counters()["refused.version"] == 1 and server.peers() == {}


@pytest.mark.parametrize("name", sorted(OTHER))
def test_layout_mismatch_is_refused_at_connect_naming_the_field(server, name):
    theirs = dataclasses.replace(LAYOUT, **{name: OTHER[name]})
    with pytest.raises(w.HandshakeError) as e:
        _client(server, layout=theirs)
    assert e.value.field == f"layout.{name}"
    assert repr(OTHER[name]) in e.value.reason
    assert server.counters()[f"refused.layout.{name}"] == 1


def test_no_answer_is_a_handshake_timeout(ctx):
    silent = _curve_router(ctx)  # through the security handshake, then not a word
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    with pytest.raises(w.HandshakeError) as e:
        t.KVClient(f"tcp://127.0.0.1:{port}", secret=SECRET, layout=LAYOUT,
                   handshake_timeout=1.0)
    assert e.value.field == "timeout" and "challenge" in e.value.reason
    with socket.socket() as probe:  # a port nothing listens on (closed at once, unlike zmq's)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(w.HandshakeError) as e:
        t.KVClient(f"tcp://127.0.0.1:{port}", secret=SECRET, layout=LAYOUT,
                   handshake_timeout=0.2)
    assert e.value.field == "timeout"


def test_a_server_without_curve_fails_the_security_handshake_naming_the_causes(ctx):
    """A K/V port of protocol version 3 (no CURVE) and one of another secret: the client says
    the security handshake failed, and why that usually happens."""
    old = ctx.socket(zmq.ROUTER)
    old.setsockopt(zmq.LINGER, 0)
    other = _curve_router(ctx, secret=os.urandom(32))
    for sock in (old, other):
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        with pytest.raises(w.HandshakeError) as e:
            t.KVClient(f"tcp://127.0.0.1:{port}", secret=SECRET, layout=LAYOUT,
                       handshake_timeout=WAIT)
        # (which of mechanism mismatch or a closed connection it saw depends on which side
        # read the other's greeting first)
        assert e.value.field == "security"
        for words in ("security (CURVE) handshake", "secret",
                      "older or newer phasewise", f"version {w.PROTOCOL_VERSION}"):
            assert words in str(e.value)


def test_a_client_of_another_secret_is_refused_by_the_zap_handler(server, ctx):
    """The right server key (so the CURVE handshake reaches the ZAP handler) with a client key
    not derived from the secret: refused there, and counted."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    sk = z85.encode(os.urandom(32))
    s.setsockopt(zmq.CURVE_SERVERKEY, _keys(SECRET, "server")[0])
    s.setsockopt(zmq.CURVE_PUBLICKEY, zmq.curve_public(sk))
    s.setsockopt(zmq.CURVE_SECRETKEY, sk)
    mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    s.connect(server.endpoint)
    s.send(w.encode_message(w.Open(identity="stranger")))
    assert mon.poll(int(WAIT * 1000))
    ev = parse_monitor_message(mon.recv_multipart())
    assert ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH and ev["value"] == 400
    s.disable_monitor()
    mon.close()
    assert _wait(lambda: server.counters().get("unauthenticated.curve", 0) == 1)
    assert not s.poll(100) and server.counters().get("unauthenticated", 0) == 0


def test_client_refuses_a_server_that_cannot_prove_the_key(ctx):
    fake = _curve_router(ctx)  # the CURVE keys, but not the key the handshake signs with
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    result = {}

    def connect():
        try:
            t.KVClient(f"tcp://127.0.0.1:{port}", secret=SECRET, layout=LAYOUT)
        except w.HandshakeError as e:
            result["field"] = e.field

    th = threading.Thread(target=connect)
    th.start()
    assert fake.poll(int(WAIT * 1000))
    rid, _open = fake.recv_multipart()
    ch = w.make_challenge("impostor")
    fake.send_multipart([rid, w.encode_message(ch)])
    assert fake.poll(int(WAIT * 1000))
    rid, data = fake.recv_multipart()
    hello = w.decode_message(data)
    fake.send_multipart([rid, w.encode_message(w.make_accept(hello, ch, secret=os.urandom(32)))])
    th.join(WAIT)
    assert result == {"field": "auth"}


# ---- faults


def _run_with_faults(plan, num_blocks=4):
    applied = []

    def on_frame(peer, header, payload):
        applied.append(header.first_block)

    faults = FaultInjector(plan)
    with t.KVServer(secret=SECRET, layout=LAYOUT, on_frame=on_frame) as srv:
        with _client(srv, frame_hook=faults) as c:
            srv.request_prefill(c.identity, _request(num_blocks=num_blocks))
            for b in range(num_blocks):
                assert _send_block(c, b) == b
            c.send_done("r1", 1)
            events = _events_until(srv, _is_done)
        return srv, faults, applied, [e for e in events if isinstance(e, t.FrameEvent)]


def test_dropped_frame_leaves_the_transfer_incomplete_naming_the_seq():
    srv, faults, applied, frames = _run_with_faults({2: "drop"})
    assert faults.applied["drop"] == 1
    assert not srv.gate.complete("r1")
    assert srv.gate.missing_seqs("r1") == [2] and srv.gate.missing_blocks("r1") == [2]
    assert srv.gate.landed_prefix("r1") == 2  # blocks 0-1 usable, recompute from 2
    assert sorted(applied) == [0, 1, 3]


def test_duplicated_frame_is_counted_and_applied_once():
    srv, faults, applied, frames = _run_with_faults({1: "duplicate"})
    assert faults.applied["duplicate"] == 1
    assert [f.outcome for f in frames] == ["ok", "ok", "duplicate", "ok", "ok"]
    assert sorted(applied) == [0, 1, 2, 3]
    assert srv.counters()["frames.duplicate"] == 1 and srv.gate.complete("r1")


def test_corrupted_frame_fails_its_checksum():
    srv, faults, applied, frames = _run_with_faults({1: "corrupt"})
    assert faults.applied["corrupt"] == 1
    bad = [f for f in frames if f.outcome != "ok"]
    assert len(bad) == 1 and bad[0].outcome == "checksum" and bad[0].header.seq == 1
    assert srv.counters()["frame_errors.checksum"] == 1
    assert 1 not in applied and srv.gate.missing_seqs("r1") == [1]
    assert not srv.gate.complete("r1")


def test_delayed_frame_still_lands():
    srv, faults, applied, frames = _run_with_faults({0: Fault("delay", after=2)})
    assert faults.applied["delay"] == 1
    assert [f.header.seq for f in frames] == [1, 2, 0, 3]  # it really arrived late
    assert all(f.outcome == "ok" for f in frames)
    assert applied == [1, 2, 0, 3] and srv.gate.complete("r1")


def test_a_frame_delayed_past_the_last_is_flushed_before_done():
    srv, faults, applied, frames = _run_with_faults({3: Fault("delay", after=5)})
    assert [f.header.seq for f in frames] == [0, 1, 2, 3] and srv.gate.complete("r1")


def test_seeded_fault_plans_are_deterministic():
    rates = {"drop": 0.2, "duplicate": 0.2, "corrupt": 0.2, "delay": 0.2}
    a = FaultInjector.seeded(7, 50, rates).plan
    assert a == FaultInjector.seeded(7, 50, rates).plan
    assert a != FaultInjector.seeded(8, 50, rates).plan
    assert {f.kind for f in a.values()} == set(FAULT_KINDS)
    with pytest.raises(ValueError, match="rates"):
        FaultInjector.seeded(1, 5, {"drop": 0.9, "corrupt": 0.9})
    with pytest.raises(ValueError, match="kind"):
        Fault("explode")


# ---- attempts, peers, liveness


def test_stale_epoch_and_foreign_request_are_refused(server):
    with _client(server) as c:
        server.request_prefill(c.identity, _request(epoch=1))
        server.request_prefill(c.identity, _request(epoch=2))  # the retry
        _send_block(c, 0, epoch=1)
        _send_block(c, 0, rid="never-asked", epoch=2)
        _send_block(c, 0, epoch=2)
        c.send_done("r1", 1)
        events = _events_until(server, _is_done)
    frames = [e.outcome for e in events if isinstance(e, t.FrameEvent)]
    assert frames == ["stale", "foreign", "ok"]
    done = [e for e in events if _is_done(e)]
    assert done[0].outcome == "stale"
    assert server.gate.missing_seqs("r1") is None  # a stale Done says nothing
    c = server.counters()
    assert (c["frames.stale"], c["frames.foreign"], c["frames.ok"]) == (1, 1, 1)


def test_abort_reaches_the_client_and_later_frames_are_foreign(server):
    with _client(server) as c:
        server.request_prefill(c.identity, _request())
        assert isinstance(c.recv(timeout=WAIT), w.PrefillRequest)
        server.abort(c.identity, "r1", 1)
        assert c.recv(timeout=WAIT) == w.Abort(request_id="r1", epoch=1)
        _send_block(c, 0)
        c.send_done("r1", 1)
        events = _events_until(server, _is_done)
    assert [e.outcome for e in events if isinstance(e, t.FrameEvent)] == ["foreign"]


def test_a_restarted_peer_replaces_its_old_identity(server):
    with _client(server, name="prefill-0") as old:
        server.request_prefill(old.identity, _request())
        with _client(server, name="prefill-0") as new:
            assert new.identity != old.identity
            ev = _events_until(server, lambda e: isinstance(e, t.PeerEvent)
                               and e.state == "replaced")[-1]
            assert (ev.peer, ev.forgotten, ev.replaced_by) == \
                (old.identity, ("r1",), new.identity)
            assert server.peer_state(old.identity) == "replaced"
            with pytest.raises(KeyError):
                server.request_prefill(old.identity, _request(epoch=2))
            _send_block(old, 0)  # the old incarnation's attempt is gone
            old.send_done("r1", 1)
            first = _events_until(server, _is_done)
            server.request_prefill(new.identity, _request(epoch=2))
            _send_block(old, 0, epoch=2)  # bound to the new identity, not the old
            second = _events_until(server, lambda e: isinstance(e, t.FrameEvent))
            _send_block(new, 0, epoch=2)  # (two connections: wait, as they do not order)
            new.send_done("r1", 2)
            third = _events_until(server, _is_done)
    outcomes = [(e.peer, e.outcome) for e in first + second + third
                if isinstance(e, t.FrameEvent)]
    assert outcomes == [(old.identity, "foreign"), (old.identity, "foreign"),
                        (new.identity, "ok")]
    assert server.counters()["peers.replaced"] == 1


def test_a_silent_peer_is_reported_lost_and_back():
    faults = FaultInjector()
    with t.KVServer(secret=SECRET, layout=LAYOUT, heartbeat_deadline=1.0) as srv:
        with _client(srv, heartbeat_interval=0.05, frame_hook=faults) as c:
            _accepted(srv, c)
            faults.mute_heartbeats()
            _events_until(srv, lambda e: isinstance(e, t.PeerEvent) and e.state == "lost")
            assert srv.peer_state(c.identity) == "lost"
            faults.unmute_heartbeats()
            _events_until(srv, lambda e: isinstance(e, t.PeerEvent) and e.state == "alive")
            assert srv.peer_state(c.identity) == "alive"
        assert srv.counters()["peers.lost"] >= 1 and srv.counters()["heartbeats"] >= 1


def test_close_says_bye_and_leaves_nothing_running(server):
    c = _client(server)
    _accepted(server, c)
    c.close()
    c.close()  # idempotent
    _events_until(server, lambda e: isinstance(e, t.PeerEvent) and e.state == "closed")
    assert server.peer_state(c.identity) == "closed"
    with pytest.raises(KeyError):
        server.send(c.identity, w.Abort(request_id="r1", epoch=1))
    with pytest.raises(RuntimeError, match="closed"):
        c.send(w.Abort(request_id="r1", epoch=1))


def test_garbage_after_the_handshake_is_counted_not_fatal(server, ctx):
    s = _raw(ctx, server.endpoint)
    _ch, _hello, reply = _raw_handshake(s)
    assert isinstance(reply, w.Accept)
    s.send(b"{not json")
    s.send_multipart([b"a", b"b", b"c"])
    s.send_multipart([b'{"kind":"kv_frame"}', b"payload"])
    s.send(w.encode_message(w.Hello(**{**dataclasses.asdict(_hello), "layout": LAYOUT})))
    assert _wait(lambda: server.counters().get("messages.unexpected", 0) == 1)
    c = server.counters()
    assert c["messages.malformed"] == 1 and c["frame_errors.malformed"] == 2
    with _client(server) as ok:  # the port still works
        _accepted(server, ok)


def test_the_server_answers_heartbeats_so_a_client_sees_it_go_silent():
    """A live server answers every heartbeat (and the answers never reach ``recv``); once it
    is gone the client's ``silent_for`` only grows."""
    srv = t.KVServer(secret=SECRET, layout=LAYOUT)
    try:
        with _client(srv, heartbeat_interval=0.05) as c:
            _accepted(srv, c)
            beats = srv.counters().get("heartbeats", 0)
            deadline = time.monotonic() + WAIT
            while srv.counters().get("heartbeats", 0) < beats + 3:  # answered three more
                assert time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(1.0)  # 20 heartbeats' worth: without answers, silent since the handshake
            assert c.silent_for < 0.8
            assert c.recv(0.05) is None  # heartbeat answers are not messages
            srv.close()
            before = c.silent_for
            time.sleep(0.3)
            assert c.silent_for >= before + 0.25  # nobody answers any more
    finally:
        srv.close()


# ---- what a peer that has not completed the handshake can cost


def _status_mb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/self/status")


class _Peak:
    """This process's peak resident memory while the ``with`` block runs, in MB above the
    resident memory at its start: the kernel's high-water mark, reset on entry, or (where
    that cannot be reset) a sampler thread's highest reading."""

    def __enter__(self):
        self.base = _status_mb("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._sampler = None
        except OSError:
            self._stop = threading.Event()
            self._highest = self.base
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self._highest = max(self._highest, _status_mb("VmRSS"))
            self._stop.wait(0.001)

    def __exit__(self, *exc):
        if self._sampler is None:
            self.peak = _status_mb("VmHWM") - self.base
        else:
            self._stop.set()
            self._sampler.join()
            self.peak = self._highest - self.base
        self.after = _status_mb("VmRSS") - self.base


# Strangers in a process of their own (so their own buffers are not counted here). Two DEALERs,
# one without CURVE (a prefill worker of protocol version 3) and one with CURVE keys of another
# secret, each queue a message of many parts (more than zmq's frame limit in all) and then an
# open. Raw TCP connections get as far as zmq's own handshake: a CURVE greeting, then a HELLO
# command declared far over the port's frame limit, one well over it (48 MiB: under the 64 MiB
# of protocol version 3) and one at it, bodies sent as far as the server reads them. It
# prints how many of its sockets heard anything back.
_STRANGER = r"""
import os, socket, struct, sys, zmq
from zmq.utils import z85
endpoint, total, part, at_limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ctx = zmq.Context()
poller = zmq.Poller()
socks = []
for curve in (False, True):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if curve:
        sk = z85.encode(os.urandom(32))
        s.setsockopt(zmq.CURVE_SERVERKEY, zmq.curve_public(z85.encode(os.urandom(32))))
        s.setsockopt(zmq.CURVE_PUBLICKEY, zmq.curve_public(sk))
        s.setsockopt(zmq.CURVE_SECRETKEY, sk)
    # zmq drops a connection that failed its handshake for a protocol error, and then
    # a DEALER has nowhere to send: a send waits for a peer, so it must not wait forever
    s.setsockopt(zmq.SNDTIMEO, 2000)
    s.connect(endpoint)
    chunk = b"x" * part
    try:
        s.send_multipart([chunk] * (total // part), copy=False)
        s.send(b'{"kind":"open","identity":"stranger"}')
    except zmq.Again:
        pass
    poller.register(s, zmq.POLLIN)
    socks.append(s)
host, port = endpoint[len("tcp://"):].rsplit(":", 1)
greeting = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"CURVE".ljust(20, b"\0") + bytes(32)
raw = []
for declared in (1 << 30, 48 << 20, at_limit):
    r = socket.create_connection((host, int(port)))
    r.settimeout(20)
    try:
        r.sendall(greeting + b"\x06" + struct.pack(">Q", declared) + b"\x05HELLO")
        r.sendall(b"z" * (min(declared, 48 << 20) - 6))
    except OSError:
        pass  # cut off by the server
    raw.append(r)
heard = len(poller.poll(1000))
for r in raw:
    r.settimeout(1.0)
    try:
        heard += len(r.recv(1 << 16)) > 64  # more than the server's greeting
    except OSError:
        pass
print(heard)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_strangers_get_no_message_through_and_cost_the_port_no_memory(server):
    """Nothing a peer without the secret sends is taken by zmq beyond one frame of the port's
    limit: not a 200 MB message in 64 KiB parts (without CURVE, or with keys of another
    secret), not a handshake command declared over the limit; each refusal that reached the
    security handshake is counted, and the port still works."""
    import subprocess
    import sys

    total, part = 200 << 20, 64 << 10
    at_limit = w.KV_PART_BYTES  # a frame the port takes (a message part's size)
    with _Peak() as mem:
        out = subprocess.run([sys.executable, "-c", _STRANGER, server.endpoint, str(total),
                              str(part), str(at_limit)],
                             capture_output=True, timeout=60, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "0"  # no stranger heard a word of the protocol
    assert mem.peak < 40 and mem.after < 40, (mem.peak, mem.after)
    # the DEALERs (each at least once) and the HELLO at the limit (read, then
    # refused as malformed); the connections cut by their declared size are not counted
    assert _wait(lambda: server.counters().get("unauthenticated.curve", 0) >= 3)
    c = server.counters()
    assert c.get("unauthenticated", 0) == 0 and c.get("internal_errors", 0) == 0
    assert server.peers() == {}
    with _client(server) as ok:
        _accepted(server, ok)


# A ZMTP 3.0 greeting offering CURVE, as a client's: signature, version 3.0, mechanism,
# as-server 0, filler.
_CURVE_GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"CURVE".ljust(20, b"\0") + bytes(32)

# The most one connection still in its security handshake may make the port hold: a frame
# of 64 KiB (one K/V part) and CURVE's framing, plus libzmq's own state for a connection
# (its read buffer and the handshake's: about 14 KiB measured), with room to spare.
_PER_UNFINISHED_HANDSHAKE = 96 << 10


def _settled_rss(timeout=WAIT):
    """This process's resident MB once it stops changing (or at ``timeout``)."""
    last = _status_mb("VmRSS")
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        time.sleep(0.2)
        now = _status_mb("VmRSS")
        if abs(now - last) < 0.5:
            return now
        last = now
    return last


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_unfinished_security_handshakes_hold_one_small_frame_each(server):
    """Raw connections that each send a CURVE greeting and then a handshake command declared
    at the port's frame limit, all of it but the last byte: zmq holds that command's buffer
    until the connection goes, so the port's peak grows by at most one small frame per
    connection. A real client still gets through meanwhile; once they are closed, each is
    counted and the heap they freed is handed back."""
    n = 200
    declared = t.PORT_FRAME_LIMIT
    head = _CURVE_GREETING + b"\x06" + declared.to_bytes(8, "big")  # a long command
    body = bytes(declared - 1)
    host, port = server.endpoint[len("tcp://"):].rsplit(":", 1)
    socks = []
    try:
        with _Peak() as mem:
            for _ in range(n):
                sock = socket.create_connection((host, int(port)), timeout=WAIT)
                socks.append(sock)
                try:
                    sock.sendall(head)
                    sock.sendall(body)
                except OSError:
                    pass  # the port dropped it already (its handshake interval)
            _settled_rss()  # until the port has read what it will
        bound = n * _PER_UNFINISHED_HANDSHAKE / 2**20 + 8
        assert mem.peak < bound, (f"{n} unfinished handshakes of {declared} bytes: peak "
                                  f"+{mem.peak:.1f} MB, bound {bound:.1f} MB")
        with _client(server) as ok:
            _accepted(server, ok)
    finally:
        for sock in socks:
            sock.close()
    assert _wait(lambda: server.counters().get("unauthenticated.curve", 0) >= n)
    if t._heap_trimmer() is not None:  # glibc
        assert _wait(lambda: server.counters().get("heap_trims", 0) >= 1), server.counters()
        back = _settled_rss() - mem.base
        assert back < max(mem.peak / 2, 4), (mem.peak, back)
    assert server.counters().get("internal_errors", 0) == 0


def test_a_strangers_malformed_json_logs_no_traceback_and_the_port_still_works(
        server, ctx, caplog):
    caplog.set_level(logging.DEBUG)
    s = _raw(ctx, server.endpoint)
    nested = b'{"kind":"open","identity":' + b"[" * 3000 + b"]" * 3000 + b"}"
    assert len(nested) <= w.PREAUTH_MAX_BYTES
    s.send(nested)
    s.send(b"{" * 4000)
    s.send(w.encode_message(w.Open(identity="x" * w.PREAUTH_MAX_BYTES)))  # too big to read
    s.send_multipart([b"{}", b"{}"])
    s.send(w.encode_message(w.FirstToken(request_id="r1", epoch=1, token_id=5)))
    s.send(w.encode_message(w.Open(identity="stranger")))
    assert isinstance(_recv(s), w.Challenge)  # all of the above were handled, in order
    c = server.counters()
    assert (c["unauthenticated.malformed"], c["unauthenticated.oversized"],
            c["unauthenticated.unexpected"], c["unauthenticated"]) == (2, 1, 2, 5)
    assert c.get("internal_errors", 0) == 0
    for r in caplog.records:
        text = r.getMessage()
        assert r.exc_info is None and "Traceback" not in text and "Recursion" not in text
    # at most one warning line for the lot (rate-limited), naming no stranger's bytes
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) <= 1 and all(len(r.getMessage()) < 400 for r in warnings)
    with _client(server) as ok:
        _accepted(server, ok)


def test_a_stranger_learns_no_layout_and_only_a_key_holder_hears_of_a_mismatch(server, ctx):
    told = b""  # every byte the server sends a peer without the key
    s = _raw(ctx, server.endpoint)
    s.send(w.encode_message(w.Open(identity="stranger")))
    assert s.poll(int(WAIT * 1000))
    raw = s.recv()
    told += raw
    ch = w.decode_message(raw)
    assert set(json.loads(raw)) == {"kind", "server_identity", "nonce", "version"}
    # a wrong key and another layout: refused for the key, nothing else said
    theirs = dataclasses.replace(LAYOUT, **OTHER)
    s.send(w.encode_message(w.make_hello(ch, secret=os.urandom(32), identity="stranger",
                                         role="prefill", layout=theirs)))
    assert s.poll(int(WAIT * 1000))
    raw = s.recv()
    told += raw
    refused = w.decode_message(raw)
    assert isinstance(refused, w.Refuse) and refused.field == "auth"
    for value in (LAYOUT.model_id, LAYOUT.compat_hash(), LAYOUT.cache_layout,
                  LAYOUT.block_hash_scheme, LAYOUT.dtype):
        assert value.encode() not in told
    assert b"layout" not in told and b"num_layers" not in told
    # the key and another layout: refused at connect time naming the field and both values
    with pytest.raises(w.HandshakeError) as e:
        _client(server, layout=dataclasses.replace(LAYOUT, num_layers=3))
    assert e.value.field == "layout.num_layers" and "2" in e.value.reason \
        and "3" in e.value.reason
    assert server.counters()["refused.auth"] == 1
    assert server.counters()["refused.layout.num_layers"] == 1


def test_frames_are_limited_to_what_the_server_announced(ctx):
    with t.KVServer(secret=SECRET, layout=LAYOUT, max_frame_bytes=3 * BLOCK) as srv:
        with _client(srv) as c:
            assert c.max_frame_bytes == srv.max_frame_bytes == 3 * BLOCK
            srv.request_prefill(c.identity, _request(num_blocks=4))
            with pytest.raises(ValueError, match="max_frame_bytes"):
                c.send_kv("r1", 1, first_block=0, num_blocks=4, first_token=0,
                          num_tokens=16, layer_start=0, layer_end=2,
                          payload=os.urandom(4 * BLOCK))
            c.send_kv("r1", 1, first_block=0, num_blocks=3, first_token=0, num_tokens=12,
                      layer_start=0, layer_end=2, payload=os.urandom(3 * BLOCK))
            _send_block(c, 3)
            c.send_done("r1", 1)
            _events_until(srv, _is_done)
        assert srv.gate.complete("r1")
    # never below one block of every layer: the smallest frame there is
    with t.KVServer(secret=SECRET, layout=LAYOUT, max_frame_bytes=1) as srv:
        assert srv.max_frame_bytes == BLOCK


def test_an_oversized_hello_is_refused_by_the_client_itself(server):
    with pytest.raises(w.HandshakeError) as e:
        _client(server, name="n" * w.PREAUTH_MAX_BYTES)
    assert e.value.field == "size"
    assert server.counters().get("unauthenticated", 0) == 0
