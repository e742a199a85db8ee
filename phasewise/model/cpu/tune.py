"""``phasewise tune``: measure the kernel plan for this machine and one model, once, and store it
where every later engine start with the same key finds it (``phasewise.model.cpu.plan``).

It loads the model as an engine would (dtype, quantization, load format), times the linear
methods on its own weights as engines used to at every start (``LinearDispatch.calibrate``:
the fused layer's few rows over a decode step's whole stream, each other projection shape at
prompt-chunk rows where AMX is among the methods), ``rounds`` times, and keeps the plan most
rounds chose (the first of those tied). The file holds the plan, its key, when it was made,
each round's plan, and every timing's best and spread over the rounds.

Where the rule packs every projection and the LM head into panels nothing reads rows, so
nothing is timed: the stored plan is the rule's, marked so. The decision to pack and the
streams' prefetch distance are the rule's (a plan file may be edited to change them).

Why a command of its own and not ``phasewise measure``: measure's peaks belong to the
machine alone and need no checkpoint; a plan belongs to a machine *and* a model (its shape,
dtype, quantization) and needs the weights loaded, as ``phasewise calibrate`` does.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from phasewise.model.cpu.capabilities import capabilities
from phasewise.model.cpu.linear import LinearDispatch
from phasewise.model.cpu.plan import (
    LinearSpec,
    PlanKey,
    Runtime,
    StoredPlan,
    now_iso,
    plans_dir,
    rule,
    write_plan_file,
)
from phasewise.model.linear_types import Int8Linear

DEFAULT_ROUNDS = 3
MAX_POSITIONS = 4096  # RoPE tables the tuning model builds (no step attends; any length does)


def measure_linear(model: nn.Module, dtype: torch.dtype, panels: bool) -> LinearDispatch:
    """One calibration of the linear plan for ``model`` (its projections in rows): where the
    plan packs the projections (``panels``) only the LM head is left in rows, and is timed
    alone; else the gate/up weights (dequantized, for int8), the fused layer's few rows over
    a decode step's whole stream, and each other projection shape at prompt-chunk rows."""
    if panels:
        return LinearDispatch.calibrate([model.lm_head_weight])
    layers = model.layers
    # (a mixture of experts' sparse layers have no gate/up projection: their q/k/v instead)
    dense = [layer for layer in layers if getattr(layer, "moe", None) is None]
    gate_up = dense[0].gate_up_proj if dense else layers[0].qkv_proj
    if isinstance(gate_up, Int8Linear):  # the plan times bf16 of that shape
        ws = [gate_up.dense().to(dtype)]
    else:  # every layer's, so that few rows time a stream from memory, as decode does
        ws = ([layer.gate_up_proj.weight for layer in dense] if dense
              else [layer.qkv_proj.weight for layer in layers])
    # what a decode step streams, for the fused layer's few rows against AMX (in rows, not
    # int8)
    stream = [lin.weight for layer in layers for lin in layer.projections().values()
              if not isinstance(lin, Int8Linear)]
    plan = LinearDispatch.calibrate(ws, stream=stream)
    # The other projections' shapes at prompt-chunk rows, each its own method, over 8
    # layers' weights (read from memory, as a prompt reads them), bf16 weights only (the
    # gate/up projection's rows take the plan's, fused with the SiLU on AMX).
    for name in ("qkv_proj", "o_proj", "down_proj"):
        lin = getattr(layers[0], name)
        if (not isinstance(lin, Int8Linear)
                and tuple(lin.weight.shape) not in plan.prompt_by_shape):
            plan.calibrate_prompt_shape([getattr(layer, name).weight for layer in layers[:8]])
    return plan


def _timings(rounds: list[LinearDispatch]) -> dict[str, dict[str, dict[str, object]]]:
    """Every timing over the rounds: method -> rows -> best, spread [fastest, slowest] and
    runs, in seconds (a wide spread is a noisy machine: tune again when it is quieter)."""
    seen: dict[str, dict[int, list[float]]] = collections.defaultdict(
        lambda: collections.defaultdict(list))
    for d in rounds:
        for method, by_rows in (d.timings or {}).items():
            for rows, t in by_rows.items():
                seen[method][rows].append(t)
    return {m: {str(r): {"best": min(ts), "spread": [min(ts), max(ts)], "runs": len(ts)}
                for r, ts in sorted(by.items())} for m, by in sorted(seen.items())}


def tune(model_dir: str | Path, *, dtype: str = "auto", quantization: str | None = None,
         load_format: str = "safetensors", seed: int = 0, rounds: int = DEFAULT_ROUNDS,
         out: Path | None = None, progress: Callable[[str], None] | None = None
         ) -> tuple[StoredPlan, Path]:
    """Measure and store the kernel plan of ``model_dir`` loaded as an engine with these
    settings would load it, on torch's threads. Returns the plan and the file written."""
    from phasewise.model.config import ModelConfig
    from phasewise.model.loader import load_model, resolve_dtype

    say = progress or (lambda line: print(f"tune: {line}", file=sys.stderr, flush=True))
    if not isinstance(rounds, int) or isinstance(rounds, bool) or not 1 <= rounds <= 20:
        raise ValueError(f"rounds must be a whole number from 1 to 20; got {rounds!r}")
    if quantization not in (None, "int8"):
        raise ValueError(f"quantization must be int8 or None; got {quantization!r}")
    mc = ModelConfig.from_file(Path(model_dir))
    dt = resolve_dtype(dtype, mc)
    if dt != torch.bfloat16:
        raise ValueError(f"phasewise tune plans the CPU kernels, which run bfloat16 models; "
                         f"this one loads as {str(dt).removeprefix('torch.')} "
                         "(--dtype bfloat16)")
    caps, runtime = capabilities(), Runtime.here()
    key = PlanKey.of(caps, mc, dt, quantization, torch.get_num_threads())
    panels, rule_linear, prefetch, why = rule(key, runtime, caps)
    say(f"{caps.describe()}, {key.threads} threads; rule: {why}")
    if panels and key.head_fits_panels():
        say("every projection and the LM head run in panels: nothing is timed")
        linear = rule_linear
        measured: dict[str, object] = {"rounds": 0, "note": "panels at every row count: "
                                       "nothing reads rows, nothing to time"}
    else:
        model = load_model(Path(model_dir), mc, dtype=dt, device=torch.device("cpu"),
                           max_positions=min(mc.max_position_embeddings, MAX_POSITIONS),
                           quantization=quantization, load_format=load_format, seed=seed)
        done = []
        for r in range(rounds):
            d = measure_linear(model, dt, panels)
            done.append(d)
            say(f"round {r + 1} of {rounds}: {d.describe()}")
        specs = [LinearSpec.of(d) for d in done]
        counts = collections.Counter(specs)
        linear = max(specs, key=lambda s: (counts[s], -specs.index(s)))
        measured = {"rounds": rounds, "plans": [d.describe() for d in done],
                    "chosen": linear.dispatch().describe(),
                    "agreement": f"{counts[linear]} of {rounds}",
                    "rule": rule_linear.dispatch().describe(),
                    "timings_s": _timings(done)}
        del model
    stored = StoredPlan(key=key, panels=panels, linear=linear, stream_prefetch=prefetch,
                        created=now_iso(), measured=measured)
    path = write_plan_file(stored, out or plans_dir() / key.file_name())
    return stored, path
