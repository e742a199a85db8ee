"""Load a Hugging Face checkpoint folder's weights into ``CausalLM``.

Weights are read tensor by tensor from memory-mapped safetensors files and copied straight into
preallocated parameters of the target dtype and device, so peak memory stays near one copy of
the model plus the largest single tensor.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from phasewise.model.config import ModelConfig
from phasewise.model.layers import RotaryEmbedding
from phasewise.model.cpu.quant import prepare_int8, quantize_rows_int8
from phasewise.model.transformer import CausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
# Tensors some checkpoints carry that the forward pass recomputes.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
# Checkpoints above this size report loading progress by default.
PROGRESS_MIN_BYTES = 256 * 1024 * 1024
# load_format "dummy": matrices and biases ~ N(0, DUMMY_STD); norm weights 1 + N(0, 0.1 * it).
DUMMY_STD = 0.02

ProgressFn = Callable[[int, int], None]  # (bytes loaded so far, total bytes)


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig) -> torch.dtype:
    """The torch dtype to load into: ``auto`` keeps the checkpoint's own dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; allowed: {', '.join(DTYPE_CHOICES)}")
        return dtype
    if dtype == "auto":
        return DTYPES.get(cfg.dtype, torch.float32)
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; allowed: {', '.join(DTYPE_CHOICES)}")
    return DTYPES[dtype]


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        missing = sorted({s for s in weight_map.values() if not (model_dir / s).exists()})
        if missing:
            raise FileNotFoundError(f"{index} names shard files that are missing: {missing}")
        return {name: model_dir / shard for name, shard in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        extra = ""
        if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
            extra = " (only PyTorch .bin/.pt weights found; convert them to safetensors)"
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}{extra}; "
                                "load_format 'dummy' (--load-format dummy) fills the model "
                                "with random weights of its shape instead")
    out: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                out[name] = path
    return out


def _targets(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Checkpoint tensor name -> (parameter name, first row, row count) it fills."""
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    t: dict[str, tuple[str, int, int]] = {
        "model.embed_tokens.weight": ("embed_tokens.weight", 0, cfg.vocab_size),
        "model.norm.weight": ("norm.weight", 0, cfg.hidden_size),
    }
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = ("lm_head.weight", 0, cfg.vocab_size)
    suffixes = ["weight"]
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for ln in ("input_layernorm", "post_attention_layernorm"):
            t[f"{src}{ln}.weight"] = (f"{dst}{ln}.weight", 0, cfg.hidden_size)
        qkv_suffixes = ["weight", "bias"] if cfg.qkv_bias else suffixes
        for s in qkv_suffixes:
            t[f"{src}self_attn.q_proj.{s}"] = (f"{dst}qkv_proj.{s}", 0, q)
            t[f"{src}self_attn.k_proj.{s}"] = (f"{dst}qkv_proj.{s}", q, kv)
            t[f"{src}self_attn.v_proj.{s}"] = (f"{dst}qkv_proj.{s}", q + kv, kv)
        for s in ["weight", "bias"] if cfg.o_bias else suffixes:
            t[f"{src}self_attn.o_proj.{s}"] = (f"{dst}o_proj.{s}", 0, cfg.hidden_size)
        if cfg.qk_norm:
            t[f"{src}self_attn.q_norm.weight"] = (f"{dst}q_norm.weight", 0, cfg.head_dim)
            t[f"{src}self_attn.k_norm.weight"] = (f"{dst}k_norm.weight", 0, cfg.head_dim)
        if cfg.moe is not None and i in cfg.moe.layers:
            t.update(expert_targets(cfg, src, f"{dst}moe."))
            continue
        for s in ["weight", "bias"] if cfg.mlp_bias else suffixes:
            t[f"{src}mlp.gate_proj.{s}"] = (f"{dst}gate_up_proj.{s}", 0, inter)
            t[f"{src}mlp.up_proj.{s}"] = (f"{dst}gate_up_proj.{s}", inter, inter)
            t[f"{src}mlp.down_proj.{s}"] = (f"{dst}down_proj.{s}", 0, cfg.hidden_size)
    return t


def expert_targets(cfg: ModelConfig, src: str, dst: str) -> dict[str, tuple[str, int, int]]:
    """A sparse layer's router and experts (``SparseMoE``): each expert's gate and up into its
    rows of ``gate_up``, its down projection into its rows of ``down``; Mixtral names them
    ``block_sparse_moe.experts.E.w1/w3/w2``, Qwen's MoE models ``mlp.experts.E.gate_proj/
    up_proj/down_proj``, with a shared expert and its gate beside them."""
    m = cfg.moe
    assert m is not None
    h, i = cfg.hidden_size, m.intermediate_size
    mixtral = cfg.architecture == "MixtralForCausalLM"
    base = f"{src}block_sparse_moe." if mixtral else f"{src}mlp."
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    t = {f"{base}gate.weight": (f"{dst}gate.weight", 0, m.num_experts)}
    for e in range(m.num_experts):
        g, u, d = (f"{base}experts.{e}.{n}.weight" for n in names)
        t[g] = (f"{dst}gate_up", e * 2 * i, i)
        t[u] = (f"{dst}gate_up", e * 2 * i + i, i)
        t[d] = (f"{dst}down", e * h, h)
    s = m.shared_intermediate_size
    if s:
        t[f"{base}shared_expert.gate_proj.weight"] = (f"{dst}shared_gate_up.weight", 0, s)
        t[f"{base}shared_expert.up_proj.weight"] = (f"{dst}shared_gate_up.weight", s, s)
        t[f"{base}shared_expert.down_proj.weight"] = (f"{dst}shared_down.weight", 0, h)
        t[f"{base}shared_expert_gate.weight"] = (f"{dst}shared_expert_gate.weight", 0, 1)
    return t


def _stderr_progress() -> ProgressFn:
    start = time.monotonic()
    last = [-1]

    def report(done: int, total: int) -> None:
        pct = int(100 * done / max(total, 1))
        if pct // 10 != last[0] // 10 or done == total:
            last[0] = pct
            gb = 1024**3
            print(f"loading weights: {pct:3d}% ({done / gb:.2f}/{total / gb:.2f} GiB, "
                  f"{time.monotonic() - start:.1f}s)", file=sys.stderr, flush=True)

    return report


def load_model(
    model_dir: str | Path,
    cfg: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    progress: ProgressFn | None | bool = None,
    quantization: str | None = None,
    load_format: str = "safetensors",
    seed: int = 0,
) -> CausalLM:
    """Build ``CausalLM`` for ``cfg`` and fill it from the folder's safetensors files.

    ``progress``: a callback ``(bytes_done, bytes_total)``; ``None`` prints to stderr for
    checkpoints over 256 MiB; ``False`` is silent. ``quantization="int8"`` (CPU): the
    weights ``phasewise.model.cpu.quant`` names are quantized as each tensor is read (after a
    cast to ``dtype``, so the result is that of quantizing the ``dtype`` model), and only
    their int8 copies are kept.

    ``load_format="dummy"`` reads no weight file: each tensor the checkpoint would hold is
    drawn at random instead (``DUMMY_STD``; a generator seeded with ``seed``, on ``device``),
    through the same path, so the model's shapes, fusions and int8 quantization are those a
    real checkpoint gets.
    """
    model_dir = Path(model_dir)
    targets = _targets(cfg)
    if load_format == "dummy":
        files = {name: model_dir / "(random)" for name in targets}
    elif load_format == "safetensors":
        files = weight_files(model_dir)
    else:
        raise ValueError(f"load_format must be safetensors or dummy; got {load_format!r}")
    if cfg.tie_word_embeddings:
        files.pop("lm_head.weight", None)  # tied checkpoints sometimes carry a copy
    unexpected = sorted(n for n in files if n not in targets and not _IGNORED.match(n))
    missing = sorted(n for n in targets if n not in files)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {_clip(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors {_clip(unexpected)}")
        raise ValueError(f"checkpoint {model_dir} does not match {cfg.architecture}: "
                         + "; ".join(parts))

    with torch.device("meta"):
        model = CausalLM(cfg, max_positions=1)
    model = model.to(dtype)
    scales: dict[str, torch.Tensor] = {}
    if quantization == "int8":
        if device.type != "cpu":
            raise ValueError(f"quantization int8 runs on CPU only; got device {device}")
        scales = prepare_int8(model, dtype)
    elif quantization is not None:
        raise ValueError(f"quantization must be int8 or None; got {quantization!r}")
    if device.type == "cpu":
        _place_in_arena(model)
    else:
        model = model.to_empty(device=device)
    model.rope = RotaryEmbedding(cfg.head_dim, cfg.rope, max_positions).to(device)
    params = dict(model.named_parameters())

    by_file: dict[Path, list[str]] = {}
    for name in targets:
        by_file.setdefault(files[name], []).append(name)
    total = sum(p.numel() * p.element_size() for p in params.values())
    if progress is None:
        progress = _stderr_progress() if total >= PROGRESS_MIN_BYTES else False
    done = 0
    dummy = _DummyWeights(device, seed) if load_format == "dummy" else None
    with torch.no_grad():
        for path, names in by_file.items():
            with (dummy or safe_open(str(path), framework="pt", device="cpu")) as f:
                for name in names:
                    pname, row, rows = targets[name]
                    dst = params[pname].narrow(0, row, rows)
                    src = (f.get_tensor(name) if dummy is None
                           else dummy.tensor(name, tuple(dst.shape), dtype))
                    if tuple(src.shape) != tuple(dst.shape):
                        raise ValueError(
                            f"tensor {name} in {path.name} has shape {tuple(src.shape)}, "
                            f"expected {tuple(dst.shape)} from config.json"
                        )
                    if pname in scales:  # int8: quantize these rows as they arrive
                        q, scale = quantize_rows_int8(src.to(dtype))
                        dst.copy_(q)
                        scales[pname].narrow(0, row, rows).copy_(scale)
                        del q, scale
                    else:
                        dst.copy_(src)
                    del src
                    done += dst.numel() * dst.element_size()
                    if progress:
                        progress(done, total)
    model.eval()
    return model


class _DummyWeights:
    """Random stand-ins for a checkpoint's tensors (``load_format="dummy"``), in the order
    asked, from one seeded generator on the target device (no host copy of a GPU model)."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __enter__(self) -> _DummyWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        x = torch.randn(shape, generator=self.generator, device=self.device)
        if name.endswith("norm.weight"):  # RMSNorm gains near 1, as trained models have
            return (1.0 + 0.1 * x).to(dtype)
        return (DUMMY_STD * x).to(dtype)


HUGE_PAGE = 2 * 1024 * 1024
_MADV_HUGEPAGE = 14


def huge_page_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised CPU byte tensor of ``nbytes`` that starts on a huge-page boundary,
    advised to the kernel as huge-page memory before anything touches it (where
    transparent huge pages are off or madvise fails, only an aligned allocation).

    The weights live in such memory (``_place_in_arena``), so a read-bandwidth probe that
    stands beside them must too: a read over 4 KiB pages pays TLB misses the weights'
    reads do not, and would understate the bandwidth decode is held to.
    """
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE  # first huge-page boundary inside the allocation
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(raw.data_ptr() + start), ctypes.c_size_t(nbytes),
                     _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass
    return raw[start:start + nbytes]


def _place_in_arena(model: CausalLM) -> None:
    """Give every (meta) parameter CPU storage inside one allocation, in forward order,
    in huge-page memory (``huge_page_empty``).

    Decode streams every weight once per step; with 4 KiB pages that is one TLB miss per
    4 KiB of weights (~190k per step for a 0.77 GB model), which slows the stream
    (benchmarks/RESULTS.md, "Measurement notes").
    """
    slots = [(mod, name, p) for mod in model.modules()
             for name, p in mod.named_parameters(recurse=False)]
    params = [p for _, _, p in slots]
    align = 64
    sizes = [-(-p.numel() * p.element_size() // align) * align for p in params]
    arena = huge_page_empty(sum(sizes))
    offset = 0
    for (mod, name, p), size in zip(slots, sizes):
        nbytes = p.numel() * p.element_size()
        view = arena[offset:offset + nbytes].view(p.dtype).view(p.shape)
        setattr(mod, name, torch.nn.Parameter(view, requires_grad=False))
        offset += size


def _clip(names: list[str], n: int = 8) -> str:
    shown = ", ".join(names[:n])
    return shown + (f", ... ({len(names) - n} more)" if len(names) > n else "")
