"""The bundled default model (phasewise/assets/stdlib-coder), served with no --model.

The model is trained by scripts/train_default_model.py and committed; these tests load the
committed files. Its greedy output through the engine must equal an independent forward pass
of the same weights (transformers' LlamaForCausalLM), and must look like Python.
"""

from __future__ import annotations

import json
import keyword
import math
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


def test_engine_greedy_equals_transformers_forward(hf_prompt_ids, hf_greedy):
    out = greedy(LLM(dtype="float32"))
    assert out.prompt_token_ids == hf_prompt_ids
    assert out.token_ids == hf_greedy


def test_default_dtype_and_kernels_agree_with_transformers(default_llm, hf_greedy):
    # bf16 weights, phasewise's CPU kernels (fp32 arithmetic) vs transformers in fp32 on the
    # same bf16 weights: activations are rounded differently, so allow a late divergence.
    out = greedy(default_llm)
    same = next((i for i, (a, b) in enumerate(zip(out.token_ids, hf_greedy)) if a != b),
                len(hf_greedy))
    assert same >= 16, (out.token_ids, hf_greedy)


def test_greedy_output_looks_like_python_not_noise(default_llm):
    out = greedy(default_llm)
    ids = out.token_ids
    assert len(set(ids)) >= len(ids) // 3, ids  # many distinct tokens
    longest_run = max(sum(1 for _ in g) for _, g in __import__("itertools").groupby(ids))
    assert longest_run <= 4, ids
    text = out.text
    lines = [ln for ln in (PROMPT + text).split("\n") if ln.strip()]
    assert len(lines) >= 3, text
    indents = [len(ln) - len(ln.lstrip(" ")) for ln in lines]
    assert all(i % 4 == 0 for i in indents), text  # PEP 8 indentation, like the stdlib
    assert any(i > 0 for i in indents[1:]), text  # the def has an indented body
    words = set(text.replace("(", " ").replace(")", " ").replace(":", " ").split())
    assert words & (set(keyword.kwlist) | {"self"}), text


def test_model_predicts_stdlib_source_far_better_than_chance(hf_model):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    ids = tok.encode(text).ids[:256]
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([ids])).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item()
    assert nll < 0.6 * math.log(tok.get_vocab_size()), nll  # random weights: ~ln(V)


def test_chat_template_turns_messages_into_comments(default_llm):
    text = default_llm.tokenizer.apply_chat_template(
        [{"role": "system", "content": "stdlib style"},
         {"role": "user", "content": "reverse a list\nin place"}])
    assert text == "# stdlib style\n# reverse a list\n# in place\ndef "


def test_generate_without_model_prints_both_phases_and_their_bounds(tmp_path, monkeypatch,
                                                                    capsys):
    # A machine file so that no measurement runs: 100 GFLOP/s fp32, 10 GB/s, ridge 10.
    (tmp_path / "machine.json").write_text(json.dumps({"cpu-local": {
        "name": "test CPU", "peak_flops": {"fp32": 100e9}, "mem_bytes": 8e9,
        "mem_bandwidth": 10e9}}))
    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path))
    assert cli_main(["generate", PROMPT, "--max-tokens", "12", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert out.strip()
    assert "stdlib-coder" in err
    assert "[prefill]" in err and "TTFT" in err and "[decode]   11 tokens," in err
    assert "ridge 10.0 FLOP/byte" in err
    # a 7-token prompt on a 4 M-parameter bf16 model: ~3-4 FLOP/byte, below the ridge
    assert "prefill was memory-bound and decode was memory-bound" in err
    assert "would make prefill compute-bound" in err


def test_serve_without_model_serves_the_bundled_model(tmp_path, default_llm):
    server = start_server(None, tmp_path / "server.log", "--max-num-seqs", "2")
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            assert c.get("/v1/models").json()["data"][0]["id"] == "stdlib-coder"
            r = c.post("/v1/completions", json={"model": "stdlib-coder", "prompt": PROMPT,
                                                "max_tokens": 24, "temperature": 0,
                                                "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == greedy(default_llm, n=24).text
    finally:
        server.stop()
