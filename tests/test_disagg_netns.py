"""The K/V really crosses a network interface: the decode worker runs in one network namespace
and the prefill worker in another, joined by a veth pair, so the prefill worker reaches the
decode worker's K/V port only over that link. Both namespaces (and their addresses) are made
by this test and removed by it; every process is stopped by PID.

Needs root and iproute2 (``scripts/test.sh`` installs iproute2 where it is missing); skipped,
saying why, where network namespaces cannot be made."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from conftest import build_hf_checkpoint
from phasewise import LLM, SamplingParams

PROMPT = "def fibonacci(n):"
DECODE_IP, PREFILL_IP = "10.250.17.1", "10.250.17.2"  # inside this test's own namespaces


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def namespaces():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make network namespaces")
    tag = uuid.uuid4().hex[:6]
    ns_d, ns_p = f"pw-d-{tag}", f"pw-p-{tag}"
    made: list[str] = []
    try:
        for ns in (ns_d, ns_p):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", f"vd{tag}", "netns", ns_d, "type", "veth", "peer", "name",
            f"vp{tag}", "netns", ns_p)
        for ns, dev, addr in ((ns_d, f"vd{tag}", DECODE_IP), (ns_p, f"vp{tag}", PREFILL_IP)):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
    except subprocess.CalledProcessError as e:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {e.stderr.strip()}")
    yield ns_d, ns_p
    for ns in made:  # deleting a namespace removes its end of the veth pair, and so both
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _spawn(ns: str, args: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *args], stdout=log,
                            stderr=subprocess.STDOUT)


CLIENT = textwrap.dedent("""
    import json, sys, time, httpx
    url, prompt = sys.argv[1], sys.argv[2]
    deadline = time.monotonic() + 120
    def alive():
        try:
            text = httpx.get(url + "/metrics", timeout=2).text
        except httpx.HTTPError:
            return False
        return any(l.startswith("phasewise:kv_peers_alive") and l.split()[-1] == "1.0"
                   for l in text.splitlines())
    while not alive():
        if time.monotonic() > deadline:
            sys.exit("the prefill worker never connected over the veth link")
        time.sleep(0.2)
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
    m = httpx.get(url + "/metrics", timeout=5).text
    done = [l for l in m.splitlines() if l.startswith("phasewise:remote_prefills_total")
            and 'outcome="done"' in l]
    print(json.dumps({"text": r.json()["choices"][0]["text"],
                      "done": float(done[0].split()[-1])}))
""")


def test_kv_crosses_a_veth_link_between_two_namespaces(namespaces, tmp_path):
    ns_d, ns_p = namespaces
    model = tmp_path / "model"
    build_hf_checkpoint(model, "LlamaForCausalLM", seed=2, max_position_embeddings=512)
    secret = tmp_path / "kv.secret"
    secret.write_bytes(b"a-shared-secret-for-the-kv-port\n")
    want = LLM(str(model)).generate(PROMPT, SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True))[0].text
    kv = f"tcp://{DECODE_IP}:18900"  # a port of the decode namespace's own address
    common = ["-m", "phasewise.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
              "--port", "18901", "--kv-secret-file", str(secret), "--log-interval", "0"]
    procs = []
    with open(tmp_path / "decode.log", "wb") as dlog, open(tmp_path / "prefill.log", "wb") as plog:
        try:
            procs.append(_spawn(ns_d, [*common, "--role", "decode", "--kv-bind", kv], dlog))
            # The decode worker's K/V port must be up before the prefill worker's handshake.
            client = subprocess.Popen(
                ["ip", "netns", "exec", ns_d, sys.executable, "-c", CLIENT,
                 "http://127.0.0.1:18901", PROMPT], stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True)
            procs.append(client)
            deadline = time.monotonic() + 120
            while b"K/V port" not in (tmp_path / "decode.log").read_bytes():
                assert procs[0].poll() is None, (tmp_path / "decode.log").read_text()
                assert time.monotonic() < deadline
                time.sleep(0.1)
            procs.append(_spawn(ns_p, [*common, "--role", "prefill", "--kv-connect", kv],
                                plog))
            out, err = client.communicate(timeout=240)
            assert client.returncode == 0, err + (tmp_path / "prefill.log").read_text()
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
    got = json.loads(out)
    assert got["text"] == want
    assert got["done"] == 1.0  # its prompt came over the veth link, not computed locally
    assert "accepted KV peer" in (tmp_path / "decode.log").read_text()
