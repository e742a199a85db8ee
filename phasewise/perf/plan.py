"""``phasewise plan``: which deployment serves a workload with the most goodput per accelerator.

Goodput is DistServe's: the highest request rate at which at least 90% of requests meet both
the TTFT and the TPOT SLO. ``goodput`` finds it for one deployment by simulating the workload
at a rising rate (doubling until attainment falls below the bar, then bisecting), each rate
with the same requests (lengths and intruders depend on the seed, not the rate).

The search (``search``):

* co-located: each scheduling policy, each step budget, one replica (replicas scale goodput
  by their number: each takes its share of the traffic);
* P/D: each prefill:decode ratio and each disaggregation threshold, one unit of that ratio.

Candidates are ranked by goodput per accelerator. Each gets a verdict with its reason: the
deployment is simulated just above its goodput to see what gives first (the TTFT or the TPOT
SLO, which workers are saturated, preemptions). For the workload's own rate (when it has
one), the planner sizes the candidate that meets it with the fewest accelerators (units
needed at its per-unit goodput; ties go to the more goodput per accelerator), which at a
low rate may not be the one with the most goodput per accelerator (one co-located engine
for 10 req/s rather than a P/D pair), and checks that size by simulating the whole
deployment at that rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from phasewise.engine.slo import SLO
from phasewise.perf.costmodel import CostModel
from phasewise.perf.simulate import MAX_WORKERS, Deployment, EngineSpec, simulate
from phasewise.perf.workload import RequestSpec

ATTAINMENT = 0.9
RATIOS = ((1, 1), (1, 2), (2, 1), (1, 3), (3, 1))


@dataclass
class Workload:
    """Requests at a given rate: ``make(rate)`` builds them (same lengths at every rate)."""

    make: Callable[[float], list[RequestSpec]]
    rate: float | None = None  # the operator's traffic, req/s (None: size nothing)


@dataclass
class Candidate:
    deployment: Deployment
    engine: EngineSpec
    goodput: float = 0.0  # req/s at >= ATTAINMENT of requests within both SLOs
    at_goodput: dict[str, Any] | None = None  # the simulation at that rate
    above: dict[str, Any] | None = None  # just above it: what gives first
    verdict: str = ""

    @property
    def accelerators(self) -> int:
        return self.deployment.accelerators

    @property
    def per_accelerator(self) -> float:
        return self.goodput / self.accelerators

    def label(self) -> str:
        d, e = self.deployment, self.engine
        if d.mode == "colocated" and e.policy == "prefill-first":  # the budget is not used:
            return "co-located, prefill-first, whole prompts"  # a step takes whole prompts
        if d.mode == "colocated":
            return f"co-located, {e.policy}, budget {e.max_num_batched_tokens}"
        return f"P/D {d.prefill}:{d.decode}, threshold {d.threshold}, budget " \
               f"{e.max_num_batched_tokens}"


def attainment(result: dict[str, Any], slo: dict[str, float]) -> float:
    """Share of all requests (failed ones count as misses) within every SLO."""
    n = result["completed"] + result["failed"]
    met = round((result["request_goodput"] or 0.0) * result["duration"])
    return met / n if n else 0.0


def goodput(cost: CostModel, engine: EngineSpec, dep: Deployment, wl: Workload,
            slo: dict[str, float], *, start: float = 0.25, iters: int = 9,
            max_rate: float = 1e4) -> tuple[float, dict[str, Any] | None]:
    """The highest rate with attainment >= ATTAINMENT, and the simulation at it (0 and None
    when even a slow trickle misses)."""
    def run(rate: float) -> tuple[float, dict[str, Any]]:
        res = simulate(cost, engine, dep, wl.make(rate), slo)
        return attainment(res, slo), res

    lo, lo_res, hi = 0.0, None, None
    rate = start
    while rate <= max_rate:  # bracket: double until it fails
        att, res = run(rate)
        if att >= ATTAINMENT:
            lo, lo_res = rate, res
            rate *= 2
        else:
            hi = rate
            break
    if hi is None:
        return lo, lo_res
    if lo == 0.0:  # the first rate failed: look below it
        rate = start
        for _ in range(6):
            rate /= 4
            att, res = run(rate)
            if att >= ATTAINMENT:
                lo, lo_res = rate, res
                break
            hi = rate
        if lo == 0.0:
            return 0.0, None
    for _ in range(iters):
        mid = (lo + hi) / 2
        att, res = run(mid)
        if att >= ATTAINMENT:
            lo, lo_res = mid, res
        else:
            hi = mid
    return lo, lo_res


# A role this busy (its mean share of the simulated time) is saturated: the late prompts'
# time is put down to it.
SATURATED = 0.9


def verdict(c: Candidate, slo: dict[str, float]) -> str:
    """Why a candidate stops where it does, from the simulation just above its goodput: which
    SLO gives first, and what the requests that miss it spent their time on."""
    if c.goodput == 0.0 or c.above is None:
        return "misses the SLO even at a trickle of requests: no rate is served within it"
    a = c.above
    n = len(a["ttfts"])
    ttft_ms, tpot_ms = slo.get("ttft", math.inf), slo.get("tpot", math.inf)
    late: list[dict[str, Any]] = []  # the server timings of the requests that miss TTFT
    tpot_miss = 0
    for ttft, lat, out, timing in zip(a["ttfts"], a["latencies"], a["output_lens"],
                                      a["server_timings"]):
        if ttft is None or ttft * 1e3 > ttft_ms:
            late.append(timing or {})
        elif out > 1 and (lat - ttft) / (out - 1) * 1e3 > tpot_ms:
            tpot_miss += 1
    sim = a["simulated"]
    roles: dict[str, list[float]] = {}
    for w in sim["workers"]:
        roles.setdefault(w["role"], []).append(w["utilization"])
    busy = ", ".join(f"{role} {sum(u) / len(u):.0%} busy" for role, u in roles.items())
    rate = a["request_rate"]
    misses = f"{len(late)} of {n} miss TTFT, {tpot_miss} miss TPOT"
    missed = f"(missed at {rate:.3g} req/s)"
    if not late and not tpot_miss:
        why = (f"meets the SLO at {rate:.3g} req/s too, above the rate the search settled on "
               "(attainment is not monotonic in the rate at this number of requests)")
    elif len(late) >= tpot_miss:
        queue = [t["queue_s"] for t in late if t.get("queue_s") is not None]
        pre = [t["prefill_s"] for t in late if t.get("prefill_s") is not None]
        q = sum(queue) / len(queue) if queue else 0.0
        p = sum(pre) / len(pre) if pre else 0.0
        # the waiting is behind the busiest role's steps: a saturated decode worker of a P/D
        # pair delays first steps as a saturated prefill worker does; and where it is
        # saturated, a late prompt's prefill (its remote prefill, the hand-off and its first
        # step there) is stretched by it too, however the two times compare
        busiest = max(roles, key=lambda r: sum(roles[r]) / len(roles[r]))
        saturated = sum(roles[busiest]) / len(roles[busiest]) >= SATURATED
        if busiest == "decode" and (q >= p or saturated):
            why = (f"decode-bound {missed}: the late prompts waited {q * 1e3:.0f} ms for their "
                   f"first step behind the busy decode workers, then took {p * 1e3:.0f} ms")
        elif q >= p:
            why = (f"prefill-bound {missed}: the late prompts waited {q * 1e3:.0f} ms for their "
                   f"first step, then took {p * 1e3:.0f} ms")
        else:
            why = (f"prefill-bound {missed}: the late prompts' own prefill took "
                   f"{p * 1e3:.0f} ms (after {q * 1e3:.0f} ms of waiting) against a TTFT "
                   f"SLO of {ttft_ms:g} ms")
    else:
        mix = {}
        for w in sim["workers"]:
            for k, v in w["steps"].items():
                mix[k] = mix.get(k, 0) + v
        steps = sum(mix.values()) or 1
        why = (f"decode-bound {missed}: TPOT p90 {a['p90_tpot_ms']:.1f} ms against "
               f"{tpot_ms:g} ms; {mix.get('mixed', 0) / steps:.0%} of steps carry prompt "
               "chunks")
    why += f" ({busy}; {misses})"
    preempt = sum(w["preemptions"] for w in sim["workers"])
    if preempt:
        why += f"; {preempt} preemptions (the K/V pool is full)"
    return why


def search(cost: CostModel, engine: EngineSpec, wl: Workload, slo: dict[str, float], *,
           budgets: Sequence[int] = (256, 512, 1024, 2048), policies: Sequence[str] =
           ("chunked", "prefill-first"), ratios: Sequence[tuple[int, int]] = RATIOS,
           thresholds: Sequence[int] = (0, 512, 1024), link: Any = None, pd: bool = True,
           start: float = 0.25, queue_limit: int = 8,
           progress: Callable[[str], None] | None = None) -> list[Candidate]:
    """Every candidate, its goodput and verdict, best goodput per accelerator first
    (``start``: the first rate each search tries, req/s)."""
    say = progress or (lambda msg: None)
    cands: list[Candidate] = []
    for policy in policies:
        for b in (budgets if policy == "chunked" else budgets[-1:]):
            cands.append(Candidate(Deployment("colocated"),
                                   replace(engine, policy=policy, max_num_batched_tokens=b)))
    if pd:
        budget = max(budgets)
        for p, d in ratios:
            for t in thresholds:
                cands.append(Candidate(Deployment("pd", prefill=p, decode=d, threshold=t,
                                                  link=link, prefill_queue_limit=queue_limit),
                                       replace(engine, max_num_batched_tokens=budget)))
    for i, c in enumerate(cands, 1):
        c.goodput, c.at_goodput = goodput(cost, c.engine, c.deployment, wl, slo, start=start)
        if c.goodput > 0:
            res = simulate(cost, c.engine, c.deployment, wl.make(c.goodput * 1.25), slo)
            res["request_rate"] = c.goodput * 1.25
            c.above = res
        c.verdict = verdict(c, slo)
        say(f"[{i}/{len(cands)}] {c.label():<44} goodput {c.goodput:8.3f} req/s "
            f"({c.per_accelerator:.3f} per accelerator)")
    cands.sort(key=lambda c: -c.per_accelerator)
    return cands


def units_for(c: Candidate, rate: float) -> int:
    """Units of ``c`` its goodput says ``rate`` needs (at least one)."""
    return max(1, math.ceil(rate / c.goodput))


def cheapest_for(cands: Sequence[Candidate], rate: float | None) -> Candidate | None:
    """Of the candidates that meet the SLOs at some rate, the one whose units for ``rate``
    take the fewest accelerators; ties go to the earlier (more goodput per accelerator, as
    ``search`` ranks them). None where none does, or no rate is given."""
    able = [c for c in cands if c.goodput > 0]
    if rate is None or not math.isfinite(rate) or not able:
        return None
    return min(able, key=lambda c: units_for(c, rate) * c.accelerators)


@dataclass
class Sized:
    """The winner scaled to the workload's rate, and its check."""

    candidate: Candidate
    units: int
    deployment: Deployment
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def attainment(self) -> float:
        return self.result.get("_attainment", 0.0)


def size(best: Candidate, wl: Workload, cost: CostModel, slo: dict[str, float]) -> Sized | None:
    """Units of the winner needed for the workload's rate, checked by simulating them all
    behind one router (one more unit while the check misses, up to 4 more)."""
    if wl.rate is None or not math.isfinite(wl.rate) or best.goodput <= 0:
        return None
    units = units_for(best, wl.rate)
    d = best.deployment
    per_unit = d.replicas if d.mode == "colocated" else max(d.prefill, d.decode)
    if units * per_unit > MAX_WORKERS:
        raise ValueError(f"{wl.rate:g} req/s needs about {units} units of {d.describe()}: "
                         f"more than the {MAX_WORKERS} workers of a role a simulation (or a "
                         "Deployment) holds; size for a lower --request-rate")
    for attempt in range(5):
        if attempt:
            if (units + 1) * per_unit > MAX_WORKERS:
                break
            units += 1
        dep = replace(d, replicas=units) if d.mode == "colocated" else \
            replace(d, prefill=d.prefill * units, decode=d.decode * units)
        res = simulate(cost, best.engine, dep, wl.make(wl.rate), slo)
        res["_attainment"] = attainment(res, slo)
        if res["_attainment"] >= ATTAINMENT:
            break
    return Sized(best, units, dep, res)  # units, dep and res always agree


ADMISSION_LOADS = (1.0, 1.5, 2.0, 3.0)  # x the winner's goodput


def compare_admission(best: Candidate, wl: Workload, cost: CostModel, slo: dict[str, float],
                      admission: SLO, loads: Sequence[float] = ADMISSION_LOADS
                      ) -> list[dict[str, Any]]:
    """One unit of the winner at ``loads`` x its goodput, served without and with admission
    by SLO (``Deployment.admission``), the same requests each time: per rate, each run's
    good requests a second (``request_goodput``), the share of all requests that met both
    SLOs, the requests refused, and the share of the admitted ones that met them."""
    rows = []
    for load in loads:
        rate = best.goodput * load
        specs = wl.make(rate)
        row: dict[str, Any] = {"load": load, "rate": rate}
        for name, dep in (("without", replace(best.deployment, admission=None)),
                          ("with", replace(best.deployment, admission=admission))):
            res = simulate(cost, best.engine, dep, specs, slo)
            adm = res["simulated"].get("admission") or {}
            met = attainment(res, slo)
            row[name] = {"goodput": res.get("request_goodput") or 0.0, "attainment": met,
                         "refused": adm.get("refused", 0),
                         "admitted_met": adm.get("admitted_met_slo", met)}
        rows.append(row)
    return rows


def admission_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'load':>5} {'req/s':>8}  {'goodput w/o':>11} {'met w/o':>8}  "
             f"{'goodput with':>12} {'met with':>8} {'refused':>8} {'admitted met':>12}"]
    for r in rows:
        a, b = r["without"], r["with"]
        lines.append(f"{r['load']:>4.1f}x {r['rate']:>8.3g}  {a['goodput']:>11.3g} "
                     f"{a['attainment']:>8.0%}  {b['goodput']:>12.3g} {b['attainment']:>8.0%} "
                     f"{b['refused']:>8} {b['admitted_met'] or 0:>12.0%}")
    return "\n".join(lines)


def table(cands: Sequence[Candidate]) -> str:
    lines = [f"{'rank':>4}  {'deployment':<44} {'accel':>5} {'goodput':>9} {'per accel':>9}  "
             "verdict: what limits it, at the lowest rate tried that missed the SLO"]
    for i, c in enumerate(cands, 1):
        lines.append(f"{i:>4}  {c.label():<44} {c.accelerators:>5} {c.goodput:>9.3f} "
                     f"{c.per_accelerator:>9.3f}  {c.verdict}")
    return "\n".join(lines)
