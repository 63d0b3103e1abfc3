"""An in-memory `Cluster`: the objects, statuses and Events a pass writes, kept in dicts.

For the reconciler's unit tests and the simulated control loop of the benchmark: the same `Reconciler` runs
against it as against the Kubernetes API. It keeps the ownership contract (`sluice.istio.ownership`) exactly as
the Kubernetes adapter does, and can be told to fail calls, to test the loop's error paths.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sluice.api.jsontypes import JsonObject, members
from sluice.api.v1alpha1 import InferencePoolSpec, InferencePoolStatus
from sluice.core.events import Event
from sluice.core.observed import ObservedMesh, ObservedPod
from sluice.io.ports import ClusterError, ObjectKey, WriteResult
from sluice.istio.ownership import MANAGED_BY, POOL_LABEL, POOL_NAMESPACE_LABEL, decide, release
from sluice.istio.rendered import Rendered


@dataclass
class MemoryCluster:
    pod_list: list[ObservedPod] = field(default_factory=list)
    secrets: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    """(namespace, kind, name) -> object (JSON; the benchmark reads the objects a pass wrote from it)."""
    statuses: deque[tuple[str, str, JsonObject]] = field(default_factory=lambda: deque(maxlen=1000))
    """The latest status writes (bounded: a simulation runs for hours of simulated time)."""
    events: deque[Event] = field(default_factory=lambda: deque(maxlen=10000))
    failures: dict[str, ClusterError] = field(default_factory=dict)
    """Method name -> the error its next calls raise (until removed)."""
    calls: deque[str] = field(default_factory=lambda: deque(maxlen=10000))
    mesh_view: ObservedMesh | None = None
    """What `mesh` answers (None: the mesh side is not observed)."""

    def _enter(self, method: str) -> None:
        self.calls.append(method)
        if method in self.failures:
            raise self.failures[method]

    def pods(self, namespace: str, match_labels: dict[str, str]) -> list[ObservedPod]:
        self._enter("pods")
        return [p for p in self.pod_list if all(p.labels.get(k) == v for k, v in match_labels.items())]

    def secret_key(self, namespace: str, name: str, key: str) -> str:
        self._enter("secret_key")
        data = self.secrets.get((namespace, name))
        if data is None or key not in data:
            raise LookupError(f"Secret {namespace}/{name} has no key {key!r}")
        return data[key]

    def apply(self, desired: Rendered, pool_uid: str | None, adopt: bool) -> WriteResult:
        self._enter("apply")
        kind, name, namespace = desired.kind, desired.name, desired.namespace
        live = self.objects.get((namespace, kind, name))
        decision = decide(live, desired.body, pool_uid, adopt)
        if decision.action == "refuse":
            return WriteResult(kind, name, "refused", f"{kind} {namespace}/{name} exists and is not managed by sluice")
        if decision.action == "unchanged" or decision.body is None:
            return WriteResult(kind, name, "unchanged")
        self.objects[(namespace, kind, name)] = copy.deepcopy(decision.body)
        if decision.action == "restore":
            return WriteResult(kind, name, "restored", f"{kind} {namespace}/{name} given back to its owner")
        return WriteResult(kind, name, "created" if live is None else "updated")

    def mesh(self, namespace: str, spec: InferencePoolSpec) -> ObservedMesh | None:
        self._enter("mesh")
        return self.mesh_view

    def owned(self, namespace: str, pool: str, elsewhere: frozenset[str] = frozenset()) -> list[ObjectKey]:
        self._enter("owned")
        wanted = {**MANAGED_BY, POOL_LABEL: pool}
        keys = []
        for (ns, kind, name), obj in sorted(self.objects.items()):
            labels = members(obj, "metadata", "labels")
            if not all(labels.get(k) == v for k, v in wanted.items()):
                continue
            if ns == namespace:
                keys.append(ObjectKey(kind, name))
            elif kind == "EnvoyFilter" and labels.get(POOL_NAMESPACE_LABEL) == namespace:  # listed cluster-wide
                keys.append(ObjectKey(kind, name, ns))
        return keys

    def release(self, namespace: str, key: ObjectKey) -> WriteResult:
        self._enter("release")
        where = key.namespace or namespace
        live = self.objects.get((where, key.kind, key.name))
        if live is None:
            return WriteResult(key.kind, key.name, "unchanged")
        decision = release(live)
        if decision.action == "restore" and decision.body is not None:
            self.objects[(where, key.kind, key.name)] = decision.body
            return WriteResult(key.kind, key.name, "restored")
        del self.objects[(where, key.kind, key.name)]
        return WriteResult(key.kind, key.name, "pruned")

    def write_status(self, namespace: str, name: str, status: InferencePoolStatus) -> None:
        self._enter("write_status")
        self.statuses.append((namespace, name, status.wire()))

    def emit(self, namespace: str, name: str, uid: str | None, event: Event) -> None:
        self._enter("emit")
        self.events.append(event)
