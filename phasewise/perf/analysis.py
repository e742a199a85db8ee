"""``phasewise roofline``: one model x accelerator x workload, analysed and formatted.

``analyse`` returns a plain dict (the ``--json`` output, schema in ``SCHEMA_KEYS``);
``format_text`` renders it as the readable table.
"""

from __future__ import annotations

import math
from typing import Any

from phasewise.engine.kv_sizing import DEFAULT_CPU_KV_MEMORY
from phasewise.perf.explain import unstable_note
from phasewise.perf.hardware import Accelerator, Link
from phasewise.perf.models import GenericModel, ModelShape
from phasewise.perf.roofline import Roofline

SCHEMA_KEYS = ("model", "accelerator", "dtype", "kv_dtype", "efficiency", "workload",
               "prefill", "decode", "ttft_s", "tpot_s", "decode_tokens_per_s", "batch_sweep",
               "critical_batch", "never_compute_bound_beyond_context",
               "max_concurrent_requests", "kv_transfer", "notes")
CRITICAL_CONTEXTS = (128, 512, 2048, 8192, 32768)


def analyse(model: ModelShape | GenericModel, accel: Accelerator, dtype: str = "bf16", *,
            prompt_len: int = 512, prefix_len: int = 0, output_len: int = 128,
            batch: int = 1, context: int | None = None, kv_dtype: str | None = None,
            mfu: float = 1.0, mbu: float = 1.0, link: Link | None = None,
            reserve_frac: float = 0.1, compute_dtype: str | None = None) -> dict[str, Any]:
    if output_len < 1:
        raise ValueError(f"output length must be >= 1, got {output_len}")
    if not 0 <= reserve_frac < 1:
        raise ValueError(f"reserve fraction must be in [0, 1), got {reserve_frac}")
    r = Roofline(model, accel, dtype, kv_dtype, mfu, mbu, compute_dtype)
    shaped = isinstance(model, ModelShape)
    if context is None:
        # Generic models have no KV cache to read: weights only, as in the seed example.
        # (A cached prefix is context the decode steps read too.)
        context = prefix_len + prompt_len + output_len // 2 if shaped else 0
    pre = r.prefill(prompt_len, prefix_len)
    dec = r.decode(batch, context)
    notes = []
    noisy = unstable_note(accel, r.compute_dtype)
    if noisy:
        notes.append(noisy)
    if isinstance(model, GenericModel):
        notes.append("generic dense model: 2 FLOPs per parameter per token, every weight read "
                     "once per step; no attention or KV cache (give a model for those)")
    if shaped and model.is_moe:
        e, k = model.num_experts, model.experts_per_token
        skew = model.routed_experts
        routing = ("uniform routing; skewed routing reads fewer: --experts-read fits it"
                   if skew is None else
                   f"E = {skew:.1f}, fitted to the experts measured (--experts-read): its "
                   f"router touches as few as {skew:.1f} equally likely experts would")
        grows = (f"so its weight bytes grow with the batch toward the "
                 f"{model.total_params / 1e9:.2f}B total" if skew is None or skew > k + 1e-6
                 else f"so every batch reads the same {k} experts a layer: its tokens all "
                 "route alike")
        notes.append(f"MoE: FLOPs use the {model.active_params / 1e9:.2f}B active parameters; "
                     f"a step reads only the experts its tokens route to: of {e} per layer, "
                     f"{k} at one token and E(1-(1-{k}/E)^T) in expectation at T tokens "
                     f"({routing}), {grows}")
    if mfu != 1.0 or mbu != 1.0:
        notes.append(f"predictions at {mfu:.0%} of peak FLOP/s (MFU) and {mbu:.0%} of peak "
                     "bandwidth (MBU)")
    # a request's whole context: its prefix, prompt and output, or the decode context given
    ctx_total = max(prefix_len + prompt_len + output_len, context)
    sweep = []
    cap = r.max_concurrent_requests(ctx_total, reserve_frac) if shaped else None
    on_cpu = accel.key.startswith("cpu")
    limit = getattr(model, "max_position_embeddings", None)
    if shaped and limit and ctx_total > limit:
        notes.append(f"a context of {ctx_total} tokens exceeds the model's "
                     f"{limit} positions: it cannot be served so")
    # (the reserve is a share of what the weights leave, so weights fit below the memory)
    fits = accel.mem_bytes <= 0 or r.weight_bytes < accel.mem_bytes
    if not fits:
        cards = math.floor(r.weight_bytes / accel.mem_bytes) + 1
        notes.append(f"the weights ({r.weight_bytes / 1e9:.4g} GB at {r.dtype}) exceed one "
                     f"{accel.name} ({accel.mem_bytes / 1e9:.4g} GB): serving them takes at "
                     f"least {cards} such cards (tensor or "
                     "expert parallelism, which this one-card analysis does not model); the "
                     "step figures are one card's with its memory unbounded, and the batch "
                     "sweep is not cut at the K/V capacity")
    if fits and cap is not None and batch > cap:
        notes.append(f"batch {batch} exceeds the K/V capacity ({cap} requests of {ctx_total} "
                     f"tokens fit beside the weights): the decode step above is priced as if "
                     "the memory held them")
    b = 1
    while b <= 1024 and (cap is None or not fits or b <= max(cap, 1)):
        step = r.decode(b, context)
        sweep.append({"batch": b, "step_s": step.time, "tokens_per_s": b / step.time,
                      "intensity": step.intensity, "bound": step.bound,
                      "weight_bytes": step.weight_bytes, "bytes": step.bytes,
                      "experts_touched": (model.experts_touched(b)
                                          if shaped and model.is_moe else None)})
        b *= 2
    critical = {str(c): r.critical_batch(c) for c in
                ((0,) if not shaped else CRITICAL_CONTEXTS)}
    return {
        "model": {
            "name": model.name,
            "source": getattr(model, "source", "parameter count given on the command line"),
            "total_params": model.params if isinstance(model, GenericModel)
            else model.total_params,
            "active_params": model.params if isinstance(model, GenericModel)
            else model.active_params,
            "moe": shaped and model.is_moe,
            "generic": not shaped,
            "sliding_window": model.sliding_window if shaped and model.windowed else None,
            "window_layers": model.window_layers if shaped and model.windowed else 0,
            "weight_bytes": r.weight_bytes,
            "kv_bytes_per_token": r.kv_bytes_per_token,
        },
        "accelerator": accel.as_dict(),
        "dtype": r.dtype, "kv_dtype": r.kv_dtype, "compute_dtype": r.compute_dtype,
        "efficiency": {"mfu": mfu, "mbu": mbu, "peak_flops": r.peak_flops,
                       "bandwidth_Bps": r.bandwidth, "ridge_flops_per_byte":
                       r.peak_flops / r.bandwidth},
        "workload": {"prompt_len": prompt_len, "prefix_len": prefix_len,
                     "output_len": output_len, "batch": batch, "decode_context": context},
        "prefill": pre.as_dict(),
        "decode": dec.as_dict(),
        "ttft_s": pre.time,
        "tpot_s": dec.time,
        "decode_tokens_per_s": batch / dec.time,
        "batch_sweep": sweep,
        "critical_batch": critical,
        "never_compute_bound_beyond_context": r.never_compute_bound_context(),
        "max_concurrent_requests": {
            "context": ctx_total, "reserve_frac": reserve_frac, "requests": cap,
            # on a CPU, phasewise serve's pool is a set size, far below the memory
            "serve_cpu_pool_bytes": DEFAULT_CPU_KV_MEMORY if on_cpu else None,
            "serve_cpu_pool_requests": (r.requests_in_pool(DEFAULT_CPU_KV_MEMORY, ctx_total)
                                        if on_cpu and shaped else None)},
        "kv_transfer": (dict(r.kv_transfer(prompt_len, link) or {}, link=link.as_dict())
                        if link is not None and shaped else None),
        "notes": notes,
    }


def _t(s: float) -> str:
    if s is None or not math.isfinite(s):
        return "-"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.4g} µs"


def _b(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.3g} B"


def _step_lines(title: str, s: dict[str, Any]) -> list[str]:
    return [
        f"{title}",
        f"  arithmetic        {_amount(s['flops'], 'FLOP')} -> {_t(s['t_compute_s'])}",
        f"  memory traffic    {_b(s['bytes'])} (weights {_b(s['weight_bytes'])}, KV read "
        f"{_b(s['kv_read_bytes'])}, KV written {_b(s['kv_write_bytes'])}, activations "
        f"{_b(s['act_bytes'])}) -> {_t(s['t_memory_s'])}",
        f"  intensity         {s['intensity']:.3g} FLOP/byte (ridge {s['ridge']:.3g})",
        f"  bound             {s['bound']}-bound by {s['ratio']:.3g}x; lower bound "
        f"{_t(s['time_s'])}",
    ]


def format_text(a: dict[str, Any]) -> str:
    m, acc, eff, w = a["model"], a["accelerator"], a["efficiency"], a["workload"]
    lines = [
        f"model        {m['name']}: {m['total_params'] / 1e9:.3g}B parameters"
        + (f" ({m['active_params'] / 1e9:.3g}B active)" if m["moe"] else "")
        + f", {_b(m['weight_bytes'])} of weights at {a['dtype']}",
        f"accelerator  {acc['name']}: {_rate(eff['peak_flops'], 'FLOP')} "
        f"{a['compute_dtype']}, "
        f"{_rate(eff['bandwidth_Bps'], 'B')}, {_b(acc['mem_bytes'])} "
        f"[{acc['source']}]",
    ]
    if m["kv_bytes_per_token"]:
        lines.append(f"KV cache     {m['kv_bytes_per_token'] / 1024:.4g} KiB per token "
                     f"({a['kv_dtype']})")
    if m.get("sliding_window"):
        lines.append(f"window       {m['window_layers']} of the layers attend to the last "
                     f"{m['sliding_window']} positions only: their K/V reads and attention "
                     "stop growing there, and the capacity below counts no more K/V than "
                     "that for them")
    p, d = a["prefill"], a["decode"]
    lines.append(f"in short     prefill of {w['prompt_len']} tokens is {p['bound']}-bound "
                 f"({p['ratio']:.3g}x); a decode step at batch {w['batch']} is {d['bound']}-"
                 f"bound ({d['ratio']:.3g}x): its memory traffic takes {_t(d['t_memory_s'])}, "
                 f"the arithmetic {_t(d['t_compute_s'])}")
    lines.append("")
    lines += _step_lines(f"prefill: {w['prompt_len']} tokens after a cached prefix of "
                         f"{w['prefix_len']}", a["prefill"])
    lines.append(f"  TTFT (no queueing) {_t(a['ttft_s'])}")
    lines.append("")
    lines += _step_lines(f"decode step: batch {w['batch']} at context {w['decode_context']}"
                         + (" (a generic model: no K/V to read)" if m.get("generic") else ""),
                         a["decode"])
    lines.append(f"  TPOT              {_t(a['tpot_s'])}; {_n(a['decode_tokens_per_s'])} "
                 "output tokens/s")
    lines.append("")
    lines.append("decode throughput against batch (context as above):")
    for p in a["batch_sweep"]:
        moe = ("" if p.get("experts_touched") is None else
               f", {p['experts_touched']:.3g} experts/layer; reads {_b(p['bytes'])}, "
               f"{_b(p['weight_bytes'])} of it weights")
        lines.append(f"  batch {p['batch']:>5}: step {_t(p['step_s']):>9}, "
                     f"{_n(p['tokens_per_s']):>10} tok/s, {p['bound']}-bound{moe}")
    crit = ", ".join(f"{'never' if v is None else _n(v)} at {c}"
                     for c, v in a["critical_batch"].items())
    lines.append(f"critical batch (decode turns compute-bound): {crit}"
                 + ("" if m["kv_bytes_per_token"] else " (weights only)"))
    never = a["never_compute_bound_beyond_context"]
    if never is not None and never < 1:
        lines.append("  at no context does decode turn compute-bound: each sequence's KV "
                     "reads outweigh its arithmetic from its first token")
    elif never is not None:
        lines.append(f"  beyond a context of {never:.0f} tokens decode never turns "
                     "compute-bound: each sequence's KV reads outweigh its arithmetic")
    mc = a["max_concurrent_requests"]
    if mc["requests"] is not None:
        lines.append(f"KV capacity: {mc['requests']} concurrent requests of {mc['context']} "
                     f"tokens (after the weights, {mc['reserve_frac']:.0%} of what they leave "
                     "kept for activations)")
        if mc.get("serve_cpu_pool_requests") is not None:
            lines.append(f"  phasewise serve on a CPU sizes its pool at "
                         f"{mc['serve_cpu_pool_bytes'] / 2**30:g} GiB unless --kv-cache-memory "
                         f"says otherwise: {mc['serve_cpu_pool_requests']} such requests")
    kt = a["kv_transfer"]
    if kt:
        lines.append(f"KV transfer of one {w['prompt_len']}-token prompt over "
                     f"{kt['link']['name']}: {_b(kt['bytes'])} in {_t(kt['transfer_s'])} "
                     f"= {kt['transfer_over_prefill']:.3g}x its prefill time")
    for n in a["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def _n(v: float) -> str:
    """A count or rate for a table: four significant digits, thousands as ``15,310``."""
    return f"{v:,.0f}" if v >= 1e4 else f"{v:.4g}"


def _amount(v: float, unit: str) -> str:
    """A figure with a fitting prefix: ``12.99 TFLOP``, ``105.2 GFLOP``."""
    for prefix, size in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if v >= size:
            return f"{v / size:.4g} {prefix}{unit}"
    return f"{v:.4g} {unit}"


def _rate(v: float, unit: str) -> str:
    """A per-second figure with a fitting prefix: ``989.4 TFLOP/s``, ``105.2 GFLOP/s``."""
    return f"{_amount(v, unit)}/s"


def _accelerator_lines(acc: Accelerator) -> list[str]:
    peaks = ", ".join(f"{d} {_rate(v, 'OP' if d.startswith('int') else 'FLOP')}"
                      for d, v in acc.peak_flops.items())
    link = f"; link {acc.interconnect}" if acc.interconnect else ""
    lines = [f"  {acc.key:<16}{acc.name}: {peaks}; {_b(acc.mem_bytes)} at "
             f"{_rate(acc.mem_bandwidth, 'B')}{link}",
             f"  {'':<16}source: {acc.source}"]
    if acc.notes:
        lines.append(f"  {'':<16}note: {acc.notes}")
    return lines


def catalog_dict() -> dict[str, Any]:
    """``phasewise roofline --list --json``: the catalog's accelerators, models and links,
    each with its figures and source (the stored cpu-local / gpu-local ones too)."""
    from dataclasses import asdict

    from phasewise.perf.hardware import ACCELERATORS, LINKS, load_local
    from phasewise.perf.models import CATALOG

    accels = [a.as_dict() for a in ACCELERATORS.values()]
    for key in ("cpu-local", "gpu-local"):
        try:
            accels.append(load_local(key).as_dict())
        except (ValueError, KeyError, TypeError):  # not measured, or a damaged file
            pass
    models = [dict(asdict(m), total_params=m.total_params, active_params=m.active_params)
              for m in CATALOG.values()]
    return {"accelerators": accels, "models": models,
            "links": [link.as_dict() for link in LINKS.values()]}


def format_catalog(local: dict[str, Accelerator | str] | None = None) -> str:
    """``phasewise roofline --list``: every catalog entry with its figures and their source.
    ``local``: the measured ``cpu-local`` / ``gpu-local`` accelerators, or for each one a line
    saying why it is not there; by default read from ``phasewise measure``'s file."""
    from phasewise.perf.hardware import ACCELERATORS, LINKS, load_local
    from phasewise.perf.models import CATALOG

    if local is None:
        local = {}
        for key in ("cpu-local", "gpu-local"):
            try:
                local[key] = load_local(key)
            except (ValueError, KeyError, TypeError) as e:  # not measured, or a damaged file
                local[key] = str(e)

    lines = ["accelerators (dense peaks per dtype; memory at read bandwidth):"]
    for acc in ACCELERATORS.values():
        lines += _accelerator_lines(acc)
    for key, acc in local.items():
        if isinstance(acc, Accelerator):
            lines += _accelerator_lines(acc)
        else:
            lines.append(f"  {key:<16}{acc}")
    lines += ["", "models (parameters; MoE: active per token):"]
    for m in CATALOG.values():
        active = f" ({m.active_params / 1e9:.3g}B active)" if m.is_moe else ""
        lines.append(f"  {m.name:<20}{m.total_params / 1e9:.3g}B parameters{active}; "
                     f"source: {m.source}")
    lines += ["", "links (bandwidth each way, latency):"]
    for link in LINKS.values():
        lines.append(f"  {link.key:<16}{link.name}: {_rate(link.bandwidth, 'B')}, "
                     f"{_t(link.latency_s)}")
        lines.append(f"  {'':<16}source: {link.source}")
    return "\n".join(lines)
