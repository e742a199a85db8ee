"""What a benchmark sends and when: lengths, arrival times, intruders and traces.

Shared by the load generator (``phasewise bench``, which sends it to a server) and the
simulator (``phasewise simulate`` and ``plan``, which replay it in virtual time), so both run
the same requests. Everything here is deterministic given the seed, and imports nothing of the
engine.

Length distributions are written as text on the command line:

* ``256`` or ``fixed:256`` - every request the same;
* ``uniform:128-512`` - integers uniformly in [128, 512];
* ``normal:256,64`` - normal with mean 256 and standard deviation 64, rounded and clipped
  to at least 1 (and to ``max`` when given as ``normal:256,64,max=1024``).

Arrivals: ``request_rate`` requests per second, with gaps drawn from a gamma distribution of
shape ``burstiness`` (1.0 is a Poisson process; below 1 burstier, above 1 more regular), or
all at once when the rate is infinite.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LengthDist:
    kind: str  # "fixed", "uniform" or "normal"
    a: float
    b: float = 0.0
    max: int | None = None

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        t = text.strip().lower()
        allowed = "N, fixed:N, uniform:LO-HI or normal:MEAN,STD[,max=M]"
        if re.fullmatch(r"\d+", t):
            t = "fixed:" + t
        m = re.fullmatch(r"fixed:(\d+)", t)
        if m:
            dist = cls("fixed", float(m.group(1)))
        elif m := re.fullmatch(r"uniform:(\d+)-(\d+)", t):
            dist = cls("uniform", float(m.group(1)), float(m.group(2)))
        elif m := re.fullmatch(r"normal:(\d+(?:\.\d+)?),(\d+(?:\.\d+)?)(?:,max=(\d+))?", t):
            dist = cls("normal", float(m.group(1)), float(m.group(2)),
                       int(m.group(3)) if m.group(3) else None)
        else:
            raise ValueError(f"length distribution must be {allowed}; got {text!r}")
        if dist.a < 1:  # (a normal's mean too: below 1 every draw is clamped to 1)
            raise ValueError(f"lengths must be >= 1; got {text!r}")
        if dist.kind == "normal" and dist.max is not None and dist.max < 1:
            raise ValueError(f"a normal's max must be >= 1; got {text!r}")
        if dist.kind == "uniform" and dist.b < dist.a:
            raise ValueError(f"uniform range must be LO-HI with LO <= HI; got {text!r}")
        return dist

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        n = max(1, round(rng.gauss(self.a, self.b)))
        return min(n, self.max) if self.max is not None else n

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}-{int(self.b)}"
        return f"normal:{self.a:g},{self.b:g}" + (f",max={self.max}" if self.max else "")


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload. ``prompt`` is set when it comes from a trace with text."""

    index: int
    arrival: float  # seconds after the start of the run
    prompt_len: int
    output_len: int
    intruder: bool = False
    prompt: str | None = None


def arrival_times(n: int, request_rate: float, burstiness: float,
                  rng: random.Random) -> list[float]:
    """Offsets (s) of ``n`` arrivals: gamma-distributed gaps with mean 1/rate."""
    if n < 0:
        raise ValueError(f"number of requests must be >= 0, got {n}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"request rate must be > 0 (inf: all at once), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * n
    scale = 1.0 / (request_rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, scale)
    return out


def build_workload(num_requests: int, input_len: LengthDist, output_len: LengthDist, *,
                   request_rate: float = math.inf, burstiness: float = 1.0,
                   intruder_fraction: float = 0.0, intruder_len: LengthDist | None = None,
                   seed: int = 0) -> list[RequestSpec]:
    """A synthetic workload. With ``intruder_fraction`` > 0, that share of the requests (as
    close as rounding allows, spread by the seed) get ``intruder_len`` prompts instead: long
    prompts mixed into short chats, the case that makes prefill stall decode."""
    if not 0.0 <= intruder_fraction <= 1.0:
        raise ValueError(f"intruder fraction must be in [0, 1], got {intruder_fraction}")
    if intruder_fraction > 0 and intruder_len is None:
        raise ValueError("an intruder fraction needs an intruder length")
    # Separate streams: the same seed gives the same lengths and intruders at every rate, so
    # the points of a sweep differ only in their arrival times.
    rng = random.Random(seed)
    arrivals = arrival_times(num_requests, request_rate, burstiness, random.Random(seed + 1))
    n_intruders = round(intruder_fraction * num_requests)
    intruders = set(rng.sample(range(num_requests), n_intruders)) if n_intruders else set()
    specs = []
    for i, t in enumerate(arrivals):
        is_intruder = i in intruders
        dist = intruder_len if is_intruder and intruder_len is not None else input_len
        specs.append(RequestSpec(i, t, dist.sample(rng), output_len.sample(rng), is_intruder))
    return specs


def _count(value: object, name: str) -> int:
    """A trace's token count: an integer (a float only where it is one: 7.0, not 7.9; a
    string of digits, as traces written by other tools may hold)."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not value.is_integer()):
        raise TypeError(f"{name} must be a whole number of tokens, got {value!r}")
    return int(value)


# A workload's requests are built in memory before the first is sent (or simulated): a
# million is minutes of simulation and a few hundred MB; past it a typo (1e8) would only
# exhaust the machine.
MAX_NUM_PROMPTS = 1_000_000


def workload_lengths(a: Any) -> list[LengthDist]:
    """The workload flags' length distributions (``--input-len``, ``--output-len``,
    ``--intruder-len``), an error naming the flag; ``--num-prompts`` and
    ``--intruder-fraction`` checked too."""
    if not 1 <= a.num_prompts <= MAX_NUM_PROMPTS:
        raise ValueError(f"--num-prompts must be in 1..{MAX_NUM_PROMPTS}, got {a.num_prompts}")
    dists = []
    for flag, text in (("--input-len", a.input_len), ("--output-len", a.output_len),
                       ("--intruder-len", a.intruder_len)):
        try:
            dists.append(LengthDist.parse(text))
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
    if not 0 <= a.intruder_fraction <= 1:
        raise ValueError(f"--intruder-fraction is a share of the requests: in [0, 1], got "
                         f"{a.intruder_fraction}")
    return dists


def check_fits(specs: Sequence[RequestSpec], context: int, trace: bool = False,
               whose: str = "the server's") -> None:
    """Refuse, before anything is sent or simulated, a workload whose requests a server
    would refuse: a prompt and its output longer than the context (``max_model_len``;
    ``whose``: the server's, or the simulated engine's). Names the flag at fault (the
    intruders' length, the prompts' and outputs', or the trace). A trace's text prompts are
    not counted here (their length is the tokenizer's to tell)."""
    over = [s for s in specs if s.prompt is None and s.prompt_len + s.output_len > context]
    if not over:
        return
    worst = max(over, key=lambda s: s.prompt_len + s.output_len)
    flag = ("the trace's lengths" if trace else "--intruder-len"
            if all(s.intruder for s in over) else "--input-len or --output-len")
    raise ValueError(
        f"{len(over)} of the {len(specs)} requests would not fit {whose} context of "
        f"{context} tokens (the longest: a {worst.prompt_len}-token prompt and "
        f"{worst.output_len} output tokens); lower {flag} so that a prompt and its output "
        f"stay within {context} tokens")


# A trace line's most characters: a request with its prompt's text (a long prompt is
# hundreds of KB); a file without line breaks would otherwise be read whole into one line.
MAX_TRACE_LINE = 16 * 2**20


# bytes that were not UTF-8, as errors="surrogateescape" decodes them
_NOT_UTF8 = re.compile("[\udc80-\udcff]")


def _trace_lines(path: str | Path):
    """(line number, text) of each line of the trace, each at most ``MAX_TRACE_LINE``
    characters, at most ``MAX_NUM_PROMPTS`` non-empty ones; errors name the file. A line ends
    at LF, CRLF or a lone CR, as editors on every system write them (JSON text holds no raw
    CR inside a string, so a CR can only end a line or be blank space)."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape", newline=None) as f:
            lineno = requests = 0
            while True:
                # bounded: a file with no line break (/dev/zero) is not read whole
                text = f.readline(MAX_TRACE_LINE + 1)
                if not text:
                    return
                lineno += 1
                if len(text.rstrip("\n")) > MAX_TRACE_LINE:
                    raise ValueError(f"{path}:{lineno}: a line longer than "
                                     f"{MAX_TRACE_LINE // 2**20} Mi characters; a trace holds "
                                     "one JSON object a line")
                bad = _NOT_UTF8.search(text)
                if bad is not None:
                    raise ValueError(f"{path}:{lineno}: not UTF-8 text (column "
                                     f"{bad.start() + 1})")
                if text.strip():
                    requests += 1
                    if requests > MAX_NUM_PROMPTS:
                        raise ValueError(f"{path}: more than {MAX_NUM_PROMPTS} requests; "
                                         "split the trace")
                yield lineno, text
    except FileNotFoundError:
        raise FileNotFoundError(f"no such trace file: {path}") from None


def load_trace(path: str | Path, time_scale: float = 1.0) -> list[RequestSpec]:
    """A JSONL trace, one request per line: ``{"arrival": s, "prompt_len": n | "prompt":
    text, "output_len": n}`` (``timestamp``/``input_length``/``output_length`` are accepted
    as aliases). Arrivals are sorted and shifted to start at 0, then multiplied by
    ``time_scale``."""
    specs = []
    if Path(path).is_dir():
        raise ValueError(f"--trace {path}: a folder, not a JSONL file")
    for lineno, line in _trace_lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise TypeError(f"got a {type(row).__name__}")
            arrival = float(row.get("arrival", row.get("timestamp", 0.0)))
            prompt = row.get("prompt")
            plen = row.get("prompt_len", row.get("input_length"))
            olen = row.get("output_len", row.get("output_length"))
            if olen is None:
                raise TypeError("no output_len")
            olen = _count(olen, "output_len")
            plen = None if plen is None else _count(plen, "prompt_len")
            if prompt is not None and not isinstance(prompt, str):
                raise TypeError(f"prompt must be text, got a {type(prompt).__name__}")
        except (ValueError, TypeError, OverflowError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}:{lineno}: each line must be a JSON object with "
                             f"arrival, prompt_len (or prompt) and output_len: {e}") from e
        if not math.isfinite(arrival):
            raise ValueError(f"{path}:{lineno}: arrival must be a finite number of "
                             f"seconds, got {arrival}")
        if prompt is None and plen is None:
            raise ValueError(f"{path}:{lineno}: give prompt_len or prompt")
        if olen < 1 or (plen is not None and plen < 1):
            raise ValueError(f"{path}:{lineno}: lengths must be >= 1")
        specs.append((arrival, prompt, plen if plen is not None else 0, olen))
    if not specs:
        raise ValueError(f"{path}: the trace holds no request")
    specs.sort(key=lambda s: s[0])
    t0 = specs[0][0]
    return [RequestSpec(i, (a - t0) * time_scale, plen, olen, prompt=prompt)
            for i, (a, prompt, plen, olen) in enumerate(specs)]
