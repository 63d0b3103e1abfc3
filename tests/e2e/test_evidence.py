"""Evidence on the local stack: a Prometheus that still answers from old samples, and HTTP failures vLLM-style.

The model servers' `/metrics` is made to stall (the last exposition served again with its original sample
timestamps, as a stuck exporter or a lagging federation does). The real Prometheus keeps answering every query
with those old samples and writes no staleness marker, so only the samples' own timestamps can tell.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sluice.devstack.kubelet import PodSpec
from sluice.devstack.stack import Stack
from sluice.devstack.traffic import Traffic
from tests.e2e.conftest import (
    Background,
    condition,
    operator_stack,
    pool_manifest,
    rows,
    running_traffic,
    wait_until,
)

pytestmark = pytest.mark.slow
PODS = [
    PodSpec("llama-a100-0", "a100", "v1", "127.0.23.1"),
    PodSpec("llama-a100-1", "a100", "v1", "127.0.23.2"),
    PodSpec("llama-cpu-0", "cpu", "v1", "127.0.23.3"),
]


def apply_pool(stack: Stack) -> None:
    manifest = pool_manifest(stack).replace("staleAfter: 15s", "staleAfter: 6s")
    stack.kubectl("apply", "-f", "-", stdin=manifest)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, background: Background) -> Iterator[Stack]:
    yield from operator_stack(Path(tmp_path_factory.mktemp("evidence")), background, PODS, setup=apply_pool)


@pytest.fixture(scope="module")
def traffic(stack: Stack, background: Background) -> Iterator[Traffic]:
    yield from running_traffic(stack, background, rate=8.0)


def pool(stack: Stack) -> dict[str, Any]:
    return stack.pool("llama")


def weights(stack: Stack) -> dict[str, int]:
    return {name: row["weight"] for name, row in rows(pool(stack)).items()}


def inject_all(stack: Stack, background: Background, faults: dict[str, Any]) -> None:
    for spec in PODS:
        background.start(stack.inject(spec.name, faults)).result(timeout=10)


def test_stalled_scraping_is_stale_even_though_prometheus_answers(
    stack: Stack, traffic: Traffic, background: Background
) -> None:
    wait_until(
        lambda: (
            condition(pool(stack), "MetricsAvailable")["status"] == "True"
            and all(w > 0 for w in weights(stack).values())
        ),
        60,
        "every pod routable on fresh metrics",
    )
    inject_all(stack, background, {"stallMetrics": True})
    try:
        stale = wait_until(
            lambda: condition(pool(stack), "MetricsAvailable")["reason"] == "Stale" and pool(stack),
            30,
            "MetricsAvailable=False (Stale) while Prometheus still answers",
        )
        assert "scraping has stalled" in condition(stale, "MetricsAvailable")["message"]
        # Prometheus does answer: the gauges are still there, with their old timestamps.
        answer = stack.prometheus_query('max by (pod) (vllm:num_requests_running{namespace="llm"})')
        assert {series["metric"]["pod"] for series in answer} == {spec.name for spec in PODS}
        before = weights(stack)
        wait_until(
            lambda: pool(stack)["status"]["lastReconcileTime"] > stale["status"]["lastReconcileTime"], 10, "a pass"
        )
        assert weights(stack) == before
        assert stack.events("MetricsUnavailable")
    finally:
        inject_all(stack, background, {"stallMetrics": False})
    wait_until(lambda: condition(pool(stack), "MetricsAvailable")["status"] == "True", 30, "fresh again")


def test_http_failures_are_seen_although_vllm_does_not_count_them_as_finished(
    stack: Stack, traffic: Traffic, background: Background
) -> None:
    background.start(stack.inject("llama-a100-1", {"errorRate": 0.6})).result(timeout=10)
    try:
        zeroed = wait_until(
            lambda: rows(pool(stack))["llama-a100-1"]["state"] == "Zeroed" and pool(stack), 40, "the failing pod zeroed"
        )
        row = rows(zeroed)["llama-a100-1"]
        assert row["incident"] == "ErrorRate"
        errors = stack.prometheus_query(
            'sum by (pod) (vllm:request_success_total{namespace="llm",pod="llama-a100-1",finished_reason="error"})'
        )
        assert errors == []  # the engine never saw them: only the HTTP counters did
    finally:
        background.start(stack.inject("llama-a100-1", {"errorRate": 0.0})).result(timeout=10)
