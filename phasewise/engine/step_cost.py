"""A step's mix as a cost model prices it, and what the engine asks of a step cost model.

The engine records each step's predicted FLOPs, bytes and time (``StepStats.predicted_*``)
from a ``StepCoster`` that whoever builds the engine hands it (``phasewise.perf.attribution``'s
``StepCostModel``, for the CLI, ``LLM``, the server and the calibration grid): the engine room
sits below ``perf`` and knows no roofline. Without one, steps carry no predictions.

Pure Python and torch-free: the roofline, the simulator and the scheduler share ``Chunk``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Chunk:
    """One request's prompt (or recompute) chunk in a step: ``tokens`` computed after
    ``context`` tokens already in the KV cache (cached prefix, earlier chunks). ``samples``:
    the chunk reaches the request's last token, so its last position goes through the LM head
    (a chunk that stops short of the prompt's end samples nothing)."""

    tokens: int
    context: int = 0
    samples: bool = True


@dataclass(frozen=True)
class StepPrediction:
    flops: float | None
    bytes: float | None
    seconds: float | None  # max(flops / peak, bytes / bandwidth); None without peaks
    compute_dtype: str | None  # whose peak the step's arithmetic is rated at


class StepCoster(Protocol):
    """Prices engine steps; called on the engine thread every step, so it must be quick."""

    def predict(self, chunks: Sequence[Chunk], decodes: Sequence[int]) -> StepPrediction:
        """One step: prompt ``chunks`` and ``decodes`` (each decoding sequence's length with
        its new token), all in one fused pass."""
        ...

    def note(self, max_rows: int) -> str:
        """What the predictions rest on, in words, for a server's start-up log ("" for
        nothing to say); ``max_rows``: the most tokens a step holds."""
        ...


class Unpriced:
    """The engine's cost model when it was given none: no step gets a prediction."""

    _NONE = StepPrediction(None, None, None, None)

    def predict(self, chunks: Sequence[Chunk], decodes: Sequence[int]) -> StepPrediction:
        return self._NONE

    def note(self, max_rows: int) -> str:
        return ""
