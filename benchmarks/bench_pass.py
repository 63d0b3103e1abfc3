"""CPU of one steady pass inside the operator process, for one or more versions of the code side by side.

What a pass costs apart from kopf and HTTP: the whole `Reconciler.run` (snapshot, signals, plan, rendering,
the comparison with the stored status, the writes it decides on) for a pool of 16 pods of one class at
`interval: 5s`, over an in-memory cluster, its signals drawn within ±10 % at every pass as `make bench-scale`
draws them. Each `--code` directory (an `operator/` source root, e.g. from `git archive REV operator`) runs in
its own process, the versions alternating `--rounds` times so that the machine's drift falls on all of them;
the figure is the median over rounds of CPU time per pass (`time.process_time`). The signals come from a stub,
not from `PromIO`: reading Prometheus' answers is measured by `bench_prom_decode.py`.

    PYTHONPATH=operator python benchmarks/bench_pass.py --code /tmp/old/operator --code operator
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sluice
from sluice.core.observed import ObservedPod, PodSignals, SignalSnapshot
from sluice.io.memory import MemoryCluster
from sluice.runtime.reconciler import Reconciler
from sluice.runtime.snapshots import SnapshotReader

SPEC = {
    "selector": {"matchLabels": {"app": "p"}},
    "targetPort": 8000,
    "service": "p",
    "engine": "vllm",
    "interval": "5s",
    "metrics": {"prometheusUrl": "http://prometheus:9090", "window": "30s", "staleAfter": "30s", "timeout": "4s"},
    "capacity": {"classes": {"a100": 10}},
}
PODS = 16


class Signals:
    """Every pod's signals drawn within ±10 % of their level at each pass."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def read_signals(self, spec: Any, namespace: str, pods: list[str], auth: Any, now: datetime) -> Any:
        def j(value: float) -> float:
            return value * self.rng.uniform(0.9, 1.1)

        readings = {
            name: PodSignals(
                ttft_seconds=j(0.3),
                ttft_p95_seconds=j(0.9),
                kv_cache_usage=j(0.5),
                queue_length=j(2.0),
                running_requests=j(8.0),
                request_rate=j(4.0),
                error_rate=0.0,
            )
            for name in pods
        }
        return SignalSnapshot(collected_at=now, pods=readings, answered_at={"errorRate": now})


def measure(passes: int, seed: int) -> float:
    """ms of CPU per pass, after a warm-up, in this process (the code on its PYTHONPATH)."""
    labels = {"app": "p", "sluice.dev/hardware-class": "a100", "sluice.dev/revision": "v1"}
    pods = [ObservedPod(name=f"p-{i:02d}", ip=f"10.0.0.{i + 1}", labels=labels) for i in range(PODS)]
    reconciler = Reconciler(MemoryCluster(pod_list=pods), Signals(seed))
    body = {"metadata": {"name": "p", "namespace": "bench", "uid": "u1", "generation": 1}, "spec": SPEC}
    reader = SnapshotReader()
    now = datetime(2026, 12, 1, tzinfo=UTC)

    def run(n: int) -> None:
        nonlocal now
        for _ in range(n):
            reconciler.run(reader.read(body, reconciler.written_at("u1")), now)
            now += timedelta(seconds=5)

    run(50)
    start = time.process_time()
    run(passes)
    return (time.process_time() - start) / passes * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", action="append", help="an operator/ source root (repeat to compare)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--passes", type=int, default=800)
    parser.add_argument("--out", default="out/bench-pass")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps({"ms": measure(args.passes, seed=1), "from": str(Path(sluice.__file__).resolve())}))
        return
    codes = args.code or ["operator"]
    samples: dict[str, list[float]] = {code: [] for code in codes}
    for _ in range(args.rounds):
        for code in codes:
            command = [sys.executable, __file__, "--child", "--passes", str(args.passes)]
            env = {"PYTHONPATH": str(Path(code).resolve()), "PATH": "/usr/bin:/bin"}
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False, timeout=600)
            if done.returncode != 0:
                raise SystemExit(f"{code}: the measuring process failed:\n{done.stderr}")
            answer = json.loads(done.stdout)
            if not Path(answer["from"]).is_relative_to(Path(code).resolve()):  # an installed sluice shadowed it
                raise SystemExit(f"{code}: the measuring process imported sluice from {answer['from']}")
            samples[code].append(answer["ms"])
    first = statistics.median(samples[codes[0]])
    lines = [f"{PODS}-pod pool, {args.passes} passes per run, {args.rounds} alternating rounds; ms of CPU per pass", ""]
    lines += ["| code | median | min – max | ratio to the first |", "|---|---|---|---|"]
    for code in codes:
        median = statistics.median(samples[code])
        lines.append(
            f"| `{code}` | {median:.2f} | {min(samples[code]):.2f} – {max(samples[code]):.2f} | {median / first:.2f} |"
        )
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(samples, indent=2) + "\n")


if __name__ == "__main__":
    main()
