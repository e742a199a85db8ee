"""Model shapes for the roofline analyser: a catalog of well-known configs, any HF
``config.json``, or a bare parameter count. Configs only: no weights, no torch.

Parameter counts are the matmul weights (attention q/k/v/o, MLP gate/up/down or the experts),
the embedding, the LM head when untied, and the norms; biases are left out (a few thousand
per layer at most).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from phasewise.model.config import layer_windows, read_config_json


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (per expert for MoE: moe_intermediate_size)
    vocab_size: int
    tie_word_embeddings: bool = False
    num_experts: int = 0  # 0: dense
    experts_per_token: int = 0
    shared_expert_size: int = 0  # an MoE's shared expert's width (Qwen2-MoE; 0: none)
    max_position_embeddings: int | None = None
    source: str = ""
    # Sliding-window attention: ``window_layers`` of the layers attend to the last
    # ``sliding_window`` positions only (None: every layer attends to the whole context)
    sliding_window: int | None = None
    window_layers: int = 0
    # An MoE model's layers whose MLP is dense (DeepSeek's first ``first_k_dense_replace``,
    # Qwen-MoE's ``mlp_only_layers``), of ``dense_intermediate_size`` (0: intermediate_size)
    dense_layers: int = 0
    dense_intermediate_size: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3; kv_lora_rank 0: none): K and V stored as a
    # ``kv_lora_rank`` latent plus a ``qk_rope_head_dim`` rotary key per token and layer,
    # queries through a ``q_lora_rank`` bottleneck (0: none), ``head_dim`` the q/k head
    # (nope + rope), ``v_head_dim`` the value head
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Routing skew (``fit_routed_experts``): how many equally likely experts would touch as
    # few distinct experts per batch as this model's router was measured to (None: all of
    # ``num_experts``, uniform routing)
    routed_experts: float | None = None

    def __post_init__(self) -> None:
        # A size of 0 or less would price a model of negative bytes: refused by name.
        for f in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "vocab_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{self.name}: {f} must be a positive integer, got {v!r}")
        for f in ("num_experts", "experts_per_token", "shared_expert_size", "dense_layers",
                  "dense_intermediate_size", "kv_lora_rank", "q_lora_rank",
                  "qk_rope_head_dim", "v_head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{self.name}: {f} must be an integer >= 0, got {v!r}")
        if self.num_kv_heads > self.num_heads:
            raise ValueError(f"{self.name}: num_key_value_heads ({self.num_kv_heads}) exceeds "
                             f"num_attention_heads ({self.num_heads})")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"{self.name}: num_experts_per_tok must be in 1..{self.num_experts} "
                             f"(the experts), got {self.experts_per_token}")
        if self.sliding_window is not None and not (
                self.sliding_window >= 1 and 0 <= self.window_layers <= self.num_layers):
            raise ValueError(f"{self.name}: sliding_window {self.sliding_window} over "
                             f"{self.window_layers} of {self.num_layers} layers is not a window")

    # -- attention spans (sliding windows) ----------------------------------------------------
    @property
    def windowed(self) -> bool:
        return self.sliding_window is not None and self.window_layers > 0

    def attended(self, n: float) -> float:
        """Positions a query at position ``n`` attends to (or the K/V of a sequence of
        ``n`` tokens a step reads), averaged over the layers: ``n`` where a layer sees the
        whole context, at most the window where it sees a window."""
        if not self.windowed:
            return n
        w, lw = self.sliding_window, self.window_layers
        return ((self.num_layers - lw) * n + lw * min(n, w)) / self.num_layers

    def attended_sum(self, lo: int, hi: int) -> float:
        """``attended(i)`` summed for i from ``lo`` to ``hi`` (a prompt chunk's queries)."""
        if hi < lo:
            return 0.0
        full = (lo + hi) * (hi - lo + 1) / 2
        if not self.windowed:
            return full
        w, lw = self.sliding_window, self.window_layers
        top = min(hi, w)
        capped = ((lo + top) * (top - lo + 1) / 2 if top >= lo else 0.0) \
            + max(0, hi - max(lo, w + 1) + 1) * w
        return ((self.num_layers - lw) * full + lw * capped) / self.num_layers

    # -- parameters -------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attn_params_per_layer(self) -> int:
        h, hd, nh = self.hidden_size, self.head_dim, self.num_heads
        if self.mla:  # q (through its bottleneck), the K/V latent and rotary key, their
            # up-projection to every head's key and value, o
            q = h * self.q_lora_rank + self.q_lora_rank * nh * hd if self.q_lora_rank \
                else h * nh * hd
            nope = hd - self.qk_rope_head_dim
            return (q + h * (self.kv_lora_rank + self.qk_rope_head_dim)
                    + self.kv_lora_rank * nh * (nope + self.v_head_dim)
                    + nh * self.v_head_dim * h)
        return h * nh * hd * 2 + h * self.num_kv_heads * hd * 2  # q, o; k, v

    @property
    def attn_flops_per_position(self) -> float:
        """FLOPs one query spends on one key, over all layers: its score and its weighted
        value, ``2 * head_dim`` each per head (MLA: against the latent and the rotary key,
        then the latent, with the up-projections absorbed into q and o, as serving engines
        run it)."""
        if self.mla:
            lat = self.kv_lora_rank
            return 2.0 * self.num_layers * self.num_heads * (2 * lat + self.qk_rope_head_dim)
        return 4.0 * self.num_layers * self.num_heads * self.head_dim

    @property
    def sparse_layers(self) -> int:
        """Layers whose MLP is a mixture of experts (0 for a dense model)."""
        return self.num_layers - self.dense_layers if self.is_moe else 0

    @property
    def _dense_mlp(self) -> int:
        """One dense layer's MLP weights (an MoE model's dense layers: their own width)."""
        width = self.dense_intermediate_size or self.intermediate_size
        return 3 * self.hidden_size * width

    @property
    def mlp_params(self) -> int:
        """Every layer's MLP weights (every expert, and the router, of each sparse layer)."""
        if not self.is_moe:
            return self.num_layers * self._dense_mlp
        return self.sparse_mlp_params + self.dense_layers * self._dense_mlp

    @property
    def sparse_mlp_params(self) -> int:
        """The sparse layers' MLP weights: every expert, the router and a shared expert and
        its gate, over all sparse layers; 0 for a dense model."""
        if not self.is_moe:
            return 0
        one = 3 * self.hidden_size * self.intermediate_size
        return self.sparse_layers * (self.num_experts * one + self.hidden_size * self.num_experts
                                     + self._shared_params)

    def weight_bytes(self, wbytes: float, moe_wbytes: float | None = None,
                     experts: float | None = None) -> float:
        """Bytes of the weights at ``wbytes`` per parameter, the sparse layers' MLPs
        (``sparse_mlp_params``) at ``moe_wbytes`` (default: the same; phasewise's weight-only
        int8 keeps them at the checkpoint's dtype). ``experts``: only that many experts of
        each sparse layer counted (those a step reads); None: all of them."""
        m = wbytes if moe_wbytes is None else moe_wbytes
        b = self.total_params * wbytes + self.sparse_mlp_params * (m - wbytes)
        if experts is not None and self.is_moe:
            b -= self.idle_expert_params(experts) * m
        return b

    @property
    def _shared_params(self) -> int:
        """A shared expert and its gate (every token goes through them)."""
        s = self.shared_expert_size
        return 3 * self.hidden_size * s + self.hidden_size if s else 0

    @property
    def active_mlp_params(self) -> int:
        """MLP weights one token goes through, over all layers (its routed experts, the
        router and a shared expert in each sparse layer)."""
        if not self.is_moe:
            return self.mlp_params
        one = 3 * self.hidden_size * self.intermediate_size
        sparse = self.experts_per_token * one + self.hidden_size * self.num_experts \
            + self._shared_params
        return self.sparse_layers * sparse + self.dense_layers * self._dense_mlp

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        norms = self.num_layers * 2 * self.hidden_size + self.hidden_size
        head = 0 if self.tie_word_embeddings else self.lm_head_params
        return (self.embedding_params + head + norms
                + self.num_layers * self.attn_params_per_layer + self.mlp_params)

    @property
    def active_linear_params(self) -> int:
        """Matmul weights a token passes through in the layers (no embedding, no LM head)."""
        return self.num_layers * self.attn_params_per_layer + self.active_mlp_params

    @property
    def expert_params(self) -> int:
        """One expert's weights (gate, up and down projections); 0 for a dense model."""
        return 3 * self.hidden_size * self.intermediate_size if self.is_moe else 0

    def experts_touched(self, tokens: float) -> float:
        """Distinct experts of a layer that ``tokens`` tokens route to, in expectation, when
        each picks its ``experts_per_token`` of the ``num_experts`` uniformly:
        E (1 - (1 - k/E)^tokens). A batch of 1 reads k; as the batch grows, all E. With a
        measured skew (``routed_experts``), E is that fitted count."""
        if not self.is_moe or tokens <= 0:
            return 0.0
        return expected_experts(self.routed_experts or self.num_experts,
                                self.experts_per_token, tokens)

    def params_read(self, tokens: float) -> float:
        """Weights a step of ``tokens`` tokens reads: all of a dense model's but the rows of
        an untied input embedding no token looks up (a tied one is the LM head too, read
        whole); an MoE model's less the experts no token routed to (``experts_touched``)."""
        unread = self.unread_embedding_params(tokens)
        if not self.is_moe:
            return self.total_params - unread
        return (self.total_params - unread
                - self.idle_expert_params(self.experts_touched(tokens)))

    def unread_embedding_params(self, tokens: float) -> float:
        """The input embedding's weights a step of ``tokens`` tokens does not look up: an
        untied one's rows but theirs; none of a tied one, which is the LM head too."""
        if self.tie_word_embeddings:
            return 0.0
        return max(0.0, self.embedding_params - max(tokens, 0) * self.hidden_size)

    def idle_expert_params(self, experts: float) -> float:
        """The expert weights a step leaves unread when its tokens touch ``experts`` of each
        layer's experts (the rest, in every layer)."""
        return self.sparse_layers * (self.num_experts - experts) * self.expert_params

    @property
    def active_params(self) -> int:
        head = 0 if self.tie_word_embeddings else self.lm_head_params
        return self.active_linear_params + self.embedding_params + head

    def kv_bytes_per_token(self, bytes_per_el: float) -> float:
        """K and V of one token over all layers (GQA: only the KV heads are stored; MLA: the
        latent and the rotary key, shared by every head)."""
        if self.mla:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * bytes_per_el
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_el

    def act_elems_per_token(self) -> int:
        """Activation elements a token moves through one layer: each matmul's input and output
        once (residual stream, q/k/v, attention output, MLP intermediate)."""
        h, hd = self.hidden_size, self.head_dim
        inter = self.intermediate_size * (self.experts_per_token if self.is_moe else 1) \
            + self.shared_expert_size
        return 4 * h + (2 * self.num_heads + 2 * self.num_kv_heads) * hd + 3 * inter

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "config.json",
                       source: str = "") -> ModelShape:
        if not isinstance(cfg, dict):
            raise ValueError(f"{name}: a config is a JSON object of fields, got a "
                             f"{type(cfg).__name__}")
        text = cfg.get("text_config")
        if isinstance(text, dict):  # multimodal wrappers keep the LM's shape here
            cfg = {**cfg, **text}
        for key in _SIZE_FIELDS & cfg.keys():  # a whole number, never "4096" or 4096.5
            value = cfg[key]
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name}: {key} must be an integer, got {value!r}")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
        except KeyError as e:
            raise ValueError(f"{name}: missing {e.args[0]!r}; a decoder-only config needs "
                             "hidden_size, num_attention_heads and num_hidden_layers") from e
        if heads < 1 or layers < 1:
            raise ValueError(f"{name}: num_attention_heads and num_hidden_layers must be "
                             f"positive integers, got {heads} and {layers}")
        if "vocab_size" not in cfg or cfg["vocab_size"] is None:
            raise ValueError(f"{name}: missing 'vocab_size'")
        n_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts")
                        or cfg.get("n_routed_experts") or 0)
        window, window_layers = _window_of(cfg, layers)
        inter = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if n_experts \
            else int(cfg["intermediate_size"])
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        if not shared and cfg.get("n_shared_experts"):  # DeepSeek: that many of its experts
            shared = int(cfg["n_shared_experts"]) * inter
        dense = 0
        if n_experts:  # layers whose MLP stays dense
            dense = min(layers, int(cfg.get("first_k_dense_replace") or 0)
                        + len(cfg.get("mlp_only_layers") or ()))
        mla = int(cfg.get("kv_lora_rank") or 0)
        rope = int(cfg.get("qk_rope_head_dim") or 0)
        head_dim = (int(cfg.get("qk_nope_head_dim") or 0) + rope if mla
                    else int(cfg.get("head_dim") or hidden // heads))
        return cls(
            name=name, hidden_size=hidden, num_layers=layers, num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=inter, vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=n_experts,
            experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if n_experts else 0,
            shared_expert_size=shared if n_experts else 0,
            max_position_embeddings=cfg.get("max_position_embeddings"),
            source=source or name, sliding_window=window, window_layers=window_layers,
            dense_layers=dense,
            dense_intermediate_size=int(cfg["intermediate_size"]) if dense else 0,
            kv_lora_rank=mla, q_lora_rank=int(cfg.get("q_lora_rank") or 0) if mla else 0,
            qk_rope_head_dim=rope if mla else 0,
            v_head_dim=int(cfg.get("v_head_dim") or head_dim) if mla else 0)

    @classmethod
    def from_path(cls, path: str | Path) -> ModelShape:
        p, cfg = read_config_json(path)
        return cls.from_hf_config(cfg, name=p.parent.name or str(p), source=str(p))


# The config fields read as sizes (from_hf_config): each must be an integer where given.
_SIZE_FIELDS = frozenset((
    "hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
    "head_dim", "intermediate_size", "moe_intermediate_size", "vocab_size",
    "shared_expert_intermediate_size", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
    "qk_nope_head_dim", "v_head_dim", "num_local_experts", "num_experts", "n_routed_experts",
    "n_shared_experts", "num_experts_per_tok"))


@dataclass(frozen=True)
class GenericModel:
    """A dense model known only by its parameter count: 2 FLOPs per parameter per token and
    every weight read once per step. Attention and the KV cache are unknown (no shape)."""

    params: float
    name: str = field(default="")

    def __post_init__(self) -> None:
        if not self.params > 0:
            raise ValueError(f"parameter count must be > 0, got {self.params}")
        if not self.name:
            object.__setattr__(self, "name", f"dense {self.params:.3g} parameters")


def expected_experts(experts: float, k: int, tokens: float) -> float:
    """E (1 - (1 - k/E)^T): the distinct experts T tokens touch in expectation, each picking
    k of E uniformly."""
    return experts * (1.0 - (1.0 - k / experts) ** tokens)


def fit_routed_experts(observations: Sequence[tuple[float, float]], num_experts: int,
                       k: int) -> float | None:
    """The routing skew measured: the count E' in [k, num_experts] whose uniform routing
    best matches the observed (tokens in a step, distinct experts its layers read on
    average) pairs, by least squares (``expected_experts`` grows with E' at every batch of
    two or more tokens, so a bounded search finds it). None where no observation holds two
    tokens or more (a lone token reads k whatever the skew)."""
    obs = [(t, x) for t, x in observations if t >= 2]
    if not obs or not 1 <= k <= num_experts:
        return None

    def sse(e: float) -> float:
        return sum((expected_experts(e, k, t) - x) ** 2 for t, x in obs)

    lo, hi = float(k), float(num_experts)
    grid = [lo + (hi - lo) * i / 64 for i in range(65)]
    best = min(range(65), key=lambda i: sse(grid[i]))
    lo, hi = grid[max(0, best - 1)], grid[min(64, best + 1)]
    for _ in range(60):  # golden section inside the best grid cell's neighbours
        a, b = lo + (hi - lo) * 0.382, lo + (hi - lo) * 0.618
        if sse(a) <= sse(b):
            hi = b
        else:
            lo = a
    return (lo + hi) / 2


def with_routing(model: Any, spec: str) -> ModelShape:
    """``model`` (an MoE ``ModelShape``) with the routing skew fitted to ``spec``, pairs
    ``T:X`` (X distinct experts a layer read in steps of T tokens) separated by commas."""
    if not isinstance(model, ModelShape) or not model.is_moe:
        raise ValueError("--experts-read: the model is not a mixture of experts")
    obs = []
    for part in spec.split(","):
        t, sep, x = part.partition(":")
        try:
            pair = (float(t), float(x))
        except ValueError:
            pair = None
        k, e = model.experts_per_token, model.num_experts
        if not sep or pair is None or not (
                pair[0] >= 1 and k <= pair[1] <= min(e, k * pair[0])):
            raise ValueError(f"--experts-read: {part!r} is not T:X with T >= 1 tokens and X "
                             f"experts a layer in [{k}, min({e}, {k} T)] (each token reads "
                             f"{k} of the {e})")
        obs.append(pair)
    fitted = fit_routed_experts(obs, model.num_experts, model.experts_per_token)
    if fitted is None:
        raise ValueError("--experts-read: give a step of 2 tokens or more (one token reads "
                         f"its {model.experts_per_token} experts whatever the skew)")
    return replace(model, routed_experts=fitted)


def _window_of(cfg: dict[str, Any], layers: int) -> tuple[int | None, int]:
    """(window, layers that use it) of a transformers config, by the engine's own rule
    (``phasewise.model.config.layer_windows``). A window no shorter than the context is
    none."""
    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    windows = [w for w in layer_windows(arch, cfg, layers) if w is not None]
    if not windows or windows[0] >= int(cfg.get("max_position_embeddings") or 0) > 0:
        return None, 0
    return windows[0], len(windows)


def _shape(name: str, source: str, **kw: Any) -> ModelShape:
    kw.setdefault("head_dim", kw["hidden_size"] // kw["num_heads"])
    return ModelShape(name=name, source=source, **kw)


def _llama2(name, hidden, layers, heads, kv, inter):
    return _shape(name, f"meta-llama/{name} config.json", hidden_size=hidden,
                  num_layers=layers, num_heads=heads, num_kv_heads=kv,
                  intermediate_size=inter, vocab_size=32000, max_position_embeddings=4096)


def _llama31(name, hidden, layers, heads, inter):
    return _shape(name, f"meta-llama/{name} config.json", hidden_size=hidden,
                  num_layers=layers, num_heads=heads, num_kv_heads=8,
                  intermediate_size=inter, vocab_size=128256,
                  max_position_embeddings=131072)


def _qwen25(size, hidden, layers, heads, kv, inter, tied):
    name = f"Qwen2.5-{size}"
    return _shape(name, f"Qwen/{name} config.json", hidden_size=hidden, num_layers=layers,
                  num_heads=heads, num_kv_heads=kv, intermediate_size=inter,
                  vocab_size=151936 if size in ("0.5B", "1.5B", "3B") else 152064,
                  tie_word_embeddings=tied, max_position_embeddings=32768)


def _qwen3(size, hidden, layers, heads, kv, inter, tied):
    name = f"Qwen3-{size}"
    return _shape(name, f"Qwen/{name} config.json", hidden_size=hidden, num_layers=layers,
                  num_heads=heads, num_kv_heads=kv, head_dim=128, intermediate_size=inter,
                  vocab_size=151936, tie_word_embeddings=tied, max_position_embeddings=40960)


def _gemma2(size, hidden, layers, heads, kv, head_dim, inter):
    name = f"gemma-2-{size}"
    return _shape(name, f"google/{name} config.json", hidden_size=hidden, num_layers=layers,
                  num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                  intermediate_size=inter, vocab_size=256000, tie_word_embeddings=True,
                  max_position_embeddings=8192, sliding_window=4096,
                  window_layers=layers // 2)  # every other layer local


CATALOG: dict[str, ModelShape] = {m.name.lower(): m for m in [
    _llama2("Llama-2-7b-hf", 4096, 32, 32, 32, 11008),
    _llama2("Llama-2-13b-hf", 5120, 40, 40, 40, 13824),
    _llama2("Llama-2-70b-hf", 8192, 80, 64, 8, 28672),
    _llama31("Llama-3.1-8B", 4096, 32, 32, 14336),
    _llama31("Llama-3.1-70B", 8192, 80, 64, 28672),
    _llama31("Llama-3.1-405B", 16384, 126, 128, 53248),
    _qwen25("0.5B", 896, 24, 14, 2, 4864, True),
    _qwen25("1.5B", 1536, 28, 12, 2, 8960, True),
    _qwen25("3B", 2048, 36, 16, 2, 11008, True),
    _qwen25("7B", 3584, 28, 28, 4, 18944, False),
    _qwen25("14B", 5120, 48, 40, 8, 13824, False),
    _qwen25("32B", 5120, 64, 40, 8, 27648, False),
    _qwen25("72B", 8192, 80, 64, 8, 29568, False),
    _qwen3("0.6B", 1024, 28, 16, 8, 3072, True),
    _qwen3("1.7B", 2048, 28, 16, 8, 6144, True),
    _qwen3("4B", 2560, 36, 32, 8, 9728, True),
    _qwen3("8B", 4096, 36, 32, 8, 12288, False),
    _qwen3("14B", 5120, 40, 40, 8, 17408, False),
    _qwen3("32B", 5120, 64, 64, 8, 25600, False),
    _shape("Mistral-7B-v0.1", "mistralai/Mistral-7B-v0.1 config.json", hidden_size=4096,
           num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
           vocab_size=32000, max_position_embeddings=32768, sliding_window=4096,
           window_layers=32),
    _gemma2("2b", 2304, 26, 8, 4, 256, 9216),
    _gemma2("9b", 3584, 42, 16, 8, 256, 14336),
    _gemma2("27b", 4608, 46, 32, 16, 128, 36864),
    _shape("Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x7B-v0.1 config.json", hidden_size=4096,
           num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
           vocab_size=32000, num_experts=8, experts_per_token=2,
           max_position_embeddings=32768),
    # 671 B parameters, 37 B active: 3 dense layers, then 256 routed experts (8 a token) and
    # one shared; multi-head latent attention (a 512 + 64 K/V latent per token and layer)
    _shape("DeepSeek-V3", "deepseek-ai/DeepSeek-V3 config.json", hidden_size=7168,
           num_layers=61, num_heads=128, num_kv_heads=128, head_dim=192,
           intermediate_size=2048, vocab_size=129280, num_experts=256, experts_per_token=8,
           shared_expert_size=2048, dense_layers=3, dense_intermediate_size=18432,
           kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
           max_position_embeddings=163840),
    _shape("Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B config.json", hidden_size=2048,
           num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, intermediate_size=768,
           vocab_size=151936, num_experts=128, experts_per_token=8,
           max_position_embeddings=40960),
]}


def lookup_model(name: str) -> ModelShape:
    """A catalog entry (case-insensitive; a unique prefix or substring also matches) or a
    path to a folder / config.json."""
    p = Path(name)
    if p.exists():
        return ModelShape.from_path(p)
    key = name.lower()
    if key in CATALOG:
        return CATALOG[key]
    hits = [m for k, m in CATALOG.items() if key in k]
    if len(hits) == 1:
        return hits[0]
    names = ", ".join(m.name for m in CATALOG.values())
    if hits:
        raise ValueError(f"model {name!r} is ambiguous: {', '.join(m.name for m in hits)}")
    raise ValueError(f"unknown model {name!r}: give a config.json path or one of {names}")


def catalog_name(model: str) -> str | None:
    """The catalog's name for ``model`` or for its last path part (a hub id ``org/name``),
    matched exactly but for case; None if neither is there (``phasewise.config.resolve_model``
    refuses such a name with it)."""
    for candidate in (model, Path(model).name):
        shape = CATALOG.get(candidate.lower())
        if shape is not None:
            return shape.name
    return None


def with_name(shape: ModelShape, name: str) -> ModelShape:
    return replace(shape, name=name)
