"""Headroom routing: each pod's share of the pool's traffic from the load it can take, then Envoy weights. Pure.

The cube policy (`sluice.core.scoring`) weighs a pod by (K / latency penalty)^3: it ranks pods but says nothing
about how much each can take, so on servers that saturate it overfills the fastest class. This policy instead:

1. learns each pod's capacity (requests/s) from what it shows. Utilisation ρ is read two ways and the larger
   kept: TTFT inflation over the pod's own idle TTFT (M/M/1: T = s / (1 − ρ), so ρ = 1 − s/T) and the waiting
   queue (M/D/1: Lq = ρ² / (2(1 − ρ))), the queue only from `QUEUE_EVIDENCE` waiting requests when there is a
   TTFT reading (one scrape of one or two waiting is noise, not load). With ρ ≥ `INFORMATIVE` the capacity is
   rate / ρ, a measurement, and only a measurement is remembered as learned; every measurement, the first one
   included, moves the capacity from what was believed (the learned value, or the prior) at a gain that grows
   with ρ, rising at `RISE` of the gain it falls with. Until a pod has one, its capacity is a prior: the declared
   class K scaled by the pool's learned capacity per unit of K (`capacity.classes`); while nothing in the pool is
   learned yet, the pods carrying traffic without showing load are taken to be at most `SPARE` loaded. With
   no rate anywhere yet, the shares follow K itself (unitless, "relative", never stored as requests/s). A
   mislabelled or throttled pod finds its own capacity as soon as it carries load. The KV-cache usage u is a
   lower bound on ρ (`KV_ROOM`): rate / u bounds the capacity from above (a belief past it falls towards it, a
   rise never passes it), and a cache with room lets a pod that shows no load probe upwards, one never measured
   from its prior — a pod whose TTFT stays flat until its cliff is otherwise stuck at K x what the others taught.
   Pods of one hardware class within the noise of their class's median are planned as the class (`pool_by_class`);
2. water-fills the pool's observed request rate over the pods with fresh evidence: with T_i(x) = s_i / (1 − x/μ_i)
   every loaded pod is given the same latency level L, the lowest that carries the demand: x_i = μ_i (1 − s_i/L),
   fast pods first, spilling over to slower ones as they fill (this minimises the highest TTFT, not the mean);
   no pod is planned past `targetUtilization` of its capacity unless the whole pool is, and then shares follow
   capacity. A pod without fresh evidence (frozen) keeps its weight and is left out of both the demand and the
   fill;
3. maps shares to weights for Envoy's weighted least-request, which picks in proportion to w / (active + 1)^bias
   per sidecar: w_i ∝ x_i (1 + x_i E_i / clientSidecars)^bias, with E_i the pod's observed time in system
   (in-flight / rate, Little's law) — so the share planned is the share Envoy gives once the actives settle.

The health band (error rate) scales the capacity; hysteresis, the recovery ramp, fast-zeroing and the floor work
on the resulting weights exactly as for the cube. Called by `sluice.core.policies`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

# Provenance of the constants: "swept" ones were compared in ad-hoc 2- and 5-seed runs of the simulated benchmark on
# the seed-000 and mixed-fleet scenarios only (not in the repository; docs/benchmarks.md, "Headroom vs the cube"),
# KV_ROOM and PROBE_ROOM also on underdeclared (docs/design.md, "The KV-cache bound"); the others were set by hand
# and never swept. None is validated on data outside the simulation.

INFORMATIVE = 0.3
"""Utilisation from which a pod's reading is a measurement of its capacity (below, TTFT inflation is mostly noise).
Provenance: swept 0.3 / 0.4 (seed-000, mixed-fleet); 0.3 kept."""
RISE = 0.1
"""Learned capacity rises at this share of the gain it falls with: quick to shed load, slow to add it. It applies to
a pod's first measurement too, which starts from the pod's prior: a flat TTFT curve (an H100 until its cliff) read
ρ = 0.34 at 12.5 req/s, and taking rate / ρ = 37 req/s at once (its capacity is 15.5) planned 23 req/s on it.
Provenance: swept 0.1 / 0.3 (seed-000, mixed-fleet); again with the changes of acfca5c (5 seeds, P99 medians:
0.3 at most 11 % better at any load, 34 % worse on seed-000 at 80 %; docs/design.md); 0.1 kept."""
QUEUE_EVIDENCE = 3.0
"""Waiting requests from which the queue is read as utilisation when the pod also has a TTFT reading (without
one, any queue counts). The queue is one scrape sample: an A100 at ρ ≈ 0.6 shows 2 waiting now and then, which
M/D/1 reads as ρ = 0.83, and the max of the two readings kept its learned capacity near 7 of its 9.9 req/s (the
rest spilled to slower pods). Provenance: swept 0 / 2 / 3 / 4 / 6 and TTFT-only (never the queue) on seed-000
and mixed-fleet, 5 seeds (docs/design.md, "What was tried and dropped"); 3 kept: 0 and 2 overfilled the slow
pods below the knee, TTFT-only and 6 reacted late past it."""

EVIDENCE_FROM = 0.5
"""A TTFT or queue reading moves a learned capacity only when the pod shows load: it carries at least this share
of what it is believed to take, or its waiting queue reaches `QUEUE_EVIDENCE`, or its KV cache `KV_ROOM`. A
reading counts from ρ ≥ INFORMATIVE, and a lightly loaded pod's TTFT p95 is inflated by its prompt mix alone: at
a rate under INFORMATIVE × the belief every such reading lies below the belief and could only ever lower it (an
A100 of the local stack fell 11.5 → 3.6 req/s while idle, its class sibling pooled with it, below the RTX 4090
beside them), and between INFORMATIVE and half of it, raise it. A belief far above the truth still falls: the
plan gives the pod that share, and it queues. A first measurement is not gated: the prior it moves is K x what
the other pods taught, not the pod's own. Provenance: set from that argument, not swept."""
AGEING = 0.0002
"""Per pass without load shown, a learned capacity moves this share of the way towards its prior (its class K x
the pool's learned capacity per unit of K): what was measured long ago weighs less, visibly (`ageing`). Slow: a
measured capacity is a property of the hardware, and a prior can be wrong. Provenance: hand-set (half-life about
3,500 passes, some 5 h at the default interval), not swept; with it and `EVIDENCE_FROM`, underdeclared's P99 at
20 / 50 / 70 % was 190 / 269 / 358 ms against 190 / 238 / 366 without either (5 seeds, intervals overlapping)."""
PROBE = 0.02
"""Per pass, the rise of a pod's learned capacity while it carries much and reads below INFORMATIVE.
Provenance: swept 0 / 1 / 2 / 3 % (seed-000, mixed-fleet); 3 % again with the changes of acfca5c (5 seeds, P99
medians: better on the mixed fleet at 90 %, worse on seed-000 at 90 %; docs/design.md); 2 % kept."""
KV_ROOM = 0.5
"""KV-cache usage below which a pod's cache shows room for probing. vLLM's KV cache holds the running batch's
context (prompt and generated tokens of every running request), and the batch is rate x time in system (Little's
law) with a time in system that does not fall as the load rises (decode steps lengthen with the batch): usage
grows at least in proportion to the rate and reaches at most 1 at saturation, so a usage u is at most the pod's
utilisation. Hence u >= KV_ROOM proves the pod at least that loaded, and no probing goes on past it; and
rate / u is an upper bound on the capacity (`estimate`). The converse does not hold: a compute-bound pod (long
prompts) saturates with its cache far from full, so low usage is never read as capacity, only as leave to probe.
Provenance: swept 0.3 / 0.5 with PROBE_ROOM 2 % on seed-000, mixed-fleet and underdeclared (5 seeds, P99
medians in docs/design.md, "The KV-cache bound"): 0.3 no better at 20-70 %, worse at 90 %; 0.5 kept."""
PROBE_ROOM = 0.1
"""Per pass, the rise of a probing pod's capacity when its KV cache is read and shows room (below KV_ROOM),
instead of PROBE; it is also the first step of an unmeasured pod probing from its prior. Provenance: swept 2 / 5 /
10 % on seed-000, mixed-fleet and underdeclared (5 seeds, P99 medians in docs/design.md, "The KV-cache bound");
underdeclared at 20 / 50 / 70 %: 296 / 381 / 554 ms at 2 %, 214 / 307 / 379 at 5 %, 188 / 271 / 348 at 10 %;
seed-000 and mixed-fleet within the seed noise of each other; 10 % kept."""
PROBE_FROM = 0.5
"""A pod carrying at least this share of its learned capacity while an actual reading shows ρ < INFORMATIVE has it
raised by PROBE (PROBE_ROOM with room in its KV cache) per pass (a reading past INFORMATIVE takes it down again at
once); a missing reading is no evidence and never probes. Provenance: hand-set, never swept."""
SPARE = 0.5
"""While nothing in the pool is learned yet, the pods carrying traffic without a measurement are taken to be at
most this loaded: the pool's capacity per unit of K is the median of rate / SPARE / K. It is no floor under any
one pod's capacity (a prior at least its own rate / SPARE, as before): that fed on itself on a pod whose TTFT
does not inflate before its cliff (planned 0.8 × rate / 0.5 = 1.6 × its rate, so its rate rose, and its floor:
mixed-fleet's H100 was planned 17 req/s of its 15.5). Provenance: 0.5 hand-set after 0.3 made the learned
capacities swing, never swept as the per-K bound; the per-pod floor was compared at 0.5 / 0.6 / 0.7, only before
anything is learned, and not at all, on seed-000 and mixed-fleet, 5 seeds (docs/design.md, "What was tried and
dropped"): dropped."""
CONFIDENT = 0.6
"""Utilisation from which a reading moves the learned capacity at the full smoothing gain.
Provenance: hand-set, never swept."""
MAX_UTILISATION = 0.98
"""Cap on a reading of ρ, so a saturated pod reads as very loaded, never infinitely. Provenance: hand-set."""
IDLE_DRIFT = 0.002
"""Per pass, the learned idle TTFT may rise by this share towards what is observed (a slowed node's new normal).
Provenance: hand-set, never swept (by arithmetic, a sustained 2x slowdown becomes the new idle in ~350 passes)."""
IDLE_DESCENT = 0.1
"""Per pass, the learned idle TTFT moves this share of the way down to a lower reading (one short-prompt window
cannot set it). Provenance: hand-set, never swept."""
SAMPLES = 30
"""Completed requests in the window from which a pod's reading counts fully (fewer: proportionally less).
Provenance: hand-set, never swept."""
RATE_NOISE = 2.0
"""Relative noise of a learned capacity, times 1/sqrt(n) for n completions in the window: identical pods learn
capacities that differ by this much from their window's request mix alone. Measured on homogeneous-tuning (five
identical L40S, Azure lengths) and four identical H100s on the same lengths (an ad-hoc copy), seed 44 at 90 and
110 %: the median over the measured window's passes of the spread (coefficient of variation) of the learned
capacities across the pods was 1.25-2.2 times 1/sqrt(n). Provenance: set from that measurement, not swept."""
POOL_WITHIN = 2.0
"""A pod whose learned capacity is within this many noise units (`RATE_NOISE`) of its hardware class's median is
planned at the class's median; beyond twice this its own value stands (a throttled or mislabelled pod keeps what
it showed), linearly in between. Provenance: hand-set (2 and 4 noise units), not swept."""
TRICKLE = 0.05
"""With no traffic observed, the share of the pool's capacity planned (fastest pods first), so weights exist.
Provenance: hand-set, never swept (with no traffic only the order of the weights matters)."""

CapacitySource = Literal["measured", "learned", "ageing", "probing", "prior", "relative", "held"]
LEARNED_SOURCES = ("measured", "learned", "ageing", "probing", "held")
"""Sources whose capacity rests on a measurement (now or remembered): only these are stored as learned."""


def finite(value: float | None) -> float | None:
    """A signal as evidence: a NaN or infinite value is missing, never a number."""
    return value if value is not None and math.isfinite(value) else None


@dataclass(frozen=True)
class PodLoad:
    """One pod's evidence this pass, and what the status remembers of it."""

    name: str
    prior: float
    """The declared class coefficient K."""
    rate: float | None
    """Completed requests per second over the window."""
    ttft: float | None
    """TTFT p95 over the window (seconds): its inflation over the idle TTFT reads the load."""
    queue: float | None
    running: float | None
    health: float = 1.0
    """The health band's share (errors), applied to the capacity."""
    previous_capacity: float | None = None
    previous_idle: float | None = None
    fresh: bool = True
    """False: no fresh evidence (frozen): the previous capacity is held."""
    kv: float | None = None
    """KV-cache usage, 0 to 1 (one scrape sample): a lower bound on the pod's utilisation (`KV_ROOM`)."""
    hardware_class: str | None = None
    """The pod's hardware class label: pods of one class are one capacity unless they differ beyond the noise
    (`pool_by_class`); None is a class of its own."""


@dataclass(frozen=True)
class PodHeadroom:
    """What the policy concluded for one pod."""

    estimate: float
    """Capacity before health: requests/s, except with source "relative", where it is the class coefficient K."""
    learned: float | None
    """The learned capacity (requests/s) the status remembers: the estimate when it rests on a measurement; None
    while only a prior is known."""
    capacity: float
    """The capacity planned with: estimate x health."""
    idle_ttft: float | None
    utilisation: float | None
    """Utilisation read from this pass's evidence, if any."""
    source: CapacitySource
    share: float
    """Planned requests/s."""
    demand: float
    """The pool's (subset's) observed request rate the shares add up to."""
    weight: float
    """Relative Envoy weight (before scaling to integers)."""
    kv: float | None = None
    """The KV-cache usage read this pass, if any (a lower bound on the utilisation: `KV_ROOM`)."""
    pooled: float = 0.0
    """The share (0 to 1) of the estimate that is its hardware class's median rather than its own value."""
    class_size: int = 0
    """How many pods of its class with a learned capacity were pooled (0: not pooled)."""

    def explain(self) -> str:
        if self.source == "relative":
            parts = [f"capacity relative K={self.estimate:.2f} (no rate yet"]
        elif self.source == "ageing":
            parts = [f"capacity {self.estimate:.2f}/s (learned, no load shown: ageing towards its prior"]
        else:
            parts = [f"capacity {self.estimate:.2f}/s ({self.source}"]
        if self.utilisation is not None:
            parts[0] += f", load {self.utilisation:.0%}"
        if self.kv is not None:
            parts[0] += f", kv {self.kv:.0%}"
        parts[0] += ")"
        if self.pooled > 0:
            parts.append(f"{self.pooled:.0%} class median of {self.class_size} pods")
        if self.estimate > 0 and self.capacity < self.estimate * 0.995:
            parts.append(f"x{self.capacity / self.estimate:.2f} for errors")
        if self.idle_ttft is not None:
            parts.append(f"idle ttft {self.idle_ttft * 1000:.0f}ms")
        total = f"{self.demand:.2f}/s"
        parts.append(f"planned {self.share:.2f}/s of {total}")
        return " ".join(parts)


def utilisation(ttft: float | None, idle: float | None, queue: float | None) -> float | None:
    """ρ from TTFT inflation (M/M/1) and from the waiting queue (M/D/1); the larger, or None without evidence.

    With a TTFT reading, the queue counts only from `QUEUE_EVIDENCE` waiting requests."""
    readings = []
    if ttft is not None and idle is not None and ttft > 0:
        readings.append(max(0.0, 1.0 - idle / ttft))
    if queue is not None and queue > 0 and (queue >= QUEUE_EVIDENCE or not readings):
        readings.append(-queue + math.sqrt(queue * queue + 2.0 * queue))
    return min(MAX_UTILISATION, max(readings)) if readings else None


def shows_load(rate: float, belief: float, queue: float | None, kv: float | None) -> bool:
    """Whether a reading may move `belief` (`EVIDENCE_FROM`): the pod carries half of it, queues or fills its
    cache. Below that a TTFT inflated by the prompt mix alone would read as load, lowering the belief, or raising
    it (rate / ρ exceeds the belief once the rate passes INFORMATIVE of it)."""
    return (
        rate >= EVIDENCE_FROM * belief
        or (queue is not None and queue >= QUEUE_EVIDENCE)
        or (kv is not None and kv >= KV_ROOM)
    )


def learn_idle(ttft: float | None, previous: float | None) -> float | None:
    """The pod's idle TTFT, a slow low-quantile tracker: it moves IDLE_DESCENT of the way down to a lower reading
    and drifts up by IDLE_DRIFT per pass towards a higher one, so one short-prompt window cannot set it."""
    if ttft is None or ttft <= 0:
        return previous
    if previous is None:
        return ttft
    if ttft < previous:
        return previous + IDLE_DESCENT * (ttft - previous)
    return min(ttft, previous * (1.0 + IDLE_DRIFT))


class Estimate(NamedTuple):
    """What `estimate` finds for one pod."""

    capacity: float
    """Requests/s before health (unitless K while nothing has a rate: `relative`)."""
    idle: float | None
    """The pod's learned idle TTFT (seconds)."""
    utilisation: float | None
    """ρ read this pass, or None without a reading."""
    source: CapacitySource


def estimate(pods: Sequence[PodLoad], smoothing: float, window: float) -> dict[str, Estimate]:
    """Per pod: capacity before health, idle TTFT, utilisation and where the capacity comes from.

    An observation rate / ρ counts in proportion to ρ (up to `CONFIDENT`): the busier the pod, the more its
    inflation says about its capacity; a lightly loaded pod's reading hardly moves what was learned. A pod's first
    measurement moves its prior the same way (when it has one). A KV-cache reading u >= INFORMATIVE bounds the
    capacity at rate / u: a belief above it falls towards it (at the gain of a reading of ρ = u), a rise never
    passes it, and a bound alone is no capacity to start from (`KV_ROOM`).
    """
    learned: dict[str, float] = {}
    unmeasured: list[str] = []
    """Pods with nothing learned, carrying traffic without showing load, their KV cache showing room."""
    first: dict[str, tuple[float, float, float, bool]] = {}
    """Pods measured for the first time: (observation, gain, rate, whether it may raise the prior)."""
    ageing: list[str] = []
    """Pods with a learned capacity and no load shown this pass."""
    notes: dict[str, tuple[float | None, float | None, CapacitySource]] = {}
    for p in pods:
        if not p.fresh:
            idle = p.previous_idle
            if p.previous_capacity:
                learned[p.name] = p.previous_capacity
            notes[p.name] = (idle, None, "held")
            continue
        idle = learn_idle(p.ttft, p.previous_idle)
        rho = utilisation(p.ttft, p.previous_idle or idle, p.queue)
        rate = p.rate if p.rate is not None and p.rate > 0 else 0.0
        observed = rate / rho if rate > 0 and rho is not None and rho >= INFORMATIVE else None
        gain = (1.0 - smoothing) * min(1.0, (rho or 0.0) / CONFIDENT) * min(1.0, rate * window / SAMPLES)
        source: CapacitySource = "learned"
        bound = rate / p.kv if rate > 0 and p.kv is not None and p.kv >= INFORMATIVE else None
        bound_gain = (1.0 - smoothing) * min(1.0, (p.kv or 0.0) / CONFIDENT) * min(1.0, rate * window / SAMPLES)
        if p.previous_capacity:
            value = p.previous_capacity
            if bound is not None and bound < value and (observed is None or bound < observed):
                # The KV cache proves the pod at least p.kv loaded: its capacity is at most rate / kv.
                value += bound_gain * (bound - value)
                source = "measured"
            elif observed is not None and shows_load(rate, value, p.queue, p.kv):
                if observed < value:
                    value += gain * (observed - value)
                elif bound is not None:
                    value += gain * RISE * max(0.0, min(observed, bound) - value)
                else:
                    value += gain * RISE * (observed - value)
                source = "measured"
            elif rate >= PROBE_FROM * value and rho is not None and rho < INFORMATIVE and _cache_room(p.kv, True):
                # Carrying most of what it is believed to take, and a reading shows no load: the belief is too low.
                value *= 1.0 + (PROBE if p.kv is None else PROBE_ROOM)
                source = "probing"
            else:
                ageing.append(p.name)  # no load shown: what was learned holds, ageing towards the prior
            learned[p.name] = max(value, rate)
        elif bound is not None and (observed is None or bound < observed):
            # Only a bound (or a bound under the TTFT reading): it may lower the prior; it raises it only as far
            # as a TTFT or queue reading says.
            first[p.name] = (bound, bound_gain, rate, observed is not None)
            source = "measured"
        elif observed is not None:
            first[p.name] = (observed, gain, rate, True)
            source = "measured"
        elif rate > 0 and rho is not None and rho < INFORMATIVE and _cache_room(p.kv, False):
            unmeasured.append(p.name)
        notes[p.name] = (idle, rho, source)
    prior_of = {p.name: p.prior for p in pods if p.prior > 0}
    # A first measurement starts from the pod's prior (the capacity per unit of K of what was learned before it)
    # and moves like any later one: a low reading of a flat TTFT curve is not taken as the capacity at once.
    start_per_k = _per_k(pods, learned, prior_of)
    taught = any(n in prior_of for n in learned)
    for name, (observed, gain, rate, rises) in first.items():
        if start_per_k is None or name not in prior_of:
            if rises:
                learned[name] = observed
            continue  # a bound alone is no capacity to start from
        start = prior_of[name] * start_per_k
        if observed < start:
            learned[name] = max(rate, start + gain * (observed - start))
        elif rises:
            learned[name] = max(rate, start + gain * (observed - start) * RISE)
        # else: a KV bound above the prior says nothing the prior does not
    # An unmeasured pod carrying most of its prior with no load shown and room in its KV cache probes from its
    # prior: a pod whose TTFT stays flat until its cliff is otherwise never measured below it, and stays at K x
    # what the other pods taught, however wrong K is. The cache stops the lift (`KV_ROOM`), a reading past
    # INFORMATIVE or a queue then measures it. Only from a prior that rests on what the pool learned: the
    # optimistic bound used before anything is (`SPARE`) is not persisted.
    by_name = {p.name: p for p in pods}
    for name in unmeasured:
        if start_per_k is None or not taught or name not in prior_of:
            continue
        p = by_name[name]
        rate = p.rate or 0.0
        start = prior_of[name] * start_per_k
        if rate >= PROBE_FROM * start:
            learned[name] = max(rate, start * (1.0 + PROBE_ROOM))
            notes[name] = (notes[name][0], notes[name][1], "probing")
    per_k = _per_k(pods, learned, prior_of)
    if per_k is not None:
        for name in ageing:
            if name in prior_of:
                learned[name] += AGEING * (prior_of[name] * per_k - learned[name])
                notes[name] = (notes[name][0], notes[name][1], "ageing")
    out: dict[str, Estimate] = {}
    for p in pods:
        idle, rho, source = notes[p.name]
        if p.name in learned:
            out[p.name] = Estimate(learned[p.name], idle, rho, source)
        elif per_k is not None:
            out[p.name] = Estimate(p.prior * per_k, idle, rho, "prior")
        else:
            out[p.name] = Estimate(p.prior, idle, rho, "relative")
    return out


@dataclass(frozen=True)
class Pooling:
    """How far one pod is planned as its hardware class rather than on its own evidence (`pool_by_class`)."""

    share: float
    """0 to 1: the share of each planned quantity taken from the class's median."""
    members: tuple[str, ...]
    """The class's pods with a fresh learned capacity (this one included)."""


def pool_by_class(pods: Sequence[PodLoad], estimates: dict[str, Estimate], window: float) -> dict[str, Pooling]:
    """Which fresh learned pods are planned as their hardware class, and how far (classes of two or more).

    Identical pods learn unequal capacities, idle TTFTs and times in system from their windows' request mixes
    (`RATE_NOISE`), and the plan then gives them unequal weights: at overload the pods weighted higher hold
    proportionally more of the queue (Envoy's least-request keeps active ∝ weight), and the pool's P99 is theirs.
    So a pod whose learned capacity is within `POOL_WITHIN` noise units of its class's median (over the class's
    fresh learned capacities) is planned with the class's medians; one beyond twice that keeps its own (a throttled
    or mislabelled pod is not hidden by its siblings), linearly in between. A noise unit is `RATE_NOISE` / sqrt(n),
    relative to the median, n the pod's completions in the window (none: no evidence of its own, the class's
    value); the distance is the larger of its learned capacity's and this pass's measurement's (rate / ρ), so a
    node that just slowed down is on its own from its first reading; a pod with only a prior takes its class's
    learned median. Frozen pods and pods without a class label are left as they are.
    """
    classes: dict[str, list[PodLoad]] = {}
    for p in pods:
        if p.fresh and p.hardware_class is not None and estimates[p.name].source in (*LEARNED_SOURCES, "prior"):
            classes.setdefault(p.hardware_class, []).append(p)
    out: dict[str, Pooling] = {}
    for members in classes.values():
        learned = [p for p in members if estimates[p.name].source != "prior"]
        if len(members) < 2 or not learned:
            continue
        median = statistics.median(estimates[p.name].capacity for p in learned)
        if median <= 0:
            continue
        names = tuple(p.name for p in learned)
        for p in members:
            if estimates[p.name].source == "prior":
                out[p.name] = Pooling(1.0, names)  # nothing learned of its own: its class's value
                continue
            completions = (p.rate or 0.0) * window
            noise = RATE_NOISE / math.sqrt(completions) if completions >= 1 else math.inf
            # What it learned, and what this pass measured (rate / ρ), the further from the class: a node that
            # just slowed down shows it in its reading before its learned capacity has moved.
            readings = [estimates[p.name].capacity]
            rho = estimates[p.name].utilisation
            if p.rate and rho is not None and rho >= INFORMATIVE:
                readings.append(p.rate / rho)
            units = max(abs(r / median - 1.0) for r in readings) / noise
            out[p.name] = Pooling(min(1.0, max(0.0, 2.0 - units / POOL_WITHIN)), names)
    return out


def pooled_values(pooling: dict[str, Pooling], values: dict[str, float]) -> dict[str, float]:
    """`values` with each pooled pod's moved its pooling share of the way to its class's median (over the class
    members that have a value); the others as they are."""
    out = dict(values)
    medians: dict[int, float | None] = {}
    """A class's median, once per class: `pool_by_class` gives every pod of a class the same members tuple (keyed
    by identity: hashing a 4,096-name tuple per pod would cost more than the median)."""
    for name, pool in pooling.items():
        if name not in values or pool.share <= 0:
            continue
        key = id(pool.members)
        if key not in medians:
            known = [values[m] for m in pool.members if m in values]
            medians[key] = statistics.median(known) if known else None
        median = medians[key]
        if median is not None:
            out[name] = values[name] + pool.share * (median - values[name])
    return out


def _cache_room(kv: float | None, missing_is_room: bool) -> bool:
    """Whether the KV cache shows room for a lift (`KV_ROOM`). A missing reading is room only for a pod that
    already has a measurement (the probing it had before the cache was read); an unmeasured pod needs the cache."""
    if kv is None:
        return missing_is_room
    return kv < KV_ROOM


def _per_k(pods: Sequence[PodLoad], learned: dict[str, float], prior_of: dict[str, float]) -> float | None:
    """The pool's capacity per unit of K: the median over what was learned; with nothing learned, the optimistic
    bound over the pods carrying traffic (rate / SPARE / K); None without either."""
    values = [learned[n] / prior_of[n] for n in learned if n in prior_of]
    if not values:
        values = [(p.rate or 0.0) / SPARE / prior_of[p.name] for p in pods if p.name in prior_of and (p.rate or 0) > 0]
    return statistics.median(values) if values else None


def water_fill(
    demand: float, capacity: Sequence[float], idle: Sequence[float], target_utilisation: float
) -> list[float]:
    """Rates x_i adding up to `demand` that give every loaded pod the same latency level L, the lowest possible.

    With T_i(x) = s_i / (1 − x/μ_i), a pod at level L takes x_i = μ_i (1 − s_i/L): the fastest pods (lowest idle
    TTFT) take traffic first and each slower one joins once the level reaches its idle TTFT — water-filling; no
    pod is planned past `target_utilisation` of its capacity while another has room. A pod of zero capacity gets
    nothing; past that utilisation on every pod, shares follow capacity. Minimising the highest latency rather
    than the mean keeps slow pods further from their knee, which is what a P99 sees.
    """
    total = sum(c for c in capacity if c > 0)
    if demand <= 0 or total <= 0:
        return [0.0] * len(capacity)
    if demand >= target_utilisation * total:
        return [demand * c / total if c > 0 else 0.0 for c in capacity]

    def fill(level: float) -> list[float]:
        return [
            min(target_utilisation * c, c * (1.0 - s / level)) if c > 0 and level > s else 0.0
            for c, s in zip(capacity, idle, strict=True)
        ]

    return fill(water_level(demand, capacity, idle, target_utilisation))


def water_level(demand: float, capacity: Sequence[float], idle: Sequence[float], cap: float) -> float:
    """The level L at which `water_fill`'s rates add up to `demand` (< cap × the total capacity), solved exactly;
    idle TTFTs > 0 (what `plan` passes).

    The total Σ x_i(L) is continuous and rises with L; between two breakpoints (a pod joining at L = s_i, or
    reaching its cap at L = s_i / (1 − cap)) it is a − b/L + held, where a and b sum μ_i and μ_i s_i over the pods
    loaded below their cap and held sums cap × μ_i over the capped ones. Walk the breakpoints in order to the
    segment where the total reaches `demand`, and solve there: L = b / (a + held − demand), kept within the
    segment (the running sums keep rounding residue once pods leave them: on a stretch where every loaded pod is
    capped, a demand within a rounding error of the plateau would otherwise divide residue by residue).
    """
    breakpoints: list[tuple[float, int, float, float]] = []
    for c, s in zip(capacity, idle, strict=True):
        if c > 0:
            breakpoints.append((s, 0, c, s))  # joins
            if cap < 1.0:
                breakpoints.append((s / (1.0 - cap), 1, c, s))  # reaches its cap
    breakpoints.sort()
    a = b = held = low = 0.0
    for level, kind, c, s in breakpoints:
        if level > 0 and a > 0 and a - b / level + held >= demand:
            high = level
            break
        if kind == 0:
            a, b = a + c, b + c * s
        else:
            a, b, held = a - c, b - c * s, held + cap * c
        low = max(low, level)
    else:
        if cap < 1.0:  # every pod at its cap short of `demand`: only rounding gets here (the caller checked)
            return math.inf
        high = math.inf
    span = a + held - demand
    return min(high, max(low, b / span)) if span > 0 else high


def _model_divisor(
    p: PodLoad, share: float, times: dict[str, float], fallback_time: float, clients: float, bias: float
) -> float:
    """(1 + active)^bias at the planned rate: Little's law on the running batch, per client sidecar; never more in
    flight than now when the plan lowers the pod's rate (a few slow requests would read as a long time)."""
    if p.name in times and p.rate:
        in_flight = times[p.name] * p.rate * share / max(p.rate, share) if share > 0 else 0.0
    else:
        in_flight = share * fallback_time
    return float((1.0 + in_flight / clients) ** bias)


def _fraction(value: float | None) -> float | None:
    """A KV-cache usage as evidence: within 0 to 1, or missing."""
    return value if value is not None and 0.0 <= value <= 1.0 else None


def _sanitised(p: PodLoad) -> PodLoad:
    rate, ttft, queue, running = finite(p.rate), finite(p.ttft), finite(p.queue), finite(p.running)
    kv, capacity, idle = _fraction(finite(p.kv)), finite(p.previous_capacity), finite(p.previous_idle)
    evidence = (rate, ttft, queue, running, kv, capacity, idle)
    given = (p.rate, p.ttft, p.queue, p.running, p.kv, p.previous_capacity, p.previous_idle)
    if all(a is b for a, b in zip(evidence, given, strict=True)):
        return p  # already evidence (`_load` reads signals through `finite`): no copy
    return replace(
        p, rate=rate, ttft=ttft, queue=queue, running=running, kv=kv, previous_capacity=capacity, previous_idle=idle
    )


def carried_at(level: float, capacity: Sequence[float], idle: Sequence[float], cap: float) -> float:
    """The demand pods of these capacities and idle TTFTs carry at latency level `level` (`water_fill`'s model,
    none past `cap` of its capacity): the inverse of `water_level`."""
    return sum(min(cap * c, c * (1.0 - s / level)) for c, s in zip(capacity, idle, strict=True) if c > 0 and level > s)


def plan(
    pods: Sequence[PodLoad],
    smoothing: float,
    window: float,
    target_utilisation: float,
    client_sidecars: float,
    active_request_bias: float,
    demand: float | None = None,
) -> dict[str, PodHeadroom]:
    """Capacities, shares and relative weights for one subset of pods.

    `demand`: the request rate (requests/s) to share out, when it is not what these pods carried (the pods kept
    by `sluice.core.absorb` take part of it); default the fresh pods' observed rates.

    A pod without fresh evidence (frozen) keeps what it learned and gets no share: its weight is held by the
    caller, and its stale rate is not part of the demand the fresh pods' shares add up to. `active_request_bias`
    0 (consistent hash, which weighs proportionally) makes weights follow shares exactly.
    """
    if not pods:
        return {}
    pods = [_sanitised(p) for p in pods]
    estimates = estimate(pods, smoothing, window)
    # Pods of one class are planned with the class's capacity, idle TTFT and time in system unless they differ
    # beyond the noise; the pooled capacity is what is remembered, the idle TTFT stays the pod's own.
    pooling = pool_by_class(pods, estimates, window)
    for name, value in pooled_values(pooling, {n: e.capacity for n, e in estimates.items()}).items():
        estimates[name] = estimates[name]._replace(capacity=value)
    fresh = [p for p in pods if p.fresh]
    capacity = [max(0.0, estimates[p.name].capacity * p.health) for p in fresh]
    own_idle = {p.name: s for p in fresh if (s := estimates[p.name].idle) is not None and s > 0}
    class_idle = pooled_values(pooling, own_idle)
    idles = [class_idle.get(p.name) for p in fresh]
    known_idle = [s for s in idles if s is not None and s > 0]
    fallback_idle = statistics.median(known_idle) if known_idle else 1.0
    idle = [s if s is not None and s > 0 else fallback_idle for s in idles]
    if demand is None:
        demand = sum(p.rate for p in fresh if p.rate is not None and p.rate > 0)
    # With no traffic observed, plan for a trickle: the fastest pods take it first.
    planned_demand = demand if demand > 0 else TRICKLE * sum(capacity)
    shares = dict(
        zip([p.name for p in fresh], water_fill(planned_demand, capacity, idle, target_utilisation), strict=True)
    )
    # In flight at the planned rate: the running batch (the queue is what the plan removes).
    in_system = {p.name: p.running for p in fresh if p.rate is not None and p.rate > 0 and p.running is not None}
    times = {p.name: in_system[p.name] / (p.rate or 1.0) for p in fresh if p.name in in_system}
    fallback_time = statistics.median(times.values()) if times else 0.0
    own_divisor = {
        p.name: _model_divisor(p, shares.get(p.name, 0.0), times, fallback_time, client_sidecars, active_request_bias)
        for p in pods
    }
    # A pooled pod's divisor is its class's median one (each at its own planned rate, capped by what it runs now).
    divisors = pooled_values(pooling, own_divisor)
    out: dict[str, PodHeadroom] = {}
    for p in pods:
        value, idle_ttft, rho, source = estimates[p.name]
        share = shares.get(p.name, 0.0)
        divisor = divisors[p.name]
        pool = pooling.get(p.name)
        out[p.name] = PodHeadroom(
            estimate=value,
            learned=value if source in LEARNED_SOURCES else None,
            capacity=max(0.0, value * p.health),
            idle_ttft=idle_ttft,
            utilisation=rho,
            source=source,
            share=share,
            demand=demand,
            weight=share * divisor,
            kv=p.kv if p.fresh else None,
            pooled=pool.share if pool is not None else 0.0,
            class_size=len(pool.members) if pool is not None and pool.share > 0 else 0,
        )
    return out
