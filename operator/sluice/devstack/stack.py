"""The local stack: every part sluice talks to, running for real on loopback, for the demo and end-to-end tests.

Local-stack tool. What runs:
- the Kubernetes API emulator (`apiserver`, its own process, with a kubeconfig);
- real Prometheus (Debian package), scraping every simulated pod each second through file-based discovery, with
  `pod` and `namespace` labels as a Kubernetes scrape config would add;
- one simulated vLLM server per pod (`modelserver`), each on its own 127.0.0.x address and port 8000;
- a small kubelet: it registers each pod in the API with its IP and labels, marks it Ready only after a real
  1-token completion succeeds, and when a server process dies records the termination (`OOMKilled` only when the
  simulated cgroup OOM killer fired, i.e. the `oom_kill` count in the pod's memory.events file went up; otherwise
  `Error` with the exit code, 137 for a SIGKILL), bumps the restart count and restarts it;
- the operator (`python -m sluice operator`), its own process;
- `Traffic`: a bounded load generator that routes each request the way Envoy would with the objects sluice
  published: a revision split from the VirtualService, then weighted least-request (`w / (active + 1)`) over the
  ServiceEntry endpoints; it measures TTFT from the SSE stream. It follows the route's `mirrors` as Envoy does:
  a sampled share of the requests is also sent, fire-and-forget, to a pod of the mirror's subset, and that answer
  is read and discarded. It counts per pod the requests that served users and those that were mirror copies.
Everything binds to 127.0.0.0/8, has a deadline, and is stopped (by PID) when the stack closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections import defaultdict, deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import aiohttp
import re2  # type: ignore[import-untyped]
import yaml
from kubernetes import client as k8s

from sluice.io.kube import load_api_client
from sluice.istio.kinds import SERVICE_ENTRY, VIRTUAL_SERVICE
from sluice.istio.objects import PoolRef, object_name, subset_name

ROOT = Path(__file__).resolve().parents[3]
SHARED_ISTIO = ROOT.parent / "shared" / "istio" / "istio-1.30.3-networking-crds.yaml"
SHARED_SIDECAR = ROOT.parent / "shared" / "istio" / "istio-1.30.3-sidecar-crd.yaml"
"""Istio's Sidecar CRD: the operator watches Sidecars (their egress hosts can hide the pool's hosts)."""
SHARED_GIE = ROOT.parent / "shared" / "istio" / "gie-v1.6.0-inferencepool-crd.yaml"
"""The Gateway API Inference Extension's InferencePool CRD (inference.networking.k8s.io): same kind, same plural."""
POOL_RESOURCE = "inferencepools.inference.sluice.dev"
"""sluice's pools as kubectl must name them where GIE is installed: its group sorts first, so the bare
`inferencepool` resolves to GIE's kind."""
SLUICE_CRD = ROOT / "crds" / "inference.sluice.dev_inferencepools.yaml"
PROMPT_WORDS = 2048


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


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
    last_termination: dict[str, Any] | None = None
    restart_at: float | None = None
    deleted: bool = False
    oom_kills_at_start: int = 0
    """The `oom_kill` count of the pod's memory.events file when its server last started."""


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


class StackClosing(RuntimeError):
    """A process asked of a stack that is closing: nothing starts once `close` has begun."""


class Stack:
    """Start with `with Stack(workdir) as stack:`; everything started is stopped on exit."""

    def __init__(
        self,
        workdir: Path,
        namespace: str = "llm",
        deadline_seconds: float = 900.0,
        sluice_crd: Path | None = SLUICE_CRD,
    ) -> None:
        """`sluice_crd=None` starts the API without sluice's CRD, for an installer (Helm) to create it."""
        self.workdir = workdir
        self.sluice_crd = sluice_crd
        self.namespace = namespace
        self.deadline = time.monotonic() + deadline_seconds
        self.processes: list[subprocess.Popen[bytes]] = []
        self._services: list[subprocess.Popen[bytes]] = []
        self._service_names: set[str] = set()
        """The API server and Prometheus: `close` stops them after everything else."""
        self._closing = False
        """Set by `close`: nothing is started from then on."""
        self.pods: dict[str, PodState] = {}
        self.kubeconfig = workdir / "kubeconfig"
        self.api_url = ""
        self.prometheus_url = ""
        self.targets_file = workdir / "prometheus" / "targets.json"
        self.operator: subprocess.Popen[bytes] | None = None
        self.operator_args: list[str] = []
        self._kubelet_stop = asyncio.Event()
        # The second octet of this stack's pod addresses (see `_own_address`); SLUICE_STACK_OCTET pins it.
        self.address_octet = int(os.environ.get("SLUICE_STACK_OCTET") or random.randint(1, 254))
        self.apiserver_args: list[str] = []  # extra `sluice.emulator.apiserver` options (e.g. a small watch history)
        self.core: k8s.CoreV1Api | None = None
        self.custom: k8s.CustomObjectsApi | None = None

    # ------------------------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Stack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self.start_apiserver()
            self.start_prometheus()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def spawn(
        self, args: list[str], log: str, kubeconfig: Path | None = None, service: bool = False
    ) -> subprocess.Popen[bytes]:
        """Start a process in its own session, output to `log` in the workdir. `service`: a server the others use
        (the API server, Prometheus), stopped last by `close`. Refused once `close` has begun."""
        if self._closing:
            raise StackClosing(f"the stack is closing: {args[0]} not started")
        handle = (self.workdir / log).open("ab")
        env = {**os.environ, "KUBECONFIG": str(kubeconfig or self.kubeconfig)}
        process = subprocess.Popen(
            args, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True, env=env
        )
        self.processes.append(process)
        if service:
            self._services.append(process)
        return process

    def close(self) -> None:
        """Stop every process: first those that use the API server and Prometheus (operators, routers, model
        servers, in reverse order of start), and only once they are gone those two, so a client shutting down
        (an operator clearing its shard Leases, finishing a pass) still has its servers."""
        self._closing = True  # nothing starts from now on (the kubelet would restart the model servers it sees exit)
        services = [p for p in self.processes if p in self._services]
        clients = [p for p in self.processes if p not in self._services]
        try:
            self._stop(list(reversed(clients)))
        finally:  # an interrupted first wave still stops the servers (they run in sessions of their own)
            self._stop(list(reversed(services)))
            self.processes.clear()
            self._services.clear()

    @staticmethod
    def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
        """SIGTERM to every process group at once, then wait for each (SIGKILL after 10 s)."""
        for process in processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=5)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    # ------------------------------------------------------------------------------------ API server

    def start_apiserver(self, with_gie: bool = False) -> None:
        """The API emulator with sluice's and Istio's CRDs (and GIE's InferencePool CRD beside sluice's when
        `with_gie`, as on a cluster running the Gateway API Inference Extension)."""
        crds = [str(self.sluice_crd)] if self.sluice_crd else []
        if with_gie:
            crds.append(str(SHARED_GIE))
        if SHARED_ISTIO.exists():
            crds += [str(SHARED_ISTIO), str(SHARED_SIDECAR)]
        else:
            raise FileNotFoundError(f"Istio CRDs not found at {SHARED_ISTIO}")
        args = [
            sys.executable,
            "-m",
            "sluice.emulator.apiserver",
            "--kubeconfig",
            str(self.kubeconfig),
            "--namespace",
            self.namespace,
            "--audit-log",
            str(self.workdir / "audit.jsonl"),
        ]
        for crd in crds:
            args += ["--crd", crd]
        args += self.apiserver_args
        log_path = self.workdir / "apiserver.log"
        log_path.unlink(missing_ok=True)
        process = self.spawn(args, "apiserver.log", service=True)
        self._wait_for(
            lambda: "ready " in log_path.read_text() if log_path.exists() else False, 30, "API emulator", process
        )
        self.api_url = log_path.read_text().split("ready ", 1)[1].split()[0]
        api = load_api_client(str(self.kubeconfig))
        self.core = k8s.CoreV1Api(api)
        self.custom = k8s.CustomObjectsApi(api)

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Real kubectl against the emulator."""
        binary = shutil.which("kubectl")
        if binary is None:
            raise FileNotFoundError("kubectl not found on PATH")
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        result = subprocess.run(
            [binary, *args], input=stdin, capture_output=True, text=True, env=env, timeout=60, check=False
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result

    def patch_pool(self, name: str, patch: dict[str, Any]) -> None:
        """`kubectl patch inferencepools.inference.sluice.dev NAME --type merge -p PATCH`, as a user would."""
        self.kubectl("patch", POOL_RESOURCE, name, "-n", self.namespace, "--type", "merge", "-p", json.dumps(patch))

    # ------------------------------------------------------------------------------------ Prometheus

    def start_prometheus(self) -> None:
        binary = shutil.which("prometheus") or "/usr/bin/prometheus"
        if not Path(binary).exists():
            raise FileNotFoundError("prometheus not found: `make stack-deps` installs the Debian package")
        home = self.workdir / "prometheus"
        home.mkdir(parents=True, exist_ok=True)
        self.write_targets()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "scrape_configs": [
                {"job_name": "vllm", "file_sd_configs": [{"files": [str(self.targets_file)], "refresh_interval": "1s"}]}
            ],
        }
        (home / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        data = Path(tempfile.mkdtemp(prefix="tsdb-", dir=home))
        self.spawn(
            [
                binary,
                f"--config.file={home / 'prometheus.yml'}",
                f"--storage.tsdb.path={data}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            "prometheus.log",
            service=True,
        )
        self.prometheus_url = f"http://127.0.0.1:{port}"
        self.wait_http(f"{self.prometheus_url}/-/ready", 30, "Prometheus")

    def stop_prometheus(self) -> subprocess.Popen[bytes]:
        process = next(p for p in self.processes if "prometheus" in str(p.args) and p.poll() is None)
        os.killpg(process.pid, signal.SIGSTOP)  # frozen: connections hang, then time out, like an overloaded server
        return process

    def resume_prometheus(self, process: subprocess.Popen[bytes]) -> None:
        os.killpg(process.pid, signal.SIGCONT)

    def prometheus_query(self, query: str) -> list[dict[str, Any]]:
        """An instant query against the stack's Prometheus: the result vector, as its HTTP API returns it."""
        url = f"{self.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": query})
        with urllib.request.urlopen(url, timeout=5) as answer:
            return cast(list[dict[str, Any]], json.loads(answer.read())["data"]["result"])

    def write_targets(self) -> None:
        groups = [
            {"targets": [f"{state.spec.ip}:8000"], "labels": {"pod": name, "namespace": self.namespace}}
            for name, state in sorted(self.pods.items())
            if not state.deleted
        ]
        self.targets_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.targets_file)

    # ------------------------------------------------------------------------------------ pods and the kubelet

    def _own_address(self, spec: PodSpec) -> None:
        """Move a `127.0.x.y` pod address to this stack's own `127.N.x.y`, in place (callers keep the spec).

        Stacks of other checkouts on the same machine use the same example addresses; a server that cannot bind
        its address never gets Ready, and the tests of both stacks fail for a reason neither has.
        """
        parts = spec.ip.split(".")
        if parts[:2] == ["127", "0"]:
            spec.ip = ".".join(["127", str(self.address_octet), *parts[2:]])

    def add_pod(self, spec: PodSpec) -> None:
        assert self.core is not None
        self._own_address(spec)
        state = PodState(spec)
        self.pods[spec.name] = state
        labels = {"app": spec.app, "sluice.dev/hardware-class": spec.hardware, "sluice.dev/revision": spec.revision}
        manifest: Any = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": spec.name, "labels": labels},
            "spec": {
                "serviceAccountName": f"{spec.app}-server",
                "containers": [{"name": "vllm", "image": "sluice/sim-vllm", "ports": [{"containerPort": 8000}]}],
            },
        }
        self.core.create_namespaced_pod(self.namespace, manifest)
        self._ensure_service(spec.app)
        self._start_server(state)
        self._report(state)
        self.write_targets()

    def _ensure_service(self, app: str) -> None:
        """The Service clients call, as a user's manifest would have it: named after the app, port 8000 named
        http (Istio reads the protocol from the name)."""
        assert self.core is not None
        if app in self._service_names:
            return
        manifest: Any = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": app, "labels": {"app": app}},
            "spec": {"selector": {"app": app}, "ports": [{"name": "http", "port": 8000, "targetPort": 8000}]},
        }
        try:
            self.core.create_namespaced_service(self.namespace, manifest)
        except k8s.ApiException as failure:
            if failure.status != 409:
                raise
        self._service_names.add(app)

    def add_server(self, spec: PodSpec) -> None:
        """A model server scraped by Prometheus, without a pod in the API (for the Envoy benchmark)."""
        self._own_address(spec)
        state = PodState(spec)
        self.pods[spec.name] = state
        self._start_server(state)
        self.write_targets()

    def wait_ready(self, names: list[str], seconds: float = 30.0) -> None:
        """Block until each server answers a 1-token completion."""

        async def probe_all() -> bool:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
                results = [await self._probe(http, self.pods[n].spec.ip) for n in names]
            return all(results)

        self._wait_for(lambda: asyncio.run(probe_all()), seconds, "model servers")

    def delete_pod(self, name: str) -> None:
        assert self.core is not None
        state = self.pods[name]
        state.deleted = True
        if state.process and state.process.poll() is None:
            os.killpg(state.process.pid, signal.SIGTERM)
        with contextlib.suppress(k8s.ApiException):
            self.core.delete_namespaced_pod(name, self.namespace)
        self.write_targets()

    def _start_server(self, state: PodState) -> None:
        spec = state.spec
        state.oom_kills_at_start = read_oom_kills(self._memory_events(spec))
        state.process = self.spawn(
            [
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
                str(self._memory_events(spec)),
                *spec.server_args,
            ],
            f"pod-{spec.name}.log",
        )
        state.ready = False

    def _memory_events(self, spec: PodSpec) -> Path:
        """The pod's cgroup v2 `memory.events` stand-in: its server records there the OOM kills it suffers."""
        return self.workdir / f"pod-{spec.name}.memory.events"

    def _report(self, state: PodState) -> None:
        """Write the pod's status to the API, as a kubelet does."""
        assert self.core is not None
        container: dict[str, Any] = {
            "name": "vllm",
            "ready": state.ready,
            "restartCount": state.restarts,
            "image": "sluice/sim-vllm",
            "imageID": "",
            "state": {"running": {"startedAt": now_iso()}},
        }
        if state.last_termination:
            container["lastState"] = {"terminated": state.last_termination}
        status = {
            "phase": "Running",
            "podIP": state.spec.ip,
            "podIPs": [{"ip": state.spec.ip}],
            "conditions": [
                {"type": "Ready", "status": "True" if state.ready else "False", "lastTransitionTime": now_iso()}
            ],
            "containerStatuses": [container],
        }
        with contextlib.suppress(k8s.ApiException):
            self.core.patch_namespaced_pod_status(state.spec.name, self.namespace, {"status": status})

    async def kubelet(self) -> None:
        """Probe readiness with real inference, record crashes, restart servers. Runs until the stack stops."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as http:
            while not self._kubelet_stop.is_set() and not self._closing and self.remaining() > 0:
                for state in list(self.pods.values()):
                    if state.deleted or state.process is None:
                        continue
                    code = state.process.poll()
                    if code is not None and state.restart_at is None:
                        oom_kills = read_oom_kills(self._memory_events(state.spec))
                        reason, exit_code = termination_reason(code, state.oom_kills_at_start, oom_kills)
                        state.last_termination = {
                            "exitCode": exit_code,
                            "reason": reason,
                            "startedAt": now_iso(),
                            "finishedAt": now_iso(),
                        }
                        state.restarts += 1
                        state.ready = False
                        state.restart_at = time.monotonic() + 2.0  # back-off before the restart
                        await asyncio.to_thread(self._report, state)
                    elif state.restart_at is not None and time.monotonic() >= state.restart_at:
                        state.restart_at = None
                        try:
                            await asyncio.to_thread(self._start_server, state)
                        except StackClosing:  # `close` began since the loop's check: nothing more to run
                            return
                    elif code is None and not state.ready and await self._probe(http, state.spec.ip):
                        state.ready = True
                        await asyncio.to_thread(self._report, state)
                await asyncio.sleep(0.5)

    @staticmethod
    async def _probe(http: aiohttp.ClientSession, ip: str) -> bool:
        """Readiness as a 1-token completion, not a TCP check."""
        try:
            async with http.post(f"http://{ip}:8000/v1/completions", json={"prompt": "ping", "max_tokens": 1}) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def inject(self, pod: str, faults: dict[str, Any]) -> None:
        ip = self.pods[pod].spec.ip
        async with aiohttp.ClientSession() as http, http.post(f"http://{ip}:8000/admin/faults", json=faults) as r:
            await r.read()

    # ------------------------------------------------------------------------------------ operator

    def start_operator(self, extra: list[str] | None = None) -> subprocess.Popen[bytes]:
        """Start the operator; a restart (no arguments) reuses the arguments of the previous start."""
        if extra is not None:
            self.operator_args = extra
        command = [sys.executable, "-m", "sluice", "operator", "-n", self.namespace]
        command += ["--kubeconfig", str(self.kubeconfig), *self.operator_args]
        self.operator = self.spawn(command, "operator.log")
        return self.operator

    def operator_usage(self) -> dict[str, float]:
        """CPU seconds and memory of the operator process so far, from /proc (Linux)."""
        if self.operator is None or self.operator.poll() is not None:
            return {}
        pid = self.operator.pid
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        status = dict(
            line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
        )
        return {
            "cpu_seconds": (int(fields[11]) + int(fields[12])) / ticks,
            "rss_mib": int(status["VmRSS"].split()[0]) / 1024,
            "peak_rss_mib": int(status["VmHWM"].split()[0]) / 1024,
        }

    def stop_operator(self, kill: bool = False) -> None:
        if self.operator is not None and self.operator.poll() is None:
            os.killpg(self.operator.pid, signal.SIGKILL if kill else signal.SIGTERM)
            self.operator.wait(timeout=15)
        self.operator = None

    # ------------------------------------------------------------------------------------ reads

    def pool(self, name: str) -> dict[str, Any]:
        assert self.custom is not None
        result = self.custom.get_namespaced_custom_object(
            "inference.sluice.dev", "v1alpha1", self.namespace, "inferencepools", name
        )
        return cast(dict[str, Any], result)

    def istio(self, plural: str, name: str, version: str = "v1") -> dict[str, Any] | None:
        assert self.custom is not None
        try:
            result = self.custom.get_namespaced_custom_object(
                "networking.istio.io", version, self.namespace, plural, name
            )
        except k8s.ApiException as failure:
            if failure.status == 404:
                return None
            raise
        return cast(dict[str, Any], result)

    def events(self, reason: str | None = None) -> list[dict[str, Any]]:
        assert self.core is not None
        items = self.core.list_namespaced_event(self.namespace, _preload_content=False)
        events: list[dict[str, Any]] = json.loads(cast(Any, items).data)["items"]
        return [e for e in events if reason is None or e.get("reason") == reason]

    # ------------------------------------------------------------------------------------ helpers

    def _wait_for(self, ready: Any, seconds: float, what: str, process: subprocess.Popen[bytes] | None = None) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if ready():
                return
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{what} exited with status {process.returncode}")
            time.sleep(0.1)
        raise TimeoutError(f"{what} not ready after {seconds:.0f}s")

    def stop_kubelet(self) -> None:
        """Stop the kubelet loop (pods are no longer restarted or watched; from the stack's event loop)."""
        self._kubelet_stop.set()

    def wait_http(self, url: str, seconds: float, what: str) -> None:
        """Until `url` answers 200 (`seconds` at most, then an error naming `what`)."""
        import urllib.request  # noqa: PLC0415

        def ok() -> bool:
            try:
                with urllib.request.urlopen(url, timeout=1) as answer:
                    return bool(answer.status == 200)
            except OSError:
                return False

        self._wait_for(ok, seconds, what)


# ---------------------------------------------------------------------------------------- traffic


async def stream_completion(
    http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
) -> tuple[float | None, bool]:
    """One streamed completion: (time to the first SSE chunk, whether it completed). Errors are (None, False)."""
    ttft, ok, _ = await attempt_completion(http, url, prompt, max_tokens)
    return ttft, ok


async def attempt_completion(
    http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
) -> tuple[float | None, bool, str | None]:
    """One attempt: (TTFT, completed, the Envoy retry condition it failed with before any response byte, if any).

    The conditions are Envoy's `retryOn` names: `connect-failure` (no connection), `reset` (dropped before the
    response headers), `gateway-error` (502/503/504), or the status code of another error answer ("500"). A
    failure after the response started has none: Envoy never retries once it has sent the client part of an answer.
    """
    started = time.monotonic()
    ttft: float | None = None
    headers_seen = False
    try:
        async with http.post(url, json={"prompt": prompt, "max_tokens": max_tokens, "stream": True}) as answer:
            headers_seen = True
            if answer.status != 200:
                return None, False, "gateway-error" if answer.status in (502, 503, 504) else str(answer.status)
            async for line in answer.content:
                if ttft is None and line.startswith(b"data:"):
                    ttft = time.monotonic() - started
    except aiohttp.ClientConnectorError:
        return None, False, "connect-failure"
    except (aiohttp.ClientError, TimeoutError):
        return ttft, False, None if headers_seen else "reset"
    return ttft, True, None


@dataclass
class Sample:
    at: float
    pod: str
    revision: str
    ttft: float | None
    ok: bool
    attempts: int = 1
    condition: str | None = None
    """How the last attempt failed before any response byte (an Envoy `retryOn` name, or the status code of another
    error answer, e.g. "500"); None: it did not, or it failed after the answer had started (never retried)."""
    first: str = ""
    """The pod its first attempt went to (`pod` is the last attempt's)."""
    tester: bool = False
    """The request carried the tester headers (`Traffic.tester_headers`)."""
    user: str | None = None
    """The user key it carried (`Traffic.user_header`), if any."""


@dataclass(frozen=True)
class RetryPolicy:
    """The VirtualService route's `retries`, as Envoy applies them."""

    attempts: int = 0
    retry_on: frozenset[str] = frozenset()
    ignore_previous_hosts: bool = True

    def retries(self, condition: str | None) -> bool:
        """Whether Envoy retries an attempt that failed so: its retryOn name, a status code listed (istiod's
        retriable_status_codes), or any 5xx, reset or connection failure under `5xx`."""
        if condition is None:
            return False
        if condition in self.retry_on:
            return True
        server_error = condition in ("gateway-error", "reset", "connect-failure", "refused-stream") or (
            condition.isdigit() and condition.startswith("5")
        )
        return "5xx" in self.retry_on and server_error

    @classmethod
    def of(cls, retries: dict[str, Any] | None) -> RetryPolicy:
        if not retries:
            return cls()
        return cls(
            attempts=int(retries.get("attempts", 0)),
            retry_on=frozenset(filter(None, str(retries.get("retryOn", "")).split(","))),
            ignore_previous_hosts=bool(retries.get("retryIgnorePreviousHosts", False)),
        )


@dataclass(frozen=True)
class MirrorRoute:
    """One of the VirtualService route's `mirrors`: the revision of its subset and the share of requests copied."""

    revision: str
    percent: float


def user_key(index: int) -> str:
    """User `index`'s key: 16 hex digits, as a random session or user id looks (the same for every request)."""
    return hashlib.sha256(f"user-{index}".encode()).hexdigest()[:16]


def headers_match(headers: dict[str, str], conditions: dict[str, dict[str, str]]) -> bool:
    """Envoy's header matching for one Istio match entry: every condition holds (exact, prefix, or a regex that
    matches the whole value, RE2 as Envoy's safe_regex); a missing header matches none."""
    for name, condition in conditions.items():
        value = headers.get(name)
        if value is None:
            return False
        kind, wanted = next(iter(condition.items()))
        if kind == "exact" and value != wanted:
            return False
        if kind == "prefix" and not value.startswith(wanted):
            return False
        if kind == "regex" and re2.fullmatch(wanted, value) is None:
            return False
    return True


@dataclass
class Traffic:
    """Bounded load through the published routing: revision split, then weighted least-request, the route's
    retry policy (another pod, on failures before the response starts) and its request mirrors as Envoy applies
    them (a copy sent once per request, before any retry, whose answer nobody sees)."""

    stack: Stack
    pool: str
    rate: float = 6.0
    max_tokens: int = 32
    samples: deque[Sample] = field(default_factory=lambda: deque(maxlen=20000))
    active: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    routes: tuple[dict[str, int], dict[str, list[tuple[str, str, int]]]] = field(default=({}, {}))
    retries: RetryPolicy = field(default_factory=RetryPolicy)
    mirrors: tuple[MirrorRoute, ...] = ()
    served: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Per pod: attempts of user requests sent to it (retries included) — the answers users got."""
    mirrored: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Per pod: mirror copies sent to it (answers discarded)."""
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    seed: int = 7
    tester_share: float = 0.0
    """Share of requests sent with `tester_headers` (testers steered by the canary's header routes)."""
    tester_headers: dict[str, str] = field(default_factory=lambda: {"x-sluice-tester": "yes"})
    user_header: str | None = None
    """Every request carries a user key in this header, drawn from `users` users (each the same key every time)."""
    users: int = 200
    matched: tuple[tuple[tuple[dict[str, dict[str, str]], ...], dict[str, int]], ...] = ()
    """The header routes ahead of the weighted one, in order: (their match entries, their split)."""

    def refresh_routes(self) -> None:
        """Read the ServiceEntry (per-pod weights) and VirtualService (revision split) sluice wrote."""
        name = object_name(PoolRef(self.pool, self.stack.namespace))
        entry = self.stack.istio(SERVICE_ENTRY.plural, name)
        service = self.stack.istio(VIRTUAL_SERVICE.plural, name)
        if entry is None:
            return
        pods = {state.spec.ip: pod for pod, state in self.stack.pods.items()}
        by_revision: dict[str, list[tuple[str, str, int]]] = defaultdict(list)
        for endpoint in entry["spec"].get("endpoints", []):
            revision = endpoint.get("labels", {}).get("sluice.dev/revision", "")
            by_revision[revision].append(
                (
                    pods.get(endpoint["address"], endpoint["address"]),
                    endpoint["address"],
                    int(endpoint.get("weight", 1)),
                )
            )
        revision_of = {subset_name(revision): revision for revision in by_revision if revision}

        def split_of(route: dict[str, Any]) -> dict[str, int]:
            split: dict[str, int] = {}
            for target in route.get("route", []):
                subset = target["destination"].get("subset")
                split[revision_of.get(subset, subset) if subset else ""] = int(target.get("weight", 100))
            return split

        http = (service or {}).get("spec", {}).get("http", [{}])
        # Envoy tries the routes in order: the first whose match holds (or that has none) takes the request.
        self.matched = tuple(
            (tuple(entry.get("headers") or {} for entry in route["match"]), split_of(route))
            for route in http
            if route.get("match")
        )
        http_route: dict[str, Any] = next((route for route in http if not route.get("match")), {})
        self.retries = RetryPolicy.of(http_route.get("retries"))
        split = split_of(http_route)
        self.mirrors = tuple(
            MirrorRoute(
                revision_of.get(mirror["destination"].get("subset", ""), ""),
                float(mirror.get("percentage", {}).get("value", 100.0)),
            )
            for mirror in http_route.get("mirrors", [])
        )
        self.routes = (split, dict(by_revision))

    def pick_mirror(self, rng: random.Random, revision: str) -> tuple[str, str] | None:
        """A pod of the mirror's subset, by the same weighted least-request; None when the subset has none."""
        endpoints = self.routes[1].get(revision) if revision else None
        if not endpoints:
            return None  # Envoy: no healthy upstream in the mirror cluster, the copy is dropped
        effective = [w / (self.active[pod] + 1) for pod, _, w in endpoints]
        pod, ip, _ = rng.choices(endpoints, weights=effective)[0]
        return pod, ip

    def pick(
        self, rng: random.Random, avoid: frozenset[str] = frozenset(), headers: dict[str, str] | None = None
    ) -> tuple[str, str, str] | None:
        split, by_revision = self.routes
        for entries, route_split in self.matched:
            if any(headers_match(headers or {}, entry) for entry in entries):
                split = route_split
                break
        if avoid:  # a retry that ignores previous hosts
            by_revision = {r: [e for e in group if e[0] not in avoid] for r, group in by_revision.items()}
            by_revision = {r: group for r, group in by_revision.items() if group}
        if not by_revision:
            return None
        if split and "" not in split:
            revisions = [r for r in split if split[r] > 0 and by_revision.get(r)]
            if not revisions:
                return None
            revision = rng.choices(revisions, weights=[split[r] for r in revisions])[0]
            endpoints = by_revision[revision]
        else:
            revision, endpoints = "", [e for group in by_revision.values() for e in group]
        # Envoy LEAST_REQUEST with unequal weights: effective weight w / (active + 1).
        effective = [w / (self.active[pod] + 1) for pod, _, w in endpoints]
        pod, ip, _ = rng.choices(endpoints, weights=effective)[0]
        return pod, ip, revision or self.stack.pods[pod].spec.revision if pod in self.stack.pods else revision

    async def run(self, seconds: float) -> None:
        rng = random.Random(self.seed)
        prompt = "w " * PROMPT_WORDS
        end = time.monotonic() + min(seconds, self.stack.remaining())
        tasks: set[asyncio.Task[None]] = set()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            refresh = asyncio.create_task(self._refresh_loop())
            try:
                while time.monotonic() < end and not self.stop.is_set():
                    await asyncio.sleep(rng.expovariate(self.rate))
                    headers = dict(self.tester_headers) if rng.random() < self.tester_share else {}
                    if self.user_header is not None:
                        headers[self.user_header] = user_key(rng.randrange(self.users))
                    choice = self.pick(rng, headers=headers)
                    if choice is None or len(tasks) > 200:
                        continue
                    task = asyncio.create_task(self._one(http, prompt, *choice, headers=headers))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    for mirror in self.mirrors:
                        target = self.pick_mirror(rng, mirror.revision) if rng.random() * 100 < mirror.percent else None
                        if target is not None:
                            copy = asyncio.create_task(self._mirror(http, prompt, *target))
                            tasks.add(copy)
                            copy.add_done_callback(tasks.discard)
            finally:
                refresh.cancel()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, refresh, return_exceptions=True)

    async def _refresh_loop(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.refresh_routes)
            await asyncio.sleep(0.5)

    async def _mirror(self, http: aiohttp.ClientSession, prompt: str, pod: str, ip: str) -> None:
        """A mirror copy: sent, answered in full by the pod, and thrown away (never retried, never a sample)."""
        self.mirrored[pod] += 1
        self.active[pod] += 1
        try:
            await attempt_completion(http, f"http://{ip}:8000/v1/completions", prompt, self.max_tokens)
        finally:
            self.active[pod] -= 1

    async def _one(
        self,
        http: aiohttp.ClientSession,
        prompt: str,
        pod: str,
        ip: str,
        revision: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        headers = headers or {}
        policy, tried, attempts, first = self.retries, {pod}, 1, pod
        rng = random.Random(hash((pod, time.monotonic())))
        while True:
            self.served[pod] += 1
            self.active[pod] += 1
            try:
                url = f"http://{ip}:8000/v1/completions"
                ttft, ok, condition = await attempt_completion(http, url, prompt, self.max_tokens)
            finally:
                self.active[pod] -= 1
            if ok or not policy.retries(condition) or attempts > policy.attempts:
                break
            retry = self.pick(rng, frozenset(tried) if policy.ignore_previous_hosts else frozenset(), headers)
            if retry is None:
                break
            pod, ip, revision = retry
            tried.add(pod)
            attempts += 1
        tester = bool(self.tester_headers) and all(headers.get(k) == v for k, v in self.tester_headers.items())
        user = headers.get(self.user_header) if self.user_header else None
        self.samples.append(
            Sample(time.monotonic(), pod, revision, ttft, ok, attempts, condition, first, tester=tester, user=user)
        )

    def finished(self) -> list[Sample]:
        """The samples so far, copied in one step: the traffic's loop appends from its own thread, and iterating
        the deque while it does raises."""
        return list(self.samples)

    def failures(self, since: float, until: float | None = None, retriable: bool = False) -> tuple[int, int]:
        """(failed, all) requests finished in the window; `retriable`: only the failures before any response
        byte (those a retry policy can turn into a retry)."""
        recent = [s for s in self.finished() if s.at >= since and (until is None or s.at <= until)]
        return sum(1 for s in recent if not s.ok and (not retriable or s.condition is not None)), len(recent)

    def share(self, since: float, key: str = "pod") -> dict[str, float]:
        recent = [s for s in self.finished() if s.at >= since]
        counts: dict[str, int] = defaultdict(int)
        for sample in recent:
            counts[getattr(sample, key)] += 1
        total = sum(counts.values()) or 1
        return {k: v / total for k, v in sorted(counts.items())}
