"""Rollout operations applied to the rollout state, once each: promote, abort, retry, pause, resume, skip-step. Pure.

Called by `sluice.core.canary.step_canary` before the normal stepping. Each operation is checked against the
state it finds and is either **Applied** or **Refused** with the reason; the record goes into
`status.canary.lastOperation`, whose id makes it exactly-once across passes and operator restarts.
- `promote`: finish the rollout now — only after the current step's check passed (and no forced split), unless
  `force` (recorded as forced);
- `skip-step`: go to the next step now, with the same gate;
- `abort`: roll the candidate back now (it stays back until `retry` or a new candidate);
- `retry`: a rolled-back candidate again, from the first step, failed checks forgotten;
- `pause` / `resume`: hold / release the current step (like `spec.canary.paused`, but without touching the spec).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from sluice.api.operation import Operation
from sluice.api.v1alpha1 import CanarySpec, CanaryStatus, OperationRecord

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


def apply_operation(spec: CanarySpec, state: CanaryStatus, operation: Operation, now: datetime) -> Applied:
    op = operation.op
    if op == "invalid":
        return Applied(state, record(operation, now, False, operation.problem or "not an operation"))
    rolled_back = state.phase == "RolledBack"
    if op == "retry":
        if not rolled_back:
            return Applied(
                state, record(operation, now, False, f"retry needs a rolled-back rollout (phase {state.phase})")
            )
        fresh = CanaryStatus(
            phase="Progressing",
            stable_revision=state.stable_revision,
            candidate_revision=state.candidate_revision,
            step_index=0,
            step_started_at=now,
        )
        return Applied(fresh, record(operation, now, True, f"{state.candidate_revision} again from the first step"))
    if rolled_back:
        return Applied(state, record(operation, now, False, "the rollout is rolled back: retry it first"))
    if op == "abort":
        aborted = state.model_copy(
            update={"phase": "RolledBack", "weight": 0, "message": f"aborted {state.candidate_revision} by operation"}
        )
        return Applied(aborted, record(operation, now, True, f"{state.candidate_revision} rolled back now"))
    if op in ("pause", "resume"):
        paused_by = (operation.by or "an operation") if op == "pause" else None
        message = "held at the current step" if op == "pause" else "released"
        if op == "resume" and spec.paused:
            message += " (spec.canary.paused is still true and still holds it)"
        return Applied(state.model_copy(update={"paused_by": paused_by}), record(operation, now, True, message))
    return _advance(spec, state, operation, now)


def _advance(spec: CanarySpec, state: CanaryStatus, operation: Operation, now: datetime) -> Applied:
    """promote / skip-step: gated on a passing check at this step unless forced."""
    passed = state.last_check == "Pass" and state.split_forced is None and state.phase in ("Progressing", "Paused")
    if not passed and not operation.force:
        why = f"no passing check at the current step yet (last: {state.last_check or 'none'}); --force skips analysis"
        return Applied(state, record(operation, now, False, why))
    forced = not passed
    index = state.step_index or 0
    if operation.op == "promote" or index >= len(spec.steps) - 1:
        note = "promoted now" + (" (analysis skipped)" if forced else "")
        return Applied(state, record(operation, now, True, note, forced), "promote")
    moved = state.model_copy(
        update={"step_index": index + 1, "step_started_at": now, "last_check": None, "last_check_reason": ""}
    )
    note = f"to step {index + 2} ({spec.steps[index + 1]}%) now" + (" (analysis skipped)" if forced else "")
    return Applied(moved, record(operation, now, True, note, forced))
