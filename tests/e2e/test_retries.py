"""Retries around zeroing, measured on the local stack: requests failed when a pod is OOM-killed, without and with
`spec.routing.retries`.

The load generator follows the route's retry policy as Envoy does (another pod, only for failures before any
response byte), so what changes between the two runs is only the VirtualService sluice renders.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sluice.devstack.kubelet import PodSpec
from sluice.devstack.stack import Stack
from sluice.devstack.traffic import Sample, Traffic
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


def failed_after_oom(stack: Stack, traffic: Traffic, background: Background, pod: str) -> Window:
    """The requests that finished in the window after `pod` is OOM-killed."""
    wait_until(lambda: all_routable(stack), 90, "every pod routable before the kill")
    time.sleep(3)
    killed = time.monotonic()
    background.start(stack.inject(pod, {"oom": True})).result(timeout=10)
    time.sleep(WINDOW + 2)
    return Window(pod, [s for s in traffic.finished() if killed <= s.at <= killed + WINDOW])


@dataclass(frozen=True)
class Window:
    killed: str
    samples: list[Sample]

    @property
    def hit(self) -> list[Sample]:
        """Requests first sent to the dead pod whose first attempt failed before any response byte (retried or
        not); a failure elsewhere (a client timeout under load, another pod's error) is not one."""
        return [
            s
            for s in self.samples
            if s.first == self.killed and (s.attempts > 1 or (not s.ok and s.condition is not None))
        ]

    @property
    def unsaved(self) -> int:
        """Requests first sent to the dead pod that failed before any response byte: a retry could have saved
        them and did not."""
        return sum(1 for s in self.hit if not s.ok and s.condition is not None)

    def __str__(self) -> str:
        failed = sum(1 for s in self.samples if not s.ok)
        return f"{self.killed}: {len(self.hit)} hit, {self.unsaved} unsaved, {failed} failed of {len(self.samples)}"


def first_hit(stack: Stack, traffic: Traffic, background: Background, pods: list[str]) -> Window:
    """Kill the pods in turn until a request reached a dead one. At ~4 req/s per pod and a pod zeroed within about
    a second of its death, a kill can pass with nothing sent to it: such a kill measures nothing."""
    for pod in pods:
        window = failed_after_oom(stack, traffic, background, pod)
        print(f"\nafter the OOM kill of {window}")
        if window.hit:
            return window
    pytest.fail(f"no request reached a dead pod in {len(pods)} kills: nothing measured")


def test_retries_turn_failed_requests_into_retried_ones_when_a_pod_is_oom_killed(
    stack: Stack, traffic: Traffic, background: Background
) -> None:
    # Streams the kill cut after their first byte fail with retries too (Envoy never retries an answer it has
    # started to send): what retries change is the failures before any response byte.
    without = first_hit(stack, traffic, background, ["llama-a100-1", "llama-a100-0", "llama-a100-2"])
    assert all(s.attempts == 1 for s in without.samples)  # no retries until the pool asks for them
    stack.patch_pool("llama", {"spec": {"routing": {"retries": {"attempts": 2}}}})
    wait_until(lambda: traffic.retries.attempts == 2, 30, "the route's retries reach the data plane")
    with_retries = first_hit(stack, traffic, background, ["llama-a100-2", "llama-a100-0", "llama-a100-1"])
    retried = [s for s in with_retries.hit if s.attempts > 1]
    assert with_retries.unsaved < len(with_retries.hit), "a retry saved no request sent to the dead pod"
    assert retried
    assert all(s.pod != with_retries.killed for s in retried if s.ok)  # a retry goes to another pod
