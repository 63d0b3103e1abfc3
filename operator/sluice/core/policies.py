"""Weight policies: what each pod of a revision subset is asked to weigh, before hysteresis, ramps, holds and the
floor (`sluice.core.allocation`). Pure.

`POLICIES` maps `scoring.policy` to its function: the cube scores each pod by (K / latency penalty)^sharpness
(`sluice.core.scoring`); headroom plans shares from learned capacities (`sluice.core.headroom`) and weighs a
zeroing against what the other pods can take (`sluice.core.absorb`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from sluice.api.v1alpha1 import ProtectionSpec, ScoringPolicy, ScoringSpec
from sluice.core.absorb import FROZEN, HOLDABLE, SLOWER, Candidate, Hold, Other, weigh
from sluice.core.capacity import INFORMATIVE, LEARNED_SOURCES, SAMPLES
from sluice.core.headroom import PodHeadroom, plan, weight_at
from sluice.core.podload import KV_ROOM, PodLoad, finite, utilisation
from sluice.core.verdicts import PodVerdict
from sluice.core.weights import scale


@dataclass(frozen=True)
class Targets:
    """What a weight policy asks for one revision subset, before `_weigh` applies hysteresis, ramps and holds."""

    weights: dict[str, int]
    """Pod -> the weight the policy scored (pods it leaves out keep theirs, `_weigh`)."""
    regroup: frozenset[str] = frozenset()
    """Pods whose weights were evened out within their class (`_unequal_equals`)."""
    headroom: dict[str, PodHeadroom] = field(default_factory=dict)
    """headroom only: each pod's learned capacity and planned share."""
    holds: dict[str, Hold] = field(default_factory=dict)
    """headroom only: zeroings weighed against the others' room (`sluice.core.absorb`)."""


@dataclass(frozen=True)
class Subset:
    """What a weight policy is asked about: one revision subset of the pool."""

    scoring: ScoringSpec
    protection: ProtectionSpec
    members: list[PodVerdict]
    """Every pod of the subset."""
    live: list[PodVerdict]
    """Its pods that are scored, ramping or frozen."""
    active_request_bias: float
    window: float
    """The metrics window (seconds)."""
    hashing: bool = False
    """The pool routes by consistent hash (`routing.sessionAffinity`): pods of a class are weighed alike
    (`_alike_in_class`)."""


Policy = Callable[[Subset], Targets]


def _cube(subset: Subset) -> Targets:
    """(K / latency penalty)^sharpness (`sluice.core.scoring`): frozen pods take part with their last score, so
    fresh pods are scaled on the same basis."""
    live = subset.live
    return Targets(scale({v.name: v.smoothed for v in live}, subset.scoring) if live else {})


def _headroom(subset: Subset) -> Targets:
    """Shares from learned capacities (`sluice.core.headroom`), zeroings weighed against what the others can take
    (`sluice.core.absorb`)."""
    scoring, protection, members, live = subset.scoring, subset.protection, subset.members, subset.live
    active_request_bias, window = subset.active_request_bias, subset.window
    if not live:
        return Targets({})

    def planned_for(pods: list[PodVerdict], demand: float | None = None) -> dict[str, PodHeadroom]:
        return plan(
            [_load(v) for v in pods],
            scoring.smoothing,
            window,
            scoring.target_utilization,
            scoring.client_sidecars,
            active_request_bias,
            demand=demand,
        )

    headroom = planned_for(live)
    # Frozen pods hold their weight (`_weigh`); only the fresh ones are planned and scaled.
    fresh = {v.name for v in live if v.kind != "frozen"}
    planned = {name: h.weight for name, h in headroom.items() if name in fresh}
    holds: dict[str, Hold] = {}
    if not protection.zero_when_others_full:
        holds = _weigh_zeroing(scoring, protection, members, headroom, window)
    held = {name for name, h in holds.items() if h.held}
    weighed = {name for name in held if not holds[name].frozen}
    if not weighed and _quiet([h for name, h in headroom.items() if name in fresh]):
        return _by_latency(subset, headroom, holds)
    if weighed:
        # The others are planned for what they can take; the held pods keep the rest, in the same units.
        rest = [v for v in live if v.name not in held]
        kept = sum(holds[name].share for name in held)
        carried = sum(_rate(v) for v in members if v.name in held or (v.name in fresh and v.name not in held))
        headroom = {**headroom, **planned_for(rest, max(0.0, carried - kept))} if rest else headroom
        planned = {v.name: headroom[v.name].weight for v in rest if v.name in fresh}
        per_share = _weight_per_share([headroom[n] for n in planned])
        live_names = {v.name for v in live}
        loads = [_load(v) for v in members if v.name in weighed or v.name in live_names]
        planned.update({name: _held_weight(holds[name], name, per_share, loads, subset) for name in weighed})
    if subset.hashing:
        planned = _alike_in_class(planned, live, held)
    scaled = scale(planned, scoring) if planned else {}
    regroup = _unequal_equals([v for v in live if v.name not in held], scaled)
    targets = _smoothed(scoring, [v for v in live if v.name not in regroup and v.name not in held], scaled)
    return Targets(targets, frozenset(regroup), headroom, holds)


def _quiet(rows: list[PodHeadroom]) -> bool:
    """Whether no fresh pod of the subset shows load: none read at `INFORMATIVE` or more (TTFT inflation over a
    settled idle TTFT, or a queue), none with its KV cache past `KV_ROOM`, and, once anything is learned, the
    demand within INFORMATIVE of the capacity planned with. Not before any rate is seen (K alone ranks nothing)."""
    if not rows or any(h.source == "relative" for h in rows):
        return False
    if any((h.utilisation or 0.0) >= INFORMATIVE or (h.kv or 0.0) >= KV_ROOM for h in rows):
        return False
    if any(h.source in LEARNED_SOURCES for h in rows):
        return rows[0].demand <= INFORMATIVE * sum(h.capacity for h in rows)
    return True


def _by_latency(subset: Subset, headroom: dict[str, PodHeadroom], holds: dict[str, Hold]) -> Targets:
    """headroom while no pod shows load (`_quiet`): the cube's weights (`_cube`).

    A pool this lightly loaded shows nothing to plan capacities with: before anything is learned they are priors
    (K scaled by what the pods carry, taken as at most SPARE loaded), and the M/M/1 level the water-fill plans the
    fast pods at lets slower pods in whose idle tail is above the fast pods' loaded one. The latency ranking keeps
    traffic on the fast pods (seed-000 at 20 %: P99 376 -> 345 ms, the cube's figure). The first load shown ends
    it. The score each pod was weighed by is given in its reason (`PodHeadroom.by_latency`); the row's score stays
    the capacity planned with, which the cube's smoothing starts from (keeping the cube's own score in the row
    instead was measured and dropped: docs/benchmarks.md, "A quiet pool ranked by latency")."""
    by_latency = {v.name: v.smoothed for v in subset.live}
    headroom = {name: replace(h, by_latency=by_latency.get(name)) for name, h in headroom.items()}
    if subset.hashing:
        ranked = _alike_in_class({n: float(w) for n, w in _cube(subset).weights.items()}, subset.live, set())
        return Targets(scale(ranked, subset.scoring), frozenset(), headroom, holds)
    return Targets(_cube(subset).weights, frozenset(), headroom, holds)


def _alike_in_class(planned: dict[str, float], live: list[PodVerdict], held: set[str]) -> dict[str, float]:
    """Under consistent hashing, each scored pod of a hardware class planned at its class's median weight.

    What a pod carries under a hash ring is what the sessions hashed to it bring, so identical pods show unequal
    load, TTFT and prefix-cache hits, and the plan weighs them apart; every published change rebuilds every
    Envoy's ring and moves sessions away from their cached prefixes (on chat-sessions at 50 % of capacity
    the weights of four identical A100s swung 500-1000 every few passes: P99 316 ms against 274 ms with equal
    weights, the hit rate 0.81 against 0.84; docs/benchmarks.md, "Prefix reuse"). Across classes the plan stands;
    a momentary imbalance within a class is bounded load's to spill (`sessionAffinity.hashBalanceFactor`). A pod
    held, ramping, zeroed or frozen keeps its own weight. What this gives up: a pod slower than its class (a
    throttled node) is weighed as its class, until its errors or checks take it out."""
    classes: dict[str, list[str]] = {}
    for v in live:
        if v.name in planned and v.name not in held and v.kind == "scored" and v.hardware_class is not None:
            classes.setdefault(v.hardware_class, []).append(v.name)
    out = dict(planned)
    for names in classes.values():
        median = statistics.median(planned[n] for n in names)
        out.update(dict.fromkeys(names, median))
    return out


POLICIES: dict[ScoringPolicy, Policy] = {"cube": _cube, "headroom": _headroom}
"""`scoring.policy` -> the function that asks for each pod's weight."""


def _rate(verdict: PodVerdict) -> float:
    rate = finite(verdict.signals.request_rate)
    return rate if rate is not None and rate > 0 else 0.0


def _held_weight(hold: Hold, name: str, per_share: float, loads: list[PodLoad], subset: Subset) -> float:
    """A held pod's weight: its overflow share at the others' weight per req/s (a tenth of their weight per unit
    of capacity), a larger share at the weight that gives it that rate at its own time in system."""
    valve = hold.valve * per_share
    if hold.share <= hold.valve:
        return valve
    own = weight_at(loads, name, hold.share, subset.scoring.client_sidecars, subset.active_request_bias)
    return max(valve, own)


def _weight_per_share(planned: list[PodHeadroom]) -> float:
    """The plan's weight per requests/s (its divisor for the actives), the median over the pods given a share."""
    ratios = sorted(h.weight / h.share for h in planned if h.share > 0 and h.weight > 0)
    return ratios[len(ratios) // 2] if ratios else 1.0


def _class_capacity(
    hardware_class: str | None, members: list[PodVerdict], headroom: dict[str, PodHeadroom]
) -> float | None:
    """The median learned capacity of the normally scored pods of a hardware class (None without one)."""
    if hardware_class is None:
        return None
    values = sorted(
        h.estimate
        for v in members
        if v.kind == "scored"
        and v.hardware_class == hardware_class
        and (h := headroom.get(v.name)) is not None
        and h.source in LEARNED_SOURCES
    )
    return values[len(values) // 2] if values else None


def _evidence_since_incident(verdict: PodVerdict) -> bool:
    """Whether the pod's samples postdate the pass that saw its incident (never on that pass itself), or the pod
    has been held since before it: its errors went on past the rate window and the same incident fired again, on
    a pod read pass after pass since the first (a new incident would otherwise zero it for a scrape)."""
    prev, incident = verdict.previous, verdict.memory.last_incident_at
    same = prev is not None and prev.capacity_held and prev.incident == verdict.memory.incident
    held_since = prev.held_since if same and prev is not None else None
    if held_since is not None and incident is not None and held_since < incident:
        return True
    if verdict.new_incident:
        return False
    at = verdict.sampled_at
    return at is None or incident is None or at > incident


def _in_system(verdict: PodVerdict, window: float) -> float | None:
    """Seconds a request spends on the pod: (running + waiting) / completed rate (Little's law), or None with
    fewer than `SAMPLES` completions in the window (a pod given a trickle read 30 s from 1.5 running over 3
    completions, and was zeroed as slowed down)."""
    running, rate = finite(verdict.signals.running_requests), _rate(verdict)
    if running is None or rate <= 0 or rate * window < SAMPLES:
        return None
    return (running + (finite(verdict.signals.queue_length) or 0.0)) / rate


def _still_failing(verdict: PodVerdict) -> bool:
    """Whether the pod's failures go on this pass: errors, LoRA load failures, or every health band missed."""
    errors, lora = finite(verdict.signals.error_rate), finite(verdict.signals.lora_failure_rate)
    return bool((errors or 0.0) > 0 or (lora or 0.0) > 0 or verdict.score.below_bands)


def _inflation(ttft: float | None, idle: float | None) -> float | None:
    ttft = finite(ttft)
    return ttft / idle if ttft is not None and idle is not None and idle > 0 else None


def _weigh_zeroing(
    scoring: ScoringSpec,
    protection: ProtectionSpec,
    members: list[PodVerdict],
    headroom: dict[str, PodHeadroom],
    window: float,
) -> dict[str, Hold]:
    """headroom: each pod zeroed or ramping after an incident that leaves it serving, weighed against the room of
    the subset's normally scored pods (`sluice.core.absorb`)."""
    candidates: list[Candidate] = []
    frozen: dict[str, Hold] = {}
    any_scored = any(v.kind == "scored" for v in members)
    scored = [v for v in members if v.kind == "scored" and v.name in headroom]
    # Priors extrapolate what the pool learned (K x capacity per unit of K); with nothing learned among the others
    # (or only relative shares), there is no capacity to weigh on, only the priors' proportions.
    sources = [headroom[v.name].source for v in scored]
    unknown = "relative" in sources or not any(source in LEARNED_SOURCES for source in sources)
    for v in members:
        if v.kind not in ("quiet", "ramping") or v.memory.incident not in HOLDABLE:
            continue
        if v.previous is not None and v.previous.capacity_held and (not v.evidence or not any_scored):
            frozen[v.name] = FROZEN  # held before; nothing fresh to weigh on this pass
            continue
        candidates.append(_candidate(v, members, headroom, unknown, window))
    if not candidates:
        return frozen
    others = [Other(headroom[v.name].capacity, headroom[v.name].idle_ttft, _rate(v)) for v in scored]
    inflations = [
        i for v in scored if (i := _inflation(v.signals.ttft_p95_seconds, headroom[v.name].idle_ttft)) is not None
    ]
    times = [t for v in scored if (t := _in_system(v, window)) is not None]
    return frozen | weigh(
        candidates,
        None if unknown else others,
        max(inflations) if inflations else None,
        scoring.target_utilization,
        protection.absorb_ttft_percent / 100.0,
        max(times) if times else None,
        priors=others if unknown else None,
    )


def _candidate(
    v: PodVerdict, members: list[PodVerdict], headroom: dict[str, PodHeadroom], unknown: bool, window: float
) -> Candidate:
    """A pod zeroed or ramping after an incident that leaves it serving, as the weighing sees it."""
    h = headroom.get(v.name)
    prev = v.previous
    capacity, idle = _capacity_and_idle(v, h, members, headroom, unknown)
    floor = h.share * (v.ramp_percent or 0.0) / 100.0 if h is not None and v.kind == "ramping" else 0.0
    return Candidate(
        name=v.name,
        rate=_rate(v),
        error_rate=finite(v.signals.error_rate),
        inflation=_inflation(v.signals.ttft_p95_seconds, idle),
        in_system=_in_system(v, window),
        evidence_since_incident=_evidence_since_incident(v),
        capacity=capacity,
        idle=idle,
        floor=floor,
        ramping=v.kind == "ramping",
        held_before=prev is not None and prev.capacity_held,
        still_failing=_still_failing(v),
    )


def _capacity_and_idle(
    v: PodVerdict, h: PodHeadroom | None, members: list[PodVerdict], headroom: dict[str, PodHeadroom], unknown: bool
) -> tuple[float | None, float | None]:
    """A candidate's capacity (learned, remembered, its class's, or its prior where only priors are known), bounded
    by what its own reading shows now, and its idle TTFT."""
    prev = v.previous
    if h is not None:
        capacity = h.estimate if h.source in LEARNED_SOURCES else None
        idle = h.idle_ttft
    else:
        capacity = finite(prev.learned_capacity) if prev is not None else None
        idle = finite(prev.idle_ttft_seconds) if prev is not None else None
    if capacity is None:
        # zeroed before it learned one: its hardware class's, as the others of the class learned it
        capacity = _class_capacity(v.hardware_class, members, headroom)
    if capacity is None and unknown and h is not None:
        capacity = h.estimate  # a prior, in the priors' units: only the overflow share's proportion
    if capacity is None and unknown:
        capacity = _prior_like_the_others(v, members, headroom)
    # what its own reading shows now bounds it: a node that slowed down reads loaded at a rate it used to
    # carry easily, and is held within the target of what it takes now, not of what it once learned
    rho = utilisation(finite(v.signals.ttft_p95_seconds), idle, finite(v.signals.queue_length))
    if capacity is not None and rho is not None and rho >= INFORMATIVE and _rate(v) > 0:
        shows = _rate(v) / rho
        if shows * SLOWER < capacity:  # beyond a reading's noise: it lost a third of it or more
            capacity = shows
    return capacity, idle


def _prior_like_the_others(v: PodVerdict, members: list[PodVerdict], headroom: dict[str, PodHeadroom]) -> float | None:
    """A pod zeroed before anything was learned (so not planned this pass): its prior in the others' units, its K
    at their median prior per unit of K. Without it the overflow share had no proportion, and the pod was zeroed
    outright (\"it has no learned capacity\") where the others' room was never weighed."""
    per_k = sorted(
        headroom[o.name].estimate / o.capacity
        for o in members
        if o.kind == "scored" and o.name in headroom and o.capacity > 0 and headroom[o.name].source != "relative"
    )
    return v.capacity * per_k[len(per_k) // 2] if per_k and v.capacity > 0 else None


def _unequal_equals(live: list[PodVerdict], targets: dict[str, int]) -> set[str]:
    """headroom: scored pods the plan weighs equally whose published weights differ: they are published equal.

    Envoy's least-request balances equal weights by the power of two choices on live active counts, unequal ones by
    an EDF schedule whose weights are re-read only when a host is picked, which spreads queueing less evenly. Pods
    the plan cannot tell apart (one hardware class, pooled) would otherwise keep weights a few percent apart for
    good: smoothing moves each a share of the way to the plan, and hysteresis then holds any step below its
    threshold. Returns the pods whose smoothing and hysteresis are skipped this pass (once: their weights are then
    equal and move together)."""
    groups: dict[int, list[PodVerdict]] = {}
    for v in live:
        if v.kind == "scored" and v.name in targets and v.previous is not None and v.previous.state == "Routable":
            groups.setdefault(targets[v.name], []).append(v)
    out: set[str] = set()
    for group in groups.values():
        if len(group) >= 2 and len({v.previous.weight for v in group if v.previous is not None}) > 1:
            out.update(v.name for v in group)
    return out


def _smoothed(scoring: ScoringSpec, live: list[PodVerdict], targets: dict[str, int]) -> dict[str, int]:
    """headroom: weights move `1 - smoothing` of the way to the plan each pass (shares follow a noisy window).

    A recovering pod is not blended: its ramp is its smoothing (blending its ramped weight into the target would
    slow the documented ramp and show a lower scored weight than planned)."""
    out = dict(targets)
    for v in live:
        previous = v.previous
        ran_headroom = previous is not None and (
            previous.learned_capacity is not None or previous.idle_ttft_seconds is not None
        )
        if ran_headroom and previous is not None and previous.weight > 0 and v.kind == "scored" and v.name in out:
            blended = scoring.smoothing * previous.weight + (1.0 - scoring.smoothing) * out[v.name]
            out[v.name] = min(scoring.max_weight, max(scoring.min_weight, round(blended)))
    return out


def _load(verdict: PodVerdict) -> PodLoad:
    previous = verdict.previous
    # What was learned is marked explicitly (`learned_capacity`): engines without a TTFT signal keep it too, and
    # a prior or a cube score is never read back as a measurement. A NaN or infinite signal is missing.
    signals = verdict.signals
    return PodLoad(
        name=verdict.name,
        prior=verdict.capacity,
        rate=finite(signals.request_rate),
        ttft=finite(signals.ttft_p95_seconds),
        queue=finite(signals.queue_length),
        running=finite(signals.running_requests),
        kv=finite(signals.kv_cache_usage),
        health=verdict.score.band_factor,
        previous_capacity=finite(previous.learned_capacity) if previous is not None else None,
        previous_idle=finite(previous.idle_ttft_seconds) if previous is not None else None,
        previous_idle_samples=previous.idle_ttft_samples if previous is not None else None,
        fresh=verdict.kind != "frozen",
        hardware_class=verdict.hardware_class,
    )


__all__ = ["POLICIES", "Policy", "Subset", "Targets"]
