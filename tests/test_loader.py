"""Checkpoint loading: formats, dtypes, RoPE variants and the errors that name the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import build_hf_checkpoint, hf_greedy
from phasewise import LLM, SamplingParams
from phasewise.model.config import ModelConfig
from phasewise.model.loader import load_model
from phasewise.model.tiny import make_tiny_checkpoint, tiny_config, train_tokenizer
from test_parity import our_logits, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
], ids=["linear", "llama3"])
def test_rope_scaling_matches_hf(tmp_path, rope):
    hf = build_hf_checkpoint(tmp_path, "LlamaForCausalLM", seed=4, rope_theta=5000.0,
                             rope_scaling=rope)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved.get("rope_parameters") or saved.get("rope_scaling"))["rope_type"] == rope[
        "rope_type"]
    ids = random_prompts(hf.config.vocab_size, [70], seed=1)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(our_logits(tmp_path, torch.float32, ids), ref,
                               atol=1e-4, rtol=1e-4)
    # The scaling changes the function: without it the logits differ.
    plain = _copy(tmp_path, tmp_path.parent / (tmp_path.name + "-plain"))
    _edit_config(plain, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    assert (our_logits(plain, torch.float32, ids) - ref).abs().max() > 1e-2


def test_sharded_checkpoint_loads(tmp_path):
    hf = build_hf_checkpoint(tmp_path, "Qwen2ForCausalLM", seed=2, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    prompt = random_prompts(hf.config.vocab_size, [12], seed=0)[0]
    out = LLM(str(tmp_path)).generate(prompt, GREEDY)[0]
    assert out.token_ids == hf_greedy(hf, prompt, 24)


def test_dtype_conversion_on_load(tmp_path):
    build_hf_checkpoint(tmp_path, "LlamaForCausalLM", dtype=torch.bfloat16, seed=1)
    assert ModelConfig.from_file(tmp_path).dtype == "bfloat16"
    for asked, expected in [("auto", torch.bfloat16), ("float32", torch.float32),
                            ("float16", torch.float16)]:
        llm = LLM(str(tmp_path), dtype=asked)
        assert llm.engine.model.embed_tokens.weight.dtype == expected
        assert llm.engine.runner.kv_cache.dtype == expected
    with pytest.raises(ValueError, match="dtype must be one of auto, float32"):
        LLM(str(tmp_path), dtype="int4")


def test_progress_is_reported(tmp_path):
    build_hf_checkpoint(tmp_path, "LlamaForCausalLM")
    cfg = ModelConfig.from_file(tmp_path)
    seen = []
    load_model(tmp_path, cfg, dtype=torch.float32, device=torch.device("cpu"), max_positions=64,
               progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1]
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))


def test_unknown_architecture_lists_supported(tmp_path):
    build_hf_checkpoint(tmp_path, "LlamaForCausalLM")
    _edit_config(tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM, "
                                         "MistralForCausalLM, MixtralForCausalLM, "
                                         "Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3"):
        LLM(str(tmp_path))


def test_unsupported_rope_type_lists_supported(tmp_path):
    build_hf_checkpoint(tmp_path, "LlamaForCausalLM")
    _edit_config(tmp_path, rope_parameters={"rope_type": "yarn", "factor": 2.0,
                                            "rope_theta": 1e4})
    with pytest.raises(ValueError, match="'yarn'.*default, linear, llama3"):
        LLM(str(tmp_path))


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    build_hf_checkpoint(tmp_path, "LlamaForCausalLM", tie_word_embeddings=False)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.mystery.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        LLM(str(tmp_path))
    msg = str(err.value)
    assert "missing tensors model.layers.1.mlp.up_proj.weight" in msg
    assert "unexpected tensors model.layers.0.mystery.weight" in msg


def test_mismatched_tensor_shape_is_named(tmp_path):
    build_hf_checkpoint(tmp_path, "LlamaForCausalLM")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_proj.weight .*shape "
                                         r"\(3, 64\), expected \(32, 64\)"):
        LLM(str(tmp_path))


def test_missing_tokenizer_and_weights_are_named(tmp_path):
    build_hf_checkpoint(tmp_path, "LlamaForCausalLM")
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        LLM(str(tmp_path))
    (tmp_path / "model.safetensors").unlink()
    train_tokenizer(tmp_path, ["some text for a tokenizer"], vocab_size=280)
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors weights"):
        LLM(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))


def test_sliding_window_shorter_than_context_is_served(tmp_path):
    """(tests/test_windows.py serves such windows; here: the context is the model's.)"""
    build_hf_checkpoint(tmp_path, "MistralForCausalLM", sliding_window=64)
    llm = LLM(str(tmp_path))
    assert llm.engine.max_model_len == 512 and llm.engine.kv.window == 64


def test_qwen2_window_counts_only_when_enabled(tmp_path):
    build_hf_checkpoint(tmp_path, "Qwen2ForCausalLM")
    _edit_config(tmp_path, sliding_window=32, use_sliding_window=False, layer_types=None)
    assert ModelConfig.from_file(tmp_path).sliding_window is None
    _edit_config(tmp_path, use_sliding_window=True, max_window_layers=0)
    assert ModelConfig.from_file(tmp_path).sliding_window == 32


def test_generation_config_sets_eos_and_defaults(tmp_path):
    build_hf_checkpoint(tmp_path, "LlamaForCausalLM")
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [1, 5], "do_sample": True, "temperature": 0.6, "top_p": 0.9}))
    llm = LLM(str(tmp_path))
    assert set(llm.engine.eos_token_ids) >= {1, 5}
    p = llm.engine.default_sampling_params()
    assert (p.temperature, p.top_p) == (0.6, 0.9)


def test_own_tiny_checkpoint_loads_in_hf_and_agrees(tmp_path):
    """make-tiny writes a checkpoint HF reads as the same model (checks the writer too)."""
    import transformers

    make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", vocab_size=300, hidden_size=32,
                         num_heads=4, num_kv_heads=2, num_layers=2, intermediate_size=64)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    prompt = random_prompts(hf.config.vocab_size, [10], seed=3)[0]
    out = LLM(str(tmp_path)).generate(prompt, GREEDY)[0]
    assert out.token_ids == hf_greedy(hf, prompt, 24)


def test_tiny_config_rejects_bad_heads():
    cfg = tiny_config(vocab_size=100, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        ModelConfig.from_dict(cfg)
