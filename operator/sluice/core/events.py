"""Kubernetes Events, derived in one place from the previous and the next status. Pure.

Nothing else in sluice creates an Event: a pass computes its next status, and `derive_events(previous, next)`
names what changed — a condition's transition, a pod's state change, a rollout's step. So an Event can never
say something the status does not, and replaying a pass with the same inputs emits the same Events.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from sluice.api.memory import remembered
from sluice.api.v1alpha1 import CanaryStatus, Condition, EndpointStatus, InferencePoolStatus

ACTIVE = ("Shadow", "Progressing", "Paused", "Waiting")


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


def derive_events(
    previous: InferencePoolStatus | None,
    next_: InferencePoolStatus,
    before: Mapping[str, EndpointStatus] | None = None,
) -> tuple[Event, ...]:
    """`before`: every pod `previous` remembers (`remembered(previous)`), when the caller has it decoded."""
    rows = remembered(previous) if before is None else before
    return (
        *_condition_events(previous, next_, rows),
        *_endpoint_events(rows, next_),
        *_canary_events(previous.canary if previous else None, next_.canary),
    )


def _cond(status: InferencePoolStatus | None, type_: str) -> Condition | None:
    return next((c for c in status.conditions if c.type == type_), None) if status else None


def _condition_events(
    previous: InferencePoolStatus | None, next_: InferencePoolStatus, rows: Mapping[str, EndpointStatus]
) -> Iterator[Event]:
    def became(type_: str) -> tuple[Condition | None, Condition | None]:
        return _cond(previous, type_), _cond(next_, type_)

    before, after = became("SpecValid")
    if after is not None and after.status == "False" and (before is None or before.message != after.message):
        yield Event("Warning", "InvalidSpec", after.message)
    if after is not None and after.reason == "GatesWithoutData" and (before is None or before.message != after.message):
        yield Event("Warning", "GatesWithoutData", after.message)
    before, after = became("MetricsAvailable")
    if after is not None:
        if after.status == "False" and (before.status == "True" if before else previous is not None):
            yield Event("Warning", "MetricsUnavailable", after.message)
        elif after.status == "True" and before is not None and before.status == "False":
            yield Event("Normal", "MetricsRestored", "signals are fresh again; weights follow them")
    before, after = became("Ready")
    if after is not None and after.reason == "ReconcileFailed" and (before is None or before.message != after.message):
        yield Event("Warning", "ReconcileFailed", after.message)
    before, after = became("SplitForced")
    if after is not None and after.status == "True" and (before is None or before.status != "True"):
        yield Event("Warning", "SplitForced", after.message)
    elif after is not None and after.status == "False" and before is not None and before.status == "True":
        yield Event("Normal", "SplitRestored", after.message)
    before, after = became("IstioSynced")
    if after is not None and after.status == "False" and (before is None or before.reason != after.reason):
        yield Event("Warning", after.reason, after.message)
    before, after = became("AdmissionEnforced")
    if after is not None:
        if before is None or (before.status, before.reason) != (after.status, after.reason):
            yield Event("Normal" if after.status == "True" else "Warning", f"Admission{after.reason}", after.message)
        if after.reason != "NotRendered":
            yield from _limit_events(rows, next_)
    before, after = became("TenantSharesEnforced")
    if after is not None and (before is None or (before.status, before.reason) != (after.status, after.reason)):
        yield Event("Normal" if after.status == "True" else "Warning", f"TenantShares{after.reason}", after.message)
    before, after = became("Shedding")
    if after is not None and after.status == "True" and (before is None or before.status != "True"):
        yield Event("Warning", "SheddingStarted", after.message)
    elif after is not None and after.status == "False" and before is not None and before.status == "True":
        yield Event("Normal", "SheddingStopped", after.message)
    yield from _class_events(rows, next_)


def _class_limits(rows: Iterable[EndpointStatus]) -> dict[str, int]:
    return {r.hardware_class: r.inbound_limit for r in rows if r.hardware_class and r.inbound_limit is not None}


def _limit_events(before: Mapping[str, EndpointStatus], next_: InferencePoolStatus) -> Iterator[Event]:
    """The limits per hardware class moved (`admission.mode: Enforce`: its sidecars' EnvoyFilter rewritten)."""
    old, new = _class_limits(before.values()), _class_limits(next_.endpoints)
    if old == new:
        return
    moved = [
        f"{name} {old[name]} -> {new[name]}" if name in old and name in new else f"{name} {new[name]} (new)"
        for name in sorted(new)
        if old.get(name) != new[name]
    ]
    moved += [f"{name} {old[name]} (gone)" for name in sorted(set(old) - set(new))]
    yield Event("Normal", "AdmissionLimits", "sidecar limits per hardware class: " + "; ".join(moved))


def _class_events(before: Mapping[str, EndpointStatus], next_: InferencePoolStatus) -> Iterator[Event]:
    known_before = {row.pod for row in before.values() if not row.class_known}  # podMemory too
    fresh: dict[str, list[str]] = {}
    for row in next_.endpoints:
        if not row.class_known and row.pod not in known_before:
            fresh.setdefault(row.hardware_class or "(no label)", []).append(row.pod)
    for value, pods in sorted(fresh.items()):
        yield Event(
            "Warning",
            "UnknownHardwareClass",
            f"hardware class {value!r} is not in capacity.classes, capacity.default used: {', '.join(pods)}",
        )


MAX_NAMED = 20
"""Pods named in one Event; the rest are counted ("and N more")."""
MAX_POD_EVENTS = 10
"""Events of one reason about pods per pass; the pods of the rest share one more Event."""
MESSAGE_LIMIT = 1024
"""What an Event's message may hold (the runtime cuts there): the reason comes first, the names fill the rest."""


def _about(pods: list[str], message: str) -> str:
    """`pod: message` for one pod; `N pods: message: a, b, ... and K more` for several, within the limit."""
    if len(pods) == 1:
        return f"{pods[0]}: {message}"
    head = f"{len(pods)} pods: {message}: "
    names: list[str] = []
    for pod in pods[:MAX_NAMED]:
        more = len(pods) - len(names) - 1
        tail = f" and {more} more" if more > 0 else ""
        if len(head) + len(", ".join([*names, pod])) + len(tail) > MESSAGE_LIMIT:
            break
        names.append(pod)
    more = len(pods) - len(names)
    return head + ", ".join(names) + (f" and {more} more" if more > 0 else "")


def _endpoint_events(before: Mapping[str, EndpointStatus], next_: InferencePoolStatus) -> Iterator[Event]:
    """Pods that changed state. Pods with the same reason and message share one Event, and one reason gives at
    most `MAX_POD_EVENTS` per pass: when a whole large pool changes at once (no signals yet at start-up, an
    outage), a pod per Event was thousands of Events in one pass."""
    said: dict[tuple[Literal["Normal", "Warning"], str, str], list[str]] = {}

    def say(type_: Literal["Normal", "Warning"], reason: str, pod: str, message: str) -> None:
        said.setdefault((type_, reason, message), []).append(pod)

    for row in next_.endpoints:
        prev = before.get(row.pod)
        incident_is_new = row.last_incident_at is not None and row.last_incident_at != (
            prev.last_incident_at if prev else None
        )
        if incident_is_new and row.weight == 0:
            say("Warning", "PodZeroed", row.pod, str(row.incident_message or row.incident))
        if row.capacity_held and not (prev is not None and prev.capacity_held):
            say("Warning", "PodHeld", row.pod, row.reason)
        elif prev is not None and prev.capacity_held and not row.capacity_held and row.weight == 0:
            say("Normal", "PodZeroed", row.pod, row.reason)
        if row.floor_held and not (prev is not None and prev.floor_held):
            say("Warning", "FloorHeld", row.pod, row.reason)
        if prev is None:
            continue
        if prev.state == "Zeroed" and row.state == "Recovering":
            say("Normal", "PodRecovering", row.pod, row.reason)
        elif prev.state == "Recovering" and row.state == "Routable" and row.verdict == "scored":
            say("Normal", "PodRecovered", row.pod, f"back to normal scoring (weight {row.weight})")
    by_reason: dict[tuple[Literal["Normal", "Warning"], str], list[tuple[str, list[str]]]] = {}
    for (type_, reason, message), pods in said.items():
        by_reason.setdefault((type_, reason), []).append((message, pods))
    for (type_, reason), groups in by_reason.items():
        shown = groups if len(groups) <= MAX_POD_EVENTS else groups[: MAX_POD_EVENTS - 1]
        for message, pods in shown:
            yield Event(type_, reason, _about(pods, message))
        rest = [pod for _, pods in groups[len(shown) :] for pod in pods]
        if rest:
            yield Event(type_, reason, _about(rest, "more, for their own reasons (see the status)"))


def _canary_events(previous: CanaryStatus | None, next_: CanaryStatus | None) -> Iterator[Event]:
    if next_ is None:
        return
    done = next_.last_operation
    if done is not None and (
        previous is None or previous.last_operation is None or previous.last_operation.id != done.id
    ):
        who = f" by {done.by}" if done.by else ""
        kind: Literal["Normal", "Warning"] = "Normal" if done.result == "Applied" else "Warning"
        forced = " (forced: analysis skipped)" if done.forced else ""
        yield Event(kind, "CanaryOperation", f"{done.op}{who}: {done.result.lower()}{forced}: {done.message}")
    was_active = previous is not None and previous.phase in ACTIVE
    candidate = next_.candidate_revision
    same = previous is not None and previous.candidate_revision == candidate
    if next_.phase == "Idle":
        if was_active and previous is not None:
            yield Event(
                "Normal",
                "CanaryAborted",
                f"candidate {previous.candidate_revision} removed: traffic back to {next_.stable_revision}",
            )
        return
    if next_.phase == "Promoted":
        if previous is None or previous.phase != "Promoted":
            yield Event("Normal", "CanaryPromoted", next_.message)
        return
    if not same:
        reason = "CanaryRestarted" if was_active else "CanaryStarted"
        shadow = " in shadow first (mirrored requests only)" if next_.stage == "Shadow" else ""
        yield Event("Normal", reason, f"rolling out {candidate} over {next_.stable_revision}{shadow}")
    yield from _shadow_events(previous if same else None, next_)
    failed_before = previous.failed_checks if same and previous else 0
    if next_.failed_checks > failed_before:
        where = "in shadow" if next_.stage == "Shadow" else f"at {next_.weight}%"
        yield Event(
            "Warning",
            "CanaryCheckFailed",
            f"{candidate} {where}: {next_.last_check_reason} ({next_.failed_checks} failed)",
        )
    if next_.phase == "RolledBack" and not (same and previous is not None and previous.phase == "RolledBack"):
        yield Event("Warning", "CanaryRolledBack", next_.message)
    if same and previous is not None and (next_.step_index or 0) > (previous.step_index or 0):
        held = f", published at {next_.weight}%" if next_.capacity_held else ""
        yield Event(
            "Normal",
            "CanaryAdvanced",
            f"{candidate} to {next_.step_weight}% (step {(next_.step_index or 0) + 1}){held}",
        )
    if next_.capacity_held and not (
        same and previous is not None and previous.capacity_held and previous.step_index == next_.step_index
    ):
        yield Event(
            "Normal",
            "CanaryHeldForCapacity",
            f"{candidate} at {next_.weight}% of step {next_.step_weight}%: {next_.capacity_held}",
        )


def _shadow_events(previous: CanaryStatus | None, next_: CanaryStatus) -> Iterator[Event]:
    """The mirror appearing or going away while in shadow, and the shadow ending into the live steps."""
    candidate = next_.candidate_revision
    mirrored_before = previous.mirror_percent if previous is not None else None
    if next_.stage == "Shadow" and next_.mirror_percent is not None and mirrored_before is None:
        yield Event("Normal", "ShadowMirroring", f"{next_.mirror_percent:g}% of requests mirrored to {candidate}")
    elif next_.stage == "Shadow" and next_.mirror_percent is None and mirrored_before is not None:
        yield Event("Normal", "ShadowMirrorRemoved", f"no mirror to {candidate}: {next_.message}")
    if previous is not None and previous.stage == "Shadow" and next_.stage == "Live":
        yield Event("Normal", "ShadowPassed", f"{candidate} shadow {next_.shadow_verdict or 'ended'}: to live steps")
