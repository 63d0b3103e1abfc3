"""Prometheus I/O: run a pool's preset queries and turn the answers into signals, sharing each answer.

One namespace-wide vector query per signal (rendered by `sluice.io.promqueries` from `sluice.core.presets`),
shared by every pool of the namespace that renders the same query within its interval and split by pod (the
policy is `sluice.io.promshare`'s; `PromIO` runs it), run concurrently with the pool's timeout, bearer token and
CA bundle over a session of `sluice.io.promtransport` (one retry on a dropped connection or a 502, none after a
timeout), the answers read by `sluice.io.promanswers`. Every failure is kept per signal
(`SignalSnapshot.failed`), so the core freezes weights and the pool says why: a failed, slow or partial answer
is never read as zero.
Called by the reconciler, in a worker thread (the client is blocking).
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Hashable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timedelta
from pathlib import Path
from typing import NamedTuple, Protocol, TypeVar

from sluice.api.v1alpha1 import InferencePoolSpec
from sluice.core.observed import CheckAnswers, SeriesAnswer, SignalSnapshot
from sluice.core.presets import CheckPlan, check_every
from sluice.io.ports import PromAuth
from sluice.io.promanswers import values_snapshot, vector_values
from sluice.io.promqueries import FRESHNESS_KEY, QueryPlans
from sluice.io.promrecords import Answer, QueryKey, Reading, Send
from sluice.io.promshare import SharedAnswers
from sluice.io.promtransport import (
    QUERY_FAILURES,
    Transport,
    TransportKey,
    ask,
    close_session,
    describe_failure,
    open_transport,
    unreached,
)

log = logging.getLogger("sluice")

SLOW_SHARE = 0.5
"""A query that took more than this share of its timeout is logged (with its size): the warning before pools
freeze on timeouts."""
SWEEP_EVERY = 60.0
"""Seconds between sweeps of old answers and idle sessions (done by the pass that comes next)."""
IDLE_CLIENT_SECONDS = 600.0
"""A session (its keep-alive connections, its CA file) no query has used for this long is closed: what a rotated
CA bundle or a changed timeout leaves behind."""


def _asked_before(now: datetime, at: float, answer: Answer) -> datetime:
    """When `answer` was asked, on the clock of the pass whose `now` is read at monotonic `at`: its age by the
    monotonic clock. Its own `asked_at` is on the wall clock of the pass that asked, and a step of the wall clock
    since (an NTP step, a skewed node put right) would age it by the step: 30 s forward made every pool's
    signals read as 30 s old, stale, their weights frozen (the chaos matrix's clock-skew cases)."""
    return now - timedelta(seconds=max(0.0, at - answer.monotonic))


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


class _Got(NamedTuple):
    """A query's answer as a pass reads it: when it was asked (the asking pass's `now`: which answer it is), pod
    -> value, and when it was asked on this pass's clock (`_asked_before`: how old it is)."""

    asked_at: datetime
    values: dict[str, float]
    aged_from: datetime


_Part = TypeVar("_Part", bound=Hashable)


def _check_parts(plan: CheckPlan) -> dict[tuple[str, str], str]:
    """The preflight's queries by (series key, "identity" or "newest"), and ("", "samples")."""
    parts: dict[tuple[str, str], str] = {}
    for name, (identity, newest) in plan.series.items():
        parts[(name, "identity")], parts[(name, "newest")] = identity, newest
    if plan.samples is not None:
        parts[("", "samples")] = plan.samples
    return parts


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
    doubling to two intervals (`LONGEST_BACKOFF`), a success ending it. Meanwhile passes use
    the last good answer while it was asked within the pool's `staleAfter`, and otherwise report the failure
    (each pool freezes its weights and says why, as it would have alone) without waiting for the retry.
    Signals judged from a shared answer carry the time it was asked (`collected_at`), and freshness comes from
    the samples' own timestamps, never later than that time, so sharing or falling back never makes old data
    look new. Those decisions are `sluice.io.promshare.SharedAnswers`'; PromIO runs the queries it sends and
    its refresher, on its clock.
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
        self._plans = QueryPlans()
        self._transports: dict[TransportKey, Transport] = {}
        self._ca_files: dict[str, str] = {}
        """CA bundle -> the temporary file it was written to (one per bundle, whatever uses it)."""
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="sluice-prom")
        self._shares = SharedAnswers(self._submit, self._wake.notify_all, owned, unreached)
        """The shared answers and their policy (`owned`: namespace -> the pods of the pools this process runs
        there, those that have not passed yet included, asked for as well so that a replica starting with
        hundreds of pools asks once for all of them, not once for each handful whose passes came first; called
        from the query threads: it must be thread-safe)."""
        self._swept = self.clock.now()
        self.queries_sent = 0
        """Queries sent to Prometheus so far (all pools)."""
        self._closed = False
        self._refresher = threading.Thread(target=self._refresh_loop, name="sluice-prom-refresh", daemon=True)
        self._refresher.start()

    def in_flight(self) -> int:
        """Queries sent and not answered yet."""
        with self._lock:
            return self._shares.in_flight()

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
        with self._lock:
            if self._closed:
                raise OSError("the Prometheus client is closed")
            transport = self._transports.get(key)
            if transport is None:
                verify = False if key.insecure else self._ca_file(key.ca_pem) if key.ca_pem else True
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
            body = ask(transport, query, f"{key.timeout:g}s", headers)
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

    def _shared(self, reading: Reading, now: datetime) -> Answer:
        """The answer to `reading`'s query to use now (`SharedAnswers.read`), sweeping first when it is time."""
        at = self.clock.now()
        with self._lock:
            if at - self._swept > SWEEP_EVERY:
                self._sweep(at)
            return self._shares.read(reading, now, at)

    def _submit(self, send: Send) -> None:
        """Ask a query on a query thread (the lock is held)."""
        self.queries_sent += 1
        self._pool.submit(self._fetch, send)

    def _refresh_loop(self) -> None:
        """Ask each query again once its answer is `REFRESH_AFTER` of its interval old, while passes read it
        (`SharedAnswers.refresh`), sleeping on the clock until the next is due or a pass wakes it."""
        with self._lock:
            while not self._closed:
                at = self.clock.now()
                next_wake = self._shares.refresh(at)
                self.clock.wait(self._wake, max(0.01, next_wake - at))

    def _fetch(self, send: Send) -> None:
        """Run one query (on a query thread) and hand its answer, or its failure, to the passes that wait for it."""
        answer = send.answer
        try:
            values = send.fetch(send.pods)
            answer.took = self.clock.now() - answer.monotonic
            answer.done.set_result(values)
        except BaseException as failure:  # handed to every pass that waits for it
            answer.took = self.clock.now() - answer.monotonic
            answer.done.set_exception(failure)
        if answer.took > SLOW_SHARE * send.key.timeout:
            scope = "the namespace" if send.pods is None else f"{len(send.pods)} pods by name"
            took, timeout, query = answer.took, send.key.timeout, send.key.query
            log.warning("a Prometheus query for %s took %.1f s (timeout %g s): %.120s", scope, took, timeout, query)
        with self._lock:
            self._shares.answered(send.key, answer, send.ttl, self.clock.now())

    def _last_good(self, reading: Reading) -> Answer | None:
        """The newest successful answer to `reading`'s query if it was asked within its `stale_after`."""
        with self._lock:
            return self._shares.last_good(reading.key, reading.stale_after, reading.pods, self.clock.now())

    def _sweep(self, at: float) -> None:
        self._swept = at
        self._shares.forget_old(at)
        self._close_idle(at)

    def _reading(
        self,
        spec: InferencePoolSpec,
        namespace: str,
        auth: PromAuth,
        signal: str,
        query: str,
        ttl: float,
        stale_after: float,
        pods: frozenset[str] | None = None,
    ) -> Reading:
        """`query` of the pool's `signal` as a shared reading: asked with the pool's URL, credentials, timeout
        and pod label, namespace-wide or (scoped) as the same query for the pods of the pools that read it."""
        metrics = spec.metrics
        ca_pem = None if auth.insecure_skip_verify else auth.ca_pem
        transport = TransportKey(metrics.prometheus_url, ca_pem, auth.insecure_skip_verify, metrics.timeout)

        def fetch(scope: frozenset[str] | None) -> dict[str, float]:
            if scope is not None:  # the same query, for the pods of the pools that read it
                scoped = self._plans.scoped(spec, namespace, scope)
                return self._query(transport, auth.bearer_token, scoped.get(signal) or query, metrics.pod_label)
            return self._query(transport, auth.bearer_token, query, metrics.pod_label)

        key = QueryKey(metrics.prometheus_url, auth, metrics.timeout, metrics.pod_label, query)
        return Reading(key, fetch, ttl, stale_after, pods, namespace)

    def _read_all(
        self, readings: Mapping[_Part, Reading], now: datetime, timeout: float, fault: str
    ) -> tuple[dict[_Part, _Got], dict[_Part, str]]:
        """Ask every reading's query (shared) first, then wait for each answer: a failed one is read from the
        last good answer within the reading's `stale_after`, else its failure is described. A failure no query
        fails with is a fault, raised (`fault`, formatted with the part, says what failed)."""
        asked = {part: self._shared(reading, now) for part, reading in readings.items()}
        got: dict[_Part, _Got] = {}
        failed: dict[_Part, str] = {}
        at = self.clock.now()
        for part, answer in asked.items():
            outcome = _outcome(answer.done, timeout + 2)
            if not isinstance(outcome, BaseException):
                got[part] = _Got(answer.asked_at, outcome, _asked_before(now, at, answer))
                continue
            if not isinstance(outcome, QUERY_FAILURES):
                raise RuntimeError(f"{fault.format(part)}: {outcome!r}") from outcome
            fallback = self._last_good(readings[part])
            if fallback is None:
                failed[part] = describe_failure(outcome)
            else:
                got[part] = _Got(fallback.asked_at, fallback.done.result(), _asked_before(now, at, fallback))
        return got, failed

    def read_signals(
        self, spec: InferencePoolSpec, namespace: str, pod_names: list[str], auth: PromAuth, now: datetime
    ) -> SignalSnapshot:
        plan = self._plans.for_pass(spec, namespace, pod_names)
        interval, stale_after = spec.interval, spec.metrics.stale_after
        pods = frozenset(pod_names) if self.scoped else None
        readings = {
            signal: self._reading(
                spec, namespace, auth, signal, query, interval, stale_after, None if signal in plan.own else pods
            )
            for signal, query in plan.queries.items()
        }
        got, failed = self._read_all(readings, now, spec.metrics.timeout, "reading {} failed")
        answers = {signal: {pod: g.values[pod] for pod in pod_names if pod in g.values} for signal, g in got.items()}
        collected_at = min([now, *(g.aged_from for g in got.values())])
        freshness = answers.pop(FRESHNESS_KEY, None) if plan.freshness else None
        if plan.freshness and freshness is None:
            freshness = {}  # the freshness query failed: it is in `failed`, which freezes the pool
        fresh_at = got[FRESHNESS_KEY].aged_from if FRESHNESS_KEY in got else collected_at
        signal_answers = {signal: answers[signal] for signal in plan.signals if signal in answers}
        snapshot = values_snapshot(
            signal_answers, failed, plan.unsupported, set(pod_names), collected_at, freshness, fresh_at
        )
        answered_at = {signal: g.asked_at for signal, g in got.items() if signal != FRESHNESS_KEY}
        checks = self._read_checks(spec, namespace, pod_names, auth, now)
        return snapshot.model_copy(update={"answered_at": answered_at, "checks": checks})

    def _read_checks(
        self, spec: InferencePoolSpec, namespace: str, pod_names: list[str], auth: PromAuth, now: datetime
    ) -> CheckAnswers | None:
        """The preflight's answers: asked like the signals' (shared by the namespace's pools), but refreshed every
        `check_every` seconds, namespace-wide, and never freezing the pool when they fail (each says why)."""
        plan = self._plans.checks(spec, namespace)
        if not self.preflight or (not plan.series and plan.samples is None):
            return None
        every = check_every(spec)
        readings = {
            part: self._reading(spec, namespace, auth, "check", query, every, 3 * every)
            for part, query in _check_parts(plan).items()
        }
        got, failed = self._read_all(readings, now, spec.metrics.timeout, "the preflight's query failed")
        mine = set(pod_names)
        values = {part: {pod: value for pod, value in g.values.items() if pod in mine} for part, g in got.items()}
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
            asked_at=min([now, *(g.aged_from for g in got.values())]),
            series=series,
            samples_per_window=values.get(("", "samples"), {}),
            failed=failed.get(("", "samples")),
        )


__all__ = ["PromAuth", "PromIO"]
