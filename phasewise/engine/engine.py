"""The synchronous engine: load a checkpoint, accept requests, run steps.

One ``step()``: ``Scheduler.schedule()`` -> ``ModelRunner.execute()`` -> ``Sampler`` ->
``Scheduler.update()`` -> text and stop strings (``OutputProcessor``) -> ``RequestOutput`` for
every request that received a token, plus a ``StepStats`` record with the step's cost as the
engine's cost model predicts it (``phasewise.engine.step_cost``).

The engine's clock is ``time.monotonic``; the scheduler stamps requests with the same clock,
passed to it (it reads none of its own).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from phasewise.cache.manager import KVCacheManager
from phasewise.config import EngineConfig
from phasewise.engine.connector import PushConnector
from phasewise.engine.finish import masked_tokens, token_finish
from phasewise.engine.generation import GenerationDefaults
from phasewise.engine.kv_sizing import KVPlan, check_host_memory
from phasewise.engine.model_runner import ModelRunner, RunnerOutput
from phasewise.engine.output_processor import OutputProcessor
from phasewise.engine.outputs import RequestOutput, StepStats
from phasewise.engine.remote_prefill import RemotePrefills
from phasewise.engine.request import Request, RequestStatus
from phasewise.engine.request_builder import RequestBuilder
from phasewise.engine.sampler import Failure, Sampler, sample_step, step_groups
from phasewise.engine.sampling_params import SamplingParams
from phasewise.engine.scheduler import Scheduler, SchedulerConfig
from phasewise.engine.slo import (SLO, Refusal, StepClock, group_forecast, judge,
                                  mean_context)
from phasewise.engine.spec import DraftPolicy, NgramProposer, SpecStats, Speculator
from phasewise.engine.step_cost import Chunk, StepCoster, Unpriced
from phasewise.engine.structured import GrammarCompiler
from phasewise.engine.validation import ValidationError, check_token_ids
from phasewise.model.config import ModelConfig
from phasewise.model.loader import resolve_dtype
from phasewise.model.prepare import prepare_model, resolve_device
from phasewise.model.tokenizer import Tokenizer

__all__ = ["Failure", "LLMEngine", "StepFailed"]

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


class LLMEngine:
    def __init__(self, config: EngineConfig, *, load_progress: Any = None,
                 cost_model: Callable[[LLMEngine], StepCoster] | None = None) -> None:
        """``cost_model``: builds, from the loaded engine, what prices each step
        (``StepStats.predicted_*``; ``phasewise.perf.attribution.StepCostModel.for_engine``);
        None: steps carry no predictions."""
        self.config = config
        if config.num_threads is not None:  # before the kernel plan, keyed by thread count
            torch.set_num_threads(config.num_threads)
        model_dir = Path(config.model)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model folder {model_dir} does not exist (phasewise loads "
                                    "local checkpoint folders; it downloads nothing)")
        self.model_config = mc = ModelConfig.from_file(model_dir)
        self.tokenizer = Tokenizer(model_dir)
        self.generation = GenerationDefaults.load(model_dir, mc, self.tokenizer)
        self.generation_config = self.generation.config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, mc)

        # The pool and the context length it allows, settled before spending time on the
        # weights where the budget is known (phasewise.engine.kv_sizing).
        bs = config.block_size
        kv_plan = KVPlan.plan(config, mc, ModelRunner.bytes_per_block(mc, bs, self.dtype),
                              self.device.type)
        if self.device.type == "cpu":
            check_host_memory(kv_plan, config)
        # The weights, and the ops that run them (phasewise.model.prepare)
        self.prepared = prepare_model(config, model_dir, mc, self.dtype, self.device,
                                      kv_plan.max_model_len, load_progress)
        self.model = self.prepared.module
        self.cpu_backend = self.prepared.cpu_backend  # the CPU kernels, their plan and words
        self.linear_plan = self.prepared.linear_plan  # its LinearDispatch
        self.panels_reason = self.prepared.panels_reason  # "" where packed into panels
        self.gpu_kernels = self.prepared.gpu_kernels  # on CUDA: what runs
        if kv_plan.num_blocks is None:  # CUDA: the memory the weights left
            kv_plan = kv_plan.on_free(torch.cuda.mem_get_info(self.device)[0], config, mc)
        num_blocks, max_len = kv_plan.num_blocks, kv_plan.max_model_len
        self.max_model_len = max_len
        self.clock = time.monotonic

        # under a window every layer shares, blocks behind it go back to the pool
        self.kv = KVCacheManager(num_blocks, bs, config.enable_prefix_caching, mc.kv_window)
        self.max_num_batched_tokens = config.max_num_batched_tokens or (
            DEFAULT_CUDA_STEP_TOKENS if self.device.type == "cuda" else DEFAULT_CPU_STEP_TOKENS)
        self.scheduler = Scheduler(SchedulerConfig.of(
            self.max_num_batched_tokens, config.max_num_seqs, max_len, config.policy),
            self.kv, self.clock)
        # (a mixture of experts routes each step's tokens in Python on what the router chose:
        # no graph can replay that, so it runs eagerly; a sliding window shorter than the
        # context too: the graphs' padded tables hold whole contexts)
        windowed = mc.sliding_window is not None and mc.sliding_window < max_len
        graphs = ("cuda" if self.device.type == "cuda" and not config.enforce_eager
                  and mc.moe is None and not windowed else None)
        self.runner = ModelRunner(self.model, mc, num_blocks=num_blocks, block_size=bs,
                                  dtype=self.dtype, device=self.device, decode_graphs=graphs,
                                  max_model_len=max_len)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        # Speculative decoding (phasewise.engine.spec): who proposes drafts, the policy that
        # lets a step draft only at batch sizes where drafting has delivered more tokens per
        # second on this engine, and the counts.
        self.proposer = NgramProposer() if config.speculative == "ngram" else None
        self.speculator = (Speculator(self.proposer, config.num_speculative_tokens or 0,
                                      DraftPolicy()) if self.proposer is not None else None)
        self.spec_stats = SpecStats()
        self.requests: dict[str, Request] = {}
        # prompts, defaults, ids and grammars (phasewise.engine.request_builder)
        self.builder = RequestBuilder(self.tokenizer, mc.vocab_size, self.generation,
                                      self.requests, self.clock)
        self.output_processor = OutputProcessor(self.tokenizer)  # text and stop strings
        self.step_stats: deque[StepStats] = deque(maxlen=MAX_STEP_HISTORY)
        self._step_index = 0
        self.stalled = False  # the last step() found nothing it may run
        # P/D: the K/V this engine ships (prefill role) and receives (decode role).
        self.connector = PushConnector(self.runner, bs)
        self.remote = RemotePrefills(self.requests, self._register, self.scheduler, self.kv,
                                     self.connector, self.sampler, self.device,
                                     mc.vocab_size, lambda: self.grammars)
        # What each step should have cost (phasewise.engine.step_cost), built from the engine
        # as loaded: its dtype, device and CPU kernels decide the arithmetic a step runs in.
        self.cost_model: StepCoster = cost_model(self) if cost_model is not None else Unpriced()
        # What a step costs now, from the last steps' periods (admission by SLO)
        self.step_clock = StepClock()
        # a mixture of experts' sparse MLPs, whose routing each step's stats report
        self._sparse_layers = [layer.moe for layer in getattr(self.model, "layers", ())
                               if getattr(layer, "moe", None) is not None]
        # the layers' sliding windows that bind within the context, each with how many
        # layers have it (the others read the whole context), for the steps' K/V reads
        self._windows = Counter(w for w in (mc.window_of(i) for i in range(mc.num_layers))
                                if w is not None and w < max_len)
        self._num_layers = mc.num_layers

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids new requests stop at (``RequestBuilder``; may be replaced)."""
        return self.builder.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: tuple[int, ...]) -> None:
        self.builder.eos_token_ids = ids

    @property
    def draft_policy(self) -> DraftPolicy | None:
        """Speculative decoding's draft policy (None: every step drafts, or no speculation)."""
        return self.speculator.policy if self.speculator is not None else None

    @draft_policy.setter
    def draft_policy(self, policy: DraftPolicy | None) -> None:
        if self.speculator is not None:
            self.speculator.policy = policy

    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """Sampling defaults from ``generation_config.json``, then ``overrides``."""
        return self.generation.sampling_params(**overrides)

    # -- requests --------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None, *,
                    export_kv_from: int | None = None, resume: Sequence[int] = ()) -> str:
        """Queue a request; returns its id. Raises ValueError for input it can never serve.

        ``arrival_time`` (on ``self.clock``, ``time.monotonic``) defaults to now; a server
        passes the time the HTTP request arrived, so queue time and TTFT include the wait to
        reach the engine. Errors are ``phasewise.engine.validation.ValidationError`` (a
        ValueError naming the field at fault) or ValueError.

        ``export_kv_from`` (the prefill role): after every step that computes part of this
        request's prompt, hand the K/V of its blocks from this token index on (a multiple of
        block_size) to ``kv_sink`` as soon as the forward pass has written them; each block
        once, when it is full or holds the prompt's end. Under a sliding window every layer
        shares, from the block of the first key the decode side's first query reads, where
        that is later.

        ``resume``: the tokens another engine generated for this request and streamed before
        it went away (a router migrates the request here). They become the request's first
        outputs, computed here as a preempted request's are (one prefill of the prompt and
        them, its cached prefix taken from the pool); its text, stop strings, grammar,
        penalties, ``min_tokens``/``max_tokens`` and seeded draws go on from that position,
        and its outputs carry only what comes after them."""
        req = self.builder.build(prompt, params, request_id, arrival_time)
        if resume:
            self._resume(req, resume)
        if export_kv_from is not None:
            # under a sliding window the decode side reads only the blocks of its first
            # query's window (RemotePrefills.admit reserves those): none before them is sent
            behind = self.kv.dead_blocks(req.num_prompt_tokens) * self.kv.block_size
            self.connector.export(req.request_id, max(export_kv_from, behind))
        try:
            self.scheduler.add_request(req)  # raises if it can never fit
        except BaseException:
            self.connector.request_finished(req.request_id)
            raise
        self._register(req)
        if resume:
            self.output_processor.resume(req, len(resume))
            self.sampler.skip_draws(req, self.device, len(resume))
        return req.request_id

    def _resume(self, req: Request, tokens: Sequence[int]) -> None:
        """Give ``req`` the outputs ``tokens`` (see ``add_request``); ValueError (naming
        ``resume``) where they could not have been its outputs."""
        ids = check_token_ids(tokens, self.model_config.vocab_size, "resume")
        p = req.params
        if p.max_tokens is not None and len(ids) >= p.max_tokens:
            raise ValidationError(f"resume has {len(ids)} tokens but max_tokens is "
                                  f"{p.max_tokens}: the request had finished", "resume")
        if req.num_prompt_tokens + len(ids) >= self.scheduler.max_len:
            raise ValidationError(f"the prompt ({req.num_prompt_tokens} tokens) and resume "
                                  f"({len(ids)}) reach the context length "
                                  f"{self.scheduler.max_len}: the request had finished",
                                  "resume")
        held = masked_tokens(p, req.eos_token_ids, 0)  # while i < min_tokens
        for i, t in enumerate(ids):
            if i < p.min_tokens and t in held:
                raise ValidationError(f"resume token {i} ({t}) is one min_tokens holds back "
                                      "there: it could not have been drawn", "resume")
            if token_finish(p, req.eos_token_ids, t, i + 1, req.num_prompt_tokens + i + 1,
                            self.scheduler.max_len) is not None:
                raise ValidationError(f"resume token {i} ({t}) would have ended the request "
                                      "(an end-of-sequence or stop token)", "resume")
            if req.grammar is not None and not req.grammar.accept(t):
                raise ValidationError(f"resume token {t} is not one the request's structured "
                                      "output allows there", "resume")
            req.append_output(t)
        if req.grammar is not None and req.grammar.done:
            raise ValidationError("resume completes the request's structured output at its "
                                  "last token: the request had finished", "resume")
        stop = self.output_processor.stop_in(req, ids)
        if stop is not None:
            raise ValidationError(f"resume token {stop[0]} completes the stop string "
                                  f"{stop[1]!r}: the request had finished", "resume")
        if req.logprobs is not None:  # streamed already: what is sent from here has its own
            req.logprobs.extend({} for _ in ids)

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured output's compiler for this model's tokenizer and logits width."""
        return self.builder.grammars

    # -- admission by SLO (phasewise.engine.slo) ----------------------------------------------
    def slo_refusal(self, group: list[Request], slo: SLO) -> Refusal | None:
        """Whether ``group`` (just added, waiting together) would miss ``slo`` at the load
        ahead of it: the refusal, or None (also where the clock cannot say yet). A request
        whose prompt a prefill worker computes adds no prompt work here."""
        context = mean_context(self.scheduler, group)

        def predicted(prefill: int, rows: int) -> float | None:
            chunks = [Chunk(prefill, 0)] if prefill else []
            return self.cost_model.predict(chunks, [context] * rows).seconds

        return judge(slo, group_forecast(self.scheduler, self.kv, group,
                                         lambda p, d: self.step_clock.cost(p, d, predicted),
                                         self.step_clock.prompt_share(self.clock())))

    def _register(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.output_processor.add(req)

    # -- remote prefill (phasewise.engine.remote_prefill) ------------------------------------
    def add_remote_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                           request_id: str | None = None,
                           arrival_time: float | None = None) -> int | None:
        """Admit a request whose prompt a prefill worker computes. Returns the number of
        prompt tokens this engine's prefix cache already holds (the prefill worker sends K/V
        from there on), or None when there is no room now (add_request it instead)."""
        return self.remote.admit(self.builder.build(prompt, params, request_id, arrival_time))

    def load_remote_kv(self, request_id: str, first_token: int, data: torch.Tensor) -> None:
        """Write K/V sent by the prefill worker (``RemotePrefills.load``)."""
        self.remote.load(request_id, first_token, data)

    def remote_kv_complete(self, request_id: str) -> bool:
        """Whether every block of the request's prompt has arrived."""
        return self.remote.complete(request_id)

    def finish_remote_prefill(self, request_id: str, token: int,
                              logprobs: dict[int, float] | None = None) -> RequestOutput:
        """The prefill worker's first sampled token: the request joins the running ones (its
        next step is a decode). Returns its output for that token."""
        return self._emit(self.remote.finish(request_id, token, logprobs))

    def fail_remote_prefill(self, request_id: str) -> int:
        """The remote prefill will not finish: compute the rest of the prompt here. Returns
        the prompt tokens kept (their K/V arrived)."""
        return self.remote.fail(request_id)

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

    def park(self, request_ids: Sequence[str], parked: bool) -> None:
        """Hold (``parked``) or release these requests: a parked request runs no tokens
        and gives up its seat to a waiting request that needs one (``Request.parked``).
        Unknown or finished ids are ignored."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and not req.finished:
                req.parked = parked

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def _forget(self, req: Request) -> None:
        self.connector.request_finished(req.request_id)  # pushing never holds blocks
        if self.speculator is not None:
            self.speculator.release(req.request_id)
        self.requests.pop(req.request_id, None)
        self.output_processor.remove(req.request_id)
        self.sampler.release(req.request_id)

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.monotonic()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.scheduler.max_len)
        batch = self.scheduler.schedule()
        # Nothing could run and nothing changed (every seat held by requests waiting for
        # remote K/V): only a command can change that, so a caller may wait for one.
        self.stalled = not batch.requests and not batch.preempted
        if not batch.requests:
            return []
        chunks, decodes = batch.mix()  # before update() advances the counts
        cost = self.cost_model.predict(chunks, decodes)
        decode_s = (cost.seconds if not chunks or cost.seconds is None else 0.0
                    if not decodes else self.cost_model.predict([], decodes).seconds)
        riders = batch.riders()  # as mix(): before update()
        tables = [self.kv.block_table(r.request_id) for r in batch.requests]
        try:
            exports = (self.connector.step_exports(batch.requests, batch.num_tokens)
                       if self.connector.exporting else [])
            ran = self.runner.execute(batch, tables)
            if exports:
                self.connector.save(exports, {r.request_id: t
                                              for r, t in zip(batch.requests, tables)})
            # the grammars' budget: this step's forward time, on CUDA (whose kernels may
            # still run when the forward call returns) the last step's
            last = self.step_stats[-1].forward_s if self.step_stats else None
            tokens, failed = sample_step(
                self.sampler, ran, step_groups(batch.requests),
                None if self.device.type == "cpu" else (last or 0.0))
            verified = Speculator.verify(self.sampler, ran, tokens, failed)
            read = time.monotonic()
        except Exception as e:
            raise StepFailed([r.request_id for r in batch.requests], e) from e
        forward_s = self._forward_s(ran, read)
        got = self.scheduler.update(batch, tokens)

        outputs = []
        for req, error, code in failed:  # its own sampling failed: it ends here, no one else
            if not req.finished:
                self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
            out = self.output_processor.output(req)
            out.error, out.error_code = error, code
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
        if (self.speculator is not None and batch.num_decode_tokens
                and not batch.num_prefill_tokens):
            self.speculator.observe(bool(verified), len(batch.requests),
                                    sum(kept for _, kept in got), duration)
        stats = StepStats.of(
            self._step_index, start, duration, batch, riders, cost, self.scheduler,
            self.kv.usage, proposed, accepted, decode_s, forward_s, self._experts_read(),
            self._kv_read(decodes))
        self.step_stats.append(stats)
        self.step_clock.observe(stats)
        routing = getattr(self.cost_model, "observe_routing", None)
        if routing is not None and stats.experts_read is not None:  # a mixture of experts
            routing(stats.num_tokens, stats.experts_read)
        return outputs

    def _experts_read(self) -> float | None:
        """The distinct experts the last forward pass's tokens routed to, averaged over the
        sparse layers (each records its own, ``SparseMoE.last_experts``); None if dense."""
        sparse = self._sparse_layers
        if not sparse:
            return None
        return sum(m.last_experts for m in sparse) / len(sparse)

    def _kv_read(self, decodes: list[int]) -> tuple[int, float] | None:
        """Under sliding windows: the positions the step's decode rows held (``decodes``:
        each row's keys) and those whose K/V they read, averaged over the layers; None where
        every layer reads the whole context."""
        if not self._windows:
            return None
        held = sum(decodes)
        windowed = sum(self._windows.values())
        read = (self._num_layers - windowed) * held + sum(
            count * sum(min(k, w) for k in decodes) for w, count in self._windows.items())
        return held, read / self._num_layers

    def _forward_s(self, ran: RunnerOutput, read: float) -> float | None:
        """The wall time of the step's forward pass, without adding a synchronisation.

        On CPU the model's ops have finished when its call returns: the runner's own window
        (``RunnerOutput.forward_start`` to ``forward_end``). Elsewhere (CUDA) kernels run
        asynchronously and the step waits for them only where it first reads their results:
        sampling's ``.tolist()`` (or ``Speculator.verify``'s), which ``read`` follows. There
        the forward pass runs from its start to ``read``, so it includes what the step does
        before that read (a K/V export, prompt logprobs, sampling itself): an upper bound,
        and the host share a lower one. A step that samples nothing reads nothing, so its
        end is not seen (None); its kernels' tail then lands in the next step's window.
        Invariant (every stamp is ``time.monotonic`` inside the step's own window):
        0 <= forward_s <= duration_s."""
        if self.device.type == "cpu":
            return ran.forward_end - ran.forward_start
        return read - ran.forward_start if ran.requests else None

    def _emit(self, req: Request, new_tokens: int = 1) -> RequestOutput:
        """The output of a request that just got ``new_tokens`` tokens (more than one after
        a verify; stop strings: ``OutputProcessor.emit``), and the request forgotten if that
        finished it."""
        out = self.output_processor.emit(req, new_tokens, self.scheduler.finish_request)
        if req.finished:
            self._forget(req)
        return out

