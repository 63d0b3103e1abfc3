"""Weighing a protective zeroing against what the rest of the subset can absorb. Pure.

Zeroing a pod that still serves most of its requests moves its share onto the others. When they cannot take it
within `scoring.targetUtilization` of their learned capacity and `protection.absorbTtftPercent` of their
modelled TTFT, the zeroing costs every request the queueing it causes, to save a fraction of the pod's: three
L40S, one failing 30 % of its requests at 70 % load, zeroed, left the two others at 105 % of their capacity
(P99 TTFT 20x least-request's). So, under the headroom policy (the one that knows capacities), a pod zeroed or
ramping after an error-rate, LoRA-failure or consecutive-failure incident stays ("held") when the others cannot
take its share within those bounds: it keeps what would take them past halfway from the target to saturation, and
at least an overflow share (`OVERFLOW`, a tenth of the others' weight, so Envoy's least-request sends it requests
mostly when the others are busy), when the evidence says holding it serves:

- it still serves most of its requests (error rate below `SERVES_MOST`);
- it is not slow: its TTFT p95 over its own idle TTFT is within `SLOWER` of the highest of the others', and so is
  the time a request spends on it (running and waiting over its rate: a slowdown shows there a scrape after it
  begins, before the slow first tokens reach the TTFT histogram) (a node that slowed down 4x queues whatever it
  keeps: it is zeroed, its share is better queued on the others);
- a scrape since the incident began shows it (or it has been held since before the incident fired again); until
  then it keeps only what would take the others past halfway from the target to their whole capacity, and its
  overflow share (on 5 s scrapes a node slowed 5x, held on the pass that saw its errors, doubled the incident's
  P99 before its TTFT showed the slowdown; zeroing for a scrape at 120 % took the queue minutes to drain, and at
  105 % cost failing-pod-tuning's 70 % point its tail);
- it has a learned capacity, and keeps at most `targetUtilization` of it — or of what its own reading shows it
  takes now (rate / ρ) when that is a third less: a node that slowed down 4x, held within what it once learned,
  took the held-out degrading-node's P99 at 70 % from 2775 to 4872 ms; a pod ramping back from a zeroing keeps
  its ramp and the overflow share, and more only if it was held before, then at most a little more than it
  carried (`KEEP_GROWTH`).

A held share is published at the weight that gives the pod that rate at its own time in system
(`sluice.core.headroom.weight_at`), its overflow share at the others' weight per req/s (a tenth of their weight).

The frontier of fixed weights on a failing pod (`benchmarks/bench_failing_frontier.py`) is what set this: the
others carried up to about 90 % of their capacity at no P99 cost past 4-9 % while the pod, at a tenth of their
weight, took their bursts; removing it cost 1.2-1.4x least-request's P99 even at 30-50 % load.

OOM kills, restarts and not-Ready pods leave at once (they cannot serve); with no capacity learned among the
others (a lightly loaded pool) nothing is weighed and a pod read since its incident keeps only its overflow share
(`_overflow_only`); the cube policy knows no capacity and zeroes. `protection.zeroWhenOthersFull` restores
zeroing whatever the cost. Called by `sluice.core.policies`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from sluice.core.waterfill import carried_at, water_level

HOLDABLE = ("ErrorRate", "LoraFailures", "ConsecutiveFailures")
"""Incidents after which the pod still serves: its zeroing is weighed. OOMKilled and Restarted are not."""
SERVES_MOST = 0.5
"""A pod failing this share of its requests or more is zeroed whatever the others' load: it no longer serves most
of what it is sent. Hand-set from the issue's definition ("pods that still serve most requests"), not swept."""

OVERFLOW = 0.1
"""A held pod keeps at least this share of what the others would carry per req/s of capacity, at its own capacity
(about this share of their weight): at a tenth of the others' weight, Envoy's least-request (EDF over weight /
(active + 1)) sends it requests mostly when the others are busy, so it takes their bursts and few requests
besides. Chosen on failing-pod-tuning's frontier of fixed weights (`benchmarks/bench_failing_frontier.py`, 5
seeds, weights 0-1 of the others'): 0.05 and 0.1 met both failing-pod targets at 30 / 50 / 70 % load, 0.1 with
the better P99 at 70 / 80 %; removing the pod cost 1.35-1.39x least-request's P99 at 30-50 % (two pods left for
the prefill collisions of three), 0.2 and above left the errors above half of least-request's. Reported on the
held-out failing-pod."""
KEEP_GROWTH = 0.1
"""A held pod ramping back keeps at most what it carried over the window plus this share (per pass): a hold
keeps a share, it never hands a recovering pod more than it has shown it takes at once (a node slowed 5x,
ramping back after its zeroing, was held at 3.0 req/s when it carried 1.7 in an early version, and its queue ran
away). Hand-set, not swept."""
SLOWER = 1.5
"""A pod whose TTFT inflation (p95 over its idle) is more than this times the others' highest is slow, not only
failing: it is zeroed. A window's p95 varies by tens of percent between identical pods; the slowed-down nodes of
the degrading scenarios read 4-5x. Hand-set between the two, not swept."""


@dataclass(frozen=True)
class Candidate:
    """A pod sluice would zero (or ramp) after an incident that leaves it serving."""

    name: str
    rate: float
    """Requests/s it carried over the window (completed)."""
    error_rate: float | None
    inflation: float | None
    """TTFT p95 over its learned idle TTFT (None without both)."""
    capacity: float | None
    """Its learned capacity (requests/s), None while only a prior is known."""
    idle: float | None = None
    """Its learned idle TTFT (seconds)."""
    floor: float = 0.0
    """Requests/s it keeps anyway (a ramping pod's ramp share): held only when the others need more of it."""
    in_system: float | None = None
    """Seconds a request spends on it (running and waiting over its rate, Little's law): a slowdown shows here at
    the next scrape, before the slow requests' first tokens reach the TTFT histogram."""
    evidence_since_incident: bool = True
    """Its samples were scraped after the pass that saw its incident: a slowdown that came with the errors has
    had a scrape to show (errors return at once, slow first tokens and a growing batch only later)."""
    ramping: bool = False
    held_before: bool = False
    still_failing: bool = True
    """Its errors (or LoRA load failures, or failed checks) go on: only such a pod keeps an overflow share; one whose
    failures stopped comes back by its recovery ramp."""
    """Held by the previous pass: only such a pod is held while it ramps (a pod zeroed and ramping back is
    judged by its ramp, not given more than it shows it can take)."""


@dataclass(frozen=True)
class Other:
    """A pod of the subset scored normally: what it can take."""

    capacity: float
    """Requests/s (learned, or the prior the pool's learned capacities extrapolate), health applied."""
    idle: float | None
    rate: float


@dataclass(frozen=True)
class Hold:
    """The verdict of the weighing on one candidate: `share` requests/s kept (0: zeroed), and why."""

    share: float
    """Requests/s kept on the pod beyond its ramp; 0: not held (zeroed, or its ramp as it is)."""
    others_load: float | None
    """The others' utilisation if they took every candidate's share (None: unknown, nothing weighed)."""
    ceiling: float
    why: str
    frozen: bool = False
    """Held before, and this pass has no fresh evidence to weigh on: its last weight is kept."""
    valve: float = 0.0
    """Its overflow share (requests/s; 0: none). The caller publishes it at the others' weight per req/s (a tenth
    of their weight per unit of capacity), and a larger `share` at the weight that gives the pod that rate at its
    own time in system, never below the valve's."""

    @property
    def held(self) -> bool:
        return self.share > 0 or self.frozen

    def explain(self) -> str:
        return self.why


def weigh(
    candidates: Sequence[Candidate],
    others: Sequence[Other] | None,
    others_inflation: float | None,
    ceiling: float,
    tolerance: float,
    others_in_system: float | None = None,
    priors: Sequence[Other] | None = None,
) -> dict[str, Hold]:
    """What each candidate keeps: the share the others cannot take within `ceiling` of their capacity, nor
    without their modelled TTFT rising more than `tolerance` (a fraction) over the level a healthy pool would
    serve the same demand at.

    The model is the headroom plan's (`sluice.core.waterfill.water_fill`: T_i = s_i / (1 - x_i / mu_i), every
    loaded pod at one level L): the reference level is the pool's with the candidates taking part at their
    learned capacities; the others may carry what they carry at (1 + tolerance) x that level. What the others
    cannot take is spread over the candidates that may be held, in proportion to their learned capacities, each
    within `ceiling` of its own (a ramping one also within `KEEP_GROWTH` of what it carried); one without a sample
    since its incident only what would take the others past halfway from `ceiling` to saturation. `others` is None
    when none of them has learned a capacity: nothing is weighed, and with their `priors` a pod read since its
    incident keeps only its overflow share (`_overflow_only`).
    """
    if not candidates:
        return {}
    if others is None and priors:
        return _overflow_only(candidates, priors, others_inflation, ceiling, others_in_system)
    capacity = sum(o.capacity for o in others) if others else 0.0
    if others is None or capacity <= 0:
        why = "nothing weighed: no capacity learned among the other pods" if others is None else ""
        why = why or "nothing weighed: no other pod to take its share"
        return {c.name: Hold(0.0, None, ceiling, why) for c in candidates}
    room = _others_room(candidates, others, capacity, ceiling, tolerance)
    if room.need <= 1e-9:
        return {c.name: Hold(0.0, room.load, ceiling, f"{room.at} (within {room.bounds})") for c in candidates}
    out, groups = _sorted(candidates, room, others_inflation, others_in_system)
    shares, overflow, valves = _kept_shares(candidates, groups, room)
    for c in candidates:
        if c.name in groups.able or c.name in groups.unproven or c.name in groups.overflow_only:
            out[c.name] = replace(_held(c, groups, room, shares, overflow), valve=valves.get(c.name, 0.0))
    return out


@dataclass(frozen=True)
class _Room:
    """What the others can take of the demand, in the plan's model, and how it reads."""

    demand: float
    """Requests/s the others and the candidates carried."""
    capacity: float
    """The others' capacity (requests/s)."""
    ceiling: float
    need: float
    """Requests/s the others cannot take within `ceiling` and the TTFT tolerance."""
    load: float
    """The others' utilisation if they took every candidate's share."""
    at: str
    bounds: str


def _others_room(
    candidates: Sequence[Candidate], others: Sequence[Other], capacity: float, ceiling: float, tolerance: float
) -> _Room:
    """The others' room: within `ceiling` of their capacity, and at most (1 + tolerance) x the latency level of the
    healthy pool (the candidates taking part at their learned capacities)."""
    demand = sum(o.rate for o in others) + sum(c.rate for c in candidates)
    known = [o.idle for o in others if o.idle is not None and o.idle > 0]
    fallback = statistics.median(known) if known else 1.0
    caps = [o.capacity for o in others]
    idles = [o.idle if o.idle is not None and o.idle > 0 else fallback for o in others]
    learned = [c for c in candidates if c.capacity is not None and c.capacity > 0]
    all_caps = caps + [c.capacity or 0.0 for c in learned]
    all_idles = idles + [c.idle if c.idle is not None and c.idle > 0 else fallback for c in learned]
    healthy = water_level(demand, all_caps, all_idles, ceiling) if demand < ceiling * sum(all_caps) else math.inf
    alone = water_level(demand, caps, idles, ceiling) if demand < ceiling * capacity else math.inf
    room = ceiling * capacity
    if math.isfinite(healthy) and healthy > 0:
        room = min(room, carried_at((1.0 + tolerance) * healthy, caps, idles, ceiling))
    load = demand / capacity
    at = f"the other pods would be at {load:.0%} of their capacity"
    if math.isfinite(alone) and math.isfinite(healthy) and healthy > 0:
        at += f", their TTFT +{alone / healthy - 1.0:.0%}"
    bounds = f"targetUtilization {ceiling:.0%}, absorbTtftPercent {tolerance:.0%}"
    return _Room(demand, capacity, ceiling, demand - room, load, at, bounds)


class _Groups(NamedTuple):
    """The candidates that may keep a share, by how."""

    able: dict[str, float]
    """Read since its incident and not refused: the most it may keep (requests/s)."""
    unproven: dict[str, float]
    """No sample since its incident yet: the most it may keep."""
    overflow_only: set[str]
    """Ramping back, not held before: its ramp stands, and it may keep its overflow share."""


def _sorted(
    candidates: Sequence[Candidate], room: _Room, others_inflation: float | None, others_in_system: float | None
) -> tuple[dict[str, Hold], _Groups]:
    """The refused candidates' holds (zeroed), and the others grouped by what they may keep."""
    out: dict[str, Hold] = {}
    groups = _Groups({}, {}, set())
    for c in candidates:
        refusal = _refusal(c, others_inflation, others_in_system)
        own = room.ceiling * (c.capacity or 0.0)
        if refusal:
            out[c.name] = Hold(0.0, room.load, room.ceiling, f"{room.at}, but {refusal}")
        elif not c.evidence_since_incident:
            groups.unproven[c.name] = own
        elif c.ramping and not c.held_before:
            groups.overflow_only.add(c.name)  # its ramp stands; read not slow, it may keep its overflow share
        else:
            groups.able[c.name] = min(own, (1.0 + KEEP_GROWTH) * c.rate) if c.ramping else own
    return out, groups


def _kept_shares(
    candidates: Sequence[Candidate], groups: _Groups, room: _Room
) -> tuple[dict[str, float], set[str], dict[str, float]]:
    """Requests/s each candidate keeps, which of them keep it as overflow, and each one's overflow share.

    Until a scrape since the incident shows whether it slowed down too, a pod keeps only what would take the
    others past halfway from the target to their whole capacity (90 % at the default target): at 87 % they queue
    for a scrape and recover; at 105-120 % the queue a scrape builds takes minutes to drain. The rest is what the
    others cannot take within that same halfway mark. A pod still failing keeps an overflow share (`OVERFLOW`)
    whatever they could take, read since its incident or not: at a tenth of their weight a pod that slowed down
    too gets requests mostly when they are busy, and zeroing it for a scrape left three L40S at 105 % of their
    capacity on failing-pod-tuning at 70 % (their capacities, probed at light load, read 81 %). Keeping the share
    only when the others read past their target (so, there, not on every seed) gave 1.08x least-request's P99 and
    0.58x its errors there; always, 1.07x and 0.54x; zeroing, 1.09x and 0.63x."""
    by_name = {c.name: c for c in candidates}
    demand, capacity, ceiling = room.demand, room.capacity, room.ceiling
    beyond = max(0.0, demand - (1.0 + ceiling) / 2.0 * capacity)
    shares = _spread(beyond, groups.unproven)
    shares |= _spread(max(0.0, beyond - sum(shares.values())), groups.able)
    overflow: set[str] = set()
    valves: dict[str, float] = {}
    for name in [*groups.able, *groups.unproven, *groups.overflow_only]:
        if not by_name[name].still_failing:
            continue
        # a tenth of the others' weight: of what they would carry per req/s of capacity, at its own capacity
        own = by_name[name].capacity or 0.0
        valve = OVERFLOW * demand / capacity * own
        if valve > ceiling * own:
            continue
        valves[name] = valve
        if valve > shares.get(name, 0.0):
            shares[name] = valve
            overflow.add(name)
    return shares, overflow, valves


def _held(c: Candidate, groups: _Groups, room: _Room, shares: dict[str, float], overflow: set[str]) -> Hold:
    """One candidate's hold: its share when it exceeds what its ramp keeps, else zeroed (or its ramp as it is)."""
    at, load, ceiling = room.at, room.load, room.ceiling
    if c.name in groups.overflow_only and c.name not in overflow:
        return Hold(0.0, load, ceiling, f"{at}, but it is ramping back from a zeroing: its ramp stands")
    share = shares[c.name]
    if share > c.floor:
        kept = " as overflow" if c.name in overflow else ""
        why = f"held at {share:.2f}/s (it carried {c.rate:.2f}/s){kept}: {at} ({room.bounds})"
        if c.name in groups.unproven and c.name not in overflow:
            why += "; no sample since its incident yet: only what would take them past halfway to saturation"
        elif c.name in groups.unproven:
            why += "; no sample since its incident yet: no more than its overflow share"
        return Hold(share, load, ceiling, why)
    if c.name in groups.unproven:
        return Hold(0.0, load, ceiling, f"{at}, and no sample since its incident yet: zeroed until one")
    return Hold(0.0, load, ceiling, f"{at}; its ramp already keeps what they cannot take")


def _overflow_only(
    candidates: Sequence[Candidate],
    priors: Sequence[Other],
    others_inflation: float | None,
    ceiling: float,
    others_in_system: float | None,
) -> dict[str, Hold]:
    """Nothing learned among the others (a lightly loaded pool shows too little load to learn from): no share is
    weighed, but a pod read since its incident that is not refused keeps the overflow share, at the proportions of
    the priors (its capacity is its prior here). Removing one of three pods cost 1.35x least-request's P99 at
    30 % load on failing-pod-tuning, a tenth of the others' weight 1.09x."""
    capacity = sum(o.capacity for o in priors)
    demand = sum(o.rate for o in priors) + sum(c.rate for c in candidates)
    unknown = "nothing learned among the other pods to weigh its share on"
    out: dict[str, Hold] = {}
    for c in candidates:
        refusal = _refusal(c, others_inflation, others_in_system)
        valve = OVERFLOW * demand / capacity * (c.capacity or 0.0) if capacity > 0 and c.still_failing else 0.0
        if refusal:
            out[c.name] = Hold(0.0, None, ceiling, f"{unknown}, and {refusal}")
        elif not c.evidence_since_incident:
            out[c.name] = Hold(0.0, None, ceiling, f"{unknown}, and no sample since its incident yet: zeroed until one")
        elif valve > c.floor:
            out[c.name] = Hold(
                valve,
                None,
                ceiling,
                f"held at {valve:.2f}/s (it carried {c.rate:.2f}/s) as overflow: {unknown}",
                valve=valve,
            )
        elif not c.still_failing:
            out[c.name] = Hold(0.0, None, ceiling, f"{unknown}; its failures stopped: its ramp stands")
        else:
            out[c.name] = Hold(0.0, None, ceiling, f"{unknown}; its ramp already keeps its overflow share")
    return out


FROZEN = Hold(0.0, None, 0.0, "no fresh signals to weigh on: held weight frozen at its last value", frozen=True)


def _refusal(c: Candidate, others_inflation: float | None, others_in_system: float | None = None) -> str:
    """Why holding this candidate would not serve, or ""."""
    if c.error_rate is None:
        return "its error rate is unknown: zeroed"
    if c.error_rate >= SERVES_MOST:
        return f"it fails {c.error_rate:.0%} of its requests: zeroed"
    if c.capacity is None or c.capacity <= 0:
        return "it has no learned capacity: zeroed"
    if c.inflation is None or others_inflation is None:
        return "its TTFT or the others' is unknown: zeroed"
    if c.inflation > SLOWER * others_inflation:
        return f"its TTFT is {c.inflation:.1f}x its idle, the others' at most {others_inflation:.1f}x: zeroed"
    if c.in_system is not None and others_in_system is not None and c.in_system > SLOWER * others_in_system:
        return (
            f"a request spends {c.in_system:.1f}s on it, at most {others_in_system:.1f}s on the others "
            "(running and waiting over the rate): slowed down, zeroed"
        )
    return ""


def _spread(need: float, able: dict[str, float]) -> dict[str, float]:
    """`need` over the pods of `able` in proportion to their room, each within it (all of it when short)."""
    room = sum(able.values())
    if room <= 0:
        return dict.fromkeys(able, 0.0)
    part = min(1.0, need / room)
    return {name: part * value for name, value in able.items()}
