"""Retries around zeroing, measured on the local stack: requests failed when a pod is OOM-killed, without and with
`spec.routing.retries`.

The load generator follows the route's retry policy as Envoy does (another pod, only for failures before any
response byte), so what changes between the two runs is only the VirtualService sluice renders.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.devstack.stack import PodSpec, Stack, Traffic
from tests.e2e.conftest import Background, operator_stack, pool_manifest, rows, running_traffic, wait_until

pytestmark = pytest.mark.slow
PODS = [
    PodSpec("llama-a100-0", "a100", "v1", "127.0.25.1"),
    PodSpec("llama-a100-1", "a100", "v1", "127.0.25.2"),
    PodSpec("llama-a100-2", "a100", "v1", "127.0.25.3"),
]
WINDOW = 10.0  # seconds after the kill over which failed requests are counted


def apply_pool(stack: Stack) -> None:
    stack.kubectl("apply", "-f", "-", stdin=pool_manifest(stack))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, background: Background) -> Iterator[Stack]:
    yield from operator_stack(Path(tmp_path_factory.mktemp("retries")), background, PODS, setup=apply_pool)


@pytest.fixture(scope="module")
def traffic(stack: Stack, background: Background) -> Iterator[Traffic]:
    yield from running_traffic(stack, background, rate=12.0)


def all_routable(stack: Stack) -> bool:
    table = rows(stack.pool("llama"))
    return len(table) == len(PODS) and all(r["state"] == "Routable" and r["weight"] > 0 for r in table.values())


def failed_after_oom(stack: Stack, traffic: Traffic, background: Background, pod: str) -> tuple[int, int, int]:
    """(failed before any response byte, failed in all, requests) in the window after `pod` is OOM-killed."""
    wait_until(lambda: all_routable(stack), 90, "every pod routable before the kill")
    time.sleep(3)
    killed = time.monotonic()
    background.start(stack.inject(pod, {"oom": True})).result(timeout=10)
    time.sleep(WINDOW + 2)
    retriable, _ = traffic.failures(killed, killed + WINDOW, retriable=True)
    failed, total = traffic.failures(killed, killed + WINDOW)
    return retriable, failed, total


def test_retries_turn_failed_requests_into_retried_ones_when_a_pod_is_oom_killed(
    stack: Stack, traffic: Traffic, background: Background
) -> None:
    # Streams the kill cut after their first byte fail with retries too (Envoy never retries an answer it has
    # started to send): what retries change is the failures before any response byte.
    without = failed_after_oom(stack, traffic, background, "llama-a100-1")
    if without[0] == 0:  # nothing was sent to the pod after it died (~4 req/s each): that kill measured nothing
        without = failed_after_oom(stack, traffic, background, "llama-a100-0")
    stack.patch_pool("llama", {"spec": {"routing": {"retries": {"attempts": 2}}}})
    wait_until(lambda: traffic.retries.attempts == 2, 30, "the route's retries reach the data plane")
    with_retries = failed_after_oom(stack, traffic, background, "llama-a100-2")
    print(
        f"\nfailed requests in the {WINDOW:.0f} s after an OOM kill (before any response byte / in all / requests): "
        f"without retries {without}, with retries {with_retries}"
    )
    assert without[0] > 0, "the kill must cost something a retry can save, or this measures nothing"
    assert with_retries[0] < without[0]
    retried = [s for s in traffic.samples if s.attempts > 1]
    assert retried
    assert all(s.pod != "llama-a100-2" for s in retried if s.ok)  # a retry goes to another pod
