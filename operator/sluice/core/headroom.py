"""Headroom routing: each pod's share of the pool's traffic from the load it can take, then Envoy weights. Pure.

The cube policy (`sluice.core.scoring`) weighs a pod by (K / latency penalty)^3: it ranks pods but says nothing
about how much each can take, so on servers that saturate it overfills the fastest class. This policy instead:

1. learns each pod's capacity (requests/s) from what it shows. Utilisation ρ is read two ways and the larger
   kept: TTFT inflation over the pod's own idle TTFT (M/M/1: T = s / (1 − ρ), so ρ = 1 − s/T) and the waiting
   queue (M/D/1: Lq = ρ² / (2(1 − ρ))). With ρ ≥ `INFORMATIVE` the capacity is rate / ρ, a measurement; below it
   the rate only bounds the capacity from below (rate / `INFORMATIVE`), and the declared class K scaled by the
   pool's measured capacity per unit of K (`capacity.classes` stays the prior) fills in. A mislabelled or
   throttled pod thus finds its own capacity as soon as it carries load;
2. water-fills the pool's observed request rate over the pods: with T_i(x) = s_i / (1 − x/μ_i) the shares that
   minimise the pool's mean TTFT are x_i = μ_i (1 − √(s_i / ν)) (Kleinrock's square-root assignment), fast pods
   first, spilling over to slower ones as they fill; no pod is planned past `targetUtilization` of its capacity
   unless the whole pool is, and then shares follow capacity;
3. maps shares to weights for Envoy's weighted least-request, which picks in proportion to w / (active + 1)^bias
   per sidecar: w_i ∝ x_i (1 + x_i E_i / clientSidecars)^bias, with E_i the pod's observed time in system
   (in-flight / rate, Little's law) — so the share planned is the share Envoy gives once the actives settle.

The health band (error rate) scales the capacity; hysteresis, the recovery ramp, fast-zeroing and the floor work
on the resulting weights exactly as for the cube. Called by `sluice.core.allocation`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

INFORMATIVE = 0.3
"""Utilisation from which a pod's reading is a measurement of its capacity (below, TTFT inflation is mostly noise)."""
RISE = 0.1
"""Learned capacity rises at this share of the gain it falls with: quick to shed load, slow to add it."""

PROBE = 0.02
PROBE_FROM = 0.5
"""A pod carrying at least this share of its learned capacity without showing load has it raised by PROBE per
pass (slow; a reading past INFORMATIVE takes it down again at once)."""
SPARE = 0.5
"""A pod carrying traffic with less than INFORMATIVE inflation is taken to be at most this loaded."""
CONFIDENT = 0.6
"""Utilisation from which a reading moves the learned capacity at the full smoothing gain."""
MAX_UTILISATION = 0.98
IDLE_DRIFT = 0.002
IDLE_DESCENT = 0.1
SAMPLES = 30
"""Completed requests in the window from which a pod's reading counts fully (fewer: proportionally less)."""
"""Per pass, the learned idle TTFT may rise by this share towards what is observed (a slowed node's new normal)."""

CapacitySource = Literal["measured", "learned", "probing", "prior", "relative", "held"]


@dataclass(frozen=True)
class PodLoad:
    """One pod's evidence this pass, and what the status remembers of it."""

    name: str
    prior: float
    """The declared class coefficient K."""
    rate: float | None
    """Completed requests per second over the window."""
    ttft: float | None
    """Mean TTFT over the window (seconds)."""
    queue: float | None
    running: float | None
    health: float = 1.0
    """The health band's share (errors), applied to the capacity."""
    previous_capacity: float | None = None
    previous_idle: float | None = None
    fresh: bool = True
    """False: no fresh evidence (frozen): the previous capacity is held."""


@dataclass(frozen=True)
class PodHeadroom:
    """What the policy concluded for one pod."""

    learned: float
    """Learned capacity (requests/s), smoothed, before health: what the status remembers."""
    capacity: float
    """The capacity planned with: learned x health."""
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

    def explain(self) -> str:
        parts = [f"capacity {self.learned:.2f}/s ({self.source}"]
        if self.utilisation is not None:
            parts[0] += f", load {self.utilisation:.0%}"
        parts[0] += ")"
        if self.capacity < self.learned * 0.995:
            parts.append(f"x{self.capacity / self.learned:.2f} for errors")
        if self.idle_ttft is not None:
            parts.append(f"idle ttft {self.idle_ttft * 1000:.0f}ms")
        total = f"{self.demand:.2f}/s"
        parts.append(f"planned {self.share:.2f}/s of {total}")
        return " ".join(parts)


def utilisation(ttft: float | None, idle: float | None, queue: float | None) -> float | None:
    """ρ from TTFT inflation (M/M/1) and from the waiting queue (M/D/1); the larger, or None without evidence."""
    readings = []
    if ttft is not None and idle is not None and ttft > 0:
        readings.append(max(0.0, 1.0 - idle / ttft))
    if queue is not None and queue > 0:
        readings.append(-queue + math.sqrt(queue * queue + 2.0 * queue))
    return min(MAX_UTILISATION, max(readings)) if readings else None


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


def estimate(
    pods: Sequence[PodLoad], smoothing: float, window: float
) -> dict[str, tuple[float, float | None, float | None, str]]:
    """Per pod: (capacity req/s before health, idle TTFT, utilisation, source).

    An observation rate / ρ counts in proportion to ρ (up to `CONFIDENT`): the busier the pod, the more its
    inflation says about its capacity; a lightly loaded pod's reading hardly moves what was learned.
    """
    learned: dict[str, float] = {}
    notes: dict[str, tuple[float | None, float | None, str]] = {}
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
        source = "learned"
        if p.previous_capacity:
            value = p.previous_capacity
            if observed is not None:
                gain = (1.0 - smoothing) * min(1.0, (rho or 0.0) / CONFIDENT) * min(1.0, rate * window / SAMPLES)
                value += gain * (observed - value) * (1.0 if observed < value else RISE)
                source = "measured"
            elif rate >= PROBE_FROM * value and (rho is None or rho < INFORMATIVE):
                # Carrying most of what it is believed to take, yet showing no load: the belief is too low.
                value *= 1.0 + PROBE
                source = "probing"
            learned[p.name] = max(value, rate)
        elif observed is not None and (rho or 0.0) >= INFORMATIVE:
            learned[p.name] = observed
            source = "measured"
        notes[p.name] = (idle, rho, source)
    prior_of = {p.name: p.prior for p in pods if p.prior > 0}
    # The pool's capacity per unit of K: from what was learned; before that, the optimistic bound that a pod
    # showing no inflation is at most SPARE loaded.
    per_k_values = [learned[n] / prior_of[n] for n in learned if n in prior_of]
    if not per_k_values:
        per_k_values = [
            (p.rate or 0.0) / SPARE / prior_of[p.name] for p in pods if p.name in prior_of and (p.rate or 0) > 0
        ]
    per_k = statistics.median(per_k_values) if per_k_values else None
    out: dict[str, tuple[float, float | None, float | None, str]] = {}
    for p in pods:
        idle, rho, source = notes[p.name]
        if p.name in learned:
            out[p.name] = (learned[p.name], idle, rho, source)
        elif per_k is not None:
            out[p.name] = (max(p.prior * per_k, p.rate or 0.0), idle, rho, "prior")
        else:
            out[p.name] = (p.prior, idle, rho, "relative")
    return out


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

    lo = min(s for c, s in zip(capacity, idle, strict=True) if c > 0)
    hi = lo * 2.0
    while sum(fill(hi)) < demand and hi < lo * 1e12:
        hi *= 2.0
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if sum(fill(mid)) < demand:
            lo = mid
        else:
            hi = mid
    return fill(hi)


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


def plan(
    pods: Sequence[PodLoad],
    smoothing: float,
    window: float,
    target_utilisation: float,
    client_sidecars: float,
    active_request_bias: float,
) -> dict[str, PodHeadroom]:
    """Capacities, shares and relative weights for one subset of pods."""
    if not pods:
        return {}
    estimates = estimate(pods, smoothing, window)
    names = [p.name for p in pods]
    capacity = [max(0.0, estimates[p.name][0] * p.health) for p in pods]
    idles = [estimates[n][1] for n in names]
    known_idle = [s for s in idles if s is not None and s > 0]
    fallback_idle = statistics.median(known_idle) if known_idle else 1.0
    idle = [s if s is not None and s > 0 else fallback_idle for s in idles]
    demand = sum(p.rate for p in pods if p.fresh and p.rate is not None and p.rate > 0)
    # With no traffic observed, plan for a trickle: the fastest pods take it first.
    planned_demand = demand if demand > 0 else 0.05 * sum(capacity)
    shares = water_fill(planned_demand, capacity, idle, target_utilisation)
    # In flight at the planned rate: the running batch (the queue is what the plan removes).
    in_system = {
        p.name: p.running or 0.0
        for p in pods
        if p.fresh and p.rate is not None and p.rate > 0 and p.running is not None
    }
    times = {p.name: in_system[p.name] / (p.rate or 1.0) for p in pods if p.name in in_system}
    fallback_time = statistics.median(times.values()) if times else 0.0
    out: dict[str, PodHeadroom] = {}
    for p, cap, share in zip(pods, capacity, shares, strict=True):
        divisor = _model_divisor(p, share, times, fallback_time, client_sidecars, active_request_bias)
        _, idle_ttft, rho, source = estimates[p.name]
        out[p.name] = PodHeadroom(
            learned=estimates[p.name][0],
            capacity=cap,
            idle_ttft=idle_ttft,
            utilisation=rho,
            source=source,  # type: ignore[arg-type]
            share=share,
            demand=demand,
            weight=share * divisor,
        )
    return out
