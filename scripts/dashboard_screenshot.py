"""The README's screenshot: ``/dashboard`` of the bundled model under load.

Starts ``phasewise serve`` (the bundled model) on a free port, opens the dashboard in a
headless chromium (Debian's, through playwright), runs the load command below against it,
runs the playground once while the load goes on, and saves the whole page:

    phasewise bench --base-url URL --num-prompts 160 --request-rate 8 \\
        --input-len uniform:16-64 --output-len 64 --intruder-fraction 0.1 --intruder-len 180

    python -m scripts.dashboard_screenshot [--out docs/dashboard.png] [--at 0.7]

(from the repository's root: it uses the benchmarks' harness, ``benchmarks.harness``).

``--at``: how far through the load (its expected duration) the picture is taken. Every
process it starts, it stops by PID (its process group; logs in
benchmarks/results/dashboard/).
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from benchmarks.bench_dashboard import LOGS, start
from benchmarks.harness import PW, Procs, free_port

REPO = Path(__file__).resolve().parent.parent

LOAD = ["--num-prompts", "160", "--request-rate", "8", "--input-len", "uniform:16-64",
        "--output-len", "64", "--intruder-fraction", "0.1", "--intruder-len", "180",
        "--seed", "1", "--disable-tqdm"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "dashboard.png"))
    ap.add_argument("--at", type=float, default=0.7)
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs = Procs()
    try:
        start(procs, None, port)  # the bundled model
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url + "/dashboard")
            page.wait_for_function("document.getElementById('conn').textContent === 'live'")
            cmd = [*PW, "bench", "--base-url", url, *LOAD]
            print("load:", " ".join(["phasewise", *cmd[len(PW):]]), flush=True)
            load = procs.start("bench", cmd, LOGS / "screenshot-load.log")
            expected = 160 / 8
            time.sleep(expected * args.at - 4)
            page.click("#pg-run")
            page.wait_for_function(
                "document.getElementById('pg-status').textContent === 'done'", timeout=60000)
            page.evaluate("document.getElementById('pg-steps-box').open = false")
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=args.out, full_page=True)
            print("saved", args.out, flush=True)
            browser.close()
        load.wait(600)
    finally:
        procs.stop_all()


if __name__ == "__main__":
    main()
