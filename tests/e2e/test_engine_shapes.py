"""The local stack's servers in the shapes real deployments export, read by the operator end to end: an SGLang
pool with two data-parallel ranks (`--exposition sglang --data-parallel-size 2`), and a vLLM engine put to sleep
through its own `/sleep` route (`vllm:engine_sleep_state`), which sluice stops routing until it wakes up."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sluice.devstack.kubelet import PodSpec
from sluice.devstack.stack import Stack
from sluice.devstack.traffic import Traffic
from tests.e2e.conftest import Background, condition, operator_stack, pool_manifest, rows, running_traffic, wait_until

pytestmark = pytest.mark.slow
SLEEPER = "llama-a100-1"
PODS = [
    PodSpec("llama-a100-0", "a100", "v1", "127.0.27.1"),
    PodSpec(SLEEPER, "a100", "v1", "127.0.27.2", server_args=("--enable-sleep-mode",)),
    PodSpec("qwen-a100-0", "a100", "v1", "127.0.27.3", app="qwen", server_args=("--exposition", "sglang")),
    PodSpec(
        "qwen-a100-1",
        "a100",
        "v1",
        "127.0.27.4",
        app="qwen",
        server_args=("--exposition", "sglang", "--data-parallel-size", "2"),
    ),
]
SGLANG_POOL = """
apiVersion: inference.sluice.dev/v1alpha1
kind: InferencePool
metadata: {name: qwen, namespace: llm}
spec:
  selector: {matchLabels: {app: qwen}}
  targetPort: 8000
  service: qwen
  engine: sglang
  interval: 2s
  metrics: {prometheusUrl: PROMETHEUS_URL, window: 10s, staleAfter: 15s, timeout: 2s}
  capacity: {classes: {a100: 10}}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, background: Background) -> Iterator[Stack]:
    def apply(stack: Stack) -> None:
        stack.kubectl("apply", "-f", "-", stdin=pool_manifest(stack))
        stack.kubectl("apply", "-f", "-", stdin=SGLANG_POOL.replace("PROMETHEUS_URL", stack.prometheus_url))

    yield from operator_stack(Path(tmp_path_factory.mktemp("shapes")), background, PODS, setup=apply)


@pytest.fixture(scope="module")
def traffic(stack: Stack, background: Background) -> Iterator[Traffic]:
    yield from running_traffic(stack, background, rate=6.0)


def post(stack: Stack, pod: str, path: str) -> int:
    """POST to the pod's server at the address the stack gave it."""
    request = urllib.request.Request(f"http://{stack.pods[pod].spec.ip}:8000{path}", method="POST", data=b"")
    with urllib.request.urlopen(request, timeout=10) as answer:
        return int(answer.status)


def test_an_sglang_pool_with_data_parallel_ranks_is_read_and_weighted(stack: Stack) -> None:
    def settled() -> dict[str, Any] | None:
        pool = stack.pool("qwen")
        found = rows(pool)
        if len(found) == 2 and all(row["weight"] > 0 for row in found.values()):
            return pool
        return None

    pool = wait_until(settled, 60, "both SGLang pods weighted", show=lambda: rows(stack.pool("qwen")))
    found = rows(pool)
    for row in found.values():  # the scheduler's gauges, read per pod (each DP rank's summed, TP ranks once)
        assert row["signals"]["kvCacheUsage"] is not None
        assert row["signals"]["queueLength"] == 0
        assert row["signals"]["runningRequests"] == 0
    # idle: the tokenizer's series come with the first request, which is no finding (the first checks may come
    # before Prometheus has found the new pods' targets: the next ones, every 15 s here, see them)
    ready = wait_until(
        lambda: (c := condition(stack.pool("qwen"), "SignalsReady"))["status"] == "True" and c,
        60,
        "the SGLang pool's SignalsReady=True",
        show=lambda: condition(stack.pool("qwen"), "SignalsReady"),
    )
    assert ready["reason"] == "AllPresent", ready
    checks = {c["signal"]: c for c in stack.pool("qwen")["status"]["signalChecks"]["signals"]}
    assert checks["queueLength"]["state"] == "Ok"
    assert checks["queueLength"]["podsOk"] == 2
    assert checks["sleeping"]["state"] == "NotProvided"


def test_a_sleeping_vllm_engine_is_not_routed_until_it_wakes(stack: Stack, traffic: Traffic) -> None:
    wait_until(lambda: rows(stack.pool("llama"))[SLEEPER]["weight"] > 0, 60, "the sleeper routed while awake")
    assert post(stack, SLEEPER, "/sleep?level=1") == 200
    asleep = wait_until(
        lambda: (row := rows(stack.pool("llama"))[SLEEPER])["weight"] == 0 and row,
        30,
        "the sleeping engine out of routing",
        show=lambda: rows(stack.pool("llama"))[SLEEPER],
    )
    assert "asleep" in asleep["reason"]
    assert asleep["signals"]["sleeping"] == 1
    assert post(stack, SLEEPER, "/wake_up") == 200
    awake = wait_until(
        lambda: (row := rows(stack.pool("llama"))[SLEEPER])["weight"] > 0 and row,
        30,
        "the engine routed again once awake",
        show=lambda: rows(stack.pool("llama"))[SLEEPER],
    )
    assert awake["signals"]["sleeping"] == 0
