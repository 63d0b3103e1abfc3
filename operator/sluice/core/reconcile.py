"""One reconcile pass, as a pure function: (spec, observed pods and signals, previous status, now) -> Plan.

The pass is a chain of immutable decisions, each readable on its own:
1. the evidence: are this pass's signals usable at all (`sluice.core.evidence`)?
2. one verdict per pod from its own evidence (`sluice.core.verdicts`);
3. weights per revision subset, then the floor per subset (`sluice.core.allocation`);
4. the rollout step and the split actually published (`sluice.core.canary`);
5. the status — rows, conditions — rendered once from the above (`sluice.core.status`), and the Events derived
   from the previous and the next status (`sluice.core.events`).
The Plan holds the next status (the controller's whole memory) and what to publish. Called by the runtime's
reconciler, by `sluice plan`, and by the benchmark's simulated control loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sluice.api.memory import remembered
from sluice.api.operation import Operation
from sluice.api.v1alpha1 import EndpointStatus, InferencePoolSpec, InferencePoolStatus
from sluice.core import status as conditions
from sluice.core.allocation import Allocation, allocate
from sluice.core.canary import step_canary
from sluice.core.canarycheck import RevisionStats, enabled_gates
from sluice.core.canaryround import Mirror
from sluice.core.events import Event, derive_events
from sluice.core.evidence import judge_metrics
from sluice.core.headroom import PodHeadroom
from sluice.core.mesh import TLS_MODE_LABEL, MeshPlan, PoolId, assess
from sluice.core.observed import Observed
from sluice.core.presets import supported_signals
from sluice.core.signalcheck import screen
from sluice.core.verdicts import PodVerdict, judge_pod, not_routable_because, selects

# The signal each canary gate reads.
GATE_SIGNAL = {"errorRate": "errorRate", "ttftP95": "ttftP95", "ttftRatioToStable": "ttftP95"}


@dataclass(frozen=True)
class EndpointWeight:
    """A routable pod as it goes into the ServiceEntry."""

    pod: str
    ip: str
    revision: str | None
    weight: int
    service_account: str | None = None
    tls_mode: str | None = None
    """The pod's `security.istio.io/tlsMode` label (istio: it has a sidecar); None when it has none."""


@dataclass(frozen=True)
class Plan:
    status: InferencePoolStatus
    endpoints: tuple[EndpointWeight, ...]
    revisions: tuple[str, ...]
    """Every revision with a pod in the pool: one DestinationRule subset each."""
    publish: bool
    """False when nothing is routable: leave the mesh as it is rather than publish an empty pool."""
    previous: InferencePoolStatus | None = field(default=None, repr=False)
    mirror: Mirror | None = None
    """Shadow canary: the request mirror to render on the route (its percent is `status.canary.mirrorPercent`)."""
    steer: str | None = None
    """Header routes: the revision `spec.canary.match` sends matching requests to (None: no such route)."""
    mesh: MeshPlan = field(default_factory=MeshPlan)
    """What the mesh side allows to render (`sluice.core.mesh`); a refusal there means nothing is published."""
    before: Mapping[str, EndpointStatus] = field(default_factory=dict, repr=False)
    """Every pod `previous` remembers (`remembered`, its podMemory decoded once per pass)."""

    @property
    def revision_weights(self) -> dict[str, int]:
        """Traffic % per revision as published (the status's); empty: no canary, route to the whole pool."""
        return self.status.revision_weights

    @property
    def events(self) -> tuple[Event, ...]:
        """What changed from the previous status to this one (the runtime derives them again after Istio)."""
        return derive_events(self.previous, self.status, self.before)


def plan_pass(
    spec: InferencePoolSpec,
    generation: int | None,
    observed: Observed,
    previous: InferencePoolStatus | None,
    now: datetime,
    operation: Operation | None = None,
    pool: PoolId | None = None,
    before: Mapping[str, EndpointStatus] | None = None,
) -> Plan:
    """`pool` names the pool whose mesh side `observed.mesh` describes (without it, the mesh is not judged);
    `before`: `remembered(previous)`, when the caller has it decoded."""
    pods = sorted((p for p in observed.pods if selects(spec, p)), key=lambda p: p.name)
    screened = screen(spec, observed.signals, [p.name for p in pods if not not_routable_because(p)], now)
    signals = screened.snapshot
    metrics = judge_metrics(spec, signals, now)
    if before is None:
        before = remembered(previous)
    verdicts = [judge_pod(spec, p, before.get(p.name), signals, metrics.usable, now) for p in pods]
    # Envoy's least-request divides a weight by (active + 1)^bias; consistent hash (sessionAffinity) weighs
    # proportionally, so the plan's weights then follow its shares (bias 0).
    if spec.routing.least_request is not None:
        bias = spec.routing.least_request.active_request_bias
    else:
        bias = 0.0 if spec.routing.session_affinity is not None else 1.0
    allocations = allocate(spec.scoring, spec.protection, verdicts, bias, spec.metrics.window)
    revisions = revision_stats(spec, verdicts, allocations)
    canary = step_canary(
        spec.canary,
        previous.canary if previous else None,
        revisions,
        metrics.usable,
        now,
        operation,
        spec.scoring.target_utilization,
    )
    rows = [render_row(spec, v, allocations[v.name], now) for v in verdicts]
    eligible = [v for v in verdicts if v.eligible]
    routable = [v for v in eligible if allocations[v.name].routable]
    mesh = assess(spec, pool, observed.mesh, bool(canary.weights))
    publish = bool(routable) and mesh.refusal is None
    mesh_status = mesh.status()
    if not publish and previous is not None and previous.mesh is not None:
        # nothing is written: the EnvoyFilters are where the last publishing pass put them (pruning looks there)
        mesh_status = mesh_status.model_copy(update={"envoy_filter_namespaces": previous.mesh.envoy_filter_namespaces})
    wants = [
        conditions.ready(len(routable), len(eligible), mesh.refusal),
        conditions.spec_valid(gate_warnings(spec), routing_warnings(spec)),
        conditions.metrics_available(metrics.usable, metrics.reason, metrics.message),
        conditions.signals_ready(*screened.ready),
        mesh.condition(),
    ]
    if canary.status is not None:
        wants += [conditions.progressing(canary.status), conditions.split_forced(canary.status)]
    before_conditions = previous.conditions if previous else []
    status = InferencePoolStatus.model_validate(
        {
            "observed_generation": generation,
            "conditions": conditions.conditions(wants, generation, before_conditions, now),
            "routable": f"{len(routable)}/{len(eligible)}",
            "revision_weights": canary.weights,
            "canary": canary.status,
            "endpoints": rows,
            "signal_checks": screened.checks,
            "mesh": mesh_status,
            "last_reconcile_time": now,
        }
    )
    degraded = conditions.degraded(status.endpoints, spec.capacity.class_label, metrics.usable)
    status = conditions.with_condition(status, degraded, generation, before_conditions, now)
    return Plan(
        status=status,
        endpoints=tuple(
            EndpointWeight(
                v.name,
                v.pod.ip or "",
                v.revision,
                allocations[v.name].weight,
                v.pod.service_account,
                v.pod.labels.get(TLS_MODE_LABEL),
            )
            for v in routable
        ),
        revisions=tuple(sorted({v.revision for v in verdicts if v.revision is not None})),
        publish=publish,
        previous=previous,
        before=before,
        mirror=canary.mirror,
        steer=canary.steer,
        mesh=mesh,
    )


def routing_warnings(spec: InferencePoolSpec) -> tuple[str, ...]:
    """Routing settings Envoy will not act on as written."""
    least = spec.routing.least_request
    if least is not None and spec.routing.endpoint_weights and least.choice_count != 2:
        return (
            f"routing.leastRequest.choiceCount {least.choice_count} has no effect: with per-pod endpoint weights "
            "Envoy picks by weighted EDF (weight / (active+1)^activeRequestBias) and samples choiceCount hosts only "
            "while every weight is equal",
        )
    return ()


def gate_warnings(spec: InferencePoolSpec) -> list[str]:
    """Enabled canary gates whose signal the engine cannot provide: the rollout could never pass them."""
    if spec.canary is None:
        return []
    have = set(supported_signals(spec))
    analyses = [("canary.analysis", spec.canary.analysis)]
    if spec.canary.shadow is not None:
        analyses.append(("canary.shadow.analysis", spec.canary.shadow.analysis))
    warnings = []
    for where, analysis in analyses:
        lacking = [gate for gate in enabled_gates(analysis) if GATE_SIGNAL[gate] not in have]
        if not lacking:
            continue
        signals = sorted({GATE_SIGNAL[gate] for gate in lacking})
        prefix = "canary" if where == "canary.analysis" else "shadow"
        warnings.append(
            f"{prefix} gate(s) {', '.join(lacking)} need {', '.join(signals)}, which engine {spec.engine} does not "
            f"provide: no check can pass until they are listed in {where}.disabledGates or "
            f"metrics.queries supplies the signal"
        )
    return warnings


def revision_stats(
    spec: InferencePoolSpec, verdicts: list[PodVerdict], allocations: dict[str, Allocation]
) -> dict[str, RevisionStats]:
    if spec.canary is None:
        return {}
    groups: dict[str, list[PodVerdict]] = {}
    for verdict in verdicts:
        if verdict.revision is not None:
            groups.setdefault(verdict.revision, []).append(verdict)
    return {name: _aggregate(spec.metrics.window, items, allocations) for name, items in groups.items()}


def _aggregate(window: float, items: list[PodVerdict], allocations: dict[str, Allocation]) -> RevisionStats:
    """Request-weighted error rate and TTFT p95 over a revision's pods (p95 of pods, not of the merged histogram).

    Only fresh evidence counts: a pod whose samples are stale or absent (verdict frozen / awaiting) contributes
    no figures, and a routable one is named in `stale_pods`, which makes the check Inconclusive."""
    fresh = [v for v in items if v.kind not in ("frozen", "awaiting")]
    rated = [v for v in fresh if v.signals.request_rate is not None and v.signals.request_rate > 0]
    healthy = [v for v in items if allocations[v.name].healthy]
    learned = [(v, h) for v in healthy if (h := allocations[v.name].headroom) is not None and h.learned is not None]
    classed = [(v, h) for v, h in learned if v.class_known and v.capacity > 0]
    return RevisionStats(
        capacity=sum(h.capacity for _, h in learned) if healthy and len(learned) == len(healthy) else None,
        classes=sum(v.capacity for v in healthy) if all(v.class_known for v in healthy) else 0.0,
        per_k=sum(h.capacity for _, h in classed) / sum(v.capacity for v, _ in classed) if classed else None,
        window=window,
        routable_pods=sum(1 for v in items if allocations[v.name].routable),
        healthy_pods=sum(1 for v in items if allocations[v.name].healthy),
        stale_pods=tuple(
            sorted(v.name for v in items if v.kind in ("frozen", "awaiting") and allocations[v.name].routable)
        ),
        requests=sum((v.signals.request_rate or 0.0) * window for v in rated) if rated else None,
        error_rate=_weighted(rated, "error_rate"),
        ttft_p95=_weighted(rated, "ttft_p95_seconds"),
        incidents=sum(1 for v in items if v.new_incident),
    )


def _weighted(items: list[PodVerdict], field_name: str) -> float | None:
    """The request-weighted mean over the pods that measured the signal in the window; None when none did.

    A pod with finished requests but no TTFT sample in the window (its first tokens came before it) has nothing
    to contribute; it is not counted as 0."""
    pairs = [
        (value, v.signals.request_rate or 0.0) for v in items if (value := getattr(v.signals, field_name)) is not None
    ]
    if not pairs:
        return None
    total = sum(weight for _, weight in pairs)
    return sum(value * weight for value, weight in pairs) / total if total > 0 else None


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


def render_row(spec: InferencePoolSpec, verdict: PodVerdict, allocation: Allocation, now: datetime) -> dict[str, Any]:
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


__all__ = ["EndpointWeight", "Plan", "plan_pass"]
