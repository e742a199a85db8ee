"""Make small random-weight checkpoints in standard Hugging Face layout.

Used by ``phasewise make-tiny`` (the README's first run needs a model and nothing can be
downloaded) and by the tests. The files are the ones a real checkpoint has: ``config.json``,
``generation_config.json``, ``model.safetensors``, ``tokenizer.json`` and
``tokenizer_config.json`` with a chat template, so they load through the same path.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import Any

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def stdlib_text(max_bytes: int = 2_000_000) -> list[str]:
    """Deterministic training text found on every machine: the stdlib's own sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def train_tokenizer(out_dir: str | Path, texts: Iterable[str], vocab_size: int = 512, *,
                    chat_template: str = CHAT_TEMPLATE, model_max_length: int = 4096) -> int:
    """Train a byte-level BPE tokenizer on ``texts`` and save tokenizer files.

    Encoding adds BOS in front (the post-processor). Returns the vocabulary size actually
    reached (special tokens included).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    with open(out / "tokenizer_config.json", "w") as f:
        json.dump({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
            "chat_template": chat_template, "model_max_length": model_max_length,
        }, f, indent=2)
    return tok.get_vocab_size()


def tiny_config(
    architecture: str = "LlamaForCausalLM", *, vocab_size: int, hidden_size: int = 64,
    intermediate_size: int = 128, num_layers: int = 2, num_heads: int = 4,
    num_kv_heads: int = 2, head_dim: int | None = None, tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0, rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int = 4096, dtype: str = "float32", bos_token_id: int = 0,
    eos_token_id: int = 1, **extra: Any,
) -> dict[str, Any]:
    """A config.json dict in the layout transformers writes for ``architecture``."""
    model_type = {
        "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
        "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
        "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
        "Qwen3MoeForCausalLM": "qwen3_moe",
    }[architecture]
    # mixture of experts: 4 experts, 2 a token (Qwen's: half-width experts; Qwen2-MoE's
    # shared expert as wide as the dense MLP); ``extra`` overrides any of them
    if architecture == "MixtralForCausalLM":
        extra = {"num_local_experts": 4, "num_experts_per_tok": 2, **extra}
    elif architecture in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        extra = {"num_experts": 4, "num_experts_per_tok": 2,
                 "moe_intermediate_size": max(1, intermediate_size // 2),
                 "norm_topk_prob": architecture == "Qwen3MoeForCausalLM", **extra}
        if architecture == "Qwen2MoeForCausalLM":
            extra = {"shared_expert_intermediate_size": intermediate_size, **extra}
    cfg: dict[str, Any] = {
        "architectures": [architecture], "model_type": model_type,
        "vocab_size": vocab_size, "hidden_size": hidden_size,
        "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim or hidden_size // num_heads, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": rope_theta,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings, "torch_dtype": dtype,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
    }
    if rope_scaling:
        cfg["rope_scaling"] = rope_scaling
    cfg.update(extra)
    return cfg


def _expert_weights(cfg: Any, p: str, rnd: Any) -> dict[str, Any]:
    """A sparse layer's router and experts (and shared expert), each tensor the loader asks
    for under the name the checkpoint's architecture gives it (``loader.expert_targets``:
    its rows; a down projection's columns are its expert's width, the rest the hidden
    size)."""
    from phasewise.model.loader import expert_targets

    m = cfg.moe
    cols = {"down": m.intermediate_size, "shared_down.weight": m.shared_intermediate_size}
    return {name: rnd(rows, cols.get(param, cfg.hidden_size))
            for name, (param, _, rows) in expert_targets(cfg, p, "").items()}


def write_random_weights(out_dir: str | Path, config: dict[str, Any], seed: int = 0,
                         std: float = 0.05) -> None:
    """Write config.json, generation_config.json and random ``model.safetensors``."""
    import torch
    from safetensors.torch import save_file

    from phasewise.model.config import ModelConfig
    from phasewise.model.loader import DTYPES

    cfg = ModelConfig.from_dict(config)
    dtype = DTYPES[cfg.dtype]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + torch.randn(n, generator=g) * 0.1).to(dtype)

    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    t = {"model.embed_tokens.weight": rnd(cfg.vocab_size, h), "model.norm.weight": norm(h)}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = rnd(cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(h)
        t[p + "post_attention_layernorm.weight"] = norm(h)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            t[f"{p}self_attn.{name}.weight"] = rnd(rows, h)
            if cfg.qkv_bias:
                t[f"{p}self_attn.{name}.bias"] = rnd(rows)
        t[p + "self_attn.o_proj.weight"] = rnd(h, q)
        if cfg.o_bias:
            t[p + "self_attn.o_proj.bias"] = rnd(h)
        if cfg.qk_norm:
            t[p + "self_attn.q_norm.weight"] = norm(cfg.head_dim)
            t[p + "self_attn.k_norm.weight"] = norm(cfg.head_dim)
        if cfg.moe is not None and i in cfg.moe.layers:
            t.update(_expert_weights(cfg, p, rnd))
            continue
        t[p + "mlp.gate_proj.weight"] = rnd(inter, h)
        t[p + "mlp.up_proj.weight"] = rnd(inter, h)
        t[p + "mlp.down_proj.weight"] = rnd(h, inter)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    with open(out / "generation_config.json", "w") as f:
        json.dump({"bos_token_id": config.get("bos_token_id"),
                   "eos_token_id": config.get("eos_token_id")}, f, indent=2)


def make_tiny_checkpoint(out_dir: str | Path, architecture: str = "LlamaForCausalLM",
                         vocab_size: int = 512, seed: int = 0, **config_kwargs: Any) -> Path:
    """Tokenizer trained on stdlib text plus a random-weight model, in HF layout."""
    from tokenizers import Tokenizer

    out = Path(out_dir)
    real_vocab = train_tokenizer(out, stdlib_text(), vocab_size=vocab_size)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    config = tiny_config(architecture, vocab_size=real_vocab, bos_token_id=tok.token_to_id(BOS),
                         eos_token_id=tok.token_to_id(EOS), **config_kwargs)
    write_random_weights(out, config, seed=seed)
    return out
