"""Offline API: ``LLM(path).generate(...)`` and ``LLM(path).stream(...)``."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from phasewise.config import EngineConfig, resolve_model
from phasewise.engine.engine import LLMEngine
from phasewise.engine.outputs import RequestOutput, StepStats
from phasewise.engine.sampling_params import SamplingParams
from phasewise.perf.attribution import StepCostModel
from phasewise.perf.models import catalog_name

Prompt = str | list[int]


class LLM:
    """Load a Hugging Face checkpoint folder and generate from it (no folder: the bundled
    default model, ``stdlib-coder``).

    Keyword arguments are ``EngineConfig`` fields (``dtype``, ``max_model_len``,
    ``kv_cache_memory``, ``max_num_batched_tokens``, ``policy``, ...). Every step is priced
    on the roofline (``StepStats.predicted_*``, ``phasewise.perf.attribution``).
    """

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        config = EngineConfig(model=resolve_model(model, catalog=catalog_name), **engine_kwargs)
        self.engine = LLMEngine(config, cost_model=StepCostModel.for_engine)

    @property
    def tokenizer(self):  # noqa: ANN201 - phasewise.model.tokenizer.Tokenizer
        return self.engine.tokenizer

    @property
    def step_stats(self) -> list[StepStats]:
        return list(self.engine.step_stats)

    def warm_up(self) -> None:
        """Run one short greedy request, so that one-time costs (buffers, the first calls of
        each kernel) stay out of the next requests' timings, as ``phasewise generate`` does
        before its prompt."""
        from phasewise.generate import warm_up

        warm_up(self)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion (continuously batched); outputs in input order.

        ``prompts``: a string, a list of token ids, or a list of either.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        try:
            prompts = list(prompts)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"prompts must be a string, a list of token ids, or a list of "
                            f"either; got {type(prompts).__name__}") from None
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        else:
            raise TypeError(f"sampling_params must be a SamplingParams, a list of them (one a "
                            f"prompt) or None; got {type(sampling_params).__name__}")
        engine = self.engine
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(engine.add_request(prompt, p))
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        start, last_report = time.monotonic(), 0.0
        while len(final) < len(ids) and engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
            if progress and time.monotonic() - last_report > 1.0:
                last_report = time.monotonic()
                print(f"\rgenerate: {len(final)}/{len(ids)} done, "
                      f"{time.monotonic() - start:.1f}s", end="", file=sys.stderr, flush=True)
        if progress:
            print(f"\rgenerate: {len(final)}/{len(ids)} done, "
                  f"{time.monotonic() - start:.1f}s", file=sys.stderr, flush=True)
        return [final[rid] for rid in ids]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None
               ) -> Iterator[RequestOutput]:
        """Yield this request's output after every step that gave it a token.

        Other queued requests keep being served by the same steps. Closing the iterator early
        aborts the request and frees its KV blocks.
        """
        engine = self.engine
        rid = engine.add_request(prompt, sampling_params)
        done = False
        try:
            while not done and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id == rid:
                        done = out.finished
                        yield out
        finally:
            if not done:
                engine.abort_request(rid)
