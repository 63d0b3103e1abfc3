"""The preflight on the local stack: a pod whose engine exports no engine metric (vLLM's --disable-log-stats) is
named, with the flag, in the SignalsReady condition, in `status.signalChecks` and by `kubectl sluice doctor`
(run by the real kubectl), from the operator's status and asked of Prometheus directly."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sluice.devstack.kubelet import PodSpec
from sluice.devstack.stack import Stack
from sluice.devstack.traffic import Traffic
from tests.e2e.conftest import Background, condition, operator_stack, pool_manifest, running_traffic, wait_until
from tests.e2e.test_plugin import kubectl_sluice

pytestmark = pytest.mark.slow
SILENT = "llama-silent-0"
PODS = [
    PodSpec("llama-a100-0", "a100", "v1", "127.0.26.1"),
    PodSpec("llama-a100-1", "a100", "v1", "127.0.26.2"),
    PodSpec(SILENT, "a100", "v1", "127.0.26.3", server_args=("--disable-log-stats",)),
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, background: Background) -> Iterator[Stack]:
    def apply(stack: Stack) -> None:
        stack.kubectl("apply", "-f", "-", stdin=pool_manifest(stack))

    yield from operator_stack(Path(tmp_path_factory.mktemp("doctor")), background, PODS, setup=apply)


@pytest.fixture(scope="module")
def traffic(stack: Stack, background: Background) -> Iterator[Traffic]:
    yield from running_traffic(stack, background, rate=6.0)


def signals_ready(stack: Stack) -> dict[str, Any]:
    return condition(stack.pool("llama"), "SignalsReady")


def test_a_pod_without_engine_metrics_is_named_with_the_flag_that_removed_them(stack: Stack, traffic: Traffic) -> None:
    ready = wait_until(
        lambda: (c := signals_ready(stack))["reason"] == "SeriesMissing" and c,
        90,
        "SignalsReady=False (SeriesMissing)",
        show=lambda: stack.pool("llama").get("status", {}).get("conditions"),
    )
    assert ready["status"] == "False"
    assert SILENT in ready["message"]
    assert "vllm:num_requests_waiting" in ready["message"]
    checks = {c["signal"]: c for c in stack.pool("llama")["status"]["signalChecks"]["signals"]}
    for signal in ("ttft", "kvCacheUsage", "queueLength", "runningRequests", "requestRate"):
        assert checks[signal]["state"] == "Missing", checks[signal]
        assert checks[signal]["pods"] == [SILENT]
        assert checks[signal]["podsOk"] == 2
        assert "--disable-log-stats" in checks[signal]["fix"]
    # its HTTP answers are still counted: the error rate has a series for every pod
    assert checks["errorRate"]["state"] == "Ok", checks["errorRate"]
    assert checks["loraFailureRate"]["message"].startswith("query override")  # the pool's own query
    # the pod has no engine sample: nothing to route it on
    assert SILENT in condition(stack.pool("llama"), "Degraded")["message"]


def test_kubectl_sluice_doctor_prints_the_finding_and_the_fix(stack: Stack, traffic: Traffic) -> None:
    wait_until(lambda: signals_ready(stack)["reason"] == "SeriesMissing", 90, "the preflight's finding")
    shown = kubectl_sluice(stack, "doctor", "llama", "-n", "llm")
    assert shown.returncode == 1, shown.stderr  # SignalsReady is not True
    assert "status.signalChecks" in shown.stdout
    assert "queueLength: Missing: no vllm:num_requests_waiting for llama-silent-0" in shown.stdout
    assert "fix: vLLM exports it unless started with --disable-log-stats" in shown.stdout
    assert "SignalsReady=False (SeriesMissing)" in shown.stdout


def test_doctor_asks_a_prometheus_the_user_names_and_finds_the_same(stack: Stack, traffic: Traffic) -> None:
    missing = "queueLength: Missing: no vllm:num_requests_waiting for llama-silent-0"

    def ask() -> subprocess.CompletedProcess[str] | None:
        # run alone, Prometheus may not have scraped the pods yet: doctor then says so instead
        answer = kubectl_sluice(stack, "doctor", "llama", "-n", "llm", "--prometheus", stack.prometheus_url)
        return answer if missing in answer.stdout else None

    asked = wait_until(ask, 30, "doctor naming the silent pod's missing series")
    assert asked.returncode == 1, asked.stderr
    assert f"asked {stack.prometheus_url} now" in asked.stdout
    unreachable = kubectl_sluice(stack, "doctor", "llama", "-n", "llm", "--prometheus", "http://127.0.0.1:9")
    assert unreachable.returncode == 1
    assert unreachable.stderr.startswith("error: Prometheus at http://127.0.0.1:9 did not answer")


def test_once_every_pod_exports_its_series_signals_are_ready_and_doctor_exits_0(stack: Stack, traffic: Traffic) -> None:
    """Runs last: without the silent pod the preflight's next round finds every series (within check_every, 15 s
    at the demo pool's 2 s interval, and the answer's reuse)."""
    stack.delete_pod(SILENT)
    ready = wait_until(
        lambda: (c := signals_ready(stack))["status"] == "True" and c,
        90,
        "SignalsReady=True once the silent pod is gone",
        show=lambda: signals_ready(stack),
    )
    assert ready["reason"] == "AllPresent", ready
    shown = kubectl_sluice(stack, "doctor", "llama", "-n", "llm")
    assert shown.returncode == 0, (shown.stdout, shown.stderr)
    assert "SignalsReady=True (AllPresent)" in shown.stdout
