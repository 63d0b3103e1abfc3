"""Status helpers: metav1.Condition bookkeeping and the spec-invalid status. Pure.

Conditions are computed as a whole every pass (a merge patch replaces lists); a condition keeps its
lastTransitionTime while its status does not change.
"""

from __future__ import annotations

from datetime import datetime

from sluice.api.v1alpha1 import Condition, ConditionStatus, InferencePoolStatus

CONDITION_TYPES = ("Ready", "SpecValid", "MetricsAvailable", "Degraded", "Progressing")


def make_condition(
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    generation: int | None,
    previous: list[Condition],
    now: datetime,
) -> Condition:
    before = next((c for c in previous if c.type == type_), None)
    since = before.last_transition_time if before is not None and before.status == status else now
    return Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )


def find(conditions: list[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def invalid_spec_status(
    previous: InferencePoolStatus | None, generation: int | None, message: str, now: datetime
) -> InferencePoolStatus:
    """The status of a pool whose spec does not parse: SpecValid=False; everything else (weights) kept as it was."""
    base = previous or InferencePoolStatus()
    others = [c for c in base.conditions if c.type != "SpecValid"]
    spec_valid = make_condition("SpecValid", "False", "InvalidSpec", message, generation, base.conditions, now)
    conditions = sorted([*others, spec_valid], key=lambda c: _order(c.type))
    return base.model_copy(update={"conditions": conditions, "last_reconcile_time": now})


def _order(type_: str) -> int:
    return CONDITION_TYPES.index(type_) if type_ in CONDITION_TYPES else len(CONDITION_TYPES)
