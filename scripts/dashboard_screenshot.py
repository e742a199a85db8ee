"""The README's screenshot: ``/dashboard`` of the bundled model under load.

Starts ``phasewise serve`` (the bundled model) on a free port, opens the dashboard in a
headless chromium (Debian's, through playwright), runs the load command below against it,
runs the playground once while the load goes on, and saves the whole page:

    phasewise bench --base-url URL --num-prompts 160 --request-rate 8 \\
        --input-len uniform:16-64 --output-len 64 --intruder-fraction 0.1 --intruder-len 180

    python scripts/dashboard_screenshot.py [--out docs/dashboard.png] [--at 0.7]

``--at``: how far through the load (its expected duration) the picture is taken. Every
process it starts, it stops by PID.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
LOAD = ["--num-prompts", "160", "--request-rate", "8", "--input-len", "uniform:16-64",
        "--output-len", "64", "--intruder-fraction", "0.1", "--intruder-len", "180",
        "--seed", "1", "--disable-tqdm"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "dashboard.png"))
    ap.add_argument("--at", type=float, default=0.7)
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    exe = [sys.executable, "-m", "phasewise.cli"]
    server = subprocess.Popen([*exe, "serve", "--port", str(port), "--log-interval", "0",
                               "--no-access-log"], start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    load = None
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not come up")
            time.sleep(0.2)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url + "/dashboard")
            page.wait_for_function("document.getElementById('conn').textContent === 'live'")
            cmd = [*exe, "bench", "--base-url", url, *LOAD]
            print("load:", " ".join(["phasewise", *cmd[3:]]), flush=True)
            load = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, start_new_session=True)
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
        for proc in (load, server):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
