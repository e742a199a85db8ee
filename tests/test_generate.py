"""``phasewise generate``'s speculative decoding lines (``phasewise.generate``), from
synthetic step records: no model, no timing."""

from __future__ import annotations

import io
import random
import re
import statistics

from phasewise.engine.outputs import StepStats
from phasewise.engine.spec import DraftPolicy
from phasewise.generate import policy_line, speculation_lines


def step(ms: float, drafts: int = 0, accepted: int = 0, prefill: int = 0,
         requests: int = 1) -> StepStats:
    rows = 0 if prefill else requests + drafts
    return StepStats(index=0, start_time=0.0, duration_s=ms / 1e3, num_prefill_tokens=prefill,
                     num_decode_tokens=rows, num_requests=requests, num_running=1,
                     num_waiting=0, kv_usage=0.0, num_preempted=0,
                     num_spec_proposed=drafts, num_spec_accepted=accepted)


def observe(policy: DraftPolicy, steps: list[StepStats]) -> None:
    """What the engine tells the policy about its decode-only steps."""
    for s in steps:
        if s.num_decode_tokens and not s.num_prefill_tokens:
            policy.observe_step(bool(s.num_spec_proposed), s.num_requests,
                                s.num_requests + s.num_spec_accepted, s.duration_s)


def report(run: list[StepStats], policy: DraftPolicy | None = None) -> tuple[str, int]:
    decoded = sum(s.num_requests + s.num_spec_accepted for s in run
                  if s.num_decode_tokens and not s.num_prefill_tokens)
    err = io.StringIO()
    speculation_lines(run, decoded, err, policy)
    return err.getvalue(), decoded


def figures(text: str) -> list[float]:
    """Every speedup ("x2.10") the lines print."""
    return [float(v) for v in re.findall(r"\bx(\d+(?:\.\d+)?)\b", text)]


def bound(run: list[StepStats]) -> tuple[float, float]:
    """(tokens per weight read, that x the median plain step / the mean decode step, each
    step at the median of its kind: plain or with drafts)."""
    dec = [s for s in run if s.num_decode_tokens and not s.num_prefill_tokens]
    per_read = sum(1 + s.num_spec_accepted for s in dec) / len(dec)
    plain = statistics.median(s.duration_s for s in dec if not s.num_spec_proposed)
    drafted = [s.duration_s for s in dec if s.num_spec_proposed]
    typical = [statistics.median(drafted) if s.num_spec_proposed else plain for s in dec]
    return per_read, per_read * plain / statistics.mean(typical)


def seen_run() -> tuple[list[StepStats], list[StepStats]]:
    """Like the run that printed "x3.61" beside "2.10 tokens per weight read": generate's warm-up
    (a cold plain decode step of 2.49 ms), then the prompt, plain steps of about 1 ms, and
    steps verifying 4 drafts in about 1.35 ms, the last eight keeping all four."""
    warm = [step(4.97, prefill=3), step(2.49)]
    run = [step(3.96, prefill=36)]
    pattern = [(4, 0), (1, 0), (0, 0), (4, 4), (0, 0), (0, 0), (0, 0), (0, 0), (0, 0),
               (4, 0), (0, 0), (0, 0), (0, 0), (4, 0), (0, 0), (4, 0), (4, 1), (0, 0),
               (0, 0), (0, 0), (4, 0), (4, 4), (4, 4), (4, 4), (4, 4), (4, 4), (4, 4),
               (4, 4), (4, 4)]
    for drafts, kept in pattern:
        run.append(step(1.35 if drafts else 1.0, drafts, kept))
    return warm, run


def test_printed_speedup_never_exceeds_tokens_per_weight_read():
    warm, run = seen_run()
    policy = DraftPolicy()
    observe(policy, warm + run)  # the policy lives as long as the engine: warm-up included
    text, decoded = report(run, policy)
    per_read, limit = bound(run)
    assert f"{decoded / 29:.2f} tokens per weight read" in text
    assert figures(text), text
    for x in figures(text):
        assert x <= min(per_read, limit) + 0.005, text
    # measured against this run's own plain steps, and the line says so
    speed = sum(1 + s.num_spec_accepted for s in run[1:]) * 1.0 / sum(
        s.duration_s * 1e3 for s in run[1:])
    assert f"speedup over plain decode: x{speed:.2f} (" in text
    n_plain = sum(not s.num_spec_proposed for s in run[1:])
    assert (f"medians of this run's {n_plain} plain and {29 - n_plain} drafting decode steps "
            "at batch 1, so that a stall of the machine is not counted") in text
    # the policy's own running estimate (x3.6 here) is not printed as a speedup
    assert policy.speedup(1) > per_read
    line = next(ln for ln in text.splitlines() if "by decoding batch" in ln)
    assert line == ("[speculative] draft policy by decoding batch: 1: drafts (decided on its "
                    "running estimate over recent drafting steps)")


def test_speedup_without_a_plain_step_is_not_a_bare_number():
    run = [step(4.0, prefill=10)] + [step(1.4, 4, k) for k in (4, 2, 0, 3)]
    text, _ = report(run)
    assert ("speedup over plain decode: not measured (no decode step of this run went "
            "without drafts, so there is nothing to compare with); at most x3.25, the tokens "
            "per weight read, if a step with drafts costs at least what a plain one does"
            ) in text
    # plain steps at another batch size than the drafting ones do not stand in for them
    text, _ = report([step(1.0, requests=2), step(1.4, 4, 4)])
    assert "not measured (no plain decode step of this run at batch 1" in text


def test_speedup_from_noisy_timings_says_so():
    # the steps with drafts ran faster than the plain ones: noise, not a speedup
    run = [step(1.0), step(3.0), step(2.0), step(0.9, 4, 1), step(0.9, 4, 1)]
    text, _ = report(run)
    assert ("speedup over plain decode: at most x1.40, the tokens per weight read; measured "
            "x1.79, but its steps with drafts took less than its plain ones, so the timings "
            "are noisy (7 tokens in 5 decode steps, 2 with drafts: 7.8 ms at each kind's "
            "median step time, where plain steps of 2.00 ms would take 14.0 ms; medians of "
            "this run's 3 plain and 2 drafting decode steps at batch 1") in text
    # two plain steps: a figure, said to be rough
    text, _ = report([step(1.0), step(1.0), step(1.5, 4, 3)])
    assert "speedup over plain decode: x1.71 (" in text and "rough: 2 plain steps only" in text


def test_a_stall_of_the_machine_is_not_counted_as_speculations():
    """58 plain steps and 5 with drafts, two plain steps stalled 20 ms by other work: the
    figure stays near 1 (few steps drafted), not the x0.07 a mean over the stalls gave."""
    run = [step(4.0, prefill=8)] + [step(1.5) for _ in range(56)] + [step(21.5), step(20.0)]
    run += [step(1.7, 4, 2) for _ in range(5)]
    text, _ = report(run)
    x = figures(text.split("speedup over plain decode: ")[1])[0]
    assert 1.0 < x < 1.3, text


def test_speedup_invariant_over_random_runs():
    rng = random.Random(7)
    for _ in range(300):
        plain_ms = rng.uniform(0.5, 3.0)
        run = [step(rng.uniform(1, 10), prefill=rng.randint(1, 64))]
        for _ in range(rng.randint(1, 40)):
            if rng.random() < 0.5:
                run.append(step(plain_ms * rng.uniform(0.7, 1.6)))
            else:
                drafts = rng.randint(1, 5)
                run.append(step(plain_ms * rng.uniform(0.7, 2.0), drafts,
                                rng.randint(0, drafts)))
        policy = DraftPolicy()
        observe(policy, [step(plain_ms * rng.uniform(1, 5))] + run)
        text, _ = report(run, policy)
        dec = run[1:]
        per_read = sum(1 + s.num_spec_accepted for s in dec) / len(dec)
        limit = per_read
        if any(not s.num_spec_proposed for s in dec):
            limit = min(per_read, bound(run)[1])
        for x in figures(text):
            assert x <= limit + 0.005 or f"measured x{x:.2f}" in text, text


def test_policy_line_keeps_decisions_and_drops_the_estimate():
    assert policy_line("drafting / plain speed by decoding batch: 1: x2.04, drafts; 2-3: "
                       "measuring; 4-7: x0.80, no drafts") == (
        "draft policy by decoding batch: 1: drafts; 2-3: measuring; 4-7: no drafts (decided "
        "on its running estimate over recent drafting steps)")
    assert policy_line("no decode-only step measured yet") == "no decode-only step measured yet"


def test_a_ttft_shorter_than_its_prefill_step_says_why():
    from phasewise.generate import ttft_words

    assert ttft_words(0.0050, 0.0040) == "; TTFT 5.0 ms"
    assert ttft_words(0.0029, 0.0030) == "; TTFT 2.9 ms"  # a hair short: nothing to say
    short = ttft_words(0.0034, 0.0115)
    assert short.startswith("; TTFT 3.4 ms (stamped when the token was sampled")
    assert ttft_words(None, 0.01) == ""
