"""What the operator's `/metrics` page costs at N steady pools: its series, its size, and CPU per scrape.

Every pool records the same steady pass (`bench_pass.py`'s 16-pod pool over an in-memory cluster: weights,
states, the ServiceEntry left unchanged, the status written or deferred), as `OperatorMetrics` does in the
operator after each pass; then the page is rendered (`prometheus_client.generate_latest`, what a scrape runs)
`--scrapes` times and the median CPU time per render is reported, with and without the per-pod series
(`--no-pod-metrics`), without `_created` series as in the operator. No canary, no failed query, no Event: the
steady floor of the page.

    PYTHONPATH=operator:benchmarks python benchmarks/bench_metrics_page.py --pools 1000
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import bench_pass
from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest

from sluice.core.observed import ObservedPod
from sluice.io.memory import MemoryCluster
from sluice.runtime.metrics import OperatorMetrics
from sluice.runtime.reconciler import Reconciler
from sluice.runtime.report import PassReport
from sluice.runtime.snapshots import SnapshotReader


def steady_reports(passes: int = 20) -> list[PassReport]:
    """A few steady passes of the benchmark pool (the first ones create; the later ones are steady)."""
    labels = {"app": "p", "sluice.dev/hardware-class": "a100", "sluice.dev/revision": "v1"}
    pods = [ObservedPod(name=f"p-{i:02d}", ip=f"10.0.0.{i + 1}", labels=labels) for i in range(bench_pass.PODS)]
    signals = bench_pass.Signals(seed=1)
    reconciler = Reconciler(MemoryCluster(pod_list=pods), signals)
    body = {"metadata": {"name": "p", "namespace": "bench", "uid": "u1", "generation": 1}, "spec": bench_pass.SPEC}
    reader = SnapshotReader()
    now = datetime(2026, 12, 1, tzinfo=UTC)
    reports = []
    for _ in range(passes):
        reports.append(reconciler.run(reader.read(body, reconciler.written_at("u1")), now))
        now += timedelta(seconds=5)
    return reports[-5:]


def page(pools: int, pod_series: bool, reports: list[PassReport]) -> tuple[int, int, float, list[float]]:
    """(series, bytes, seconds to build, CPU seconds per render) for `pools` pools having run `reports`."""
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry, pod_series=pod_series)
    started = time.process_time()
    for index in range(pools):
        pool = f"bench/pool-{index:04d}"
        for report in reports:
            metrics.record(replace(report, pool=pool))
            metrics.timing(pool, 0.05, 0.0, 5.0, time.time())
    built = time.process_time() - started
    renders = []
    text = b""
    for _ in range(ARGS.scrapes):
        began = time.process_time()
        text = generate_latest(registry)
        renders.append(time.process_time() - began)
    series = sum(1 for line in text.decode().splitlines() if line and not line.startswith("#"))
    return series, len(text), built, renders


def main() -> None:
    disable_created_metrics()  # type: ignore[no-untyped-call]  # as the operator does at start
    for pod_series in (True, False):
        series, size, _, renders = page(ARGS.pools, pod_series, steady_reports())
        label = "with per-pod series" if pod_series else "--no-pod-metrics"
        median = statistics.median(renders) * 1000
        print(
            f"{ARGS.pools} pools, {label}: {series} series, {size / 1024:.0f} KiB, "
            f"{median:.0f} ms of CPU per scrape (median of {len(renders)}; "
            f"{min(renders) * 1000:.0f}-{max(renders) * 1000:.0f}), {median * 1000 / series:.1f} µs per series"
        )


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--pools", type=int, default=1000)
parser.add_argument("--scrapes", type=int, default=7)
ARGS = parser.parse_args() if __name__ == "__main__" else parser.parse_args([])

if __name__ == "__main__":
    main()
