"""``phasewise bench report RESULT.json [...]``: one self-contained HTML page of pictures.

For each result file: a per-request timeline (waiting + prefill until the first token, then
decode, with stalls marked where an inter-token gap exceeds ``stall_factor`` x the run's median
ITL), and tokens per second over time. Across files: CDFs of TTFT and TPOT with the SLO lines,
and a side-by-side table (with the server's own queue/prefill/decode split when the server was
phasewise). Charts need matplotlib (the ``plot`` extra); without it the page still holds the
tables and every series as JSON (``<script id="phasewise-series">``).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from phasewise.files import read_json_file, write_text_atomic


def load_result(path: str | Path) -> dict[str, Any]:
    r = read_json_file(path)
    if not isinstance(r, dict):
        raise ValueError(f"{path}: a benchmark result is a JSON object, got a "
                         f"{type(r).__name__}")
    for key in ("ttfts", "itls", "latencies", "start_times"):
        if key not in r:
            raise ValueError(f"{path} has no {key!r}: not a benchmark result with per-request "
                             "detail (phasewise bench, or vllm bench serve --save-detailed)")
    if not r.get("label"):
        r["label"] = Path(path).stem
    elif r.get("sweep"):  # one file of a sweep: name it by its rate, group it by its label
        r["sweep_label"] = r["label"]
        r["label"] = f"{r['label']} @ {r['request_rate']} req/s"
    # vLLM stores absolute clock readings; phasewise, offsets from the run's start.
    t0 = min((t for t in r["start_times"] if t is not None), default=0.0)
    r["start_times"] = [t - t0 for t in r["start_times"]]
    return r


def _tpots(r: dict[str, Any]) -> list[float]:
    out = []
    for ttft, lat, n in zip(r["ttfts"], r["latencies"], r.get("output_lens", [])):
        if ttft is not None and n and n > 1:
            out.append((lat - ttft) / (n - 1))
    return out


def series(r: dict[str, Any], stall_factor: float, bin_s: float = 1.0) -> dict[str, Any]:
    """Everything the charts draw, in seconds."""
    ttfts = [t for t in r["ttfts"] if t is not None]
    all_itls = [g for itls in r["itls"] for g in itls]
    median_itl = statistics.median(all_itls) if all_itls else 0.0
    threshold = stall_factor * median_itl
    rows, stalls = [], []
    intruders = r.get("intruders") or [False] * len(r["ttfts"])
    timings = r.get("server_timings") or [None] * len(r["ttfts"])
    chunk_times = r.get("chunk_times")
    for i, (start, ttft, lat, itls) in enumerate(zip(r["start_times"], r["ttfts"],
                                                     r["latencies"], r["itls"])):
        if ttft is None:
            continue
        queue = (timings[i] or {}).get("queue_s")
        # The server's queue time splits waiting from prefill; without it they are one bar.
        queue_end = start + min(queue, ttft) if queue is not None else None
        rows.append({"request": i, "start": start, "queue_end": queue_end,
                     "first_token": start + ttft, "end": start + lat,
                     "intruder": bool(intruders[i])})
        # Chunk arrival times: stored by phasewise bench; rebuilt from ITLs for vLLM files.
        times = (chunk_times[i] if chunk_times else
                 [ttft + sum(itls[:k]) for k in range(len(itls) + 1)])
        for k, gap in enumerate(itls):
            if median_itl and gap > threshold:
                stalls.append({"request": i, "at": start + times[k], "gap": gap})
    tokens_at: list[tuple[float, int]] = []
    for i, (start, ttft, itls) in enumerate(zip(r["start_times"], r["ttfts"], r["itls"])):
        if ttft is None:
            continue
        if r.get("chunk_times") and r.get("chunk_tokens"):
            tokens_at += [(start + t, n) for t, n in zip(r["chunk_times"][i],
                                                         r["chunk_tokens"][i])]
        else:
            t = start + ttft
            tokens_at.append((t, 1))
            for gap in itls:
                t += gap
                tokens_at.append((t, 1))
    end = max((t for t, _ in tokens_at), default=0.0)
    bins = [0] * (int(end // bin_s) + 1)
    for t, n in tokens_at:
        bins[int(t // bin_s)] += n
    return {
        "label": r["label"], "ttft_sorted": sorted(ttfts), "tpot_sorted": sorted(_tpots(r)),
        "median_itl": median_itl, "stall_threshold": threshold, "stalls": stalls,
        "timeline": rows, "tokens_per_s": {"bin_s": bin_s,
                                           "values": [n / bin_s for n in bins]},
    }


def sweep_curves(results: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, float]]]:
    """Latency against achieved throughput, per label that ran at two or more request rates
    (``phasewise bench --request-rate A B ...`` writes one file per rate, same label)."""
    groups: dict[str, list[dict[str, float]]] = {}
    for r in results:
        base = r.get("sweep_label") or r["label"]
        groups.setdefault(base, []).append({
            "request_rate": float(r.get("request_rate", math.nan)),
            "request_throughput": r["request_throughput"],
            "median_ttft_ms": r.get("median_ttft_ms"), "p99_ttft_ms": r.get("p99_ttft_ms"),
            "median_tpot_ms": r.get("median_tpot_ms"), "p99_itl_ms": r.get("p99_itl_ms")})
    return {k: sorted(v, key=lambda p: p["request_throughput"])
            for k, v in groups.items() if len(v) >= 2}


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _charts(all_series: list[dict[str, Any]], slo: dict[str, float],
            curves: dict[str, list[dict[str, float]]]) -> list[tuple[str, str]]:
    """(title, base64 PNG) pairs; empty without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    charts = []
    for s in all_series:
        rows = s["timeline"]
        fig, ax = plt.subplots(figsize=(10, max(2.5, 0.12 * len(rows) + 1)))
        split = any(row["queue_end"] is not None for row in rows)
        for y, row in enumerate(rows):
            prefill_from = row["start"]
            if row["queue_end"] is not None:
                ax.barh(y, row["queue_end"] - row["start"], left=row["start"], height=0.8,
                        color="#bbbbbb")
                prefill_from = row["queue_end"]
            ax.barh(y, row["first_token"] - prefill_from, left=prefill_from, height=0.8,
                    color="#d98c1f" if row["intruder"] else "#f2c879")
            ax.barh(y, row["end"] - row["first_token"], left=row["first_token"], height=0.8,
                    color="#3b7dd8")
        ys = {row["request"]: y for y, row in enumerate(rows)}
        stall_x = [st["at"] for st in s["stalls"]]
        stall_y = [ys[st["request"]] for st in s["stalls"]]
        if stall_x:
            ax.scatter(stall_x, stall_y, marker="|", s=60, color="#c0392b", zorder=3,
                       label=f"stall (gap > {s['stall_threshold'] * 1e3:.0f} ms)")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_xlabel("time since the run started (s)")
        ax.set_ylabel("request")
        waiting = "queue (grey, server's clock), prefill" if split else "waiting + prefill"
        ax.set_title(f"{s['label']}: {waiting} (orange; dark = long-prompt intruder), "
                     f"decode (blue)", fontsize=10)
        charts.append((f"Timeline: {s['label']}", _png(fig)))

    for key, title, slo_key in (("ttft_sorted", "TTFT", "ttft"),
                                ("tpot_sorted", "TPOT", "tpot")):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for s in all_series:
            xs = [v * 1e3 for v in s[key]]
            if xs:
                ax.step(xs, [(k + 1) / len(xs) for k in range(len(xs))], where="post",
                        label=s["label"])
        if slo_key in slo:
            ax.axvline(slo[slo_key], color="#c0392b", linestyle="--",
                       label=f"SLO {slo[slo_key]:g} ms")
        if not any(s[key] for s in all_series):
            # a run whose requests all failed, or produced one token each, has no TPOT
            ax.text(0.5, 0.5, f"no request has a {title}", ha="center", va="center",
                    transform=ax.transAxes)
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of requests")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.set_title(f"CDF of {title}", fontsize=10)
        charts.append((f"CDF of {title}", _png(fig)))

    fig, ax = plt.subplots(figsize=(10, 3.5))
    for s in all_series:
        tp = s["tokens_per_s"]
        ax.plot([k * tp["bin_s"] for k in range(len(tp["values"]))], tp["values"],
                label=s["label"])
    ax.set_xlabel("time since the run started (s)")
    ax.set_ylabel("output tokens/s")
    ax.legend(fontsize=8)
    ax.set_title("Output tokens per second over time", fontsize=10)
    charts.append(("Tokens per second over time", _png(fig)))

    if curves:
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
        for label, pts in curves.items():
            xs = [p["request_throughput"] for p in pts]
            for ax, key, name in zip(axes, ("median_ttft_ms", "median_tpot_ms", "p99_itl_ms"),
                                     ("TTFT p50", "TPOT p50", "ITL p99")):
                ax.plot(xs, [p[key] for p in pts], marker="o", label=label)
                ax.set_xlabel("achieved requests/s")
                ax.set_ylabel(f"{name} (ms)")
        for ax, key in zip(axes, ("ttft", "tpot", None)):
            if key and key in slo:
                ax.axhline(slo[key], color="#c0392b", linestyle="--")
        axes[0].legend(fontsize=8)
        fig.suptitle("Latency against throughput (sweep)", fontsize=10)
        charts.append(("Latency against throughput", _png(fig)))
    return charts


def _fmt(x: Any, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _longest_gap_ms(r: dict[str, Any]) -> float | None:
    gaps = [g for itls in r["itls"] for g in itls]
    return 1e3 * max(gaps) if gaps else None


def _table(results: Sequence[dict[str, Any]], all_series: list[dict[str, Any]]) -> str:
    rows = [("completed / failed", lambda r, s: f"{r['completed']} / {r.get('failed', 0)}"),
            ("request throughput (req/s)", lambda r, s: _fmt(r["request_throughput"], 3)),
            ("output throughput (tok/s)", lambda r, s: _fmt(r["output_throughput"])),
            ("goodput (req/s)", lambda r, s: _fmt(r.get("request_goodput"), 3))]
    for m in ("ttft", "tpot", "itl", "e2el"):
        for p in ("median", "p90", "p99"):
            rows.append((f"{m.upper()} {p} (ms)",
                         lambda r, s, k=f"{p}_{m}_ms": _fmt(r.get(k))))
    rows.append(("longest stall (ms)", lambda r, s: _fmt(_longest_gap_ms(r))))
    rows.append(("stalls marked", lambda r, s: str(len(s["stalls"]))))
    rows.append(("server: mean queue / prefill / decode (ms)", lambda r, s: (
        " / ".join(_fmt((r.get("server_metrics") or {}).get(f"mean_request_{k}_ms"), 0)
                   for k in ("queue_time", "prefill_time", "decode_time"))
        if r.get("server_metrics") else "-")))
    head = "".join(f"<th>{html.escape(r['label'])}</th>" for r in results)
    body = "".join(
        "<tr><td>" + html.escape(label) + "</td>" + "".join(
            f"<td>{html.escape(fn(r, s))}</td>" for r, s in zip(results, all_series)) + "</tr>"
        for label, fn in rows)
    return f"<table><tr><th></th>{head}</tr>{body}</table>"


def render(paths: Sequence[str | Path], out: str | Path, stall_factor: float = 5.0,
           slo: dict[str, float] | None = None) -> Path:
    if not 1 < stall_factor < math.inf:
        raise ValueError(f"--stall-factor must be a finite number > 1, got {stall_factor}")
    results = [load_result(p) for p in paths]
    # runs under the same name (bench's default label, or a label used twice) are told
    # apart by their files' names
    counts: dict[str, int] = {}
    for r in results:
        counts[r["label"]] = counts.get(r["label"], 0) + 1
    for r, p in zip(results, paths):
        if counts[r["label"]] > 1:
            r["label"] = f"{r['label']} ({Path(p).name})"
    if not results:
        raise ValueError("give at least one result file")
    slo = slo or next((r["slo"] for r in results if r.get("slo")), None) or {}
    all_series = [series(r, stall_factor) for r in results]
    curves = sweep_curves(results)
    charts = _charts(all_series, slo, curves)
    figs = "".join(f"<h2>{html.escape(t)}</h2><img src=\"data:image/png;base64,{png}\">"
                   for t, png in charts)
    if not charts:
        figs = ("<p><em>Charts need matplotlib: pip install matplotlib (or the package's "
                "'plot' extra). The series are in this page as JSON.</em></p>")
    data = json.dumps({"series": all_series, "slo": slo, "stall_factor": stall_factor,
                       "sweeps": curves}).replace("</", "<\\/")
    title = "phasewise bench report: " + ", ".join(r["label"] for r in results)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}
td:first-child{{text-align:left}}img{{max-width:100%}}</style></head><body>
<h1>{html.escape(title)}</h1>
<p>Stalls: inter-token gaps longer than {stall_factor:g} x the run's median ITL.
TTFT covers waiting and prefill as the client sees them; the server's own split comes from
its /metrics when it is phasewise.</p>
{_table(results, all_series)}
{figs}
<script type="application/json" id="phasewise-series">{data}</script>
</body></html>
"""
    out = Path(out)
    write_text_atomic(out, page)
    return out
