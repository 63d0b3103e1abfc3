"""kopf's diff-base storage without the deep copy of every event's status.

On every watch event of a pool — one per pass, for the pass's own status write — kopf builds the object's
"essence" (what its change detection compares: everything but `status` and most of `metadata`) with
`copy.deepcopy(dict(body))`, then deletes `status` and `metadata` from the copy. A pool's status is most of its
object (per-pod rows, conditions, memory) and its metadata carries `managedFields`, so each event deep-copied
both only to throw them away. `SpecDiffBase` hands kopf's own `build` the body without them (keeping labels,
annotations and `ownerReferences`, which kopf reads to name its own annotation keys) — the same essence,
computed by kopf's code — unless a handler asks for an extra field elsewhere (none of sluice's do; the whole body
is passed then, as before).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import kopf

KEPT_METADATA = ("labels", "annotations")  # the only metadata kopf's essence keeps
READ_METADATA = (*KEPT_METADATA, "ownerReferences")  # and what kopf's key naming reads (`mark_key`)


def _light(field: kopf.FieldSpec) -> bool:
    """An extra field `SpecDiffBase`'s lighter body still has."""
    path = field.split(".") if isinstance(field, str) else list(field or ())
    if not path or path[0] == "status":
        return False
    return path[0] != "metadata" or (len(path) > 1 and path[1] in KEPT_METADATA)


class SpecDiffBase(kopf.AnnotationsDiffBaseStorage):
    def build(self, *, body: kopf.Body, extra_fields: Iterable[kopf.FieldSpec] | None = None) -> kopf.BodyEssence:
        fields = list(extra_fields or ())
        if not all(_light(f) for f in fields):
            return super().build(body=body, extra_fields=fields)
        meta = body.get("metadata") or {}
        light: dict[str, object] = {k: v for k, v in body.items() if k not in ("status", "metadata")}
        light["metadata"] = {k: meta[k] for k in READ_METADATA if k in meta}
        # the body's own JSON, without its status and most of its metadata
        return super().build(body=kopf.Body(cast(kopf.RawBody, light)), extra_fields=fields)
