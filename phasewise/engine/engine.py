"""The synchronous engine: load a checkpoint, accept requests, run steps.

One ``step()``: ``Scheduler.schedule()`` -> ``ModelRunner.execute()`` -> ``Sampler`` ->
``Scheduler.update()`` -> text and stop strings (``OutputProcessor``) -> ``RequestOutput`` for
every request that received a token, plus a ``StepStats`` record with the step's cost as the
engine's cost model predicts it (``phasewise.engine.step_cost``).

The engine's clock is ``time.monotonic``; the scheduler stamps requests with the same clock,
passed to it (it reads none of its own).
"""

from __future__ import annotations

import ctypes
import itertools
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from phasewise.cache.manager import KVCacheManager
from phasewise.config import EngineConfig
from phasewise.engine.connector import PushConnector
from phasewise.engine.kv_sizing import KVPlan
from phasewise.engine.model_runner import ModelRunner
from phasewise.engine.output_processor import OutputProcessor
from phasewise.engine.outputs import RequestOutput, StepStats
from phasewise.engine.request import Request, RequestStatus
from phasewise.engine.sampler import Sampler
from phasewise.engine.sampling_params import SamplingParams
from phasewise.engine.scheduler import Scheduler, SchedulerConfig
from phasewise.engine.spec import DraftPolicy, NgramProposer, SpecStats
from phasewise.engine.step_cost import StepCoster, Unpriced
from phasewise.engine.structured import GrammarCompiler
from phasewise.engine.validation import check_token_ids
from phasewise.model.config import ModelConfig
from phasewise.model.cpu.backend import CpuBackend, prepare_cpu_backend
from phasewise.model.loader import load_model, resolve_dtype
from phasewise.model.tokenizer import Tokenizer, load_generation_config

DEFAULT_CPU_STEP_TOKENS = 256  # see EngineConfig.max_num_batched_tokens
DEFAULT_CUDA_STEP_TOKENS = 2048
MAX_STEP_HISTORY = 100_000


class StepFailed(RuntimeError):
    """A step's forward pass (or its sampling, for every request alike) raised: no single
    request is to blame. ``request_ids``: the requests the step held; requests outside it
    (waiting, or not scheduled) are untouched and may go on."""

    def __init__(self, request_ids: list[str], cause: Exception) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids
        self.cause = cause


def release_freed_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``). Packing
    weights into panels and the int8 conversion free transient copies that glibc keeps (its
    mmap threshold rises with the first large block freed, so later large blocks come from
    the heap and stay resident); trimmed before the KV pool is sized, they are not counted
    in the served process's resident memory. True where the C library has ``malloc_trim``
    (glibc), else False (nothing done)."""
    try:
        libc = ctypes.CDLL(None)  # TypeError on Windows, which has no such library handle
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device")
    return torch.device(device)


class LLMEngine:
    def __init__(self, config: EngineConfig, *, load_progress: Any = None,
                 cost_model: Callable[[LLMEngine], StepCoster] | None = None) -> None:
        """``cost_model``: builds, from the loaded engine, what prices each step
        (``StepStats.predicted_*``; ``phasewise.perf.attribution.StepCostModel.for_engine``);
        None: steps carry no predictions."""
        self.config = config
        model_dir = Path(config.model)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model folder {model_dir} does not exist (phasewise loads "
                                    "local checkpoint folders; it downloads nothing)")
        self.model_config = mc = ModelConfig.from_file(model_dir)
        self.tokenizer = Tokenizer(model_dir)
        self.generation_config = load_generation_config(model_dir)
        self.device = resolve_device(config.device)
        if self.device.type == "cuda" and self.device.index is not None:
            # Triton launches and graph capture follow the current device, not the tensors'
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config.dtype, mc)

        # The pool and the context length it allows, settled before spending time on the
        # weights where the budget is known (phasewise.engine.kv_sizing).
        bs = config.block_size
        kv_plan = KVPlan.plan(config, mc, ModelRunner.bytes_per_block(mc, bs, self.dtype),
                              self.device.type)
        max_len = kv_plan.max_model_len
        if config.quantization is not None and self.device.type != "cpu":
            raise ValueError(f"quantization {config.quantization} runs on CPU only; got "
                             f"device {self.device}")
        self.model = load_model(model_dir, mc, dtype=self.dtype, device=self.device,
                                max_positions=max_len, progress=load_progress,
                                quantization=config.quantization,
                                load_format=config.load_format, seed=config.seed)
        # The CPU kernels (phasewise.model.cpu.backend): the ops, the kernel plan they follow
        # (pinned, stored by `phasewise tune`, or ruled; never timed here) and its words.
        self.cpu_backend: CpuBackend | None = prepare_cpu_backend(
            self.model, config, self.dtype, self.device)
        backend = self.cpu_backend
        self.linear_plan = backend.linear if backend else None  # its LinearDispatch
        # why the decoder projections stay in rows ("" where they are packed into panels)
        self.panels_reason = backend.panels_reason if backend else "not the CPU kernels"
        if backend is not None:
            release_freed_heap()  # the packing's transient copies, before the KV pool
        self.gpu_kernels = "torch operations"  # on CUDA: what runs (generate reports it)
        if config.kernels == "auto" and self.device.type == "cuda":
            try:  # fused norm, RoPE, SiLU and paged decode attention (Triton ships with torch)
                from phasewise.model.triton_ops import TritonOps
            except ImportError as e:
                self.gpu_kernels = f"torch operations (no Triton: {e})"
            else:
                self.model.ops = TritonOps()
                self.gpu_kernels = "Triton kernels between the matrix products, cuBLAS GEMMs"
        if kv_plan.num_blocks is None:  # CUDA: the memory the weights left
            kv_plan = kv_plan.on_free(torch.cuda.mem_get_info(self.device)[0], config, mc)
        num_blocks, max_len = kv_plan.num_blocks, kv_plan.max_model_len
        self.max_model_len = max_len
        self.eos_token_ids = self._eos_ids()
        self.clock = time.monotonic

        self.kv = KVCacheManager(num_blocks, bs, config.enable_prefix_caching)
        budget_tokens = config.max_num_batched_tokens or (
            DEFAULT_CUDA_STEP_TOKENS if self.device.type == "cuda" else DEFAULT_CPU_STEP_TOKENS)
        self.max_num_batched_tokens = budget_tokens
        if config.policy == "prefill-first":
            budget_tokens = max(budget_tokens, max_len)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens=budget_tokens,
                            max_num_seqs=config.max_num_seqs, max_model_len=max_len,
                            policy=config.policy),
            self.kv, self.clock,
        )
        graphs = ("cuda" if self.device.type == "cuda" and not config.enforce_eager
                  else None)
        self.runner = ModelRunner(self.model, mc, num_blocks=num_blocks, block_size=bs,
                                  dtype=self.dtype, device=self.device, decode_graphs=graphs,
                                  max_model_len=max_len)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request
        # Speculative decoding (phasewise.engine.spec): who proposes drafts, and the counts.
        self.proposer = NgramProposer() if config.speculative == "ngram" else None
        self.spec_stats = SpecStats()
        self._untimed_s = 0.0
        self.requests: dict[str, Request] = {}
        self.output_processor = OutputProcessor(self.tokenizer)  # text and stop strings
        self._ids = itertools.count()
        self.step_stats: deque[StepStats] = deque(maxlen=MAX_STEP_HISTORY)
        self._step_index = 0
        self.stalled = False  # the last step() found nothing it may run
        # P/D: the K/V this engine ships (prefill role) and receives (decode role).
        self.connector = PushConnector(self.runner, bs)
        # What each step should have cost (phasewise.engine.step_cost), built from the engine
        # as loaded: its dtype, device and CPU kernels decide the arithmetic a step runs in.
        self.cost_model: StepCoster = cost_model(self) if cost_model is not None else Unpriced()
        # Speculative decoding spends rows: the policy lets a step draft only at batch sizes
        # where drafting has delivered more tokens per second on this engine. None: every
        # step drafts.
        self.draft_policy = DraftPolicy() if self.proposer is not None else None

    # -- set-up helpers --------------------------------------------------------------------
    def _eos_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        gen = self.generation_config.get("eos_token_id")
        for source in (gen, list(self.model_config.eos_token_ids), self.tokenizer.eos_token_id):
            if source is None:
                continue
            for t in source if isinstance(source, list) else [source]:
                if t not in ids:
                    ids.append(int(t))
        return tuple(ids)

    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """Sampling defaults from ``generation_config.json``, then ``overrides``."""
        g = self.generation_config
        kw: dict[str, Any] = {}
        if g.get("do_sample") is False:
            kw["temperature"] = 0.0
        else:
            for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
                if g.get(key) is not None:
                    kw[key] = g[key]
        kw.update(overrides)
        return SamplingParams(**kw)

    # -- requests --------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None, *,
                    export_kv_from: int | None = None) -> str:
        """Queue a request; returns its id. Raises ValueError for input it can never serve.

        ``arrival_time`` (on ``self.clock``, ``time.monotonic``) defaults to now; a server
        passes the time the HTTP request arrived, so queue time and TTFT include the wait to
        reach the engine. Errors are ``phasewise.engine.validation.ValidationError`` (a
        ValueError naming the field at fault) or ValueError.

        ``export_kv_from`` (the prefill role): after every step that computes part of this
        request's prompt, hand the K/V of its blocks from this token index on (a multiple of
        block_size) to ``kv_sink`` as soon as the forward pass has written them; each block
        once, when it is full or holds the prompt's end."""
        req = self._new_request(prompt, params, request_id, arrival_time)
        if export_kv_from is not None:
            self.connector.export(req.request_id, export_kv_from)
        try:
            self.scheduler.add_request(req)  # raises if it can never fit
        except BaseException:
            self.connector.request_finished(req.request_id)
            raise
        self._register(req)
        return req.request_id

    def _new_request(self, prompt: str | list[int], params: SamplingParams | None,
                     request_id: str | None, arrival_time: float | None) -> Request:
        params = params or self.default_sampling_params()
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text = None
            ids = check_token_ids(prompt, self.model_config.vocab_size, "prompt")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, "
                             f"got {type(prompt).__name__}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(rid, ids, params, eos_token_ids=self.eos_token_ids, prompt=text,
                      arrival_time=self.clock() if arrival_time is None else arrival_time)
        if params.structured_output is not None:
            req.grammar = self.grammars.compile(params.structured_output)
        return req

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured output's compiler for this model's tokenizer and logits width."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer.to_json(), self.eos_token_ids,
                                             self.model_config.vocab_size)
        return self._grammars

    def _register(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.output_processor.add(req)

    # -- remote prefill ------------------------------------------------------------------
    # The decode role admits a request with add_remote_request, writes the K/V a prefill
    # worker sends with load_remote_kv, and hands over the first token with
    # finish_remote_prefill; fail_remote_prefill computes here whatever did not arrive.
    # The prefill role runs the request with add_request(..., export_kv_from=...) and
    # max_tokens=1, with a kv_sink that ships each chunk's blocks.
    def add_remote_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                           request_id: str | None = None,
                           arrival_time: float | None = None) -> int | None:
        """Admit a request whose prompt a prefill worker computes. Returns the number of
        prompt tokens this engine's prefix cache already holds (the prefill worker sends K/V
        from there on), or None when there is no room now (add_request it instead)."""
        req = self._new_request(prompt, params, request_id, arrival_time)
        hit = self.scheduler.reserve_remote(req)
        if hit is None:
            return None
        self._register(req)
        self.connector.after_alloc(req.request_id, req.num_prompt_tokens, hit)
        return hit

    def _remote(self, request_id: str) -> Request:
        req = self.requests.get(request_id)
        if req is None or req.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            raise ValueError(f"request {request_id!r} is not waiting for remote KV")
        return req

    def load_remote_kv(self, request_id: str, first_token: int, data: torch.Tensor) -> None:
        """Write K/V sent by the prefill worker: ``data`` ([layers, 2, n, block_size, kv, hd])
        holds the blocks that start at prompt token ``first_token`` (a block boundary).
        Blocks before the local prefix-cache hit are never overwritten."""
        self._remote(request_id)
        self.connector.start_load(request_id, first_token, data,
                                  self.kv.block_table(request_id))

    def remote_kv_complete(self, request_id: str) -> bool:
        """Whether every block of the request's prompt has arrived."""
        self._remote(request_id)
        return self.connector.load_complete(request_id)

    def finish_remote_prefill(self, request_id: str, token: int,
                              logprobs: dict[int, float] | None = None) -> RequestOutput:
        """The prefill worker's first sampled token: the request joins the running ones (its
        next step is a decode). Returns its output for that token."""
        req = self._remote(request_id)
        vocab = self.model_config.vocab_size
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            raise ValueError(f"the first token {token!r} of request {request_id!r} is not an id "
                             f"in [0, {vocab})")
        if not self.remote_kv_complete(request_id):
            raise ValueError(f"request {request_id!r} has K/V for "
                             f"{self.connector.loaded_tokens(request_id)} of its "
                             f"{req.num_prompt_tokens} prompt tokens; it cannot decode")
        if req.grammar is not None and not req.grammar.accept(token):
            # a fresh matcher for the local prefill that the caller falls back to
            req.grammar = self.grammars.compile(req.params.structured_output)
            raise ValueError(f"the first token {token} of request {request_id!r} is not one "
                             f"its structured output allows")
        self.connector.end_load(request_id)
        if req.logprobs is not None and logprobs is not None:
            req.logprobs.append(dict(logprobs))
        self.sampler.skip_draw(req, self.device)
        self.scheduler.remote_prefill_done(req, token)
        return self._emit(req)

    def fail_remote_prefill(self, request_id: str) -> int:
        """The remote prefill will not finish: compute the rest of the prompt here. Returns
        the prompt tokens kept (their K/V arrived)."""
        req = self._remote(request_id)
        kept = self.connector.loaded_tokens(request_id)
        self.connector.end_load(request_id)
        self.scheduler.remote_prefill_failed(req, kept)
        return req.num_computed_tokens

    @property
    def kv_sink(self) -> Callable[[str, int, int, torch.Tensor], None] | None:
        """The prefill role's sink: (request id, first prompt token, end, the blocks' K/V),
        called on the engine thread right after the forward pass that wrote them."""
        return self.connector.sink

    @kv_sink.setter
    def kv_sink(self, sink: Callable[[str, int, int, torch.Tensor], None] | None) -> None:
        self.connector.sink = sink

    def abort_request(self, request_id: str) -> Request | None:
        """Stop a request now and free its KV blocks. Returns the aborted request, or None
        if the id is unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
        self._forget(req)
        return req

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()


    def _forget(self, req: Request) -> None:
        self.connector.request_finished(req.request_id)  # pushing never holds blocks
        if self.proposer is not None:
            self.proposer.release(req.request_id)
        self.requests.pop(req.request_id, None)
        self.output_processor.remove(req.request_id)
        self.sampler.release(req.request_id)

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.monotonic()
        self._untimed_s = 0.0  # spent in this step but not by it (the draft policy's view)
        if self.proposer is not None:
            self._propose()
        batch = self.scheduler.schedule()
        # Nothing could run and nothing changed (every seat held by requests waiting for
        # remote K/V): only a command can change that, so a caller may wait for one.
        self.stalled = not batch.requests and not batch.preempted
        if not batch.requests:
            return []
        cost = self.cost_model.predict(*batch.mix())  # before update() advances the counts
        chunks, decoders = batch.riders()
        tables = [self.kv.block_table(r.request_id) for r in batch.requests]
        try:
            exports = (self.connector.step_exports(batch.requests, batch.num_tokens)
                       if self.connector.exporting else [])
            ran = self.runner.execute(batch, tables)
            if exports:
                self.connector.save(exports, {r.request_id: t
                                              for r, t in zip(batch.requests, tables)})
            tokens, failed = self._sample(ran)
            verified = self._verify(ran, tokens, failed)
        except Exception as e:
            raise StepFailed([r.request_id for r in batch.requests], e) from e
        got = self.scheduler.update(batch, tokens)

        outputs = []
        for req, error in failed:  # its own sampling failed: it ends here, no one else
            if not req.finished:
                self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
            out = self.output_processor.output(req)
            out.error = error
            outputs.append(out)
            self._forget(req)
        proposed = accepted = 0
        for req, kept in got:
            spec = verified.get(req.request_id)
            if spec is not None and req.logprobs is not None:  # drop those of tokens cut off
                del req.logprobs[len(req.logprobs) - (len(tokens[req.request_id]) - kept):]
            out = self._emit(req, kept)
            outputs.append(out)
            if spec is not None:
                proposed += spec[0]
                accepted += spec[1]
                self.spec_stats.add(spec[0], spec[1], len(out.delta_token_ids))
        self._step_index += 1
        duration = time.monotonic() - start
        if (self.draft_policy is not None and batch.num_decode_tokens
                and not batch.num_prefill_tokens):
            self.draft_policy.observe_step(bool(verified), len(batch.requests),
                                           sum(kept for _, kept in got),
                                           duration - self._untimed_s)
        self.step_stats.append(StepStats(
            index=self._step_index, start_time=start, duration_s=duration,
            num_prefill_tokens=batch.num_prefill_tokens,
            num_decode_tokens=batch.num_decode_tokens, num_requests=len(batch.requests),
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_usage=self.kv.usage, num_preempted=len(batch.preempted),
            predicted_flops=cost.flops, predicted_bytes=cost.bytes, predicted_s=cost.seconds,
            prefill_chunks=chunks, decode_ids=decoders, compute_dtype=cost.compute_dtype,
            num_spec_proposed=proposed, num_spec_accepted=accepted,
        ))
        return outputs

    def _propose(self) -> None:
        """Give each decoding request drafts to verify in this step: at most
        ``num_speculative_tokens``, no more than its context and ``max_tokens`` leave room
        for, none for a request whose sampling needs the history token by token
        (penalties, ``min_tokens`` still masking its stop tokens, a grammar), and none at all
        in a step that ``draft_policy`` finds drafting does not pay in."""
        k = self.config.num_speculative_tokens or 0
        max_len = self.scheduler.max_len
        decoding = [r for r in self.scheduler.running
                    if r.num_output_tokens and r.num_computed_tokens == r.num_tokens - 1]
        policy = self.draft_policy
        if policy is not None:
            drafted_before = policy.drafting
            if not policy.begin_step(len(decoding)):
                return
            catch_up = getattr(self.proposer, "catch_up", None)
            if not drafted_before and catch_up is not None:
                # steps that did not draft left the proposer's index behind: bringing it up
                # to date is not what drafting costs a step, so it stays out of the timing
                t = time.monotonic()
                for req in decoding:
                    catch_up(req.request_id, req.all_token_ids)
                self._untimed_s = time.monotonic() - t
        for req in decoding:
            p = req.params
            if (p.needs_penalties or req.num_output_tokens < p.min_tokens
                    or req.grammar is not None):
                continue
            room = min(k, max_len - req.num_tokens)
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - req.num_output_tokens - 1)
            if room >= 1:
                req.spec_token_ids = self.proposer.propose(req.request_id, req.all_token_ids,
                                                           room)

    def _verify(self, ran: Any, tokens: dict[str, list[int]],
                failed: list[tuple[Request, str]]) -> dict[str, tuple[int, int]]:
        """Turn each verify's rows of logits into its tokens (added to ``tokens``; a request
        whose verification raises joins ``failed``). Returns (drafts, accepted) per
        verifying request."""
        verified: dict[str, tuple[int, int]] = {}
        for req, row, n in ran.spans():
            if n == 1:
                continue
            try:
                out, accepted = self.sampler.verify(ran.logits[row:row + n], req)
            except Exception as e:  # noqa: BLE001 - reported on that request only
                failed.append((req, f"sampling failed for this request: "
                                    f"{type(e).__name__}: {e}"))
                continue
            tokens[req.request_id] = out.token_ids
            if req.logprobs is not None:
                req.logprobs.extend(lp for lp in out.logprobs if lp is not None)
            verified[req.request_id] = (n - 1, accepted)
        return verified

    def _sample(self, ran: Any) -> tuple[dict[str, list[int]], list[tuple[Request, str]]]:
        """Tokens for the requests that sample one token (and their logprobs, recorded on
        the requests); the rows of verifying requests (``Request.spec_token_ids``) are left
        to ``_verify``.

        If sampling the batch raises, each row is sampled alone to find the requests whose
        own settings fail: those come back in the second list, with the error, and the rest
        of the step goes on. If every row fails alone too, the fault is not one request's,
        and the original error is raised."""
        plain = [(req, row) for req, row, n in ran.spans() if n == 1]
        if not plain:
            return {}, []
        requests = [req for req, _ in plain]
        logits = (ran.logits if len(plain) == ran.logits.shape[0]
                  else ran.logits[[row for _, row in plain]])
        try:
            sampled = self.sampler(logits, requests)
            rows = list(zip(requests, sampled.token_ids, sampled.logprobs))
            failed: list[tuple[Request, str]] = []
        except Exception as batch_error:
            rows, failed = [], []
            for i, req in enumerate(requests):
                try:
                    one = self.sampler(logits[i:i + 1], [req])
                except Exception as e:  # noqa: BLE001 - reported on that request only
                    failed.append((req, f"sampling failed for this request: "
                                        f"{type(e).__name__}: {e}"))
                    continue
                rows.append((req, one.token_ids[0], one.logprobs[0]))
            if not rows:
                raise batch_error
        tokens = {}
        for req, tok, lp in rows:
            slow = req.grammar.too_slow if req.grammar is not None else None
            if slow is not None:
                failed.append((req, slow))
                continue
            if req.grammar is not None and not req.grammar.accept(tok):
                failed.append((req, f"structured output refused token {tok}: "
                                    f"{req.grammar.error}"))
                continue
            tokens[req.request_id] = [tok]
            if req.logprobs is not None and lp is not None:
                req.logprobs.append(lp)
        return tokens, failed

    def _emit(self, req: Request, new_tokens: int = 1) -> RequestOutput:
        """The output of a request that just got ``new_tokens`` tokens (more than one after
        a verify; stop strings: ``OutputProcessor.emit``), and the request forgotten if that
        finished it."""
        out = self.output_processor.emit(req, new_tokens, self.scheduler.finish_request)
        if req.finished:
            self._forget(req)
        return out

