"""A stored InferencePool parsed once, at the edge: metadata, the spec or why it does not parse, the status.

Built from the body kopf hands over (or a file `sluice plan` reads) and passed inward typed; nothing inside
parses raw dicts again. The spec and the status are parsed separately, so a status written by another version
of sluice (parsed leniently, the unreadable parts dropped and listed) never makes a valid spec look invalid.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import ValidationError

from sluice.api.errors import format_validation_error
from sluice.api.jsontypes import members
from sluice.api.memory import readable
from sluice.api.operation import Operation, parse_operation
from sluice.api.spec import InferencePoolSpec
from sluice.api.status import InferencePoolStatus, read_status
from sluice.api.v1alpha1 import InferencePool, ObjectMeta


@dataclass(frozen=True)
class PoolSnapshot:
    meta: ObjectMeta
    spec: InferencePoolSpec | None
    """None when the spec does not parse; `spec_error` says why, as the API server would."""
    spec_error: str | None
    status: InferencePoolStatus | None
    status_problems: tuple[str, ...] = field(default=())
    operation: Operation | None = None
    """A rollout operation requested on the pool's annotation (`sluice.api.operation`)."""

    @property
    def key(self) -> str:
        return f"{self.meta.namespace}/{self.meta.name}"


def parse_snapshot(body: Mapping[str, object]) -> PoolSnapshot:
    raw_meta = members(body, "metadata")
    annotations = {str(k): str(v) for k, v in members(raw_meta, "annotations").items()}
    uid, generation = raw_meta.get("uid"), raw_meta.get("generation")
    meta = ObjectMeta.model_construct(
        name=str(raw_meta.get("name", "")),
        namespace=str(raw_meta.get("namespace") or "default"),
        uid=uid if isinstance(uid, str) else None,
        generation=generation if isinstance(generation, int) else None,
        annotations=annotations,
    )
    operation = parse_operation(annotations)
    raw_status = body.get("status")
    status, problems = read_status(raw_status if isinstance(raw_status, dict) else None)
    status, unreadable = readable(status)
    problems += unreadable
    try:
        pool = InferencePool.model_validate({**body, "status": None})
    except ValidationError as failure:
        message = format_validation_error("InferencePool", meta.name, failure)
        return PoolSnapshot(meta, None, message, status, tuple(problems), operation)
    return PoolSnapshot(pool.metadata, pool.spec, None, status, tuple(problems), operation)
