"""Pools per replica: N pools on the local stack run by R operator processes (`--shards R`), passes/s and CPU each.

    python benchmarks/bench_shards.py --pools 200 --replicas 1 2 4 [--interval 10] [--measure 60] [--out DIR]

The local stack is the real one (API emulator, real Prometheus, two simulated vLLM pods every pool selects).
For each replica count it starts a fresh stack, creates the pools, starts the processes (each with
`--shards R`; one process runs with the default, no Leases), waits for every pool's first pass, then counts the
passes each process made over `--measure` seconds (its `sluice_reconcile_total`) and the CPU seconds each used
(/proc). Expected passes/s is pools / interval: a fleet that keeps up makes that many. Everything runs on this
machine, so the emulator and Prometheus share its cores with the operators: the figures are this machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from sluice.devstack.kubelet import PodSpec
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


def run_one(pools: int, replicas: int, interval: int, measure: float, warmup: float) -> dict[str, Any]:
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
        before = [(passes(p), cpu_seconds(proc.pid)) for p, proc in zip(ports, processes, strict=True)]
        api_before = cpu_seconds(stack.processes[0].pid)
        time.sleep(measure)
        after = [(passes(p), cpu_seconds(proc.pid)) for p, proc in zip(ports, processes, strict=True)]
        api_cpu = (cpu_seconds(stack.processes[0].pid) - api_before) / measure
        per_process = [
            {"passes_per_s": (a[0] - b[0]) / measure, "cpu_per_s": (a[1] - b[1]) / measure}
            for b, a in zip(before, after, strict=True)
        ]
    loop.call_soon_threadsafe(loop.stop)
    total = sum(p["passes_per_s"] for p in per_process)
    return {
        "pools": pools,
        "replicas": replicas,
        "interval_s": interval,
        "expected_passes_per_s": pools / interval,
        "passes_per_s": round(total, 2),
        "keeps_up": total >= 0.95 * pools / interval,
        "per_process": [{k: round(v, 3) for k, v in p.items()} for p in per_process],
        "apiserver_cpu_per_s": round(api_cpu, 3),
        "create_seconds": round(created, 1),
        "first_round_seconds": round(first_round, 1),
        "measure_seconds": measure,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--pools", type=int, nargs="+", default=[200])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--measure", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=300.0)
    parser.add_argument("--out", default="out/bench-shards")
    args = parser.parse_args()
    results = []
    for pools in args.pools:
        for replicas in args.replicas:
            result = run_one(pools, replicas, args.interval, args.measure, args.warmup)
            print(json.dumps(result), flush=True)
            results.append(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()}
    (out / "results.json").write_text(json.dumps({"machine": machine, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
