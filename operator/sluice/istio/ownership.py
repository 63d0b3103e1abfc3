"""Ownership: which Istio objects sluice may write, prune or must give back. Pure.

The contract (see docs/guide.md, "Ownership"):
- **ours**: created by sluice for a pool — labelled `app.kubernetes.io/managed-by: sluice` and
  `sluice.dev/pool: <pool>`, with the pool as controller owner. sluice rewrites it when it differs and deletes it
  when a pass no longer renders it (pruning); Kubernetes' garbage collector deletes it with the pool.
- **adopted**: a user's object of the same name taken over with `spec.routing.adoptExisting`. It never gets an
  ownerReference (deleting the pool must not delete it); its original spec, labels and annotations are kept in the
  annotation `sluice.dev/original`, and are put back exactly — when the pool is deleted, when `adoptExisting` is
  turned off, or when a pass no longer renders it.
- **foreign**: anybody else's object: never written, never deleted; the pool reports `ObjectNotManaged`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast

from sluice.api.jsontypes import JsonObject, members, text

MANAGED_BY = {"app.kubernetes.io/managed-by": "sluice"}
POOL_LABEL = "sluice.dev/pool"
POOL_NAMESPACE_LABEL = "sluice.dev/pool-namespace"
"""The pool's namespace, on every object: an EnvoyFilter written for clients in another namespace names its pool
by both labels (two pools of one name in two namespaces stay apart)."""
ORIGINAL_ANNOTATION = "sluice.dev/original"

Ownership = Literal["absent", "ours", "adopted", "foreign"]


def _listed(value: Mapping[str, object], key: str) -> list[object]:
    """The list at `key` (an empty one when missing or not a list)."""
    found = value.get(key)
    return found if isinstance(found, list) else []


def _child(value: JsonObject, key: str) -> JsonObject:
    """The JSON object at `key` (an empty one when missing or not an object)."""
    found = value.get(key)
    return found if isinstance(found, dict) else {}


def ownership(live: Mapping[str, object] | None, pool_uid: str | None) -> Ownership:
    if live is None:
        return "absent"
    meta = members(live, "metadata")
    if ORIGINAL_ANNOTATION in members(meta, "annotations"):
        return "adopted"
    labels = members(meta, "labels")
    owned = any(members(ref).get("uid") == pool_uid for ref in _listed(meta, "ownerReferences") if pool_uid)
    managed = all(labels.get(k) == v for k, v in MANAGED_BY.items())
    return "ours" if managed or owned else "foreign"


def original_of(live: Mapping[str, object]) -> str:
    """What to give back later: the object's spec, labels and annotations as the user left them (JSON)."""
    meta = members(live, "metadata")
    return json.dumps(
        {"spec": live.get("spec"), "labels": meta.get("labels") or {}, "annotations": meta.get("annotations") or {}},
        sort_keys=True,
        separators=(",", ":"),
    )


def kept_original(live: Mapping[str, object]) -> str:
    """The original an adopted object carries (its annotation, as `original_of` wrote it)."""
    return text(live, "metadata", "annotations", ORIGINAL_ANNOTATION)


def as_adopted(desired: JsonObject, original: str) -> JsonObject:
    """The desired object for an adopted one: no ownerReference, the original kept in an annotation."""
    meta = dict(_child(desired, "metadata"))
    meta.pop("ownerReferences", None)
    meta["annotations"] = {**_child(meta, "annotations"), ORIGINAL_ANNOTATION: original}
    return {**desired, "metadata": meta}


def restored(live: Mapping[str, object]) -> JsonObject:
    """The whole object to write back (a replace): the user's spec, labels and annotations, sluice's gone."""
    meta = members(live, "metadata")
    # json.loads is untyped: the annotation holds the JSON object `original_of` wrote
    original = cast(JsonObject, json.loads(kept_original(live)))
    restored_meta: JsonObject = {
        k: v for k, v in meta.items() if k in ("name", "namespace", "resourceVersion", "uid") and isinstance(v, str)
    }
    for key in ("labels", "annotations"):
        if original[key]:
            restored_meta[key] = original[key]
    body: JsonObject = {"apiVersion": text(live, "apiVersion"), "kind": text(live, "kind"), "metadata": restored_meta}
    if original["spec"] is not None:
        body["spec"] = original["spec"]
    return body


def differs(live: Mapping[str, object], desired: Mapping[str, object]) -> bool:
    """True when applying `desired` would change the live object (spec, our labels, annotations, owner)."""
    if live.get("spec") != desired.get("spec"):
        return True
    live_meta, want_meta = members(live, "metadata"), members(desired, "metadata")
    for key in ("labels", "annotations"):
        have = members(live_meta, key)
        if any(have.get(k) != v for k, v in members(want_meta, key).items()):
            return True
    wanted_owners = {members(ref).get("uid") for ref in _listed(want_meta, "ownerReferences")}
    live_owners = {members(ref).get("uid") for ref in _listed(live_meta, "ownerReferences")}
    return not wanted_owners <= live_owners


def _holds(live: object, want: object) -> bool:
    """`live` has every field `want` sets, with its value (maps compared field by field; lists, atomic in
    Istio's schemas, as a whole)."""
    if isinstance(want, dict):
        return isinstance(live, dict) and all(k in live and _holds(live[k], v) for k, v in want.items())
    return bool(live == want)


def drifted(live: Mapping[str, object], written: Mapping[str, object]) -> bool:
    """True when the live object no longer holds what sluice wrote: a field it sets changed or went, or one of
    its labels, annotations or owners. Fields somebody else added are not drift: sluice's server-side apply
    would not remove them, so reading the object again could not make it match."""
    if not _holds(live.get("spec"), written.get("spec")):
        return True
    return differs({**live, "spec": written.get("spec")}, written)


@dataclass(frozen=True)
class Decision:
    """What to do with one desired object, given what is live: the adapters only carry it out."""

    action: Literal["refuse", "restore", "unchanged", "write", "delete"]
    body: JsonObject | None = None
    """The object to apply (`write`) or to replace the live one with (`restore`)."""


def another_pools(live: Mapping[str, object], desired: Mapping[str, object]) -> bool:
    """A sluice object labelled for another pool (same name, another namespace: its EnvoyFilter copies)."""
    have = members(live, "metadata", "labels")
    want = members(desired, "metadata", "labels")
    return any(key in have and key in want and have[key] != want[key] for key in (POOL_LABEL, POOL_NAMESPACE_LABEL))


def decide(live: Mapping[str, object] | None, desired: JsonObject, pool_uid: str | None, adopt: bool) -> Decision:
    """`desired` is the rendered object's body (`Rendered.body`): ownership reads its metadata and spec only."""
    owner = ownership(live, pool_uid)
    if live is not None and owner == "ours" and another_pools(live, desired):
        return Decision("refuse")
    if live is None or owner == "ours":
        return Decision("write", desired) if live is None or differs(live, desired) else Decision("unchanged")
    if owner == "foreign":
        return Decision("write", as_adopted(desired, original_of(live))) if adopt else Decision("refuse")
    if not adopt:  # adopted, and adoptExisting was turned off: the user's object is theirs again
        return Decision("restore", restored(live))
    body = as_adopted(desired, kept_original(live))
    return Decision("write", body) if differs(live, body) else Decision("unchanged")


def release(live: Mapping[str, object]) -> Decision:
    """What releasing a live object means: an adopted one is given back, one sluice created is deleted."""
    return Decision("restore", restored(live)) if ownership(live, None) == "adopted" else Decision("delete")
