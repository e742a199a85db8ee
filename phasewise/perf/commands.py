"""The work behind ``phasewise calibrate``, ``simulate`` and ``plan`` (``phasewise.cli`` parses
their flags and calls these). What is modelled, and from where:

* the model: a catalog name (``phasewise roofline --list``) or a checkpoint folder;
* the machine: a catalog accelerator, or ``cpu-local`` / ``gpu-local`` (this machine as
  ``phasewise measure`` measured it);
* the step costs: ``--profile FILE``, else the profile ``phasewise calibrate`` stored for
  this model on this machine (``cpu-local``), else efficiencies assumed for the accelerator
  (said on the first line of the output).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phasewise.engine.slo import SLO
from phasewise.perf.costmodel import CostModel
from phasewise.perf.explain import unstable_note
from phasewise.perf.models import ModelShape, lookup_model
from phasewise.perf.roofline import DTYPE_BYTES, norm_dtype
from phasewise.perf.simulate import Deployment, EngineSpec, simulate
from phasewise.perf.summary import parse_slo, save_result, text_table
from phasewise.perf.workload import (RequestSpec, build_workload, check_fits, load_trace,
                                     workload_lengths)

CPU_STEP_TOKENS, GPU_STEP_TOKENS = 256, 2048  # the engine's default step budgets
DEFAULT_CONTEXT = 4096  # a catalog model's context where its config gives none
MAX_PLAN_REQUESTS = 20_000  # per simulated rate in plan's search


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def model_shape(model: str) -> ModelShape:
    p = Path(model)
    if p.exists():
        return ModelShape.from_path(p)
    return lookup_model(model)


def cost_model(model: str, gpu: str, profile: str | None, dtype: str = "bf16"
               ) -> CostModel:
    """The step cost model for ``model`` on ``gpu`` (see the module)."""
    from phasewise.perf.calibrate import load_profile, profile_path, profiles_at_other_threads
    from phasewise.perf.hardware import lookup_accelerator

    shape = model_shape(model)
    if profile is not None:
        if not profile:
            raise ValueError("--profile: an empty path (leave the flag out for the stored "
                             "profile)")
        return load_profile(profile, shape)
    others: list[Path] = []
    if gpu == "cpu-local":
        name = Path(model).name if Path(model).exists() else model
        stored = profile_path(name)
        if stored.exists():
            return load_profile(stored, shape)
        others = profiles_at_other_threads(name)
        if len(others) == 1:  # calibrate --threads N: the only one there is
            cm = load_profile(others[0], shape)
            cm.source += (f" (from {others[0].name}, calibrated at another thread count "
                          "than this machine's cores: --profile FILE chooses)")
            return cm
    accel = lookup_accelerator(gpu)
    compute = None
    if gpu == "cpu-local" and norm_dtype(dtype) != "fp32":
        # no native bf16 math on many CPUs: rate at the faster peak (fp32 weights run fp32
        # arithmetic, whichever peak is faster)
        compute = max(accel.peak_flops, key=accel.peak_flops.get)
    cm = CostModel(shape, accel, dtype, compute_dtype=compute)
    if gpu == "cpu-local":
        cm.source = ("assumed efficiencies: no profile for this model on this machine "
                     "('phasewise calibrate' fits one)" if not others else
                     "assumed efficiencies: this model's profiles here were calibrated at "
                     f"other thread counts ({', '.join(p.name for p in others)}); "
                     "--profile FILE picks one")
        noisy = unstable_note(accel, norm_dtype(compute or dtype))
        if noisy:
            cm.source += f"; {noisy}"
    return cm


@dataclass(frozen=True)
class _ShapeLimits:
    """The engine's context limits for a model known by its shape alone (a catalog entry, or a
    checkpoint phasewise serve cannot load); ``kv_window``: its sliding window where every
    layer has it (``ContextLimits``)."""

    architecture: str
    max_position_embeddings: int
    kv_window: int | None = None


def _context_limits(shape: ModelShape, model: str | None, max_model_len: int | None
                    ) -> tuple[Any, str]:
    """What the engine's sizing reads of the model, and a note where it is not the
    checkpoint's own ``ModelConfig``."""
    from phasewise.model.config import ModelConfig

    note = ""
    if model and Path(model).exists():
        try:
            return ModelConfig.from_file(model), ""
        except (ValueError, KeyError, TypeError) as e:
            note = f"; phasewise serve cannot load {model} ({e}): sized from its shape"
    mpe = shape.max_position_embeddings
    if mpe is None:
        mpe = max_model_len or DEFAULT_CONTEXT
        note += (f"; {shape.name}'s context length is not known: "
                 f"{'--max-model-len' if max_model_len else f'{mpe} tokens assumed'}")
    shared = shape.sliding_window if shape.window_layers == shape.num_layers else None
    return _ShapeLimits(shape.name, int(mpe), shared), note


def kv_element_bytes(cm: CostModel) -> int:
    """Bytes of one K/V element as the engine stores it: the model's dtype, and 16-bit
    under weight-only quantization (the activations', as ``--quantization int8``)."""
    from phasewise.perf.roofline import WEIGHT_ONLY_DTYPES

    return 2 if cm.dtype in WEIGHT_ONLY_DTYPES else int(cm.wbytes)


def engine_spec(cm: CostModel, a: argparse.Namespace, model: str | None = None) -> EngineSpec:
    """One engine's limits, its K/V pool sized as ``phasewise serve`` sizes it
    (``phasewise.engine.kv_sizing``: the same ``KVPlan``) from the same flags; ``model``: the
    checkpoint folder or catalog name (a folder's ``config.json`` gives the context limits)."""
    from phasewise.config import EngineConfig
    from phasewise.engine.kv_sizing import (
        CUDA_FREE_FRACTION,
        DEFAULT_CPU_KV_MEMORY,
        KVPlan,
    )

    if a.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {a.block_size}")
    cpu = cm.accel.key == "cpu-local" or cm.accel.key.startswith("cpu")
    limits, note = _context_limits(cm.shape, model, a.max_model_len)
    config = EngineConfig(model=model or cm.shape.name, max_model_len=a.max_model_len,
                          block_size=a.block_size, kv_cache_memory=a.kv_cache_memory or None,
                          max_num_seqs=a.max_num_seqs,
                          max_num_batched_tokens=a.max_num_batched_tokens, policy=a.policy,
                          enable_prefix_caching=not a.no_prefix_caching)
    # (the shape's own K/V bytes: a latent-attention model stores no per-head K/V)
    bb = int(cm.shape.kv_bytes_per_token(kv_element_bytes(cm))) * a.block_size
    plan = KVPlan.plan(config, limits, bb, "cpu" if cpu else "cuda")
    weights = cm.shape.total_params * cm.wbytes
    if cm.accel.mem_bytes > 0 and weights + bb > cm.accel.mem_bytes:
        raise ValueError(f"{cm.shape.name}'s weights ({_gib(weights)}) do not fit in "
                         f"{cm.accel.name}'s memory ({_gib(cm.accel.mem_bytes)}) with room "
                         "for K/V")
    if config.kv_cache_memory is not None:
        what = f"--kv-cache-memory {config.kv_cache_memory}"
    elif cpu:
        what = f"{_gib(DEFAULT_CPU_KV_MEMORY)}, the engine's default on a CPU"
    else:
        free = cm.accel.mem_bytes - weights
        plan = plan.on_free(int(free), config, limits)
        what = (f"an estimate: {CUDA_FREE_FRACTION:.0%} of the {free / 1e9:.1f} GB that "
                f"{weights / 1e9:.1f} GB of weights leave of {cm.accel.name}'s "
                f"{cm.accel.mem_bytes / 1e9:.0f} GB, where the engine takes {CUDA_FREE_FRACTION:.0%} "
                "of what CUDA reports free after loading, less by the CUDA context and other "
                "processes (--kv-cache-memory sizes it exactly)")
    blocks = plan.num_blocks
    assert blocks is not None
    if blocks == plan.most_blocks:
        what += (f", capped at what {config.max_num_seqs} sequences of {plan.max_model_len} "
                 "tokens could use")
    source = (f"{blocks} blocks of {a.block_size} tokens, {bb / 2**10:g} KiB a block "
              f"({_gib(blocks * bb)}) from {what}; as phasewise serve sizes it{note}")
    served = getattr(limits, "dtype", None)  # a checkpoint's: serve's --dtype auto loads it
    if served is not None:
        served = served if served in ("float32", "bfloat16", "float16") else "float32"
    if served is not None and DTYPE_BYTES[norm_dtype(served)] != kv_element_bytes(cm):
        source += (f"; K/V at --dtype {cm.dtype}, where phasewise serve's default is the "
                   f"checkpoint's {served}")
    budget = a.max_num_batched_tokens or (CPU_STEP_TOKENS if cpu else GPU_STEP_TOKENS)
    return EngineSpec(num_kv_blocks=blocks, max_num_batched_tokens=budget,
                      max_num_seqs=a.max_num_seqs, max_model_len=plan.max_model_len,
                      policy=a.policy, block_size=a.block_size,
                      enable_prefix_caching=not a.no_prefix_caching, kv_source=source,
                      kv_window=limits.kv_window)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def deployment(a: argparse.Namespace) -> Deployment:
    """``simulate``'s deployment; a flag of the other mode is refused, not ignored (None: a
    flag not given)."""
    from phasewise.perf.hardware import sim_link

    flags = {"colocated": (("--replicas", a.replicas), ("--fail-at", a.fail_at)),
             "pd": (("--prefill", a.prefill), ("--decode", a.decode),
                    ("--disagg-threshold", a.disagg_threshold), ("--link", a.link),
                    ("--prefill-queue-limit", a.prefill_queue_limit))}
    other = "pd" if a.mode == "colocated" else "colocated"
    wrong = [f for f, v in flags[other] if v is not None]
    if wrong:
        raise ValueError(f"{', '.join(wrong)}: for --mode {other}, not --mode {a.mode}; give "
                         f"--mode {other}, or leave {'it' if len(wrong) == 1 else 'them'} out")
    if a.trace is None and a.trace_time_scale != 1.0:
        raise ValueError("--trace-time-scale scales a trace's arrivals: give --trace")
    link = sim_link(a.link)
    # the flags given; Deployment's own defaults stand for the rest
    given = {k: v for k, v in (("replicas", a.replicas), ("prefill", a.prefill),
                               ("decode", a.decode), ("threshold", a.disagg_threshold),
                               ("prefill_queue_limit", a.prefill_queue_limit))
             if v is not None}
    return Deployment(a.mode, link=link, admission=admission_of(a), routing=a.routing,
                      fail_at=a.fail_at, **given)


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def admission_of(a: argparse.Namespace) -> SLO | None:
    """``--slo-admission``: the --goodput targets as every request's SLO, or None."""
    if not getattr(a, "slo_admission", False):
        return None
    slo = parse_slo(a.goodput)
    if not {"ttft", "tpot"} & set(slo):
        raise ValueError("--slo-admission admits by the --goodput targets: give --goodput "
                         "ttft:MS and/or tpot:MS")
    return SLO.from_ms(slo.get("ttft"), slo.get("tpot"))


def workload_maker(a: argparse.Namespace, model: str):
    """``make(rate, n=None)``: the workload flags' requests at ``rate`` (a trace: as given)."""
    dists = workload_lengths(a)
    trace = _trace(a.trace, a.trace_time_scale, model) if a.trace else None

    def make(rate: float, n: int | None = None) -> list[RequestSpec]:
        if trace is not None:
            return trace
        return build_workload(n or a.num_prompts, dists[0], dists[1], request_rate=rate,
                              burstiness=a.burstiness, intruder_fraction=a.intruder_fraction,
                              intruder_len=dists[2], seed=0 if a.seed is None else a.seed)
    return make


def _trace(path: str, scale: float, model: str) -> list[RequestSpec]:
    specs = load_trace(path, scale)
    if any(s.prompt is not None and not s.prompt_len for s in specs):
        tok = Path(model) / "tokenizer.json"
        if not tok.exists():
            raise ValueError(f"{path} gives prompts as text: simulating needs their lengths "
                             "(prompt_len), or --model a checkpoint folder with a tokenizer")
        from tokenizers import Tokenizer

        t = Tokenizer.from_file(str(tok))
        specs = [s if s.prompt is None or s.prompt_len else
                 RequestSpec(s.index, s.arrival, len(t.encode(s.prompt).ids), s.output_len,
                             s.intruder) for s in specs]
    return specs


# -- phasewise simulate -----------------------------------------------------------------------
def run_simulate(a: argparse.Namespace, model: str,
                 served: Callable[[Any], Any] | None = None) -> int:
    """``served``: makes the cost model the live server's (``--served``: a probe through
    it, ``phasewise.perf.served``), or None."""
    cm = cost_model(model, a.gpu, a.profile, a.dtype)
    if served is not None:
        cm = served(cm)
    eng = engine_spec(cm, a, model)
    dep = deployment(a)
    slo = parse_slo(a.goodput)
    make = workload_maker(a, model)
    label = a.label or "phasewise-simulate"
    for line in cm.describe():
        print(line)
    print(f"deployment: {dep.describe()}; per engine: {eng.policy}, budget "
          f"{eng.max_num_batched_tokens} tokens, {eng.max_num_seqs} sequences, "
          f"{eng.num_kv_blocks} K/V blocks of {eng.block_size}, context {eng.max_model_len}")
    print(f"K/V pool: {eng.kv_source}")
    sweep = len(a.request_rate) > 1
    for rate in a.request_rate:
        if not rate > 0:
            raise ValueError(f"--request-rate values must be > 0 (or inf), got {rate}")
        specs = make(rate)
        check_fits(specs, eng.max_model_len, trace=bool(a.trace), whose="the engine's")
        t0 = time.monotonic()
        out = simulate(cm, eng, dep, specs, slo or None, progress=_say)
        wall = time.monotonic() - t0
        out.update({"label": label, "request_rate": rate if math.isfinite(rate) else "inf",
                    "num_prompts": len(specs), "seed": 0 if a.seed is None else a.seed,
                    "input_len": a.input_len,
                    "output_len": a.output_len, "intruder_fraction": a.intruder_fraction,
                    "intruder_len": a.intruder_len if a.intruder_fraction else None,
                    "trace": a.trace, "sweep": sweep, "model_id": model,
                    "date": time.strftime("%Y%m%d-%H%M%S"), "simulation_wall_s": wall})
        rate_text = "a trace's arrivals" if a.trace else f"request rate {rate:g} req/s"
        print(f"\n==== {label}: {rate_text} ({len(specs)} requests; the simulation took "
              f"{wall:.2f} s of wall time) ====")
        print(text_table(out))
        doubt = doubt_line(cm)
        if doubt:
            print(doubt)
        sim = out["simulated"]
        if "migrated" in sim:
            print(f"replica 0 failed at {dep.fail_at:g} s: {sim['migrated']} request(s) "
                  "moved to the others, each recomputing its prompt and outputs there")
        elif dep.fail_at is not None:
            print(f"replica 0 was to fail at {dep.fail_at:g} s, after the run had ended: "
                  "nothing failed")
        adm = sim.get("admission")
        if adm is not None:
            why = ", ".join(f"{n} {r}" for r, n in sorted(adm["by_reason"].items())) or "none"
            met = adm["admitted_met_slo"]
            which = ("both SLOs" if {"ttft", "tpot"} <= set(slo)
                     else "the " + "/".join(k.upper() for k in slo) + " SLO")
            print(f"SLO admission: {adm['refused']} refused ({why}), {adm['admitted']} "
                  f"admitted" + ("" if met is None else f", of which {met:.1%} met {which}"))
        for w in sim["workers"]:
            steps = ", ".join(f"{n} {kind}" for kind, n in w["steps"].items())
            print(f"{w['name']:<14} {w['role']:<8} busy {w['utilization']:6.1%}  steps: "
                  f"{steps}; preemptions {w['preemptions']}")
        if dep.mode == "pd":
            local = sim["local_prefills"]
            why = ", ".join(f"{n} {reason.replace('_', ' ')}" for reason, n in
                            sorted(local.items())) if local else "none"
            print(f"remote prefills {sim['remote_prefills']}, local {sum(local.values())} "
                  f"({why}), "
                  f"mean K/V hand-off after the prefill: {_ms(sim['mean_transfer_wait_ms'])} "
                  f"(the last K/V byte's wait over "
                  f"{dep.link.key if dep.link else 'an instant link (--link names one)'}, "
                  f"plus {dep.handoff_s * 1e3:g} ms fixed)")
        save_result(a, out, label, rate, sweep)
    return 0


def doubt_line(cm: CostModel) -> str | None:
    """A line to print under predicted figures where the cost model's own header warned
    about them (an untrusted profile, or peaks measured unstable), since readers go to the
    figures and not the header; None where it did not."""
    fr = cm.fit_report or {}
    if cm.knots and fr.get("unstable"):
        why = "from a profile that is not trusted"
    elif not cm.knots and "UNSTABLE" in cm.source:
        why = "from peaks measured UNSTABLE"
    else:
        return None
    return (f"caveat: these figures come {why}, as the cost model's lines above say; "
            "they may be far from what this machine serves")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} ms"


# -- phasewise plan ---------------------------------------------------------------------------
def run_plan(a: argparse.Namespace, model: str,
             served: Callable[[Any], Any] | None = None) -> int:
    from phasewise.perf.plan import Workload, search, size, table

    slo = parse_slo(a.goodput)
    if not {"ttft", "tpot"} <= set(slo):
        raise ValueError("plan needs both SLOs: --goodput ttft:MS tpot:MS")
    cm = cost_model(model, a.gpu, a.profile, a.dtype)
    if served is not None:
        cm = served(cm)
    eng = engine_spec(cm, a, model)
    make = workload_maker(a, model)
    if len(a.request_rate) != 1:
        raise ValueError("plan takes one --request-rate: the traffic to size for (inf: size "
                         "nothing)")
    rate = a.request_rate[0]
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf: size nothing), got {rate}")
    if a.trace or a.trace_time_scale != 1.0:
        raise ValueError("plan searches over request rates, which a trace fixes: give the "
                         "workload as lengths and a rate (simulate takes --trace and "
                         "--trace-time-scale)")
    window = a.window
    check_plan_flags(a)  # before a search of minutes, not after it

    def at(r: float) -> list[RequestSpec]:
        # Enough requests that the rate holds for the window (a burst would measure a queue
        # draining instead, and flatter whichever deployment spreads it over more workers):
        # at least --num-prompts, at most MAX_PLAN_REQUESTS.
        n = min(max(a.num_prompts, math.ceil(r * window)), MAX_PLAN_REQUESTS)
        return make(r, n)

    wl = Workload(at, rate if math.isfinite(rate) else None)
    from phasewise.perf.hardware import sim_link

    link = sim_link(a.link)
    for line in cm.describe():
        print(line)
    print(f"K/V pool per engine: {eng.kv_source}")
    budgets = sorted(set(a.budgets))
    if any(b < 1 for b in budgets):
        raise ValueError(f"--budgets must be >= 1, got {budgets}")
    cands = search(cm, eng, wl, slo, budgets=budgets,
                   ratios=_ratios(_given(a.ratios, PLAN_RATIOS)),
                   thresholds=sorted(set(_given(a.thresholds, PLAN_THRESHOLDS))), link=link,
                   pd=not a.no_pd,
                   queue_limit=_given(a.prefill_queue_limit, Deployment.prefill_queue_limit),
                   progress=_say)
    print(f"\nSLO: TTFT <= {slo['ttft']:g} ms and TPOT <= {slo['tpot']:g} ms for >= 90% of "
          "requests (DistServe's goodput); per accelerator: goodput / accelerators")
    print(table(cands))
    doubt = doubt_line(cm)
    if doubt:
        print(doubt)
    if link is None and any(c.deployment.mode == "pd" for c in cands):
        print("P/D rows move K/V over an instant link (--link instant, the default): each "
              "hand-off costs "
              f"its fixed {Deployment.handoff_s * 1e3:g} ms only, which flatters P/D wherever "
              "the real link is slower; --link names the one the workers would use")
    best = cands[0]
    if best.goodput <= 0:
        print("\nno deployment meets the SLO at any rate: loosen the SLO or use a faster "
              "accelerator")
        return 1
    print(f"\nbest: {best.label()}: {best.per_accelerator:.3g} req/s per accelerator")
    from phasewise.perf.plan import cheapest_for, units_for

    pick = cheapest_for(cands, wl.rate) or best
    if pick is not best:  # a low rate: a smaller unit of less goodput each is enough
        need = units_for(best, wl.rate) * best.accelerators
        print(f"for {rate:g} req/s fewer accelerators do: {pick.label()} "
              f"({pick.goodput:.3g} req/s a unit of {pick.accelerators}) needs "
              f"{units_for(pick, wl.rate) * pick.accelerators}, the best per accelerator "
              f"{need}")
    best = pick
    sized = size(best, wl, cm, slo)
    short = sized is not None and sized.attainment < 0.9
    dep = best.deployment
    if sized is not None:
        dep = sized.deployment
        print(f"for {rate:g} req/s: {sized.units} unit(s): {dep.describe()}, "
              f"{dep.accelerators} accelerators; simulated at that rate "
              f"{sized.attainment:.0%} of requests meet both SLOs "
              f"(TTFT p90 {sized.result['p90_ttft_ms']:.0f} ms, TPOT p90 "
              f"{sized.result['p90_tpot_ms']:.1f} ms)"
              + ("; that is still short of 90%: more units, or a looser SLO" if short else ""))
    admission = admission_of(a)
    if admission is not None:
        from phasewise.perf.plan import admission_table, compare_admission

        _say(f"comparing {best.label()} with and without SLO admission")
        rows = compare_admission(best, wl, cm, slo, admission)
        print("\none unit of the winner past its goodput, without and with admission by SLO "
              "(serve --slo-ttft-ms/--slo-tpot-ms at the --goodput targets); goodput: "
              "requests a second that met both SLOs; met: their share of all requests; "
              "admitted met: of those admitted:")
        print(admission_table(rows))
    if a.k8s_out:
        paths = write_manifests(a, model, best, dep, cm)
        print(f"Kubernetes manifests written to {', '.join(map(str, paths))}")
    return 1 if short else 0


def _ratios(items: list[str]) -> list[tuple[int, int]]:
    out = []
    for item in items:
        p, sep, d = item.partition(":")
        if not sep or not p.isdigit() or not d.isdigit() or int(p) < 1 or int(d) < 1:
            raise ValueError(f"--ratios takes P:D pairs of integers >= 1, e.g. 1:1 2:1; "
                             f"got {item!r}")
        out.append((int(p), int(d)))
    return out


# plan's P/D candidates: their defaults, given where the flag was not (the flags default to
# None, so that one that would be ignored is refused instead)
PLAN_RATIOS = ("1:1", "1:2", "2:1", "1:3", "3:1")
PLAN_THRESHOLDS = (0, 512, 1024)
_MANIFEST_FLAGS = ("name", "namespace", "image", "model_pvc", "model_path", "cpus",
                   "api_key_secret")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_plan_flags(a: argparse.Namespace) -> None:
    """plan's flags that would be ignored are refused by name (--no-pd with a P/D flag, a
    manifest flag without --k8s-out); the manifests' flags are checked as the manifests
    will check them, and given their defaults."""
    if a.no_pd:
        pd = [_flag(d) for d in ("ratios", "thresholds", "link", "prefill_queue_limit")
              if getattr(a, d) is not None]
        if pd:
            raise ValueError(f"--no-pd searches co-located deployments only: {', '.join(pd)} "
                             "would be ignored; drop --no-pd or "
                             + ("them" if len(pd) > 1 else "it"))
    given = [_flag(d) for d in _MANIFEST_FLAGS if getattr(a, d) is not None]
    if not a.k8s_out:
        if given:
            raise ValueError(f"{', '.join(given)} shape{'' if len(given) > 1 else 's'} the "
                             "Kubernetes manifests, which plan writes only with --k8s-out DIR")
        return
    from phasewise.perf.k8s import DEFAULT_RESOURCES, DeploySpec

    # the manifests' own defaults stand for the flags not given (None)
    defaults = {"name": DeploySpec.name, "image": DeploySpec.image,
                "model_pvc": DeploySpec.model_pvc,
                "cpus": int(DEFAULT_RESOURCES["both"].cpu)}
    for dest, default in defaults.items():
        if getattr(a, dest) is None:
            setattr(a, dest, default)
    check_manifest_flags(a)


def check_manifest_flags(a: argparse.Namespace) -> None:
    """The manifests' flags, each checked as the manifests will check it, and refused by
    its flag name (ValueError)."""
    from phasewise.perf.k8s import DeploySpec, RoleResources

    checks = (("--cpus", lambda: RoleResources(cpu=str(a.cpus), memory="1Gi")),
              ("--name", lambda: DeploySpec(model_path="/models/m", name=a.name)),
              ("--namespace", lambda: DeploySpec(model_path="/models/m",
                                                 namespace=a.namespace)),
              ("--image", lambda: DeploySpec(model_path="/models/m", image=a.image)),
              ("--model-pvc", lambda: DeploySpec(model_path="/models/m",
                                                 model_pvc=a.model_pvc)),
              ("--api-key-secret", lambda: DeploySpec(model_path="/models/m",
                                                      api_key_secret=a.api_key_secret)),
              ("--model-path", lambda: a.model_path is None
               or DeploySpec(model_path=a.model_path)))
    for flag, check in checks:
        try:
            check()
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None


def write_manifests(a: argparse.Namespace, model: str, best: Any, dep: Deployment,
                    cm: CostModel) -> list[Path]:
    from phasewise.perf.k8s import DeploySpec, RoleResources, write

    eng = best.engine  # the winner's policy and budget, not the flags' defaults
    gpu = 0 if cm.accel.key.startswith("cpu") else 1
    # Host memory: on a CPU the weights and the K/V pool live there; on a GPU only a copy of
    # the weights passes through while loading.
    per_block = int(cm.shape.kv_bytes_per_token(kv_element_bytes(cm))) * eng.block_size
    kv = eng.num_kv_blocks * per_block if not gpu else 0.0
    mem_gib = math.ceil((cm.body_bytes + cm.head_bytes + kv) / 2**30 * 1.3) + 2
    engine_role = RoleResources(cpu=str(a.cpus), memory=f"{mem_gib}Gi", gpus=gpu)
    args = [("--policy", eng.policy),
            ("--max-num-batched-tokens", str(eng.max_num_batched_tokens)),
            ("--max-num-seqs", str(eng.max_num_seqs)),
            ("--max-model-len", str(eng.max_model_len)), ("--block-size", str(eng.block_size))]
    if dep.mode == "pd":
        args.append(("--prefill-queue-limit", str(dep.prefill_queue_limit)))
    if a.kv_cache_memory:
        args.append(("--kv-cache-memory", a.kv_cache_memory))
    if a.no_prefix_caching:
        args.append(("--no-prefix-caching", ""))
    name = Path(model).name if Path(model).exists() else model
    spec = DeploySpec(
        model_path=_given(a.model_path, f"/models/{name}"),
        mode=dep.mode, replicas=dep.replicas, prefill=dep.prefill, decode=dep.decode,
        name=a.name, namespace=a.namespace, image=a.image, model_pvc=a.model_pvc,
        api_key_secret=a.api_key_secret, engine_args=tuple(args), disagg_threshold=dep.threshold,
        resources={"both": engine_role, "prefill": engine_role, "decode": engine_role,
                   "router": RoleResources(cpu="1", memory="2Gi")})
    return write(spec, a.k8s_out)
