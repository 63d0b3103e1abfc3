"""The operator's own metrics, updated from a pass report."""

from __future__ import annotations

from prometheus_client import generate_latest

from sluice.api.v1alpha1 import AdmissionStatus, InferencePoolStatus
from sluice.core.events import Event
from sluice.io.ports import WriteResult
from sluice.runtime.metrics import OperatorMetrics
from sluice.runtime.report import PassReport


def report(rows: list[dict], **fields) -> PassReport:
    status = {
        "conditions": [
            {
                "type": "MetricsAvailable",
                "status": "False",
                "reason": "Stale",
                "lastTransitionTime": "2026-12-01T10:00:00Z",
            }
        ],
        "endpoints": rows,
        "canary": {"phase": "Progressing", "weight": 25, "stepIndex": 1},
    }
    return PassReport(pool="llm/llama", status=InferencePoolStatus.model_validate(status), seconds=0.012, **fields)


def value(metrics: OperatorMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_a_pass_report_becomes_series() -> None:
    metrics = OperatorMetrics()
    metrics.record(
        report(
            [
                {"pod": "a", "revision": "v1", "weight": 1000, "state": "Routable"},
                {"pod": "b", "revision": "v2", "weight": 0, "state": "Zeroed"},
            ],
            writes=[
                WriteResult("ServiceEntry", "sluice-llama", "updated"),
                WriteResult("VirtualService", "x", "unchanged"),
            ],
            events=[Event("Warning", "PodZeroed", "b: errors")],
            status_outcome="written",
            prometheus_seconds=0.004,
            signal_failures={"ttft": "timed out"},
        )
    )
    pool = {"pool": "llm/llama"}
    assert value(metrics, "sluice_reconcile_total", **pool, result="ok") == 1
    assert value(metrics, "sluice_endpoint_weight", **pool, pod="a", revision="v1") == 1000
    assert value(metrics, "sluice_endpoints", **pool, state="Zeroed") == 1
    assert value(metrics, "sluice_metrics_available", **pool) == 0
    assert value(metrics, "sluice_canary_weight", **pool) == 25
    assert value(metrics, "sluice_canary_phase", **pool, phase="Progressing") == 1
    assert value(metrics, "sluice_istio_writes_total", **pool, kind="VirtualService", action="unchanged") == 1
    assert value(metrics, "sluice_status_writes_total", **pool, result="written") == 1
    assert value(metrics, "sluice_events_total", **pool, reason="PodZeroed") == 1
    assert value(metrics, "sluice_prometheus_query_errors_total", **pool, signal="ttft") == 1
    assert b"sluice_reconcile_duration_seconds_bucket" in generate_latest(metrics.registry)


def test_pods_that_leave_the_pool_leave_the_weight_series() -> None:
    metrics = OperatorMetrics()
    metrics.record(
        report([{"pod": "a", "weight": 5, "state": "Routable"}, {"pod": "b", "weight": 7, "state": "Routable"}])
    )
    metrics.record(report([{"pod": "a", "weight": 5, "state": "Routable"}]))
    assert value(metrics, "sluice_endpoint_weight", pool="llm/llama", pod="b", revision="") is None
    assert value(metrics, "sluice_endpoint_weight", pool="llm/llama", pod="a", revision="") == 5


def test_pass_timing_is_operator_wide_and_counts_the_pools_that_are_behind() -> None:
    metrics = OperatorMetrics()
    metrics.timing("llm/a", lag=0.2, queued=0.1, interval=5.0, started_at=1000.0)
    metrics.timing("llm/b", lag=7.5, queued=6.0, interval=5.0, started_at=1001.0)
    assert value(metrics, "sluice_pools_behind") == 1
    assert value(metrics, "sluice_pass_lag_last_seconds", pool="llm/b") == 7.5
    assert value(metrics, "sluice_last_pass_timestamp_seconds", pool="llm/a") == 1000.0
    assert value(metrics, "sluice_pass_lag_seconds_count") == 2  # one histogram, however many pools
    metrics.timing("llm/b", lag=0.1, queued=0.0, interval=5.0, started_at=1006.0)
    assert value(metrics, "sluice_pools_behind") == 0
    metrics.timing("llm/a", lag=9.0, queued=0.0, interval=5.0, started_at=1010.0)
    metrics.forget("llm/a")
    assert value(metrics, "sluice_pools_behind") == 0
    assert value(metrics, "sluice_pass_lag_last_seconds", pool="llm/a") is None


def test_a_pass_started_early_counts_as_on_time_and_one_interval_late_is_not_yet_behind() -> None:
    """A wake-up before the pass was due (a pod restarted) gives a negative lag: 0, not a negative sample in the
    histogram; "behind" is a pass more than one interval late."""
    metrics = OperatorMetrics()
    metrics.timing("llm/a", lag=-1.0, queued=-0.5, interval=5.0, started_at=1000.0)
    assert value(metrics, "sluice_pass_lag_last_seconds", pool="llm/a") == 0.0
    assert value(metrics, "sluice_pass_lag_seconds_sum") == 0.0
    assert value(metrics, "sluice_pass_queue_seconds_sum") == 0.0
    metrics.timing("llm/a", lag=5.0, queued=0.0, interval=5.0, started_at=1005.0)
    assert value(metrics, "sluice_pools_behind") == 0
    metrics.timing("llm/a", lag=5.01, queued=0.0, interval=5.0, started_at=1010.0)
    assert value(metrics, "sluice_pools_behind") == 1


def test_per_pod_series_can_be_left_out() -> None:
    metrics = OperatorMetrics(pod_series=False)
    metrics.record(report([{"pod": "a", "weight": 5, "state": "Routable"}]))
    assert value(metrics, "sluice_endpoint_weight", pool="llm/llama", pod="a", revision="") is None
    assert value(metrics, "sluice_endpoints", pool="llm/llama", state="Routable") == 1


def test_a_pass_like_the_last_sets_nothing_new_and_the_next_change_shows() -> None:
    metrics = OperatorMetrics()
    steady = [{"pod": "a", "weight": 5, "state": "Routable"}, {"pod": "b", "weight": 7, "state": "Routable"}]
    metrics.record(report(steady))
    touched: list[tuple[str, ...]] = []
    for gauge in (metrics.weight, metrics.endpoints, metrics.metrics_available):
        labels = gauge.labels

        def spy(*names: str, _labels=labels, **named: str):  # type: ignore[no-untyped-def]
            touched.append(names)
            return _labels(*names, **named)

        gauge.labels = spy  # type: ignore[method-assign]
    metrics.record(report(steady))
    assert touched == []  # the same pass again: no gauge looked up, nothing set
    assert value(metrics, "sluice_endpoint_weight", pool="llm/llama", pod="b", revision="") == 7
    metrics.record(
        report([{"pod": "a", "weight": 5, "state": "Routable"}, {"pod": "b", "weight": 0, "state": "Zeroed"}])
    )
    assert value(metrics, "sluice_endpoint_weight", pool="llm/llama", pod="b", revision="") == 0
    assert value(metrics, "sluice_endpoints", pool="llm/llama", state="Zeroed") == 1
    assert value(metrics, "sluice_endpoints", pool="llm/llama", state="Routable") == 1
    metrics.record(report(steady))
    assert value(metrics, "sluice_endpoints", pool="llm/llama", state="Zeroed") == 0


def test_a_pool_forgotten_leaves_no_gauge_behind() -> None:
    """A deleted pool's gauges go (its pod weights went before; its state counts, canary and freshness stayed
    on the page for as long as the process ran)."""
    metrics = OperatorMetrics()
    metrics.record(report([{"pod": "a", "weight": 5, "state": "Routable"}]))
    metrics.timing("llm/llama", 0.1, 0.0, 5.0, 1_800_000_000.0)
    metrics.forget("llm/llama")
    page = generate_latest(metrics.registry).decode()
    gauges = (
        "sluice_endpoint",
        "sluice_canary",
        "sluice_metrics_available",
        "sluice_pass_lag_last",
        "sluice_last_pass",
        "sluice_reconcile_last",
    )
    left = [line for line in page.splitlines() if 'pool="llm/llama"' in line and line.startswith(gauges)]
    assert left == []
    metrics.record(report([{"pod": "a", "weight": 5, "state": "Routable"}]))  # the same pool again: set anew
    assert value(metrics, "sluice_endpoint_weight", pool="llm/llama", pod="a", revision="") == 5
    assert value(metrics, "sluice_endpoints", pool="llm/llama", state="Routable") == 1


def test_a_steady_pool_without_a_canary_costs_a_dozen_series_besides_its_pods() -> None:
    """The page is rendered at every scrape, series by series (15–17 µs each here): at 1000 pools the per-pool
    duration histogram (13 series) and the canary gauges of pools without a canary (9) were most of it."""
    metrics = OperatorMetrics()
    rows = [{"pod": f"p{i}", "revision": "v1", "weight": 100, "state": "Routable"} for i in range(16)]
    steady = report(rows, status_outcome="written")
    steady.status = steady.status.model_copy(update={"canary": None})
    metrics.record(steady)
    metrics.timing("llm/llama", 0.1, 0.0, 5.0, 1_800_000_000.0)
    page = generate_latest(metrics.registry).decode().splitlines()
    mine = [line for line in page if 'pool="llm/llama"' in line and not line.startswith("sluice_endpoint_weight")]
    assert len(mine) <= 12, mine
    assert not [line for line in mine if line.startswith("sluice_canary")]
    assert value(metrics, "sluice_reconcile_last_duration_seconds", pool="llm/llama") == 0.012
    assert value(metrics, "sluice_reconcile_duration_seconds_count") == 1  # operator-wide, whatever the pools


def test_a_canary_that_goes_takes_its_series_with_it() -> None:
    metrics = OperatorMetrics()
    metrics.record(report([{"pod": "a", "weight": 5, "state": "Routable"}]))
    assert value(metrics, "sluice_canary_weight", pool="llm/llama") == 25
    gone = report([{"pod": "a", "weight": 5, "state": "Routable"}])
    gone.status = gone.status.model_copy(update={"canary": None})
    metrics.record(gone)
    assert value(metrics, "sluice_canary_weight", pool="llm/llama") is None
    assert value(metrics, "sluice_canary_phase", pool="llm/llama", phase="Progressing") is None


def test_a_pods_admission_limit_is_a_series_while_it_has_one() -> None:
    metrics = OperatorMetrics()
    row = {"pod": "a", "weight": 5, "state": "Routable"}
    metrics.record(report([{**row, "inboundLimit": 30}, {"pod": "b", "weight": 7, "state": "Routable"}]))
    assert value(metrics, "sluice_endpoint_inbound_limit", pool="llm/llama", pod="a") == 30
    assert value(metrics, "sluice_endpoint_inbound_limit", pool="llm/llama", pod="b") is None  # none: no series
    metrics.record(report([row, {"pod": "b", "weight": 7, "state": "Routable"}]))  # admission turned off
    assert value(metrics, "sluice_endpoint_inbound_limit", pool="llm/llama", pod="a") is None
    metrics.record(report([{**row, "inboundLimit": 33}]))
    metrics.forget("llm/llama")
    assert value(metrics, "sluice_endpoint_inbound_limit", pool="llm/llama", pod="a") is None


def test_a_pods_admitted_rate_is_a_series_while_it_has_one() -> None:
    metrics = OperatorMetrics()
    row = {"pod": "a", "weight": 5, "state": "Routable"}
    metrics.record(report([{**row, "rateLimit": 24.5}, {"pod": "b", "weight": 7, "state": "Routable"}]))
    assert value(metrics, "sluice_endpoint_rate_limit", pool="llm/llama", pod="a") == 24.5
    assert value(metrics, "sluice_endpoint_rate_limit", pool="llm/llama", pod="b") is None
    metrics.record(report([row]))  # tenants removed from the pool
    assert value(metrics, "sluice_endpoint_rate_limit", pool="llm/llama", pod="a") is None
    metrics.record(report([{**row, "rateLimit": 20.0}]))
    metrics.forget("llm/llama")
    assert value(metrics, "sluice_endpoint_rate_limit", pool="llm/llama", pod="a") is None


def test_the_pools_refused_rate_is_a_series_only_while_known() -> None:
    metrics = OperatorMetrics()
    rows = [{"pod": "a", "weight": 5, "state": "Routable"}]
    counted = report(rows)
    counted.status = counted.status.model_copy(
        update={"admission": AdmissionStatus(refused_rate=1.5, served_rate=20.0, refused_share=1.5 / 21.5)}
    )
    metrics.record(counted)
    assert value(metrics, "sluice_pool_refused_rate", pool="llm/llama") == 1.5
    unknown = report(rows)
    unknown.status = unknown.status.model_copy(update={"admission": AdmissionStatus(uncounted=["a"])})
    metrics.record(unknown)  # one sidecar's count unread: no number, not the last one, not 0
    assert value(metrics, "sluice_pool_refused_rate", pool="llm/llama") is None
    metrics.record(counted)
    metrics.forget("llm/llama")
    assert value(metrics, "sluice_pool_refused_rate", pool="llm/llama") is None
