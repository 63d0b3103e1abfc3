"""Prometheus I/O: run a pool's preset queries and turn the answers into signals, sharing each answer.

One namespace-wide vector query per signal (built by `sluice.core.presets`), shared by every pool of the namespace
that renders the same query within its interval and split by pod (see `PromIO`), run concurrently with the
pool's timeout, bearer token and CA bundle over a session of `sluice.io.promtransport` (one retry on a dropped
connection or a 502, none after a timeout), the answers read by `sluice.io.promanswers`. Every
failure is kept per signal (`SignalSnapshot.failed`), so the core freezes weights and the pool says why: a
failed, slow or partial answer is never read as zero.
Called by the reconciler, in a worker thread (the client is blocking).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import tempfile
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

from sluice.api.v1alpha1 import InferencePoolSpec
from sluice.core.observed import CheckAnswers, SeriesAnswer, SignalName, SignalSnapshot
from sluice.core.presets import CheckPlan, build_queries, check_every, check_queries, names_pods
from sluice.io.ports import PromAuth
from sluice.io.promanswers import values_snapshot, vector_values
from sluice.io.promtransport import (
    QUERY_FAILURES,
    Transport,
    TransportKey,
    ask,
    close_session,
    describe_failure,
    open_transport,
)

log = logging.getLogger("sluice")

MAX_BACKOFF_SECONDS = 60.0
"""The longest wait before a failing shared query is asked again (it doubles from one interval)."""

REFRESH_AFTER = 0.5
"""Share of the asking pool's interval after which a shared answer is asked again, ahead of the passes that will
read it: about two queries per (namespace, URL, signal) per interval and, while a query takes less than half an
interval, a pool's next pass (one interval on) reads an answer asked since its previous pass. A query with a
single reader is asked once per interval instead, just before that reader's next pass (`LEAD`)."""
LEAD = 0.2
"""A query read by one pool alone, once per interval, is asked again this share of the interval (or twice its
last answer's time, if longer) before that pool's next pass is due: one query per signal per interval, and the
pass reads an answer a fifth of an interval old instead of up to half of one."""
LONE_GAP = 0.9
"""A query has a single reader when one pool interval reads it, its last two reads at least this share of the
interval apart (a pool's passes are one interval apart; a second pool, or a wake-up, reads in between)."""
WANTED_FOR = 2.0
"""Intervals a query keeps being refreshed after the last pass that read it (a deleted pool's queries stop)."""
SLOW_SHARE = 0.5
"""A query that took more than this share of its timeout is logged (with its size): the warning before pools
freeze on timeouts."""
EXTEND_GAP = 0.5
"""Seconds at least between two queries asked to take in pods a scoped answer was not asked for (or twice the
query's last answer time, if longer): the pools a replica starts or takes over within that time wait for one
query, not one each, and a slow Prometheus is not asked faster than it answers."""
_EXTEND = object()
"""Marks a heap entry as the start of a scoped query's extension (`PromIO._extend`)."""

SWEEP_EVERY = 60.0
"""Seconds between sweeps of old answers and idle sessions (done by the pass that comes next)."""
IDLE_CLIENT_SECONDS = 600.0
"""A session (its keep-alive connections, its CA file) no query has used for this long is closed: what a rotated
CA bundle or a changed timeout leaves behind."""

FRESHNESS_KEY = "sampleTime"
"""Name under which the freshness query's failure is reported (it is not a signal)."""


def _outcome(done: Future[dict[str, float]], timeout: float) -> dict[str, float] | BaseException:
    """A shared answer, or its failure as a value, waiting up to `timeout`.

    Never `done.result()` on a failed answer: re-raising the one stored exception in every pass that reads it
    prepends each pass's frames to its traceback, which kept every such pass (its status, spec and report)
    alive for as long as the answer was kept — the operator grew by ~15 MB/s at 1000 pools while Prometheus
    timed out.
    """
    try:
        failure = done.exception(timeout=timeout)
    except TimeoutError as waited:
        return waited
    return failure if failure is not None else done.result()


@dataclass
class _Answer:
    """One query's answer, split by pod, shared by the pools that render the same query."""

    asked_at: datetime
    """The `now` of the pass that asked (the time its pools' signals are from)."""
    monotonic: float
    done: Future[dict[str, float]]
    """Pod -> value (`pod_values`)."""
    took: float = 0.0
    """Seconds from asking to the answer (set when it is done)."""
    covers: frozenset[str] | None = None
    """The pods it was asked for (scoped queries); None: every pod of the namespace."""

    def serves(self, pods: frozenset[str] | None) -> bool:
        """Whether it was asked for every pod in `pods` (None: a namespace-wide reader, served by anything)."""
        return pods is None or self.covers is None or pods <= self.covers


@dataclass
class _Backoff:
    """A shared query's run of failures: when it may be asked again."""

    failures: int
    retry_at: float


Fetch = Callable[[frozenset[str] | None], dict[str, float]]
_Memo = TypeVar("_Memo", bound=tuple[Any, ...])
_Plan = TypeVar("_Plan")
"""Asks one query: for the given pods (scoped), or namespace-wide (None); its answer split by pod."""


@dataclass
class _Wanted:
    """A query some pass read: how to ask it again, and when it was last read."""

    fetch: Fetch
    ttl: float
    """The shortest interval among the pools that read it recently (`readers`)."""
    readers: dict[float, float]
    """Interval -> when a pool with that interval last read it (monotonic): a deleted 1 s pool stops
    setting the pace once it has not read for `WANTED_FOR` of its interval."""
    read_now: datetime
    """The `now` of the last pass that read it; with `read_at`, what the refresher's asking time maps to."""
    read_at: float
    read_before: float | None = None
    """The read before the last one (monotonic): with `readers`, whether one pool alone reads it (`LONE_GAP`)."""
    scope: dict[frozenset[str], tuple[float, float]] | None = None
    """Scoped queries: each pod set a pass read it for -> (when, that pool's interval); the query asks for their
    union (with the pods of every pool the process runs, `PromIO(owned=...)`), a set kept while read within
    `WANTED_FOR` of its interval. None: namespace-wide."""
    namespace: str = ""

    def pods(self) -> frozenset[str] | None:
        """The pods to ask for now (None: namespace-wide)."""
        return None if self.scope is None else frozenset().union(*self.scope)

    def prune(self, at: float) -> None:
        """Forget the pod sets not read within `WANTED_FOR` of their interval (a pool gone, or a pod set that
        changed): a replica stops asking for the pods of pools it no longer runs."""
        if self.scope is not None:
            self.scope = {p: seen for p, seen in self.scope.items() if at - seen[0] <= WANTED_FOR * seen[1]}

    @property
    def lone(self) -> bool:
        return (
            len(self.readers) == 1
            and self.read_before is not None
            and self.read_at - self.read_before >= LONE_GAP * self.ttl
        )


PASS_PLANS = 8192
"""Pools' rendered queries kept (`PromIO._pass_plan`); past it they are all rendered anew."""


@dataclass(frozen=True)
class _PassPlan:
    unsupported: tuple[SignalName, ...]
    freshness: bool
    """Whether the engine has a freshness query (`FRESHNESS_KEY` in `queries`)."""
    queries: dict[str, str]
    """Signal name (and `FRESHNESS_KEY`) -> the namespace-wide query."""
    own: frozenset[str]
    """The keys of `queries` over the pool's own pods (`$pods`): never asked for other pods."""
    pods: tuple[str, ...] | None
    """The pods `queries` name (when `own`): rendered again when they change."""


class Clock(Protocol):
    """`PromIO`'s time: when answers were asked, when queries are due, how long the refresher sleeps."""

    def now(self) -> float:
        """Seconds, monotonic."""

    def wait(self, condition: threading.Condition, seconds: float) -> None:
        """Wait on `condition` (its lock held) until notified or `seconds` of this clock have passed."""


class MonotonicClock:
    """The process's monotonic clock."""

    def now(self) -> float:
        return time.monotonic()

    def wait(self, condition: threading.Condition, seconds: float) -> None:
        condition.wait(timeout=seconds)


class PromIO:
    """Prometheus sessions per (URL, CA bundle, TLS verification, timeout), whatever the bearer token, reused
    across passes, and answers shared across pools.

    The token is sent with each query, not kept in the session: a projected service-account token re-read
    every hour, or a Secret that changed, goes out over the same keep-alive connections, and pools with other
    tokens for one Prometheus share them without sending each other's. Each distinct CA bundle is written once
    to a temporary file, removed when no session uses it any more (`close`, or a session idle for
    `IDLE_CLIENT_SECONDS`). Answers stay per token: a pool never reads what another pool's credentials fetched.

    Pools of one namespace with the same metrics settings render the same namespace-wide queries
    (`build_queries(..., namespace_wide=True)`). The first pass to need a query runs it (and waits for it); the
    answer, split by pod, serves every pass that needs the same query (same URL, credentials, timeout, pod
    label). A refresher thread asks each query again once its answer is `REFRESH_AFTER` of the reading pool's
    `interval` old, while passes still read it (`WANTED_FOR`), so Prometheus sees about two queries per
    (namespace, URL, signal) per interval, not one per pool, and (while a query takes less than half an interval)
    a pool's next pass reads an answer asked since its previous one; a query one pool alone reads is asked once
    per interval, `LEAD` before that pool's next pass. No pass waits behind a refresh: while the
    next answer is being asked, passes read the previous one if it succeeded within `staleAfter` (at 1000 pools,
    eight worker threads waiting for a slow Prometheus were the operator's whole throughput). A pass waits only
    when there is no such answer: the first, or after nobody read the query for `WANTED_FOR` intervals.
    A failed query is asked again once per backoff, not by every pass: one interval after the first failure,
    doubling with each further one up to `MAX_BACKOFF_SECONDS`, a success ending it. Meanwhile passes use
    the last good answer while it was asked within the pool's `staleAfter`, and otherwise report the failure
    (each pool freezes its weights and says why, as it would have alone) without waiting for the retry.
    Signals judged from a shared answer carry the time it was asked (`collected_at`), and freshness comes from
    the samples' own timestamps, never later than that time, so sharing or falling back never makes old data
    look new.
    """

    def __init__(
        self,
        max_workers: int = 4,
        scoped: bool = False,
        owned: Callable[[str], Collection[str]] | None = None,
        preflight: bool = True,
        clock: Clock | None = None,
    ) -> None:
        self.clock: Clock = clock or MonotonicClock()
        """Every time PromIO reads or waits on (a test's clock steps through intervals without sleeping)."""
        self.preflight = preflight
        """Ask the preflight's queries too (`CheckAnswers`, every `check_every` seconds per namespace)."""
        self.scoped = scoped or owned is not None
        """Ask for the pods of the pools that read a query, not for the whole namespace: what a replica owning a
        shard of the pools does, so N replicas do not each ask Prometheus for every pod (`read_signals`)."""
        self._owned = owned
        """Namespace -> the pods of the pools this process runs there (those that have not passed yet included):
        asked for as well, so that a replica starting with hundreds of pools asks once for all of them, not once
        for each handful whose passes came first (called from the query threads: it must be thread-safe)."""
        self._plans: dict[tuple[int, str, frozenset[str]], tuple[InferencePoolSpec, dict[str, str | None]]] = {}
        """Scoped queries as last rendered, per (spec, namespace, pods): the queries of a namespace are asked
        together for the same pods, and rendering a few thousand pod names costs milliseconds."""
        self._check_plans: dict[tuple[int, str], tuple[InferencePoolSpec, CheckPlan]] = {}
        """The preflight's queries as last rendered, per (spec, namespace)."""
        self._pass_plans: dict[tuple[int, str], tuple[InferencePoolSpec, _PassPlan]] = {}
        """A pool's namespace-wide queries as last rendered, per (spec, namespace, and its pods when a query names
        them): the same at every pass until the spec changes (rendering them was ~3 % of a 300-pool operator)."""
        self._transports: dict[TransportKey, Transport] = {}
        self._ca_files: dict[str, str] = {}
        """CA bundle -> the temporary file it was written to (one per bundle, whatever uses it)."""
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="sluice-prom")
        self._answers: dict[tuple[Any, ...], _Answer] = {}
        """The newest completed answer per query."""
        self._pending: dict[tuple[Any, ...], _Answer] = {}
        """The query being asked, per query."""
        self._good: dict[tuple[Any, ...], _Answer] = {}
        """The newest successful answer per query (what passes fall back on while it fails)."""
        self._backoff: dict[tuple[Any, ...], _Backoff] = {}
        """Queries whose last answer failed: not asked again before `retry_at`."""
        self._wanted: dict[tuple[Any, ...], _Wanted] = {}
        """Queries passes read, for the refresher."""
        self._next: dict[tuple[Any, ...], _Answer] = {}
        """Scoped queries to be asked again for pods their answers were not asked for, not sent yet (`_extend`)."""
        self._sent_at: dict[tuple[Any, ...], float] = {}
        """When each query was last sent (monotonic)."""
        self._owned_at: dict[str, tuple[float, frozenset[str]]] = {}
        """Namespace -> (when, the pods of the pools run here), for `_owned_pods`."""
        self._swept = self.clock.now()
        self.queries_sent = 0
        """Queries sent to Prometheus so far (all pools)."""
        self._wake = threading.Condition(self._lock)
        self._due: list[tuple[float, int, tuple[Any, ...]]] = []
        """A heap of (when, tiebreak, query): when the refresher looks at a query next (entries may be stale:
        checked when they come up)."""
        self._tiebreak = itertools.count()
        self._next_wake = math.inf
        self._closed = False
        self._refresher = threading.Thread(target=self._refresh_loop, name="sluice-prom-refresh", daemon=True)
        self._refresher.start()

    def in_flight(self) -> int:
        """Queries sent and not answered yet."""
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        """Stop the refresher and the queries, close every session and remove the CA files."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            transports, self._transports = list(self._transports.values()), {}
            files, self._ca_files = list(self._ca_files.values()), {}
        self._pool.shutdown(wait=False, cancel_futures=True)
        for transport in transports:
            close_session(transport.session)
        for path in files:
            Path(path).unlink(missing_ok=True)

    def _acquire(self, key: TransportKey) -> Transport:
        """The session for `key`, made on first use, marked busy until `_release`."""
        _, ca_pem, insecure, _ = key
        with self._lock:
            if self._closed:
                raise OSError("the Prometheus client is closed")
            transport = self._transports.get(key)
            if transport is None:
                verify = False if insecure else self._ca_file(ca_pem) if ca_pem else True
                transport = self._transports[key] = open_transport(key, verify)
            transport.busy += 1
            transport.used_at = self.clock.now()
            return transport

    def _release(self, transport: Transport) -> None:
        with self._lock:
            transport.busy -= 1
            transport.used_at = self.clock.now()

    def _query(self, key: TransportKey, token: str | None, query: str, pod_label: str) -> dict[str, float]:
        """One query over the session for `key`, with `token` as its bearer token (sent with the request, never
        kept in the shared session), its answer split by pod."""
        transport = self._acquire(key)
        headers = {"Authorization": f"Bearer {token}"} if token else None
        try:
            body = ask(transport, query, f"{key[3]:g}s", headers)
        finally:
            self._release(transport)
        return vector_values(body, pod_label)

    def _ca_file(self, pem: str) -> str:
        """The temporary file holding `pem`, written once per bundle (the lock is held)."""
        path = self._ca_files.get(pem)
        if path is None:
            with tempfile.NamedTemporaryFile("w", suffix=".pem", delete=False) as handle:
                handle.write(pem)
                path = handle.name
            self._ca_files[pem] = path
        return path

    def _close_idle(self, at: float) -> None:
        """Close the sessions no query used for `IDLE_CLIENT_SECONDS`, and remove the CA files no session uses
        any more (the lock is held)."""
        idle = [k for k, t in self._transports.items() if t.busy == 0 and at - t.used_at > IDLE_CLIENT_SECONDS]
        for key in idle:
            close_session(self._transports.pop(key).session)
        used = {t.ca_pem for t in self._transports.values()}
        for pem in [pem for pem in self._ca_files if pem not in used]:
            Path(self._ca_files.pop(pem)).unlink(missing_ok=True)

    def _shared(
        self,
        key: tuple[Any, ...],
        ttl: float,
        stale_after: float,
        now: datetime,
        fetch: Fetch,
        pods: frozenset[str] | None = None,
        namespace: str = "",
    ) -> _Answer:
        """The answer to `key` to use now.

        `pods`: a scoped read (`scoped`), for these pods: only an answer asked for all of them serves it; without
        one the query is asked now for every pod set read within `WANTED_FOR`, and the pass waits for it.

        `ttl` is the asking pool's interval. The newest answer serves while it is younger than `REFRESH_AFTER`
        of it; an older one is asked again now if the refresher has not yet (once; after a failure, not before
        its backoff) and serves meanwhile if it succeeded within `stale_after`. While the query fails, the last
        good answer serves if it was asked within `stale_after`, else the failure does. A pass waits only when
        there is no answer at all. Every answer carries the time it was asked, so reusing one never makes old
        data look new.
        """
        at = self.clock.now()
        with self._lock:
            if at - self._swept > SWEEP_EVERY:
                self._sweep(at)
            wanted = self._wanted.get(key)
            readers = {t: seen for t, seen in (wanted.readers if wanted else {}).items() if at - seen <= WANTED_FOR * t}
            readers[ttl] = at
            before = wanted.read_at if wanted is not None else None
            scope = None
            if pods is not None:
                # the same dict, updated in place: pruned when the query is sent (`_Wanted.prune`)
                scope = wanted.scope if wanted is not None and wanted.scope is not None else {}
                scope[pods] = (at, ttl)
            self._wanted[key] = _Wanted(fetch, min(readers), readers, now, at, before, scope, namespace)
            if wanted is None:
                self._schedule(key, self._due_at(key, at))
            answer = self._answers.get(key)
            backoff = self._backoff.get(key)
            if answer is not None and backoff is None and not answer.serves(pods):
                # asked for other pods: wait for a query asked for these too
                pending = self._pending.get(key)
                return pending if pending is not None and pending.serves(pods) else self._extend(key, now, at)
            if answer is not None and backoff is None and at - answer.monotonic < REFRESH_AFTER * ttl:
                return answer
            if backoff is None or at >= backoff.retry_at:
                pending = self._ask(key, now, at, pods)
            else:
                pending = self._pending.get(key)
            if backoff is not None and answer is not None:  # the last answer failed
                good = self._good.get(key)
                usable = good is not None and good.serves(pods) and at - good.monotonic <= stale_after
                return good if usable and good is not None else answer
            if answer is not None and at - answer.monotonic <= stale_after:
                return answer
            assert pending is not None  # no answer to use: one is being asked
            return pending

    def _ask(self, key: tuple[Any, ...], now: datetime, at: float, pods: frozenset[str] | None = None) -> _Answer:
        """The query being asked for `key`, starting it if none is (the lock is held). A scoped query asks for the
        union of the pod sets passes read it for; if the one being asked does not include `pods`, the pass waits
        for the next (`_extend`)."""
        pending = self._pending.get(key)
        if pending is not None and not pending.serves(pods):
            return self._extend(key, now, at)
        if pending is None:
            # an extension waiting to be sent is this query: its passes get this answer
            pending = self._next.pop(key, None) or _Answer(now, at, Future())
            self._send(key, pending, at)
        return pending

    def _send(self, key: tuple[Any, ...], answer: _Answer, at: float) -> None:
        """Ask `key` now for `answer`, for the pods wanted now (the lock is held)."""
        wanted = self._wanted[key]
        wanted.prune(at)
        covers = wanted.pods()
        if covers is not None and self._owned is not None:
            covers = covers | self._owned_pods(wanted.namespace, at)
        answer.monotonic, answer.covers = at, covers
        self._pending[key] = answer
        self._sent_at[key] = at
        self.queries_sent += 1
        self._pool.submit(self._fetch, key, answer, wanted.fetch, answer.covers, wanted.ttl)

    def _owned_pods(self, namespace: str, at: float) -> frozenset[str]:
        """The pods of the pools this process runs in `namespace`, asked at most once a second (the eight queries
        of a namespace are sent together); if asking fails, none (the pod sets passes read still count). The lock
        is held."""
        known = self._owned_at.get(namespace)
        if known is not None and at - known[0] < 1.0:
            return known[1]
        assert self._owned is not None
        try:
            pods = frozenset(self._owned(namespace))
        except Exception:  # never the refresher's end: the read pod sets are still asked for
            log.exception("listing the pods of the pools run here failed")
            pods = frozenset()
        self._owned_at[namespace] = (at, pods)
        return pods

    def _extend(self, key: tuple[Any, ...], now: datetime, at: float) -> _Answer:
        """The next scoped query for `key`, asked for every pod set read by then: sent when the query in flight
        (if any) has answered, and at least `EXTEND_GAP` (or twice the last answer's time) after the last one was
        sent, so one query per key is in flight at a time and passes that come meanwhile for pods not asked for
        yet wait for the same one (the lock is held)."""
        extension = self._next.get(key)
        if extension is None:
            extension = self._next[key] = _Answer(now, at, Future())
            if key not in self._pending:  # else `_fetch` schedules it when the query in flight answers
                self._schedule_extension(key, at)
        return extension

    def _schedule_extension(self, key: tuple[Any, ...], at: float) -> None:
        """Send the waiting extension of `key` now or when its gap is over (the lock is held)."""
        last = self._answers.get(key)
        gap = max(EXTEND_GAP, 2.0 * last.took if last is not None else 0.0)
        start = self._sent_at.get(key, -math.inf) + gap
        if start <= at:
            self._send(key, self._next.pop(key), at)
        else:
            heapq.heappush(self._due, (start, next(self._tiebreak), (_EXTEND, key)))
            if start < self._next_wake:
                self._wake.notify_all()

    def _due_at(self, key: tuple[Any, ...], at: float) -> float:
        """When `key` is to be asked again: at its backoff's end, or `REFRESH_AFTER` of its interval after its
        answer was asked (now, without one) — for a query one pool alone reads, not before `LEAD` ahead of that
        pool's next pass. The lock is held."""
        backoff, answer, wanted = self._backoff.get(key), self._answers.get(key), self._wanted.get(key)
        if backoff is not None:
            return backoff.retry_at
        if answer is None or wanted is None:
            return at
        due = answer.monotonic + REFRESH_AFTER * wanted.ttl
        if wanted.lone:
            lead = max(LEAD * wanted.ttl, 2.0 * answer.took)
            due = max(due, wanted.read_at + wanted.ttl - lead)
        return due

    def _schedule(self, key: tuple[Any, ...], due: float) -> None:
        """Look at `key` again at `due`, waking the refresher only if that is before its next wake-up (the lock
        is held)."""
        heapq.heappush(self._due, (due, next(self._tiebreak), key))
        if due < self._next_wake:
            self._wake.notify_all()

    def _refresh_loop(self) -> None:
        """Ask each query again once its answer is `REFRESH_AFTER` of its interval old, while passes read it.

        The queries due come off a heap, so one wake-up costs a few queries' work, not a walk over every query
        (8 per namespace): with a walk, a thousand namespaces' answers made the refresher hold the lock passes
        need for milliseconds at each of thousands of wake-ups a second.
        """
        with self._lock:
            while not self._closed:
                at = self.clock.now()
                while self._due and self._due[0][0] <= at:
                    _, _, key = heapq.heappop(self._due)
                    if key[0] is _EXTEND:
                        if key[1] in self._pending or key[1] not in self._next:
                            continue  # in flight again (it is scheduled when that answers), or already sent
                        extension = self._next.pop(key[1])
                        if key[1] in self._wanted:
                            self._send(key[1], extension, at)
                        else:  # never the case: a pass asked for it just now
                            extension.done.set_exception(OSError("the query is no longer read"))
                        continue
                    wanted = self._wanted.get(key)
                    if wanted is None or key in self._pending:
                        continue  # not read any more, or being asked: its answer schedules it again
                    if at - wanted.read_at > WANTED_FOR * wanted.ttl:
                        del self._wanted[key]
                        continue
                    due = self._due_at(key, at)
                    if due > at:
                        heapq.heappush(self._due, (due, next(self._tiebreak), key))  # a stale entry
                        continue
                    self._ask(key, wanted.read_now + timedelta(seconds=at - wanted.read_at), at)
                self._next_wake = min(self._due[0][0], at + 1.0) if self._due else at + 1.0
                self.clock.wait(self._wake, max(0.01, self._next_wake - at))

    def _fetch(
        self,
        key: tuple[Any, ...],
        answer: _Answer,
        fetch: Fetch,
        pods: frozenset[str] | None,
        ttl: float,
    ) -> None:
        try:
            values = fetch(pods)
            answer.took = self.clock.now() - answer.monotonic
            answer.done.set_result(values)
        except BaseException as failure:  # handed to every pass that waits for it
            answer.took = self.clock.now() - answer.monotonic
            answer.done.set_exception(failure)
        if answer.took > SLOW_SHARE * key[2]:
            scope = "the namespace" if pods is None else f"{len(pods)} pods by name"
            took, timeout, query = answer.took, key[2], key[4]
            log.warning("a Prometheus query for %s took %.1f s (timeout %g s): %.120s", scope, took, timeout, query)
        with self._lock:
            self._answers[key] = answer  # the newest: one query per key is in flight at a time
            if self._pending.get(key) is answer:
                del self._pending[key]
            if answer.done.exception() is None:
                self._good[key] = answer
                self._backoff.pop(key, None)
            else:
                failures = self._backoff[key].failures + 1 if key in self._backoff else 1
                wait = min(ttl * 2 ** (failures - 1), max(ttl, MAX_BACKOFF_SECONDS))
                self._backoff[key] = _Backoff(failures, self.clock.now() + wait)
            if key in self._wanted:
                self._schedule(key, self._due_at(key, self.clock.now()))
            if key in self._next and key not in self._pending:  # pods waited for while this was in flight
                self._schedule_extension(key, self.clock.now())

    def _last_good(self, key: tuple[Any, ...], stale_after: float, pods: frozenset[str] | None) -> _Answer | None:
        """The newest successful answer to `key` if it was asked within `stale_after` seconds (for `pods`)."""
        with self._lock:
            good = self._good.get(key)
        if good is None or not good.serves(pods):
            return None
        return good if self.clock.now() - good.monotonic <= stale_after else None

    def _sweep(self, at: float) -> None:
        self._swept = at
        for key in [k for k, a in self._answers.items() if a.done.done() and at - a.monotonic > 600]:
            del self._answers[key]
            self._backoff.pop(key, None)
        for key in [k for k, a in self._good.items() if at - a.monotonic > 600]:
            del self._good[key]
        for key in [k for k, sent in self._sent_at.items() if at - sent > 600]:
            del self._sent_at[key]
        self._close_idle(at)

    def _recall(
        self, store: dict[_Memo, tuple[InferencePoolSpec, _Plan]], memo: _Memo, spec: InferencePoolSpec
    ) -> _Plan | None:
        """What was rendered for `spec` under `memo`, if it is still that spec's."""
        with self._lock:
            known = store.get(memo)
        return known[1] if known is not None and known[0] is spec else None

    def _keep(
        self,
        store: dict[_Memo, tuple[InferencePoolSpec, _Plan]],
        memo: _Memo,
        spec: InferencePoolSpec,
        plan: _Plan,
        limit: int,
    ) -> _Plan:
        """Remember `plan` for `spec` (the spec is kept: its id is not reused while it is here), `limit` at most."""
        with self._lock:
            if len(store) >= limit:
                store.clear()
            store[memo] = (spec, plan)
        return plan

    def _scoped_queries(self, spec: InferencePoolSpec, namespace: str, pods: frozenset[str]) -> dict[str, str | None]:
        """The pool's queries (by signal name, and the freshness query) for `pods` by name, rendered once per
        (spec, namespace, pods)."""
        memo = (id(spec), namespace, pods)
        known = self._recall(self._plans, memo, spec)
        if known is not None:
            return known
        plan = build_queries(spec, namespace, sorted(pods), by_pod=True)
        rendered: dict[str, str | None] = {str(name): text for name, text in plan.queries.items()}
        rendered[FRESHNESS_KEY] = plan.freshness
        return self._keep(self._plans, memo, spec, rendered, 16)

    def _pass_plan(self, spec: InferencePoolSpec, namespace: str, pod_names: list[str]) -> _PassPlan:
        """The pool's queries for a pass (`build_queries(..., namespace_wide=True)`), rendered once per spec and
        namespace (and pods, when a query names them)."""
        memo = (id(spec), namespace)
        known = self._recall(self._pass_plans, memo, spec)
        if known is not None and (known.pods is None or known.pods == tuple(sorted(pod_names))):
            return known
        built = build_queries(spec, namespace, pod_names, namespace_wide=True)
        queries: dict[str, str] = {str(name): query for name, query in built.queries.items()}
        if built.freshness is not None:
            queries[FRESHNESS_KEY] = built.freshness
        # a query over the pool's own pods (`$pods`) stays its own: never asked for other pods
        own = frozenset(signal for signal in queries if names_pods(spec, signal))
        pods = tuple(sorted(pod_names)) if own else None  # sorted, as the query names them
        plan = _PassPlan(built.unsupported, built.freshness is not None, queries, own, pods)
        return self._keep(self._pass_plans, memo, spec, plan, PASS_PLANS)

    def read_signals(
        self, spec: InferencePoolSpec, namespace: str, pod_names: list[str], auth: PromAuth, now: datetime
    ) -> SignalSnapshot:
        plan = self._pass_plan(spec, namespace, pod_names)
        metrics = spec.metrics
        ca_pem = None if auth.insecure_skip_verify else auth.ca_pem
        transport: TransportKey = (metrics.prometheus_url, ca_pem, auth.insecure_skip_verify, metrics.timeout)
        pods = frozenset(pod_names) if self.scoped else None

        def runner(signal: str, query: str) -> Fetch:
            def fetch(scope: frozenset[str] | None) -> dict[str, float]:
                if scope is not None:  # the same query, for the pods of the pools that read it
                    scoped = self._scoped_queries(spec, namespace, scope)
                    return self._query(transport, auth.bearer_token, scoped.get(signal) or query, metrics.pod_label)
                return self._query(transport, auth.bearer_token, query, metrics.pod_label)

            return fetch

        queries = plan.queries
        keys = {
            signal: (metrics.prometheus_url, auth, metrics.timeout, metrics.pod_label, query)
            for signal, query in queries.items()
        }
        scope = {signal: None if signal in plan.own else pods for signal in queries}
        asked = {
            signal: self._shared(
                keys[signal],
                spec.interval,
                metrics.stale_after,
                now,
                runner(signal, query),
                scope[signal],
                namespace,
            )
            for signal, query in queries.items()
        }
        answers: dict[str, dict[str, float]] = {}
        answered_at: dict[str, datetime] = {}
        failed: dict[str, str] = {}
        collected_at = now
        for signal, asking in asked.items():
            answer = asking
            outcome = _outcome(answer.done, metrics.timeout + 2)
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, QUERY_FAILURES):
                    raise RuntimeError(f"reading {signal} failed: {outcome!r}") from outcome
                fallback = self._last_good(keys[signal], metrics.stale_after, scope[signal])
                if fallback is None:
                    failed[signal] = describe_failure(outcome)
                    continue
                answer, by_pod = fallback, fallback.done.result()
            else:
                by_pod = outcome
            answers[signal] = {pod: by_pod[pod] for pod in pod_names if pod in by_pod}
            answered_at[signal] = answer.asked_at
            collected_at = min(collected_at, answer.asked_at)
        freshness = answers.pop(FRESHNESS_KEY, None) if plan.freshness else None
        if plan.freshness and freshness is None:
            freshness = {}  # the freshness query failed: it is in `failed`, which freezes the pool
        signal_answers = {cast(SignalName, name): series for name, series in answers.items()}
        snapshot = values_snapshot(signal_answers, failed, plan.unsupported, set(pod_names), collected_at, freshness)
        answered_at.pop(FRESHNESS_KEY, None)
        checks = self._read_checks(spec, namespace, pod_names, auth, now, runner)
        return snapshot.model_copy(update={"answered_at": answered_at, "checks": checks})

    def _check_plan(self, spec: InferencePoolSpec, namespace: str) -> CheckPlan:
        """The preflight's queries for the pool's namespace, rendered once per spec and namespace."""
        memo = (id(spec), namespace)
        known = self._recall(self._check_plans, memo, spec)
        return (
            known
            if known is not None
            else self._keep(self._check_plans, memo, spec, check_queries(spec, namespace), PASS_PLANS)
        )

    def _read_checks(
        self,
        spec: InferencePoolSpec,
        namespace: str,
        pod_names: list[str],
        auth: PromAuth,
        now: datetime,
        runner: Callable[[str, str], Fetch],
    ) -> CheckAnswers | None:
        """The preflight's answers: asked like the signals' (shared by the namespace's pools), but refreshed every
        `check_every` seconds, namespace-wide, and never freezing the pool when they fail (each says why)."""
        plan = self._check_plan(spec, namespace)
        if not self.preflight or (not plan.series and plan.samples is None):
            return None
        metrics = spec.metrics
        parts: dict[tuple[str, str], str] = {}
        for name, (identity, newest) in plan.series.items():
            parts[(name, "identity")], parts[(name, "newest")] = identity, newest
        if plan.samples is not None:
            parts[("", "samples")] = plan.samples
        keys = {
            part: (metrics.prometheus_url, auth, metrics.timeout, metrics.pod_label, query)
            for part, query in parts.items()
        }
        every = check_every(spec)
        asked = {
            part: self._shared(keys[part], every, 3 * every, now, runner("check", query), None, namespace)
            for part, query in parts.items()
        }
        mine = set(pod_names)
        values: dict[tuple[str, str], dict[str, float]] = {}
        failed: dict[tuple[str, str], str] = {}
        asked_at = now
        for part, asking in asked.items():
            answer, outcome = asking, _outcome(asking.done, metrics.timeout + 2)
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, QUERY_FAILURES):
                    raise RuntimeError(f"the preflight's query failed: {outcome!r}") from outcome
                fallback = self._last_good(keys[part], 3 * every, None)
                if fallback is None:
                    failed[part] = describe_failure(outcome)
                    continue
                answer, outcome = fallback, fallback.done.result()
            values[part] = {pod: value for pod, value in outcome.items() if pod in mine}
            asked_at = min(asked_at, answer.asked_at)
        series = [
            SeriesAnswer(
                name=name,
                per_identity=values.get((name, "identity"), {}),
                newest=values.get((name, "newest"), {}),
                failed=failed.get((name, "identity")) or failed.get((name, "newest")),
            )
            for name in plan.series
        ]
        return CheckAnswers(
            asked_at=asked_at,
            series=series,
            samples_per_window=values.get(("", "samples"), {}),
            failed=failed.get(("", "samples")),
        )


__all__ = ["FRESHNESS_KEY", "PromAuth", "PromIO"]
