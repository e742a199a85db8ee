"""Shared fixtures: tiny random-weight checkpoints written by HF transformers itself.

transformers builds and saves the reference model (``save_pretrained``), so the files phasewise
loads are exactly what real checkpoints look like, and the same in-memory model serves as the
reference implementation.
"""

from __future__ import annotations

import os

# Triton kernels (phasewise.model.triton_ops) run on CPU through Triton's interpreter, which
# must be chosen before triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path
from typing import Any

import pytest
import torch

from phasewise.model.tiny import train_tokenizer

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]

_CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
    "        self.items.append(x)\n",
    "import os, sys\nfor path in sys.argv[1:]:\n    print(os.path.getsize(path))\n",
    "Prefill is compute-bound; decode is bound by memory bandwidth. Ünïcödé ✓ 日本語 🙂\n",
]


def hf_config(arch: str, vocab_size: int, **over: Any):
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
    )
    common.update(over)
    cls = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
        "MixtralForCausalLM": transformers.MixtralConfig,
        "Qwen2MoeForCausalLM": transformers.Qwen2MoeConfig,
        "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
    }[arch]
    if arch == "MixtralForCausalLM":  # 4 experts of intermediate_size, 2 per token
        common.setdefault("num_local_experts", 4)
        common.setdefault("num_experts_per_tok", 2)
        common.setdefault("sliding_window", None)
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        common.setdefault("num_experts", 4)
        common.setdefault("num_experts_per_tok", 2)
        common.setdefault("moe_intermediate_size", 48)
    if arch == "Qwen2MoeForCausalLM":
        common.setdefault("shared_expert_intermediate_size", 80)
    if arch == "Qwen3MoeForCausalLM":
        common.setdefault("head_dim", 16)
    if arch == "MistralForCausalLM":
        common.setdefault("sliding_window", None)
    if arch == "Qwen3ForCausalLM":
        common.setdefault("head_dim", 16)
    return cls(**common)


def build_hf_checkpoint(out: Path, arch: str, dtype: torch.dtype = torch.float32, seed: int = 0,
                        max_shard_size: str | None = None, **over: Any):
    """Write a random-weight checkpoint with transformers; return the in-memory HF model."""
    import transformers

    vocab = train_tokenizer(out, _CORPUS, vocab_size=300)
    # over["vocab_size"]: the model's table, wider than the tokenizer's (its ids stay below)
    cfg = hf_config(arch, over.pop("vocab_size", vocab), **over)
    torch.manual_seed(seed)
    model_cls = getattr(transformers, arch)
    model = model_cls(cfg).eval()
    # Spread the weights: HF's default init (std 0.02) gives near-uniform logits, where
    # greedy ties would make parity a coin toss.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    return model


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, tuple[Path, Any]]:
    """One fp32 checkpoint per supported architecture: {arch: (folder, hf_model)}."""
    out = {}
    for i, arch in enumerate(ARCHS):
        path = tmp_path_factory.mktemp(arch)
        over: dict[str, Any] = {}
        if arch == "LlamaForCausalLM":
            over["tie_word_embeddings"] = True  # cover tied embeddings too
        out[arch] = (path, build_hf_checkpoint(path, arch, seed=i, **over))
    return out


@pytest.fixture(scope="session")
def llama_dir(hf_checkpoints) -> Path:
    return hf_checkpoints["LlamaForCausalLM"][0]


def padded(llm):
    """``llm`` with its runner replaced by one whose decode-only steps take the CUDA graphs'
    padded static buffers, run eagerly on CPU (before any step, so the KV cache holds
    nothing yet)."""
    from phasewise.engine.model_runner import ModelRunner

    eng = llm.engine
    old = eng.runner
    eng.runner = ModelRunner(eng.model, eng.model_config, num_blocks=old.kv_cache.shape[2],
                             block_size=old.block_size, dtype=old.kv_cache.dtype,
                             device=old.device, decode_graphs="padded",
                             max_model_len=eng.max_model_len)
    eng.connector.io = eng.runner
    return llm


def cache_with_kernels(path: Path) -> Path:
    """A fresh phasewise cache folder at ``path`` (for ``PHASEWISE_CACHE_DIR``) that holds no
    stored figures or plans but shares the compiled CPU kernels of the cache the tests
    otherwise use, so an engine started on it does not compile them again (tens of seconds
    on two cores). The kernels' file names carry their sources' hash, so sharing them is
    safe."""
    from phasewise.model.cpu.kernels import cache_dir

    kernels = cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    path.mkdir(parents=True, exist_ok=True)
    (path / "kernels").symlink_to(kernels.resolve(), target_is_directory=True)
    return path


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """Reference greedy continuation of ``n`` tokens that ignores end-of-sequence."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()




async def streamed_greedy_tokens(client, prompt: list[int], n: int) -> list[str]:
    """Stream a greedy completion of ``n`` tokens of ``prompt`` through an OpenAI server
    (``client``: an httpx client on it) and return each streamed token as the server names
    it (its logprobs' ``tokens``)."""
    import json

    ids: list[str] = []
    async with client.stream("POST", "/v1/completions", json={
            "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "logprobs": 0}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    ids += ch["logprobs"]["tokens"]
    return ids


async def collect(group) -> dict:
    """Every output of an engine request group, by index, then close it."""
    outs = {}
    try:
        async for idx, out in group:
            outs[idx] = out
    finally:
        group.close()
    return outs
