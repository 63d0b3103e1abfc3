"""Status: conditions as metav1.Condition, one small builder per concern, one aggregator; lenient reading. Pure.

Conditions are computed as a whole every pass (a merge patch replaces lists); a condition keeps its
lastTransitionTime while its status does not change. The core builds every condition of a pass; the runtime
adds the ones only it can know (`IstioSynced`, a failed pass) through `with_condition`, the same builder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime

from sluice.api.v1alpha1 import (
    CanaryStatus,
    Condition,
    ConditionStatus,
    EndpointStatus,
    InferencePoolStatus,
)
from sluice.core.apiretry import TROUBLES, Episode
from sluice.core.inbound import NO_CLASS, NO_SIDECAR, Enforcement

# A condition message names at most this many pods per finding (a 4,096-pod pool must not list them all).
NAMED_PODS = 20
CONDITION_TYPES = (
    "Ready",
    "SpecValid",
    "MetricsAvailable",
    "SignalsReady",
    "Degraded",
    "Progressing",
    "SplitForced",
    "MeshReach",
    "IstioSynced",
    "KubeApiHealthy",
    "AdmissionEnforced",
    "TenantSharesEnforced",
    "Shedding",
)


@dataclass(frozen=True)
class Want:
    """A condition as a pass wants it; `conditions` turns it into a metav1.Condition."""

    type: str
    status: ConditionStatus
    reason: str
    message: str


def make_condition(want: Want, generation: int | None, previous: Iterable[Condition], now: datetime) -> Condition:
    before = find(list(previous), want.type)
    since = before.last_transition_time if before is not None and before.status == want.status else now
    return Condition(
        type=want.type,
        status=want.status,
        reason=want.reason,
        message=want.message,
        last_transition_time=since,
        observed_generation=generation,
    )


def conditions(
    wants: Iterable[Want], generation: int | None, previous: list[Condition], now: datetime
) -> list[Condition]:
    """The whole condition list, in a stable order."""
    built = [make_condition(want, generation, previous, now) for want in wants]
    return sorted(built, key=lambda c: _order(c.type))


def with_condition(
    status: InferencePoolStatus, want: Want, generation: int | None, previous: list[Condition], now: datetime
) -> InferencePoolStatus:
    """The status with one condition set (added or replaced), its transition time kept from `previous`."""
    others = [c for c in status.conditions if c.type != want.type]
    merged = sorted([*others, make_condition(want, generation, previous, now)], key=lambda c: _order(c.type))
    return status.model_copy(update={"conditions": merged})


def find(conditions_: list[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions_ if c.type == type_), None)


def _order(type_: str) -> int:
    return CONDITION_TYPES.index(type_) if type_ in CONDITION_TYPES else len(CONDITION_TYPES)


# ------------------------------------------------------------------------------------ one builder per concern


def ready(routable: int, eligible: int, refused: str | None = None) -> Want:
    if refused is not None:
        return Want("Ready", "False", "MeshRefused", f"nothing is published: {refused}")
    if routable:
        return Want("Ready", "True", "WeightsPublished", f"{routable} of {eligible} ready pods routable")
    if eligible:
        return Want(
            "Ready",
            "False",
            "NothingRoutable",
            "no pod can be routed on evidence: the mesh keeps its last configuration",
        )
    return Want("Ready", "False", "NoReadyPods", "no pod is ready: the mesh keeps its last configuration")


def spec_valid(gate_warnings: list[str], inert: tuple[str, ...] = ()) -> Want:
    """Accepted; gates that can never pass, then settings Envoy will not act on, are named."""
    if gate_warnings:
        return Want("SpecValid", "True", "GatesWithoutData", "; ".join([*gate_warnings, *inert]))
    if inert:
        return Want("SpecValid", "True", "SettingWithoutEffect", "; ".join(inert))
    return Want("SpecValid", "True", "Valid", "spec accepted")


def metrics_available(usable: bool, reason: str, message: str) -> Want:
    return Want("MetricsAvailable", "True" if usable else "False", reason, message)


SIGNALS_READY_MESSAGE = 1000
"""A SignalsReady message is cut at this many characters (`status.signalChecks` has every finding)."""


def signals_ready(status: ConditionStatus, reason: str, message: str) -> Want:
    """The preflight (`sluice.core.signalcheck`): are the series the preset reads there, fresh, one per pod?"""
    cut = message if len(message) <= SIGNALS_READY_MESSAGE else message[: SIGNALS_READY_MESSAGE - 1] + "…"
    return Want("SignalsReady", status, reason, cut)


def degraded(rows: list[EndpointStatus], class_label: str, metrics_usable: bool) -> Want:
    """The worst thing wrong with the pool's pods first; every finding listed."""
    findings: list[tuple[str, str]] = []

    def names(pick: Callable[[EndpointStatus], bool]) -> list[str]:
        return [row.pod for row in rows if pick(row)]

    groups = [
        ("FloorHeld", "held by the floor", names(lambda r: r.floor_held)),
        ("HeldForCapacity", "held (the others cannot take their share)", names(lambda r: r.capacity_held)),
        (
            "PodsZeroed",
            "zeroed",
            names(lambda r: r.verdict == "quiet" and not r.floor_held and not r.capacity_held),
        ),
        ("PodsRecovering", "recovering", names(lambda r: r.state == "Recovering")),
        (
            "PodsUnobserved",
            "no fresh samples (weight frozen)",
            names(lambda r: metrics_usable and r.verdict == "frozen"),
        ),
        (
            "AwaitingEvidence",
            "no samples yet (not routed)",
            names(lambda r: r.verdict == "awaiting" and not r.floor_held),
        ),
    ]
    for reason, label, pods in groups:
        if pods:
            findings.append((reason, f"{label}: {_named(pods)}"))
    unknown: dict[str, list[str]] = {}
    for row in rows:
        if not row.class_known:
            unknown.setdefault(row.hardware_class or "(no label)", []).append(row.pod)
    if unknown:
        listed = "; ".join(f"{value}: {_named(pods)}" for value, pods in sorted(unknown.items()))
        findings.append(
            ("UnknownHardwareClass", f"{class_label} not in capacity.classes, capacity.default used ({listed})")
        )
    missing = [f"{row.pod} ({', '.join(row.missing_signals)})" for row in rows if row.missing_signals]
    if missing:
        more = f"; and {len(missing) - NAMED_PODS} more" if len(missing) > NAMED_PODS else ""
        findings.append(("SignalsMissing", f"no series for {'; '.join(missing[:NAMED_PODS])}{more}"))
    if not findings:
        return Want("Degraded", "False", "AllHealthy", "every ready pod is scored normally")
    return Want("Degraded", "True", findings[0][0], "; ".join(text for _, text in findings))


def _named(pods: list[str]) -> str:
    more = f" and {len(pods) - NAMED_PODS} more" if len(pods) > NAMED_PODS else ""
    return ", ".join(pods[:NAMED_PODS]) + more


def admission_enforced(enforcement: Enforcement, refusal: str | None) -> Want:
    """`admission.mode: Enforce`: which hardware classes have a limit on their sidecars, and which pods are
    admitted without one, and why."""
    if refusal is not None:
        return Want("AdmissionEnforced", "False", "NotRendered", f"no limit rendered: {refusal}")
    rendered = ", ".join(f"{name} {limit}" for name, limit in sorted(enforcement.limits.items()))
    unlimited = "; ".join(f"{why}: {_named(list(pods))}" for why, pods in sorted(enforcement.unlimited.items()))
    if not enforcement.unlimited:
        return Want("AdmissionEnforced", "True", "Enforced", f"every pod's sidecar has its class's limit ({rendered})")
    message = f"admitted without a limit ({unlimited})" + (f"; enforced: {rendered}" if rendered else "")
    reason = "PartlyEnforced" if enforcement.limits else "NoLimits"
    return Want("AdmissionEnforced", "False", reason, message[:1000])


def tenant_shares(enforcement: Enforcement, refusal: str | None) -> Want:
    """`admission.tenants` under Enforce: which hardware classes' sidecars split an admitted rate among the
    tenants, and which pods have none (no rate read at their limit; no sidecar or class label, as
    AdmissionEnforced says)."""
    if refusal is not None:
        return Want("TenantSharesEnforced", "False", "NotRendered", f"no rate rendered: {refusal}")
    rendered = ", ".join(f"{name} {rate:g}/s" for name, rate in sorted(enforcement.rates.items()))
    without = sorted(
        [*enforcement.unshared, *enforcement.unlimited.get(NO_SIDECAR, ()), *enforcement.unlimited.get(NO_CLASS, ())]
    )
    if not without:
        return Want(
            "TenantSharesEnforced", "True", "Enforced", f"every pod's sidecar splits its class's rate ({rendered})"
        )
    message = f"admitted without tenant shares: {_named(without)}" + (f"; enforced: {rendered}" if rendered else "")
    reason = "PartlyEnforced" if enforcement.rates else "NoRates"
    return Want("TenantSharesEnforced", "False", reason, message[:1000])


def shedding(enforcement: Enforcement) -> Want:
    """`admission.mode: Enforce`: whether the sidecars sluice configures refused requests over the signals' window,
    as Istio counted them: True where any counted sidecar refused, False only where every one was counted and none
    refused. With some uncounted and none of the others refusing, a sample decides (an engine running at its limit
    has a sidecar refusing past it), and the message names the pods not counted. The message names pods, never
    rates (a condition's words are decisions, written at once; the rates are in `status.admission`)."""
    uncounted = f"; refusals not counted for {_named(list(enforcement.uncounted))}" if enforcement.uncounted else ""
    refusing = sorted(pod for pod, rate in enforcement.refused.items() if rate > 0)
    if refusing:
        message = f"sidecars refused requests over the signals' window: {_named(refusing)}{uncounted}"
        return Want("Shedding", "True", "Refusing", message[:1000])
    if enforcement.refused and not enforcement.uncounted:
        return Want(
            "Shedding",
            "False",
            "NoRefusals",
            f"none of the {len(enforcement.refused)} configured sidecars refused a request over the signals' window",
        )
    if enforcement.at_limit:
        message = (
            f"{len(enforcement.at_limit)} of {enforcement.read} limited pods ran at their limit at their last scrape "
            f"(their sidecars refuse past it): {_named(list(enforcement.at_limit))}{uncounted}"
        )
        return Want("Shedding", "True", "AtLimit", message[:1000])
    if not enforcement.read:
        message = f"no limited pod has a running count to compare with its limit{uncounted}"
        return Want("Shedding", "Unknown", "NoReadings", message[:1000])
    message = f"all {enforcement.read} limited pods ran below their limit at their last scrape{uncounted}"
    return Want("Shedding", "False", "BelowLimits", message[:1000])


def progressing(canary: CanaryStatus) -> Want:
    active = canary.phase in ("Shadow", "Progressing", "Paused", "Waiting")
    return Want("Progressing", "True" if active else "False", canary.phase, canary.message)


def split_forced(canary: CanaryStatus) -> Want:
    if canary.split_forced:
        return Want("SplitForced", "True", "NoHealthyPods", canary.split_forced)
    if canary.capacity_held:
        message = f"step {canary.step_weight}% published at {canary.weight}%: {canary.capacity_held}"
        return Want("SplitForced", "False", "HeldForCapacity", message)
    return Want("SplitForced", "False", "AsPlanned", f"the published split is the step's ({canary.weight}% candidate)")


def istio_synced(refused: list[str], failed: list[str], total: int) -> Want:
    """Whether the mesh has what the pass rendered. What was written when is not in the message (it would change
    the condition, and so the status, at the pass after every write): `sluice_istio_writes_total` counts it."""
    if refused:
        message = "; ".join(refused) + " (set spec.routing.adoptExisting to take it over)"
        return Want("IstioSynced", "False", "ObjectNotManaged", message)
    if failed:
        return Want("IstioSynced", "False", "WriteFailed", "; ".join(failed))
    return Want("IstioSynced", "True", "Synced", f"{total} objects in sync")


NOTHING_TO_PUBLISH = Want(
    "IstioSynced", "Unknown", "NothingToPublish", "no routable pod: the mesh keeps its last configuration"
)


def not_published(refused: str | None) -> Want:
    """IstioSynced for a pass that publishes nothing: no routable pod, or the mesh side refused the routing."""
    if refused is None:
        return NOTHING_TO_PUBLISH
    return Want(
        "IstioSynced", "Unknown", "MeshRefused", f"nothing written, the mesh keeps its configuration: {refused}"
    )


API_TROUBLES = {
    "no_answer": ("NoAnswer", "sent without an answer (timeouts, refused or reset connections)"),
    "server_error": ("ServerErrors", "answered with server errors (5xx)"),
    "throttled": ("Throttled", "throttled (429, waited out as Retry-After said)"),
    "slow": ("SlowAnswers", "answered slowly (one answer past 1 s, or a pass's answers past its interval)"),
}
"""Trouble kind (`sluice.core.apiretry.TROUBLES`, worst first) -> the condition's reason, and its words."""


def kube_api(episode: Episode | None) -> Want:
    """KubeApiHealthy: False while the pool's passes meet trouble at the API server, and for
    `HOLD_INTERVALS` intervals after (an episode: `next_episode`), naming every kind met since it began (its
    lastTransitionTime); the requests were sent again within the pass's budget, so a pass that then succeeded
    published what it decided. The counts are in `sluice_kube_retries_total`, not in the message (a message that
    changed at every pass would be a status write at every pass)."""
    if episode is None:
        return Want("KubeApiHealthy", "True", "Answering", "the API server answered this pool's passes")
    kinds = [kind for kind in TROUBLES if kind in episode.troubles]
    words = "; ".join(API_TROUBLES[kind][1] for kind in kinds)
    message = f"requests of this pool's passes were {words}; sent again within each pass's budget"
    return Want("KubeApiHealthy", "False", API_TROUBLES[kinds[0]][0], message)


def reconcile_failed(message: str) -> Want:
    return Want("Ready", "False", "ReconcileFailed", f"the pass failed and published nothing: {message}")


def invalid_spec(message: str) -> Want:
    return Want("SpecValid", "False", "InvalidSpec", message)
