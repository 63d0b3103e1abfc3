"""The operator's own Prometheus metrics (prometheus-client), updated from each pass's report.

Series (labelled by `pool` = namespace/name unless marked operator-wide; see docs/metrics.md for cardinality):
| metric | type | meaning |
|---|---|---|
| `sluice_reconcile_duration_seconds` | histogram | operator-wide: time of one pass (observe, plan, apply, status) |
| `sluice_reconcile_last_duration_seconds` | gauge | time of the pool's last pass |
| `sluice_reconcile_total{result}` | counter | passes: `ok`, `invalid_spec`, `error` |
| `sluice_pass_lag_seconds` | histogram | operator-wide: how late passes started after they were due |
| `sluice_pass_queue_seconds` | histogram | operator-wide: time passes waited for a worker thread |
| `sluice_pass_lag_last_seconds` | gauge | how late the pool's last pass started |
| `sluice_last_pass_timestamp_seconds` | gauge | when the pool's last pass started (status written or not) |
| `sluice_pools_behind` | gauge | operator-wide: pools whose last pass started more than one interval late |
| `sluice_prometheus_query_seconds` | histogram | operator-wide: time to read a pool's signals |
| `sluice_prometheus_query_errors_total{signal}` | counter | failed queries, per signal |
| `sluice_metrics_available` | gauge | 1 when signals are fresh, 0 when weights are frozen |
| `sluice_endpoint_weight{pod,revision}` | gauge | published endpoint weight (0 = removed) |
| `sluice_endpoints{state}` | gauge | pods per state: Routable, Zeroed, Recovering |
| `sluice_endpoint_inbound_limit{pod}` | gauge | the pod's admission limit (admission Report or Enforce, if any) |
| `sluice_endpoint_rate_limit{pod}` | gauge | the pod's admitted rate in req/s, split among the tenants (if any) |
| `sluice_canary_weight` / `sluice_canary_step` | gauge | candidate traffic % / step index (-1 without a rollout) |
| `sluice_canary_phase{phase}` | gauge | 1 for the current phase (the canary series: pools with `status.canary` only) |
| `sluice_istio_writes_total{kind,action}` | counter | Istio writes: created, updated, unchanged (skipped), |
| | | refused, pruned, restored |
| `sluice_status_writes_total{result}` | counter | per pass: `written`, `skipped` (nothing changed), `deferred` |
| | | (only observations moved, the refresh not due), `failed` |
| `sluice_events_total{reason}` | counter | Kubernetes Events emitted |
| `sluice_gc_pause_seconds_total{generation}` | counter | operator-wide: time Python's garbage collector held |
| | | the process, per generation (`sluice_gc_collections_total` counts them) |
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator, Mapping
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from sluice.api.v1alpha1 import InferencePoolStatus
from sluice.runtime.report import PassReport

PHASES = ("Idle", "Waiting", "Shadow", "Progressing", "Paused", "Promoted", "RolledBack")
STATES = ("Routable", "Zeroed", "Recovering")


class GcPauses(Collector):
    """Time spent in Python's cyclic garbage collector, per generation, from `gc.callbacks`.

    A collection stops every thread; a full one walks every tracked object (at 1000 pools about a million), so
    what the operator keeps alive shows here first. The callback only adds to plain numbers (it may run while a
    metric's lock is held by the thread that triggered the collection); they are read at scrape time.
    """

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._started: dict[int, float] = {}

    def callback(self, phase: str, info: Mapping[str, int]) -> None:
        ident = threading.get_ident()
        if phase == "start":
            self._started[ident] = time.perf_counter()
            return
        started = self._started.pop(ident, None)
        generation = int(info.get("generation", 2))
        if started is not None and 0 <= generation <= 2:
            self.seconds[generation] += time.perf_counter() - started
            self.collections[generation] += 1

    def install(self) -> None:
        if self.callback not in gc.callbacks:
            gc.callbacks.append(self.callback)

    def uninstall(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self.callback)

    def collect(self) -> Iterator[CounterMetricFamily]:
        seconds = CounterMetricFamily(
            "sluice_gc_pause_seconds", "Time the garbage collector held the process.", labels=["generation"]
        )
        count = CounterMetricFamily("sluice_gc_collections", "Garbage collections.", labels=["generation"])
        for generation in range(3):
            seconds.add_metric([str(generation)], self.seconds[generation])
            count.add_metric([str(generation)], self.collections[generation])
        yield seconds
        yield count


class _Recorded(NamedTuple):
    """What `_record_status` last set for a pool."""

    available: float | None
    rows: tuple[tuple[str, str, int, int | None, float | None], ...]
    states: tuple[int, ...]
    canary_weight: int
    canary_step: int
    phase: str | None
    refused: float | None = None


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, pod_series: bool = True) -> None:
        r = registry or CollectorRegistry()
        self.registry = r
        self._pass_series(r)
        self._signal_series(r)
        self._routing_series(r)
        self._write_series(r)
        self._pods: dict[str, set[tuple[str, str]]] = {}
        self._limited: dict[str, set[str]] = {}
        self._rated: dict[str, set[str]] = {}
        """Pool -> the pods with an admission limit on the page."""
        self._recorded: dict[str, _Recorded] = {}
        """Pool -> what `_record_status` last set: a pass that changed none of it sets nothing (the labelled
        children cost ~30 lookups a pass, ~5 % of a 1000-pool operator's CPU)."""
        self._behind: set[str] = set()
        self._canaries: set[str] = set()
        """Pools whose canary series are on the page."""
        self.pod_series = pod_series

    def _pass_series(self, r: CollectorRegistry) -> None:
        """The passes: their time, how late they started, how long they queued."""
        # Operator-wide, as the lag: 13 series per pool were the largest part of a 1000-pool page, rendered anew
        # at every scrape. The pool's own last pass is one gauge.
        self.duration = Histogram(
            "sluice_reconcile_duration_seconds",
            "One reconcile pass.",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.last_duration = Gauge(
            "sluice_reconcile_last_duration_seconds", "The pool's last reconcile pass.", ["pool"], registry=r
        )
        self.passes = Counter("sluice_reconcile", "Reconcile passes.", ["pool", "result"], registry=r)
        lag_buckets = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        # Operator-wide (no pool label): how the process keeps up is one distribution, and 1000 pools x 14 series
        # each would dominate the page. The pool that is behind is in `sluice_pass_lag_last_seconds{pool}`.
        self.pass_lag = Histogram(
            "sluice_pass_lag_seconds", "How late passes started after they were due.", registry=r, buckets=lag_buckets
        )
        self.queue_wait = Histogram(
            "sluice_pass_queue_seconds", "Time passes waited for a worker thread.", registry=r, buckets=lag_buckets
        )
        self.lag_last = Gauge(
            "sluice_pass_lag_last_seconds", "How late the pool's last pass started.", ["pool"], registry=r
        )
        self.last_pass = Gauge(
            "sluice_last_pass_timestamp_seconds",
            "When the pool's last pass started (Unix time), status written or not.",
            ["pool"],
            registry=r,
        )
        self.behind = Gauge(
            "sluice_pools_behind", "Pools whose last pass started more than one interval late.", registry=r
        )

    def _signal_series(self, r: CollectorRegistry) -> None:
        """Reading the signals from Prometheus."""
        self.query_seconds = Histogram(
            "sluice_prometheus_query_seconds",
            "Reading a pool's signals (shared answers included).",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.query_errors = Counter(
            "sluice_prometheus_query_errors", "Failed Prometheus queries.", ["pool", "signal"], registry=r
        )
        self.metrics_available = Gauge(
            "sluice_metrics_available", "1: signals fresh; 0: weights frozen.", ["pool"], registry=r
        )

    def _routing_series(self, r: CollectorRegistry) -> None:
        """What the pool routes: weights, pods per state, the canary."""
        self.weight = Gauge(
            "sluice_endpoint_weight", "Published endpoint weight (0: removed).", ["pool", "pod", "revision"], registry=r
        )
        self.endpoints = Gauge("sluice_endpoints", "Pods per state.", ["pool", "state"], registry=r)
        self.inbound_limit = Gauge(
            "sluice_endpoint_inbound_limit",
            "The pod's admission limit (status.endpoints[].inboundLimit): requests its sidecar lets through at once.",
            ["pool", "pod"],
            registry=r,
        )
        self.rate_limit = Gauge(
            "sluice_endpoint_rate_limit",
            "The pod's admitted rate (status.endpoints[].rateLimit, admission.tenants): requests/s its sidecar "
            "admits, split among the tenants.",
            ["pool", "pod"],
            registry=r,
        )
        self.refused_rate = Gauge(
            "sluice_pool_refused_rate",
            "Requests/s the pool's sidecars refused, as read from Istio (status.admission.refusedRate, admission "
            "Enforce); absent while unknown.",
            ["pool"],
            registry=r,
        )
        self.canary_weight = Gauge("sluice_canary_weight", "Candidate traffic percentage.", ["pool"], registry=r)
        self.canary_step = Gauge("sluice_canary_step", "Canary step index (-1: no rollout).", ["pool"], registry=r)
        self.canary_phase = Gauge(
            "sluice_canary_phase", "1 for the current canary phase.", ["pool", "phase"], registry=r
        )

    def _write_series(self, r: CollectorRegistry) -> None:
        """What the passes wrote: Istio objects, statuses, Events."""
        self.istio_writes = Counter(
            "sluice_istio_writes", "Istio object writes.", ["pool", "kind", "action"], registry=r
        )
        self.status_writes = Counter("sluice_status_writes", "Status writes.", ["pool", "result"], registry=r)
        self.events = Counter("sluice_events", "Kubernetes Events emitted.", ["pool", "reason"], registry=r)

    def record(self, report: PassReport, gauges: bool = True) -> None:
        """Update every series from one pass's report; `gauges` False: its counters and histograms only (a pass
        whose shard went away: what it did is counted here, the pool's state is no longer this replica's)."""
        pool = report.pool
        self.duration.observe(report.seconds)
        if gauges:
            self.last_duration.labels(pool).set(report.seconds)
        self.passes.labels(pool, report.result).inc()
        if report.prometheus_seconds is not None:
            self.query_seconds.observe(report.prometheus_seconds)
        for signal in report.signal_failures:
            self.query_errors.labels(pool, signal).inc()
        for write in report.writes:
            self.istio_writes.labels(pool, write.kind, write.action).inc()
        self.status_writes.labels(pool, report.status_outcome).inc()
        for event in report.events:
            self.events.labels(pool, event.reason).inc()
        if report.status is not None and gauges:
            self._record_status(pool, report.status)

    def _record_status(self, pool: str, status: InferencePoolStatus) -> None:
        metrics = next((c for c in status.conditions if c.type == "MetricsAvailable"), None)
        available = None if metrics is None else 1.0 if metrics.status == "True" else 0.0
        rows = (
            tuple(
                (row.pod, row.revision or "", row.weight, row.inbound_limit, row.rate_limit) for row in status.endpoints
            )
            if self.pod_series
            else ()
        )
        states = tuple(sum(1 for row in status.endpoints if row.state == state) for state in STATES)
        canary = status.canary
        step = canary.step_index if canary else None
        recorded = _Recorded(
            available,
            rows,
            states,
            canary.weight if canary else 0,
            -1 if step is None else step,
            canary.phase if canary else None,
            status.admission.refused_rate if status.admission else None,
        )
        if self._recorded.get(pool) == recorded:
            return
        self._recorded[pool] = recorded
        if available is not None:
            self.metrics_available.labels(pool).set(available)
        seen = {(pod, revision) for pod, revision, *_ in rows}
        for pod, revision in self._pods.get(pool, set()) - seen:
            self.weight.remove(pool, pod, revision)
        self._pods[pool] = seen
        for pod, revision, weight, *_ in rows:
            self.weight.labels(pool, pod, revision).set(weight)
        _set_per_pod(self.inbound_limit, self._limited, pool, {pod: limit for pod, _, _, limit, _ in rows})
        _set_per_pod(self.rate_limit, self._rated, pool, {pod: rate for pod, _, _, _, rate in rows})
        for state, count in zip(STATES, states, strict=True):
            self.endpoints.labels(pool, state).set(count)
        if recorded.refused is None:
            _remove([(self.refused_rate, (pool,))])
        else:
            self.refused_rate.labels(pool).set(recorded.refused)
        if canary is None:  # no canary (or no longer): no canary series, 9 per pool
            self._forget_canary(pool)
            return
        self._canaries.add(pool)
        self.canary_weight.labels(pool).set(recorded.canary_weight)
        self.canary_step.labels(pool).set(recorded.canary_step)
        for phase in PHASES:
            self.canary_phase.labels(pool, phase).set(1.0 if recorded.phase == phase else 0.0)

    def _forget_canary(self, pool: str) -> None:
        if pool not in self._canaries:
            return
        self._canaries.discard(pool)
        labelled: list[tuple[Gauge, tuple[str, ...]]] = [(self.canary_weight, (pool,)), (self.canary_step, (pool,))]
        labelled += [(self.canary_phase, (pool, phase)) for phase in PHASES]
        _remove(labelled)

    def timing(self, pool: str, lag: float, queued: float, interval: float, started_at: float) -> None:
        """A pass's start: `lag` seconds after it was due, `queued` of them waiting for a worker thread."""
        lag = max(0.0, lag)
        self.pass_lag.observe(lag)
        self.queue_wait.observe(max(0.0, queued))
        self.lag_last.labels(pool).set(lag)
        self.last_pass.labels(pool).set(started_at)
        if lag > interval:
            self._behind.add(pool)
        else:
            self._behind.discard(pool)
        self.behind.set(len(self._behind))

    def forget(self, pool: str) -> None:
        """Drop the pool's gauges (its counters and histograms stay: rates over them stay right)."""
        for pod, revision in self._pods.pop(pool, set()):
            self.weight.remove(pool, pod, revision)
        for gauge, series in ((self.inbound_limit, self._limited), (self.rate_limit, self._rated)):
            _set_per_pod(gauge, series, pool, {})
            del series[pool]
        self._recorded.pop(pool, None)
        self._behind.discard(pool)
        self.behind.set(len(self._behind))
        gauges = (self.lag_last, self.last_pass, self.metrics_available, self.last_duration, self.refused_rate)
        labelled: list[tuple[Gauge, tuple[str, ...]]] = [(gauge, (pool,)) for gauge in gauges]
        labelled += [(self.endpoints, (pool, state)) for state in STATES]
        _remove(labelled)
        self._forget_canary(pool)


def _set_per_pod(gauge: Gauge, series: dict[str, set[str]], pool: str, values: dict[str, float | None]) -> None:
    """A per-pod gauge only for the pods with a value: the others' series removed (`series`: pool -> pods that
    have one)."""
    present = {pod: value for pod, value in values.items() if value is not None}
    for pod in series.get(pool, set()) - set(present):
        gauge.remove(pool, pod)
    series[pool] = set(present)
    for pod, value in present.items():
        gauge.labels(pool, pod).set(value)


def _remove(labelled: list[tuple[Gauge, tuple[str, ...]]]) -> None:
    for gauge, labels in labelled:
        with contextlib.suppress(KeyError):
            gauge.remove(*labels)
