"""The local stack: every part sluice talks to, running for real on loopback, for the demo and end-to-end tests.

Local-stack tool. `Stack` starts, supervises and stops what runs:
- the Kubernetes API emulator (`sluice.emulator.apiserver`, its own process, with a kubeconfig);
- real Prometheus (Debian package), scraping every simulated pod each second through file-based discovery, with
  `pod` and `namespace` labels as a Kubernetes scrape config would add;
- one simulated vLLM server per pod (`sluice.devstack.modelserver`), each on its own 127.0.0.x address and port
  8000, tended by a small kubelet (`sluice.devstack.kubelet`: readiness by real inference, crashes recorded,
  servers restarted);
- the operator (`python -m sluice operator`), its own process.
The load generator (`sluice.devstack.traffic.Traffic`) sends requests through what sluice published. Everything
binds to 127.0.0.0/8, has a deadline, and is stopped (by PID) when the stack closes.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import aiohttp
import yaml
from kubernetes import client as k8s

from sluice.devstack.kubelet import (
    PodSpec,
    PodState,
    memory_events_file,
    pod_manifest,
    pod_status,
    probe,
    read_oom_kills,
    run_kubelet,
    server_command,
    service_manifest,
)
from sluice.devstack.processes import StackClosing, answers_ok, stop_processes, wait_for
from sluice.io.kubereads import load_api_client

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


_LOWEST_PORT = 10000
_handed_out: set[int] = set()
_port_draw = random.Random()  # seeded from the OS: each process starts elsewhere


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections and `bind(port 0)` (Linux); its documented default elsewhere."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback port nothing listens on, for a server started next.

    Not from the kernel's ephemeral range: a port `bind(0)` hands out is free again once the probe closes, and any
    outgoing connection (a readiness poll, a scrape) may take it before the server binds it -- the race that made a
    real Envoy fail with "Address already in use". Below that range only listeners compete, and a port is handed
    out once per process (a random start keeps concurrent processes apart).
    """
    low, _ = _ephemeral_range()
    span = low - _LOWEST_PORT
    if span < 1000:  # an unusual range: fall back to the kernel's choice
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
            return port
    start = _port_draw.randrange(span)
    for step in range(span):
        candidate = _LOWEST_PORT + (start + step) % span
        if candidate in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", candidate))
            except OSError:
                continue
        _handed_out.add(candidate)
        return candidate
    raise RuntimeError(f"no free loopback port in {_LOWEST_PORT}..{low - 1}")


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
        workdir = workdir.resolve()  # Prometheus reads a relative file_sd path from its config file's directory
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

    def kube_env(self, kubeconfig: Path | None = None) -> dict[str, str]:
        """The environment for kubectl, Helm and the operator against this stack: its kubeconfig, and a discovery
        cache of its own (`KUBECACHEDIR`). kubectl caches discovery per host and port under ~/.kube/cache; a port
        an earlier stack used would otherwise be read with that stack's resources."""
        return {
            **os.environ,
            "KUBECONFIG": str(kubeconfig or self.kubeconfig),
            "KUBECACHEDIR": str(self.workdir / "kube-cache"),
        }

    def spawn(
        self,
        args: list[str],
        log: str,
        kubeconfig: Path | None = None,
        service: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start a process in its own session, output to `log` in the workdir. `service`: a server the others use
        (the API server, Prometheus), stopped last by `close`. `env`: variables set for it besides `kube_env`'s.
        Refused once `close` has begun."""
        if self._closing:
            raise StackClosing(f"the stack is closing: {args[0]} not started")
        handle = (self.workdir / log).open("ab")
        env = {**self.kube_env(kubeconfig), **(env or {})}
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
            stop_processes(list(reversed(clients)))
        finally:  # an interrupted first wave still stops the servers (they run in sessions of their own)
            stop_processes(list(reversed(services)))
            self.processes.clear()
            self._services.clear()

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
        wait_for(lambda: "ready " in log_path.read_text() if log_path.exists() else False, 30, "API emulator", process)
        self.api_url = log_path.read_text().split("ready ", 1)[1].split()[0]
        api = load_api_client(str(self.kubeconfig))
        self.core = k8s.CoreV1Api(api)
        self.custom = k8s.CustomObjectsApi(api)

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Real kubectl against the emulator."""
        binary = shutil.which("kubectl")
        if binary is None:
            raise FileNotFoundError("kubectl not found on PATH")
        env = self.kube_env()
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
        manifest: Any = pod_manifest(spec)  # the client sends a dict body as it is; its stubs name only V1Pod
        self.core.create_namespaced_pod(self.namespace, manifest)
        self._ensure_service(spec.app)
        self._start_server(state)
        self._report(state)
        self.write_targets()

    def _ensure_service(self, app: str) -> None:
        """The app's Service (`service_manifest`), created once."""
        assert self.core is not None
        if app in self._service_names:
            return
        manifest: Any = service_manifest(app)  # a dict body, sent as it is (the stubs name only V1Service)
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
                results = [await probe(http, self.pods[n].spec.ip) for n in names]
            return all(results)

        wait_for(lambda: asyncio.run(probe_all()), seconds, "model servers")

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
        """Start the pod's server (its container), not Ready until the kubelet's probe succeeds."""
        memory_events = memory_events_file(self.workdir, state.spec)
        state.oom_kills_at_start = read_oom_kills(memory_events)
        state.process = self.spawn(server_command(state.spec, memory_events), f"pod-{state.spec.name}.log")
        state.ready = False

    def _report(self, state: PodState) -> None:
        """Write the pod's status to the API, as a kubelet does."""
        assert self.core is not None
        with contextlib.suppress(k8s.ApiException):
            self.core.patch_namespaced_pod_status(state.spec.name, self.namespace, {"status": pod_status(state)})

    async def kubelet(self) -> None:
        """Probe readiness with real inference, record crashes, restart servers. Runs until the stack stops."""
        await run_kubelet(self)

    def kubelet_running(self) -> bool:
        """Whether the kubelet goes on: not stopped (`stop_kubelet`), the stack not closing, within its deadline."""
        return not self._kubelet_stop.is_set() and not self._closing and self.remaining() > 0

    def stop_kubelet(self) -> None:
        """Stop the kubelet loop (pods are no longer restarted or watched; from the stack's event loop)."""
        self._kubelet_stop.set()

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

    def wait_http(self, url: str, seconds: float, what: str) -> None:
        """Until `url` answers 200 (`seconds` at most, then an error naming `what`)."""
        wait_for(lambda: answers_ok(url), seconds, what)
