"""Turn one step's logits into tokens, per request's ``SamplingParams``.

Order of operations on each row: penalties (repetition over prompt and outputs, presence and
frequency over outputs), the ``min_tokens`` mask on stop tokens, a structured output's grammar
mask (``phasewise.engine.structured``), then greedy argmax or
temperature -> top-k -> top-p -> min-p -> a draw. A request with a seed draws from its own
``torch.Generator``, kept here (a ``Request`` holds no tensors): created from
``params.seed`` on the request's first draw and dropped by ``release`` when the engine forgets
the request, so its tokens do not depend on what else is batched, survive preemption, and
resume on another engine at a token position (``skip_draws``: one draw a token) (except under
speculative decoding: a verify draws once per draft it checks, and how many drafts a step
leaves it depends on the batch).
Requests without a seed share the engine's generator. Each sampled row takes one uniform
number and draws by the inverse of its filtered distribution's running sum: on CPU in the
kernels (``cpu_kernels.sample_list``: each filter a threshold found by radix selection, no
sort), else in torch's operations (``_sample_torch``: ``torch.topk`` for the filters, a sort
only of rows whose nucleus spans more than an eighth of the vocabulary). ``_probs``, which
sorts every filtering row, is the reference the tests hold both to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from phasewise.engine.backend import GrammarFailed
from phasewise.engine.finish import masked_tokens
from phasewise.engine.request import Request
from phasewise.engine.spec import inverse_cdf, verify_greedy, verify_sampled

if TYPE_CHECKING:
    from phasewise.engine.model_runner import RunnerOutput

# A request whose own sampling failed this step: it, the message, and its error code
# (None, or GrammarFailed.code where its grammar is at fault).
Failure = tuple[Request, str, "str | None"]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: the first maximum, a NaN counting as the maximum (as
    ``Tensor.argmax``). On CPU the kernels' one-pass argmax (``cpu_kernels.argmax_rows``);
    else ``torch.max(dim).indices``, which matched ``argmax`` in 3,000 random cases with
    ties, NaNs and infinities and took a third of its time over [32, 32000] fp32 on a 2-core
    CPU (0.23 against 0.70 ms). Inside an engine step at batch 32 of the reference
    checkpoint, torch's ``max`` took 0.54 ms, the kernel 0.34 ms (2-core AMX Xeon; alone,
    0.26 against 0.09 ms)."""
    if logits.device.type == "cpu":
        from phasewise.model.cpu.kernels import argmax_rows

        picked = argmax_rows(logits)
        if picked is not None:
            return picked
    return torch.max(logits, dim=-1).indices


def greedy_token_list(logits: torch.Tensor) -> list[int]:
    """``greedy_tokens(logits).tolist()``; on CPU straight from the kernels' argmax into a
    list (``cpu_kernels.argmax_list``), no tensor between: a decode step's host work runs
    on caches the weights' stream has just flushed, where each torch call costs tens of
    microseconds."""
    if logits.device.type == "cpu":
        from phasewise.model.cpu.kernels import argmax_list

        picked = argmax_list(logits)
        if picked is not None:
            return picked
    return greedy_tokens(logits).tolist()


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token_id: logprob} for the top-N and the sampled token, or None.
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # for requests without a seed
        self._seeded: dict[str, torch.Generator] = {}  # request id -> its own generator

    def release(self, request_id: str) -> None:
        """Drop a request's generator (the engine calls this when it forgets the request)."""
        self._seeded.pop(request_id, None)

    def skip_draw(self, req: Request, device: torch.device) -> None:
        """Advance a seeded request's generator past one draw made elsewhere (a prefill
        worker sampled its first token), so its later tokens are those it would have drawn
        here."""
        if req.params.seed is not None and not req.params.greedy:
            torch.rand(1, device=device, generator=self._generator(req, device))

    def skip_draws(self, req: Request, device: torch.device, n: int) -> None:
        """Advance a seeded request's generator past ``n`` draws, as if it had sampled its
        first ``n`` tokens here (a request resumed from another engine, with the tokens it
        streamed there): its next token is the one that engine would have drawn. One draw a
        token, as ``_uniforms`` takes. On CPU, ``torch.rand(n)`` advances the generator as
        ``n`` calls of ``torch.rand(1)`` do (a test holds it to that); elsewhere (CUDA's
        counter-based generator advances by a stride a call) one call a draw."""
        if req.params.seed is None or req.params.greedy or n <= 0:
            return
        gen = self._generator(req, device)
        if device.type == "cpu":
            torch.rand(n, device=device, generator=gen)
            return
        for _ in range(n):
            torch.rand(1, device=device, generator=gen)

    def _generator(self, req: Request, device: torch.device) -> torch.Generator:
        seed = req.params.seed
        if seed is None:
            return self.generator
        gen = self._seeded.get(req.request_id)
        if gen is None:
            gen = self._seeded[req.request_id] = torch.Generator(device=device).manual_seed(seed)
        return gen

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: [num_requests, vocab] fp32, one row per request, in order."""
        raw = logits  # logprobs are those of the model's logits, before any penalty
        penalized = self._apply_penalties(logits, requests)
        logits = self._apply_grammars(penalized, requests, copied=penalized is not logits)

        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        rand = [i for i, r in enumerate(requests) if not r.params.greedy]
        if len(greedy) == len(requests):  # all greedy: no gather of the rows (4 MB at b32)
            token_list = greedy_token_list(logits)
        else:
            token_list = [0] * len(requests)
            dev = logits.device
            if greedy:
                picked = greedy_token_list(logits[torch.tensor(greedy, device=dev)])
                for i, t in zip(greedy, picked):
                    token_list[i] = t
            rows = logits if not greedy else logits[torch.tensor(rand, device=dev)]
            for i, t in zip(rand, self._sample_rows([requests[i] for i in rand], rows)):
                token_list[i] = t

        return SamplerOutput(token_list, self._logprobs(raw, requests, token_list))

    @staticmethod
    def _logprobs(logits: torch.Tensor, requests: list[Request], tokens: list[int], *,
                  kernels: bool = True) -> list[dict[int, float] | None]:
        """Each asking row's {token: log-prob} for its sampled token and its top N: on CPU
        in the kernels (``logprob_entries``: one exp pass and one insertion pass a row),
        where they load and ``kernels`` is left on, else by torch's log-softmax."""
        out: list[dict[int, float] | None] = [None] * len(requests)
        rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if not rows:
            return out
        if kernels and logits.device.type == "cpu":
            from phasewise.model.cpu.kernels import logprob_entries

            got = logprob_entries(logits, rows, [tokens[i] for i in rows],
                                  [requests[i].params.logprobs for i in rows])
            if got is not None:
                for i, entry in zip(rows, got):
                    out[i] = entry
                return out
        raw = torch.log_softmax(logits, dim=-1)
        for i in rows:
            out[i] = _logprob_entry(raw[i], tokens[i], requests[i].params.logprobs)
        return out

    def verify(self, logits: torch.Tensor, req: Request) -> tuple[SamplerOutput, int]:
        """Speculative decoding: ``logits`` ([1 + drafts, vocab] fp32) are the rows of a
        request that verified ``req.spec_token_ids``; returns the tokens to emit (the
        accepted drafts and one more, see ``phasewise.engine.spec``) with their logprobs,
        and how many drafts were accepted. The engine gives drafts only to requests this
        sampler needs no per-token history for (no penalties, min_tokens reached)."""
        drafts = req.spec_token_ids
        if req.params.greedy:
            tokens, accepted = verify_greedy(logits, drafts)
        else:
            probs = self._vocab_probs([req] * logits.shape[0], logits)
            tokens, accepted = verify_sampled(probs, drafts, self._generator(req, logits.device))
        logprobs: list[dict[int, float] | None] = [None] * len(tokens)
        n = req.params.logprobs
        if n is not None:
            raw = torch.log_softmax(logits[:len(tokens)], dim=-1)
            logprobs = [_logprob_entry(raw[j], t, n) for j, t in enumerate(tokens)]
        return SamplerOutput(tokens, logprobs), accepted

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, requests: list[Request], *,
                         kernels: bool = True) -> torch.Tensor:
        """Repetition, presence and frequency penalties and the ``min_tokens`` mask, on a
        copy of ``logits``: the penalties on CPU in the kernels (``apply_penalties``: a
        token at a time), where they load and ``kernels`` is left on, else in torch."""
        needs = [i for i, r in enumerate(requests)
                 if r.params.needs_penalties or r.num_output_tokens < r.params.min_tokens]
        if not needs:
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        dev = logits.device
        pen = [i for i in needs if requests[i].params.needs_penalties]
        done = False
        if pen and kernels and dev.type == "cpu":
            from phasewise.model.cpu.kernels import apply_penalties

            rs = [requests[i] for i in pen]
            done = apply_penalties(
                logits, pen, [r.all_token_ids for r in rs], [r.num_prompt_tokens for r in rs],
                [r.params.repetition_penalty for r in rs], [r.params.presence_penalty for r in rs],
                [r.params.frequency_penalty for r in rs])
        for i in needs:
            r, p = requests[i], requests[i].params
            row = logits[i]
            if not done and p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.all_token_ids)), dtype=torch.long, device=dev)
                seen = seen[seen < vocab]
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                        vals * p.repetition_penalty)
            if not done and (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
                out = torch.tensor(r.output_token_ids, dtype=torch.long, device=dev)
                counts = torch.bincount(out[out < vocab], minlength=vocab).to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
            ids = [t for t in masked_tokens(p, r.eos_token_ids, r.num_output_tokens)
                   if t < vocab]
            if ids:
                row[torch.tensor(ids, device=dev)] = float("-inf")
        return logits

    @staticmethod
    def _apply_grammars(logits: torch.Tensor, requests: list[Request], *,
                        copied: bool) -> torch.Tensor:
        """Structured output: -inf for every token a request's grammar does not allow next
        (on a copy, unless ``logits`` already is one)."""
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return logits
        if not copied:
            logits = logits.clone()
        for i in rows:
            requests[i].grammar.apply(logits[i])
        return logits

    def _sample_rows(self, requests: list[Request], logits: torch.Tensor) -> list[int]:
        """One draw per row from its filtered distribution (the one ``_probs`` gives) at one
        uniform number a row (``_uniforms``): on CPU by the kernels' ``sample_list`` (radix
        selection: no sort, no ``topk``), else, or where the kernels decline a row, by
        ``_sample_torch``."""
        u = self._uniforms(requests, logits.device)
        if logits.device.type == "cpu":
            from phasewise.model.cpu.kernels import sample_list

            vocab = logits.shape[-1]
            picked = sample_list(
                logits, [r.params.temperature for r in requests],
                [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in requests],
                _nucleus([r.params.top_p for r in requests]),
                [r.params.min_p for r in requests], u.tolist())
            if picked is not None:
                left = [i for i, t in enumerate(picked) if t < 0]  # nothing to draw there
                if left:
                    idx = torch.tensor(left)
                    redo = self._sample_torch([requests[i] for i in left], logits[idx], u[idx])
                    for i, t in zip(left, redo):
                        picked[i] = t
                return picked
        return self._sample_torch(requests, logits, u)

    def _uniforms(self, requests: list[Request], device: torch.device) -> torch.Tensor:
        """One uniform number in [0, 1) a row, on ``device``: from each row's own generator
        where it has a seed (so its draws do not depend on the batch), else from the shared
        one in one call."""
        shared = [i for i, r in enumerate(requests) if r.params.seed is None]
        if len(shared) == len(requests):
            return torch.rand(len(shared), device=device, generator=self.generator)
        u = torch.empty(len(requests), device=device)
        if shared:
            u[torch.tensor(shared, device=device)] = torch.rand(
                len(shared), device=device, generator=self.generator)
        for i, r in enumerate(requests):
            if r.params.seed is not None:
                u[i] = torch.rand(1, device=device, generator=self._generator(r, device))[0]
        return u

    def _sample_torch(self, requests: list[Request], logits: torch.Tensor,
                      u: torch.Tensor) -> list[int]:
        """``_sample_rows`` in torch's operations: the filter of ``_candidates``, then the
        inverse of each row's running sum at its ``u``, in vocabulary order as the kernel
        draws (so a row's token at a given ``u`` depends neither on the path nor on whether
        other rows of the batch filter). A row with nothing to draw (its logits all -inf, or
        +inf: no finite distribution) takes its argmax."""
        probs = self._vocab_probs(requests, logits)
        total = probs.sum(dim=-1)
        ok = torch.isfinite(total) & (total > 0)
        if bool(ok.all()):
            return inverse_cdf(probs, u).tolist()
        picked = inverse_cdf(torch.where(ok[:, None], probs, 1.0), u)
        return torch.where(ok, picked, greedy_tokens(logits)).tolist()

    @classmethod
    def _vocab_probs(cls, requests: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """``_candidates``' distribution in its places over the whole vocabulary, [n,
        vocab]. Added, not written: a row that finished in an earlier, narrower pass is
        padded with id 0 at probability 0, which a plain scatter could write over token 0's
        own probability (on CUDA in any order). Rows that filter by rank and rows that do
        not go separately: beside filtering rows, an unfiltered one would widen to a sort of
        its whole row."""
        vocab = logits.shape[-1]
        plain = [i for i, r in enumerate(requests)
                 if not 0 < r.params.top_k < vocab and r.params.top_p >= 1.0]
        if 0 < len(plain) < len(requests):
            out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
            ranked = sorted(set(range(len(requests))) - set(plain))
            for part in (plain, ranked):
                idx = torch.tensor(part, device=logits.device)
                out[idx] = cls._vocab_probs([requests[i] for i in part], logits[idx])
            return out
        cand, probs = cls._candidates(requests, logits)
        if cand is None:
            return probs
        return torch.zeros(logits.shape, dtype=probs.dtype,
                           device=logits.device).scatter_add_(1, cand, probs)

    @staticmethod
    def _candidates(requests: list[Request], logits: torch.Tensor
                    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``_probs``'s filtered distribution without sorting the vocabulary: (token ids,
        their probabilities), [n, K] each, zero past a row's kept tokens; ``None`` for the
        ids where no row filters by rank (then the probabilities are over the whole
        vocabulary, K = vocab). A row's top-k and top-p keep a prefix of its tokens in
        descending order, so only that prefix is needed: the largest ``K`` logits come from
        ``topk`` (where a full sort of 32,000 logits took 1.7 ms a row and ``topk`` of 64
        0.035 ms, 2-core EPYC), at first 64 (or the largest top_k), then, for rows whose
        nucleus is wider, four times a lower bound on its size (at least 1024): the tokens
        past the first K each hold at most the K-th's probability, so at least (top_p - mass
        of the K) / (the K-th's probability) more are needed; past an eighth of the
        vocabulary, a sort of the row (a flat distribution: as slow as the sort it
        replaced). ``topk`` runs on the raw logits (a temperature keeps their order), only
        the chosen ones are divided by it, and the whole row's normaliser is computed only
        for rows without top-k. Probabilities are those of ``_probs`` up to
        fp32 rounding."""
        dev = logits.device
        n, vocab = logits.shape
        temps = torch.tensor([r.params.temperature for r in requests], device=dev)
        top_ks = [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in requests]
        top_ps = [r.params.top_p for r in requests]
        min_ps = [r.params.min_p for r in requests]
        if not any(top_ks) and all(p >= 1.0 for p in top_ps):
            probs = torch.softmax(logits / temps[:, None], dim=-1)
            cand = None
        else:
            width = min(vocab, max([64] + top_ks))
            k = torch.tensor([k if k else vocab for k in top_ks], device=dev)
            p = torch.tensor(_nucleus(top_ps), device=dev)
            # the normaliser of rows without top-k: the whole row's
            lse = torch.zeros(n, device=dev)
            whole = [i for i, kk in enumerate(top_ks) if not kk]
            if whole:
                idx = torch.tensor(whole, device=dev)
                rows_logits = logits if len(whole) == n else logits[idx]
                lse[idx] = torch.logsumexp(rows_logits / temps[idx, None], dim=-1)
            rows = torch.arange(n, device=dev)
            parts = []  # (rows, ids, probs) of the rows each widening finished
            while len(rows):
                src = logits if len(rows) == n else logits[rows]
                if width == vocab:  # the whole row: a sort is the faster way there
                    vals, ids = src.sort(dim=-1, descending=True)
                else:
                    vals, ids = torch.topk(src, width, dim=-1)
                vals = vals.float() / temps[rows, None]
                ranks = torch.arange(width, device=dev)[None, :]
                vals = vals.masked_fill(ranks >= k[rows, None], float("-inf"))
                norm = torch.where(k[rows] < vocab, torch.logsumexp(vals, dim=-1), lse[rows])
                sorted_probs = torch.exp(vals - norm[:, None])
                cum = sorted_probs.cumsum(dim=-1)
                # Keep the smallest prefix whose mass reaches top_p (the top token stays).
                drop = (cum - sorted_probs) >= p[rows, None]
                drop[:, 0] = False
                done = (k[rows] <= width) | (cum[:, -1] >= p[rows]) | (width == vocab)
                kept = vals.masked_fill(drop, float("-inf"))
                if bool(done.all()):
                    parts.append((rows, ids, torch.softmax(kept, dim=-1)))
                    break
                parts.append((rows[done], ids[done], torch.softmax(kept[done], dim=-1)))
                left = ~done
                more = (p[rows][left] - cum[left, -1]) / sorted_probs[left, -1]
                need = float(more.max()) if bool(torch.isfinite(more).all()) else vocab
                width = max(1024, 4 * (width + int(need) + 1))
                # past an eighth of the vocabulary, topk costs much of a sort of the row
                width = vocab if width >= vocab // 8 else width
                rows = rows[left]
            if len(parts) == 1:  # every row finished in one pass, in order
                _, cand, probs = parts[0]
            else:
                width = max(ids.shape[1] for _, ids, _ in parts)
                cand = torch.zeros((n, width), dtype=torch.long, device=dev)
                probs = torch.zeros((n, width), dtype=torch.float32, device=dev)
                for done_rows, ids, pr in parts:
                    cand[done_rows, :ids.shape[1]] = ids
                    probs[done_rows, :ids.shape[1]] = pr
        if any(min_ps):
            mp = torch.tensor(min_ps, device=dev)
            keep = probs >= mp[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs * keep
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return cand, probs

    @staticmethod
    def _probs(requests: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """Filtered distribution ([n, vocab]) for the non-greedy rows, by a sort of the
        whole vocabulary: the reference ``_candidates`` is tested against (and
        ``bench_sampler.py``'s yardstick)."""
        dev = logits.device
        temps = torch.tensor([r.params.temperature for r in requests], device=dev)
        logits = logits / temps[:, None]
        top_ks = [r.params.top_k if r.params.top_k > 0 else 0 for r in requests]
        top_ps = [r.params.top_p for r in requests]
        if any(top_ks) or any(p < 1.0 for p in top_ps):
            vocab = logits.shape[-1]
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            k = torch.tensor([k if k else vocab for k in top_ks], device=dev)
            ranks = torch.arange(vocab, device=dev)[None, :]
            sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            p = torch.tensor(_nucleus(top_ps), device=dev)
            drop = mass_before >= p[:, None]
            drop[:, 0] = False  # the top token stays, even when top_p rounds to 0 in fp32
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        probs = torch.softmax(logits, dim=-1)
        min_ps = [r.params.min_p for r in requests]
        if any(min_ps):
            mp = torch.tensor(min_ps, device=dev)
            keep = probs >= mp[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs * keep
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs


# The masks of one step's grammars together may take as long as its forward pass (at least
# this floor), where the step holds other clients' requests: a grammar may slow the steps
# it shares at most twofold. Past it, the requests whose one mask took HEAVY_MASK_S or more
# are ended, costliest first, until the rest fit. A typical grammar's mask takes tens of
# microseconds, so only grammars far off the common case are ever ended.
GRAMMAR_STEP_FLOOR_S = 0.005
HEAVY_MASK_S = 0.001


def step_groups(requests: list[Request]) -> int:
    """The client requests a step holds: its requests' groups, those without one (the
    offline API's, whose caller is one) counting as one."""
    return len({r.group for r in requests})


def grammars_over_budget(requests: list[Request], budget_s: float,
                         groups: int) -> dict[str, str]:
    """The requests whose grammar to end this step (request id -> why): where this step's
    masks took longer than ``budget_s`` together and the step holds ``groups`` client
    requests, more than one (every scheduled request counts: prompt chunks that sample
    nothing wait for the masks too), the costliest masks of ``HEAVY_MASK_S`` or more, until
    the rest fit."""
    costs = sorted(((r.grammar.last_fill_s, r) for r in requests if r.grammar is not None),
                   key=lambda c: -c[0])
    total = sum(c for c, _ in costs)
    if total <= budget_s or groups < 2:
        return {}
    ended, step_total = {}, total
    for cost, req in costs:
        if total <= budget_s or cost < HEAVY_MASK_S:
            break
        ended[req.request_id] = (
            f"its structured output's grammar took {cost * 1e3:.1f} ms of CPU time for one "
            f"token's mask, and this step's grammars {step_total * 1e3:.0f} ms together, "
            f"longer than the step's forward pass ({budget_s * 1e3:.0f} ms) that other "
            "requests share: a grammar may at most double their steps; simplify it")
        total -= cost
    return ended


def sample_step(sampler: Sampler, ran: RunnerOutput, groups: int = 1,
                forward_s: float | None = None
                ) -> tuple[dict[str, list[int]], list[Failure]]:
    """Tokens for the requests of a step that sample one token (and their logprobs, recorded
    on the requests); the rows of verifying requests (``Request.spec_token_ids``) are left
    to ``Speculator.verify``.

    If sampling the batch raises, each row is sampled alone to find the requests whose
    own settings fail: those come back in the second list, with the error, and the rest
    of the step goes on. If every row fails alone too, the fault is not one request's,
    and the original error is raised. A request whose grammar gives up or refuses the
    token, or whose masks take too long (``Matcher.too_slow``, ``grammars_over_budget``:
    ``groups``, the client requests the step holds; ``forward_s``, the step's forward time
    where ``ran``'s window does not hold it, on CUDA), fails with ``GrammarFailed.code``."""
    plain = [(req, row) for req, row, n in ran.spans() if n == 1]
    if not plain:
        return {}, []
    requests = [req for req, _ in plain]
    logits = (ran.logits if len(plain) == ran.logits.shape[0]
              else ran.logits[[row for _, row in plain]])
    try:
        sampled = sampler(logits, requests)
        rows = list(zip(requests, sampled.token_ids, sampled.logprobs))
        failed: list[Failure] = []
    except Exception as batch_error:
        rows, failed = [], []
        for i, req in enumerate(requests):
            try:
                one = sampler(logits[i:i + 1], [req])
            except Exception as e:  # noqa: BLE001 - reported on that request only
                failed.append((req, f"sampling failed for this request: "
                                    f"{type(e).__name__}: {e}", None))
                continue
            rows.append((req, one.token_ids[0], one.logprobs[0]))
        if not rows:
            raise batch_error
    tokens = {}
    if forward_s is None:
        forward_s = ran.forward_end - ran.forward_start
    heavy = grammars_over_budget([req for req, _, _ in rows],
                                 max(GRAMMAR_STEP_FLOOR_S, forward_s), groups)
    for req, tok, lp in rows:
        slow = req.grammar.too_slow if req.grammar is not None else None
        slow = heavy.get(req.request_id, slow)
        if slow is not None:
            failed.append((req, slow, GrammarFailed.code))
            continue
        broken = req.grammar.error if req.grammar is not None else None
        if broken is not None:  # its mask failed: what it allowed means nothing
            n = req.num_output_tokens
            where = "cannot start" if n == 0 else f"failed at output token {n}"
            failed.append((req, f"structured output: the grammar {where}: {broken}",
                           GrammarFailed.code))
            continue
        if req.grammar is not None and not req.grammar.accept(tok):
            failed.append((req, refusal(req, tok), GrammarFailed.code))
            continue
        tokens[req.request_id] = [tok]
        if req.logprobs is not None and lp is not None:
            req.logprobs.append(lp)
    return tokens, failed


def refusal(req: Request, tok: int) -> str:
    """Why a request's grammar refused its sampled token, in the client's terms: where it
    happened, and the usual cause, a grammar that allows only tokens the request's other
    settings forbid there (``min_tokens`` holds back end of sequence and ``stop_token_ids``)."""
    n = req.num_output_tokens
    p = req.params
    err = " ".join((req.grammar.error or "").replace("<non-verbose/>", "").split())
    why = ""
    if p.min_tokens and n < p.min_tokens:
        stops = f" and stop_token_ids {list(p.stop_token_ids)}" if p.stop_token_ids else ""
        why = (f"; until output token {p.min_tokens}, min_tokens forbids end of sequence"
               f"{stops}, and the grammar may allow only those here: lower min_tokens or "
               "change the grammar")
    return (f"structured output: the grammar refused output token {n} (id {tok}){why} "
            f"({err or 'the grammar gave no reason'})")


def _nucleus(top_ps: list[float]) -> list[float]:
    """Each row's top-p threshold, where a top_p of 1 drops nothing: a row's fp32 running
    mass can round to 1 before its last tokens, which ``mass >= 1`` would drop."""
    return [p if p < 1.0 else float("inf") for p in top_ps]


def _logprob_entry(row: torch.Tensor, token: int, n: int) -> dict[int, float]:
    """{token_id: logprob} for the sampled token and the row's top ``n``."""
    entry = {token: float(row[token])}
    if n:
        top = torch.topk(row, min(n, row.shape[-1]))  # a vocabulary smaller than n: all
        entry.update(zip(top.indices.tolist(), top.values.tolist()))
    return entry
