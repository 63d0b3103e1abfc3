"""Pods from the operator's own pod watch, so a pass does not list the API.

kopf already watches every pod (the handlers wake a pool when one of its pods restarts or turns unready); the same
handler feeds this cache with every event, the initial listing's included. kopf does not say when its listing is
complete, so the first pass in a namespace lists the namespace's pods once (`KubeCluster.pods`) and seeds the
cache; from then on the watch keeps it current and passes read only the cache. A pod the watch changed or deleted
while that list was in flight keeps what the watch said (the watch delivers every later change in order; a list
answer may be older than an event already applied).

(A kopf index handler on pods would give the same guarantee without the list, since kopf holds every handler back
until indexed resources are listed; but its readiness bookkeeping wakes every waiting object for every indexed
one, which at 16,000 pods kept the operator busy at startup for minutes.)

Lookups are by label: an inverted index (namespace, key, value) -> pod names, the rarest label first, so a pass
costs the pool's own pods, not the namespace's. Written on kopf's event loop, read and seeded from the worker
threads of the passes: one lock.

Reseeding: after a watch error kopf lists the pods again, and a pod deleted while the watch was down sends no
DELETED event. So a namespace is listed again every `reseed_seconds` (5 min), and sooner (`relist_gap`, 30 s after
its last seed at the earliest) when the watch delivers a listing event (kopf marks the objects of its listings
with event type None) for a namespace already seeded; a seed drops the pods neither in its list nor touched by the
watch since it began. One pass lists; the others read the cache meanwhile. Known limit: a pod deleted while the
watch was down stays here until the next seed of its namespace (at most 5 min; kopf's own indexes keep it).
A reseed whose list fails leaves the cache as the watch keeps it and is tried again `relist_gap` later; a first
seed that fails fails the pass (there is nothing to answer from) and the next pass lists again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence

from sluice.core.observed import ObservedPod
from sluice.io.kubeobserved import observed_pod


class PodCache:
    def __init__(
        self, reseed_seconds: float = 300.0, relist_gap: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.reseed_seconds, self.relist_gap, self.clock = reseed_seconds, relist_gap, clock
        self._began: dict[str, float] = {}
        """Namespace -> when its last finished seed began (monotonic)."""
        self._pending: dict[str, float] = {}
        self._relisted: dict[str, float] = {}
        """Namespace -> when the watch last delivered a listing event for it after it was seeded."""
        self._failed: dict[str, float] = {}
        """Namespace -> when its last reseed failed: not due again within `relist_gap` of it."""
        self._lock = threading.Lock()
        self._pods: dict[tuple[str, str], ObservedPod] = {}
        self._by_label: dict[tuple[str, str, str], set[str]] = {}
        self._by_namespace: dict[str, set[str]] = {}
        self._seeded: set[str] = set()
        self._seeding: dict[str, set[str]] = {}
        """Namespace -> pods the watch touched while its seeding list was in flight."""

    def __len__(self) -> int:
        return len(self._pods)

    def seeded(self, namespace: str) -> bool:
        return namespace in self._seeded

    def due(self, namespace: str) -> bool:
        """A seeded namespace to list again: its seed is `reseed_seconds` old, or the watch relisted since."""
        with self._lock:
            began = self._began.get(namespace)
            if began is None or namespace in self._seeding:
                return False
            now = self.clock()
            if now - self._failed.get(namespace, float("-inf")) < self.relist_gap:
                return False
            age = now - began
            relisted = self._relisted.get(namespace, float("-inf")) > began
            return age >= self.reseed_seconds or (relisted and age >= self.relist_gap)

    def begin_seed(self, namespace: str) -> None:
        """Before listing the namespace: from now on, note the pods the watch touches."""
        with self._lock:
            self._seeding.setdefault(namespace, set())
            self._pending[namespace] = self.clock()

    def abandon_seed(self, namespace: str) -> None:
        """The seeding list failed: the namespace is as it was (what the watch said meanwhile is applied already);
        a seeded one is due again `relist_gap` later, not at every pass."""
        with self._lock:
            self._seeding.pop(namespace, None)
            self._pending.pop(namespace, None)
            self._failed[namespace] = self.clock()

    def finish_seed(self, namespace: str, pods: Sequence[Mapping[str, object]]) -> None:
        """The namespace's listed pods, except those the watch touched since `begin_seed` (its word is newer);
        the pods neither listed nor touched are gone (deleted while the watch was down)."""
        with self._lock:
            touched = self._seeding.pop(namespace, set())
            listed = set()
            for pod in pods:
                seen = observed_pod(pod)
                listed.add(seen.name)
                if seen.name not in touched:
                    self._put(namespace, seen)
            for name in self._by_namespace.get(namespace, set()) - listed - touched:
                self._remove(namespace, name)
            self._seeded.add(namespace)
            self._began[namespace] = self._pending.pop(namespace, self.clock())
            self._failed.pop(namespace, None)

    def put(self, namespace: str, pod: Mapping[str, object], listing: bool = False) -> None:
        """Add or replace a pod from its object (as the watch delivered it); `listing`: from a listing of the
        watch (event type None), which for a namespace already seeded means the watch was restarted."""
        seen = observed_pod(pod)
        with self._lock:
            if listing and namespace in self._seeded:
                self._relisted[namespace] = self.clock()
            self._touch(namespace, seen.name)
            self._put(namespace, seen)

    def drop(self, namespace: str, name: str) -> None:
        with self._lock:
            self._touch(namespace, name)
            self._remove(namespace, name)

    def _touch(self, namespace: str, name: str) -> None:
        touched = self._seeding.get(namespace)
        if touched is not None:
            touched.add(name)

    def _put(self, namespace: str, seen: ObservedPod) -> None:
        self._remove(namespace, seen.name)
        self._pods[(namespace, seen.name)] = seen
        self._by_namespace.setdefault(namespace, set()).add(seen.name)
        for key, value in seen.labels.items():
            self._by_label.setdefault((namespace, key, value), set()).add(seen.name)

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
                sets: list[set[str]] = [self._by_label.get((namespace, k, v), set()) for k, v in match_labels.items()]
                sets.sort(key=len)
                names = set(sets[0])
                for other in sets:
                    names &= other
            return [self._pods[(namespace, name)] for name in sorted(names)]
