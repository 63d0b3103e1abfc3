"""Pools per replica: N pools on the local stack run by R operator processes (`--shards R`), passes/s and CPU each.

    python benchmarks/bench_shards.py --pools 200 --replicas 1 2 4 [--interval 10] [--measure 60] [--out DIR]
        [--api-pressure]

The local stack is the real one (API emulator, real Prometheus, two simulated vLLM pods every pool selects).
For each replica count it starts a fresh stack, creates the pools, starts the processes (each with
`--shards R`; one process runs with the default, no Leases), waits for every pool's first pass, then counts the
passes each process made over `--measure` seconds (its `sluice_reconcile_total`) and the CPU seconds each used
(/proc). Expected passes/s is pools / interval: a fleet that keeps up makes that many. Everything runs on this
machine, so the emulator and Prometheus share its cores with the operators: the figures are this machine's.

`--api-pressure` measures under the API server a control plane under load presents (issue "keeps working when
the cluster misbehaves"): from the first round on, the emulator answers the operators' requests with latency
(p50 0.3 s, p99 2 s) and a 429 with `Retry-After: 1` on every 20th (5 %) — the chaos matrix's api-latency and
api-429 rules together (`sluice.devstack.chaoscases`). Every 2 s of the measured window it reads each pool's
`sluice_last_pass_timestamp_seconds` from every replica and reports the age of each pool's last pass at its
oldest, in intervals: the target is every pool younger than 3.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from sluice.cli import build_parser
from sluice.devstack.chaoscases import LATENCY, THROTTLE, install_plan, operator_only, served_by_rule
from sluice.devstack.kubelet import PodSpec
from sluice.devstack.metricspage import operator_page, samples
from sluice.devstack.stack import ROOT, Stack, free_port

PODS = [PodSpec("llama-a100-0", "a100", "v1", "127.0.20.1"), PodSpec("llama-4090-0", "rtx4090", "v1", "127.0.20.2")]


def pool_body(name: str, prometheus: str, interval: int) -> dict[str, Any]:
    base = yaml.safe_load((ROOT / "examples" / "local" / "pool.yaml").read_text().replace("PROMETHEUS_URL", prometheus))
    base["metadata"]["name"] = name
    base["spec"]["interval"] = f"{interval}s"
    base["spec"].pop("canary", None)
    return dict(base)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def passes(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("sluice_reconcile_total{")
    )


def last_passes(port: int) -> dict[str, float]:
    """Each pool's last pass start (Unix time) as one replica's /metrics says (nothing while it cannot be read)."""
    prefix = 'sluice_last_pass_timestamp_seconds{pool="'
    return {
        series[len(prefix) :].split('"', 1)[0]: value
        for series, value in samples(operator_page(port)).items()
        if series.startswith(prefix)
    }


def watch_ages(ports: list[int], seconds: float, pools: int) -> dict[str, float]:
    """Sample every pool's last pass every 2 s over `seconds` (an age can grow up to 2 s between samples): the
    oldest age each pool's last pass reached (a pool no replica reports counts from the window's start)."""
    start = time.time()
    oldest: dict[str, float] = {}
    while time.time() - start < seconds:
        newest: dict[str, float] = {}
        for port in ports:
            for pool, at in last_passes(port).items():
                newest[pool] = max(at, newest.get(pool, 0.0))
        now = time.time()
        for pool, at in newest.items():
            oldest[pool] = max(oldest.get(pool, 0.0), now - at)
        for i in range(pools):
            name = f"llm/pool-{i:04d}"
            if name not in newest:
                oldest[name] = max(oldest.get(name, 0.0), now - start)
        time.sleep(2.0)
    return oldest


def run_one(
    pools: int,
    replicas: int,
    interval: int,
    measure: float,
    warmup: float,
    pressure: bool = False,
    workers: int | None = None,
) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-shards-{pools}-{replicas}-"))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    with Stack(workdir, deadline_seconds=3600) as stack:
        asyncio.run_coroutine_threadsafe(stack.kubelet(), loop)
        for pod in PODS:
            stack.add_pod(pod)
        stack.wait_ready([p.name for p in PODS])
        assert stack.custom is not None
        started = time.monotonic()
        for i in range(pools):
            body = pool_body(f"pool-{i:04d}", stack.prometheus_url, interval)
            stack.custom.create_namespaced_custom_object(
                "inference.sluice.dev", "v1alpha1", "llm", "inferencepools", body
            )
        created = time.monotonic() - started
        ports = [free_port() for _ in range(replicas)]
        processes = []
        for n, port in enumerate(ports):
            command = [sys.executable, "-m", "sluice", "operator", "-n", "llm", "--kubeconfig", str(stack.kubeconfig)]
            command += ["--metrics-port", str(port), "--metrics-address", "127.0.0.1", "--log-level", "warning"]
            command += ["--workers", str(workers)] if workers is not None else []
            if replicas > 1:
                command += ["--shards", str(replicas), "--lease-namespace", "llm", "--identity", f"bench-{n}"]
            processes.append(stack.spawn(command, f"operator-{n}.log"))
        deadline = time.monotonic() + warmup
        while time.monotonic() < deadline:  # every pool passed once (or the warm-up ran out)
            time.sleep(2)
            try:
                if sum(passes(p) for p in ports) >= pools:
                    break
            except OSError:
                continue
        first_round = time.monotonic() - (deadline - warmup)
        if pressure:
            install_plan(stack, [operator_only(LATENCY), operator_only(THROTTLE)])
        before = [(passes(p), cpu_seconds(proc.pid)) for p, proc in zip(ports, processes, strict=True)]
        api_before = cpu_seconds(stack.processes[0].pid)
        window_start = time.monotonic()
        oldest = watch_ages(ports, measure, pools) if pressure else {}
        if not pressure:
            time.sleep(measure)
        after = [(passes(p), cpu_seconds(proc.pid)) for p, proc in zip(ports, processes, strict=True)]
        measured = time.monotonic() - window_start  # the sampling runs past `measure` by up to a sample
        api_cpu = (cpu_seconds(stack.processes[0].pid) - api_before) / measured
        served = served_by_rule(stack) if pressure else {}
        per_process = [
            {"passes_per_s": (a[0] - b[0]) / measured, "cpu_per_s": (a[1] - b[1]) / measured}
            for b, a in zip(before, after, strict=True)
        ]
    loop.call_soon_threadsafe(loop.stop)
    total = sum(p["passes_per_s"] for p in per_process)
    ages = sorted(age / interval for age in oldest.values())
    pressure_figures = (
        {
            "api_pressure": "latency p50 0.3 s, p99 2 s; 429 Retry-After 1 on every 20th request",
            "faults_served": served,
            "oldest_last_pass_intervals": round(ages[-1], 2),
            "median_oldest_last_pass_intervals": round(ages[len(ages) // 2], 2),
            "pools_younger_than_3_intervals": sum(1 for a in ages if a < 3.0),
            "oldest_pools": {
                pool: round(age / interval, 2) for pool, age in sorted(oldest.items(), key=lambda kv: -kv[1])[:5]
            },
        }
        if ages
        else {}
    )
    return {
        **pressure_figures,
        "pools": pools,
        "replicas": replicas,
        "workers": workers or build_parser().parse_args(["operator"]).workers,
        "interval_s": interval,
        "expected_passes_per_s": pools / interval,
        "passes_per_s": round(total, 2),
        "keeps_up": total >= 0.95 * pools / interval,
        "per_process": [{k: round(v, 3) for k, v in p.items()} for p in per_process],
        "apiserver_cpu_per_s": round(api_cpu, 3),
        "create_seconds": round(created, 1),
        "first_round_seconds": round(first_round, 1),
        "measure_seconds": round(measured, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--pools", type=int, nargs="+", default=[200])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--measure", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=300.0)
    parser.add_argument("--out", default="out/bench-shards")
    parser.add_argument("--api-pressure", action="store_true", help="API latency (p99 2 s) and 5 %% 429s")
    parser.add_argument("--workers", type=int, help="each operator's --workers (default: the operator's)")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = []
    for pools in args.pools:
        for replicas in args.replicas:
            result = run_one(pools, replicas, args.interval, args.measure, args.warmup, args.api_pressure, args.workers)
            print(json.dumps(result), flush=True)
            results.append(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()}
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    body = {"machine": machine, "commit": commit or "unknown", "started": started, "results": results}
    (out / "results.json").write_text(json.dumps(body, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
