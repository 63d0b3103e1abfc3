"""`kubectl sluice` invoked by the real kubectl as a plugin, against the local stack with a running operator."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sluice.devstack.kubelet import PodSpec
from sluice.devstack.stack import Stack
from sluice.devstack.traffic import Traffic
from tests.e2e.conftest import Background, operator_stack, pool_manifest, running_traffic, wait_until

pytestmark = pytest.mark.slow
PODS = [
    PodSpec("llama-a100-0", "a100", "v1", "127.0.24.1"),
    PodSpec("llama-a100-1", "a100", "v1", "127.0.24.2"),
    PodSpec("llama-v2-a100-0", "a100", "v2", "127.0.24.3"),
]


def apply_rollout(stack: Stack) -> None:
    # Long steps: only operations move this rollout. Its one-pod candidate serves ~0.8 requests/s at 10 %, so its
    # p95 is its slowest request of the window: the ratio gate stays on, loosely (this module is about operations).
    manifest = pool_manifest(stack).replace("stepInterval: 10s", "stepInterval: 10m")
    stack.kubectl("apply", "-f", "-", stdin=manifest)
    canary = {"candidateRevision": "v2", "analysis": {"maxTtftRatioToStable": 3}}
    stack.patch_pool("llama", {"spec": {"canary": canary}})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, background: Background) -> Iterator[Stack]:
    yield from operator_stack(Path(tmp_path_factory.mktemp("plugin")), background, PODS, setup=apply_rollout)


@pytest.fixture(scope="module")
def traffic(stack: Stack, background: Background) -> Iterator[Traffic]:
    yield from running_traffic(stack, background, rate=8.0)


def kubectl_sluice(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    """The real kubectl finds `kubectl-sluice` on PATH (the package's console script) and runs it."""
    env = stack.kube_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        ["kubectl", "sluice", *args], capture_output=True, text=True, env=env, timeout=90, check=False
    )


def canary(stack: Stack) -> dict[str, Any]:
    return stack.pool("llama").get("status", {}).get("canary") or {}


def test_kubectl_lists_the_plugin_and_every_verb_has_help(stack: Stack) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    listed = subprocess.run(["kubectl", "plugin", "list"], capture_output=True, text=True, env=env, check=False)
    assert "kubectl-sluice" in listed.stdout
    for verb in ("status", "explain", "plan", "doctor", "promote", "abort", "retry", "pause", "resume", "skip-step"):
        shown = kubectl_sluice(stack, verb, "--help")
        assert shown.returncode == 0, (verb, shown.stderr)
        assert "usage: kubectl sluice" in shown.stdout


def test_errors_read_like_kubectl_and_exit_non_zero(stack: Stack) -> None:
    missing = kubectl_sluice(stack, "status", "nope", "-n", "llm")
    assert missing.returncode == 1
    assert missing.stderr.strip() == 'error: inferencepools.inference.sluice.dev "nope" not found'
    wrong = kubectl_sluice(stack, "--context", "elsewhere", "status", "llama")
    assert wrong.returncode == 1
    assert 'error: context "elsewhere" does not exist' in wrong.stderr


def test_status_and_explain_show_the_pools_decisions(stack: Stack, traffic: Traffic) -> None:
    wait_until(
        lambda: canary(stack).get("stepWeight") == 10, 60, "the rollout at its first step", show=lambda: canary(stack)
    )
    shown = kubectl_sluice(stack, "status", "llama", "-n", "llm")
    assert shown.returncode == 0, shown.stderr
    assert "llama-v2-a100-0" in shown.stdout
    assert "canary: Progressing" in shown.stdout
    explained = kubectl_sluice(stack, "explain", "llama", "llama-a100-0", "-n", "llm")
    assert explained.returncode == 0, explained.stderr
    assert "verdict" in explained.stdout
    assert "reason" in explained.stdout
    watched = kubectl_sluice(stack, "status", "llama", "-n", "llm", "-w", "--timeout", "6")
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout.count("InferencePool llm/llama") >= 2  # the first view, then at least one change
    planned = kubectl_sluice(stack, "plan", "llama", "-n", "llm")
    assert planned.returncode == 0, planned.stderr
    assert "weight changes:" in planned.stdout


def test_pause_resume_skip_step_and_promote_through_the_plugin(stack: Stack, traffic: Traffic) -> None:
    paused = kubectl_sluice(stack, "pause", "llama", "-n", "llm")
    assert paused.returncode == 0, paused.stderr
    assert "pause: applied" in paused.stdout
    wait_until(lambda: canary(stack).get("phase") == "Paused", 20, "Paused")
    resumed = kubectl_sluice(stack, "resume", "llama", "-n", "llm")
    assert resumed.returncode == 0, resumed.stderr
    wait_until(
        lambda: canary(stack).get("lastCheck") == "Pass", 60, "a passing check at this step", show=lambda: canary(stack)
    )
    skipped = kubectl_sluice(stack, "skip-step", "llama", "-n", "llm")
    assert skipped.returncode == 0, skipped.stderr
    assert canary(stack)["stepWeight"] == 50
    promoted = kubectl_sluice(stack, "promote", "llama", "-n", "llm", "--force")
    assert promoted.returncode == 0, promoted.stderr
    record = canary(stack)["lastOperation"]
    assert (record["op"], record["result"]) == ("promote", "Applied")
    # Forced or not depends on whether a check passed at the new step before the promote (the unit tests pin both
    # cases down); the plugin says which, as the record does.
    assert ("(forced: analysis skipped)" in promoted.stdout) == record.get("forced", False)
    assert record["by"].endswith("@sluice-local")  # user@context, as the kubeconfig names them
    assert canary(stack)["phase"] == "Promoted"
    again = kubectl_sluice(stack, "retry", "llama", "-n", "llm")
    assert again.returncode == 1  # nothing to retry: refused, and said so
    assert "error: " in again.stderr
    reasons = [e["reason"] for e in stack.events("CanaryOperation")]
    assert len(reasons) >= 5
