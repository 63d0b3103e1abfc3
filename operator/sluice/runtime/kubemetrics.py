"""The operator's Kubernetes requests sent again, as Prometheus counters: read at scrape time from the adapters'
`RetryCounts` (the passes' `KubeCluster`, and with shards the Lease thread's), registered by
`sluice.runtime.handlers.startup`. Series (operator-wide; `client` is `passes` or `leases`, `reason` is
`throttled` (a 429), `server_error` (a 5xx) or `no_answer` (a timeout, a reset connection)):
| metric | type | meaning |
|---|---|---|
| `sluice_kube_retries_total{client,reason}` | counter | requests sent again |
| `sluice_kube_retry_wait_seconds_total{client,reason}` | counter | time waited before sending them again |
| `sluice_kube_retries_given_up_total{client,reason}` | counter | retryable failures not sent again (the deadline |
| | | or the limit reached): each a `ClusterError`, a write's `IstioSynced=False (WriteFailed)` as before |
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from sluice.io.kubereads import RetryCounts


class KubeRetries(Collector):
    def __init__(self, counts: Mapping[str, RetryCounts]) -> None:
        self.counts = counts
        """client -> its counts."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        labels = ["client", "reason"]
        retries = CounterMetricFamily("sluice_kube_retries", "Kubernetes requests sent again.", labels=labels)
        waited = CounterMetricFamily(
            "sluice_kube_retry_wait_seconds", "Time waited before sending Kubernetes requests again.", labels=labels
        )
        gave_up = CounterMetricFamily(
            "sluice_kube_retries_given_up", "Retryable Kubernetes failures not sent again.", labels=labels
        )
        for client, counts in self.counts.items():
            sent, seconds, given = counts.totals()
            for reason, value in sent.items():
                retries.add_metric([client, reason], value)
            for reason, total in seconds.items():
                waited.add_metric([client, reason], total)
            for reason, value in given.items():
                gave_up.add_metric([client, reason], value)
        yield retries
        yield waited
        yield gave_up
