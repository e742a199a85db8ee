"""Per-request sampling and stopping settings, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from phasewise.engine.validation import ValidationError

MAX_LOGPROBS = 20
MAX_INT32 = 2**31 - 1  # the bound of every count and id a request can carry
# A seed is an integer that every JSON parser reads exactly (RFC 8259's interoperable range).
MIN_SEED, MAX_SEED = -(2**53 - 1), 2**53 - 1
MAX_STOP_STRINGS = 16
# Dividing logits by a penalty near 0 overflows them to inf (every token ties).
MIN_REPETITION_PENALTY = 0.01
# Temperatures below this are greedy: dividing logits by ~0 would overflow to inf/NaN.
GREEDY_TEMPERATURE = 1e-5


def wrap_seed(seed: int) -> int:
    """``seed`` folded into [MIN_SEED, MAX_SEED] (the j-th of n samples uses seed + j)."""
    return (seed - MIN_SEED) % (MAX_SEED - MIN_SEED + 1) + MIN_SEED


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature`` below 1e-5 (0 included) means greedy. ``top_k`` of 0 or -1 disables
    top-k. ``max_tokens`` of None generates until a stop condition or the model's context
    length; 0 only prefills the prompt (for ``prompt_logprobs``) and finishes with
    ``length`` and no output. ``logprobs`` asks for the top-N log-probabilities of every
    sampled position (computed on the model's raw distribution, before penalties and
    temperature) plus the sampled token's own. ``prompt_logprobs`` asks for the same of every
    prompt position after the first: each prompt token's own log-probability given the tokens
    before it, and the top N there (computed chunk by chunk in prefill; such a request does
    not use the prefix cache, whose blocks hold no logits). ``structured_output`` constrains
    the output to a grammar: the JSON text of a spec (``phasewise.engine.structured``).
    """

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        # Accept a single string / any sequence, store tuples (the dataclass is frozen).
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        # a list or tuple (or None): a set or a dict would be taken by its keys, in no
        # order the client chose
        for name, value in (("stop", stop), ("stop_token_ids", self.stop_token_ids)):
            if value is not None and not isinstance(value, (list, tuple)):
                raise ValidationError(f"{name} must be a list, got {type(value).__name__}",
                                      name)
        object.__setattr__(self, "stop", tuple(stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str, value: Any) -> ValidationError:
            return ValidationError(f"{name} must be {allowed}, got {value!r}", name)

        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: Any) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x

        if self.max_tokens is not None and (not is_int(self.max_tokens)
                                            or not 0 <= self.max_tokens <= MAX_INT32):
            raise bad("max_tokens", f"an integer >= 0 (at most {MAX_INT32}), or unset",
                      self.max_tokens)
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= MAX_INT32:
            raise bad("min_tokens", f"an integer >= 0 (at most {MAX_INT32})", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if not is_num(self.temperature) or not 0 <= self.temperature <= 100:
            raise bad("temperature", "a number in [0, 100]", self.temperature)
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]", self.top_p)
        if not is_int(self.top_k) or not -1 <= self.top_k <= MAX_INT32:
            raise bad("top_k", f"an integer >= 1, or 0 / -1 to disable (at most {MAX_INT32})",
                      self.top_k)
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "a number in [0, 1]", self.min_p)
        if self.seed is not None and (not is_int(self.seed)
                                      or not MIN_SEED <= self.seed <= MAX_SEED):
            raise bad("seed", f"an integer or None (in [{MIN_SEED}, {MAX_SEED}])", self.seed)
        if not is_num(self.repetition_penalty) or not (MIN_REPETITION_PENALTY
                                                       <= self.repetition_penalty <= 10):
            raise bad("repetition_penalty", f"a number in [{MIN_REPETITION_PENALTY}, 10]",
                      self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_num(value) or not -2 <= value <= 2:
                raise bad(name, "a number in [-2, 2]", value)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} strings", len(self.stop))
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", "non-empty strings", s)
        for t in self.stop_token_ids:
            if not is_int(t) or not 0 <= t <= MAX_INT32:
                raise bad("stop_token_ids", f"non-negative integers (at most {MAX_INT32})", t)
        if self.logprobs is not None and (
            not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs", f"an integer in [0, {MAX_LOGPROBS}] or None", self.logprobs)
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise bad("prompt_logprobs", f"an integer in [0, {MAX_LOGPROBS}] or None",
                      self.prompt_logprobs)
        # Flags are booleans, not truthy values: "no" is not False (a relayed request's
        # parameters arrive as JSON, where any value may stand in a flag's place).
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false", getattr(self, name))
        if self.structured_output is not None and not isinstance(self.structured_output, str):
            raise bad("structured_output", "the JSON text of a spec, or None",
                      self.structured_output)
        if self.structured_output is not None:
            from phasewise.engine.structured import check_spec

            check_spec(self.structured_output)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)
