"""The local stack's kubelet: its pods, what it writes of them to the API, and its loop.

Local-stack tool. Each pod is one simulated vLLM server (`sluice.devstack.modelserver`) on its own 127.0.0.x
address. The kubelet registers the pod with its IP and labels, marks it Ready only after a real 1-token completion
succeeds, and when a server process dies records the termination (`OOMKilled` only when the simulated cgroup OOM
killer fired, i.e. the `oom_kill` count in the pod's memory.events file went up; otherwise `Error` with the exit
code, 137 for a SIGKILL), bumps the restart count and restarts it after a back-off.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

import aiohttp

from sluice.api.jsontypes import JsonObject
from sluice.devstack.processes import StackClosing

RESTART_BACK_OFF = 2.0
"""Seconds between a server's exit and its restart."""


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PodSpec:
    name: str
    hardware: str
    revision: str
    ip: str
    app: str = "llama"
    error_rate: float = 0.0
    server_args: tuple[str, ...] = ()
    """More options of the model server (`--data-parallel-size 2`, `--disable-log-stats`, `--exposition sglang`)."""


@dataclass
class PodState:
    spec: PodSpec
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    ready: bool = False
    last_termination: JsonObject | None = None
    restart_at: float | None = None
    deleted: bool = False
    oom_kills_at_start: int = 0
    """The `oom_kill` count of the pod's memory.events file when its server last started."""


# ---------------------------------------------------------------------------------------- the pod's container


def memory_events_file(workdir: Path, spec: PodSpec) -> Path:
    """The pod's cgroup v2 `memory.events` stand-in: its server records there the OOM kills it suffers."""
    return workdir / f"pod-{spec.name}.memory.events"


def read_oom_kills(memory_events: Path) -> int:
    """The `oom_kill` count of a cgroup v2 `memory.events` file (0 when it does not exist yet)."""
    with contextlib.suppress(FileNotFoundError):
        for line in memory_events.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return 0


def termination_reason(status: int, oom_kills_before: int, oom_kills_after: int) -> tuple[str, int]:
    """A real kubelet's `terminated.reason` and `exitCode` for a container that exited with `status` (a
    `Popen.returncode`: -N for signal N): `OOMKilled` only when the runtime saw the cgroup's OOM killer fire while
    it ran (its `oom_kill` count went up); otherwise `Completed` for 0 and `Error` for anything else, a SIGKILL
    from a liveness probe or `kill -9` included (exit code 128 + 9 = 137)."""
    exit_code = status if status >= 0 else 128 - status
    if oom_kills_after > oom_kills_before:
        return "OOMKilled", exit_code
    return ("Completed" if exit_code == 0 else "Error"), exit_code


def server_command(spec: PodSpec, memory_events: Path) -> list[str]:
    """The pod's container: a simulated vLLM server on the pod's address, port 8000."""
    return [
        sys.executable,
        "-m",
        "sluice.devstack.modelserver",
        "--host",
        spec.ip,
        "--port",
        "8000",
        "--hardware",
        spec.hardware,
        "--model",
        spec.app,
        "--error-rate",
        str(spec.error_rate),
        "--memory-events",
        str(memory_events),
        *spec.server_args,
    ]


def record_exit(state: PodState, status: int, oom_kills: int) -> None:
    """A server exited with `status`: its termination, one more restart, not Ready, restarted after the back-off."""
    reason, exit_code = termination_reason(status, state.oom_kills_at_start, oom_kills)
    state.last_termination = {"exitCode": exit_code, "reason": reason, "startedAt": now_iso(), "finishedAt": now_iso()}
    state.restarts += 1
    state.ready = False
    state.restart_at = time.monotonic() + RESTART_BACK_OFF


async def probe(http: aiohttp.ClientSession, ip: str) -> bool:
    """Readiness as a 1-token completion, not a TCP check."""
    try:
        async with http.post(f"http://{ip}:8000/v1/completions", json={"prompt": "ping", "max_tokens": 1}) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


# ---------------------------------------------------------------------------------------- what the API is told


def pod_manifest(spec: PodSpec) -> JsonObject:
    """The pod as a user's Deployment would create it: the labels sluice selects and reads, one container."""
    labels: JsonObject = {
        "app": spec.app,
        "sluice.dev/hardware-class": spec.hardware,
        "sluice.dev/revision": spec.revision,
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": spec.name, "labels": labels},
        "spec": {
            "serviceAccountName": f"{spec.app}-server",
            "containers": [{"name": "vllm", "image": "sluice/sim-vllm", "ports": [{"containerPort": 8000}]}],
        },
    }


def service_manifest(app: str) -> JsonObject:
    """The Service clients call, as a user's manifest would have it: named after the app, port 8000 named http
    (Istio reads the protocol from the name)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": app, "labels": {"app": app}},
        "spec": {"selector": {"app": app}, "ports": [{"name": "http", "port": 8000, "targetPort": 8000}]},
    }


def pod_status(state: PodState) -> JsonObject:
    """The pod's status as a kubelet writes it: running, Ready or not, restarts and the last termination."""
    container: JsonObject = {
        "name": "vllm",
        "ready": state.ready,
        "restartCount": state.restarts,
        "image": "sluice/sim-vllm",
        "imageID": "",
        "state": {"running": {"startedAt": now_iso()}},
    }
    if state.last_termination:
        container["lastState"] = {"terminated": state.last_termination}
    return {
        "phase": "Running",
        "podIP": state.spec.ip,
        "podIPs": [{"ip": state.spec.ip}],
        "conditions": [
            {"type": "Ready", "status": "True" if state.ready else "False", "lastTransitionTime": now_iso()}
        ],
        "containerStatuses": [container],
    }


# ---------------------------------------------------------------------------------------- the loop


class Node(Protocol):
    """The stack as its kubelet sees it: the pods, whether the kubelet still runs, how a pod's status is written
    and its server started (`StackClosing` once the stack closes)."""

    pods: dict[str, PodState]
    workdir: Path

    def kubelet_running(self) -> bool: ...

    def _report(self, state: PodState) -> None: ...

    def _start_server(self, state: PodState) -> None: ...


async def run_kubelet(node: Node) -> None:
    """Probe readiness with real inference, record crashes, restart servers, every half second while it runs."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as http:
        while node.kubelet_running():
            for state in list(node.pods.values()):
                if state.deleted or state.process is None:
                    continue
                code = state.process.poll()
                if code is not None and state.restart_at is None:
                    record_exit(state, code, read_oom_kills(memory_events_file(node.workdir, state.spec)))
                    await asyncio.to_thread(node._report, state)
                elif state.restart_at is not None and time.monotonic() >= state.restart_at:
                    state.restart_at = None
                    try:
                        await asyncio.to_thread(node._start_server, state)
                    except StackClosing:  # `close` began since the loop's check: nothing more to run
                        return
                elif code is None and not state.ready and await probe(http, state.spec.ip):
                    state.ready = True
                    await asyncio.to_thread(node._report, state)
            await asyncio.sleep(0.5)
