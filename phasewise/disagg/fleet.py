"""The router's workers: who they are, whether they may stand behind it, and (``--discover``)
which ones a DNS name holds now.

``Fleet`` is the part of ``phasewise.disagg.router.Router`` that finds and checks its
workers: ``connect`` at start-up (blocking: before the server is built, it waits for each
worker's ``/internal/v1/info`` and refuses one that serves another checkpoint, other limits,
another block size or window), and with ``--discover`` the periodic ``_rediscover`` that
lets pods join once they pass the same checks and leave once nothing streams from them.
Relaying, migration and polling stay in the router; this module holds no stream state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
import time
import urllib.parse
from pathlib import Path
from typing import Any

import httpx

from phasewise.disagg.prefix_index import WorkerBlocks
from phasewise.engine.backend import BackendInfo, EngineSnapshot
from phasewise.engine.relay import checkpoint_identity

log = logging.getLogger("phasewise.router")


class RouterConfigError(ValueError):
    """The workers cannot be fronted by this router (unreachable, or a different model)."""


@dataclasses.dataclass
class Worker:
    url: str
    role: str  # what it was listed as: "decode" or "prefill"
    up: bool = False
    reason: str | None = "not polled yet"
    draining: bool = False
    snapshot: EngineSnapshot | None = None
    open_groups: int = 0
    in_flight: int = 0  # groups this router streams from it now
    retired: bool = False  # --discover: its address left the Service (no new requests)
    # its process's id (/internal/v1/info and load): another one means it restarted, maybe
    # with another checkpoint or other flags, so it is checked again before it is routed to
    instance: str | None = None

    # time.monotonic() at the start of the first failed poll in a row (a poll that times out
    # says, when it does, that the worker has not answered since it was sent)
    down_since: float | None = None

    def down(self, reason: str, since: float | None = None) -> None:
        if self.up:
            log.warning("%s worker %s is down: %s", self.role, self.url, reason)
        if self.down_since is None:
            self.down_since = time.monotonic() if since is None else since
        self.up, self.reason = False, reason

    @property
    def load(self) -> int:
        waiting = self.snapshot.num_waiting if self.snapshot is not None else 0
        return self.in_flight + waiting


def instance_of(reply: Any) -> str | None:
    """The worker process's id in an info or load reply (None: none, or not one)."""
    got = reply.get("instance") if isinstance(reply, dict) else None
    return got if isinstance(got, str) and 1 <= len(got) <= 64 and got.isalnum() else None


def refusal(status: int, body: bytes) -> str:
    """Why a worker refused the router, in words an operator can act on (``body``: the
    worker's JSON error, of which only the code is read)."""
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    if status == 401 and code == "invalid_internal_key":
        return ("it refused the router's internal key (401): give the router and every "
                "worker the same --internal-key-file")
    if status == 401:
        return "it refused the router's API key (401): give the router the workers' --api-key"
    if status == 429 and code == "too_many_wrong_keys":
        return ("it locks the router's address out for wrong API keys (429): give the "
                "router and the workers an --internal-key-file, which no lockout holds")
    return f"it answered {status}"


def seed_address(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of a --decode URL that --discover resolves."""
    u = urllib.parse.urlsplit(url)
    if not u.hostname or u.path not in ("", "/"):
        raise RouterConfigError(f"--discover needs --decode URLs of the form "
                                f"http://NAME:PORT (a DNS name to resolve); got {url!r}")
    try:
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError as e:
        raise RouterConfigError(f"--decode {url!r}: {e}") from None
    return u.scheme, u.hostname, port


def address_url(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def why_failed(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class Fleet:
    """The decode and prefill workers behind a router, found and checked (see the module).
    ``Router`` sets these attributes in its constructor and owns them; the methods here
    only fill them in at start-up and as DNS changes."""

    decode: list[Worker]
    prefill: list[Worker]
    index: dict[str, WorkerBlocks]  # per decode worker: the prefix blocks it holds
    model_dir: Path
    headers: dict[str, str]
    wait_s: float
    request_timeout: float
    discover: bool
    _seeds: list[tuple[str, str, int]]
    _last_seen: dict[tuple[str, str, int], set[str]]
    _identity: dict[str, Any]
    _first_info: dict[str, Any]
    _defaults: dict[str, Any]
    _loop: asyncio.AbstractEventLoop | None
    _client: httpx.AsyncClient | None
    info: BackendInfo
    block_size: int
    kv_window: int | None

    @property
    def workers(self) -> list[Worker]:
        return [*self.decode, *self.prefill]

    # -- start-up (blocking) ---------------------------------------------------------------
    def connect(self) -> None:
        """Wait up to ``wait_s`` for every worker's ``/internal/v1/info``, showing progress;
        check each serves this checkpoint. Raises ``RouterConfigError`` naming the worker.
        With ``discover``, the decode workers are first those its names resolve to (waiting
        for at least one address)."""
        self._identity = checkpoint_identity(self.model_dir)
        deadline = time.monotonic() + self.wait_s
        next_note = time.monotonic() + 5.0
        if self.discover:
            while not (found := self._resolve_now()):
                now = time.monotonic()
                if now >= deadline:
                    raise RouterConfigError(
                        f"--discover: no address for {', '.join(h for _, h, _ in self._seeds)} "
                        f"after {self.wait_s:.0f} s (no ready pod behind the Service?)")
                if now >= next_note:
                    log.info("waiting for %s to resolve to a worker",
                             ", ".join(h for _, h, _ in self._seeds))
                    next_note = now + 5.0
                time.sleep(1.0)
            self.decode = [Worker(u, "decode") for u in found]
            self.index = {w.url: WorkerBlocks() for w in self.decode}
        pending = {w.url: w for w in self.workers}
        infos: dict[str, dict[str, Any]] = {}
        with httpx.Client(headers=self.headers, timeout=self.request_timeout) as client:
            while pending:
                for url, w in list(pending.items()):
                    try:
                        r = client.get(url + "/internal/v1/info")
                    except httpx.HTTPError as e:
                        w.reason = why_failed(e)
                        continue
                    if r.status_code == 401:
                        raise RouterConfigError(f"{w.role} worker {url}: "
                                                f"{refusal(401, r.content[:4096])}")
                    if r.status_code != 200:
                        w.reason = f"/internal/v1/info answered {r.status_code}"
                        continue
                    infos[url] = r.json()
                    del pending[url]
                if self.discover and any(w.role == "decode" and w.url in infos
                                         for w in self.decode):
                    # the addresses that do not answer yet join later (_rediscover)
                    for url in [u for u, w in pending.items() if w.role == "decode"]:
                        del pending[url]
                    self.decode = [w for w in self.decode if w.url in infos]
                    self.index = {w.url: WorkerBlocks() for w in self.decode}
                if not pending:
                    break
                now = time.monotonic()
                if now >= deadline:
                    raise RouterConfigError(
                        f"workers not reachable after {self.wait_s:.0f} s: " + "; ".join(
                            f"{w.role} {u} ({w.reason})" for u, w in pending.items()))
                if now >= next_note:
                    log.info("waiting for %d worker(s): %s", len(pending), "; ".join(
                        f"{w.role} {u} ({w.reason})" for u, w in pending.items()))
                    next_note = now + 5.0
                time.sleep(0.25)
        first = infos[self.decode[0].url]
        for w in self.workers:
            why = self._mismatch(w, infos[w.url], first)
            if why is not None:
                raise RouterConfigError(why)
            w.up, w.reason, w.instance = True, None, instance_of(infos[w.url])
        base = dict(first["info"])
        base["description"] = (f"router over {len(self.decode)} decode and "
                               f"{len(self.prefill)} prefill worker(s)"
                               + (" (discovered by DNS)" if self.discover else ""))
        self.info = BackendInfo(**base)
        self._defaults = dict(first["defaults"])
        size = first.get("kv_block_size")
        if isinstance(size, int) and 1 <= size <= 1024:  # else an older worker: the default
            self.block_size = size
        window = first.get("kv_window")  # the same checkpoint everywhere: the same window
        self.kv_window = window if isinstance(window, int) and window >= 1 else None
        self._first_info = first
        log.info("router: decode %s; prefill %s", ", ".join(w.url for w in self.decode),
                 ", ".join(w.url for w in self.prefill) or "none")

    @staticmethod
    def _shape(info: dict[str, Any]) -> dict[str, Any]:
        # One set of limits and sampling defaults for all of them (paths and machines may
        # differ between hosts).
        limits = ("architecture", "num_params", "max_model_len", "vocab_size", "max_waiting")
        return {**{k: info["info"].get(k) for k in limits},
                **{f"defaults.{k}": v for k, v in info["defaults"].items()}}

    def _mismatch(self, w: Worker, got: dict[str, Any], first: dict[str, Any]) -> str | None:
        """Why worker ``w`` (its ``/internal/v1/info``: ``got``) cannot serve behind this
        router beside the first decode worker (``first``), or None."""
        allowed = ("decode", "both") if w.role == "decode" else ("prefill",)
        if got.get("role") not in allowed:
            return (f"{w.url} was given as a {w.role} worker but runs --role "
                    f"{got.get('role')!r} (a {w.role} URL must be one of: "
                    f"{', '.join(allowed)})")
        for key, value in self._identity.items():
            if got.get(key) != value:
                return (f"{w.role} worker {w.url} serves a different checkpoint: its {key} is "
                        f"{got.get(key)}, the router's --model {self.model_dir} has {value}")
        if w.role != "decode" or got is first:
            return None
        try:
            a, b = self._shape(first), self._shape(got)
        except (KeyError, TypeError, AttributeError):
            return f"decode worker {w.url} sent an /internal/v1/info the router cannot read"
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        if diff and w is self.decode[0]:
            return (f"decode worker {w.url} came back with other settings than the router "
                    f"started with ({', '.join(diff)}): restart it with its former flags, or "
                    "restart the router")
        if diff:
            return (f"decode workers {self.decode[0].url} and {w.url} differ in "
                    f"{', '.join(diff)}: start them with the same flags")
        if got.get("kv_window") != first.get("kv_window"):
            return (f"decode workers keep K/V for different sliding windows "
                    f"({first.get('kv_window')} and {got.get('kv_window')}): serve one "
                    "checkpoint with one phasewise version")
        if got.get("kv_block_size") != first.get("kv_block_size"):
            return (f"decode workers hash K/V blocks of different sizes "
                    f"({first.get('kv_block_size')} and {got.get('kv_block_size')}): start "
                    "them with the same --block-size")
        return None

    async def recheck(self, w: Worker) -> str | None:
        """Why worker ``w`` may not be routed to now that it is back (it restarted, or was
        unreachable): its ``/internal/v1/info`` checked as ``connect`` checked it, against
        the first decode worker's at start-up (whose limits the router announces); None
        where it passes, after which ``w.instance`` is the one it reported."""
        assert self._client is not None
        try:
            r = await self._client.get(w.url + "/internal/v1/info",
                                       timeout=min(2.0, self.request_timeout))
            if r.status_code != 200:
                return f"/internal/v1/info: {refusal(r.status_code, r.content[:4096])}"
            got = r.json()
        except (httpx.HTTPError, ValueError) as e:
            return f"/internal/v1/info: {why_failed(e)}"
        if not isinstance(got, dict):
            return "its /internal/v1/info is not an object"
        why = self._mismatch(w, got, self._first_info)
        if why is None:
            w.instance = instance_of(got)
        return why

    # -- discovery (--discover) ------------------------------------------------------------
    @staticmethod
    def _urls(scheme: str, port: int, infos: list[Any]) -> set[str]:
        """One URL per pod: its IPv4 addresses where the name has any (a dual-stack
        Service lists each pod under both families), else its IPv6 ones."""
        v4 = {i[4][0] for i in infos if i[0] == socket.AF_INET}
        hosts = v4 or {i[4][0] for i in infos}
        return {address_url(scheme, h, port) for h in hosts}

    def _resolve_now(self) -> list[str]:
        """Blocking: the worker URLs the seeds resolve to now (start-up only)."""
        found: set[str] = set()
        for seed in self._seeds:
            scheme, host, port = seed
            try:
                infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError:
                continue
            self._last_seen[seed] = self._urls(scheme, port, infos)
            found |= self._last_seen[seed]
        return sorted(found)

    async def _resolve(self) -> set[str] | None:
        """The worker URLs the seeds resolve to now; a name that does not resolve counts
        as what it last resolved to (a DNS failure is not an empty Service); None where
        none resolved."""
        assert self._loop is not None
        found: set[str] = set()
        ok = False
        for seed in self._seeds:
            scheme, host, port = seed
            try:
                infos = await self._loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:
                log.debug("--discover: %s does not resolve: %s", host, e)
                found |= self._last_seen.get(seed, set())
                continue
            ok = True
            self._last_seen[seed] = self._urls(scheme, port, infos)
            found |= self._last_seen[seed]
        return found if ok else None

    async def _rediscover(self) -> None:
        """Workers that appeared join once their ``/internal/v1/info`` passes the checks
        ``connect`` made; those that disappeared (a pod draining, gone) take no new request
        and are forgotten once nothing streams from them; one that comes back rejoins."""
        assert self._client is not None
        found = await self._resolve()
        if found is None:
            return
        known = {w.url: w for w in self.decode}
        for w in known.values():
            w.retired = w.url not in found
        for url in sorted(found - set(known)):
            w = Worker(url, "decode")
            try:
                r = await self._client.get(url + "/internal/v1/info",
                                           timeout=min(2.0, self.request_timeout))
                got = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError) as e:
                log.debug("--discover: %s not ready: %s", url, why_failed(e))
                continue
            why = ("its /internal/v1/info answered " + str(r.status_code) if got is None
                   else self._mismatch(w, got, self._first_info))
            if why is not None:
                log.warning("--discover: not routing to %s: %s", url, why)
                continue
            w.up, w.reason = True, None  # it answered; its polls keep it so
            w.instance = instance_of(got)
            self.index[url] = WorkerBlocks()
            self.decode = [*self.decode, w]
            log.info("--discover: decode worker %s joined", url)
        keep = [w for w in self.decode if not (w.retired and w.in_flight == 0)]
        for w in self.decode:
            if w not in keep:
                log.info("--discover: decode worker %s left", w.url)
                self.index.pop(w.url, None)
        if len(keep) != len(self.decode):
            self.decode = keep
