"""``/dashboard`` in a real browser: Debian's chromium, driven by playwright's Python package
(pointed at the system chromium; playwright's own browser download is never used).

``scripts/test.sh`` installs chromium with apt when it runs as root and it is missing; where
it cannot be had, these tests skip, except under CI (``CI`` set), where they fail.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import threading

import httpx
import pytest

from conftest import build_hf_checkpoint
from serving import free_port, start_server

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"),
                             "/usr/bin/chromium") if p and os.path.exists(p)), None)
try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - the test extra installs it
    sync_playwright = None

MISSING = None
if CHROMIUM is None or sync_playwright is None:
    MISSING = ("no chromium on this machine (apt-get install chromium)" if CHROMIUM is None
               else "playwright is not installed (pip install -e '.[test]')")
    if not os.environ.get("CI"):
        pytest.skip(MISSING, allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def _needs_a_browser():
    """Under CI each of these tests fails (not the whole session) without a browser."""
    if MISSING is not None:
        pytest.fail(f"the dashboard's browser tests must run in CI: {MISSING}",
                    pytrace=False)

WAIT_MS = 60_000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # Wide enough that a 512-token prompt chunk takes many decode steps' time on any CPU.
    path = tmp_path_factory.mktemp("browser")
    build_hf_checkpoint(path, "LlamaForCausalLM", seed=11, hidden_size=256,
                        intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=2048)
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = start_server(model_dir, tmp_path_factory.mktemp("logs") / "browser.log",
                     "--log-interval", "0", "--max-num-batched-tokens", "512")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


class Page:
    """A page with every console error and uncaught exception recorded."""

    def __init__(self, browser, url: str) -> None:
        self.errors: list[str] = []
        self.page = browser.new_page(viewport={"width": 1400, "height": 1600})
        self.page.on("console", lambda m: self.errors.append(f"console {m.type}: {m.text}")
                     if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.goto(url)

    def js(self, expr: str):
        return self.page.evaluate(expr)

    def wait(self, expr: str, timeout: int = WAIT_MS) -> None:
        self.page.wait_for_function(expr, timeout=timeout)

    def wait_live(self) -> None:
        """Until the page's badge says its event stream is open."""
        self.wait("document.getElementById('conn').textContent === 'live'")

    def close(self) -> None:
        self.page.close()

    def __enter__(self) -> "Page":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stream(url: str, body: dict, out: dict | None = None) -> None:
    with httpx.stream("POST", url + "/v1/completions", timeout=300,
                      json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if out is not None and line.startswith("data: {"):
                out.setdefault("chunks", 0)
                out["chunks"] += 1


def test_the_page_loads_cleanly_and_its_charts_follow_the_engine(server, browser):
    with Page(browser, server.url + "/dashboard") as p:
        p.wait_live()
        p.wait("S.sources.has('self') && S.sources.get('self').hello.model !== undefined")
        before = p.js("S.sources.get('self').lastIndex")
        threads = [threading.Thread(target=stream, args=(server.url, {
            "prompt": "def f(x):", "max_tokens": 40, "ignore_eos": True})) for _ in range(3)]
        for t in threads:
            t.start()
        # the charts take the new steps: tokens per step, time vs roofline, bandwidth
        p.wait(f"charts.mix.data[0].length > 0 && charts.mix.data[0].at(-1) > {before}")
        p.wait("charts.time.data[1].some(v => v > 0) && charts.bw.data[1].some(v => v > 0)")
        p.wait("S.sources.get('self').itl.reduce((a, b) => a + b, 0) > 0")
        for t in threads:
            t.join()
        p.wait("S.sources.get('self').ttft.reduce((a, b) => a + b, 0) >= 3")
        assert p.js("charts.ttft.data[1].reduce((a, b) => a + b, 0)") >= 3
        assert p.page.inner_text("#k-ttft") != "– / –"
        # every decode token the three requests took is in the page's steps (39 each: the
        # first token came out of prefill)
        p.wait(f"S.sources.get('self').steps.filter(s => s[0] > {before})"
               ".reduce((a, s) => a + s[4], 0) === 3 * 39")
        assert p.errors == []


def test_the_playground_streams_and_its_token_timings_agree_with_the_api(server, browser):
    with Page(browser, server.url + "/dashboard") as p:
        p.wait_live()
        p.page.fill("#pg-prompt", "import os\n")
        p.page.fill("#pg-max", "12")
        p.page.fill("#pg-temp", "0")
        p.page.click("#pg-run")
        p.wait("document.getElementById('pg-status').textContent === 'done' && "
               "document.getElementById('pg-summary').textContent.includes('length')")
        api = p.js("PG.api")  # the API's own timings, from the stream's usage chunk
        summary = p.page.locator("#pg-summary")
        ttft = float(summary.get_attribute("data-ttft"))
        decode = float(summary.get_attribute("data-decode"))
        assert int(summary.get_attribute("data-tokens")) == 12
        assert ttft == pytest.approx(api["queue_s"] + api["prefill_s"], abs=1e-6)
        assert decode == pytest.approx(api["decode_s"], abs=1e-6)
        # each token is marked: the first with its TTFT, every later one with its ITL
        gaps = p.js("[...document.querySelectorAll('#pg-out .tok')].map(e => +e.dataset.gap)")
        assert len(gaps) == 12 and gaps[0] == pytest.approx(ttft)
        assert sum(gaps[1:]) == pytest.approx(decode, abs=1e-6)
        streamed = p.js("PG.pieces.join('')")
        shown = p.js("[...document.querySelectorAll('#pg-out .tok')].map(e => e.textContent)"
                     ".join('')")
        assert streamed and shown == streamed  # what streamed is what the trace shows
        # and the steps it rode on: its prompt's, then one per later token
        rows = p.page.locator("#pg-steps tr")
        assert rows.count() == 12
        assert "prefill" in rows.first.text_content()  # (inside a closed <details>)
        assert p.errors == []


def test_the_stall_view_names_the_prompt_that_held_the_streams_back(server, browser):
    with Page(browser, server.url + "/dashboard") as p:
        p.wait_live()
        p.wait("S.sources.has('self')")
        before = p.js("S.sources.get('self').lastIndex")  # (the hello holds older steps)
        seen: dict = {}
        threads = [threading.Thread(target=stream, args=(server.url, {
            "prompt": f"def victim_{i}():", "max_tokens": 400, "ignore_eos": True}, seen))
            for i in range(3)]
        for t in threads:
            t.start()
        # the victims stream (a baseline of decode-only steps forms), then the intruder
        p.wait(f"S.sources.get('self').steps.filter(s => s[0] > {before} && s[3] === 0 && "
               "s[4] === 3).length >= 8")
        rng = random.Random(0)
        intruder = httpx.post(server.url + "/v1/completions", timeout=300, json={
            "prompt": [rng.randrange(3, 290) for _ in range(1500)], "max_tokens": 1})
        assert intruder.status_code == 200, intruder.text
        rid = intruder.json()["id"]
        row = p.page.locator(f'tr.stall[data-intruder="{rid}"]').first
        row.wait_for(timeout=WAIT_MS)
        text = row.inner_text()
        assert rid in text
        # its chunk: the step's budget (512) less the three decode tokens beside it, or the
        # prompt's last 1500 - 2 * 509; then the whole prompt it belongs to
        chunk = re.search(r"\((\d+) / (\d+) tokens\)", text)
        assert chunk is not None, text
        assert chunk.group(1) in ("509", "482") and chunk.group(2) == "1500"
        assert int(text.split()[-1]) >= 1  # how many streams it held back
        for t in threads:
            t.join()
        assert p.errors == []


def test_a_page_that_loses_its_server_says_so_and_reconnects(model_dir, browser, tmp_path):
    port = free_port()
    s = start_server(model_dir, tmp_path / "a.log", "--log-interval", "0", port=port)
    try:
        with Page(browser, s.url + "/dashboard") as p:
            p.wait_live()
            s.stop()
            p.wait("document.getElementById('conn').className.includes('bad')")
            banner = p.page.inner_text("#banner")
            assert "reconnecting" in banner or "cannot reach" in banner
            s = start_server(model_dir, tmp_path / "b.log", "--log-interval", "0", port=port)
            p.wait_live()
            assert p.page.locator("#banner").is_hidden()
            # the errors a browser logs for a refused connection are expected here; nothing
            # else (no exception in the page's own code)
            assert not [e for e in p.errors if e.startswith("uncaught")]
    finally:
        s.stop()


def test_with_an_api_key_the_page_asks_for_it_then_works(model_dir, browser, tmp_path):
    s = start_server(model_dir, tmp_path / "key.log", "--log-interval", "0",
                     api_key="browser-key")
    try:
        with Page(browser, s.url + "/dashboard") as p:
            assert p.page.url.endswith("/dashboard/login")
            p.page.fill("#key", "wrong")
            p.page.click("#login")
            assert "not this server" in p.page.inner_text("#error")
            p.page.fill("#key", "browser-key")
            p.page.click("#login")
            p.page.wait_for_url("**/dashboard")
            p.wait_live()
            p.page.fill("#pg-max", "4")
            p.page.click("#pg-run")  # the playground's request rides on the session
            p.wait("document.getElementById('pg-status').textContent === 'done'")
            assert p.page.locator("#pg-out .tok").count() == 4
            errors = [e for e in p.errors if "401" not in e]  # the wrong key's page, above
            assert errors == []
            # the header's logout ends the session: the dashboard asks for the key again
            p.page.click("#logout button")
            p.page.wait_for_url("**/dashboard/login")
            p.page.goto(s.url + "/dashboard")
            assert p.page.url.endswith("/dashboard/login")
    finally:
        s.stop()
