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

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from sluice.api.memory import remembered
from sluice.api.operation import Operation
from sluice.api.v1alpha1 import (
    AdmissionStatus,
    CanaryStatus,
    EndpointStatus,
    InferencePoolSpec,
    InferencePoolStatus,
    MeshStatus,
)
from sluice.core import status as conditions
from sluice.core.allocation import Allocation, allocate
from sluice.core.canary import step_canary
from sluice.core.canarycheck import RevisionStats, enabled_gates
from sluice.core.canaryround import CanaryOutcome, Mirror
from sluice.core.events import Event, derive_events
from sluice.core.evidence import MetricsVerdict, judge_metrics
from sluice.core.inbound import NO_CLASS, NO_SIDECAR, Enforcement, PodAdmission, enforced_limits
from sluice.core.mesh import TLS_MODE_LABEL, MeshPlan, PoolId, assess
from sluice.core.observed import Observed, ObservedPod
from sluice.core.presets import supported_signals
from sluice.core.rows import StatusRow, render_row, with_inbound_limits
from sluice.core.signalcheck import Screened, screen
from sluice.core.status import NAMED_PODS, Want
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
    admission: Enforcement | None = None
    """`admission.mode: Enforce`: the limit per hardware class to render on its pods' sidecars."""

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
    hashing = spec.routing.session_affinity is not None
    allocations = allocate(spec.scoring, spec.protection, verdicts, _bias(spec), spec.metrics.window, hashing)
    canary = _step_canary(spec, previous, verdicts, allocations, metrics.usable, now, operation)
    rows = with_inbound_limits(spec, [render_row(spec, v, allocations[v.name], now) for v in verdicts], before, now)
    eligible = [v for v in verdicts if v.eligible]
    routable = [v for v in eligible if allocations[v.name].routable]
    mesh = assess(spec, pool, observed.mesh, bool(canary.weights))
    publish = bool(routable) and mesh.refusal is None
    wants = _wants(spec, len(routable), len(eligible), metrics, screened, mesh, canary.status)
    admission = _enforcement(spec, pods, rows, mesh)
    if admission is not None:
        rows = _rendered_limits(rows, admission)
        unpublished = None if publish else "nothing is published this pass; the sidecars keep the limits last rendered"
        wants.append(conditions.admission_enforced(admission, mesh.refusal or unpublished))
        if spec.admission.tenants is not None:
            wants.append(conditions.tenant_shares(admission, mesh.refusal or unpublished))
        wants.append(conditions.shedding(admission))
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
            "mesh": _mesh_status(mesh, publish, previous),
            "admission": _admission_status(admission),
            "last_reconcile_time": now,
        }
    )
    degraded = conditions.degraded(status.endpoints, spec.capacity.class_label, metrics.usable)
    return Plan(
        status=conditions.with_condition(status, degraded, generation, before_conditions, now),
        endpoints=tuple(_endpoint(v, allocations[v.name]) for v in routable),
        revisions=tuple(sorted({v.revision for v in verdicts if v.revision is not None})),
        publish=publish,
        previous=previous,
        before=before,
        mirror=canary.mirror,
        steer=canary.steer,
        mesh=mesh,
        admission=admission,
    )


def _enforcement(
    spec: InferencePoolSpec, pods: list[ObservedPod], rows: list[StatusRow], mesh: MeshPlan
) -> Enforcement | None:
    """The limits to render (`admission.mode: Enforce`), from the limits the rows show."""
    if spec.admission.mode != "Enforce":
        return None
    sidecars = {
        p.name for p in pods if p.labels.get(TLS_MODE_LABEL) == "istio" and mesh.dataplane != "ambient-waypoint"
    }
    return enforced_limits(
        [
            PodAdmission(
                r["pod"],
                r["hardware_class"],
                r["inbound_limit"],
                r["pod"] in sidecars,
                r["signals"].running_requests,
                r["rate_limit"],
                r["signals"].refused_rate,
                r["signals"].request_rate,
            )
            for r in rows
        ],
        tenants=spec.admission.tenants is not None,
    )


def _admission_status(admission: Enforcement | None) -> AdmissionStatus | None:
    """The pool's refused and served rates, as the Shedding condition judges them (None without Enforce)."""
    if admission is None:
        return None
    refused, served = admission.refused_rate, admission.served_rate
    total = None if refused is None or served is None else refused + served
    return AdmissionStatus(
        refused_rate=refused,
        served_rate=served,
        refused_share=refused / total if refused is not None and total else None,
        uncounted=list(admission.uncounted[:NAMED_PODS]),
    )


def _rendered_limits(rows: list[StatusRow], admission: Enforcement) -> list[StatusRow]:
    """`admission.mode: Enforce`: a row shows the limit and the rate its sidecar is given, none where the condition
    names the pod as admitted without one (no sidecar, no class label)."""
    unenforced = {pod for why in (NO_SIDECAR, NO_CLASS) for pod in admission.unlimited.get(why, ())}
    unlimited = {pod for pods in admission.unlimited.values() for pod in pods}
    out: list[StatusRow] = []
    for row in rows:
        shown = row
        if (row["pod"] in unlimited and row["inbound_limit"] is not None) or (
            row["pod"] in unenforced and row["rate_limit"] is not None
        ):
            shown = row.copy()
            if row["pod"] in unlimited:
                shown["inbound_limit"] = None
            if row["pod"] in unenforced:
                shown["rate_limit"] = None
        out.append(shown)
    return out


def _wants(
    spec: InferencePoolSpec,
    routable: int,
    eligible: int,
    metrics: MetricsVerdict,
    screened: Screened,
    mesh: MeshPlan,
    canary: CanaryStatus | None,
) -> list[Want]:
    """The pass's conditions but Degraded (it reads the validated rows)."""
    wants = [
        conditions.ready(routable, eligible, mesh.refusal),
        conditions.spec_valid(gate_warnings(spec), routing_warnings(spec)),
        conditions.metrics_available(metrics.usable, metrics.reason, metrics.message),
        conditions.signals_ready(*screened.ready),
        mesh.condition(),
    ]
    if canary is not None:
        wants += [conditions.progressing(canary), conditions.split_forced(canary)]
    return wants


def _bias(spec: InferencePoolSpec) -> float:
    """Envoy's least-request divides a weight by (active + 1)^bias; consistent hash (sessionAffinity) weighs
    proportionally, so the plan's weights then follow its shares (bias 0)."""
    if spec.routing.least_request is not None:
        return spec.routing.least_request.active_request_bias
    return 0.0 if spec.routing.session_affinity is not None else 1.0


def _step_canary(
    spec: InferencePoolSpec,
    previous: InferencePoolStatus | None,
    verdicts: list[PodVerdict],
    allocations: dict[str, Allocation],
    metrics_usable: bool,
    now: datetime,
    operation: Operation | None,
) -> CanaryOutcome:
    """The rollout's step on this pass's figures per revision."""
    revisions = revision_stats(spec, verdicts, allocations)
    previous_canary = previous.canary if previous else None
    target = spec.scoring.target_utilization
    return step_canary(spec.canary, previous_canary, revisions, metrics_usable, now, operation, target)


def _mesh_status(mesh: MeshPlan, publish: bool, previous: InferencePoolStatus | None) -> MeshStatus:
    """The status' `mesh`; when nothing is written, the EnvoyFilters are where the last publishing pass put them
    (pruning looks there)."""
    mesh_status = mesh.status()
    if not publish and previous is not None and previous.mesh is not None:
        return mesh_status.model_copy(update={"envoy_filter_namespaces": previous.mesh.envoy_filter_namespaces})
    return mesh_status


def _endpoint(verdict: PodVerdict, allocation: Allocation) -> EndpointWeight:
    """A routable pod as the ServiceEntry lists it."""
    pod = verdict.pod
    return EndpointWeight(
        verdict.name,
        pod.ip or "",
        verdict.revision,
        allocation.weight,
        pod.service_account,
        pod.labels.get(TLS_MODE_LABEL),
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
        quiet=bool(healthy)
        and all((h := allocations[v.name].headroom) is not None and h.by_latency is not None for v in healthy),
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


__all__ = ["EndpointWeight", "Plan", "plan_pass"]
