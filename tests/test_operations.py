"""Rollout operations through the whole pass: each applied or refused once, recorded, and evented."""

from __future__ import annotations

from typing import Any

from sluice.api.operation import Operation, parse_operation
from sluice.core.reconcile import Plan, plan_pass
from tests.helpers import at, observed, pod, sig, spec

CANARY: dict[str, Any] = {
    "stableRevision": "v1",
    "candidateRevision": "v2",
    "steps": [10, 50, 100],
    "stepInterval": "60s",
    "analysis": {"interval": "5s", "minRequests": 10},
    "maxFailedChecks": 1,
}
PODS = [pod("v1-a", "a100", "v1"), pod("v1-b", "a100", "v1"), pod("v2-a", "a100", "v2")]


def run(
    seconds: float, previous: Any = None, op: Operation | None = None, candidate: Any = None, **canary: Any
) -> Plan:
    s = spec(canary={**CANARY, **canary})
    signals = {"v1-a": sig(rps=10), "v1-b": sig(rps=10), "v2-a": candidate or sig(rps=10)}
    return plan_pass(s, 1, observed(PODS, signals, at(seconds)), previous, at(seconds), op)


def op(name: str, id_: str = "1", **fields: Any) -> Operation:
    return Operation(id=id_, op=name, by="alice@prod", **fields)  # type: ignore[arg-type]


def reasons(plan: Plan) -> list[str]:
    return [e.reason for e in plan.events]


def test_promote_after_a_passing_check_finishes_the_rollout_now():
    first = run(0)  # step 1 (10 %), the first check passes at once
    assert first.status.canary.last_check == "Pass"
    promoted = run(5, first.status, op("promote"))
    assert promoted.status.canary.phase == "Promoted"
    assert promoted.revision_weights == {"v2": 100}
    record = promoted.status.canary.last_operation
    assert (record.op, record.result, record.forced, record.by) == ("promote", "Applied", False, "alice@prod")
    event = next(e for e in promoted.events if e.reason == "CanaryOperation")
    assert event.message == "promote by alice@prod: applied: promoted now"


def test_promote_without_a_passing_check_is_refused_unless_forced():
    first = run(0, candidate=sig(rps=0.01))  # too little traffic: Inconclusive
    assert first.status.canary.last_check == "Inconclusive"
    refused = run(5, first.status, op("promote"), candidate=sig(rps=0.01))
    assert refused.status.canary.phase == "Progressing"
    assert refused.status.canary.last_operation.result == "Refused"
    assert "--force skips analysis" in refused.status.canary.last_operation.message
    assert next(e for e in refused.events if e.reason == "CanaryOperation").type == "Warning"
    forced = run(10, refused.status, op("promote", "2", force=True), candidate=sig(rps=0.01))
    assert forced.status.canary.phase == "Promoted"
    assert forced.status.canary.last_operation.forced
    assert "forced: analysis skipped" in next(e for e in forced.events if e.reason == "CanaryOperation").message


def test_an_operation_is_applied_exactly_once_even_if_the_annotation_stays():
    first = run(0)
    skipped = run(5, first.status, op("skip-step"))
    assert skipped.status.canary.step_weight == 50
    again = run(10, skipped.status, op("skip-step"))  # the same id: nothing happens
    assert again.status.canary.step_weight == 50
    assert "CanaryOperation" not in reasons(again)


def test_abort_rolls_back_now_and_retry_starts_again_from_the_first_step():
    first = run(0)
    aborted = run(5, first.status, op("abort"))
    assert aborted.status.canary.phase == "RolledBack"
    assert aborted.revision_weights == {"v1": 100}
    stays = run(30, aborted.status)
    assert stays.status.canary.phase == "RolledBack"
    retried = run(35, stays.status, op("retry", "2"))
    assert retried.status.canary.phase == "Progressing"
    assert (retried.status.canary.step_weight, retried.status.canary.failed_checks) == (10, 0)
    assert retried.revision_weights == {"v1": 90, "v2": 10}


def test_retry_is_refused_unless_rolled_back_and_nothing_is_done_without_a_rollout():
    first = run(0)
    refused = run(5, first.status, op("retry"))
    assert refused.status.canary.last_operation.result == "Refused"
    idle = plan_pass(spec(canary={"stableRevision": "v1"}), 1, observed(PODS, {}, at(0)), None, at(0), op("promote"))
    assert idle.status.canary.last_operation.result == "Refused"
    assert "no rollout in progress" in idle.status.canary.last_operation.message


def test_pause_holds_the_step_without_touching_the_spec_and_resume_releases_it():
    first = run(0)
    paused = run(5, first.status, op("pause"))
    held = run(120, paused.status)  # long past the step interval, with passing checks
    assert (held.status.canary.phase, held.status.canary.step_weight) == ("Paused", 10)
    assert held.status.canary.paused_by == "alice@prod"
    resumed = run(125, held.status, op("resume", "2"))
    assert resumed.status.canary.paused_by is None
    later = run(190, resumed.status)
    assert later.status.canary.step_weight == 50  # a full step interval after the resume


def test_an_unreadable_annotation_is_refused_once_with_the_reason():
    bad = parse_operation({"sluice.dev/operation": '{"op": "promote-now", "id": "9"}'})
    assert bad is not None
    assert bad.op == "invalid"
    first = run(0)
    refused = run(5, first.status, bad)
    record = refused.status.canary.last_operation
    assert record.result == "Refused"
    assert "is not a valid operation" in record.message
    assert "CanaryOperation" not in reasons(run(10, refused.status, bad))


def test_the_operation_record_survives_phase_changes_so_it_is_never_applied_twice():
    first = run(0)
    promoted = run(5, first.status, op("promote"))
    settled = run(10, promoted.status, op("promote"))  # Promoted, then Idle/Promoted: the id is remembered
    assert settled.status.canary.last_operation.id == "1"
    assert "CanaryOperation" not in reasons(settled)
