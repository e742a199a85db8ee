"""The roofline cost model of one engine step, and what follows from it.

A step of a decoder-only transformer does ``flops`` of arithmetic and moves ``bytes`` through
the memory system; on a machine with peak ``P`` FLOP/s and bandwidth ``BW`` it cannot take
less than ``max(flops / P, bytes / BW)``. Which of the two is larger is the step's bound;
``intensity = flops / bytes`` against the machine's ridge point ``P / BW`` says the same.

FLOPs of a step:

* linear layers: 2 x (matmul parameters a token goes through) per token computed;
* attention: for a query at position ``i`` (1-based), ``QK^T`` and ``AV`` each cost
  ``2 * head_dim * i`` per head, so ``4 * layers * heads * head_dim * i`` in all. The causal
  mask is counted properly: a prefill of ``S`` tokens after a cached prefix of ``P`` sums
  ``i`` from ``P + 1`` to ``P + S``, which is ``S * P + S * (S + 1) / 2`` (not ``S * (P+S)``);
* the LM head: ``2 * vocab * hidden`` only for the positions that sample (one per request).

Bytes of a step: every weight once, except an MoE model's experts that none of the step's
tokens routed to (``ModelShape.experts_touched``: of E experts with top-k routing, T tokens
touch E (1 - (1 - k/E)^T) in expectation: k at one token, all E as T grows), the KV cache
each sequence reads (its context), the KV it writes, and activations (each matmul's input and
output once per token and layer).

A *mixed* step (``Roofline.mixed``) is what the engine runs: one fused pass over prompt chunks
and decode tokens together. Its weights are read once for the whole step, not once per phase;
linear FLOPs and activations follow the step's total tokens; attention FLOPs and KV bytes are
counted per chunk from its own positions. A pure prefill or pure decode batch costs exactly
what ``prefill()`` / ``decode()`` give.

Efficiency factors ``mfu`` and ``mbu`` (default 1.0) scale the peaks; with other values the
predictions are "at X% of peak".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cached_property

from phasewise.engine.step_cost import Chunk
from phasewise.perf.hardware import Accelerator, Link
from phasewise.perf.models import GenericModel, ModelShape

DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
WEIGHT_ONLY_DTYPES = ("int8", "int4")  # weights stored so, activations 16-bit
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def norm_dtype(dtype: str) -> str:
    d = DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    if d not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}; got {dtype!r}")
    return d


@dataclass(frozen=True)
class StepCost:
    """One step's work, its time bounds and its bound."""

    kind: str  # "prefill", "decode" or "mixed"
    tokens: int  # tokens computed in the step
    flops: float
    bytes: float
    weight_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float
    act_bytes: float
    peak_flops: float  # after mfu
    bandwidth: float  # after mbu

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    @property
    def ridge(self) -> float:
        return self.peak_flops / self.bandwidth

    @property
    def t_compute(self) -> float:
        return self.flops / self.peak_flops

    @property
    def t_memory(self) -> float:
        return self.bytes / self.bandwidth

    @property
    def time(self) -> float:
        return max(self.t_compute, self.t_memory)

    @property
    def bound(self) -> str:
        return "compute" if self.t_compute >= self.t_memory else "memory"

    @property
    def ratio(self) -> float:
        """How many times the slower side outweighs the faster (>= 1)."""
        hi, lo = max(self.t_compute, self.t_memory), min(self.t_compute, self.t_memory)
        return hi / lo if lo > 0 else math.inf

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(intensity=self.intensity, ridge=self.ridge, t_compute_s=self.t_compute,
                 t_memory_s=self.t_memory, time_s=self.time, bound=self.bound,
                 ratio=self.ratio)
        return d


def chunk_positions(chunks: Sequence[Chunk]) -> int:
    """Query positions (1-based) summed over prompt chunks: P+1..P+S for a chunk of S tokens
    after P, i.e. S * P + S * (S + 1) / 2 (the causal mask counted once per pair)."""
    return sum(c.tokens * c.context + c.tokens * (c.tokens + 1) // 2 for c in chunks)


class Roofline:
    """The cost model for one model on one accelerator at one dtype."""

    def __init__(self, model: ModelShape | GenericModel, accel: Accelerator,
                 dtype: str = "bf16", kv_dtype: str | None = None, mfu: float = 1.0,
                 mbu: float = 1.0, compute_dtype: str | None = None,
                 moe_dtype: str | None = None) -> None:
        """``dtype``: how weights are stored (bytes); ``compute_dtype`` (default: the same):
        whose peak FLOP/s the arithmetic runs at, e.g. fp32 for bf16 weights on a CPU
        without native bf16 math. Weight-only integer dtypes (int8, int4) keep 16-bit
        activations, and by default a bf16 K/V cache and bf16 arithmetic. ``moe_dtype``
        (default: ``dtype``): how an MoE model's sparse-layer MLPs (experts, router, shared
        expert) are stored, where they differ from the rest: phasewise's ``--quantization
        int8`` leaves them at the checkpoint's dtype."""
        self.model = model
        self.accel = accel
        self.dtype = norm_dtype(dtype)
        wide = "bf16" if self.dtype in WEIGHT_ONLY_DTYPES else self.dtype
        self.kv_dtype = norm_dtype(kv_dtype or wide)
        self.act_bytes_per_el = DTYPE_BYTES[wide]
        self.compute_dtype = norm_dtype(compute_dtype or wide)
        for name, v in (("mfu", mfu), ("mbu", mbu)):
            if not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v}")
        self.mfu, self.mbu = mfu, mbu
        peak = accel.peak_flops_for(self.compute_dtype)
        self.peak_flops = peak * mfu
        self.bandwidth = accel.mem_bandwidth * mbu
        self.wbytes = DTYPE_BYTES[self.dtype]
        self.moe_dtype = norm_dtype(moe_dtype or self.dtype)
        self.moe_wbytes = DTYPE_BYTES[self.moe_dtype]

    # -- model quantities ------------------------------------------------------------------
    @property
    def shaped(self) -> bool:
        return isinstance(self.model, ModelShape)

    @property
    def weight_bytes(self) -> float:
        m = self.model
        if isinstance(m, GenericModel):
            return m.params * self.wbytes
        return m.weight_bytes(self.wbytes, self.moe_wbytes)

    def step_weight_bytes(self, tokens: float) -> float:
        """Weight bytes a step of ``tokens`` tokens reads: all of them but the input
        embedding's rows no token looks up, and for an MoE model the experts no token
        routes to (``ModelShape.experts_touched``)."""
        m = self.model
        if isinstance(m, GenericModel):
            return self.weight_bytes
        read = (m.weight_bytes(self.wbytes, self.moe_wbytes, m.experts_touched(tokens))
                if m.is_moe else self.weight_bytes)
        return read - m.unread_embedding_params(tokens) * self.wbytes

    @property
    def kv_bytes_per_token(self) -> float | None:
        if not isinstance(self.model, ModelShape):
            return None
        return self.model.kv_bytes_per_token(DTYPE_BYTES[self.kv_dtype])

    def _linear_flops_per_token(self) -> float:
        m = self.model
        if isinstance(m, GenericModel):
            return 2.0 * m.params  # the whole model, LM head included, as the seed counts it
        return 2.0 * m.active_linear_params

    def _lm_head_flops(self) -> float:
        m = self.model
        return 0.0 if isinstance(m, GenericModel) else 2.0 * m.lm_head_params

    def _attn_flops(self, query_positions_sum: float) -> float:
        m = self.model
        if isinstance(m, GenericModel):
            return 0.0
        return m.attn_flops_per_position * query_positions_sum

    def _act_bytes(self, tokens: int) -> float:
        m = self.model
        if isinstance(m, GenericModel):
            return 0.0
        return tokens * m.num_layers * m.act_elems_per_token() * self.act_bytes_per_el

    @cached_property
    def _windowed(self) -> bool:
        return isinstance(self.model, ModelShape) and self.model.windowed

    def _span(self, n: float) -> float:
        """K/V positions a sequence of ``n`` tokens reads, averaged over the layers (capped
        at the window where a layer has one)."""
        return self.model.attended(n) if self._windowed else n

    def _span_sum(self, lo: int, hi: int) -> float:
        if self._windowed:
            return self.model.attended_sum(lo, hi)
        return (lo + hi) * (hi - lo + 1) / 2

    @cached_property
    def _moe(self) -> bool:
        return isinstance(self.model, ModelShape) and self.model.is_moe

    @cached_property
    def _mixed_consts(self) -> tuple[float, float, float, float, float, float]:
        """``mixed``'s per-token constants, computed once: the engine asks for every step's
        cost, and on a CPU whose caches the weights' stream has just flushed each property
        walked costs a few microseconds more."""
        return (self._linear_flops_per_token(), self._attn_flops(1), self._lm_head_flops(),
                self.kv_bytes_per_token or 0.0, self._act_bytes(1), self.weight_bytes)

    # -- steps -----------------------------------------------------------------------------
    def prefill(self, prompt_len: int, prefix_len: int = 0, batch: int = 1) -> StepCost:
        """``batch`` prompts of ``prompt_len`` new tokens each, after ``prefix_len`` cached
        tokens, in one step; each samples its first token."""
        if prompt_len < 1 or prefix_len < 0 or batch < 1:
            raise ValueError("prefill needs prompt_len >= 1, prefix_len >= 0, batch >= 1")
        s, p = prompt_len, prefix_len
        positions = self._span_sum(p + 1, p + s)  # sum of i for i in P+1..P+S (windows: capped)
        tokens = batch * s
        flops = (tokens * self._linear_flops_per_token() + batch * self._attn_flops(positions)
                 + batch * self._lm_head_flops())
        kvpt = self.kv_bytes_per_token or 0.0
        kv_read = batch * self._span(p) * kvpt
        kv_write = tokens * kvpt
        act = self._act_bytes(tokens)
        weights = self.step_weight_bytes(tokens)
        total = weights + kv_read + kv_write + act
        return StepCost("prefill", tokens, flops, total, weights, kv_read, kv_write,
                        act, self.peak_flops, self.bandwidth)

    def decode(self, batch: int = 1, context: int | Sequence[int] = 0) -> StepCost:
        """One decode step of ``batch`` sequences; ``context`` is each one's length with the
        new token (a number for all, or one per sequence). 0: weights only."""
        if isinstance(context, int):  # one length for all: priced once, times the batch
            contexts = [context]
            times = batch
        else:
            contexts = list(context)
            batch, times = len(contexts), 1
        if batch < 1 or any(c < 0 for c in contexts):
            raise ValueError("decode needs batch >= 1 and contexts >= 0")
        flops = batch * (self._linear_flops_per_token() + self._lm_head_flops()) \
            + self._attn_flops(times * sum(self._span(c) for c in contexts))
        kvpt = self.kv_bytes_per_token or 0.0
        kv_read = times * sum(self._span(max(c - 1, 0)) for c in contexts) * kvpt
        kv_write = batch * kvpt if any(contexts) else 0.0
        act = self._act_bytes(batch)
        weights = self.step_weight_bytes(batch)
        total = weights + kv_read + kv_write + act
        return StepCost("decode", batch, flops, total, weights, kv_read, kv_write,
                        act, self.peak_flops, self.bandwidth)

    def mixed(self, chunks: Sequence[Chunk] = (), decodes: Sequence[int] = ()) -> StepCost:
        """One fused step over prompt ``chunks`` and decode tokens; ``decodes`` holds each
        decoding sequence's length with its new token (as ``decode``'s ``context``).

        The weights are read once for the step; linear FLOPs and activations scale with all
        its tokens; the LM head runs once per sampling position (every decode, every chunk
        that ``samples``); attention FLOPs, KV reads and KV writes come from each chunk's and
        each decode's own positions. ``kind`` is ``prefill`` or ``decode`` for a pure batch,
        else ``mixed``."""
        if not chunks and not decodes:
            raise ValueError("a step needs at least one chunk or decode")
        if any(c.tokens < 1 or c.context < 0 for c in chunks) or (decodes and min(decodes) < 0):
            raise ValueError("chunks need tokens >= 1 and context >= 0; decodes need >= 0")
        linear, attn, head, kvpt, act1, weights = self._mixed_consts
        tokens = sum(c.tokens for c in chunks) + len(decodes)
        # Query positions (1-based) summed: the chunks', and each decode's context.
        fresh = len(decodes) - decodes.count(0)
        if self._windowed:  # each query sees at most the window where a layer has one
            m = self.model
            positions = (sum(m.attended_sum(c.context + 1, c.context + c.tokens)
                             for c in chunks) + sum(m.attended(d) for d in decodes))
            read = (sum(m.attended(c.context) for c in chunks)
                    + sum(m.attended(max(d - 1, 0)) for d in decodes))
        else:
            positions = chunk_positions(chunks) + sum(decodes)
            # each decode reads its context less the new token (none for an empty one)
            read = sum(c.context for c in chunks) + sum(decodes) - fresh
        samples = sum(1 for c in chunks if c.samples) + len(decodes)
        flops = tokens * linear + attn * positions + samples * head
        kv_read = read * kvpt
        kv_write = (sum(c.tokens for c in chunks) + fresh) * kvpt
        act = tokens * act1
        if self._moe:
            weights = self.step_weight_bytes(tokens)
        elif self.shaped:  # (an untied embedding's rows its tokens do not look up)
            weights -= self.model.unread_embedding_params(tokens) * self.wbytes
        total = weights + kv_read + kv_write + act
        kind = "mixed" if chunks and decodes else ("prefill" if chunks else "decode")
        return StepCost(kind, tokens, flops, total, weights, kv_read, kv_write, act,
                        self.peak_flops, self.bandwidth)

    # -- derived ---------------------------------------------------------------------------
    def ttft(self, prompt_len: int, prefix_len: int = 0) -> float:
        """Prefill time of one prompt (no queueing)."""
        return self.prefill(prompt_len, prefix_len).time

    def tpot(self, batch: int, prompt_len: int, output_len: int) -> float:
        """Decode step time at the mean context of the output (prompt + output / 2)."""
        return self.decode(batch, prompt_len + max(output_len // 2, 1)).time

    def critical_batch(self, context: int) -> float | None:
        """Smallest batch at which a decode step at ``context`` turns compute-bound, or None
        if it never does (each sequence's KV reads cost more time than its arithmetic). For
        an MoE model the weights a step reads grow with the batch (more experts touched), so
        the batch is found by bisection on the step's own arithmetic and traffic."""
        per_seq = self.decode(1, context)
        seq_compute = per_seq.flops / self.peak_flops
        seq_memory = (per_seq.bytes - per_seq.weight_bytes) / self.bandwidth
        if seq_compute <= seq_memory:
            return None
        if not self._moe:  # (the embedding rows a batch looks up: negligible here)
            return (self.step_weight_bytes(1) / self.bandwidth) / (seq_compute - seq_memory)

        def over(b: float) -> float:  # compute time less memory time of a batch of b
            w = self.step_weight_bytes(b) / self.bandwidth
            return b * seq_compute - (w + b * seq_memory)

        lo, hi = 0.0, 1.0
        while over(hi) < 0:  # the full model's batch bounds it: over() turns positive
            lo, hi = hi, hi * 2
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if over(mid) < 0 else (lo, mid)
        return hi

    def never_compute_bound_context(self) -> float | None:
        """Context length beyond which decode stays memory-bound at any batch (attention over
        the KV cache does fewer FLOPs per byte than the ridge), or None if no such length."""
        if not isinstance(self.model, ModelShape):
            return None
        if self._windowed:
            return self._never_compute_bound_windowed()
        m = self.model
        kvpt = self.kv_bytes_per_token or 0.0
        a = m.num_layers * m.act_elems_per_token() * self.act_bytes_per_el
        f0 = self._linear_flops_per_token() + self._lm_head_flops()
        f1 = m.attn_flops_per_position  # per context token
        # compute(t) = (f0 + f1 t)/P ; memory(t) = ((t - 1) kvpt + kvpt + a)/BW = (t kvpt + a)/BW
        slope = kvpt / self.bandwidth - f1 / self.peak_flops
        if slope <= 0:
            return None
        return max(0.0, (f0 / self.peak_flops - a / self.bandwidth) / slope)

    def _never_compute_bound_windowed(self) -> float | None:
        """``never_compute_bound_context`` where K/V reads stop growing at a window: the
        first context at which a sequence's reads outweigh its arithmetic, found on the
        decode step's own figures (None if none does up to 16 M tokens)."""
        def worse(c: float) -> bool:
            one = self.decode(1, int(c))
            return one.flops / self.peak_flops <= \
                (one.bytes - one.weight_bytes) / self.bandwidth
        hi = 1.0
        while not worse(hi):
            if hi > 2 ** 24:
                return None
            hi *= 2
        lo = hi / 2 if hi > 1 else 0.0
        while hi - lo > 1:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if worse(mid) else (mid, hi)
        return hi

    def max_concurrent_requests(self, context: int, reserve_frac: float = 0.1) -> int | None:
        """Requests of ``context`` tokens whose KV fits beside the weights, after keeping
        ``reserve_frac`` of what the weights leave for activations and the runtime: the
        engine's rule on a GPU (``engine.kv_sizing.CUDA_FREE_FRACTION`` is 1 - the default),
        so that this and ``simulate``'s pool agree."""
        free = (self.accel.mem_bytes - self.weight_bytes) * (1 - reserve_frac)
        return self.requests_in_pool(free, context)

    def requests_in_pool(self, pool_bytes: float, context: int) -> int | None:
        """Requests of ``context`` tokens whose K/V a pool of ``pool_bytes`` holds (a CPU
        engine's pool is a set size, not what the weights leave: ``kv_cache_memory``)."""
        kvpt = self.kv_bytes_per_token
        if kvpt is None or context < 1:
            return None
        # a windowed layer holds no more than its window of K/V (once what falls out of it
        # is freed)
        return max(0, int(pool_bytes // (self._span(context) * kvpt)))

    def kv_transfer(self, prompt_len: int, link: Link) -> dict[str, float] | None:
        """Time to ship one prompt's KV cache over ``link``, against its prefill time."""
        kvpt = self.kv_bytes_per_token
        if kvpt is None:
            return None
        nbytes = prompt_len * kvpt
        t = link.latency_s + nbytes / link.bandwidth
        pre = self.prefill(prompt_len).time
        return {"bytes": nbytes, "transfer_s": t, "prefill_s": pre,
                "transfer_over_prefill": t / pre}
