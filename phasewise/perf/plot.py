"""``phasewise roofline --plot FILE.png``: the roofline with the workload's steps on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_roofline(a: dict[str, Any], out: str | Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install matplotlib "
                         "(or the package's 'plot' extra)") from e
    eff = a["efficiency"]
    peak, bw = eff["peak_flops"], eff["bandwidth_Bps"]
    ridge = peak / bw
    points = [a["prefill"]["intensity"], a["decode"]["intensity"],
              *[p["intensity"] for p in a["batch_sweep"]]]
    lo, hi = min(points + [ridge]) / 4, max(points + [ridge]) * 4
    xs = [lo * (hi / lo) ** (k / 200) for k in range(201)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.loglog(xs, [min(peak, x * bw) / 1e12 for x in xs], color="black", label="roofline")
    ax.axvline(ridge, color="grey", linestyle=":", label=f"ridge {ridge:.3g} FLOP/B")

    def attained(step: dict[str, Any]) -> float:
        return step["flops"] / step["time_s"] / 1e12

    sweep = a["batch_sweep"]
    ax.plot([p["intensity"] for p in sweep],
            [min(peak, p["intensity"] * bw) / 1e12 for p in sweep], "o-", color="#3b7dd8",
            markersize=4, label="decode, batch 1, 2, 4, ...")
    ax.plot([a["prefill"]["intensity"]], [attained(a["prefill"])], "s", color="#d98c1f",
            markersize=9, label=f"prefill {a['workload']['prompt_len']} tokens")
    ax.plot([a["decode"]["intensity"]], [attained(a["decode"])], "D", color="#c0392b",
            markersize=8, label=f"decode, batch {a['workload']['batch']}")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(f"{a['model']['name']} on {a['accelerator']['name']} ({a['dtype']})",
                 fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    out = Path(out)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out
