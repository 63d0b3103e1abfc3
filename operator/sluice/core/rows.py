"""A pod's row in `status.endpoints`, rendered once per pass from its verdict and its allocation: why it has its
weight in words, its score, and what the headroom policy remembers of it. Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import TypedDict

from sluice.api.v1alpha1 import EndpointState, EndpointStatus, InferencePoolSpec
from sluice.core.allocation import Allocation
from sluice.core.headroom import PodHeadroom
from sluice.core.inbound import (
    LIMIT_HOLD_SECONDS,
    PodBatch,
    PodCapacity,
    binds,
    learn_batch,
    learn_rate_at_limit,
    limit_hold,
    pod_limits,
    pod_rates,
    steer_share,
)
from sluice.core.observed import PodSignals, SignalName
from sluice.core.verdicts import PodVerdict, VerdictKind


def reason_for(spec: InferencePoolSpec, verdict: PodVerdict, allocation: Allocation) -> str:
    """Why the pod has its weight, in words — rendered once, from the verdict and the allocation."""
    incident = verdict.memory.describe()
    if allocation.floor_held:
        why = f"would be zeroed for {verdict.memory.incident}" if verdict.kind == "quiet" else "no signals yet"
        return (
            f"kept at minimum weight by the floor (minRoutablePercent {spec.protection.min_routable_percent}%): {why}"
        )
    if verdict.kind == "excluded":
        return verdict.excluded_because + (
            f"; {incident}" if verdict.memory.last_incident_at and verdict.quiet_remaining else ""
        )
    hold = allocation.hold
    if allocation.capacity_held and hold is not None:
        if verdict.kind == "ramping":
            return f"recovering from {verdict.memory.incident}, {hold.explain()}"
        return f"would be zeroed ({incident}), {hold.explain()}"
    if verdict.kind == "quiet":
        weighed = f"; {hold.explain()}" if hold is not None else ""
        return f"{incident}; quiet for {verdict.quiet_remaining:.0f}s more{weighed}"
    if verdict.kind == "frozen":
        return "no fresh signals: weight frozen at its last value"
    if verdict.kind == "awaiting":
        return "no signals yet: not routed until Prometheus has samples for it"
    if verdict.kind == "ramping":
        percent, target = verdict.ramp_percent, allocation.scored_weight
        return f"recovering from {verdict.memory.incident}: {percent:.1f}% of scored weight {target}"
    text = allocation.headroom.explain() if allocation.headroom is not None else verdict.score.explain()
    if allocation.scored_weight is not None and allocation.weight != allocation.scored_weight:
        text += f" (scored {allocation.scored_weight}, change within hysteresis)"
    if verdict.assessment.consecutive_failures:
        text += f"; below every band {verdict.assessment.consecutive_failures}x in a row"
    return text


class StatusRow(TypedDict):
    """One `status.endpoints` row as plain data, as `EndpointStatus` validates it."""

    pod: str
    ip: str | None
    revision: str | None
    hardware_class: str | None
    capacity: float
    signals: PodSignals
    signals_sampled_at: datetime | None
    score: float
    weight: int
    state: EndpointState
    reason: str
    since: datetime
    ttft_estimate_seconds: float | None
    idle_ttft_seconds: float | None
    learned_capacity: float | None
    idle_ttft_samples: int | None
    saturated_batch: float | None
    inbound_limit: int | None
    rate_limit: float | None
    rate_at_limit: float | None
    admission_share: float | None
    limit_since: datetime | None
    consecutive_failures: int
    restarts: int
    last_incident_at: datetime | None
    incident: str | None
    incident_message: str | None
    verdict: VerdictKind
    floor_held: bool
    capacity_held: bool
    held_since: datetime | None
    missing_signals: list[SignalName]
    class_known: bool


def render_row(spec: InferencePoolSpec, verdict: PodVerdict, allocation: Allocation, now: datetime) -> StatusRow:
    """One status row as plain data; the whole status is validated in a single pydantic call (fast for big pools)."""
    prev: EndpointStatus | None = verdict.previous
    since = prev.since if prev is not None and prev.state == allocation.state and prev.since else now
    if verdict.score.ttft_source == "observed":
        estimate: float | None = verdict.score.ttft
    else:
        estimate = prev.ttft_estimate_seconds if prev else None
    return {
        "pod": verdict.name,
        "ip": verdict.pod.ip,
        "revision": verdict.revision,
        "hardware_class": verdict.hardware_class,
        "capacity": verdict.capacity,
        "signals": verdict.signals,
        "signals_sampled_at": verdict.sampled_at,
        "score": round(_score(spec, verdict, allocation), 6),
        "weight": allocation.weight,
        "state": allocation.state,
        "reason": reason_for(spec, verdict, allocation),
        "since": since,
        "ttft_estimate_seconds": estimate,
        # the measured capacity (None while only a prior) and the idle TTFT it is read against
        "idle_ttft_seconds": _headroom_memory(
            spec, allocation, lambda h: h.idle_ttft, prev.idle_ttft_seconds if prev is not None else None
        ),
        "learned_capacity": _headroom_memory(
            spec, allocation, lambda h: h.learned, prev.learned_capacity if prev is not None else None
        ),
        "idle_ttft_samples": _idle_samples(spec, allocation, prev.idle_ttft_samples if prev is not None else None),
        **_admission(spec, verdict, prev),
        "consecutive_failures": verdict.assessment.consecutive_failures,
        "restarts": verdict.pod.restarts,
        "last_incident_at": verdict.memory.last_incident_at,
        "incident": verdict.memory.incident,
        "incident_message": verdict.memory.message,
        "verdict": verdict.kind,
        "floor_held": allocation.floor_held,
        "capacity_held": allocation.capacity_held,
        "held_since": (prev.held_since or now)
        if allocation.capacity_held and prev and prev.capacity_held
        else (now if allocation.capacity_held else None),
        "missing_signals": list(verdict.missing),
        "class_known": verdict.class_known,
    }


class _Admission(TypedDict):
    saturated_batch: float | None
    inbound_limit: int | None
    rate_limit: float | None
    rate_at_limit: float | None
    admission_share: float | None
    limit_since: datetime | None


def _admission(spec: InferencePoolSpec, verdict: PodVerdict, prev: EndpointStatus | None) -> _Admission:
    """The pod's batch at a full cache (moved only by a fresh scrape sample, `learn_batch`: passes between two scrapes
    read the same gauges, and one sample counts once where the engine says when it was taken); its limit is set
    once every row has its batch (`with_inbound_limits`); nothing while admission is off."""
    if spec.admission.mode == "Off":
        return {
            "saturated_batch": None,
            "inbound_limit": None,
            "rate_limit": None,
            "rate_at_limit": None,
            "admission_share": None,
            "limit_since": None,
        }
    kept = prev.saturated_batch if prev is not None else None
    signals = verdict.signals
    seen = prev is not None and verdict.sampled_at is not None and prev.signals_sampled_at == verdict.sampled_at
    fresh = verdict.evidence and not seen
    batch = learn_batch(kept, signals.running_requests, signals.kv_cache_usage) if fresh else kept
    at_limit = prev.rate_at_limit if prev is not None else None
    if fresh and spec.admission.tenants is not None:
        limit = prev.inbound_limit if prev is not None else None
        at_limit = learn_rate_at_limit(at_limit, signals.request_rate, signals.running_requests, limit)
    return {
        "saturated_batch": None if batch is None else round(batch, 3),
        "inbound_limit": None,
        "rate_limit": None,
        "rate_at_limit": None if at_limit is None or spec.admission.tenants is None else round(at_limit, 3),
        "admission_share": _share(spec, prev, signals, fresh and verdict.sampled_at is not None),
        "limit_since": None,
    }


def _share(spec: InferencePoolSpec, prev: EndpointStatus | None, signals: PodSignals, fresh: bool) -> float | None:
    """The pod's share of its batch under `admission.ttftTarget`, moved once per fresh sample by its TTFT p95
    (`steer_share`; `fresh` only where the engine tells when its sample was taken: without that, passes between
    two scrapes would each move it), never below batchShare (raised since, it lifts a share kept below it); None
    without a target."""
    target = spec.admission.ttft_target
    if target is None:
        return None
    kept = prev.admission_share if prev is not None else None
    share = spec.admission.batch_share if kept is None else max(kept, spec.admission.batch_share)
    if not fresh:
        return share
    limit = prev.inbound_limit if prev is not None else None
    bound = binds(limit, signals.running_requests, signals.refused_rate)
    return steer_share(share, signals.ttft_p95_seconds, bound, target, spec.admission.batch_share)


def with_inbound_limits(
    spec: InferencePoolSpec, rows: list[StatusRow], before: Mapping[str, EndpointStatus], now: datetime
) -> list[StatusRow]:
    """Every row's limit, from its class's batch or its own (`pod_limits`), and with `admission.tenants` its
    admitted rate, from its class's rate at the limit or its own (`pod_rates`), each moved past the hysteresis from
    the one the previous status showed, and a limit no sooner than its `limit_hold` after it was set (from the
    pod's time in system as this pass reads it)."""
    if spec.admission.mode == "Off":
        return rows
    batches = [PodBatch(r["pod"], r["hardware_class"], r["saturated_batch"]) for r in rows]
    shown = {pod: row.inbound_limit for pod, row in before.items()}
    shares = {r["pod"]: r["admission_share"] for r in rows}
    holds = {
        r["pod"]: limit_hold(r["signals"].running_requests, r["signals"].queue_length, r["signals"].request_rate)
        for r in rows
    }
    held = {
        pod
        for pod, row in before.items()
        if row.inbound_limit is not None
        and row.limit_since is not None
        and now - row.limit_since < timedelta(seconds=holds.get(pod, LIMIT_HOLD_SECONDS))
    }
    limits = pod_limits(batches, spec.admission.batch_share, shown, spec.admission.min_limit, shares, held)
    rates: dict[str, float | None] = {}
    if spec.admission.tenants is not None:
        measured = [PodCapacity(r["pod"], r["hardware_class"], r["rate_at_limit"]) for r in rows]
        rates = pod_rates(measured, {pod: row.rate_limit for pod, row in before.items()})
    out: list[StatusRow] = []
    for row in rows:
        limited = row.copy()
        limit = limits[row["pod"]]
        previous = before.get(row["pod"])
        limited["inbound_limit"] = limit
        kept = previous.limit_since if previous is not None and previous.inbound_limit == limit else None
        limited["limit_since"] = None if limit is None else kept or now
        limited["rate_limit"] = rates.get(row["pod"])
        out.append(limited)
    return out


def _idle_samples(spec: InferencePoolSpec, allocation: Allocation, kept: int | None) -> int | None:
    """The completions the idle TTFT rests on, kept as `_headroom_memory` keeps the idle TTFT."""
    if allocation.headroom is not None:
        return allocation.headroom.idle_samples
    return kept if spec.scoring.policy == "headroom" else None


def _score(spec: InferencePoolSpec, verdict: PodVerdict, allocation: Allocation) -> float:
    """The status' score: headroom, the capacity planned with in requests/s (0 while only relative); cube its score."""
    if allocation.headroom is not None:
        return 0.0 if allocation.headroom.source == "relative" else allocation.headroom.estimate
    prev = verdict.previous
    if spec.scoring.policy == "headroom":
        return prev.score if prev is not None and prev.learned_capacity is not None else 0.0
    return verdict.smoothed


def _headroom_memory(
    spec: InferencePoolSpec, allocation: Allocation, fresh: Callable[[PodHeadroom], float | None], kept: float | None
) -> float | None:
    """headroom's per-pod memory: this pass's value (to the microsecond, as the score), the previous one while the
    pod is not weighed (zeroed: kept for its return), none under the cube."""
    if allocation.headroom is not None:
        value = fresh(allocation.headroom)
        return None if value is None else round(value, 6)
    return kept if spec.scoring.policy == "headroom" else None
