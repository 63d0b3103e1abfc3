"""Shard ownership through `coordination.k8s.io/v1` Leases, and the fence that keeps a replica's writes inside it.

With `--shards N` (N > 1) every replica runs one `ShardLeases` thread: each tick (1 s) it renews the shard
Leases it holds (every `renew_every` < duration / 3) with the resourceVersion it last wrote, so a renewal needs no
list and a list that fails against a busy API server costs no shard already held; then it lists the shard set's
Leases once, renews its own member Lease, and acquires or releases shards as `sluice.core.shards.decide` says.
Every update carries a resourceVersion, so two replicas racing for one Lease get one success and one 409. Each
call waits for its answer `call_timeout` at most (a renewal: no longer than what is left of the validity) and is
sent once: the API client is built with `retries=0`, and the next tick tries again while the Lease is valid.
A pool's daemon passes only while its shard is held (`pool_term`); inside a pass, `FencedCluster` refuses every
write unless the shard is still held in the term the pass began in (a term begins at each acquisition) and the Lease
is still valid (`renewal sent + duration - margin`), checked right before each request, which is sent with a timeout
within what is left of that validity; so a replica that lost its Lease mid-pass writes nothing after it, even once
it has taken it back. A surplus shard is given up in two steps: the fence closes at once, the Lease is cleared
`margin` seconds later, once the shard's fenced calls in flight have ended (or its validity has: their request
timeouts end with it). On shutdown the fence closes, the loop stops, the fenced calls in flight end (bounded by
their timeouts), then every held Lease is cleared, so a successor takes over at once; a replica that dies (SIGKILL)
is replaced after its Leases expire (duration + one tick).
Verbs used on leases: list, create, update, delete (expired member Leases of replicas that are gone).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any, TypeVar, cast

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from sluice.api.v1alpha1 import InferencePoolSpec, InferencePoolStatus
from sluice.core.events import Event
from sluice.core.observed import ObservedMesh, ObservedPod
from sluice.core.shards import (
    ROLE_LABEL,
    SHARD_LABEL,
    LeaseView,
    decide,
    member_lease_name,
    shard_lease_name,
    shard_of,
)
from sluice.io.kube import USER_AGENT, WRITE_FENCE
from sluice.io.ports import Cluster, ClusterError, ObjectKey, WriteResult
from sluice.istio.rendered import Rendered

log = logging.getLogger("sluice.sharding")
TIMEOUT = 4.0  # seconds per Lease call: a call that hangs must not hold the renewals past the Lease's validity
_CURRENT: contextvars.ContextVar[tuple[int, int | None] | None] = contextvars.ContextVar("sluice_shard", default=None)
"""The pool's shard of the pass running in this thread, and the term in which the pass began (None: not held)."""
T = TypeVar("T")


class _Stopping(Exception):
    """A Lease write that would take or keep a shard, asked for after `stop`."""


def _micro_time(now: datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class ShardLeases:
    def __init__(
        self,
        api_client: k8s.ApiClient,
        namespace: str,
        shards: int,
        identity: str | None = None,
        prefix: str = "sluice",
        duration: float = 10.0,
        renew_every: float = 3.0,
        margin: float = 2.0,
        tick: float = 1.0,
        call_timeout: float = TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        if not renew_every < duration / 3:
            raise ValueError("renew_every must be under a third of the lease duration")
        api_client.user_agent = USER_AGENT  # the operator's calls, told apart in audit logs
        self.api = k8s.CoordinationV1Api(api_client)
        self.namespace, self.shards, self.prefix = namespace, shards, prefix
        self.identity = identity or f"{os.environ.get('HOSTNAME', 'local')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.duration, self.renew_every, self.margin, self.tick = duration, renew_every, margin, tick
        self.call_timeout = call_timeout
        self.clock, self.wall = clock, wall
        """`clock` times the terms; `wall` stamps renewTime, which must change for a renewal to change the record
        (an update that changes nothing is a no-op: the resourceVersion stays, and others see the Lease age)."""
        self.member = member_lease_name(prefix, self.identity)
        self._lock = threading.Lock()
        self._valid_until: dict[int, float] = {}
        """Held shard -> monotonic time until which this replica may act on it."""
        self._term: dict[int, int] = {}
        """Held shard -> its term: a number taken anew each time the shard is acquired (never reused)."""
        self._terms = 0
        self._closed = False
        """Set by `stop`: no write starts from then on."""
        self._cleared = False
        self._inflight: dict[int, int] = {}
        """Shard -> fenced calls under way (`writing`): a Lease is cleared once they ended (or its validity did)."""
        self._ended = threading.Condition(self._lock)
        self._renewed: dict[str, float] = {}
        self._versions: dict[str, str] = {}
        self._releasing: dict[int, float] = {}
        self._seen: dict[str, tuple[tuple[str | None, str], float]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.transitions: list[tuple[float, int, str]] = []
        """(monotonic time, shard, 'acquired' | 'lost' | 'releasing' | 'released'), for logs and tests."""
        self.on_change: Callable[[int], None] | None = None
        """Called from the lease thread with a shard's index at each transition: the pools' daemons are woken to
        see it (a pool whose shard went away stops reporting now, not at its next interval)."""

    # ---- what the handlers ask

    def shard(self, namespace: str, name: str) -> int:
        return shard_of(namespace, name, self.shards)

    def holds(self, index: int) -> bool:
        with self._lock:
            return self._holds(index)

    def _holds(self, index: int) -> bool:
        return not self._closed and self.clock() < self._valid_until.get(index, 0.0) and index not in self._releasing

    def _held_in(self, index: int, term: int | None) -> bool:
        """Held now, and in `term` (a term is never reused, so an older pass's term no longer matches). Under the
        lock."""
        return term is not None and self._holds(index) and self._term.get(index) == term

    def term(self, index: int) -> int | None:
        """The shard's current term while it is held, else None."""
        with self._lock:
            return self._term.get(index) if self._holds(index) else None

    def pool_term(self, namespace: str, name: str) -> int | None:
        return self.term(self.shard(namespace, name))

    def holds_pool(self, namespace: str, name: str) -> bool:
        return self.holds(self.shard(namespace, name))

    def valid_for(self, namespace: str, name: str, term: int | None) -> float | None:
        """Seconds left of the validity of the pool's shard while it is held in `term`, else None: how long the
        pool's daemon may wait before it must look again (its shard can lapse with no round to say so, the lease
        thread stalled)."""
        index = self.shard(namespace, name)
        with self._lock:
            return self._valid_until[index] - self.clock() if self._held_in(index, term) else None

    def held(self) -> list[int]:
        return [i for i in range(self.shards) if self.holds(i)]

    @contextlib.contextmanager
    def passing(self, namespace: str, name: str, term: int | None = None) -> Iterator[None]:
        """Mark the calling thread as passing this pool, in `term` (by default the shard's term now):
        `FencedCluster` lets a write go only while the shard is held in that same term."""
        index = self.shard(namespace, name)
        token = _CURRENT.set((index, self.term(index) if term is None else term))
        try:
            yield
        finally:
            _CURRENT.reset(token)

    @contextlib.contextmanager
    def writing(self, index: int, term: int | None) -> Iterator[float]:
        """Around one fenced call: refuses unless the shard is held in `term`, else gives the seconds left of the
        Lease's validity (the call's request timeout) and counts the call in flight until it returns."""
        with self._lock:
            if not self._held_in(index, term):
                raise ClusterError(409, f"shard {index} not held by this replica in term {term}: write withheld")
            seconds = self._valid_until[index] - self.clock()
            self._inflight[index] = self._inflight.get(index, 0) + 1
        try:
            yield seconds
        finally:
            with self._lock:
                self._inflight[index] -= 1
                self._ended.notify_all()

    def _quiet(self, index: int, now: float) -> bool:
        """No fenced call of the shard under way, or its validity over (their request timeouts have ended)."""
        return not self._inflight.get(index) or now >= self._valid_until.get(index, 0.0)

    # ---- the loop

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="shard-leases", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Close the fence (no write starts), stop the loop (it takes no shard after this), let the fenced calls
        in flight end (each write's request timeout ends within its Lease's validity, so this is bounded by
        `duration - margin`), then clear the Leases so a successor takes over at once."""
        with self._lock:
            self._closed = True
        self._stop.set()
        if self._thread is not None:
            # at most one Lease call is in flight after `_stop`
            self._thread.join(timeout=self.call_timeout + self.tick)
        with self._lock:
            until = max(self._valid_until.values(), default=0.0)
            while not all(self._quiet(i, self.clock()) for i in self._valid_until) and self.clock() < until:
                self._ended.wait(timeout=min(0.1, max(0.0, until - self.clock())))
            held = list(self._valid_until)
            self._valid_until.clear()
            self._term.clear()
            self._cleared = True
        for index in held:
            with contextlib.suppress(Exception):
                self._clear(shard_lease_name(self.prefix, index, self.shards))
        with contextlib.suppress(Exception):
            self.api.delete_namespaced_lease(self.member, self.namespace, _request_timeout=self.call_timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except _Stopping:
                return
            except Exception:  # the API is down or refused: held shards lapse by their own deadline
                log.exception("shard lease round failed")
            self._stop.wait(self.tick)

    def step(self) -> None:
        """One round: held shards past their validity lost, renew, then list, check, release, acquire, tidy up."""
        self._expire()
        self._renew_shards()
        items = self._list()
        now = self.clock()
        for name, lease in items.items():
            spec = lease.get("spec") or {}
            record = (spec.get("holderIdentity"), str(lease["metadata"].get("resourceVersion", "")))
            seen = self._seen.get(name)
            if seen is None or seen[0] != record:
                self._seen[name] = (record, now)
        self._member_round(items, now)
        live, others = self._live_members(items, now)
        self._finish_releases(now)
        self._check_shards(items)
        views = {
            i: self._view(items.get(shard_lease_name(self.prefix, i, self.shards)), now) for i in range(self.shards)
        }
        with self._lock:
            held = {i for i in self._valid_until if now < self._valid_until[i]} - set(self._releasing)
        for view in views.values():
            if view is not None and view.holder in others and view.unchanged_for < view.duration:
                others[view.holder] += 1
        decision = decide(self.identity, self.shards, held, views, live, others)
        for index in decision.release:
            with self._lock:
                self._releasing[index] = now + self.margin
            self._note(index, "releasing")
        for index in decision.acquire:
            self._acquire(index, views[index])

    def _list(self) -> dict[str, dict[str, Any]]:
        answer = self.api.list_namespaced_lease(
            self.namespace,
            label_selector=f"{SHARD_LABEL}={self.prefix}",
            _preload_content=False,
            _request_timeout=self.call_timeout,
        )
        items = json.loads(cast(Any, answer).data).get("items", [])
        return {item["metadata"]["name"]: item for item in items}

    def _view(self, lease: dict[str, Any] | None, now: float) -> LeaseView | None:
        if lease is None:
            return None
        name = lease["metadata"]["name"]
        spec = lease.get("spec") or {}
        seen_at = self._seen.get(name, (None, now))[1]
        return LeaseView(
            holder=spec.get("holderIdentity") or None,
            resource_version=str(lease["metadata"].get("resourceVersion", "")),
            duration=float(spec.get("leaseDurationSeconds") or self.duration),
            unchanged_for=now - seen_at,
        )

    def _body(self, name: str, role: str, holder: str | None, version: str | None, acquired: bool) -> dict[str, Any]:
        stamp = _micro_time(self.wall())
        spec: dict[str, Any] = {"holderIdentity": holder, "leaseDurationSeconds": int(self.duration)}
        if holder:
            spec["renewTime"] = stamp
            if acquired:
                spec["acquireTime"] = stamp
        meta: dict[str, Any] = {
            "name": name,
            "namespace": self.namespace,
            "labels": {SHARD_LABEL: self.prefix, ROLE_LABEL: role},
        }
        if version is not None:
            meta["resourceVersion"] = version
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}

    def _write(self, name: str, body: dict[str, Any], create: bool, timeout: float | None = None) -> str:
        if self._stop.is_set() and body["spec"].get("holderIdentity"):
            raise _Stopping(name)  # after `stop` only clearing writes go out
        wait = self.call_timeout if timeout is None else timeout
        if create:
            answer = self.api.create_namespaced_lease(
                self.namespace, cast(Any, body), _preload_content=False, _request_timeout=wait
            )
        else:
            answer = self.api.replace_namespaced_lease(
                name, self.namespace, cast(Any, body), _preload_content=False, _request_timeout=wait
            )
        written = json.loads(cast(Any, answer).data)
        version = str(written["metadata"]["resourceVersion"])
        self._versions[name] = version
        self._seen[name] = ((body["spec"].get("holderIdentity"), version), self.clock())
        return version

    def _member_round(self, items: dict[str, dict[str, Any]], now: float) -> None:
        if self._renewed.get(self.member, -1e9) + self.renew_every > now and self.member in items:
            return
        current = items.get(self.member)
        try:
            version = None if current is None else str(current["metadata"]["resourceVersion"])
            self._write(self.member, self._body(self.member, "member", self.identity, version, False), current is None)
            self._renewed[self.member] = now
        except ApiException as failure:
            log.warning("member lease %s: %s %s", self.member, failure.status, failure.reason)
        except _Stopping:
            raise
        except Exception as failure:  # no answer: the shards are still checked and taken this round
            log.warning("member lease %s: %s", self.member, failure)
        for name, lease in items.items():  # replicas that are gone: their member Leases expired long ago
            role = (lease["metadata"].get("labels") or {}).get(ROLE_LABEL)
            if role == "member" and name != self.member and now - self._seen[name][1] > 3 * self.duration:
                with contextlib.suppress(ApiException):
                    self.api.delete_namespaced_lease(name, self.namespace, _request_timeout=self.call_timeout)

    def _live_members(self, items: dict[str, dict[str, Any]], now: float) -> tuple[int, dict[str, int]]:
        """How many replicas are live (this one too), and the others' identities (with a zero shard count)."""
        others: dict[str, int] = {}
        for name, lease in items.items():
            role = (lease["metadata"].get("labels") or {}).get(ROLE_LABEL)
            spec = lease.get("spec") or {}
            duration = float(spec.get("leaseDurationSeconds") or self.duration)
            holder = spec.get("holderIdentity")
            if role == "member" and name != self.member and holder and now - self._seen[name][1] < duration:
                others[str(holder)] = 0
        return 1 + len(others), others

    def _kept(self) -> list[int]:
        """The shards this replica holds and is not giving up (their validity not checked)."""
        with self._lock:
            return [i for i in self._valid_until if i not in self._releasing]

    def _renew_shards(self) -> None:
        """Renew the held shards that are due, each with the resourceVersion this replica last wrote (or last
        listed under its own name): a 409 means another replica wrote the Lease since, and the shard is lost."""
        now = self.clock()
        mine = self._kept()
        for index in mine:
            name = shard_lease_name(self.prefix, index, self.shards)
            if self._renewed.get(name, -1e9) + self.renew_every > now:
                continue
            with self._lock:
                left = self._valid_until.get(index, 0.0) - self.clock()
            if left <= 0:  # ran out during this round (renewals before it hanging): not renewed in its term
                self._lose(index, "lapsed without a renewal")
                continue
            sent = self.clock()
            body = self._body(name, "shard", self.identity, self._versions.get(name), False)
            try:
                self._write(name, body, False, timeout=min(self.call_timeout, left))
            except ApiException as failure:
                if failure.status in (404, 409):
                    self._lose(index, "conflict on renewal" if failure.status == 409 else "deleted")
                else:
                    log.warning("renewing %s: %s %s", name, failure.status, failure.reason)
                    if self.clock() >= self._valid_until.get(index, 0.0):
                        self._lose(index, "renewal failed until the lease lapsed")
                continue
            except _Stopping:
                raise
            except Exception as failure:  # no answer (a timeout, a refused connection): the other shards still renew
                log.warning("renewing %s: %s", name, failure)
                continue
            self._renewed[name] = sent
            with self._lock:
                self._valid_until[index] = sent + self.duration - self.margin

    def _check_shards(self, items: dict[str, dict[str, Any]]) -> None:
        """After the list: a held shard whose Lease another replica holds (or nobody does) is lost, and so is one
        whose validity ran out while the list was on the wire (it must be taken back in a new term, not renewed
        as if held all along). The version listed under this replica's name is the one the next renewal sends
        (a renewal whose answer was lost may have landed)."""
        mine = self._kept()
        for index in mine:
            name = shard_lease_name(self.prefix, index, self.shards)
            lease = items.get(name)
            holder = ((lease or {}).get("spec") or {}).get("holderIdentity")
            if lease is None or holder != self.identity:
                self._lose(index, f"taken by {holder or 'nobody'}")
                continue
            self._versions[name] = str(lease["metadata"]["resourceVersion"])
            with self._lock:
                lapsed = self.clock() >= self._valid_until.get(index, 0.0)
            if lapsed:
                self._lose(index, "lapsed without a renewal")

    def _acquire(self, index: int, view: LeaseView | None) -> None:
        if self._stop.is_set():
            return
        name = shard_lease_name(self.prefix, index, self.shards)
        sent = self.clock()
        body = self._body(name, "shard", self.identity, None if view is None else view.resource_version, True)
        try:
            self._write(name, body, view is None)
        except ApiException as failure:
            if failure.status not in (409,):
                log.warning("acquiring %s: %s %s", name, failure.status, failure.reason)
            return
        with self._lock:
            late = self._cleared  # `stop` cleared the Leases while this write was on the wire: give it back
        if late:
            with contextlib.suppress(ApiException):
                self._clear(name)
            return
        self._acquired(index, sent)

    def _acquired(self, index: int, sent: float) -> None:
        """The shard's Lease was taken by a write sent at `sent` (monotonic): a new term begins."""
        self._renewed[shard_lease_name(self.prefix, index, self.shards)] = sent
        with self._lock:
            self._terms += 1
            self._term[index] = self._terms
            self._valid_until[index] = sent + self.duration - self.margin
        self._note(index, "acquired")

    def _finish_releases(self, now: float) -> None:
        with self._lock:
            due = [i for i, at in self._releasing.items() if at <= now and self._quiet(i, now)]
        for index in due:
            name = shard_lease_name(self.prefix, index, self.shards)
            with contextlib.suppress(ApiException):
                self._clear(name)
            with self._lock:
                self._releasing.pop(index, None)
                self._valid_until.pop(index, None)
                self._term.pop(index, None)
            self._note(index, "released")

    def _clear(self, name: str) -> None:
        version = self._versions.get(name)
        self._write(name, self._body(name, "shard", None, version, False), False)

    def _expire(self) -> None:
        """Held shards whose validity ran out without a renewal (the API unreachable, a renewal timing out) are
        lost: a transition like any other, so their pools' daemons are woken and stop reporting them now, and a
        shard taken back later starts a new term. Runs first in every round, before anything that can fail."""
        now = self.clock()
        with self._lock:
            lapsed = [i for i, until in self._valid_until.items() if now >= until and i not in self._releasing]
        for index in lapsed:
            self._lose(index, "lapsed without a renewal")

    def _lose(self, index: int, why: str) -> None:
        with self._lock:
            self._valid_until.pop(index, None)
            self._term.pop(index, None)
        self._note(index, f"lost ({why})")

    def _note(self, index: int, what: str) -> None:
        self.transitions.append((self.clock(), index, what))
        log.info("shard %d/%d %s by %s", index, self.shards, what, self.identity)
        hook = self.on_change  # read once: cleanup clears it from the loop's thread
        if hook is not None:
            try:
                hook(index)
            except RuntimeError:  # a closed loop at shutdown: the daemons are going anyway
                log.debug("shard %d: waking its pools failed", index, exc_info=True)
            except Exception:  # never out of the lease round (it would stop half-way), but not quietly either
                log.exception("shard %d: waking its pools failed", index)


class FencedCluster:
    """The `Cluster` port with every write refused unless this replica holds the pool's shard in the term the pass
    began in. Checked when a call begins, and again right before each request it sends (`WRITE_FENCE`, honoured
    by `KubeCluster`), each request with a timeout no longer than the Lease's remaining validity."""

    def __init__(self, inner: Cluster, leases: ShardLeases) -> None:
        self.inner, self.leases = inner, leases

    def _fenced(self, call: Callable[[], T]) -> T:
        current = _CURRENT.get()
        if current is None:
            raise ClusterError(409, "no pass of a pool under way in this thread: write withheld")
        index, term = current
        with self.leases.writing(index, term):  # in flight until it returns: `stop` waits for it
            token = WRITE_FENCE.set(lambda: self.leases.writing(index, term))
            try:
                return call()
            finally:
                WRITE_FENCE.reset(token)

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
