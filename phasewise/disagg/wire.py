"""The P/D wire protocol: what crosses between a prefill and a decode worker, and how it is checked.

Pure: no sockets, no torch. ``transport.py`` moves these bytes over pyzmq.

Two layers guard a connection. Below, the K/V port speaks CurveZMQ (zmq's CURVE mechanism):
both key pairs are derived from the shared secret (:func:`curve_secret_key`), and the server
accepts only the client key derived from it, so a peer without the secret cannot complete
zmq's own security handshake and no message of its reaches the application; every later
message is encrypted and authenticated by zmq. Above, this module's handshake binds the
connection to a worker: protocol version, layout, name and identity, with nonces against
replay.

Three kinds of traffic share one connection:

- **Handshake** (``Open`` -> ``Challenge`` -> ``Hello`` -> ``Accept`` | ``Refuse``). The server
  (the decode worker's KV port) sends a fresh single-use nonce, its identity and the protocol
  version, and nothing of its :class:`KVLayout` (anyone may ask for a challenge); the client
  answers with its identity, role, protocol version, layout and an HMAC-SHA256 over both
  nonces and those fields, keyed by a shared secret. The server refuses a wrong key
  (``auth``), an unknown or already used nonce (``nonce``: a replayed hello), and only then,
  to a peer that proved it holds the key, a version (``version``) or any layout field
  (``layout.<field>``, naming both values) that differs from its own. Its ``Accept`` carries
  its own HMAC, so the client knows the server holds the key too, and the largest K/V frame
  it takes (``max_frame_bytes``, under that HMAC). Handshake messages are small: a server
  reads at most :data:`PREAUTH_MAX_BYTES` of a peer that has not completed it.
- **Control messages**: frozen dataclasses encoded as compact JSON with sorted keys and a
  ``kind`` tag. :func:`decode_message` never evaluates anything: it refuses a message over
  its byte limit before reading it, JSON nested deeper than :data:`MAX_NESTING`, unknown
  kinds, unknown or missing fields and wrong types, naming the field.
- **KV frames**: a multipart message, a JSON :class:`KVFrameHeader` then the raw payload bytes
  in parts of :data:`KV_PART_BYTES` (the last one shorter; one part at least). The header
  names request, attempt epoch, per-attempt sequence number, block/token/layer range, dtype,
  byte count and a checksum (``blake2b-128`` by default: 128 bits, so a random
  corruption is missed with probability 2**-128; ``crc32`` is the faster, weaker option).

:class:`FrameGate` is the receiver's single place that decides whether a frame may land.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import math
import re
import secrets
import threading
import types
import typing
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

PROTOCOL_VERSION = 5
"""Bumped on any change to a message's fields or meaning; peers must match exactly. 2: a
heartbeat carries the sender's queue, and the server answers each one. 3: the challenge
carries no layout (the server compares layouts after checking the hello's MAC), the accept
carries ``max_frame_bytes``, and handshake and control messages have byte limits. 4: the
K/V port requires CURVE with keys derived from the secret (:func:`curve_secret_key`), and a
K/V frame's payload travels in parts of :data:`KV_PART_BYTES`. A peer of version 3 or
older cannot complete zmq's security handshake with a version 4 one. 5: those parts are
64 KiB, not 256 (a port's zmq frame limit is one part, so a version 4 sender's parts would
cut its connection: the version check refuses it at connect time instead)."""

ROLES = ("prefill", "decode", "router")
"""Roles a client may claim in its hello."""

DTYPE_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}
"""KV cache dtypes the wire knows, with their item size in bytes (torch's names)."""

CHECKSUMS = ("blake2b-128", "crc32")
"""Payload checksum algorithms; a header's ``checksum`` reads ``"<algorithm>:<hex digest>"``."""

MAX_MESSAGE_BYTES = 64 << 20
"""Largest message :func:`decode_message` parses by default (a ``PrefillRequest`` carries a
whole prompt's token ids)."""

PREAUTH_MAX_BYTES = 8 << 10
"""Largest message a K/V port reads from a peer that has not completed the handshake: an
``Open`` or a ``Hello`` (under 1 KiB with a typical layout; the client checks its own)."""

MAX_CONTROL_BYTES = 64 << 10
"""Largest control message or frame header a K/V port parses from an authenticated peer:
everything a prefill worker sends is small (the largest, a ``FirstToken``, holds at most 21
log-probabilities; an ``Error``'s detail is cut to 500 characters)."""

MAX_NESTING = 32
"""Deepest JSON nesting :func:`decode_message` accepts (a ``Hello`` needs 2; a prefill
request's sampling parameters a few more). Checked before parsing, so a deep message costs
a scan, never a ``RecursionError``."""

DEFAULT_MAX_FRAME_BYTES = 64 << 20
"""Default largest K/V frame payload a K/V port takes (never less than one block of every
layer); a prefill worker splits a larger chunk into frames of whole blocks."""

KV_PART_BYTES = 64 << 10
"""A K/V frame's payload travels in zmq message parts of this size (the last one shorter).
The K/V port's zmq frame limit is this (plus CURVE's framing; no smaller than
:data:`MAX_CONTROL_BYTES`), not a whole frame: zmq reads a frame into memory before anything
is authenticated, even a security handshake command, so this bounds what one connection of
a stranger can make the port hold. Smaller parts cost throughput: zmq encrypts, writes and
reads each part on its own (a system call or more a part). 64 KiB is the smallest part
that keeps within 10% of larger parts' rate (benchmarks/RESULTS.md, "P/D
disaggregation"), and a stranger's unfinished connection then holds about 80 KB."""

MIN_SECRET_BYTES = 16

Buffer = bytes | bytearray | memoryview
"""Anything with the buffer protocol is accepted where this alias is used."""


# --------------------------------------------------------------------------------------------
# errors


class MessageError(ValueError):
    """A control message (or header) is malformed; ``field`` names the offending field."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


class HandshakeError(Exception):
    """A handshake was refused. ``field`` is one of ``security`` (zmq's CURVE handshake
    failed: a different secret, or a peer of another protocol version), ``auth``, ``nonce``,
    ``version``, ``role``, ``layout.<name>``, ``size`` (this side's hello is too big),
    ``protocol`` (an unexpected message) or ``timeout``."""

    def __init__(self, reason: str, field: str):
        super().__init__(f"handshake refused ({field}): {reason}")
        self.reason = reason
        self.field = field


FrameErrorKind = Literal["malformed", "size", "checksum"]


class FrameError(Exception):
    """A KV frame cannot be trusted. ``kind``: ``malformed`` (no payload part, an empty part
    among several, bad header JSON, unknown checksum algorithm), ``size`` (payload length !=
    header ``nbytes``, or over the receiver's limit) or ``checksum``.
    ``header`` is the parsed header when there was one, so the error can be attributed."""

    KINDS: ClassVar[tuple[str, ...]] = ("malformed", "size", "checksum")

    def __init__(self, kind: FrameErrorKind, detail: str, header: KVFrameHeader | None = None):
        if kind not in self.KINDS:
            raise ValueError(f"FrameError kind must be one of {self.KINDS}, got {kind!r}")
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail
        self.header = header


# --------------------------------------------------------------------------------------------
# typed, validated records


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp)


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (lists become tuples)."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        arms = typing.get_args(tp)
        if value is None and type(None) in arms:
            return None
        rest = [a for a in arms if a is not type(None)]
        if len(rest) == 1:
            return _coerce(value, rest[0], path)
        raise TypeError(f"unsupported annotation {tp}")  # pragma: no cover - our own bug
    if origin is tuple:
        (item, _ellipsis) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise MessageError(f"{path}: expected a list, got {type(value).__name__}", path)
        return tuple(_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise MessageError(f"{path}: expected an object, got {type(value).__name__}", path)
        for k in value:
            if not isinstance(k, str):
                raise MessageError(f"{path}: keys must be strings, got {k!r}", path)
        return {k: _coerce(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise MessageError(f"{path}: expected an object, got {type(value).__name__}", path)
        try:
            return _build(tp, value)
        except MessageError as e:
            raise MessageError(f"{path}.{e}", f"{path}.{e.field}") from None
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise MessageError(f"{path}: expected a number, got {type(value).__name__}", path)
        if not math.isfinite(value):
            raise MessageError(f"{path}: must be finite, got {value!r}", path)
        return float(value)
    if tp is int and isinstance(value, bool):
        raise MessageError(f"{path}: expected int, got bool", path)
    if not isinstance(value, tp):
        raise MessageError(
            f"{path}: expected {_type_name(tp)}, got {type(value).__name__}", path)
    return value


def _build(cls: type, data: dict[str, Any]) -> Any:
    """Construct ``cls`` from a JSON object, refusing unknown and missing fields. Errors name
    the field relative to ``cls``."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise MessageError(
            f"{unknown[0]}: unknown field (allowed: {', '.join(sorted(names))})", unknown[0])
    missing = [n for n, f in names.items() if n not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise MessageError(f"{missing[0]}: missing field", missing[0])
    return cls(**data)


class _Record:
    """Base for wire records: ``__post_init__`` checks every field's type against its
    annotation (so a record built locally is as valid as a decoded one), then ``_check()``
    checks values. Errors are :class:`MessageError` naming the field."""

    def __post_init__(self) -> None:
        for name, tp in _hints(type(self)).items():
            if name.startswith("_") or typing.get_origin(tp) is ClassVar:
                continue
            value = _coerce(getattr(self, name), tp, name)
            object.__setattr__(self, name, value)
        self._check()

    def _check(self) -> None:
        pass

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            out[f.name] = v.to_dict() if isinstance(v, _Record) else v
        return out


def _nonneg(obj: Any, *names: str) -> None:
    for n in names:
        if getattr(obj, n) < 0:
            raise MessageError(f"{n}: must be >= 0, got {getattr(obj, n)}", n)


def _positive(obj: Any, *names: str) -> None:
    for n in names:
        if getattr(obj, n) < 1:
            raise MessageError(f"{n}: must be >= 1, got {getattr(obj, n)}", n)


def _nonempty(obj: Any, *names: str) -> None:
    for n in names:
        if not getattr(obj, n):
            raise MessageError(f"{n}: must be a non-empty string", n)


def _canonical(obj: Any) -> bytes:
    """The one byte encoding used for messages, hashes and MACs."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True, ensure_ascii=True,
                      allow_nan=False).encode("ascii")


# --------------------------------------------------------------------------------------------
# layout


@dataclass(frozen=True)
class KVLayout(_Record):
    """Everything that must match between a prefill and a decode worker for a block of KV
    written by one to mean the same thing to the other.

    ``model_id`` is the caller's string for the weights, e.g. ``"LlamaForCausalLM:<sha256 of
    the safetensors>"``; ``cache_layout`` names the KV cache tensor's dimensions in order
    (a ``kv`` dimension means K and V are both stored, so a block holds twice the bytes);
    ``block_hash_scheme`` names how prefix-cache block hashes are computed.
    """

    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    cache_layout: str = "layers,kv,blocks,block_size,kv_heads,head_dim"
    block_hash_scheme: str = "blake2b-128/int64le"

    def _check(self) -> None:
        _nonempty(self, "model_id", "cache_layout", "block_hash_scheme")
        if self.dtype not in DTYPE_BYTES:
            raise MessageError(
                f"dtype: {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}", "dtype")
        _positive(self, "num_layers", "num_kv_heads", "head_dim", "block_size")

    def compat_hash(self) -> str:
        """Hex SHA-256 of the canonical JSON of every field (and the protocol version)."""
        return hashlib.sha256(_canonical({"v": PROTOCOL_VERSION, **self.to_dict()})).hexdigest()

    def mismatches(self, other: KVLayout) -> list[str]:
        """``"field: mine != theirs"`` for each differing field, in declaration order."""
        return [f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
                for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(other, f.name)]

    def mismatched_fields(self, other: KVLayout) -> list[str]:
        return [f.name for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(other, f.name)]

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def frame_shape(self, header: KVFrameHeader) -> tuple[int, ...]:
        """The payload's tensor shape, in ``cache_layout`` order: for the default layout
        ``[layer_end - layer_start, 2, num_blocks, block_size, num_kv_heads, head_dim]``."""
        sizes = {"layers": header.layer_end - header.layer_start, "kv": 2,
                 "blocks": header.num_blocks, "block_size": self.block_size,
                 "kv_heads": self.num_kv_heads, "head_dim": self.head_dim}
        dims = self.cache_layout.split(",")
        unknown = [d for d in dims if d not in sizes]
        if unknown:
            raise ValueError(f"cache_layout: dimension {unknown[0]!r} is not one of "
                             f"{', '.join(sizes)}")
        return tuple(sizes[d] for d in dims)

    def block_layer_bytes(self) -> int:
        """Bytes of one block of one layer: [kv?, block_size, kv_heads, head_dim] * itemsize."""
        kv = 2 if "kv" in self.cache_layout.split(",") else 1
        return kv * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize


# --------------------------------------------------------------------------------------------
# messages


MESSAGE_KINDS: dict[str, type] = {}


def _message(kind: str) -> Callable[[type], type]:
    def register(cls: type) -> type:
        cls.KIND = kind  # type: ignore[attr-defined]
        MESSAGE_KINDS[kind] = cls
        return cls
    return register


@_message("open")
@dataclass(frozen=True)
class Open(_Record):
    """Client -> server, first: please challenge me. ``identity`` is only a claim here."""

    identity: str

    def _check(self) -> None:
        _nonempty(self, "identity")


@_message("challenge")
@dataclass(frozen=True)
class Challenge(_Record):
    """Server -> client: a fresh single-use ``nonce`` (32 hex chars), the server's identity and
    protocol version. Sent to anyone who asks, so it names nothing of the layout."""

    server_identity: str
    nonce: str
    version: int

    def _check(self) -> None:
        _check_nonce(self, "nonce")


@_message("hello")
@dataclass(frozen=True)
class Hello(_Record):
    """Client -> server: who I am, answering ``server_nonce``. ``name`` is the stable worker
    name (``prefill-0``); ``identity`` is this incarnation's id. A hello whose name is bound to
    another identity replaces that peer (a restart). ``mac`` covers both nonces, the identities,
    name, role, version and ``layout.compat_hash()``."""

    identity: str
    name: str
    role: str
    version: int
    layout: KVLayout
    server_nonce: str
    client_nonce: str
    mac: str

    def _check(self) -> None:
        _nonempty(self, "identity", "name")
        _check_nonce(self, "server_nonce")
        _check_nonce(self, "client_nonce")


@_message("accept")
@dataclass(frozen=True)
class Accept(_Record):
    """Server -> client: accepted; ``mac`` proves the server holds the secret too (and covers
    ``max_frame_bytes``, the largest K/V frame payload the server takes)."""

    server_identity: str
    identity: str
    mac: str
    max_frame_bytes: int

    def _check(self) -> None:
        _positive(self, "max_frame_bytes")


@_message("refuse")
@dataclass(frozen=True)
class Refuse(_Record):
    """Server -> client: refused; ``field`` as in :class:`HandshakeError`."""

    field: str
    reason: str


@_message("prefill_request")
@dataclass(frozen=True)
class PrefillRequest(_Record):
    """Decode -> prefill: compute this prompt and push its KV.

    The request's prompt spans logical blocks ``0 .. num_blocks - 1``; the decode worker has
    reserved (or already caches) them and wants blocks ``first_block .. num_blocks - 1`` pushed.
    ``params`` are the sampling parameters for the first token, as JSON. A retry is a new
    attempt with a larger ``epoch``; nothing of an older attempt is reused.
    """

    request_id: str
    epoch: int
    token_ids: tuple[int, ...]
    params: dict[str, Any]
    num_blocks: int
    first_block: int = 0

    def _check(self) -> None:
        _nonempty(self, "request_id")
        _nonneg(self, "epoch", "first_block")
        _positive(self, "num_blocks")
        if not self.token_ids:
            raise MessageError("token_ids: must not be empty", "token_ids")
        if any(t < 0 for t in self.token_ids):
            raise MessageError("token_ids: ids must be >= 0", "token_ids")
        if self.first_block > self.num_blocks:
            raise MessageError(
                f"first_block: {self.first_block} > num_blocks {self.num_blocks}", "first_block")


@_message("kv_frame")
@dataclass(frozen=True)
class KVFrameHeader(_Record):
    """The header part of a KV frame (the "KV chunk" header).

    The payload holds whole blocks ``first_block .. first_block + num_blocks - 1`` (logical
    indices within the request) for layers ``layer_start .. layer_end - 1``, in the layout's
    ``cache_layout`` order restricted to those layers and blocks. Those blocks hold tokens
    ``first_token .. first_token + num_tokens - 1``. ``seq`` numbers the attempt's frames from
    0 in send order; blocks carry their own indices, so arrival order does not matter.
    ``nbytes`` is the payload length; ``checksum`` is ``"<algorithm>:<hex>"`` over the payload.
    """

    request_id: str
    epoch: int
    seq: int
    first_block: int
    num_blocks: int
    first_token: int
    num_tokens: int
    layer_start: int
    layer_end: int
    dtype: str
    nbytes: int
    checksum: str

    def _check(self) -> None:
        _nonempty(self, "request_id", "dtype")
        _nonneg(self, "epoch", "seq", "first_block", "first_token", "layer_start", "nbytes")
        _positive(self, "num_blocks", "num_tokens")
        if self.layer_end <= self.layer_start:
            raise MessageError(
                f"layer_end: {self.layer_end} must be > layer_start {self.layer_start}",
                "layer_end")
        algo, _, digest = self.checksum.partition(":")
        if algo not in CHECKSUMS or not digest:
            raise MessageError(
                f"checksum: {self.checksum!r} is not '<algorithm>:<hex>' with algorithm one of "
                f"{', '.join(CHECKSUMS)}", "checksum")

    def blocks(self) -> range:
        return range(self.first_block, self.first_block + self.num_blocks)


@_message("first_token")
@dataclass(frozen=True)
class FirstToken(_Record):
    """Prefill -> decode: the token sampled after the prompt. ``logprobs`` maps token ids (as
    JSON object keys, so strings) to log-probabilities, or is None."""

    request_id: str
    epoch: int
    token_id: int
    logprobs: dict[str, float] | None = None

    def _check(self) -> None:
        _nonempty(self, "request_id")
        _nonneg(self, "epoch", "token_id")


@_message("done")
@dataclass(frozen=True)
class Done(_Record):
    """Prefill -> decode: this attempt sent ``num_frames`` KV frames, seqs ``0 .. num_frames-1``
    (so the receiver can name the missing ones)."""

    request_id: str
    epoch: int
    num_frames: int

    def _check(self) -> None:
        _nonempty(self, "request_id")
        _nonneg(self, "epoch", "num_frames")


@_message("error")
@dataclass(frozen=True)
class Error(_Record):
    """Prefill -> decode: this attempt failed; the decode worker falls back to local prefill."""

    request_id: str
    epoch: int
    reason: str
    detail: str = ""

    def _check(self) -> None:
        _nonempty(self, "request_id", "reason")
        _nonneg(self, "epoch")


@_message("abort")
@dataclass(frozen=True)
class Abort(_Record):
    """Decode -> prefill: stop working on this attempt; send nothing more for it."""

    request_id: str
    epoch: int

    def _check(self) -> None:
        _nonempty(self, "request_id")
        _nonneg(self, "epoch")


@_message("heartbeat")
@dataclass(frozen=True)
class Heartbeat(_Record):
    """Either way: I am alive. ``seq`` counts up from 0 per sender; ``queue``: the prompts
    a prefill worker holds (waiting or computing), so a decode worker can route around a
    busy one."""

    identity: str
    seq: int
    queue: int = 0

    def _check(self) -> None:
        _nonempty(self, "identity")
        _nonneg(self, "seq")
        _nonneg(self, "queue")


@_message("bye")
@dataclass(frozen=True)
class Bye(_Record):
    """Client -> server: I am closing (so the server marks the peer closed, not lost)."""

    identity: str


Message = (Open | Challenge | Hello | Accept | Refuse | PrefillRequest | KVFrameHeader
           | FirstToken | Done | Error | Abort | Heartbeat | Bye)


def encode_message(msg: Any) -> bytes:
    """Compact, sorted-key JSON with a ``kind`` tag."""
    kind = getattr(type(msg), "KIND", None)
    if kind is None or MESSAGE_KINDS.get(kind) is not type(msg):
        raise TypeError(f"not a wire message: {type(msg).__name__}")
    return _canonical({"kind": kind, **msg.to_dict()})


def _no_constant(name: str) -> Any:
    raise MessageError(f"non-finite number {name} is not allowed", "")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise MessageError(f"duplicate key {k!r}", k)
        out[k] = v
    return out


# The only characters that move JSON's nesting or string state.
_NESTING_CHARS = re.compile(r'["\\\[\]{}]')


def _check_nesting(text: str) -> None:
    """Raise :class:`MessageError` if ``text`` nests deeper than MAX_NESTING (brackets inside
    strings are text). The depth counted is never below the depth ``json`` would reach on the
    same text; the cost is one regex scan plus a step per quote, backslash or bracket."""
    if text.count("[") + text.count("{") <= MAX_NESTING:
        return
    depth = 0
    in_string = False
    escaped = -1  # the index of the character a backslash in a string escapes
    for m in _NESTING_CHARS.finditer(text):
        i = m.start()
        if i == escaped:
            continue
        c = text[i]
        if in_string:
            if c == "\\":
                escaped = i + 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            if depth > MAX_NESTING:
                raise MessageError(f"JSON nested deeper than {MAX_NESTING} levels", "")
        elif c in "]}":
            depth -= 1
            if depth < 0:
                raise MessageError("not JSON: a closing bracket with none open", "")


def decode_message(data: Buffer, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Any:
    """Parse and validate one control message. Raises :class:`MessageError` (naming the
    field) for anything but a well-formed message of a known kind. A message over
    ``max_bytes`` is refused by its length alone: nothing of it is copied or read."""
    view = memoryview(data).cast("B")
    if view.nbytes > max_bytes:
        raise MessageError(f"message of {view.nbytes} bytes exceeds {max_bytes}", "")
    try:
        text = str(view, "utf-8")
    except UnicodeDecodeError as e:
        raise MessageError(f"not JSON: {e}", "") from None
    _check_nesting(text)
    try:
        obj = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_no_duplicates)
    except MessageError:
        raise
    except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: only if the
        # caller itself runs near the recursion limit (MAX_NESTING is far below it)
        raise MessageError(f"not JSON: {e}", "") from None
    if not isinstance(obj, dict):
        raise MessageError(f"expected a JSON object, got {type(obj).__name__}", "")
    kind = obj.pop("kind", None)
    if not isinstance(kind, str):
        raise MessageError("missing or non-string 'kind'", "kind")
    cls = MESSAGE_KINDS.get(kind)
    if cls is None:
        raise MessageError(
            f"unknown kind {kind!r} (allowed: {', '.join(sorted(MESSAGE_KINDS))})", "kind")
    try:
        return _build(cls, obj)
    except MessageError as e:
        raise MessageError(f"{kind}: {e}", e.field) from None


# --------------------------------------------------------------------------------------------
# KV frames


def checksum(payload: Buffer, algorithm: str = "blake2b-128") -> str:
    """``"<algorithm>:<hex>"`` over ``payload``."""
    if algorithm == "blake2b-128":
        return "blake2b-128:" + hashlib.blake2b(payload, digest_size=16).hexdigest()
    if algorithm == "crc32":
        return f"crc32:{zlib.crc32(payload):08x}"
    raise ValueError(f"checksum algorithm must be one of {', '.join(CHECKSUMS)}, "
                     f"got {algorithm!r}")


def encode_kv_frame(*, request_id: str, epoch: int, seq: int, first_block: int,
                    num_blocks: int, first_token: int, num_tokens: int, layer_start: int,
                    layer_end: int, dtype: str, payload: Buffer,
                    algorithm: str = "blake2b-128",
                    part_bytes: int = KV_PART_BYTES) -> list[Buffer]:
    """``[header JSON, payload part, ...]``: the payload cut every ``part_bytes`` (one part
    when it is no bigger, or empty); ``nbytes`` and ``checksum`` are computed here. The
    payload is not copied: its parts are views of it (anything with the buffer protocol)."""
    if part_bytes < 1:
        raise ValueError(f"part_bytes: must be >= 1, got {part_bytes}")
    view = memoryview(payload)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    header = KVFrameHeader(
        request_id=request_id, epoch=epoch, seq=seq, first_block=first_block,
        num_blocks=num_blocks, first_token=first_token, num_tokens=num_tokens,
        layer_start=layer_start, layer_end=layer_end, dtype=dtype, nbytes=view.nbytes,
        checksum=checksum(view, algorithm))
    if view.nbytes <= part_bytes:
        return [encode_message(header), payload]
    return [encode_message(header),
            *(view[i:i + part_bytes] for i in range(0, view.nbytes, part_bytes))]


def decode_kv_frame(parts: list[Buffer], *, max_header_bytes: int = MAX_CONTROL_BYTES,
                    max_payload_bytes: int | None = None) -> tuple[KVFrameHeader, memoryview]:
    """Check a received frame: a valid header (at most ``max_header_bytes``), then one or more
    payload parts, none empty unless it is the only one, whose lengths add up to the header's
    ``nbytes`` (and to at most ``max_payload_bytes``, checked before anything is copied), and
    the checksum. Returns the header and a byte view of the payload (of the part itself when
    there is one, else of the parts joined); raises :class:`FrameError`."""
    if len(parts) < 2:
        raise FrameError("malformed", f"expected a header and payload parts, got {len(parts)} "
                         "part(s)")
    try:
        header = decode_message(parts[0], max_bytes=max_header_bytes)
    except MessageError as e:
        raise FrameError("malformed", f"header: {e}") from None
    if not isinstance(header, KVFrameHeader):
        raise FrameError("malformed", f"header kind is {header.KIND!r}, not 'kv_frame'")
    views = [memoryview(p).cast("B") for p in parts[1:]]
    if len(views) > 1 and any(v.nbytes == 0 for v in views):
        raise FrameError("malformed", "an empty payload part among several", header)
    total = sum(v.nbytes for v in views)
    if max_payload_bytes is not None and total > max_payload_bytes:
        raise FrameError("size", f"payload is {total} bytes, over the receiver's limit of "
                         f"{max_payload_bytes}", header)
    if total != header.nbytes:
        raise FrameError("size", f"payload is {total} bytes, header says {header.nbytes}",
                         header)
    payload = views[0] if len(views) == 1 else memoryview(b"".join(views))
    algo = header.checksum.partition(":")[0]
    if not hmac.compare_digest(checksum(payload, algo), header.checksum):
        raise FrameError("checksum", f"{algo} of the payload does not match the header", header)
    return header, payload


# --------------------------------------------------------------------------------------------
# handshake


def _check_nonce(obj: Any, name: str) -> None:
    v = getattr(obj, name)
    if len(v) != 32 or any(c not in "0123456789abcdef" for c in v):
        raise MessageError(f"{name}: must be 32 lowercase hex characters", name)


def check_secret(secret: bytes) -> None:
    """Raise ValueError unless ``secret`` is bytes of at least MIN_SECRET_BYTES."""
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"secret: must be bytes of length >= {MIN_SECRET_BYTES}")


CURVE_KEY_LABELS = {"server": b"phasewise kv curve server",
                    "client": b"phasewise kv curve client"}
"""What :func:`curve_secret_key` signs for each side. No protocol version in them: peers of
two CURVE-speaking versions still meet, and hear ``version`` from the handshake above."""


def curve_secret_key(secret: bytes, side: Literal["server", "client"]) -> bytes:
    """The 32-byte Curve25519 secret key of ``side`` (``server``: the K/V port; ``client``:
    every prefill worker): HMAC-SHA256 of the shared secret over the side's label. So every
    holder of the secret knows both key pairs and nobody else knows either, with nothing new
    to configure; the public keys follow (``zmq.curve_public`` of the Z85 encoding). Any 32
    bytes are a valid Curve25519 secret key (the curve's scalar multiplication clamps it)."""
    check_secret(secret)
    return hmac.new(secret, CURVE_KEY_LABELS[side], hashlib.sha256).digest()


def _mac(secret: bytes, purpose: str, challenge: Challenge, hello: Hello,
         max_frame_bytes: int | None = None) -> str:
    """HMAC-SHA256 over a canonical encoding. ``purpose`` differs for the two directions, so a
    client's mac can never be reflected back as the server's; the server's also covers the
    frame limit it announces."""
    body: dict[str, Any] = {
        "purpose": purpose, "version": hello.version,
        "server_identity": challenge.server_identity, "server_nonce": challenge.nonce,
        "identity": hello.identity, "name": hello.name, "role": hello.role,
        "client_nonce": hello.client_nonce, "layout": hello.layout.compat_hash(),
    }
    if max_frame_bytes is not None:
        body["max_frame_bytes"] = max_frame_bytes
    return hmac.new(secret, _canonical(body), hashlib.sha256).hexdigest()


def new_nonce() -> str:
    return secrets.token_hex(16)


def make_challenge(server_identity: str, *, version: int = PROTOCOL_VERSION) -> Challenge:
    return Challenge(server_identity=server_identity, nonce=new_nonce(), version=version)


def make_hello(challenge: Challenge, *, secret: bytes, identity: str, role: str,
               layout: KVLayout, name: str | None = None,
               version: int = PROTOCOL_VERSION) -> Hello:
    check_secret(secret)
    unsigned = Hello(identity=identity, name=name or identity, role=role, version=version,
                     layout=layout, server_nonce=challenge.nonce, client_nonce=new_nonce(),
                     mac="")
    return dataclasses.replace(unsigned, mac=_mac(secret, "hello", challenge, unsigned))


def verify_hello(hello: Hello, challenge: Challenge, *, secret: bytes,
                 layout: KVLayout) -> None:
    """Raise :class:`HandshakeError` unless ``hello`` answers ``challenge`` (the one the server
    issued to this peer and has not accepted an answer to before), is signed with ``secret``,
    and matches the server's version and ``layout`` (the server's own). Authentication is
    checked first, so a peer without the key learns nothing beyond ``auth``: only a peer that
    holds it hears which layout field differs, and both values."""
    check_secret(secret)
    if hello.server_nonce != challenge.nonce:
        raise HandshakeError("hello answers a challenge this peer was not given, or one "
                             "already used (a replay?)", "nonce")
    if hello.client_nonce == challenge.nonce:
        raise HandshakeError("client nonce equals the server nonce", "nonce")
    if not hmac.compare_digest(hello.mac, _mac(secret, "hello", challenge, hello)):
        raise HandshakeError("hello is not signed with the shared secret", "auth")
    if hello.version != challenge.version:
        raise HandshakeError(f"protocol version {hello.version} != server's "
                             f"{challenge.version}", "version")
    if hello.role not in ROLES:
        raise HandshakeError(f"role {hello.role!r} is not one of {', '.join(ROLES)}", "role")
    diffs = layout.mismatched_fields(hello.layout)
    if diffs:
        raise HandshakeError("KV layout differs: " + "; ".join(
            layout.mismatches(hello.layout)) + " (server != client)", f"layout.{diffs[0]}")


def make_accept(hello: Hello, challenge: Challenge, *, secret: bytes,
                max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Accept:
    return Accept(server_identity=challenge.server_identity, identity=hello.identity,
                  mac=_mac(secret, "accept", challenge, hello, max_frame_bytes),
                  max_frame_bytes=max_frame_bytes)


def verify_accept(accept: Accept, hello: Hello, challenge: Challenge, *, secret: bytes) -> None:
    """The client's check that the server holds the key (and answered this very hello)."""
    if (accept.server_identity != challenge.server_identity
            or accept.identity != hello.identity
            or not hmac.compare_digest(accept.mac, _mac(secret, "accept", challenge, hello,
                                                        accept.max_frame_bytes))):
        raise HandshakeError("server's accept is not signed with the shared secret", "auth")


class ChallengeBook:
    """The server's outstanding challenges, one per connection, each answerable once.

    ``issue(peer)`` replaces any earlier challenge for that peer; ``take(peer)`` removes and
    returns it, so a replayed hello finds nothing (or a different nonce). At most ``capacity``
    are kept (oldest dropped), and each expires ``ttl`` seconds after issue on ``clock``.
    """

    def __init__(self, server_identity: str, *, capacity: int = 1024, ttl: float = 30.0,
                 clock: Callable[[], float] | None = None, version: int = PROTOCOL_VERSION):
        import time

        self._server_identity = server_identity
        self._version = version
        self._capacity = capacity
        self._ttl = ttl
        self._clock = clock or time.monotonic
        self._pending: OrderedDict[bytes, tuple[float, Challenge]] = OrderedDict()

    def issue(self, peer: bytes) -> Challenge:
        ch = make_challenge(self._server_identity, version=self._version)
        self._pending.pop(peer, None)
        self._pending[peer] = (self._clock(), ch)
        while len(self._pending) > self._capacity:
            self._pending.popitem(last=False)
        return ch

    def take(self, peer: bytes) -> Challenge | None:
        item = self._pending.pop(peer, None)
        if item is None or self._clock() - item[0] > self._ttl:
            return None
        return item[1]

    def __len__(self) -> int:
        return len(self._pending)


# --------------------------------------------------------------------------------------------
# the receiver's gate


GateOutcome = Literal["ok", "stale", "foreign", "duplicate", "out_of_range", "mismatch"]
GATE_OUTCOMES: tuple[str, ...] = typing.get_args(GateOutcome)


@dataclass
class _Attempt:
    epoch: int
    first_block: int
    total_blocks: int
    peer: str | None
    seqs: set[int] = field(default_factory=set)
    layers: dict[int, int] = field(default_factory=dict)  # block -> bitmask of landed layers
    num_frames: int | None = None


class FrameGate:
    """The one place a receiver decides whether a KV frame may land, under one lock.

    - ``expect(request_id, epoch, total_blocks, first_block=0, peer=None)`` registers the
      current attempt: blocks ``first_block .. total_blocks - 1`` are to arrive, from ``peer``
      if given. An attempt's epoch must exceed the request's previous one.
    - ``admit(header, peer=None, apply=None)`` returns the outcome, in this order of checks:
      ``foreign`` (unknown request, a newer epoch than expected, or the wrong peer),
      ``stale`` (an older epoch), ``mismatch`` (dtype, byte count or token range inconsistent
      with the layout), ``out_of_range`` (blocks or layers outside the attempt),
      ``duplicate`` (a seq already admitted, or any block-layer already landed), else ``ok``.
      For ``ok``, ``apply(header)`` runs *while the lock is held* and the blocks are marked
      landed only if it returns. So once ``forget`` returns, no copy for that request is in
      flight and none will start: its blocks may be freed. (The lock is reentrant; ``apply``
      must be quick, e.g. one device copy.)
    - ``counters()`` is a plain dict, outcome -> count, for /metrics.
    """

    def __init__(self, layout: KVLayout):
        self.layout = layout
        self._lock = threading.RLock()
        self._attempts: dict[str, _Attempt] = {}
        self._counts = dict.fromkeys(GATE_OUTCOMES, 0)

    def expect(self, request_id: str, epoch: int, total_blocks: int, *, first_block: int = 0,
               peer: str | None = None) -> None:
        if total_blocks < 1 or not 0 <= first_block <= total_blocks:
            raise ValueError(f"need total_blocks >= 1 and 0 <= first_block <= total_blocks, "
                             f"got total_blocks={total_blocks}, first_block={first_block}")
        with self._lock:
            old = self._attempts.get(request_id)
            if old is not None and epoch <= old.epoch:
                raise ValueError(f"epoch: a new attempt for {request_id!r} needs an epoch > "
                                 f"{old.epoch}, got {epoch}")
            self._attempts[request_id] = _Attempt(epoch, first_block, total_blocks, peer)

    def classify(self, request_id: str, epoch: int, peer: str | None = None) -> str:
        """``ok`` / ``stale`` / ``foreign`` for a message about (request_id, epoch) from peer."""
        with self._lock:
            a = self._attempts.get(request_id)
            if a is None or epoch > a.epoch or (a.peer is not None and peer != a.peer):
                return "foreign"
            return "stale" if epoch < a.epoch else "ok"

    def _judge(self, h: KVFrameHeader, peer: str | None) -> str:
        verdict = self.classify(h.request_id, h.epoch, peer)
        if verdict != "ok":
            return verdict
        a = self._attempts[h.request_id]
        lay = self.layout
        bs = lay.block_size
        if (h.dtype != lay.dtype
                or h.nbytes != h.num_blocks * (h.layer_end - h.layer_start)
                * lay.block_layer_bytes()
                or h.first_token != h.first_block * bs
                or not (h.num_blocks - 1) * bs < h.num_tokens <= h.num_blocks * bs):
            return "mismatch"
        if (h.first_block < a.first_block or h.first_block + h.num_blocks > a.total_blocks
                or h.layer_end > lay.num_layers):
            return "out_of_range"
        mask = ((1 << h.layer_end) - 1) ^ ((1 << h.layer_start) - 1)
        if h.seq in a.seqs or any(a.layers.get(b, 0) & mask for b in h.blocks()):
            return "duplicate"
        return "ok"

    def admit(self, header: KVFrameHeader, peer: str | None = None,
              apply: Callable[[KVFrameHeader], None] | None = None) -> str:
        with self._lock:
            verdict = self._judge(header, peer)
            if verdict == "ok":
                if apply is not None:
                    apply(header)  # raises -> nothing marked, nothing counted as ok
                a = self._attempts[header.request_id]
                a.seqs.add(header.seq)
                mask = ((1 << header.layer_end) - 1) ^ ((1 << header.layer_start) - 1)
                for b in header.blocks():
                    a.layers[b] = a.layers.get(b, 0) | mask
            self._counts[verdict] += 1
            return verdict

    def note_done(self, request_id: str, epoch: int, num_frames: int,
                  peer: str | None = None) -> bool:
        """Record the sender's frame count for the current attempt; False if not current."""
        with self._lock:
            if self.classify(request_id, epoch, peer) != "ok":
                return False
            self._attempts[request_id].num_frames = num_frames
            return True

    def complete(self, request_id: str) -> bool:
        """Whether every expected block has landed for every layer."""
        return not self.missing_blocks(request_id) and self.current_epoch(request_id) is not None

    def missing_blocks(self, request_id: str) -> list[int]:
        full = (1 << self.layout.num_layers) - 1
        with self._lock:
            a = self._attempts.get(request_id)
            if a is None:
                return []
            return [b for b in range(a.first_block, a.total_blocks) if a.layers.get(b) != full]

    def landed_prefix(self, request_id: str) -> int:
        """The end of the contiguous run of fully landed blocks from ``first_block``: blocks
        below it are usable; the rest must be recomputed locally. 0 for an unknown request."""
        with self._lock:
            a = self._attempts.get(request_id)
            if a is None:
                return 0
            missing = self.missing_blocks(request_id)
            return missing[0] if missing else a.total_blocks

    def missing_seqs(self, request_id: str) -> list[int] | None:
        """Seqs below the sender's ``num_frames`` not admitted; None before its Done."""
        with self._lock:
            a = self._attempts.get(request_id)
            if a is None or a.num_frames is None:
                return None
            return [s for s in range(a.num_frames) if s not in a.seqs]

    def current_epoch(self, request_id: str) -> int | None:
        with self._lock:
            a = self._attempts.get(request_id)
            return None if a is None else a.epoch

    def forget(self, request_id: str) -> bool:
        """Drop the request's attempt; its later frames are ``foreign``. True if it existed."""
        with self._lock:
            return self._attempts.pop(request_id, None) is not None

    def forget_peer(self, peer: str) -> list[str]:
        """Forget every attempt bound to ``peer`` (it died or was replaced); their ids."""
        with self._lock:
            gone = sorted(r for r, a in self._attempts.items() if a.peer == peer)
            for r in gone:
                del self._attempts[r]
            return gone

    def pending(self) -> list[str]:
        with self._lock:
            return sorted(self._attempts)

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
