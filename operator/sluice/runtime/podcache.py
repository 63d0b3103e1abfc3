"""Pods from the operator's own pod watch, so a pass does not list the API.

kopf already watches every pod (the handlers wake a pool when one of its pods restarts or turns unready). The
same stream feeds this cache: `sluice.runtime.handlers` indexes each pod with a kopf index handler, which kopf
runs for every object of the initial listing and every later event, and removes it on its DELETED event.
Because a resource with an index handler holds back every other handler, daemons included, until its initial
listing is indexed, the first pass of any pool finds the cache complete; the handlers then mark it `synced`.
Until then (and wherever no watch feeds it, e.g. `sluice plan` or a test), `KubeCluster.pods` lists the API.

Lookups are by label: an inverted index (namespace, key, value) -> pod names, the rarest label first, so a pass
costs the pool's own pods, not the namespace's. Written on kopf's event loop, read from the worker threads of
the passes: one lock.

Known limit: after a watch error kopf lists the pods again, and a pod deleted while the watch was down sends no
DELETED event; it stays here until its name is reused or the operator restarts (kopf's own indexes share this).
"""

from __future__ import annotations

import threading
from typing import Any

from sluice.core.observed import ObservedPod
from sluice.io.kube import observed_pod


class PodCache:
    def __init__(self) -> None:
        self.synced = False
        self._lock = threading.Lock()
        self._pods: dict[tuple[str, str], ObservedPod] = {}
        self._by_label: dict[tuple[str, str, str], set[str]] = {}
        self._by_namespace: dict[str, set[str]] = {}

    def __len__(self) -> int:
        return len(self._pods)

    def put(self, namespace: str, pod: dict[str, Any]) -> None:
        """Add or replace a pod from its object (as the watch delivered it)."""
        seen = observed_pod(pod)
        with self._lock:
            self._remove(namespace, seen.name)
            self._pods[(namespace, seen.name)] = seen
            self._by_namespace.setdefault(namespace, set()).add(seen.name)
            for key, value in seen.labels.items():
                self._by_label.setdefault((namespace, key, value), set()).add(seen.name)

    def drop(self, namespace: str, name: str) -> None:
        with self._lock:
            self._remove(namespace, name)

    def _remove(self, namespace: str, name: str) -> None:
        old = self._pods.pop((namespace, name), None)
        if old is None:
            return
        self._by_namespace[namespace].discard(name)
        for key, value in old.labels.items():
            names = self._by_label.get((namespace, key, value))
            if names is not None:
                names.discard(name)
                if not names:
                    del self._by_label[(namespace, key, value)]

    def select(self, namespace: str, match_labels: dict[str, str]) -> list[ObservedPod]:
        """The pods of `namespace` carrying every label of `match_labels` (all of them for an empty selector),
        sorted by name."""
        with self._lock:
            if not match_labels:
                names = set(self._by_namespace.get(namespace, set()))
            else:
                sets = [self._by_label.get((namespace, k, v), set()) for k, v in match_labels.items()]
                names = set(min(sets, key=len))
                for other in sets:
                    names &= other
            return [self._pods[(namespace, name)] for name in sorted(names)]
