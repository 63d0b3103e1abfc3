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
from dataclasses import dataclass
from typing import Any, Literal

MANAGED_BY = {"app.kubernetes.io/managed-by": "sluice"}
POOL_LABEL = "sluice.dev/pool"
POOL_NAMESPACE_LABEL = "sluice.dev/pool-namespace"
"""The pool's namespace, on every object: an EnvoyFilter written for clients in another namespace names its pool
by both labels (two pools of one name in two namespaces stay apart)."""
ORIGINAL_ANNOTATION = "sluice.dev/original"

Ownership = Literal["absent", "ours", "adopted", "foreign"]


def ownership(live: dict[str, Any] | None, pool_uid: str | None) -> Ownership:
    if live is None:
        return "absent"
    meta = live.get("metadata", {})
    if ORIGINAL_ANNOTATION in (meta.get("annotations") or {}):
        return "adopted"
    labels = meta.get("labels") or {}
    owned = any(ref.get("uid") == pool_uid for ref in meta.get("ownerReferences") or [] if pool_uid)
    managed = all(labels.get(k) == v for k, v in MANAGED_BY.items())
    return "ours" if managed or owned else "foreign"


def original_of(live: dict[str, Any]) -> str:
    """What to give back later: the object's spec, labels and annotations as the user left them (JSON)."""
    meta = live.get("metadata", {})
    return json.dumps(
        {"spec": live.get("spec"), "labels": meta.get("labels") or {}, "annotations": meta.get("annotations") or {}},
        sort_keys=True,
        separators=(",", ":"),
    )


def as_adopted(desired: dict[str, Any], original: str) -> dict[str, Any]:
    """The desired object for an adopted one: no ownerReference, the original kept in an annotation."""
    meta = dict(desired["metadata"])
    meta.pop("ownerReferences", None)
    meta["annotations"] = {**(meta.get("annotations") or {}), ORIGINAL_ANNOTATION: original}
    return {**desired, "metadata": meta}


def restored(live: dict[str, Any]) -> dict[str, Any]:
    """The whole object to write back (a replace): the user's spec, labels and annotations, sluice's gone."""
    meta = live["metadata"]
    original = json.loads(meta["annotations"][ORIGINAL_ANNOTATION])
    kept = {k: v for k, v in meta.items() if k in ("name", "namespace", "resourceVersion", "uid")}
    restored_meta = {**kept}
    for key in ("labels", "annotations"):
        if original[key]:
            restored_meta[key] = original[key]
    body: dict[str, Any] = {"apiVersion": live["apiVersion"], "kind": live["kind"], "metadata": restored_meta}
    if original["spec"] is not None:
        body["spec"] = original["spec"]
    return body


def differs(live: dict[str, Any], desired: dict[str, Any]) -> bool:
    """True when applying `desired` would change the live object (spec, our labels, annotations, owner)."""
    if live.get("spec") != desired.get("spec"):
        return True
    live_meta, want_meta = live.get("metadata", {}), desired.get("metadata", {})
    for key in ("labels", "annotations"):
        have = live_meta.get(key) or {}
        if any(have.get(k) != v for k, v in (want_meta.get(key) or {}).items()):
            return True
    wanted_owners = {ref["uid"] for ref in want_meta.get("ownerReferences") or []}
    live_owners = {ref.get("uid") for ref in live_meta.get("ownerReferences") or []}
    return not wanted_owners <= live_owners


def _holds(live: Any, want: Any) -> bool:
    """`live` has every field `want` sets, with its value (maps compared field by field; lists, atomic in
    Istio's schemas, as a whole)."""
    if isinstance(want, dict):
        return isinstance(live, dict) and all(k in live and _holds(live[k], v) for k, v in want.items())
    return bool(live == want)


def drifted(live: dict[str, Any], written: dict[str, Any]) -> bool:
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
    body: dict[str, Any] | None = None
    """The object to apply (`write`) or to replace the live one with (`restore`)."""


def another_pools(live: dict[str, Any], desired: dict[str, Any]) -> bool:
    """A sluice object labelled for another pool (same name, another namespace: its EnvoyFilter copies)."""
    have = live.get("metadata", {}).get("labels") or {}
    want = desired.get("metadata", {}).get("labels") or {}
    return any(key in have and key in want and have[key] != want[key] for key in (POOL_LABEL, POOL_NAMESPACE_LABEL))


def decide(live: dict[str, Any] | None, desired: dict[str, Any], pool_uid: str | None, adopt: bool) -> Decision:
    owner = ownership(live, pool_uid)
    if live is not None and owner == "ours" and another_pools(live, desired):
        return Decision("refuse")
    if live is None or owner == "ours":
        return Decision("write", desired) if live is None or differs(live, desired) else Decision("unchanged")
    if owner == "foreign":
        return Decision("write", as_adopted(desired, original_of(live))) if adopt else Decision("refuse")
    if not adopt:  # adopted, and adoptExisting was turned off: the user's object is theirs again
        return Decision("restore", restored(live))
    body = as_adopted(desired, live["metadata"]["annotations"][ORIGINAL_ANNOTATION])
    return Decision("write", body) if differs(live, body) else Decision("unchanged")


def release(live: dict[str, Any]) -> Decision:
    """What releasing a live object means: an adopted one is given back, one sluice created is deleted."""
    return Decision("restore", restored(live)) if ownership(live, None) == "adopted" else Decision("delete")
