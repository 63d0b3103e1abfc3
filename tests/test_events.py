"""Events are derived from (previous status, next status) in one function: one table row per Event."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.api.memory import encode
from sluice.api.status import EndpointStatus
from sluice.api.v1alpha1 import InferencePoolStatus
from sluice.core.events import derive_events
from tests.helpers import T0, at

NOW = at(5)


def cond(type_: str, status: str, reason: str, message: str = "m") -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": T0}


def row(pod: str = "p", **fields: Any) -> dict[str, Any]:
    return {"pod": pod, "state": "Routable", "weight": 10, **fields}


def canary(phase: str, **fields: Any) -> dict[str, Any]:
    return {"phase": phase, "stableRevision": "v1", "candidateRevision": "v2", "stepIndex": 0, **fields}


def status(**fields: Any) -> InferencePoolStatus:
    return InferencePoolStatus.model_validate(fields)


INCIDENT = {"lastIncidentAt": NOW, "incident": "ErrorRate", "incidentMessage": "error rate 50.0% >= 10.0%"}
TABLE: list[tuple[str, dict[str, Any] | None, dict[str, Any], str, str]] = [
    ("InvalidSpec", {}, {"conditions": [cond("SpecValid", "False", "InvalidSpec", "bad")]}, "Warning", "bad"),
    (
        "GatesWithoutData",
        {"conditions": [cond("SpecValid", "True", "Valid")]},
        {"conditions": [cond("SpecValid", "True", "GatesWithoutData", "no ttft")]},
        "Warning",
        "no ttft",
    ),
    (
        "MetricsUnavailable",
        {"conditions": [cond("MetricsAvailable", "True", "Fresh")]},
        {"conditions": [cond("MetricsAvailable", "False", "Stale", "old")]},
        "Warning",
        "old",
    ),
    (
        "MetricsRestored",
        {"conditions": [cond("MetricsAvailable", "False", "Stale")]},
        {"conditions": [cond("MetricsAvailable", "True", "Fresh")]},
        "Normal",
        "fresh again",
    ),
    (
        "ReconcileFailed",
        {"conditions": [cond("Ready", "True", "WeightsPublished")]},
        {"conditions": [cond("Ready", "False", "ReconcileFailed", "boom")]},
        "Warning",
        "boom",
    ),
    (
        "SplitForced",
        {"conditions": [cond("SplitForced", "False", "AsPlanned")]},
        {"conditions": [cond("SplitForced", "True", "NoHealthyPods", "stable down")]},
        "Warning",
        "stable down",
    ),
    (
        "SplitRestored",
        {"conditions": [cond("SplitForced", "True", "NoHealthyPods")]},
        {"conditions": [cond("SplitForced", "False", "AsPlanned", "as planned")]},
        "Normal",
        "as planned",
    ),
    (
        "ObjectNotManaged",
        {"conditions": [cond("IstioSynced", "True", "Synced")]},
        {"conditions": [cond("IstioSynced", "False", "ObjectNotManaged", "not ours")]},
        "Warning",
        "not ours",
    ),
    (
        "WriteFailed",
        {"conditions": [cond("IstioSynced", "True", "Synced")]},
        {"conditions": [cond("IstioSynced", "False", "WriteFailed", "409")]},
        "Warning",
        "409",
    ),
    ("UnknownHardwareClass", {}, {"endpoints": [row(hardwareClass="A100", classKnown=False)]}, "Warning", "'A100'"),
    (
        "PodZeroed",
        {"endpoints": [row()]},
        {"endpoints": [row(state="Zeroed", weight=0, **INCIDENT)]},
        "Warning",
        "50.0%",
    ),
    ("FloorHeld", {"endpoints": [row()]}, {"endpoints": [row(floorHeld=True, reason="kept")]}, "Warning", "p: kept"),
    (
        "PodRecovering",
        {"endpoints": [row(state="Zeroed", weight=0)]},
        {"endpoints": [row(state="Recovering", weight=1, reason="ramp")]},
        "Normal",
        "p: ramp",
    ),
    (
        "PodRecovered",
        {"endpoints": [row(state="Recovering", weight=1)]},
        {"endpoints": [row(verdict="scored")]},
        "Normal",
        "back to normal",
    ),
    ("CanaryStarted", {}, {"canary": canary("Progressing")}, "Normal", "rolling out v2 over v1"),
    (
        "CanaryRestarted",
        {"canary": canary("Progressing", candidateRevision="v3")},
        {"canary": canary("Progressing")},
        "Normal",
        "rolling out v2",
    ),
    (
        "CanaryAdvanced",
        {"canary": canary("Progressing")},
        {"canary": canary("Progressing", stepIndex=1, stepWeight=25)},
        "Normal",
        "v2 to 25% (step 2)",
    ),
    (
        "CanaryCheckFailed",
        {"canary": canary("Progressing")},
        {"canary": canary("Progressing", failedChecks=1, lastCheckReason="slow", weight=5)},
        "Warning",
        "v2 at 5%: slow (1 failed)",
    ),
    (
        "CanaryRolledBack",
        {"canary": canary("Progressing", failedChecks=1)},
        {"canary": canary("RolledBack", failedChecks=1, message="rolled back v2")},
        "Warning",
        "rolled back v2",
    ),
    (
        "CanaryPromoted",
        {"canary": canary("Progressing", stepIndex=3)},
        {"canary": canary("Promoted", stableRevision="v2", message="v2 promoted")},
        "Normal",
        "v2 promoted",
    ),
    (
        "CanaryStarted",
        {},
        {"canary": canary("Shadow", stage="Shadow", mirrorPercent=50)},
        "Normal",
        "rolling out v2 over v1 in shadow first (mirrored requests only)",
    ),
    (
        "ShadowMirroring",
        {"canary": canary("Waiting", stage="Shadow")},
        {"canary": canary("Shadow", stage="Shadow", mirrorPercent=50)},
        "Normal",
        "50% of requests mirrored to v2",
    ),
    (
        "ShadowMirrorRemoved",
        {"canary": canary("Shadow", stage="Shadow", mirrorPercent=50)},
        {"canary": canary("Waiting", stage="Shadow", message="shadow: candidate v2 has no routable pods")},
        "Normal",
        "no mirror to v2: shadow: candidate v2 has no routable pods",
    ),
    (
        "ShadowPassed",
        {"canary": canary("Shadow", stage="Shadow", mirrorPercent=50)},
        {"canary": canary("Progressing", stage="Live", weight=10, shadowVerdict="passed after 60s: ok")},
        "Normal",
        "v2 shadow passed after 60s: ok: to live steps",
    ),
    (
        "CanaryCheckFailed",
        {"canary": canary("Shadow", stage="Shadow", mirrorPercent=50)},
        {"canary": canary("Shadow", stage="Shadow", mirrorPercent=50, failedChecks=1, lastCheckReason="5xx")},
        "Warning",
        "v2 in shadow: 5xx (1 failed)",
    ),
    (
        "CanaryRolledBack",
        {"canary": canary("Shadow", stage="Shadow", mirrorPercent=50, failedChecks=1)},
        {"canary": canary("RolledBack", stage="Shadow", failedChecks=1, message="rolled back v2 in shadow")},
        "Warning",
        "rolled back v2 in shadow",
    ),
    (
        "CanaryAborted",
        {"canary": canary("Progressing")},
        {"canary": {"phase": "Idle", "stableRevision": "v1"}},
        "Normal",
        "candidate v2 removed: traffic back to v1",
    ),
]


IDS = [f"{row[0]}-{sum(1 for other in TABLE[:i] if other[0] == row[0])}" for i, row in enumerate(TABLE)]


@pytest.mark.parametrize(("reason", "before", "after", "kind", "says"), TABLE, ids=IDS)
def test_each_event_comes_from_its_transition(reason, before, after, kind, says):
    previous = status(**before) if before is not None else None
    events = derive_events(previous, status(**after))
    matching = [e for e in events if e.reason == reason]
    assert len(matching) == 1, events
    assert matching[0].type == kind
    assert says in matching[0].message


@pytest.mark.parametrize(("reason", "before", "after", "kind", "says"), TABLE, ids=IDS)
def test_no_event_when_nothing_changed(reason, before, after, kind, says):
    same = status(**after)
    assert [e.reason for e in derive_events(same, same)] == []


def test_a_pod_of_an_unknown_class_held_in_pod_memory_is_not_announced_again() -> None:
    remembered = EndpointStatus.model_validate(row("p-7", hardwareClass="H200", classKnown=False))
    previous = status(podMemory=encode([remembered]))  # a large pool: the pod had no row, only its memory
    next_ = status(endpoints=[row("p-7", hardwareClass="H200", classKnown=False)])
    assert [e.reason for e in derive_events(previous, next_)] == []
    fresh = status(endpoints=[row("p-8", hardwareClass="H200", classKnown=False)])
    assert [e.reason for e in derive_events(previous, fresh)] == ["UnknownHardwareClass"]


def test_pods_with_the_same_reason_share_one_event_naming_the_first_twenty():
    pods = [f"p{i:02d}" for i in range(40)]
    previous = status(endpoints=[row(p) for p in pods])
    held = status(endpoints=[row(p, floorHeld=True, reason="kept: no signals yet") for p in pods])
    (event,) = derive_events(previous, held)
    assert event.reason == "FloorHeld"
    assert event.message == "40 pods: kept: no signals yet: " + ", ".join(pods[:20]) + " and 20 more"


def test_a_shared_event_keeps_its_reason_and_count_within_the_message_limit():
    pods = [f"llama-3-70b-instruct-a100-deployment-7d9f8c6b5-{i:05d}-with-a-long-tail" for i in range(40)]
    previous = status(endpoints=[row(p) for p in pods])
    held = status(endpoints=[row(p, floorHeld=True, reason="kept: no signals yet") for p in pods])
    (event,) = derive_events(previous, held)
    assert len(event.message) <= 1024
    assert event.message.startswith("40 pods: kept: no signals yet: llama-3-70b")
    named = event.message.removeprefix("40 pods: kept: no signals yet: ").split(" and ")[0].split(", ")
    assert set(named) <= set(pods)
    assert event.message.endswith(f" and {40 - len(named)} more")


def test_one_reason_gives_at_most_ten_events_a_pass_the_other_pods_sharing_the_last():
    pods = [f"p{i:02d}" for i in range(15)]
    previous = status(endpoints=[row(p) for p in pods])
    zeroed = [
        row(p, state="Zeroed", weight=0, **{**INCIDENT, "incidentMessage": f"error rate {i}0%"})
        for i, p in enumerate(pods)
    ]
    events = derive_events(previous, status(endpoints=zeroed))
    assert [e.reason for e in events] == ["PodZeroed"] * 10
    assert [e.message for e in events[:9]] == [f"p{i:02d}: error rate {i}0%" for i in range(9)]
    assert events[9].message == "6 pods: more, for their own reasons (see the status): p09, p10, p11, p12, p13, p14"
