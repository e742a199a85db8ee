"""Model configuration: what phasewise reads from a checkpoint's ``config.json``.

Only the fields the forward pass needs are kept. Parsing is strict: an unsupported
architecture, activation or RoPE variant is an error that names the allowed values, never a
silent fallback to something that computes a different function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phasewise.files import read_json_file

# architecture name -> (qkv bias default, o_proj bias default, q/k RMSNorm)
# Llama and Qwen3 read `attention_bias` from the config (q, k, v and o together);
# Qwen2 always has q/k/v biases and no o_proj bias.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"qkv_bias": None, "o_bias": None, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "o_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "o_bias": False, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": None, "o_bias": None, "qk_norm": True},
    # Mixture of experts (``moe``: how its config names the experts and routes to them)
    "MixtralForCausalLM": {"qkv_bias": False, "o_bias": False, "qk_norm": False,
                           "moe": "mixtral"},
    "Qwen2MoeForCausalLM": {"qkv_bias": True, "o_bias": False, "qk_norm": False,
                            "moe": "qwen2_moe"},
    "Qwen3MoeForCausalLM": {"qkv_bias": None, "o_bias": None, "qk_norm": True,
                            "moe": "qwen3_moe"},
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def read_config_json(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """A checkpoint's ``config.json`` (``path`` is the file or the folder holding it): the
    file's path and its parsed contents. The one reader of the file: ``ModelConfig`` (what
    the forward pass needs, strictly) and ``phasewise.perf.models.ModelShape`` (the shape
    the roofline prices, of any decoder) both start from it."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no config.json at {path}")
    cfg = read_json_file(path)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: a config is a JSON object of fields, got a "
                         f"{type(cfg).__name__}")
    return path, cfg


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. ``rope_type`` is one of SUPPORTED_ROPE_TYPES."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: ``num_experts`` SwiGLU experts of ``intermediate_size``, each
    token routed to ``experts_per_token`` of them by a linear router (softmax over all
    experts, the top k taken, renormalised to sum to 1 where ``norm_topk_prob``); a shared
    expert of ``shared_intermediate_size`` (0: none) every token goes through, scaled by a
    sigmoid gate; ``layers``: the layers whose MLP is sparse (the rest are dense, of the
    model's ``intermediate_size``)."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int
    layers: tuple[int, ...]


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    # The window the checkpoint's attention actually uses, or None for full attention.
    sliding_window: int | None
    dtype: str
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    moe: MoEConfig | None = None  # None: every layer's MLP is dense
    # Each layer's attention window (``layer_windows``; None: it attends to the whole
    # context); empty for a config built field by field, where ``sliding_window`` holds
    # for every layer
    layer_windows: tuple[int | None, ...] = ()

    def window_of(self, layer: int) -> int | None:
        """The attention window of layer ``layer`` (None: the whole context)."""
        if self.layer_windows:
            return self.layer_windows[layer]
        return self.sliding_window

    @property
    def kv_window(self) -> int | None:
        """The window every layer attends within (None where some layer attends to the
        whole context): K/V older than it is read by no layer, so its blocks can go back to
        the pool (``KVCacheManager.window``)."""
        windows = {self.window_of(i) for i in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        total = self.num_layers * per_layer + emb + h
        m = self.moe
        if m is not None:  # its sparse layers hold experts (and a router) instead
            sparse = m.num_experts * 3 * h * m.intermediate_size + h * m.num_experts
            if m.shared_intermediate_size:
                sparse += 3 * h * m.shared_intermediate_size + h
            total += len(m.layers) * (sparse - mlp)
        return total

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.kv_size * element_size

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(read_config_json(path)[1])

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or '(none given)'}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        spec = SUPPORTED_ARCHITECTURES[arch]

        def need(key: str) -> Any:
            if key not in d or d[key] is None:
                raise ValueError(f"config.json for {arch} lacks required field {key!r}")
            return d[key]

        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; supported: 'silu'")
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(d.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
        head_dim = int(d.get("head_dim") or hidden // heads)
        attn_bias = bool(d.get("attention_bias", False))
        qkv_bias = attn_bias if spec["qkv_bias"] is None else spec["qkv_bias"]
        o_bias = attn_bias if spec["o_bias"] is None else spec["o_bias"]

        windows = layer_windows(arch, d, int(need("num_hidden_layers")))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(d),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=spec["qk_norm"],
            sliding_window=next((w for w in windows if w is not None), None),
            layer_windows=windows,
            dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            raw=d,
            moe=_parse_moe(spec.get("moe"), d, int(need("num_hidden_layers"))),
        )


def _parse_moe(style: str | None, d: dict[str, Any], layers: int) -> MoEConfig | None:
    """The experts of a Mixtral, Qwen2-MoE or Qwen3-MoE config; a field whose value would
    make the model route or compute otherwise than phasewise does is refused by name."""
    if style is None:
        return None

    def whole(key: str, value: Any, lo: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ValueError(f"config.json: {key} must be an integer >= {lo}, got {value!r}")
        return value

    if style == "mixtral":
        e = whole("num_local_experts", d.get("num_local_experts"), 1)
        inter = whole("intermediate_size", d.get("intermediate_size"), 1)
        norm, shared, sparse = True, 0, tuple(range(layers))
    else:
        # (the hub's checkpoints write num_experts; transformers 5 writes num_local_experts)
        key = "num_experts" if "num_experts" in d else "num_local_experts"
        e = whole(key, d.get(key), 1)
        inter = whole("moe_intermediate_size", d.get("moe_intermediate_size"), 1)
        norm = d.get("norm_topk_prob", False)
        if not isinstance(norm, bool):
            raise ValueError(f"config.json: norm_topk_prob must be true or false, got {norm!r}")
        shared = 0
        if style == "qwen2_moe":
            shared = whole("shared_expert_intermediate_size",
                           d.get("shared_expert_intermediate_size", 0), 0)
        step = whole("decoder_sparse_step", d.get("decoder_sparse_step", 1), 1)
        dense = d.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise ValueError(f"config.json: mlp_only_layers must be a list of layer indices, "
                             f"got {dense!r}")
        sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    k = whole("num_experts_per_tok", d.get("num_experts_per_tok"), 1)
    if k > e:
        raise ValueError(f"config.json: num_experts_per_tok ({k}) exceeds the {e} experts")
    for key in ("scoring_func", "topk_method", "n_group", "routed_scaling_factor"):
        if d.get(key) not in (None, "softmax", 1, 1.0):  # other routers than top-k softmax
            raise ValueError(f"config.json: {key} {d[key]!r} routes otherwise than phasewise "
                             "does (softmax over the experts, then the top k)")
    return MoEConfig(e, k, inter, norm, shared, sparse)


def _parse_rope(d: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files write
    # `rope_theta` at the top level and an optional `rope_scaling`.
    params = dict(d.get("rope_parameters") or {})
    scaling = d.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeConfig(theta=theta)
    factor = float(params.get("factor", 1.0))
    if factor <= 0:
        raise ValueError(f"rope scaling factor must be > 0, got {factor}")
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=factor)
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    if high <= low:
        raise ValueError(f"llama3 rope needs high_freq_factor ({high}) > low_freq_factor ({low})")
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


# Architectures whose attention ignores ``layer_types``: a window, where the config sets one
# (Qwen3-MoE: and ``use_sliding_window``), applies to every layer.
_WINDOW_ON_EVERY_LAYER = ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM")
_NO_WINDOW = ("LlamaForCausalLM",)


def layer_windows(arch: str | None, d: dict[str, Any], num_layers: int
                  ) -> tuple[int | None, ...]:
    """Each layer's attention window as transformers' modelling code applies it (None: that
    layer attends to the whole context). Qwen checkpoints need ``use_sliding_window``; then
    ``layer_types`` names the windowed layers where the config lists them, else Qwen2 and
    Qwen3 window the layers from ``max_window_layers`` on and Qwen2-MoE every other one below
    it. Mistral, Mixtral and Qwen3-MoE window every layer; Llama none. An unknown
    architecture (``arch`` None: a config read only for its shape) follows the same rules by
    the fields it has."""
    # A malformed field that would decide the windows is refused, never read as "no window":
    # that would serve a windowed checkpoint as full attention, a different model.
    none: tuple[int | None, ...] = (None,) * num_layers
    w = d.get("sliding_window")
    if arch in _NO_WINDOW or w is None:
        return none
    qwen = "use_sliding_window" in d or (arch or "").startswith("Qwen")
    use = d.get("use_sliding_window")
    if use is not None and not isinstance(use, bool):
        raise ValueError(f"config.json: use_sliding_window must be true or false, got {use!r}")
    if qwen and not use:
        return none
    if not isinstance(w, int) or isinstance(w, bool) or w < 1:
        raise ValueError(f"config.json: sliding_window must be a positive integer (positions) "
                         f"or null for none, got {w!r}")
    if arch in _WINDOW_ON_EVERY_LAYER:
        return (w,) * num_layers
    types = d.get("layer_types")
    if types is not None:
        if (not isinstance(types, list) or len(types) != num_layers
                or not set(types) <= {"sliding_attention", "full_attention"}):
            raise ValueError(f"config.json: layer_types must list 'sliding_attention' or "
                             f"'full_attention' for each of the {num_layers} layers; "
                             f"got {types!r}")
        return tuple(w if t == "sliding_attention" else None for t in types)
    if not qwen:
        return (w,) * num_layers
    first = d.get("max_window_layers") or 0
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise ValueError(f"config.json: max_window_layers must be an integer >= 0, "
                         f"got {first!r}")
    if arch == "Qwen2MoeForCausalLM":
        return tuple(w if i % 2 == 0 and i < first else None for i in range(num_layers))
    return tuple(w if i >= first else None for i in range(num_layers))
