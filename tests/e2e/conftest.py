"""Fixtures for end-to-end tests on the local stack (API emulator, real Prometheus, simulated pods, operator)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sluice.devstack.kubelet import PodSpec
from sluice.devstack.loop import Background
from sluice.devstack.metricspage import passes_done
from sluice.devstack.stack import ROOT, Stack
from sluice.devstack.traffic import Traffic


def wait_until(
    check: Callable[[], Any], seconds: float, what: str, every: float = 0.5, show: Callable[[], Any] | None = None
) -> Any:
    """Poll `check` until it returns something truthy; fail with `what` (and what `show` returns) after `seconds`."""
    end = time.monotonic() + seconds
    last_error: Exception | None = None
    while time.monotonic() < end:
        try:
            result = check()
        except (KeyError, TypeError, IndexError, StopIteration) as failure:
            last_error, result = failure, None
        if result:
            return result
        time.sleep(every)
    seen = f"; last seen: {show()!r}" if show is not None else ""
    pytest.fail(
        f"not seen within {seconds:.0f}s: {what}" + (f" (last error: {last_error!r})" if last_error else "") + seen
    )


def rows(pool: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["pod"]: row for row in pool.get("status", {}).get("endpoints", [])}


def condition(pool: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in pool.get("status", {}).get("conditions", []) if c["type"] == kind)


POOL_FILE = ROOT / "examples" / "local" / "pool.yaml"
BASE_PODS = [
    PodSpec("llama-a100-0", "a100", "v1", "127.0.20.1"),
    PodSpec("llama-4090-0", "rtx4090", "v1", "127.0.20.2"),
    PodSpec("llama-cpu-0", "cpu", "v1", "127.0.20.3"),
]


FOREIGN_DR = (  # named as sluice names the pool's DestinationRule, not sluice's
    "apiVersion: networking.istio.io/v1\nkind: DestinationRule\nmetadata: {name: sluice-llama, namespace: llm}\n"
    "spec: {host: someone-elses.llm.svc.cluster.local}\n"
)
"""A DestinationRule someone else made under the name sluice would give the pool `llama`'s."""


def weights(stack: Stack) -> dict[str, int]:
    """Pod -> weight in the pool `llama`'s ServiceEntry (the endpoints it lists)."""
    entry = stack.istio("serviceentries", "sluice-llama")
    addresses = {state.spec.ip: name for name, state in stack.pods.items()}
    endpoints = entry["spec"].get("endpoints", []) if entry else []
    return {addresses[e["address"]]: e["weight"] for e in endpoints}


def pool_manifest(stack: Stack) -> str:
    return POOL_FILE.read_text().replace("PROMETHEUS_URL", stack.prometheus_url)


@pytest.fixture(scope="module")
def background() -> Iterator[Background]:
    loop = Background()
    yield loop
    loop.close()


def start_stack(workdir: Path, background: Background, **kwargs: Any) -> Stack:
    stack = Stack(workdir, deadline_seconds=600, **kwargs).__enter__()
    background.start(stack.kubelet())
    return stack


def module_stack(
    workdir: Path,
    background: Background,
    pods: list[PodSpec],
    setup: Callable[[Stack], None] | None = None,
    **stack_options: Any,
) -> Iterator[Stack]:
    """A module's stack: the pods, then `setup` (start an operator, apply a pool...); stops itself."""
    stack = start_stack(workdir, background, **stack_options)
    try:
        for pod in pods:
            stack.add_pod(pod)
        if setup is not None:
            setup(stack)
        yield stack
    finally:
        background.call(stack.stop_kubelet)
        stack.close()


def operator_stack(
    workdir: Path,
    background: Background,
    pods: list[PodSpec],
    operator_args: list[str] | None = None,
    setup: Callable[[Stack], None] | None = None,
) -> Iterator[Stack]:
    """A module's stack: the pods, a running operator, then `setup` (apply a pool...); stops itself."""

    def start(stack: Stack) -> None:
        stack.start_operator(operator_args or [])
        if setup is not None:
            setup(stack)

    yield from module_stack(workdir, background, pods, start)


def replica(stack: Stack, name: str, args: list[str]) -> subprocess.Popen[bytes]:
    """One more operator process on the stack's namespace with `args`, its log in operator-<name>.log."""
    command = [sys.executable, "-m", "sluice", "operator", "-n", stack.namespace, "--kubeconfig", str(stack.kubeconfig)]
    return stack.spawn([*command, *args], f"operator-{name}.log")


def wait_for_passes(port: int, pool: str, count: int, seconds: float) -> None:
    """Wait until the operator has run `count` more passes of the pool: a check that nothing changed over "a few
    passes" must see them happen, not only time go by. The baseline is a reading, never a default."""
    before = wait_until(lambda: passes_done(port, pool), 15, f"the passes of {pool} on the operator's /metrics")

    def done() -> bool:
        now = passes_done(port, pool)
        return now is not None and now >= before + count

    wait_until(done, seconds, f"{count} more passes of {pool}")


def audit_trail(stack: Stack) -> list[dict[str, str]]:
    """The API emulator's audit log so far, one entry per request (and again once answered). A line the emulator
    is still writing (no newline yet) is not an entry yet: reading the file while it grows used to fail on it."""
    text = (stack.workdir / "audit.jsonl").read_text()
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines()]


def operator_pid(entry: dict[str, str]) -> int | None:
    """The pid of the operator process that made an audited request (its User-Agent ends in it), else None."""
    agent = entry["userAgent"]
    if not agent.startswith("sluice-operator/"):
        return None
    return int(agent.split()[0].rsplit("-", 1)[1])


def running_traffic(stack: Stack, background: Background, rate: float) -> Iterator[Traffic]:
    """Bounded load on the pool `llama` for the rest of the module."""
    load = Traffic(stack, "llama", rate=rate)
    background.start(load.run(stack.remaining()))
    yield load
    background.call(load.stop.set)
