"""Rollout operations: a one-shot request on the pool's annotation `sluice.dev/operation`, consumed exactly once.

`kubectl sluice promote|abort|retry|pause|resume|skip-step POOL` writes the annotation as JSON
(`{"id": "...", "op": "promote", "force": false, "by": "alice@prod"}`); the next pass applies it unless
`status.canary.lastOperation.id` already names it, and records the outcome there. The spec is never changed, so
GitOps tools see no drift; the id in the status makes it restart-safe (an operator that dies mid-pass applies it
once, when it comes back). See docs/guide.md, "Rollout operations".
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import Field, ValidationError

from sluice.api.base import ApiModel

OPERATION_ANNOTATION = "sluice.dev/operation"
OperationName = Literal["promote", "abort", "retry", "pause", "resume", "skip-step", "invalid"]
"""`invalid` stands for an annotation that cannot be read: it is refused (once), with the reason."""


class Operation(ApiModel):
    id: str = Field(min_length=1, max_length=64, description="Unique per request; a repeated id is not applied again.")
    op: OperationName = Field(description="What to do with the rollout.")
    force: bool = Field(default=False, description="promote / skip-step without a passing check at this step.")
    by: str | None = Field(default=None, max_length=256, description="Who asked, as the client states it.")
    problem: str | None = Field(default=None, description="Why an `invalid` operation could not be read.")


def parse_operation(annotations: dict[str, str]) -> Operation | None:
    """The requested operation; an unreadable annotation becomes an `invalid` one (refused once, with why)."""
    raw = annotations.get(OPERATION_ANNOTATION)
    if raw is None:
        return None
    try:
        operation = Operation.model_validate(json.loads(raw))
    except (json.JSONDecodeError, ValidationError, TypeError) as failure:
        digest = hashlib.sha256(raw.encode()).hexdigest()[:12]
        why = f"annotation {OPERATION_ANNOTATION} is not a valid operation: {str(failure).splitlines()[0]}"
        return Operation(id=f"invalid-{digest}", op="invalid", problem=why)
    if operation.op == "invalid":
        return operation.model_copy(update={"problem": "'invalid' is not an operation"})
    return operation
