"""Field ownership of the Kubernetes API emulator: `managedFields`, server-side apply and its conflicts.

Local-stack tool, used by `apistore.Store`. As kube-apiserver does it (structured-merge-diff):
- every write has a field manager (`fieldManager`, else the User-Agent's product name, e.g. `kubectl-edit`,
  `OpenAPI-Generator`); an update makes its manager own the fields it changed and takes them from the others;
- an apply makes its manager own exactly the fields it applied: a field another manager owns with a different
  value is a conflict (409, `Apply failed with 1 conflict: conflict with "kubectl-client-side-apply" using
  inference.sluice.dev/v1alpha1: .spec.interval`) unless `force=true`, which takes the field over; equal values are
  shared; fields the manager applied before and dropped are removed unless another manager still owns them;
- `metadata.managedFields` is rendered from this table, and a client that writes different managedFields (kubectl
  does, to hand client-side-apply fields to server-side apply) resets the table to them.
Lists are atomic here (Istio's and sluice's lists are), so a field path is a tuple of map keys.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

Path = tuple[str, ...]
ObjectKey = tuple[Any, ...]

# Parts of metadata a manager can own; the rest is the server's.
OWNABLE_METADATA = ("labels", "annotations")
ATOMIC_METADATA = ("ownerReferences", "finalizers")


def leaf_paths(value: Any, prefix: Path = ()) -> set[Path]:
    """Field paths a configuration sets; lists and empty objects are leaves."""
    if isinstance(value, dict) and value:
        out: set[Path] = set()
        for key, child in value.items():
            out |= leaf_paths(child, (*prefix, key))
        return out
    return {prefix}


def value_at(obj: Any, path: Path) -> Any:
    node = obj
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def fields_v1(paths: set[Path]) -> dict[str, Any]:
    """The managedFields FieldsV1 set for these field paths: {"f:spec": {"f:a": {}}}."""
    root: dict[str, Any] = {}
    for path in sorted(paths):
        node = root
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return root


def paths_from_fields_v1(node: dict[str, Any], prefix: Path = ()) -> set[Path]:
    """The inverse of `fields_v1`; list-item keys (`k:`, `v:`, `i:`) and `.` make their parent a leaf."""
    children = {key[2:]: child for key, child in node.items() if key.startswith("f:")}
    if not children:
        return {prefix} if prefix else set()
    out: set[Path] = set()
    for key, child in children.items():
        out |= paths_from_fields_v1(child if isinstance(child, dict) else {}, (*prefix, key))
    if any(not key.startswith("f:") for key in node) and prefix:
        out.add(prefix)
    return out


def remove_path(obj: dict[str, Any], path: Path) -> None:
    node: Any = obj
    for key in path[:-1]:
        if not isinstance(node, dict) or key not in node:
            return
        node = node[key]
    if isinstance(node, dict):
        node.pop(path[-1], None)
    # Drop objects left empty by the removal, as the API server prunes them.
    for depth in range(len(path) - 1, 0, -1):
        parent: Any = obj
        for key in path[: depth - 1]:
            parent = parent.get(key, {}) if isinstance(parent, dict) else {}
        child = parent.get(path[depth - 1]) if isinstance(parent, dict) else None
        if isinstance(child, dict) and not child:
            parent.pop(path[depth - 1], None)


def deep_apply(target: dict[str, Any], applied: dict[str, Any]) -> None:
    for key, value in applied.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            deep_apply(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def ownable(obj: dict[str, Any], subresource: str | None) -> dict[str, Any]:
    """The part of an object managers own: the spec side (or status for /status), labels, annotations, owners."""
    if subresource == "status":
        return {"status": obj["status"]} if "status" in obj else {}
    part = {k: v for k, v in obj.items() if k not in ("metadata", "apiVersion", "kind", "status")}
    meta = obj.get("metadata") or {}
    owned_meta = {k: meta[k] for k in OWNABLE_METADATA if meta.get(k)}
    owned_meta |= {k: meta[k] for k in ATOMIC_METADATA if meta.get(k)}
    if owned_meta:
        part["metadata"] = owned_meta
    return part


def owned_leaves(obj: dict[str, Any], subresource: str | None) -> set[Path]:
    leaves = leaf_paths(ownable(obj, subresource))
    # Finalizers and owner references are whole values (lists), never descended into.
    return {path[:2] if path[:2] in {("metadata", name) for name in ATOMIC_METADATA} else path for path in leaves} - {
        ()
    }


LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def last_applied_fields(obj: dict[str, Any]) -> set[Path]:
    """The fields kubectl's client-side apply last set, read from its annotation."""
    text = ((obj.get("metadata") or {}).get("annotations") or {}).get(LAST_APPLIED)
    if not text:
        return set()
    try:
        config = json.loads(text)
    except json.JSONDecodeError:
        return set()
    return owned_leaves(config, None) if isinstance(config, dict) else set()


def _overlap(a: Path, b: Path) -> bool:
    shorter = min(len(a), len(b))
    return a[:shorter] == b[:shorter]


@dataclass
class Manager:
    manager: str
    operation: str  # "Apply" or "Update"
    api_version: str
    subresource: str = ""
    time: str = ""
    fields: set[Path] = field(default_factory=set)

    @property
    def identity(self) -> tuple[str, str, str]:
        return (self.manager, self.operation, self.subresource)

    def printed(self) -> str:
        """How kube-apiserver names a manager in conflict messages (fieldmanager's printManager)."""
        text = json.dumps(self.manager)
        if self.subresource:
            text += f" with subresource {json.dumps(self.subresource)}"
        if self.operation == "Update":
            text += f" using {self.api_version}"
        return text

    def entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "manager": self.manager,
            "operation": self.operation,
            "apiVersion": self.api_version,
            "time": self.time,
            "fieldsType": "FieldsV1",
            "fieldsV1": fields_v1(self.fields),
        }
        if self.subresource:
            entry["subresource"] = self.subresource
        return entry


@dataclass(frozen=True)
class Conflict:
    manager: Manager
    path: Path

    @property
    def field_path(self) -> str:
        return "." + ".".join(self.path)


def conflict_message(conflicts: list[Conflict]) -> str:
    """fieldmanager's getConflictMessage, word for word."""
    if len(conflicts) == 1:
        only = conflicts[0]
        return f"Apply failed with 1 conflict: conflict with {only.manager.printed()}: {only.field_path}"
    by_manager: dict[str, list[str]] = {}
    for conflict in conflicts:
        by_manager.setdefault(conflict.manager.printed(), []).append(conflict.field_path)
    lines: list[str] = []
    for printed in sorted(by_manager):
        lines.append(f"conflicts with {printed}:")
        lines += [f"- {path}" for path in by_manager[printed]]
    return f"Apply failed with {len(conflicts)} conflicts: " + "\n".join(lines)


class Ownership:
    """Which manager owns which fields of each object."""

    def __init__(self) -> None:
        self.managers: dict[ObjectKey, list[Manager]] = {}

    def of(self, key: ObjectKey) -> list[Manager]:
        return self.managers.setdefault(key, [])

    def render(self, key: ObjectKey) -> list[dict[str, Any]]:
        return [m.entry() for m in self.of(key) if m.fields]

    def forget(self, key: ObjectKey) -> None:
        self.managers.pop(key, None)

    def load(self, key: ObjectKey, entries: list[dict[str, Any]]) -> None:
        """A client wrote managedFields itself: they become the table."""
        self.managers[key] = [
            Manager(
                manager=str(e.get("manager", "")),
                operation=str(e.get("operation", "Update")),
                api_version=str(e.get("apiVersion", "")),
                subresource=str(e.get("subresource", "")),
                time=str(e.get("time", "")),
                fields=paths_from_fields_v1(e.get("fieldsV1") or {}),
            )
            for e in entries
            if isinstance(e, dict)
        ]

    def _find(self, key: ObjectKey, wanted: Manager) -> Manager:
        for existing in self.of(key):
            if existing.identity == wanted.identity:
                existing.api_version = wanted.api_version
                return existing
        self.of(key).append(wanted)
        return wanted

    def _take(self, key: ObjectKey, taker: Manager, paths: set[Path]) -> None:
        for other in self.of(key):
            if other.identity != taker.identity:
                other.fields = {owned for owned in other.fields if not any(_overlap(owned, p) for p in paths)}

    def record_update(self, key: ObjectKey, updater: Manager, old: dict[str, Any], new: dict[str, Any]) -> None:
        """An update owns what it changed; fields it removed are no one's."""
        sub = updater.subresource or None
        before, after = owned_leaves(old, sub), owned_leaves(new, sub)
        changed = {p for p in after if p not in before or value_at(old, p) != value_at(new, p)}
        removed = before - after
        for other in self.of(key):
            other.fields = {owned for owned in other.fields if not any(_overlap(owned, p) for p in removed)}
        if changed:
            self._take(key, updater, changed)
            manager = self._find(key, updater)
            manager.fields |= changed
            manager.time = updater.time

    def record_create(self, key: ObjectKey, creator: Manager, paths: set[Path]) -> None:
        self.managers[key] = []
        manager = self._find(key, creator)
        manager.fields = set(paths)

    def conflicts(
        self, key: ObjectKey, applier: Manager, applied: dict[str, Any], live: dict[str, Any]
    ) -> list[Conflict]:
        found: list[Conflict] = []
        sub = applier.subresource or None
        for path in sorted(owned_leaves(applied, sub)):
            for other in self.of(key):
                if other.identity == applier.identity:
                    continue
                for owned in other.fields:
                    if _overlap(owned, path):
                        common = owned if len(owned) < len(path) else path
                        if value_at(live, common) != value_at(applied, common):
                            found.append(Conflict(other, path))
                            break
        return found

    def record_apply(self, key: ObjectKey, applier: Manager, applied_paths: set[Path], force: bool) -> set[Path]:
        """The applier owns `applied_paths`; returns the fields it dropped that nobody owns any more."""
        manager = self._find(key, applier)
        previous = set(manager.fields)
        if force:
            self._take(key, applier, applied_paths)
        if previous != applied_paths or not manager.time:
            manager.time = applier.time  # the time changes only with the fields, so a repeated apply is a no-op
        manager.fields = set(applied_paths)
        dropped = previous - applied_paths
        still_owned = {p for m in self.of(key) for p in m.fields}
        return {p for p in dropped if not any(_overlap(p, owned) for owned in still_owned)}

    def snapshot(self, key: ObjectKey) -> list[Manager]:
        return copy.deepcopy(self.of(key))

    def restore(self, key: ObjectKey, managers: list[Manager]) -> None:
        self.managers[key] = managers
