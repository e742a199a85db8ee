"""Fault injection for the P/D tests: a deterministic plan of what happens to a prefill
worker's outgoing K/V frames (dropped, duplicated, corrupted, delayed) and its heartbeats,
plugged into ``KVClient`` (or ``PrefillSide``) as its ``frame_hook``. Test code only: the
transport itself carries no fault logic."""

from __future__ import annotations

import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal


FaultKind = Literal["drop", "duplicate", "corrupt", "delay"]
FAULT_KINDS: tuple[str, ...] = ("drop", "duplicate", "corrupt", "delay")


@dataclass(frozen=True)
class Fault:
    """What to do to one outgoing KV frame. ``delay`` holds it back until ``after`` later
    frames have gone through the injector (or the attempt's ``send_done`` flushes it)."""

    kind: FaultKind
    after: int = 1

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"kind: {self.kind!r} is not one of {', '.join(FAULT_KINDS)}")
        if self.after < 1:
            raise ValueError(f"after: must be >= 1, got {self.after}")


class FaultInjector:
    """Deterministic faults on a client's outgoing KV frames: a
    :class:`~phasewise.disagg.transport.FrameHook` (``KVClient(..., frame_hook=...)``).

    ``plan`` maps a frame's ``seq`` (within its attempt; every attempt's frame with that seq)
    to a :class:`Fault` or its kind's name. ``corrupt`` flips one byte of the payload's first
    part after the checksum was computed. ``applied`` counts the faults done.
    ``mute_heartbeats()`` makes the client go silent (its frames and messages still flow).
    """

    def __init__(self, plan: Mapping[int, Fault | str] | None = None):
        self.plan: dict[int, Fault] = {
            int(s): f if isinstance(f, Fault) else Fault(f)  # type: ignore[arg-type]
            for s, f in (plan or {}).items()}
        self.applied = dict.fromkeys(FAULT_KINDS, 0)
        self._held: list[list[Any]] = []  # [frames still to pass, parts]
        self._lock = threading.Lock()
        self._muted = threading.Event()

    @classmethod
    def seeded(cls, seed: int, num_frames: int,
               rates: Mapping[str, float]) -> FaultInjector:
        """A plan drawn from ``random.Random(seed)``: each seq below ``num_frames`` gets fault
        ``k`` with probability ``rates[k]`` (the rates must sum to <= 1)."""
        if sum(rates.values()) > 1 or any(k not in FAULT_KINDS for k in rates):
            raise ValueError(f"rates: kinds from {', '.join(FAULT_KINDS)}, summing to <= 1")
        rng = random.Random(seed)
        plan: dict[int, Fault] = {}
        for seq in range(num_frames):
            r, acc = rng.random(), 0.0
            for kind in FAULT_KINDS:
                acc += rates.get(kind, 0.0)
                if r < acc:
                    plan[seq] = Fault(kind, rng.randint(1, 3))  # type: ignore[arg-type]
                    break
        return cls(plan)

    def mute_heartbeats(self) -> None:
        self._muted.set()

    def unmute_heartbeats(self) -> None:
        self._muted.clear()

    @property
    def heartbeats_muted(self) -> bool:
        return self._muted.is_set()

    def outgoing(self, seq: int, parts: list[Any]) -> list[list[Any]]:
        """The multipart messages to send now, in order, for frame ``seq``."""
        fault = self.plan.get(seq)
        with self._lock:
            if fault is not None:
                self.applied[fault.kind] += 1
            if fault is not None and fault.kind == "delay":
                self._held.append([fault.after, parts])
                return []
            out: list[list[Any]] = []
            if fault is None:
                out.append(parts)
            elif fault.kind == "duplicate":
                out += [parts, parts]
            elif fault.kind == "corrupt":
                payload = bytearray(parts[1])
                if payload:
                    payload[len(payload) // 2] ^= 0xFF
                else:
                    payload.append(0)
                out.append([parts[0], bytes(payload), *parts[2:]])
            for item in self._held:
                item[0] -= 1
            out += [p for n, p in self._held if n <= 0]
            self._held = [item for item in self._held if item[0] > 0]
            return out

    def flush(self) -> list[list[Any]]:
        with self._lock:
            out = [p for _, p in self._held]
            self._held = []
            return out
