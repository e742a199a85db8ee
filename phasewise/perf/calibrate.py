"""``phasewise calibrate``: time the real engine over a grid of steps, fit the step cost model,
store it as a profile for this model on this machine.

Each grid point is one engine step with an exact mix, set up without computing what comes
before it: requests are seated in the scheduler with their context already "computed" (blocks
allocated, ``num_computed_tokens`` set; the K/V those blocks hold is whatever the pool holds,
which no step's time depends on). Then ``LLMEngine.step()`` runs as in serving: schedule,
forward pass, sampling, update, and its ``StepStats`` duration is the measurement (decoders
take one untimed step first: see ``measure_point``). The requests are aborted after it, so
every point starts from an empty pool. The grid is timed in rounds, each in a new random
order, and each point keeps the median of its rounds.

The grid (trimmed to the model's context and the pool):

* pure decode: batch 1 to 32 at contexts 128 to 4k;
* pure prefill: chunks of 16 to the budget, after contexts of 0 to 4k;
* mixed: decodes of batch 1 to 32 beside a prompt chunk.

Profiles live in ``<cache>/profiles/<model>@<machine>.json`` (``phasewise calibrate --out``
writes elsewhere); ``phasewise simulate`` and ``plan`` read the one for the model and this
machine. torch is imported only when calibrating.
"""

from __future__ import annotations

import glob
import json
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phasewise.config import usable_cores
from phasewise.engine.step_cost import Chunk
from phasewise.files import write_text_atomic
from phasewise.model.cpu.capabilities import capabilities, isa_family
from phasewise.perf.contention import Contention, CpuSample
from phasewise.perf.costmodel import CostModel, StepMix, fit
from phasewise.perf.hardware import Accelerator, accelerator_from_entry, machine_file
from phasewise.perf.models import ModelShape

PROFILE_VERSION = 1
DECODE_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
CONTEXTS = (128, 512, 1024, 2048, 4096)
CHUNKS = (16, 64, 128, 256, 512)
PREFILL_CONTEXTS = (0, 512, 2048, 4096)
MIXED = ((1, 128), (4, 64), (8, 256), (16, 32), (32, 128), (32, 256))  # (decodes, chunk)
MIXED_CONTEXTS = (128, 2048)


@dataclass(frozen=True)
class GridPoint:
    """``decodes`` sequences decoding at ``decode_context``, beside one prompt chunk of
    ``chunk`` tokens after ``chunk_context`` (0: no chunk)."""

    decodes: int = 0
    decode_context: int = 0
    chunk: int = 0
    chunk_context: int = 0

    def mix(self) -> StepMix:
        chunks = [Chunk(self.chunk, self.chunk_context, True)] if self.chunk else []
        return StepMix(chunks, [self.decode_context] * self.decodes)

    def blocks_held(self, block_size: int) -> int:
        """K/V blocks the point's requests hold once their step is scheduled."""
        per = -(-self.decode_context // block_size)
        return self.decodes * per + -(-(self.chunk_context + self.chunk) // block_size)

    def label(self) -> str:
        parts = []
        if self.decodes:
            parts.append(f"decode b{self.decodes}@{self.decode_context}")
        if self.chunk:
            parts.append(f"chunk {self.chunk}@{self.chunk_context}")
        return " + ".join(parts)


def grid(max_len: int, budget: int, quick: bool = False) -> list[GridPoint]:
    """The calibration grid for a context of ``max_len`` and a step budget of ``budget``."""
    batches = (1, 4, 16) if quick else DECODE_BATCHES
    contexts = [c for c in ((128, 512) if quick else CONTEXTS) if c < max_len]
    pre_ctx = [c for c in ((0, 512) if quick else PREFILL_CONTEXTS) if c < max_len]
    mixed_ctx = [c for c in MIXED_CONTEXTS if c < max_len]
    if not quick and len(contexts) < 3:  # a short-context model: spread them over its own
        contexts = sorted({max(8, max_len * k // 8) for k in (1, 2, 4, 6)})
        pre_ctx = sorted({0, max_len // 4, max_len // 2})
        mixed_ctx = [contexts[0], contexts[-2]]
    chunks = [c for c in ((16, 128) if quick else CHUNKS) if c <= budget] or [budget]
    pts = [GridPoint(b, c) for b in batches for c in contexts]
    pts += [GridPoint(0, 0, n, c) for n in chunks for c in pre_ctx if c + n < max_len]
    for b, n in ((1, 16), (16, 64)) if quick else MIXED:
        for c in (contexts[0], contexts[-1]) if quick else mixed_ctx:
            if c + n < max_len and n <= budget - b:
                pts.append(GridPoint(b, c, n, c))
    return pts


def pool_blocks(points: Sequence[GridPoint], block_size: int, max_len: int) -> int:
    """A pool that holds the largest point (and one sequence of ``max_len``)."""
    need = max(p.blocks_held(block_size) for p in points)
    return max(need, -(-max_len // block_size)) + 8


# -- where profiles live --------------------------------------------------------------------
def machine_id(threads: int | None = None) -> dict[str, Any]:
    """What identifies this machine's speed: CPU model, vector extensions, threads (the
    cores this process may run on, unless an engine runs ``threads``)."""
    caps = capabilities()
    return {"cpu": caps.model_name or platform.machine(), "isa": list(caps.isa),
            "threads": usable_cores() if threads is None else threads}


def machine_slug(m: dict[str, Any] | None = None) -> str:
    """``<cpu>-<kernel family>-<threads>t``: the family named as stored kernel plans name it."""
    m = m or machine_id()
    base = re.sub(r"[^a-z0-9]+", "-", m["cpu"].lower()).strip("-")[:40] or "cpu"
    return f"{base}-{isa_family(m['isa'])}-{m['threads']}t"


def profile_dir() -> Path:
    return machine_file().parent / "profiles"


def profile_path(model_name: str, slug: str | None = None) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model_name)
    return profile_dir() / f"{safe}@{slug or machine_slug()}.json"


def profiles_at_other_threads(model_name: str) -> list[Path]:
    """This model's profiles for this machine calibrated at another thread count
    (``calibrate --threads N``) than the cores this process may run on, by name."""
    here = profile_path(model_name)
    stem = re.sub(r"-\d+t\.json$", "", here.name)
    return sorted(p for p in here.parent.glob(f"{glob.escape(stem)}-*t.json")
                  if p != here and re.fullmatch(r"-\d+t\.json", p.name[len(stem):]))


def load_profile(path: str | Path, shape: ModelShape | None = None) -> CostModel:
    """A stored profile as a ``CostModel`` (``shape``: the model's, when the caller has it;
    else the profile's own)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the profile {p} ({e}); run 'phasewise calibrate'") from e
    if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
        raise ValueError(f"{p} is not a phasewise profile of version {PROFILE_VERSION}; "
                         "run 'phasewise calibrate' again")
    try:
        shape = shape or ModelShape(**data["shape"])
        accel = accelerator_from_entry(data["accelerator"].get("key", "cpu-local"),
                                       data["accelerator"], p)
        return CostModel.from_dict(shape, accel, data["cost_model"])
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"{p} is a damaged profile ({type(e).__name__}: {e}); run "
                         "'phasewise calibrate' again") from e


# -- measuring --------------------------------------------------------------------------------
def _seat(engine: Any, ids: list[int], computed: int, decoding: bool) -> str:
    """A request in ``engine``'s scheduler whose first ``computed`` tokens count as computed:
    a decoder (``decoding``: its last prompt token stands for a sampled one) or a prompt
    whose next chunk is the rest of ``ids``."""
    from phasewise.engine.request import RequestStatus
    from phasewise.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
    rid = engine.add_request(ids[:-1] if decoding else ids, params)
    req = engine.requests[rid]
    sch = engine.scheduler
    sch.waiting.remove(req)
    if decoding:
        req.append_output(ids[-1])
    if not engine.kv.allocate_slots(req, computed):
        raise RuntimeError("the calibration pool is too small for its grid")
    req.num_computed_tokens = computed
    req.status = RequestStatus.RUNNING
    req.metrics.first_scheduled_time = engine.clock()
    sch.running.append(req)
    return rid


def measure_point(engine: Any, pt: GridPoint, rng: Any) -> float:
    """Seconds of one engine step holding exactly ``pt``'s mix.

    The decoders run one untimed step first: a request's first step pays once for what its
    later ones do not (hashing its computed blocks for the prefix cache, starting its
    incremental detokenizer, its sampler's state), and a decode step in serving is almost
    never a request's first. A prompt chunk's step is timed as it comes: in serving it is
    the step that pays those costs."""
    vocab = engine.model_config.vocab_size
    rids = []
    try:
        for _ in range(pt.decodes):
            ids = [rng.randrange(vocab) for _ in range(pt.decode_context - 1)]
            rids.append(_seat(engine, ids, pt.decode_context - 2, True))
        if pt.decodes:
            engine.step()  # untimed; their context is now pt.decode_context
        if pt.chunk:
            ids = [rng.randrange(vocab) for _ in range(pt.chunk_context + pt.chunk)]
            rids.append(_seat(engine, ids, pt.chunk_context, False))
        before = len(engine.step_stats)
        engine.step()
        st = engine.step_stats[-1]
        if len(engine.step_stats) == before or st.num_requests != len(rids):
            raise RuntimeError(f"the step did not hold the grid point {pt.label()}")
        want = (pt.chunk, pt.decodes)
        if (st.num_prefill_tokens, st.num_decode_tokens) != want:
            raise RuntimeError(f"the step held {st.num_prefill_tokens} prompt and "
                               f"{st.num_decode_tokens} decode tokens, not {want}")
        return st.duration_s
    finally:
        for rid in rids:
            engine.abort_request(rid)


def grid_engine(model: str | Path, points: Sequence[GridPoint], max_len: int, budget: int,
                **engine_kwargs: Any) -> Any:
    """An ``LLMEngine`` whose pool and budget hold every one of ``points``, each step priced
    as a served one is (the cost model runs inside the steps it times)."""
    from phasewise.config import EngineConfig
    from phasewise.engine.engine import LLMEngine
    from phasewise.perf.attribution import StepCostModel

    bs = engine_kwargs.get("block_size", 16)
    return LLMEngine(EngineConfig(model=str(model), max_model_len=max_len,
                                  max_num_batched_tokens=budget, max_num_seqs=64,
                                  num_kv_blocks=pool_blocks(points, bs, max_len),
                                  **engine_kwargs), cost_model=StepCostModel.for_engine)


def time_points(engine: Any, points: Sequence[GridPoint], rounds: int, rng: Any,
                say: Callable[[str], None]) -> dict[GridPoint, list[float]]:
    """Each point's step time in each of ``rounds`` rounds over all of them, each round in a
    fresh random order: a machine whose speed drifts over minutes (a shared VM's does, by
    10-20%) then spreads the drift over every point instead of skewing the points timed
    together."""
    times: dict[GridPoint, list[float]] = {p: [] for p in points}
    t0 = time.monotonic()
    for r in range(rounds):
        order = list(points)
        rng.shuffle(order)
        for i, pt in enumerate(order, 1):
            times[pt].append(measure_point(engine, pt, rng))
            if i % 10 == 0 or i == len(order):
                say(f"  round {r + 1}/{rounds}: {i}/{len(order)} steps "
                    f"({time.monotonic() - t0:.0f} s)")
    return times


def calibrate(model: str, *, engine_kwargs: dict[str, Any] | None = None, quick: bool = False,
              reps: int = 3, out: Path | None = None, max_context: int = 4096,
              progress: Callable[[str], None] | None = None) -> tuple[CostModel, Path]:
    """Run the grid on ``model`` with the real engine, fit, write the profile; returns the
    fitted model and where it was written."""
    import random

    from phasewise.perf.attribution import engine_compute_dtype
    from phasewise.perf.measure import ensure_local

    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    shape = ModelShape.from_path(model)
    kw = dict(engine_kwargs or {})
    budget = kw.pop("max_num_batched_tokens", None) or (128 + 32 if quick else 512 + 32)
    limit = shape.max_position_embeddings or max_context
    max_len = min(kw.pop("max_model_len", None) or limit, limit, max_context + budget)
    if max_len <= 64:
        raise ValueError(f"the model's context ({max_len}) is too short to calibrate "
                         "(it needs more than 64 tokens)")
    if budget < 32:
        raise ValueError(f"--max-num-batched-tokens must be >= 32 for the grid, got {budget}")
    if reps < 1:
        raise ValueError(f"--reps must be >= 1, got {reps}")
    points = grid(max_len, budget, quick)
    bs = kw.get("block_size", 16)
    say(f"calibrate: loading {model} ({shape.name}) for a grid of {len(points)} steps x "
        f"{reps} rounds")
    engine = grid_engine(model, points, max_len, budget, **kw)
    device = engine.device.type
    compute_dtype = engine_compute_dtype(engine)
    accel = ensure_local(str(engine.device),
                         tuple(sorted({compute_dtype(r) for r in (1, 16, 256, budget)})))
    rng = random.Random(0)
    for _ in range(2):  # warm-up: first steps pay for allocations and kernel builds
        measure_point(engine, GridPoint(4, min(128, max_len - 1), 16, 16), rng)
    before = CpuSample.now() if device == "cpu" else None
    times = time_points(engine, points, reps, rng, say)
    contention = Contention.between(before, CpuSample.now()) if before is not None else None
    rows = [(p, statistics.median(times[p])) for p in points]
    for p, t in rows:
        say(f"  {p.label():<36} {t * 1e3:9.2f} ms")
    dtype = str(engine.dtype).removeprefix("torch.")
    mid = machine_id(kw.get("num_threads"))  # a profile per thread count
    cm = fit(shape, accel, dtype, [(p.mix(), t) for p, t in rows], compute_dtype,
             source=f"fitted by phasewise calibrate on {time.strftime('%Y-%m-%d %H:%M')}, "
                    f"{mid['cpu'] if device == 'cpu' else device}")
    note_conditions(cm, contention)
    gpu = re.sub(r"[^a-z0-9]+", "-", accel.name.lower()).strip("-")
    path = out or profile_path(Path(model).name, machine_slug(mid) if device == "cpu"
                               else f"{device}-{gpu}")
    write_text_atomic(path, json.dumps({
        "version": PROFILE_VERSION, "model": str(model), "shape": shape.__dict__,
        "machine": mid, "device": device, "accelerator": _accel_entry(accel),
        "engine": {"max_num_batched_tokens": budget, "block_size": bs, **kw},
        "cost_model": cm.to_dict(),
        "grid": [{**p.__dict__, "seconds": t, "runs": times[p],
                  "predicted": cm.step_time(p.mix().chunks, p.mix().decodes)}
                 for p, t in rows],
    }, indent=1))
    return cm, path


# A fit whose median error over the grid is past this did not find one machine's step
# times in the steps (a quiet run's is a few percent).
FIT_DOUBT = 0.15


def note_conditions(cm: CostModel, contention: Contention | None) -> None:
    """Keep in the fit's report the load the grid ran under and, where that load or the
    fit's error says the step times are not this machine's own, why the profile is not
    trusted (``CostModel.describe`` and every command that prints it say so)."""
    fr = cm.fit_report
    reasons = []
    if contention is not None:
        fr["conditions"] = {"others": round(contention.others, 3),
                            "steal": round(contention.steal, 3),
                            "window_s": round(contention.window_s, 1)}
        if contention.shared:
            reasons.append(f"measured while {contention.words()}: its step times include "
                           "that load")
    err = fr.get("median_abs_rel_err")
    if err is not None and err > FIT_DOUBT:
        reasons.append(f"its fit misses the measured steps by a median {err:.0%} (worst "
                       f"{fr.get('max_abs_rel_err', err):.0%}): the steps did not keep one "
                       "speed")
    if reasons:
        fr["unstable"] = "; ".join(reasons)


def _accel_entry(a: Accelerator) -> dict[str, Any]:
    return {"key": a.key, "name": a.name, "peak_flops": dict(a.peak_flops),
            "mem_bytes": a.mem_bytes,
            "mem_bandwidth": a.mem_bandwidth, "source": a.source}


def check_points(cm: CostModel, measured: Sequence[tuple[GridPoint, float]]
                 ) -> list[dict[str, Any]]:
    """Predicted against measured for each point (the validation's per-step table)."""
    out = []
    for p, t in measured:
        mix = p.mix()
        pred = cm.step_time(mix.chunks, mix.decodes)
        out.append({"point": p.label(), "kind": mix.kind, "measured_s": t, "predicted_s": pred,
                    "error": (pred - t) / t})
    return out
