"""The bundled default model (phasewise/assets/stdlib-coder), served with no --model.

The model is trained by scripts/train_default_model.py and committed; these tests load the
committed files. Its greedy output through the engine must equal an independent forward pass
of the same weights (transformers' LlamaForCausalLM), and must look like Python.
"""

from __future__ import annotations

import itertools
import json
import keyword
import math
import signal
import sysconfig
from pathlib import Path

import httpx
import pytest
import torch

from phasewise import LLM, SamplingParams
from phasewise.cli import main as cli_main
from phasewise.config import BUNDLED_MODEL
from tests.serving import start_server

PROMPT = "def fibonacci(n):"
N_TOKENS = 48

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model():
    model = transformers.LlamaForCausalLM.from_pretrained(str(BUNDLED_MODEL))
    return model.float().eval()


@pytest.fixture(scope="module")
def hf_prompt_ids():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json")).encode(PROMPT).ids


@pytest.fixture(scope="module")
def hf_greedy(hf_model, hf_prompt_ids):
    """N_TOKENS greedy tokens from transformers' forward pass over the whole sequence."""
    ids = list(hf_prompt_ids)
    with torch.no_grad():
        for _ in range(N_TOKENS):
            ids.append(int(hf_model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(hf_prompt_ids):]


@pytest.fixture(scope="module")
def default_llm():
    return LLM()  # no folder: the bundled model, its own dtype (bf16), default kernels


@pytest.fixture(scope="module")
def fp32_llm():
    # fp32 arithmetic on the bf16 weights, as transformers' forward here: the same function
    # on any machine up to summation order (the bf16 path's kernel choice is timed per run)
    return LLM(dtype="float32")


def greedy(llm, prompt=PROMPT, n=N_TOKENS):
    return llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                               ignore_eos=True))[0]


def test_bundled_model_is_a_small_standard_hf_checkpoint():
    names = {p.name for p in BUNDLED_MODEL.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "README.md"} <= names
    size = sum(p.stat().st_size for p in BUNDLED_MODEL.iterdir())
    assert size < 50e6
    cfg = json.loads((BUNDLED_MODEL / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    tok_cfg = json.loads((BUNDLED_MODEL / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"]
    card = (BUNDLED_MODEL / "README.md").read_text()
    assert "What it is not" in card
    info = json.loads((BUNDLED_MODEL / "training.json").read_text())
    assert info["held_out_loss"] < 0.6 * math.log(info["vocab_size"])  # it learned something
    assert f"held out {info['held_out_loss']:.3f}" in card


def test_engine_greedy_equals_transformers_forward(fp32_llm, hf_prompt_ids, hf_greedy):
    out = greedy(fp32_llm)
    assert out.prompt_token_ids == hf_prompt_ids
    assert out.token_ids == hf_greedy


def test_default_dtype_and_kernels_agree_with_transformers(default_llm, hf_model,
                                                           hf_prompt_ids, hf_greedy):
    # bf16 weights through phasewise's CPU kernels (fp32 arithmetic, bf16 activations where
    # the reference rounds them) against transformers in fp32: where the greedy paths part,
    # transformers' own logits must show a near-tie between the two choices.
    out = greedy(default_llm)
    for i, (ours, ref) in enumerate(zip(out.token_ids, hf_greedy)):
        if ours != ref:
            with torch.no_grad():
                logits = hf_model(input_ids=torch.tensor([hf_prompt_ids + hf_greedy[:i]]))
            row = logits.logits[0, -1]
            assert row[ref] - row[ours] < 0.1, (i, float(row[ref] - row[ours]))
            break


def test_greedy_output_looks_like_python_not_noise(fp32_llm):
    out = greedy(fp32_llm)
    ids = out.token_ids
    assert len(set(ids)) >= len(ids) // 3, ids  # many distinct tokens
    longest_run = max(sum(1 for _ in g) for _, g in itertools.groupby(ids))
    assert longest_run <= 4, ids
    text = out.text
    lines = [ln for ln in (PROMPT + text).split("\n") if ln.strip()]
    assert len(lines) >= 3, text
    indents = [len(ln) - len(ln.lstrip(" ")) for ln in lines]
    assert sum(i % 4 == 0 for i in indents) >= 0.8 * len(indents), text  # PEP 8 indents
    assert indents[1] > 0, text  # the def has an indented body
    words = set(text.replace("(", " ").replace(")", " ").replace(":", " ").split())
    assert words & (set(keyword.kwlist) | {"self"}), text


def test_model_predicts_stdlib_source_far_better_than_chance(hf_model):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    # __future__.py sorts first in every stdlib, so the script always holds it out
    text = (Path(sysconfig.get_paths()["stdlib"]) / "__future__.py").read_text()
    ids = tok.encode(text).ids[-256:]  # its code (the start is a docstring in English)
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([ids])).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item()
    assert nll < 0.6 * math.log(tok.get_vocab_size()), nll  # random weights: ~ln(V)


def test_chat_template_turns_messages_into_comments(default_llm):
    text = default_llm.tokenizer.apply_chat_template(
        [{"role": "system", "content": "stdlib style"},
         {"role": "user", "content": "reverse a list\nin place"}])
    assert text == "<|bos|># stdlib style\n# reverse a list\n# in place\ndef "


def test_generate_without_model_prints_both_phases_and_their_bounds(tmp_path, monkeypatch,
                                                                    capsys):
    # A machine file so that no measurement runs: 100 GFLOP/s (fp32, and bf16 for CPUs whose
    # calibrated plan keeps torch's bf16 GEMM for prefill), 10 GB/s: ridge 10.
    (tmp_path / "machine.json").write_text(json.dumps({"cpu-local": {
        "name": "test CPU", "peak_flops": {"fp32": 100e9, "bf16": 100e9}, "mem_bytes": 8e9,
        "mem_bandwidth": 10e9}}))
    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path))
    assert cli_main(["generate", PROMPT, "--max-tokens", "12", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert out.strip()
    assert "stdlib-coder" in err
    assert "[prefill]" in err and "TTFT" in err and "[decode]   11 tokens," in err
    assert "ridge 10.0 FLOP/byte" in err
    # a 10-token prompt on a 4 M-parameter bf16 model: ~7.5 FLOP/byte, below this ridge
    assert "prefill was memory-bound and decode was memory-bound" in err
    assert "tokens or more would make prefill compute-bound" in err


def test_serve_without_model_serves_the_bundled_model(tmp_path, fp32_llm):
    server = start_server(None, tmp_path / "server.log", "--max-num-seqs", "2",
                          "--dtype", "float32")
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            assert c.get("/v1/models").json()["data"][0]["id"] == "stdlib-coder"
            r = c.post("/v1/completions", json={"model": "stdlib-coder", "prompt": PROMPT,
                                                "max_tokens": 24, "temperature": 0,
                                                "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == greedy(fp32_llm, n=24).text
            chat = c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "sort a list"}], "max_tokens": 8,
                "temperature": 0, "ignore_eos": True})
            assert chat.status_code == 200, chat.text
            # the template's BOS is the only one: exactly what the offline engine sees
            tok = fp32_llm.tokenizer
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "sort a list"}]),
                             add_special_tokens=False)
            assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
            assert chat.json()["usage"]["prompt_tokens"] == len(ids)
            assert chat.json()["choices"][0]["message"]["content"] == greedy(
                fp32_llm, ids, n=8).text
        # Ctrl-C drains and exits cleanly, without a traceback
        assert server.stop(signal.SIGINT) == 0
        assert "Traceback" not in server.log() and "Finished server process" in server.log()
    finally:
        server.stop()
