"""High availability: two operator replicas peer through a KopfPeering; one acts, the other takes over on failure."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.devstack.stack import ROOT, Stack
from tests.e2e.conftest import (
    BASE_PODS,
    Background,
    audit_trail,
    condition,
    module_stack,
    operator_pid,
    pool_manifest,
    replica,
    wait_until,
)

pytestmark = pytest.mark.slow
PEERING = "apiVersion: kopf.dev/v1\nkind: KopfPeering\nmetadata: {name: sluice, namespace: llm}\n"


def apply_peering(stack: Stack) -> None:
    stack.kubectl("apply", "-f", str(ROOT / "crds" / "kopf.dev_peerings.yaml"))
    wait_until(lambda: "kopfpeerings" in stack.kubectl("api-resources").stdout, 10, "the peering CRD is served")
    stack.kubectl("apply", "-f", "-", stdin=PEERING)


@pytest.fixture(scope="module")
def ha_stack(tmp_path_factory: pytest.TempPathFactory, background: Background) -> Iterator[Stack]:
    yield from module_stack(Path(tmp_path_factory.mktemp("ha")), background, BASE_PODS[:2], setup=apply_peering)


def peer(stack: Stack, priority: int, name: str) -> subprocess.Popen[bytes]:
    return replica(stack, name, ["--peering", "sluice", "--priority", str(priority)])


def calls_by(stack: Stack, pid: int) -> list[dict[str, str]]:
    """The API requests made by one operator process's own client (its User-Agent carries its pid)."""
    return [entry for entry in audit_trail(stack) if operator_pid(entry) == pid]


def test_one_replica_acts_and_the_other_takes_over_when_it_dies(ha_stack: Stack) -> None:
    stack = ha_stack
    active = peer(stack, 200, "a")
    standby = peer(stack, 100, "b")
    stack.kubectl("apply", "-f", "-", stdin=pool_manifest(stack))
    first = wait_until(
        lambda: condition(stack.pool("llama"), "IstioSynced")["status"] == "True" and stack.pool("llama"),
        60,
        "the pool reconciled by the active replica",
    )
    time.sleep(6)  # several passes with both replicas alive
    assert any(c["subresource"] == "status" for c in calls_by(stack, active.pid)), "the active replica wrote status"
    assert calls_by(stack, standby.pid) == [], "the standby made API calls while the active replica was alive"

    os.killpg(active.pid, signal.SIGKILL)
    killed_at = time.time()
    wait_until(lambda: calls_by(stack, standby.pid), 60, "the standby's first pass")
    took = time.time() - killed_at
    wait_until(
        lambda: any(c["subresource"] == "status" for c in calls_by(stack, standby.pid)),
        90,
        "the standby writes the status (on change or at the 60 s heartbeat)",
    )
    after = stack.pool("llama")
    assert condition(after, "IstioSynced")["status"] == "True"
    assert [r["pod"] for r in after["status"]["endpoints"]] == [r["pod"] for r in first["status"]["endpoints"]]
    print(
        f"\nfailover: the standby's first pass came {took:.1f}s after the active replica was killed "
        "(peering lifetime 15 s, first-pass delay 5 s)"
    )
