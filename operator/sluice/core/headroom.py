"""Headroom routing: each pod's share of the pool's traffic from the load it can take, then Envoy weights. Pure.

The cube policy (`sluice.core.scoring`) weighs a pod by (K / latency penalty)^3: it ranks pods but says nothing
about how much each can take, so on servers that saturate it overfills the fastest class. This policy instead:

1. learns each pod's capacity (requests/s) from what it shows (`sluice.core.podload`, `sluice.core.capacity`).
   Utilisation ρ is read two ways and the larger kept: TTFT inflation over the pod's own idle TTFT (M/M/1:
   T = s / (1 − ρ), so ρ = 1 − s/T) and the waiting queue (M/D/1: Lq = ρ² / (2(1 − ρ))), the queue only from
   `QUEUE_EVIDENCE` waiting requests when there is a TTFT reading (one scrape of one or two waiting is noise, not
   load). With ρ ≥ `INFORMATIVE` the capacity is rate / ρ, a measurement, and only a measurement is remembered as
   learned; every measurement, the first one included, moves the capacity from what was believed (the learned
   value, or the prior) at a gain that grows with ρ, rising at `RISE` of the gain it falls with. Until a pod has
   one, its capacity is a prior: the declared class K scaled by the pool's learned capacity per unit of K
   (`capacity.classes`); while nothing in the pool is learned yet, the pods carrying traffic without showing load
   are taken to be at most `SPARE` loaded. With no rate anywhere yet, the shares follow K itself (unitless,
   "relative", never stored as requests/s). A mislabelled or throttled pod finds its own capacity as soon as it
   carries load. The KV-cache usage u is a lower bound on ρ (`KV_ROOM`): rate / u bounds the capacity from above
   (a belief past it falls towards it, a rise never passes it), and a cache with room lets a pod that shows no
   load probe upwards, one never measured from its prior — a pod whose TTFT stays flat until its cliff is
   otherwise stuck at K x what the others taught. Pods of one hardware class within the noise of their class's
   median are planned as the class (`sluice.core.classpool`);
2. water-fills the pool's observed request rate over the pods with fresh evidence (`sluice.core.waterfill`): with
   T_i(x) = s_i / (1 − x/μ_i) every loaded pod is given the same latency level L, the lowest that carries the
   demand: x_i = μ_i (1 − s_i/L), fast pods first, spilling over to slower ones as they fill (this minimises the
   highest TTFT, not the mean); no pod is planned past `targetUtilization` of its capacity unless the whole pool
   is, and then shares follow capacity. A pod without fresh evidence (frozen) keeps its weight and is left out of
   both the demand and the fill;
3. maps shares to weights for Envoy's weighted least-request, which picks in proportion to w / (active + 1)^bias
   per sidecar: w_i ∝ x_i (1 + x_i E_i / clientSidecars)^bias, with E_i the pod's observed time in system
   (in-flight / rate, Little's law) — so the share planned is the share Envoy gives once the actives settle.

The health band (error rate) scales the capacity; hysteresis, the recovery ramp, fast-zeroing and the floor work
on the resulting weights exactly as for the cube. Called by `sluice.core.policies`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.core.capacity import LEARNED_SOURCES, CapacitySource, Estimate, estimate
from sluice.core.classpool import Pooling, pool_by_class, pooled_values
from sluice.core.podload import IDLE_SAMPLES, PodLoad, sanitised
from sluice.core.waterfill import water_fill

TRICKLE = 0.05
"""With no traffic observed, the share of the pool's capacity planned (fastest pods first), so weights exist.
Provenance: hand-set, never swept (with no traffic only the order of the weights matters)."""


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
    idle_samples: int | None = None
    """Completions its idle TTFT rests on (`sluice.core.podload.IDLE_SAMPLES`)."""
    by_latency: float | None = None
    """Set while no pod of its subset shows load: the latency score its weight follows (`sluice.core.policies`)."""

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
        if self.idle_samples is not None and self.idle_samples < IDLE_SAMPLES:
            parts.append(f"(from {self.idle_samples} requests, not settled)")
        if self.by_latency is not None:
            parts.append(f"no pod shows load: weighed by latency score {self.by_latency:.3g}")
            return " ".join(parts)
        total = f"{self.demand:.2f}/s"
        parts.append(f"planned {self.share:.2f}/s of {total}")
        return " ".join(parts)


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
    pods = [sanitised(p) for p in pods]
    estimates = estimate(pods, smoothing, window)
    # Pods of one class are planned with the class's capacity, idle TTFT and time in system unless they differ
    # beyond the noise; the pooled capacity is what is remembered, the idle TTFT stays the pod's own.
    pooling = pool_by_class(pods, estimates, window)
    for name, value in pooled_values(pooling, {n: e.capacity for n, e in estimates.items()}).items():
        estimates[name] = estimates[name]._replace(capacity=value)
    fresh = [p for p in pods if p.fresh]
    capacity = [max(0.0, estimates[p.name].capacity * p.health) for p in fresh]
    idle = _planned_idle(fresh, estimates, pooling)
    if demand is None:
        demand = sum(p.rate for p in fresh if p.rate is not None and p.rate > 0)
    shares = _shares(fresh, demand, capacity, idle, target_utilisation)
    divisors = _divisors(pods, fresh, shares, pooling, client_sidecars, active_request_bias)
    return {
        p.name: _concluded(p, estimates[p.name], shares.get(p.name, 0.0), divisors[p.name], pooling.get(p.name), demand)
        for p in pods
    }


def _planned_idle(fresh: list[PodLoad], estimates: dict[str, Estimate], pooling: dict[str, Pooling]) -> list[float]:
    """Each fresh pod's idle TTFT as planned: its class's where pooled, the median of the known ones where none is
    learned (1 s with none at all)."""
    own_idle = {p.name: s for p in fresh if (s := estimates[p.name].idle) is not None and s > 0}
    class_idle = pooled_values(pooling, own_idle)
    idles = [class_idle.get(p.name) for p in fresh]
    known_idle = [s for s in idles if s is not None and s > 0]
    fallback_idle = statistics.median(known_idle) if known_idle else 1.0
    return [s if s is not None and s > 0 else fallback_idle for s in idles]


def _shares(
    fresh: list[PodLoad], demand: float, capacity: list[float], idle: list[float], target_utilisation: float
) -> dict[str, float]:
    """Each fresh pod's planned requests/s: the demand water-filled (`water_fill`); with no traffic observed, a
    trickle (`TRICKLE`), which the fastest pods take first."""
    planned_demand = demand if demand > 0 else TRICKLE * sum(capacity)
    return dict(
        zip([p.name for p in fresh], water_fill(planned_demand, capacity, idle, target_utilisation), strict=True)
    )


def _divisors(
    pods: list[PodLoad],
    fresh: list[PodLoad],
    shares: dict[str, float],
    pooling: dict[str, Pooling],
    client_sidecars: float,
    active_request_bias: float,
) -> dict[str, float]:
    """Each pod's (1 + active)^bias at its planned share (`_model_divisor`), a pooled pod's its class's median."""
    times, fallback_time = _times(fresh)
    own_divisor = {
        p.name: _model_divisor(p, shares.get(p.name, 0.0), times, fallback_time, client_sidecars, active_request_bias)
        for p in pods
    }
    # A pooled pod's divisor is its class's median one (each at its own planned rate, capped by what it runs now).
    return pooled_values(pooling, own_divisor)


def _times(fresh: Sequence[PodLoad]) -> tuple[dict[str, float], float]:
    """Each fresh pod's time in system (Little's law on the running batch: the queue is what the plan removes),
    and their median for a pod without one."""
    in_system = {p.name: p.running for p in fresh if p.rate is not None and p.rate > 0 and p.running is not None}
    times = {p.name: in_system[p.name] / (p.rate or 1.0) for p in fresh if p.name in in_system}
    return times, statistics.median(times.values()) if times else 0.0


def weight_at(
    pods: Sequence[PodLoad], name: str, share: float, client_sidecars: float, active_request_bias: float
) -> float:
    """The relative weight, in `plan`'s units, that gives pod `name` `share` requests/s: the share times
    (1 + active)^bias at that rate on its own time in system. A pod kept at a small share runs few requests, so
    Envoy's least-request sends it more per unit of weight than the busy pods it is weighed against: published at
    their weight per req/s, a pod held at 2.4 req/s on failing-pod-tuning at 70 % carried 3.1."""
    pods = [sanitised(p) for p in pods]
    times, fallback_time = _times([p for p in pods if p.fresh])
    pod = next(p for p in pods if p.name == name)
    return share * _model_divisor(pod, share, times, fallback_time, client_sidecars, active_request_bias)


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


def _concluded(
    p: PodLoad, e: Estimate, share: float, divisor: float, pool: Pooling | None, demand: float
) -> PodHeadroom:
    """What the policy concluded for one pod: its estimate, the capacity planned with, its share and weight."""
    value, idle_ttft, rho, source, idle_samples = e
    return PodHeadroom(
        estimate=value,
        learned=value if source in LEARNED_SOURCES else None,
        capacity=max(0.0, value * p.health),
        idle_ttft=idle_ttft,
        idle_samples=idle_samples,
        utilisation=rho,
        source=source,
        share=share,
        demand=demand,
        weight=share * divisor,
        kv=p.kv if p.fresh else None,
        pooled=pool.share if pool is not None else 0.0,
        class_size=len(pool.members) if pool is not None and pool.share > 0 else 0,
    )
