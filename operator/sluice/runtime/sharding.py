"""Shard ownership through `coordination.k8s.io/v1` Leases: the rounds that take, renew and give them up.

With `--shards N` (N > 1) every replica runs one `ShardLeases` thread: each tick (1 s) it renews the shard Leases it
holds (every `renew_every` < duration / 3) with the resourceVersion it last wrote, so a renewal needs no list and a
list that fails against a busy API server costs no shard already held; then it lists the shard set's Leases once,
renews its own member Lease, and acquires or releases shards as `sluice.core.shards.decide` says. Every update
carries a resourceVersion, so two replicas racing for one Lease get one success and one 409. A renewal waits
`renew_timeout` (2 s) at most for its answer and is sent again after a 429, a 5xx or no answer while the validity
lasts, never past it (`sluice.runtime.leaserenewal`); the other calls wait `call_timeout` and are sent once, the
next tick trying again (the API client is built with `retries=0`). A pool's daemon passes only while its shard is
held (`pool_term`); a pass's writes are fenced (`fence`, `sluice.runtime.fence`): refused unless the shard is held
in the term the pass began in and the Lease is still valid (`renewal sent + duration - margin`), checked right
before each request, sent with a timeout within that validity; a replica that lost its Lease mid-pass writes nothing
after it, even once it took it back. A surplus shard is given up in two steps: the fence closes at once, the Lease
is cleared `margin` seconds later, once the shard's fenced calls in flight have ended (or its validity has: their
request timeouts end with it). On shutdown the fence closes, the loop stops, the fenced calls in flight end (bounded
by their timeouts), then every held Lease is cleared, so a successor takes over at once; a replica that dies
(SIGKILL) is replaced after its Leases expire (duration + one tick).
Verbs used on leases: list, create, update, delete (expired member Leases of replicas that are gone).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import cast

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from sluice.api.jsontypes import JsonObject, text
from sluice.core.apiretry import Failure, reason_of
from sluice.core.shards import (
    SHARD_LABEL,
    Fence,
    LeaseView,
    decide,
    duration_of,
    holder_of,
    lease_body,
    lease_view,
    member_lease_name,
    micro_time,
    role_of,
    shard_lease_name,
    shard_of,
    version_of,
)
from sluice.io.kube import USER_AGENT
from sluice.io.kubereads import RetryCounts, Retrying
from sluice.runtime.fence import PassFence, Tenures
from sluice.runtime.leaserenewal import RENEW_TIMEOUT, Lapsed, renew

log = logging.getLogger("sluice.sharding")
TIMEOUT = 4.0  # seconds per Lease call: a call that hangs must not hold the renewals past the Lease's validity


class _Stopping(Exception):
    """A Lease write that would take or keep a shard, asked for after `stop`."""


def _decoded(answer: object) -> JsonObject:
    """The JSON body of an answer read with `_preload_content=False` (the HTTP response: its `data`)."""
    value = json.loads(getattr(answer, "data", b"{}"))
    return value if isinstance(value, dict) else {}


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
        retrying: Retrying | None = None,
        renew_timeout: float = RENEW_TIMEOUT,
    ) -> None:
        if not renew_every < duration / 3:
            raise ValueError("renew_every must be under a third of the lease duration")
        api_client.user_agent = USER_AGENT  # the operator's calls, told apart in audit logs
        self.api = k8s.CoordinationV1Api(api_client)
        self.namespace, self.shards, self.prefix = namespace, shards, prefix
        self.identity = identity or f"{os.environ.get('HOSTNAME', 'local')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.duration, self.renew_every, self.margin, self.tick = duration, renew_every, margin, tick
        self.call_timeout, self.renew_timeout = call_timeout, renew_timeout
        self.retrying = retrying or Retrying(clock=clock)
        """When a renewal is sent again (its clock is the terms' clock)."""
        self.clock, self.wall = clock, wall
        """`clock` times the terms; `wall` stamps renewTime, which must change for a renewal to change the record
        (an update that changes nothing is a no-op: the resourceVersion stays, and others see the Lease age)."""
        self.member = member_lease_name(prefix, self.identity)
        self.tenures = Tenures(clock)
        """The shards held, their terms and validity: what the fence decides on."""
        self._renewed: dict[str, float] = {}
        self._versions: dict[str, str] = {}
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
        return self.tenures.holds(index)

    def term(self, index: int) -> int | None:
        """The shard's current term while it is held, else None."""
        return self.tenures.term(index)

    def pool_term(self, namespace: str, name: str) -> int | None:
        return self.term(self.shard(namespace, name))

    def valid_for(self, namespace: str, name: str, term: int | None) -> float | None:
        """Seconds left of the validity of the pool's shard while it is held in `term`, else None: how long the
        pool's daemon may wait before it must look again (its shard can lapse with no round to say so, the lease
        thread stalled)."""
        return self.tenures.deadline(Fence(self.shard(namespace, name), term))

    def held(self) -> list[int]:
        return [i for i in range(self.shards) if self.holds(i)]

    def fence(self, namespace: str, name: str, term: int | None = None) -> PassFence:
        """The fence of a pass of this pool begun in `term` (by default the shard's term now): its writes go only
        while the shard is held in that same term."""
        index = self.shard(namespace, name)
        return PassFence(self.tenures, Fence(index, self.term(index) if term is None else term))

    # ---- the loop

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="shard-leases", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Close the fence (no write starts), stop the loop (it takes no shard after this), let the fenced calls
        in flight end (each write's request timeout ends within its Lease's validity, so this is bounded by
        `duration - margin`), then clear the Leases so a successor takes over at once."""
        self.tenures.close()
        self._stop.set()
        if self._thread is not None:
            # at most one Lease call is in flight after `_stop`
            self._thread.join(timeout=self.call_timeout + self.tick)
        for index in self.tenures.clear():
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
            except ApiException as failure:  # an answer (a 429 past its retry, a 5xx): no traceback to read
                log.warning("shard lease round failed: %s %s", failure.status, failure.reason)
            except Exception:  # the API is down or refused: held shards lapse by their own deadline
                log.exception("shard lease round failed")
            self._stop.wait(self.tick)

    def step(self) -> None:
        """One round: held shards past their validity lost, renew the shards and the member Lease, then list,
        check, release, acquire, tidy up. The member Lease is renewed before the list, with the resourceVersion
        this replica last wrote and the renewals' short timeout: it came after the list, so under a throttling API
        server a failed list skipped it, and a member Lease left unrenewed for its duration reads as a replica
        gone, whose shards the others plan to take. A list that fails ends the round (the next, a tick later,
        lists again; a 429's Retry-After of 1 s is about a tick)."""
        self._expire()
        self._renew_shards()
        self._renew_member()
        items = self._list()
        now = self.clock()
        for name, lease in items.items():
            record = (holder_of(lease), version_of(lease))
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
        held = self.tenures.held_at(now)
        for view in views.values():
            if view is not None and view.holder in others and view.unchanged_for < view.duration:
                others[view.holder] += 1
        decision = decide(self.identity, self.shards, held, views, live, others)
        for index in decision.release:
            self.tenures.give_up(index, now + self.margin)
            self._note(index, "releasing")
        for index in decision.acquire:
            self._acquire(index, views[index])

    def _list(self) -> dict[str, JsonObject]:
        answer = self.api.list_namespaced_lease(
            self.namespace,
            label_selector=f"{SHARD_LABEL}={self.prefix}",
            _preload_content=False,
            _request_timeout=self.call_timeout,
        )
        items = _decoded(answer).get("items")
        leases = [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []
        return {text(item, "metadata", "name"): item for item in leases}

    def _view(self, lease: JsonObject | None, now: float) -> LeaseView | None:
        if lease is None:
            return None
        seen_at = self._seen.get(text(lease, "metadata", "name"), (None, now))[1]
        return lease_view(lease, self.duration, now - seen_at)

    def _body(self, name: str, role: str, holder: str | None, version: str | None, acquired: bool) -> JsonObject:
        stamp = micro_time(self.wall())
        return lease_body(self.namespace, self.prefix, name, role, holder, version, int(self.duration), stamp, acquired)

    def _write(self, name: str, body: JsonObject, create: bool, timeout: float | None = None) -> str:
        holder = holder_of(body)
        if self._stop.is_set() and holder:
            raise _Stopping(name)  # after `stop` only clearing writes go out
        wait = self.call_timeout if timeout is None else timeout
        lease = cast(k8s.V1Lease, body)  # the client sends a plain dict as it is: the Lease's JSON
        if create:
            answer = self.api.create_namespaced_lease(
                self.namespace, lease, _preload_content=False, _request_timeout=wait
            )
        else:
            answer = self.api.replace_namespaced_lease(
                name, self.namespace, lease, _preload_content=False, _request_timeout=wait
            )
        version = text(_decoded(answer), "metadata", "resourceVersion")
        self._versions[name] = version
        self._seen[name] = ((holder, version), self.clock())
        return version

    def _renew_member(self) -> None:
        """The member Lease renewed when due, before the list: with the resourceVersion this replica last wrote
        and the renewals' timeout (a 409 — another write since, or one of its own that timed out but landed — is
        left to the list's round, which writes it with the version it lists). Its first write is the list's."""
        version = self._versions.get(self.member)
        if version is None or self._renewed.get(self.member, -1e9) + self.renew_every > self.clock():
            return
        try:
            body = self._body(self.member, "member", self.identity, version, False)
            self._write(self.member, body, False, timeout=self.renew_timeout)
            self._renewed[self.member] = self.clock()
        except _Stopping:
            raise
        except Exception as failure:
            log.warning("member lease %s: %s", self.member, failure)

    def _member_round(self, items: dict[str, JsonObject], now: float) -> None:
        """The member Lease written from the list when `_renew_member` could not (its first write, or after a
        409 or no answer); the member Leases of replicas gone for three durations deleted."""
        if self._renewed.get(self.member, -1e9) + self.renew_every <= now or self.member not in items:
            self._write_member(items.get(self.member), now)
        for name, lease in items.items():  # replicas that are gone: their member Leases expired long ago
            role = role_of(lease)
            if role == "member" and name != self.member and now - self._seen[name][1] > 3 * self.duration:
                with contextlib.suppress(ApiException):
                    self.api.delete_namespaced_lease(name, self.namespace, _request_timeout=self.call_timeout)

    def _write_member(self, current: JsonObject | None, now: float) -> None:
        try:
            version = None if current is None else version_of(current)
            self._write(self.member, self._body(self.member, "member", self.identity, version, False), current is None)
            self._renewed[self.member] = now
        except ApiException as failure:
            log.warning("member lease %s: %s %s", self.member, failure.status, failure.reason)
        except _Stopping:
            raise
        except Exception as failure:  # no answer: the shards are still checked and taken this round
            log.warning("member lease %s: %s", self.member, failure)

    def _live_members(self, items: dict[str, JsonObject], now: float) -> tuple[int, dict[str, int]]:
        """How many replicas are live (this one too), and the others' identities (with a zero shard count)."""
        others: dict[str, int] = {}
        for name, lease in items.items():
            role = role_of(lease)
            holder = holder_of(lease)
            duration = duration_of(lease, self.duration)
            if role == "member" and name != self.member and holder and now - self._seen[name][1] < duration:
                others[holder] = 0
        return 1 + len(others), others

    def _renew_shards(self) -> None:
        """Renew the held shards that are due, each with the resourceVersion this replica last wrote (or last
        listed under its own name): a 409 means another replica wrote the Lease since, and the shard is lost. Each
        is sent once first; those that got a 429, a 5xx or no answer are then sent again within their validity
        (one shard's retries do not hold the others' first sends)."""
        once = replace(self.retrying, policy=replace(self.retrying.policy, max_retries=0), counts=RetryCounts())
        now, renewed = self.clock(), self._renewed
        names = {i: shard_lease_name(self.prefix, i, self.shards) for i in self.tenures.kept()}
        due = [i for i, name in names.items() if renewed.get(name, -1e9) + self.renew_every <= now]
        for index, failure in [(i, self._renew_shard(i, once)) for i in due]:  # every first send before any retry
            if failure is not None and reason_of(Failure(int(failure.status or 0))) is not None:
                self._renew_shard(index, self.retrying, failure)

    def _renew_shard(self, index: int, retrying: Retrying, after: ApiException | None = None) -> ApiException | None:
        """One shard's renewal (`after`: what its first send met); the failure it ended with, if any."""
        name = shard_lease_name(self.prefix, index, self.shards)
        if self.tenures.left(index) <= 0:  # ran out during this round (renewals before it hanging)
            self._lose(index, "lapsed without a renewal")
            return None
        body = self._body(name, "shard", self.identity, self._versions.get(name), False)
        write = functools.partial(self._write, name, body, False)
        try:
            sent = renew(write, self.tenures, index, retrying, self.renew_timeout, after)
        except Lapsed:
            self._lose(index, "lapsed without a renewal")
            return None
        except ApiException as failure:
            if failure.status in (404, 409):
                self._lose(index, "conflict on renewal" if failure.status == 409 else "deleted")
                return None
            log.warning("renewing %s: %s %s", name, failure.status, failure.reason)
            if self.tenures.left(index) <= 0:
                self._lose(index, "renewal failed until the lease lapsed")
            return failure
        except _Stopping:
            raise
        except Exception as failure:  # no answer (a timeout, a refused connection): the other shards still renew
            log.warning("renewing %s: %s", name, failure)
            return None
        if sent is not None:
            self._renewed[name] = sent
            self.tenures.renewed(index, sent + self.duration - self.margin)
        return None

    def _check_shards(self, items: dict[str, JsonObject]) -> None:
        """After the list: a held shard whose Lease another replica holds (or nobody does) is lost, and so is one
        whose validity ran out while the list was on the wire (it must be taken back in a new term, not renewed
        as if held all along). The version listed under this replica's name is the one the next renewal sends
        (a renewal whose answer was lost may have landed)."""
        for index in self.tenures.kept():
            name = shard_lease_name(self.prefix, index, self.shards)
            lease = items.get(name)
            holder = holder_of(lease)
            if lease is None or holder != self.identity:
                self._lose(index, f"taken by {holder or 'nobody'}")
                continue
            self._versions[name] = version_of(lease)
            if self.tenures.left(index) <= 0:
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
        if self.tenures.cleared:  # `stop` cleared the Leases while this write was on the wire: give it back
            with contextlib.suppress(ApiException):
                self._clear(name)
            return
        self._acquired(index, sent)

    def _acquired(self, index: int, sent: float) -> None:
        """The shard's Lease was taken by a write sent at `sent` (monotonic): a new term begins."""
        self._renewed[shard_lease_name(self.prefix, index, self.shards)] = sent
        self.tenures.begin(index, sent + self.duration - self.margin)
        self._note(index, "acquired")

    def _finish_releases(self, now: float) -> None:
        for index in self.tenures.due_releases(now):
            name = shard_lease_name(self.prefix, index, self.shards)
            with contextlib.suppress(ApiException):
                self._clear(name)
            self.tenures.released(index)
            self._note(index, "released")

    def _clear(self, name: str) -> None:
        version = self._versions.get(name)
        self._write(name, self._body(name, "shard", None, version, False), False)

    def _expire(self) -> None:
        """Held shards whose validity ran out without a renewal (the API unreachable, a renewal timing out) are
        lost: a transition like any other, so their pools' daemons are woken and stop reporting them now, and a
        shard taken back later starts a new term. Runs first in every round, before anything that can fail."""
        for index in self.tenures.lapsed(self.clock()):
            self._lose(index, "lapsed without a renewal")

    def _lose(self, index: int, why: str) -> None:
        self.tenures.end(index)
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
