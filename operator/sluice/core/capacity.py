"""Learned capacity: what each pod can take (requests/s), from what it shows. Pure.

Utilisation ρ is read from the pod's evidence (`sluice.core.podload`). With ρ ≥ `INFORMATIVE` the capacity is
rate / ρ, a measurement, and only a measurement is remembered as learned; every measurement, the first one
included, moves the capacity from what was believed (the learned value, or the prior) at a gain that grows with
ρ, rising at `RISE` of the gain it falls with, and only while the pod shows load (`EVIDENCE_FROM`). Until a pod
has one, its capacity is a prior: the declared class K scaled by the pool's learned capacity per unit of K; while
nothing in the pool is learned yet, the pods carrying traffic without showing load are taken to be at most `SPARE`
loaded. With no rate anywhere yet, the capacities are K itself (unitless, "relative", never stored as requests/s).
The KV-cache usage u bounds the capacity from above at rate / u, and a cache with room lets a pod that shows no
load probe upwards (`PROBE`, `PROBE_ROOM`), one never measured from its prior. A learned capacity with no load
shown ages towards its prior (`AGEING`). Called by `sluice.core.headroom`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from sluice.core.podload import KV_ROOM, QUEUE_EVIDENCE, PodLoad, learn_idle, settled, utilisation

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
SAMPLES = 30
"""Completed requests in the window from which a pod's reading counts fully (fewer: proportionally less).
Provenance: hand-set, never swept."""

CapacitySource = Literal["measured", "learned", "ageing", "probing", "prior", "relative", "held"]
LEARNED_SOURCES = ("measured", "learned", "ageing", "probing", "held")
"""Sources whose capacity rests on a measurement (now or remembered): only these are stored as learned."""


def shows_load(rate: float, belief: float, queue: float | None, kv: float | None) -> bool:
    """Whether a reading may move `belief` (`EVIDENCE_FROM`): the pod carries half of it, queues or fills its
    cache. Below that a TTFT inflated by the prompt mix alone would read as load, lowering the belief, or raising
    it (rate / ρ exceeds the belief once the rate passes INFORMATIVE of it)."""
    return (
        rate >= EVIDENCE_FROM * belief
        or (queue is not None and queue >= QUEUE_EVIDENCE)
        or (kv is not None and kv >= KV_ROOM)
    )


class Estimate(NamedTuple):
    """What `estimate` finds for one pod."""

    capacity: float
    """Requests/s before health (unitless K while nothing has a rate: `relative`)."""
    idle: float | None
    """The pod's learned idle TTFT (seconds)."""
    utilisation: float | None
    """ρ read this pass, or None without a reading."""
    source: CapacitySource
    idle_samples: int | None = None
    """Completions the idle TTFT rests on (`sluice.core.podload.IDLE_SAMPLES`)."""


def estimate(pods: Sequence[PodLoad], smoothing: float, window: float) -> dict[str, Estimate]:
    """Per pod: capacity before health, idle TTFT, utilisation and where the capacity comes from.

    An observation rate / ρ counts in proportion to ρ (up to `CONFIDENT`): the busier the pod, the more its
    inflation says about its capacity; a lightly loaded pod's reading hardly moves what was learned. A pod's first
    measurement moves its prior the same way (when it has one). A KV-cache reading u >= INFORMATIVE bounds the
    capacity at rate / u: a belief above it falls towards it (at the gain of a reading of ρ = u), a rise never
    passes it, and a bound alone is no capacity to start from (`KV_ROOM`).
    """
    beliefs = _Beliefs()
    for p in pods:
        _take_evidence(beliefs, p, smoothing, window)
    prior_of = {p.name: p.prior for p in pods if p.prior > 0}
    start_per_k = _per_k(pods, beliefs.learned, prior_of)
    taught = any(n in prior_of for n in beliefs.learned)
    _start_from_priors(beliefs, prior_of, start_per_k)
    if taught:
        _probe_from_priors(beliefs, prior_of, start_per_k)
    per_k = _per_k(pods, beliefs.learned, prior_of)
    _age_towards_priors(beliefs, prior_of, per_k)
    return {p.name: _concluded(p, beliefs, per_k) for p in pods}


class _Reading(NamedTuple):
    """What one fresh pod's evidence says of its capacity this pass."""

    idle: float | None
    """Its learned idle TTFT, this pass's reading taken in (`learn_idle`)."""
    idle_samples: int | None
    rho: float | None
    """Its utilisation (`utilisation`), or None without a reading."""
    rate: float
    """Its completed requests/s (0 without a rate)."""
    observed: float | None
    """A measurement of its capacity, rate / ρ (from ρ ≥ INFORMATIVE)."""
    gain: float
    """How far `observed` moves a belief: with ρ (up to `CONFIDENT`) and the window's completions (`SAMPLES`)."""
    bound: float | None
    """The KV cache's upper bound on its capacity, rate / u (from u ≥ INFORMATIVE)."""
    bound_gain: float
    """How far `bound` moves a belief above it: as `gain`, at ρ = u."""


class _First(NamedTuple):
    """A pod measured for the first time: it moves its prior once the prior is known (`_start_from_priors`)."""

    observed: float
    gain: float
    rate: float
    rises: bool
    """Whether it may raise the prior (a KV bound alone only lowers it)."""


class _Note(NamedTuple):
    """What `estimate` reports of a pod besides its capacity: its idle TTFT, ρ, and where the capacity comes from."""

    idle: float | None
    rho: float | None
    source: CapacitySource
    idle_samples: int | None = None


@dataclass
class _Beliefs:
    """What `estimate` knows of the pods as it goes: learned capacities, and the pods left to a later step."""

    learned: dict[str, float] = field(default_factory=dict)
    unmeasured: list[PodLoad] = field(default_factory=list)
    """Pods with nothing learned, carrying traffic without showing load, their KV cache showing room."""
    first: dict[str, _First] = field(default_factory=dict)
    """Pods measured for the first time."""
    ageing: list[str] = field(default_factory=list)
    """Pods with a learned capacity and no load shown this pass."""
    notes: dict[str, _Note] = field(default_factory=dict)


def _read(p: PodLoad, smoothing: float, window: float) -> _Reading:
    rate = p.rate if p.rate is not None and p.rate > 0 else 0.0
    samples = None if p.rate is None else round(rate * window)  # unknown without a rate: as before
    loaded = (p.queue is not None and p.queue >= 1.0) or (p.kv is not None and p.kv >= KV_ROOM)
    idle, idle_samples = learn_idle(p.ttft, p.previous_idle, samples, p.previous_idle_samples, loaded)
    # TTFT inflation reads load only over a settled idle TTFT (the previous one, or this reading's first)
    against = p.previous_idle if p.previous_idle is not None else idle
    settled_before = settled(p.previous_idle_samples) if p.previous_idle is not None else settled(idle_samples)
    rho = utilisation(p.ttft, against if settled_before else None, p.queue)
    observed = rate / rho if rate > 0 and rho is not None and rho >= INFORMATIVE else None
    gain = (1.0 - smoothing) * min(1.0, (rho or 0.0) / CONFIDENT) * min(1.0, rate * window / SAMPLES)
    bound = rate / p.kv if rate > 0 and p.kv is not None and p.kv >= INFORMATIVE else None
    bound_gain = (1.0 - smoothing) * min(1.0, (p.kv or 0.0) / CONFIDENT) * min(1.0, rate * window / SAMPLES)
    return _Reading(idle, idle_samples, rho, rate, observed, gain, bound, bound_gain)


def _take_evidence(beliefs: _Beliefs, p: PodLoad, smoothing: float, window: float) -> None:
    """One pod's evidence: a frozen pod holds what it learned; a fresh one moves it (`_moved`), or is measured for
    the first time, or may probe from its prior."""
    if not p.fresh:
        if p.previous_capacity:
            beliefs.learned[p.name] = p.previous_capacity
        beliefs.notes[p.name] = _Note(p.previous_idle, None, "held", p.previous_idle_samples)
        return
    r = _read(p, smoothing, window)
    source: CapacitySource = "learned"
    if p.previous_capacity:
        value, source = _moved(p.previous_capacity, p, r)
        if source == "learned":
            beliefs.ageing.append(p.name)  # no load shown: what was learned holds, ageing towards the prior
        beliefs.learned[p.name] = max(value, r.rate)
    elif r.bound is not None and (r.observed is None or r.bound < r.observed):
        # Only a bound (or a bound under the TTFT reading): it may lower the prior; it raises it only as far
        # as a TTFT or queue reading says.
        beliefs.first[p.name] = _First(r.bound, r.bound_gain, r.rate, r.observed is not None)
        source = "measured"
    elif r.observed is not None:
        beliefs.first[p.name] = _First(r.observed, r.gain, r.rate, True)
        source = "measured"
    elif r.rate > 0 and r.rho is not None and r.rho < INFORMATIVE and _cache_room(p.kv, False):
        beliefs.unmeasured.append(p)
    beliefs.notes[p.name] = _Note(r.idle, r.rho, source, r.idle_samples)


def _moved(value: float, p: PodLoad, r: _Reading) -> tuple[float, CapacitySource]:
    """A learned capacity after this pass's reading: bounded by the KV cache, measured, probing upwards, or held
    ("learned": no load shown)."""
    if r.bound is not None and r.bound < value and (r.observed is None or r.bound < r.observed):
        # The KV cache proves the pod at least p.kv loaded: its capacity is at most rate / kv.
        return value + r.bound_gain * (r.bound - value), "measured"
    if r.observed is not None and shows_load(r.rate, value, p.queue, p.kv):
        if r.observed < value:
            return value + r.gain * (r.observed - value), "measured"
        if r.bound is not None:
            return value + r.gain * RISE * max(0.0, min(r.observed, r.bound) - value), "measured"
        return value + r.gain * RISE * (r.observed - value), "measured"
    if r.rate >= PROBE_FROM * value and r.rho is not None and r.rho < INFORMATIVE and _cache_room(p.kv, True):
        # Carrying most of what it is believed to take, and a reading shows no load: the belief is too low.
        return value * (1.0 + (PROBE if p.kv is None else PROBE_ROOM)), "probing"
    return value, "learned"


def _start_from_priors(beliefs: _Beliefs, prior_of: dict[str, float], start_per_k: float | None) -> None:
    """A first measurement starts from the pod's prior (the capacity per unit of K of what was learned before it)
    and moves like any later one: a low reading of a flat TTFT curve is not taken as the capacity at once."""
    for name, (observed, gain, rate, rises) in beliefs.first.items():
        if start_per_k is None or name not in prior_of:
            if rises:
                beliefs.learned[name] = observed
            continue  # a bound alone is no capacity to start from
        start = prior_of[name] * start_per_k
        if observed < start:
            beliefs.learned[name] = max(rate, start + gain * (observed - start))
        elif rises:
            beliefs.learned[name] = max(rate, start + gain * (observed - start) * RISE)
        # else: a KV bound above the prior says nothing the prior does not


def _probe_from_priors(beliefs: _Beliefs, prior_of: dict[str, float], start_per_k: float | None) -> None:
    """An unmeasured pod carrying most of its prior with no load shown and room in its KV cache probes from its
    prior: a pod whose TTFT stays flat until its cliff is otherwise never measured below it, and stays at K x
    what the other pods taught, however wrong K is. The cache stops the lift (`KV_ROOM`), a reading past
    INFORMATIVE or a queue then measures it. Only from a prior that rests on what the pool learned (the caller
    checks): the optimistic bound used before anything is (`SPARE`) is not persisted."""
    for p in beliefs.unmeasured:
        if start_per_k is None or p.name not in prior_of:
            continue
        rate = p.rate or 0.0
        start = prior_of[p.name] * start_per_k
        if rate >= PROBE_FROM * start:
            beliefs.learned[p.name] = max(rate, start * (1.0 + PROBE_ROOM))
            beliefs.notes[p.name] = beliefs.notes[p.name]._replace(source="probing")


def _age_towards_priors(beliefs: _Beliefs, prior_of: dict[str, float], per_k: float | None) -> None:
    """A learned capacity with no load shown moves `AGEING` of the way towards its prior."""
    if per_k is None:
        return
    for name in beliefs.ageing:
        if name in prior_of:
            beliefs.learned[name] += AGEING * (prior_of[name] * per_k - beliefs.learned[name])
            beliefs.notes[name] = beliefs.notes[name]._replace(source="ageing")


def _concluded(p: PodLoad, beliefs: _Beliefs, per_k: float | None) -> Estimate:
    """What was learned; else the prior, K x the pool's capacity per unit of K; else K itself (relative)."""
    idle, rho, source, samples = beliefs.notes[p.name]
    if p.name in beliefs.learned:
        return Estimate(beliefs.learned[p.name], idle, rho, source, samples)
    if per_k is not None:
        return Estimate(p.prior * per_k, idle, rho, "prior", samples)
    return Estimate(p.prior, idle, rho, "relative", samples)


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
