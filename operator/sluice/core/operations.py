"""Rollout operations applied to the rollout state, once each: promote, abort, retry, pause, resume, skip-step. Pure.

Called by `sluice.core.canary.step_canary` before the normal stepping. Each operation is checked against the
state it finds and is either **Applied** or **Refused** with the reason; the record goes into
`status.canary.lastOperation`, whose id makes it exactly-once across passes and operator restarts.
- `promote`: finish the rollout now — only after the current step's check passed (and no forced split), unless
  `force` (recorded as forced);
- `skip-step`: go to the next step now, with the same gate; in shadow: end the shadow and go to the first live
  step (gated on a passing shadow check taken at least `metrics.window` after the mirror was in place, unless
  `force`);
- `abort`: roll the candidate back now (it stays back until `retry` or a new candidate); in shadow no user request
  has reached it, unless the split was forced to it because the stable revision had no healthy pod
  (`servedUsers`);
- `retry`: a rolled-back candidate again, from the shadow if the spec has one, else from the first step, failed
  checks forgotten;
- `pause` / `resume`: hold / release the current step (like `spec.canary.paused`, but without touching the spec);
  in shadow the mirror and the checks go on (a failed check still rolls back) but the shadow does not end.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from sluice.api.operation import Operation
from sluice.api.v1alpha1 import CanarySpec, CanaryStatus, CheckResult, OperationRecord

Effect = Literal["none", "promote"]


@dataclass(frozen=True)
class Applied:
    state: CanaryStatus
    record: OperationRecord
    effect: Effect = "none"
    """`promote`: the caller finishes the rollout this pass."""


def is_new(operation: Operation | None, previous: CanaryStatus | None) -> bool:
    seen = previous.last_operation if previous else None
    return operation is not None and (seen is None or seen.id != operation.id)


def record(operation: Operation, now: datetime, applied: bool, message: str, forced: bool = False) -> OperationRecord:
    return OperationRecord(
        id=operation.id,
        op=operation.op,
        by=operation.by,
        at=now,
        result="Applied" if applied else "Refused",
        forced=forced,
        message=message,
    )


def refuse_without_rollout(operation: Operation, now: datetime) -> OperationRecord:
    if operation.op == "invalid":
        return record(operation, now, False, operation.problem or "not an operation")
    return record(operation, now, False, "no rollout in progress: set spec.canary.candidateRevision first")


def first_state(spec: CanarySpec, stable: str | None, candidate: str | None, now: datetime) -> CanaryStatus:
    """A rollout's start: in shadow when the spec asks for one, else at the first live step."""
    shadow = spec.shadow is not None
    return CanaryStatus(
        phase="Shadow" if shadow else "Progressing",
        stage="Shadow" if shadow else "Live",
        stable_revision=stable,
        candidate_revision=candidate,
        step_index=0,
        step_started_at=now,
    )


def mirrored_evidence(
    result: CheckResult | None, checked_at: datetime | None, started: datetime | None, window: float
) -> bool:
    """A passing shadow check whose whole window (`metrics.window`) came after the mirror was in place."""
    if result != "Pass" or checked_at is None or started is None:
        return False
    return (checked_at - started).total_seconds() >= window


def go_live(state: CanaryStatus, now: datetime, verdict: str) -> CanaryStatus:
    """Shadow over: the first live step starts now, its own check pending; `shadowVerdict` says how it ended."""
    return state.model_copy(
        update={
            "phase": "Progressing",
            "stage": "Live",
            "step_index": 0,
            "step_started_at": now,
            "last_check": None,
            "last_check_reason": "",
            "mirror_percent": None,
            "shadow_verdict": verdict,
        }
    )


def apply_operation(
    spec: CanarySpec, state: CanaryStatus, operation: Operation, now: datetime, window: float
) -> Applied:
    op = operation.op
    if op == "invalid":
        return Applied(state, record(operation, now, False, operation.problem or "not an operation"))
    rolled_back = state.phase == "RolledBack"
    if op == "retry":
        if not rolled_back:
            return Applied(
                state, record(operation, now, False, f"retry needs a rolled-back rollout (phase {state.phase})")
            )
        fresh = first_state(spec, state.stable_revision, state.candidate_revision, now).model_copy(
            update={"served_users": state.served_users}  # the same candidate: what it served stays true
        )
        again = "in shadow first" if fresh.stage == "Shadow" else "from the first step"
        return Applied(fresh, record(operation, now, True, f"{state.candidate_revision} again {again}"))
    if rolled_back:
        return Applied(state, record(operation, now, False, "the rollout is rolled back: retry it first"))
    if op == "abort":
        reached = "after users were routed to it" if state.served_users else "before any user request was routed to it"
        where = f" in shadow, {reached}" if state.stage == "Shadow" else ""
        aborted = state.model_copy(
            update={
                "phase": "RolledBack",
                "weight": 0,
                "mirror_percent": None,
                "message": f"aborted {state.candidate_revision} by operation{where}",
            }
        )
        return Applied(aborted, record(operation, now, True, f"{state.candidate_revision} rolled back now{where}"))
    if op in ("pause", "resume"):
        paused_by = (operation.by or "an operation") if op == "pause" else None
        message = "held at the current step" if op == "pause" else "released"
        if op == "resume" and spec.paused:
            message += " (spec.canary.paused is still true and still holds it)"
        return Applied(state.model_copy(update={"paused_by": paused_by}), record(operation, now, True, message))
    return _advance(spec, state, operation, now, window)


def _advance(spec: CanarySpec, state: CanaryStatus, operation: Operation, now: datetime, window: float) -> Applied:
    """promote / skip-step: gated on a passing check at this step unless forced (in shadow: one over a whole
    window of mirrored traffic)."""
    active = ("Shadow", "Progressing", "Paused")
    passed = state.last_check == "Pass" and state.split_forced is None and state.phase in active
    shadow = state.stage == "Shadow"
    if shadow:
        passed = passed and mirrored_evidence(state.last_check, state.last_check_at, state.step_started_at, window)
    elif spec.ab_test is None and state.step_weight == 0 and state.phase in active and state.last_check != "Fail":
        passed = True  # a testers-only step never passes a check (testers' requests alone): a person ends it
    if not passed and not operation.force:
        where = f"in shadow over {window:g}s of mirrored traffic" if shadow else "at the current step"
        why = f"no passing check {where} yet (last: {state.last_check or 'none'}); --force skips analysis"
        return Applied(state, record(operation, now, False, why))
    forced = not passed
    skipped = " (analysis skipped)" if forced else ""
    if shadow and operation.op == "skip-step":
        verdict = f"skipped by {operation.by or 'an operation'}" + skipped
        note = f"shadow ended, to the first live step ({spec.steps[0]}%) now{skipped}"
        return Applied(go_live(state, now, verdict), record(operation, now, True, note, forced))
    index = state.step_index or 0
    if operation.op == "promote" or index >= len(spec.steps) - 1:
        note = "promoted now" + (" from shadow" if shadow else "") + skipped
        return Applied(state, record(operation, now, True, note, forced), "promote")
    moved = state.model_copy(
        update={"step_index": index + 1, "step_started_at": now, "last_check": None, "last_check_reason": ""}
    )
    note = f"to step {index + 2} ({spec.steps[index + 1]}%) now{skipped}"
    return Applied(moved, record(operation, now, True, note, forced))
