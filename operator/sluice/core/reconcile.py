"""One reconcile pass, as a pure function: (spec, observed pods and signals, previous status, now) -> Plan.

The Plan holds the next status (which is also the controller's whole memory), the endpoint weights and revision
split to publish, and the Events to emit. Called by the kopf handlers through the orchestration module, by
`sluice plan`, and by the benchmark's simulated control loop.

Order of a pass: decide metric freshness (fail-static) -> assess each pod (incidents, recovery phase) -> score
and scale -> apply the routable floor -> step the canary -> build conditions and rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sluice.api.v1alpha1 import (
    CanaryStatus,
    Condition,
    EndpointState,
    EndpointStatus,
    InferencePoolSpec,
    InferencePoolStatus,
)
from sluice.core.canary import RevisionStats, step_canary
from sluice.core.events import Event
from sluice.core.observed import Observed, ObservedPod, PodSignals
from sluice.core.protection import Assessment, assess, floor_keep, recovery_phase, spare_order
from sluice.core.scoring import Score, capacity_of, score_pod, smooth
from sluice.core.status import make_condition
from sluice.core.weights import ramp, scale, with_hysteresis

NO_SIGNALS = PodSignals()
FLOOR_HELD = "kept at minimum weight by the floor"


@dataclass(frozen=True)
class EndpointWeight:
    """A routable pod as it goes into the ServiceEntry."""

    pod: str
    ip: str
    revision: str | None
    weight: int


@dataclass(frozen=True)
class Plan:
    status: InferencePoolStatus
    endpoints: tuple[EndpointWeight, ...]
    revision_weights: dict[str, int]
    """Traffic % per revision; empty: no canary, route to the whole pool."""
    revisions: tuple[str, ...]
    """Every revision with a pod in the pool: one DestinationRule subset each."""
    publish: bool
    """False when nothing is routable: leave the mesh as it is rather than publish an empty pool."""
    events: tuple[Event, ...] = ()


@dataclass(frozen=True)
class MetricsVerdict:
    usable: bool
    reason: str
    message: str


def judge_metrics(spec: InferencePoolSpec, observed: Observed, now: datetime) -> MetricsVerdict:
    """Fresh and complete signals, or why not. Unusable signals freeze weights (fail-static)."""
    snapshot = observed.signals
    if snapshot.collected_at is None:
        return MetricsVerdict(False, "NoSignals", "no signals have been read yet; weights frozen")
    age = (now - snapshot.collected_at).total_seconds()
    if snapshot.failed:
        failures = "; ".join(f"{name}: {why}" for name, why in sorted(snapshot.failed.items()))
        return MetricsVerdict(False, "QueryFailed", f"{failures}; weights frozen")
    if age > spec.metrics.stale_after:
        return MetricsVerdict(
            False,
            "Stale",
            f"signals are {age:.0f}s old (staleAfter {spec.metrics.stale_after:.0f}s); weights frozen",
        )
    message = "signals fresh"
    if snapshot.unsupported:
        message += f"; not provided by engine {spec.engine}: {', '.join(snapshot.unsupported)}"
    return MetricsVerdict(True, "Fresh", message)


def selects(spec: InferencePoolSpec, pod: ObservedPod) -> bool:
    return all(pod.labels.get(key) == value for key, value in spec.selector.match_labels.items())


def has_samples(signals: PodSignals) -> bool:
    """Whether Prometheus returned anything for the pod: a live engine always exports its gauges."""
    return (
        signals.kv_cache_usage is not None
        or signals.queue_length is not None
        or signals.running_requests is not None
        or signals.ttft_seconds is not None
    )


@dataclass(slots=True)
class _Pod:
    """Working record of one pod during a pass (mutable on purpose, local to `plan_pass`)."""

    pod: ObservedPod
    previous: EndpointStatus | None
    signals: PodSignals
    revision: str | None
    hardware_class: str | None
    capacity: float
    score: Score
    smoothed: float
    assessment: Assessment
    last_incident_at: datetime | None
    incident: str | None
    incident_message: str | None
    eligible: bool
    frozen: bool
    state: EndpointState = "Zeroed"
    weight: int = 0
    reason: str = ""
    wants_zero: bool = False
    ramp_percent: float | None = None


def _not_eligible_reason(pod: ObservedPod) -> str | None:
    if pod.deleting:
        return "pod is terminating"
    if not pod.ready:
        return "pod is not Ready"
    if not pod.ip:
        return "pod has no IP yet"
    return None


def plan_pass(
    spec: InferencePoolSpec,
    generation: int | None,
    observed: Observed,
    previous: InferencePoolStatus | None,
    now: datetime,
) -> Plan:
    verdict = judge_metrics(spec, observed, now)
    prev_rows = {row.pod: row for row in (previous.endpoints if previous else [])}
    pods = sorted((p for p in observed.pods if selects(spec, p)), key=lambda p: p.name)
    work: list[_Pod] = []
    for pod in pods:
        prev = prev_rows.get(pod.name)
        signals = observed.signals.pods.get(pod.name) or NO_SIGNALS
        hardware_class, capacity = capacity_of(spec, pod.labels)
        score = score_pod(spec, capacity, signals, prev.ttft_estimate_seconds if prev else None)
        sampled = has_samples(signals)
        # Fail-static: a pod with a published weight and no fresh evidence keeps that weight.
        frozen = prev is not None and prev.weight > 0 and (not verdict.usable or not sampled)
        assessment = assess(
            spec.protection,
            spec.metrics.window,
            pod,
            prev,
            signals,
            verdict.usable and sampled,
            score.below_bands,
            now,
        )
        last_incident_at = prev.last_incident_at if prev else None
        incident = prev.incident if prev else None
        incident_message = prev.incident_message if prev else None
        if assessment.incident is not None:
            last_incident_at, incident = now, assessment.incident.kind
            incident_message = assessment.incident.message
        smoothed = prev.score if frozen and prev else smooth(spec.scoring, prev.score if prev else None, score.value)
        work.append(
            _Pod(
                pod=pod,
                previous=prev,
                signals=signals,
                revision=_revision(spec, pod),
                hardware_class=hardware_class,
                capacity=capacity,
                score=score,
                smoothed=smoothed,
                assessment=assessment,
                last_incident_at=last_incident_at,
                incident=incident,
                incident_message=incident_message,
                eligible=_not_eligible_reason(pod) is None,
                frozen=frozen,
            )
        )

    events: list[Event] = []
    _decide_phases(spec, work, now)
    _assign_weights(spec, work)
    _apply_floor(spec, work, events)

    revisions = _revision_stats(spec, work)
    canary_outcome = step_canary(spec.canary, previous.canary if previous else None, revisions, verdict.usable, now)
    events.extend(canary_outcome.events)
    rows = [_row(item, now) for item in work]
    events.extend(_transition_events(work, rows, prev_rows))

    eligible = [item for item in work if item.eligible]
    routable = [item for item in eligible if item.weight > 0]
    publish = bool(routable)
    conditions = _conditions(spec, generation, previous, verdict, work, routable, eligible, canary_outcome.status, now)
    prev_metrics = next((c for c in (previous.conditions if previous else []) if c.type == "MetricsAvailable"), None)
    if prev_metrics is not None and prev_metrics.status != ("True" if verdict.usable else "False"):
        if verdict.usable:
            events.append(Event("Normal", "MetricsRestored", "signals are fresh again; weights follow them"))
        else:
            events.append(Event("Warning", "MetricsUnavailable", verdict.message))
    elif prev_metrics is None and not verdict.usable and previous is not None:
        events.append(Event("Warning", "MetricsUnavailable", verdict.message))

    status = InferencePoolStatus.model_validate(
        {
            "observed_generation": generation,
            "conditions": conditions,
            "routable": f"{len(routable)}/{len(eligible)}",
            "revision_weights": canary_outcome.weights,
            "canary": canary_outcome.status,
            "endpoints": rows,
            "last_reconcile_time": now,
        }
    )
    endpoints = tuple(EndpointWeight(item.pod.name, item.pod.ip or "", item.revision, item.weight) for item in routable)
    all_revisions = tuple(sorted({item.revision for item in work if item.revision is not None}))
    return Plan(
        status=status,
        endpoints=endpoints,
        revision_weights=canary_outcome.weights,
        revisions=all_revisions,
        publish=publish,
        events=tuple(events),
    )


def _revision(spec: InferencePoolSpec, pod: ObservedPod) -> str | None:
    return pod.labels.get(spec.canary.revision_label) if spec.canary else None


def _decide_phases(spec: InferencePoolSpec, work: list[_Pod], now: datetime) -> None:
    for item in work:
        phase = recovery_phase(spec.protection.recovery, item.last_incident_at, now)
        if not item.eligible:
            item.state, item.reason = "Zeroed", _not_eligible_reason(item.pod) or ""
            if phase.name == "quiet":
                item.reason += f"; {item.incident_message or item.incident}"
            continue
        if phase.name == "quiet":
            item.wants_zero = True
            item.state = "Zeroed"
            item.reason = f"{item.incident_message or item.incident}; quiet for {phase.remaining_quiet:.0f}s more"
        elif phase.name == "ramp":
            item.state, item.ramp_percent = "Recovering", phase.percent
        else:
            item.state = "Routable"


def _assign_weights(spec: InferencePoolSpec, work: list[_Pod]) -> None:
    live = [item for item in work if item.eligible and not item.wants_zero]
    # Frozen pods take part with their last score, so fresh pods are scaled on the same basis.
    scaled = scale({item.pod.name: item.smoothed for item in live}, spec.scoring) if live else {}
    for item in live:
        prev_weight = item.previous.weight if item.previous else None
        if item.frozen and item.previous is not None:
            item.weight = item.previous.weight
            item.state = item.previous.state if item.previous.state != "Zeroed" else "Routable"
            item.reason = "no fresh signals: weight frozen at its last value"
            continue
        target = scaled[item.pod.name]
        if item.state == "Recovering" and item.ramp_percent is not None:
            item.weight = ramp(target, item.ramp_percent, spec.scoring)
            item.reason = f"recovering from {item.incident}: {item.ramp_percent:.1f}% of scored weight {target}"
            continue
        was_routable = item.previous is not None and item.previous.state == "Routable"
        item.weight = with_hysteresis(target, prev_weight if was_routable else None, spec.scoring.hysteresis_percent)
        item.reason = item.score.explain()
        if item.weight != target:
            item.reason += f" (scored {target}, change within hysteresis)"
        if item.assessment.consecutive_failures:
            item.reason += f"; below every band {item.assessment.consecutive_failures}x in a row"


def _apply_floor(spec: InferencePoolSpec, work: list[_Pod], events: list[Event]) -> None:
    eligible = [item for item in work if item.eligible]
    keep = floor_keep(len(eligible), spec.protection.min_routable_percent)
    routable = sum(1 for item in eligible if item.weight > 0)
    if routable >= keep:
        return
    zeroed = sorted(
        (item for item in eligible if item.wants_zero),
        key=lambda item: spare_order(item.incident, item.signals.error_rate, item.last_incident_at),
    )
    for item in zeroed[: keep - routable]:
        item.weight = spec.scoring.min_weight
        item.state = "Routable"
        item.reason = (
            f"{FLOOR_HELD} (minRoutablePercent {spec.protection.min_routable_percent}%): "
            f"would be zeroed for {item.incident}"
        )
        already_held = item.previous is not None and item.previous.reason.startswith(FLOOR_HELD)
        if not already_held:
            events.append(Event("Warning", "FloorHeld", f"{item.pod.name}: {item.reason}"))


def _revision_stats(spec: InferencePoolSpec, work: list[_Pod]) -> dict[str, RevisionStats]:
    if spec.canary is None:
        return {}
    groups: dict[str, list[_Pod]] = {}
    for item in work:
        if item.revision is not None:
            groups.setdefault(item.revision, []).append(item)
    return {name: _aggregate(spec, items) for name, items in groups.items()}


def _aggregate(spec: InferencePoolSpec, items: list[_Pod]) -> RevisionStats:
    """Request-weighted error rate and TTFT p95 over a revision's pods (p95 of pods, not of the merged histogram)."""
    window = spec.metrics.window
    rated = [i for i in items if i.signals.request_rate is not None and i.signals.request_rate > 0]
    requests = sum((i.signals.request_rate or 0.0) * window for i in rated) if rated else None
    return RevisionStats(
        routable_pods=sum(1 for i in items if i.eligible and i.weight > 0),
        requests=requests,
        error_rate=_weighted(rated, "error_rate"),
        ttft_p95=_weighted(rated, "ttft_p95_seconds"),
        incidents=sum(1 for i in items if i.assessment.incident is not None),
    )


def _weighted(items: list[_Pod], field_name: str) -> float | None:
    pairs: list[tuple[float, float]] = [
        (value, i.signals.request_rate or 0.0) for i in items if (value := getattr(i.signals, field_name)) is not None
    ]
    total = sum(weight for _, weight in pairs)
    if not pairs or total <= 0:
        return None
    return sum(value * weight for value, weight in pairs) / total


def _row(item: _Pod, now: datetime) -> dict[str, Any]:
    """One status row as plain data; the whole status is validated in a single pydantic call (fast for big pools)."""
    prev = item.previous
    since = prev.since if prev is not None and prev.state == item.state and prev.since else now
    if item.score.ttft_source == "observed":
        estimate: float | None = item.score.ttft
    else:
        estimate = prev.ttft_estimate_seconds if prev else None
    return {
        "pod": item.pod.name,
        "ip": item.pod.ip,
        "revision": item.revision,
        "hardware_class": item.hardware_class,
        "capacity": item.capacity,
        "signals": item.signals,
        "score": round(item.smoothed, 6),
        "weight": item.weight,
        "state": item.state,
        "reason": item.reason,
        "since": since,
        "ttft_estimate_seconds": estimate,
        "consecutive_failures": item.assessment.consecutive_failures,
        "restarts": item.pod.restarts,
        "last_incident_at": item.last_incident_at,
        "incident": item.incident,
        "incident_message": item.incident_message,
    }


def _transition_events(
    work: list[_Pod], rows: list[dict[str, Any]], prev_rows: dict[str, EndpointStatus]
) -> list[Event]:
    events: list[Event] = []
    for item, row in zip(work, rows, strict=True):
        name, state, weight = row["pod"], row["state"], row["weight"]
        if item.assessment.incident is not None and item.wants_zero and weight == 0:
            events.append(Event("Warning", "PodZeroed", f"{name}: {item.assessment.incident.message}"))
        prev = prev_rows.get(name)
        if prev is None or not item.eligible:
            continue
        if prev.state == "Zeroed" and state == "Recovering":
            events.append(Event("Normal", "PodRecovering", f"{name}: {row['reason']}"))
        elif prev.state == "Recovering" and state == "Routable" and item.last_incident_at is not None:
            events.append(Event("Normal", "PodRecovered", f"{name}: back to normal scoring (weight {weight})"))
    return events


def _conditions(
    spec: InferencePoolSpec,
    generation: int | None,
    previous: InferencePoolStatus | None,
    verdict: MetricsVerdict,
    work: list[_Pod],
    routable: list[_Pod],
    eligible: list[_Pod],
    canary: CanaryStatus | None,
    now: datetime,
) -> list[Condition]:
    before = previous.conditions if previous else []
    out = []
    if routable:
        out.append(
            make_condition(
                "Ready",
                "True",
                "WeightsPublished",
                f"{len(routable)} of {len(eligible)} ready pods routable",
                generation,
                before,
                now,
            )
        )
    else:
        out.append(
            make_condition(
                "Ready",
                "False",
                "NoReadyPods",
                "no pod is ready: the mesh keeps its last configuration",
                generation,
                before,
                now,
            )
        )
    out.append(make_condition("SpecValid", "True", "Valid", "spec accepted", generation, before, now))
    out.append(
        make_condition(
            "MetricsAvailable",
            "True" if verdict.usable else "False",
            verdict.reason,
            verdict.message,
            generation,
            before,
            now,
        )
    )
    zeroed = [i.pod.name for i in eligible if i.wants_zero and i.weight == 0]
    held = [i.pod.name for i in eligible if i.wants_zero and i.weight > 0]
    recovering = [i.pod.name for i in eligible if i.state == "Recovering"]
    unobserved = [i.pod.name for i in eligible if i.frozen and verdict.usable]
    parts = []
    if zeroed:
        parts.append(f"zeroed: {', '.join(zeroed)}")
    if held:
        parts.append(f"held by the floor: {', '.join(held)}")
    if recovering:
        parts.append(f"recovering: {', '.join(recovering)}")
    if unobserved:
        parts.append(f"no samples (weight frozen): {', '.join(unobserved)}")
    if parts:
        reason = (
            "FloorHeld"
            if held
            else ("PodsZeroed" if zeroed else ("PodsRecovering" if recovering else "PodsUnobserved"))
        )
        out.append(make_condition("Degraded", "True", reason, "; ".join(parts), generation, before, now))
    else:
        out.append(
            make_condition(
                "Degraded",
                "False",
                "AllHealthy",
                "every ready pod is scored normally",
                generation,
                before,
                now,
            )
        )
    if spec.canary is not None and canary is not None:
        active = canary.phase in ("Progressing", "Paused", "Waiting")
        out.append(
            make_condition(
                "Progressing",
                "True" if active else "False",
                canary.phase,
                canary.message,
                generation,
                before,
                now,
            )
        )
    return out
