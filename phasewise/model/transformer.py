"""The decoder-only transformer shared by Llama, Mistral, Qwen2 and Qwen3, and their
mixture-of-experts kin Mixtral, Qwen2-MoE and Qwen3-MoE.

The architectures differ only in flags read by ``ModelConfig``: q/k/v (and o) biases, q/k
RMSNorm, tied embeddings, RoPE scaling, and where an MLP is a mixture of experts
(``SparseMoE``). Projections are fused at load time: q, k and v into one ``qkv_proj``; gate
and up into one ``gate_up_proj``; each expert's gate and up into its rows of
``SparseMoE.gate_up``.

The forward pass takes a flat batch of tokens from many requests (see ``attention.py`` for its
layout) and never sees requests, HTTP or scheduling.
"""

from __future__ import annotations

import torch
from torch import nn

from phasewise.model.attention import AttentionMetadata, paged_attention, write_kv
from phasewise.model.config import ModelConfig
from phasewise.model.layers import RMSNorm, RotaryEmbedding
from phasewise.model.ops import RopeTables, TorchOps


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP (``ModelConfig.moe``): a linear router, ``E`` SwiGLU experts
    held as two 2-D weights (expert ``e``'s gate and up are rows ``e * 2I`` to
    ``(e + 1) * 2I`` of ``gate_up``, its down projection rows ``e * H`` to ``(e + 1) * H`` of
    ``down``), and an optional shared expert with its sigmoid gate.

    The step's tokens are grouped by expert: each expert a token chose runs once over all the
    tokens that chose it, so its weights are read once per step, and the experts no token
    chose are not read at all (``last_experts``: how many were, for the step's stats)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.moe
        assert m is not None
        h, i, e = cfg.hidden_size, m.intermediate_size, m.num_experts
        self.num_experts, self.top_k, self.inter = e, m.experts_per_token, i
        self.norm_topk_prob = m.norm_topk_prob
        self.gate = nn.Linear(h, e, bias=False)
        self.gate_up = nn.Parameter(torch.empty(e * 2 * i, h))
        self.down = nn.Parameter(torch.empty(e * h, i))
        if m.shared_intermediate_size:
            s = m.shared_intermediate_size
            self.shared_gate_up = nn.Linear(h, 2 * s, bias=False)
            self.shared_down = nn.Linear(s, h, bias=False)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        self.has_shared = bool(m.shared_intermediate_size)
        self.last_experts = 0

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        fused = ops.moe_mlp(self, x)
        if fused is not None:  # (it sets last_experts)
            return fused
        h = x.shape[-1]
        # each row's top k experts and their weights [T, k] (on the CPU kernels, the fused
        # call's own routing: a row routes alike whichever path runs its step)
        weights, chosen = ops.moe_route(ops.moe_linear(x, self.gate.weight), self.top_k,
                                        self.norm_topk_prob)
        weights = weights.to(x.dtype)
        gate_up = self.gate_up.view(self.num_experts, 2 * self.inter, h)
        down = self.down.view(self.num_experts, h, self.inter)
        if x.shape[0] == 1:  # one token (a batch-1 decode): its k experts, no gathering
            ids = chosen[0].tolist()
            self.last_experts = len(ids)
            out = None
            for j, e in enumerate(ids):
                ye = ops.moe_linear(ops.silu_mul(ops.moe_linear(x, gate_up[e])), down[e])
                out = ye * weights[:, j:j + 1] if out is None else out + ye * weights[:, j:j + 1]
            return self._with_shared(x, out, ops)
        out = torch.zeros_like(x)
        experts = torch.unique(chosen).tolist()
        self.last_experts = len(experts)
        for e in experts:
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            xe = x.index_select(0, rows)
            # (on CPU the kernels stream an expert's few rows as a projection's)
            act = ops.silu_mul(ops.moe_linear(xe, gate_up[e], x.shape[0]))
            ye = ops.moe_linear(act, down[e], x.shape[0])
            out.index_add_(0, rows, ye * weights[rows, slot].unsqueeze(-1))
        return self._with_shared(x, out, ops)

    def _with_shared(self, x: torch.Tensor, out: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        """``out`` plus the shared expert's output behind its sigmoid gate, if there is one
        (its projections as the experts', ``moe_linear``: a decode step's few rows stream
        their weights, as the fused CPU layer does)."""
        if not self.has_shared:
            return out
        act = ops.silu_mul(ops.moe_linear(x, self.shared_gate_up.weight))
        shared = ops.moe_linear(act, self.shared_down.weight)
        return out + shared * torch.sigmoid(ops.moe_linear(x, self.shared_expert_gate.weight))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
        self.input_layernorm = RMSNorm(h)
        self.qkv_proj = nn.Linear(h, q + 2 * kv, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim)
            self.k_norm = RMSNorm(cfg.head_dim)
        self.post_attention_layernorm = RMSNorm(h)
        # its sliding attention window (None: it attends to the whole context)
        self.window: int | None = cfg.window_of(index)
        # a sparse layer's MLP is its experts (the CPU kernels' fused layers then step aside)
        self.moe: SparseMoE | None = (SparseMoE(cfg) if cfg.moe is not None
                                      and index in cfg.moe.layers else None)
        if self.moe is None:
            self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
            self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)
        self.scale = cfg.head_dim**-0.5

    def projections(self) -> dict[str, nn.Module]:
        """The four projections in forward order, by the names the fused kernels give them
        (``qkv``, ``o``, ``gate_up``, ``down``): an ``nn.Linear`` with the weight in rows,
        or one of ``phasewise.model.linear_types`` (``Int8Linear``, ``PanelLinear``) once
        quantization or a kernel's packing has replaced it (``replace_projection``). A
        sparse layer has only ``qkv`` and ``o``: its experts are ``moe``'s."""
        if self.moe is not None:
            return {"qkv": self.qkv_proj, "o": self.o_proj}
        return {"qkv": self.qkv_proj, "o": self.o_proj, "gate_up": self.gate_up_proj,
                "down": self.down_proj}

    def replace_projection(self, name: str, module: nn.Module) -> None:
        """Put ``module`` (the same weight in another type or layout) in place of projection
        ``name`` (a key of ``projections``); its parameters keep their names."""
        if name not in ("qkv", "o", "gate_up", "down"):
            raise KeyError(f"no projection {name!r}; the projections are qkv, o, gate_up, down")
        setattr(self, f"{name}_proj", module)

    def norm_weights(self) -> dict[str, torch.Tensor]:
        """The RMSNorm weights by the names the fused kernels give them: ``in`` (before
        attention), ``post`` (before the MLP), and ``q`` and ``k`` where the model has q/k
        norms."""
        norms = {"in": self.input_layernorm.weight,
                 "post": self.post_attention_layernorm.weight}
        if self.cfg.qk_norm:
            norms["q"], norms["k"] = self.q_norm.weight, self.k_norm.weight
        return norms

    def forward(
        self,
        delta: torch.Tensor | None,  # [T, hidden]: previous layer's output, not yet added
        hidden: torch.Tensor,  # [T, hidden]: the residual stream
        rope: RopeTables,
        k_cache: torch.Tensor,  # [num_blocks, block_size, n_kv, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: TorchOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, residual stream before adding it)."""
        fused = ops.decode_layer(self, delta, hidden, rope, k_cache, v_cache, meta)
        if fused is not None:
            return fused
        cfg = self.cfg
        t = hidden.shape[0]
        hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        eps = cfg.rms_norm_eps
        x, hidden = ops.add_rms_norm(delta, hidden, self.input_layernorm.weight, eps)
        qkv = ops.proj(x, self.qkv_proj)  # [T, q + 2 kv]
        v = qkv[:, cfg.q_size + cfg.kv_size:].view(t, nkv, hd)
        if cfg.qk_norm:
            q = ops.rms_norm(qkv[:, :cfg.q_size].reshape(t, nh, hd), self.q_norm.weight, eps)
            k = ops.rms_norm(qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size].reshape(t, nkv, hd),
                             self.k_norm.weight, eps)
            qk = torch.cat([q, k], dim=1)  # [T, nh + nkv, hd]
        else:
            qk = qkv[:, :cfg.q_size + cfg.kv_size].view(t, nh + nkv, hd)
        qk = ops.rope(qk, rope)  # q and k rotated together
        q, k = qk[:, :nh], qk[:, nh:]
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale,
                               ops.decode_attention, ops.prefill_attention,
                               self.window)  # [T, nh, hd]
        attn_out = ops.proj(attn.reshape(t, nh * hd), self.o_proj)

        x, hidden = ops.add_rms_norm(attn_out, hidden, self.post_attention_layernorm.weight,
                                     eps)
        if self.moe is not None:
            return self.moe(x, ops), hidden
        mlp_out = ops.mlp(x, self.gate_up_proj, self.down_proj)  # gate/up, SiLU, down
        return mlp_out, hidden


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope, max_positions)
        # How the numeric steps are computed; the engine may swap in CPU kernels.
        self.ops: TorchOps = TorchOps()

    @property
    def lm_head_module(self) -> nn.Module:
        """The module whose ``weight`` is the LM head: the embedding table where they are
        tied, else ``lm_head`` (an ``Int8Linear`` or ``PanelLinear`` once replaced)."""
        return self.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head_module.weight

    @property
    def head_is_embedding(self) -> bool:
        """Whether the LM head is the embedding table (tied embeddings)."""
        return self.cfg.tie_word_embeddings

    @property
    def embedding_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight

    def replace_embedding(self, module: nn.Module) -> None:
        """Look tokens up in ``module`` from now on (the same table in another layout: its
        ``weight`` is then the LM head too where the embeddings are tied)."""
        self.embed_tokens = module

    def replace_lm_head(self, module: nn.Module) -> None:
        """Use ``module`` as the LM head from now on (the same weight in another type or
        layout); where the embeddings are tied, ``replace_embedding`` instead."""
        if self.head_is_embedding:
            raise ValueError("the LM head is the embedding table: replace_embedding")
        self.lm_head = module

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Run the flat batch through the decoder; returns final hidden states [T, hidden]."""
        hidden = self.embed_tokens(input_ids)
        rope = self.ops.rope_tables(self.rope.cos, self.rope.sin, positions, hidden.dtype)
        return self._decoder(hidden, rope, kv_caches, meta)

    def forward_logits(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Logits ([T, vocab], fp32) of every row: ``compute_logits(forward(...))``, in one
        call of the ops where they take the whole step (``decode_logits``: a decode step's
        fused stack with the final norm and the LM head, no return to Python between)."""
        hidden = self.embed_tokens(input_ids)
        rope = self.ops.rope_tables(self.rope.cos, self.rope.sin, positions, hidden.dtype)
        logits = self.ops.decode_logits(self.layers, hidden, rope, kv_caches, meta,
                                        self.norm.weight, self.cfg.rms_norm_eps,
                                        self.lm_head_module)
        if logits is not None:  # fp32 already (the ops' contract)
            return logits
        return self.compute_logits(self._decoder(hidden, rope, kv_caches, meta))

    def _decoder(self, hidden: torch.Tensor, rope: RopeTables,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 meta: AttentionMetadata) -> torch.Tensor:
        """The decoder layers and the final norm over the embedded rows."""
        ops = self.ops
        stacked = ops.decode_stack(self.layers, hidden, rope, kv_caches, meta)
        if stacked is not None:  # the whole decoder in one call (decode-only steps, CPU)
            delta, hidden = stacked
        else:
            delta = None
            for layer, (kc, vc) in zip(self.layers, kv_caches):
                delta, hidden = layer(delta, hidden, rope, kc, vc, meta, ops)
        out, _ = ops.add_rms_norm(delta, hidden, self.norm.weight, self.cfg.rms_norm_eps)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ([n, vocab], fp32) for the hidden states of the positions to be sampled."""
        return self.ops.proj(hidden, self.lm_head_module).float()
