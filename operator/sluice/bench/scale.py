"""`make bench-scale`: what one operator process costs at 100 / 300 / 1000 pools, on the local stack.

Local-stack tool. Per run (one pool count):
- the Kubernetes API emulator (`sluice.emulator.apiserver`, its own process, with its audit log);
- N InferencePools of `--pods` pods each (engine vllm, `interval: 5s`), the pods written Ready with an IP and
  no server behind them (nothing here sends traffic);
- one metrics exporter in this process serving every pod's vLLM series (`pod` and `namespace` labels, as a
  Kubernetes scrape config adds them), each gauge and rate drawn again within ±10 % of its level at every
  scrape, and real Prometheus scraping it every 5 s (`honor_labels`, split into targets of 100 pools);
- `--replicas` operator processes (`python -m sluice operator`, `--shards` passed on when given);
- `--namespaces N` spreads the pools round-robin over N namespaces (`bench-000`, ...; the operators then watch
  every namespace): PromQL answers are shared per namespace, so this is the case where they are shared least.
After a warm-up (until every pool has a status and has passed within two intervals, at most `--warmup`
seconds; a report says when the limit ended it) it measures for `--seconds`: operator CPU (% of one core, from
/proc) and RSS, API requests/s by verb and resource (the emulator's audit log, this harness's own reads left
out), PromQL queries/s (Prometheus' own `prometheus_http_requests_total`), pass lag (`sluice_pass_lag_seconds`
from the operator's /metrics, over the window only), the age of every pool's `status.lastReconcileTime`
(sampled every 5 s), the Events created (by reason), the size of the operator's /metrics page, and the
emulator's and Prometheus' CPU.
Prints one row per pool count and writes `report.md` and `results.json` under `--out`.

`--code DIR` runs the emulator and the operator from another checkout's `operator/` directory (a baseline).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import statistics
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

import yaml

from sluice.devstack.stack import Stack, free_port

NAMESPACE = "bench"
NAMESPACES = 1
"""How many namespaces the pools are spread over (`--namespaces`): one, `bench`, or `bench-000`, `bench-001`, ..."""
BENCH_AGENT = "sluice-bench"
POOLS_PER_TARGET = 100


@dataclass
class Result:
    pools: int
    pods: int
    replicas: int
    shards: int | None
    seconds: float
    operator_cpu_percent: float
    operator_rss_mib: float
    passes_per_second: float
    wanted_per_second: float
    api_requests_per_second: float
    api_by_verb: dict[str, float]
    promql_per_second: float
    lag_p50: float | None
    lag_max: float | None
    age_p50: float | None
    age_max: float | None
    pass_age_p50: float | None
    """now - `sluice_last_pass_timestamp_seconds` per pool (None: the operator has no such series)."""
    pass_age_max: float | None
    pools_with_status: int
    metrics_page_kib: float
    metrics_series: int
    apiserver_cpu_percent: float
    prometheus_cpu_percent: float
    load_average: tuple[float, float, float]
    notes: list[str] = field(default_factory=list)
    gc_percent: float | None = None
    namespaces: int = 1
    events_by_reason: dict[str, int] = field(default_factory=dict)
    """Events the operators created during the window, by reason."""
    unavailable: dict[str, int] = field(default_factory=dict)
    """Pools whose `MetricsAvailable` was False at the end of the window, by its reason (weights frozen)."""
    unavailable_messages: dict[str, int] = field(default_factory=dict)
    """The same pools by the condition's message, numbers shown as #: the three most common."""
    """Time the operators' garbage collector held them (`sluice_gc_pause_seconds_total`), % of one core."""
    full_gc_per_second: float | None = None


# ---------------------------------------------------------------------------------------------- exporter


def namespace_of(pool: int, namespaces: int = 1) -> str:
    """Pool `pool`'s namespace when the pools are spread round-robin over `namespaces`."""
    return NAMESPACE if namespaces <= 1 else f"{NAMESPACE}-{pool % namespaces:03d}"


class Exporter:
    """Every simulated pod's vLLM series, `POOLS_PER_TARGET` pools per scrape target (`?part=i`)."""

    def __init__(self, pools: int, pods: int, seed: int = 1, namespaces: int = 1) -> None:
        self.rng = random.Random(seed)
        self.parts: list[list[str]] = []
        names = [pod_name(p, i) for p in range(pools) for i in range(pods)]
        self.namespace = {pod_name(p, i): namespace_of(p, namespaces) for p in range(pools) for i in range(pods)}
        per_part = POOLS_PER_TARGET * pods
        self.parts = [names[i : i + per_part] for i in range(0, len(names), per_part)]
        self.counters: dict[str, list[float]] = {name: [0.0, 0.0, 0.0, 0.0, 0.0] for name in names}
        self.last: dict[int, float] = {}
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.abandoned = 0
        """Scrapes Prometheus gave up on before this exporter had answered (its scrape timeout): their series
        go stale, and the pools' queries find no data (the harness, not the operator, was too slow)."""

    def render(self, part: int) -> bytes:
        now = time.monotonic()
        with self.lock:
            elapsed = min(30.0, now - self.last.get(part, now - 5.0))
            self.last[part] = now
            lines: list[str] = []
            for name in self.parts[part]:
                jitter = self.rng.uniform
                labels = f'pod="{name}",namespace="{self.namespace[name]}"'
                c = self.counters[name]
                requests = 4.0 * jitter(0.9, 1.1) * elapsed
                ttft = 0.3 * jitter(0.9, 1.1)
                c[0] += requests  # request count
                c[1] += requests * ttft  # ttft sum
                c[2] += requests * 0.6  # ttft <= 0.25 s
                c[3] += requests * 0.95  # ttft <= 1 s
                lines += [
                    f"vllm:num_requests_running{{{labels}}} {8 * jitter(0.9, 1.1):.3f}",
                    f"vllm:num_requests_waiting{{{labels}}} {2 * jitter(0.9, 1.1):.3f}",
                    f"vllm:kv_cache_usage_perc{{{labels}}} {0.5 * jitter(0.9, 1.1):.4f}",
                    f'vllm:time_to_first_token_seconds_bucket{{{labels},le="0.25"}} {c[2]:.1f}',
                    f'vllm:time_to_first_token_seconds_bucket{{{labels},le="1.0"}} {c[3]:.1f}',
                    f'vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} {c[0]:.1f}',
                    f"vllm:time_to_first_token_seconds_sum{{{labels}}} {c[1]:.3f}",
                    f"vllm:time_to_first_token_seconds_count{{{labels}}} {c[0]:.1f}",
                    f'vllm:request_success_total{{{labels},finished_reason="stop"}} {c[0]:.1f}',
                    f'http_requests_total{{{labels},handler="/v1/completions",status="2xx"}} {c[0]:.1f}',
                ]
        return ("\n".join(lines) + "\n").encode()

    def start(self) -> int:
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                part = int(self.path.rsplit("part=", 1)[-1]) if "part=" in self.path else 0
                body = exporter.render(part) if part < len(exporter.parts) else b""
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    with exporter.lock:
                        exporter.abandoned += 1

            def log_message(self, *_: Any) -> None:
                return

        port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, name="exporter", daemon=True).start()
        return port

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def pod_name(pool: int, index: int) -> str:
    return f"pool-{pool:04d}-{index:02d}"


def pool_name(pool: int) -> str:
    return f"pool-{pool:04d}"


# ---------------------------------------------------------------------------------------------- the stack


def start_prometheus(stack: Stack, exporter_port: int, parts: int) -> str:
    home = stack.workdir / "prometheus"
    home.mkdir(parents=True, exist_ok=True)
    config = {
        "global": {"scrape_interval": "5s", "evaluation_interval": "5s", "scrape_timeout": "4s"},
        "scrape_configs": [
            {
                "job_name": f"part-{i}",
                "honor_labels": True,
                "params": {"part": [str(i)]},
                "static_configs": [{"targets": [f"127.0.0.1:{exporter_port}"]}],
            }
            for i in range(parts)
        ],
    }
    (home / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    stack.spawn(
        [
            "/usr/bin/prometheus",
            f"--config.file={home / 'prometheus.yml'}",
            f"--storage.tsdb.path={home / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=1h",
            "--log.level=warn",
        ],
        "prometheus.log",
        service=True,
    )
    url = f"http://127.0.0.1:{port}"
    stack.wait_http(f"{url}/-/ready", 60, "Prometheus")
    return url


def pool_manifest(
    index: int, pods: int, prometheus_url: str, interval: float, namespace: str = NAMESPACE, timeout: float = 4.0
) -> dict[str, Any]:
    del pods
    return {
        "apiVersion": "inference.sluice.dev/v1alpha1",
        "kind": "InferencePool",
        "metadata": {"name": pool_name(index), "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": {"app": pool_name(index)}},
            "targetPort": 8000,
            "service": pool_name(index),
            "engine": "vllm",
            "interval": f"{interval:g}s",
            "metrics": {
                "prometheusUrl": prometheus_url,
                "window": "30s",
                "staleAfter": "30s",
                "timeout": f"{timeout:g}s",
            },
            "capacity": {"classes": {"a100": 10}},
        },
    }


def pod_manifest(pool: int, index: int, octet: int) -> dict[str, Any]:
    n = pool * 64 + index
    ip = f"127.{octet}.{n // 250 % 250 + 1}.{n % 250 + 1}"
    started = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(pool, index),
            "labels": {"app": pool_name(pool), "sluice.dev/hardware-class": "a100", "sluice.dev/revision": "v1"},
        },
        "spec": {"containers": [{"name": "vllm", "image": "sluice/sim-vllm"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": started}],
            "containerStatuses": [
                {
                    "name": "vllm",
                    "ready": True,
                    "restartCount": 0,
                    "image": "sluice/sim-vllm",
                    "imageID": "",
                    "state": {"running": {"startedAt": started}},
                }
            ],
        },
    }


def populate(
    stack: Stack, pools: int, pods: int, prometheus_url: str, interval: float, namespaces: int = 1, timeout: float = 4.0
) -> None:
    assert stack.core is not None
    assert stack.custom is not None
    core, custom = stack.core, stack.custom
    core.api_client.user_agent = BENCH_AGENT
    octet = stack.address_octet

    def pool(p: int) -> None:
        namespace = namespace_of(p, namespaces)
        for i in range(pods):
            manifest: Any = pod_manifest(p, i, octet)
            core.create_namespaced_pod(namespace, manifest)
        custom.create_namespaced_custom_object(
            "inference.sluice.dev",
            "v1alpha1",
            namespace,
            "inferencepools",
            pool_manifest(p, pods, prometheus_url, interval, namespace, timeout),
        )

    if namespaces > 1:
        for name in sorted({namespace_of(p, namespaces) for p in range(pools)}):
            namespace: Any = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
            core.create_namespace(namespace)
    with ThreadPoolExecutor(max_workers=6) as workers:
        list(workers.map(pool, range(pools)))


# ---------------------------------------------------------------------------------------------- readings


def process_usage(pid: int) -> tuple[float, float]:
    """(CPU seconds, RSS MiB) of a process and its children so far, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0, 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    rss = next((int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0.0)
    return sum(int(f) for f in fields[11:15]) / ticks, rss


def http_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return str(answer.read().decode())


def prometheus_queries(url: str) -> float:
    """Instant and range queries Prometheus has answered so far."""
    total = 0.0
    for line in http_text(f"{url}/metrics").splitlines():
        if line.startswith("prometheus_http_requests_total{") and (
            'handler="/api/v1/query"' in line or 'handler="/api/v1/query_range"' in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def lag_buckets(text: str) -> dict[float, float]:
    """Cumulative `sluice_pass_lag_seconds` bucket counts summed over pools."""
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("sluice_pass_lag_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            bound = math.inf if le == "+Inf" else float(le)
            out[bound] = out.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def quantile_from_buckets(buckets: dict[float, float], q: float) -> tuple[float | None, float | None]:
    """(p-quantile, upper bound of the highest non-empty bucket) of a cumulative histogram."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None, None
    total = buckets[bounds[-1]]
    target = q * total
    lower, below, estimate = 0.0, 0.0, None
    for bound in bounds:
        count = buckets[bound]
        if estimate is None and count >= target:
            upper = bound if math.isfinite(bound) else lower
            share = (target - below) / (count - below) if count > below else 1.0
            estimate = lower + (upper - lower) * share
        if math.isfinite(bound):
            lower, below = bound, count
    highest = next((b for b in bounds if buckets[b] >= total), bounds[-1])
    return estimate, highest


def gauge_values(text: str, name: str) -> list[float]:
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]


def gc_totals(text: str) -> tuple[float, float] | None:
    """(seconds in every generation, full collections) from an operator's page; None when it exports neither."""
    seconds = gauge_values(text, "sluice_gc_pause_seconds_total")
    full = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('sluice_gc_collections_total{generation="2"}')
    ]
    return (sum(seconds), sum(full)) if seconds else None


def window_events(stack: Stack, since: datetime) -> dict[str, int]:
    """Events first seen at or after `since`, by reason (every namespace)."""
    assert stack.core is not None
    answer = stack.core.list_event_for_all_namespaces(_preload_content=False)
    reasons: Counter[str] = Counter()
    for item in json.loads(cast(Any, answer).data)["items"]:
        stamp = item.get("firstTimestamp") or item.get("eventTime")
        if stamp and datetime.fromisoformat(str(stamp).replace("Z", "+00:00")) >= since:
            reasons[str(item.get("reason"))] += 1
    return dict(sorted(reasons.items()))


def metrics_unavailable(stack: Stack) -> tuple[dict[str, int], dict[str, int]]:
    """Pools whose signals are not fresh (MetricsAvailable False: weights frozen), by the condition's reason, and
    the three most common messages (numbers as #, so that pools failing the same way count together)."""
    assert stack.custom is not None
    answer = stack.custom.list_cluster_custom_object(
        "inference.sluice.dev", "v1alpha1", "inferencepools", _preload_content=False
    )
    reasons: Counter[str] = Counter()
    messages: Counter[str] = Counter()
    for item in json.loads(cast(Any, answer).data)["items"]:
        for condition in (item.get("status") or {}).get("conditions") or []:
            if condition.get("type") == "MetricsAvailable" and condition.get("status") == "False":
                reasons[str(condition.get("reason"))] += 1
                messages[re.sub(r"\d+(\.\d+)?", "#", str(condition.get("message", "")))[:160]] += 1
    return dict(sorted(reasons.items())), dict(messages.most_common(3))


def passing(metrics_ports: list[int], pools: int, interval: float) -> bool | None:
    """Whether the operators have passed every pool within the last two intervals (their
    `sluice_last_pass_timestamp_seconds`); None when none exports it (an older operator under `--code`)."""
    stamps: list[float] = []
    for port in metrics_ports:
        stamps += gauge_values(http_text(f"http://127.0.0.1:{port}/metrics"), "sluice_last_pass_timestamp_seconds")
    if not stamps:
        return None
    now = time.time()
    return len(stamps) >= pools and all(now - stamp < 2 * interval for stamp in stamps)


def status_ages(stack: Stack) -> list[float]:
    assert stack.custom is not None
    answer = stack.custom.list_cluster_custom_object(
        "inference.sluice.dev", "v1alpha1", "inferencepools", _preload_content=False
    )
    items = json.loads(cast(Any, answer).data)["items"]
    now = datetime.now(UTC)
    ages = []
    for item in items:
        stamp = (item.get("status") or {}).get("lastReconcileTime")
        if stamp:
            ages.append((now - datetime.fromisoformat(stamp.replace("Z", "+00:00"))).total_seconds())
        else:
            ages.append(math.inf)
    return ages


def audit_counts(path: Path, offset: int) -> Counter[str]:
    counts: Counter[str] = Counter()
    with path.open("rb") as handle:
        handle.seek(offset)
        for line in handle:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if entry.get("userAgent", "").startswith(BENCH_AGENT):
                continue
            if entry.get("stage") == "ResponseComplete":  # the answer to a write already counted as a request
                continue
            resource = entry["resource"] + (f"/{entry['subresource']}" if entry.get("subresource") else "")
            counts[f"{entry['verb']} {resource}"] += 1
    return counts


# ---------------------------------------------------------------------------------------------- one run


def run(args: argparse.Namespace, pools: int) -> Result:
    workdir = Path(args.out).resolve() / f"pools-{pools}"
    workdir.mkdir(parents=True, exist_ok=True)
    for stale in ("audit.jsonl", "operator.log", "apiserver.log", "prometheus.log"):
        (workdir / stale).unlink(missing_ok=True)
    with contextlib.suppress(FileNotFoundError):
        for item in sorted((workdir / "prometheus" / "data").rglob("*"), reverse=True):
            item.unlink() if item.is_file() else item.rmdir()
    stack = Stack(workdir, namespace=NAMESPACE, deadline_seconds=args.warmup + args.seconds + 900)
    stack.apiserver_args = ["--watch-history", "100000"]
    exporter = Exporter(pools, args.pods, namespaces=args.namespaces)
    notes: list[str] = []
    try:
        stack.start_apiserver()
        prometheus_url = start_prometheus(stack, exporter.start(), len(exporter.parts))
        began = time.monotonic()
        populate(stack, pools, args.pods, prometheus_url, args.interval, args.namespaces, args.query_timeout)
        notes.append(f"created {pools} pools and {pools * args.pods} pods in {time.monotonic() - began:.0f}s")
        metrics_ports = [free_port() for _ in range(args.replicas)]
        operators = []
        for replica, port in enumerate(metrics_ports):
            command = [
                sys.executable,
                "-m",
                "sluice",
                "operator",
                *(["-n", NAMESPACE] if args.namespaces <= 1 else []),  # spread: every namespace (cluster-wide)
                "--kubeconfig",
                str(stack.kubeconfig),
            ]
            command += ["--metrics-port", str(port), "--metrics-address", "127.0.0.1", "--log-level", "warning"]
            if args.shards:
                command += ["--shards", str(args.shards)]
            if args.workers:
                command += ["--workers", str(args.workers)]
            if args.status_refresh is not None:
                command += ["--status-refresh", f"{args.status_refresh:g}"]
            operators.append(stack.spawn(command, f"operator-{replica}.log"))
        end_warmup = time.monotonic() + args.warmup
        steady = False
        while time.monotonic() < end_warmup and not steady:
            time.sleep(5)
            ages = status_ages(stack)
            if ages and all(math.isfinite(a) for a in ages) and len(ages) == pools:
                keeping_up = passing(metrics_ports, pools, args.interval)
                steady = keeping_up is None or keeping_up
        if not steady:
            notes.append(
                f"the warm-up ended at its limit ({args.warmup:g} s) before every pool had a status and had passed "
                "within two intervals: the window starts with a backlog"
            )
        time.sleep(args.interval)  # one more interval for the first writes to settle
        apiserver = stack.processes[0]
        prometheus = stack.processes[1]
        audit = workdir / "audit.jsonl"
        t0, wall0 = time.monotonic(), datetime.now(UTC)
        cpu0 = [process_usage(p.pid)[0] for p in operators]
        api_cpu0, prom_cpu0 = process_usage(apiserver.pid)[0], process_usage(prometheus.pid)[0]
        offset = audit.stat().st_size
        abandoned0 = exporter.abandoned
        queries0 = prometheus_queries(prometheus_url)
        texts0 = [http_text(f"http://127.0.0.1:{p}/metrics") for p in metrics_ports]
        lag0 = [lag_buckets(t) for t in texts0]
        ages_seen: list[float] = []
        pass_ages: list[float] = []
        lag_seen: list[float] = []
        while time.monotonic() - t0 < args.seconds:
            time.sleep(min(5.0, max(0.0, args.seconds - (time.monotonic() - t0))))
            ages_seen += status_ages(stack)
            for port in metrics_ports:
                text = http_text(f"http://127.0.0.1:{port}/metrics")
                now = time.time()
                pass_ages += [now - stamp for stamp in gauge_values(text, "sluice_last_pass_timestamp_seconds")]
                lag_seen += gauge_values(text, "sluice_pass_lag_last_seconds")
        elapsed = time.monotonic() - t0
        usage = [process_usage(p.pid) for p in operators]
        api_cpu1, prom_cpu1 = process_usage(apiserver.pid)[0], process_usage(prometheus.pid)[0]
        queries1 = prometheus_queries(prometheus_url)
        texts1 = [http_text(f"http://127.0.0.1:{p}/metrics") for p in metrics_ports]
        gc0, gc1 = [gc_totals(t) for t in texts0], [gc_totals(t) for t in texts1]
        gc_spent = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(gc0, gc1, strict=True) if a and b]
        time.sleep(1.0)  # the audit log is written from its own thread
        counts = audit_counts(audit, offset)
        events = window_events(stack, wall0)
        unavailable, unavailable_messages = metrics_unavailable(stack)
        lag: dict[float, float] = {}
        for before, text in zip(lag0, texts1, strict=True):
            for bound, count in lag_buckets(text).items():
                lag[bound] = lag.get(bound, 0.0) + count - before.get(bound, 0.0)
        lag_p50, lag_bound = quantile_from_buckets(lag, 0.5)
        lag_max = round(max(lag_seen), 2) if lag_seen else lag_bound  # sampled per pool, else the bucket bound
        if not lag_seen:
            notes.append("pass lag max: upper bound of the highest non-empty histogram bucket")
        passes = lag.get(math.inf, 0.0)
        finite = sorted(a for a in ages_seen if math.isfinite(a))
        load = os.getloadavg()
        if exporter.abandoned > abandoned0:
            notes.append(
                f"{exporter.abandoned - abandoned0} scrapes of the simulated pods abandoned by Prometheus in the "
                "window (this harness answered past the scrape timeout: those pods' series went stale)"
            )
        for process in operators:
            if process.poll() is not None:
                notes.append(f"an operator exited with status {process.returncode}")
        return Result(
            pools=pools,
            pods=args.pods,
            replicas=args.replicas,
            shards=args.shards,
            seconds=round(elapsed, 1),
            operator_cpu_percent=round(100 * sum(u[0] - c for u, c in zip(usage, cpu0, strict=True)) / elapsed, 1),
            operator_rss_mib=round(max(u[1] for u in usage), 1),
            passes_per_second=round(passes / elapsed, 1),
            wanted_per_second=round(pools / args.interval, 1),
            api_requests_per_second=round(sum(counts.values()) / elapsed, 1),
            api_by_verb={k: round(v / elapsed, 2) for k, v in sorted(counts.items())},
            promql_per_second=round((queries1 - queries0) / elapsed, 1),
            lag_p50=None if lag_p50 is None else round(lag_p50, 2),
            lag_max=lag_max,
            age_p50=round(statistics.median(finite), 1) if finite else None,
            age_max=round(max(ages_seen), 1) if ages_seen else None,
            pass_age_p50=round(statistics.median(pass_ages), 1) if pass_ages else None,
            pass_age_max=round(max(pass_ages), 1) if pass_ages else None,
            pools_with_status=sum(1 for a in status_ages(stack) if math.isfinite(a)),
            metrics_page_kib=round(max(len(t) for t in texts1) / 1024, 1),
            metrics_series=max(sum(1 for line in t.splitlines() if line and not line.startswith("#")) for t in texts1),
            apiserver_cpu_percent=round(100 * (api_cpu1 - api_cpu0) / elapsed, 1),
            prometheus_cpu_percent=round(100 * (prom_cpu1 - prom_cpu0) / elapsed, 1),
            load_average=(round(load[0], 2), round(load[1], 2), round(load[2], 2)),
            notes=notes,
            gc_percent=round(100 * sum(g[0] for g in gc_spent) / elapsed, 1) if gc_spent else None,
            namespaces=args.namespaces,
            events_by_reason=events,
            unavailable=unavailable,
            unavailable_messages=unavailable_messages,
            full_gc_per_second=round(sum(g[1] for g in gc_spent) / elapsed, 2) if gc_spent else None,
        )
    finally:
        stack.close()
        exporter.stop()


# ---------------------------------------------------------------------------------------------- report

HEADER = (
    "| pools | replicas | operator CPU (% of one core) | RSS MiB | passes/s done / wanted | pass lag p50 / max | "
    "`lastReconcileTime` age p50 / max | last pass age p50 / max | API req/s | PromQL q/s | "
    "emulator CPU | Prometheus CPU | /metrics | operator GC (% of one core; full collections/s) |"
)


def _s(value: float | None, unit: str = "") -> str:
    if value is None:
        return "–"
    if math.isinf(value):
        return "∞"
    return f"{value:g}{unit}"


def row(r: Result) -> str:
    replicas = f"{r.replicas}" + (f" (--shards {r.shards})" if r.shards else "")
    pools = f"{r.pools}" + (f" in {r.namespaces} namespaces" if r.namespaces > 1 else "")
    return (
        f"| {pools} | {replicas} | {r.operator_cpu_percent:g} % | {r.operator_rss_mib:g} | "
        f"{r.passes_per_second:g} / {r.wanted_per_second:g} | ≈{_s(r.lag_p50, ' s')} / {_s(r.lag_max, ' s')} | "
        f"{_s(r.age_p50, ' s')} / {_s(r.age_max, ' s')} | {_s(r.pass_age_p50, ' s')} / {_s(r.pass_age_max, ' s')} | "
        f"{r.api_requests_per_second:g} | {r.promql_per_second:g} | "
        f"{r.apiserver_cpu_percent:g} % | {r.prometheus_cpu_percent:g} % | "
        f"{r.metrics_series} series, {r.metrics_page_kib:g} KiB | "
        + ("–" if r.gc_percent is None else f"{r.gc_percent:g} %; {r.full_gc_per_second:g}/s")
        + " |"
    )


def report(results: list[Result], args: argparse.Namespace) -> str:
    lines = [
        "# bench-scale",
        "",
        f"{args.pods} pods per pool, `interval: {args.interval:g}s`, signals drawn within ±10 % at every scrape "
        f"(5 s); {args.seconds:g} s measured after warm-up; machine: {os.cpu_count()} cores, shared.",
        "",
        HEADER,
        "|" + "---|" * (HEADER.count("|") - 1),
        *[row(r) for r in results],
        "",
        "Pass lag p50 is interpolated in the `sluice_pass_lag_seconds` histogram over the window; its max is the "
        "largest `sluice_pass_lag_last_seconds` sampled every 5 s (an operator without it: the upper bound of the "
        "highest non-empty bucket). Ages are sampled every 5 s over every pool: `status.lastReconcileTime` (moves "
        "when the status is written) and `sluice_last_pass_timestamp_seconds` (every pass). API requests exclude "
        "this harness's own reads; emulator and Prometheus CPU are % of one core.",
        "",
    ]
    for r in results:
        lines.append(f"## {r.pools} pools: API requests/s by verb and resource")
        lines += [f"- `{k}`: {v:g}" for k, v in r.api_by_verb.items()]
        events = ", ".join(f"{reason} {count}" for reason, count in r.events_by_reason.items()) or "none"
        lines.append(f"- Events created in the window, by reason: {events}")
        frozen = ", ".join(f"{reason} {count}" for reason, count in r.unavailable.items()) or "none"
        lines.append(f"- pools with MetricsAvailable=False (weights frozen) at the end, by reason: {frozen}")
        for message, count in r.unavailable_messages.items():
            lines.append(f"  - {count} pools: {message}")
        lines.append(f"- load average at the end: {r.load_average}")
        lines += [f"- {note}" for note in r.notes]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sluice.bench.scale", description=__doc__.splitlines()[0])
    parser.add_argument("--pools", default="100,300,1000", help="comma-separated pool counts, one run each")
    parser.add_argument("--pods", type=int, default=16, help="pods per pool")
    parser.add_argument("--namespaces", type=int, default=1, help="spread the pools round-robin over this many")
    parser.add_argument(
        "--query-timeout",
        type=float,
        default=10.0,
        help="the pools' metrics.timeout, seconds: it bounds the namespace-wide queries (at 4 s, 16,000 pods in one "
        "namespace timed out here and every pool froze its weights)",
    )
    parser.add_argument("--interval", type=float, default=5.0, help="the pools' interval, seconds")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured window per run")
    parser.add_argument(
        "--warmup",
        type=float,
        default=120.0,
        help="longest wait for every pool's status and passes within two intervals",
    )
    parser.add_argument("--replicas", type=int, default=1, help="operator processes")
    parser.add_argument("--shards", type=int, help="passed to every operator as --shards (needs shard support)")
    parser.add_argument("--workers", type=int, help="passed to every operator as --workers")
    parser.add_argument(
        "--status-refresh", type=float, help="passed to every operator as --status-refresh (default: theirs)"
    )
    parser.add_argument("--code", help="run the emulator and the operator from this operator/ directory")
    parser.add_argument("--out", default="out/bench-scale")
    args = parser.parse_args(argv)
    if args.code:
        os.environ["PYTHONPATH"] = str(Path(args.code).resolve())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    print(HEADER, flush=True)
    for pools in [int(p) for p in args.pools.split(",") if p]:
        result = run(args, pools)
        results.append(result)
        print(row(result), flush=True)
    (out / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    (out / "report.md").write_text(report(results, args))
    print(f"report: {out / 'report.md'}")


if __name__ == "__main__":
    main()
