"""The shard fence: what this replica holds, and the writes of a pass kept inside it.

`Tenures` is the shards this replica holds as the lease rounds (`sluice.runtime.sharding.ShardLeases`) set them:
each shard's term and validity, the shards being given up, whether the fence is closed for good, the fenced calls
in flight. One lock guards it; the lease thread writes it, the pools' daemons and the passes' writes read it.
A pass receives a `PassFence` (its `sluice.core.shards.Fence`: the pool's shard and the term the pass began in)
and writes through `FencedCluster`, which hands the fence to each write explicitly: a call is let through only
while `Fence.deadline` says so (the shard held in the pass's term, its validity not over), counted in flight until
it returns, and the Kubernetes adapter checks again right before each request it sends, each request with a
timeout within what is left of the validity.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TypeVar

from sluice.api.v1alpha1 import InferencePoolSpec, InferencePoolStatus
from sluice.core.events import Event
from sluice.core.observed import ObservedMesh, ObservedPod
from sluice.core.shards import Fence, Tenure
from sluice.io.kube import KubeCluster
from sluice.io.ports import Cluster, ClusterError, ObjectKey, WriteResult
from sluice.istio.rendered import Rendered

T = TypeVar("T")


class Tenures:
    """The shards this replica holds. Every method takes the lock itself unless its name says `_locked`."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.valid_until: dict[int, float] = {}
        """Held shard -> monotonic time until which this replica may act on it."""
        self.terms: dict[int, int] = {}
        """Held shard -> its term: a number taken anew each time the shard is acquired (never reused)."""
        self._taken = 0
        self.releasing: dict[int, float] = {}
        """Shard given up -> when its Lease is cleared (its fence closed at once)."""
        self.closed = False
        """Set by `close`: no write starts from then on."""
        self.cleared = False
        """Set by `clear`: the Leases were cleared (a shard taken after that is given back)."""
        self._inflight: dict[int, int] = {}
        """Shard -> fenced calls under way (`writing`): a Lease is cleared once they ended (or its validity did)."""
        self._ended = threading.Condition(self.lock)

    # ---- what the daemons and the writes ask

    def holds(self, index: int) -> bool:
        with self.lock:
            return self._holds_locked(index)

    def _holds_locked(self, index: int) -> bool:
        return not self.closed and self.clock() < self.valid_until.get(index, 0.0) and index not in self.releasing

    def _tenure_locked(self, index: int) -> Tenure | None:
        """The shard's tenure while it is held (its validity not checked: `Fence.deadline` does)."""
        term = self.terms.get(index)
        if self.closed or term is None or index in self.releasing:
            return None
        return Tenure(term, self.valid_until.get(index, 0.0))

    def term(self, index: int) -> int | None:
        """The shard's current term while it is held, else None."""
        with self.lock:
            return self.terms.get(index) if self._holds_locked(index) else None

    def deadline(self, fence: Fence) -> float | None:
        """Seconds left of the validity of the fence's shard while it is held in the fence's term, else None."""
        with self.lock:
            return fence.deadline(self._tenure_locked(fence.shard), self.clock())

    @contextlib.contextmanager
    def writing(self, fence: Fence) -> Iterator[float]:
        """Around one fenced call: refuses unless `fence` lets it go now, else gives the seconds left of the
        Lease's validity (the call's request timeout) and counts the call in flight until it returns."""
        index = fence.shard
        with self.lock:
            seconds = fence.deadline(self._tenure_locked(index), self.clock())
            if seconds is None:
                raise ClusterError(409, f"shard {index} not held by this replica in term {fence.term}: write withheld")
            self._inflight[index] = self._inflight.get(index, 0) + 1
        try:
            yield seconds
        finally:
            with self.lock:
                self._inflight[index] -= 1
                self._ended.notify_all()

    # ---- what the lease rounds set

    def kept(self) -> list[int]:
        """The shards held and not being given up (their validity not checked)."""
        with self.lock:
            return [i for i in self.valid_until if i not in self.releasing]

    def held_at(self, now: float) -> set[int]:
        """The shards valid at `now` and not being given up."""
        with self.lock:
            return {i for i in self.valid_until if now < self.valid_until[i]} - set(self.releasing)

    def left(self, index: int) -> float:
        """Seconds left of the shard's validity (0 or less: over, or not held)."""
        with self.lock:
            return self.valid_until.get(index, 0.0) - self.clock()

    def lapsed(self, now: float) -> list[int]:
        """Held shards, not being given up, whose validity is over at `now`."""
        with self.lock:
            return [i for i, until in self.valid_until.items() if now >= until and i not in self.releasing]

    def begin(self, index: int, valid_until: float) -> None:
        """The shard taken: a new term begins."""
        with self.lock:
            self._taken += 1
            self.terms[index] = self._taken
            self.valid_until[index] = valid_until

    def renewed(self, index: int, valid_until: float) -> None:
        with self.lock:
            self.valid_until[index] = valid_until

    def end(self, index: int) -> None:
        """The shard lost: its term is over."""
        with self.lock:
            self.valid_until.pop(index, None)
            self.terms.pop(index, None)

    def released(self, index: int) -> None:
        """The shard given up and its Lease cleared."""
        with self.lock:
            self.releasing.pop(index, None)
            self.valid_until.pop(index, None)
            self.terms.pop(index, None)

    def give_up(self, index: int, at: float) -> None:
        """Close the shard's fence now; its Lease is cleared at `at`, once its calls in flight have ended."""
        with self.lock:
            self.releasing[index] = at

    def due_releases(self, now: float) -> list[int]:
        with self.lock:
            return [i for i, at in self.releasing.items() if at <= now and self._quiet_locked(i, now)]

    def _quiet_locked(self, index: int, now: float) -> bool:
        """No fenced call of the shard under way, or its validity over (their request timeouts have ended)."""
        return not self._inflight.get(index) or now >= self.valid_until.get(index, 0.0)

    def close(self) -> None:
        with self.lock:
            self.closed = True

    def clear(self) -> list[int]:
        """Once the fenced calls in flight have ended (bounded by the validity, which their request timeouts are
        within), forget every shard: the ones held are returned, for their Leases to be cleared."""
        with self.lock:
            until = max(self.valid_until.values(), default=0.0)
            while not all(self._quiet_locked(i, self.clock()) for i in self.valid_until) and self.clock() < until:
                self._ended.wait(timeout=min(0.1, max(0.0, until - self.clock())))
            held = list(self.valid_until)
            self.valid_until.clear()
            self.terms.clear()
            self.cleared = True
        return held


@dataclass(frozen=True)
class PassFence:
    """What one pass's writes are held to: its `Fence`, decided on the replica's `Tenures`."""

    tenures: Tenures
    fence: Fence

    def writing(self) -> AbstractContextManager[float]:
        return self.tenures.writing(self.fence)

    def around(self, cluster: Cluster) -> FencedCluster:
        """`cluster` with every write of this pass behind the fence."""
        return FencedCluster(cluster, self)


class FencedCluster:
    """The `Cluster` port with every write refused unless this replica holds the pool's shard in the term the pass
    began in. Checked when a call begins, and again right before each request it sends (the Kubernetes adapter is
    handed the fence: `KubeCluster.fenced`), each request with a timeout no longer than the Lease's remaining
    validity."""

    def __init__(self, inner: Cluster, fence: PassFence) -> None:
        self.fence = fence
        self.inner = inner.fenced(fence.writing) if isinstance(inner, KubeCluster) else inner

    def _fenced(self, call: Callable[[], T]) -> T:
        with self.fence.writing():  # in flight until it returns: `ShardLeases.stop` waits for it
            return call()

    def pods(self, namespace: str, match_labels: dict[str, str]) -> list[ObservedPod]:
        return self.inner.pods(namespace, match_labels)

    def secret_key(self, namespace: str, name: str, key: str) -> str:
        return self.inner.secret_key(namespace, name, key)

    def mesh(self, namespace: str, spec: InferencePoolSpec) -> ObservedMesh | None:
        return self.inner.mesh(namespace, spec)

    def owned(self, namespace: str, pool: str, elsewhere: frozenset[str] = frozenset()) -> list[ObjectKey]:
        return self.inner.owned(namespace, pool, elsewhere)

    def apply(self, desired: Rendered, pool_uid: str | None, adopt: bool) -> WriteResult:
        return self._fenced(lambda: self.inner.apply(desired, pool_uid, adopt))

    def release(self, namespace: str, key: ObjectKey) -> WriteResult:
        return self._fenced(lambda: self.inner.release(namespace, key))

    def write_status(self, namespace: str, name: str, status: InferencePoolStatus) -> None:
        self._fenced(lambda: self.inner.write_status(namespace, name, status))

    def emit(self, namespace: str, name: str, uid: str | None, event: Event) -> None:
        self._fenced(lambda: self.inner.emit(namespace, name, uid, event))
