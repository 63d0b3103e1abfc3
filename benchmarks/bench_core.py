"""Plan time of the pure core: one reconcile pass (plan + Istio rendering) for pools of 8 to 4096 pods.

Prints a table and writes `report.md` and `results.json` to --out. Each figure is the median of repeated runs
of a steady-state pass (with the previous status, a canary in progress and a few failing pods), measured in one
process, side by side; the growth column is the ratio to the previous size's time per pod.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sluice.api.v1alpha1 import InferencePoolSpec
from sluice.core.observed import Observed, ObservedPod, PodSignals, SignalSnapshot
from sluice.core.reconcile import plan_pass
from sluice.istio.objects import PoolRef
from sluice.istio.render import render

SIZES = (8, 64, 512, 4096)
CLASSES = ("a100", "rtx4090", "cpu", "h100")
T0 = datetime(2026, 12, 1, tzinfo=UTC)


def make_pool(size: int) -> tuple[InferencePoolSpec, Observed]:
    spec = InferencePoolSpec.model_validate(
        {
            "selector": {"matchLabels": {"app": "llm"}},
            "targetPort": 8000,
            "service": "llm",
            "capacity": {"classes": {"a100": 10, "rtx4090": 4, "cpu": 1, "h100": 16}},
            "canary": {"stableRevision": "v1", "candidateRevision": "v2"},
            "routing": {"leastRequest": {}},
        }
    )
    pods, signals = [], {}
    for i in range(size):
        name = f"llm-{i:05d}"
        revision = "v2" if i % 10 == 0 else "v1"
        labels = {"app": "llm", "sluice.dev/hardware-class": CLASSES[i % 4], "sluice.dev/revision": revision}
        pods.append(ObservedPod(name=name, ip=f"10.{i // 65536}.{(i // 256) % 256}.{i % 256}", labels=labels))
        signals[name] = PodSignals(
            ttft_seconds=0.03 + (i % 17) * 0.01,
            ttft_p95_seconds=0.08 + (i % 17) * 0.02,
            kv_cache_usage=(i % 10) / 10,
            queue_length=float(i % 5),
            running_requests=float(i % 9),
            request_rate=5.0,
            error_rate=0.3 if i % 97 == 5 else 0.0,
        )
    return spec, Observed(pods=pods, signals=SignalSnapshot(collected_at=T0, pods=signals))


def measure(size: int, budget: float) -> dict[str, float]:
    spec, observed = make_pool(size)
    ref = PoolRef("llm", "bench")
    warm = plan_pass(spec, 1, observed, None, T0)
    previous = warm.status
    now = T0 + timedelta(seconds=5)
    snapshot = observed.model_copy(update={"signals": observed.signals.model_copy(update={"collected_at": now})})
    samples = []
    deadline = time.perf_counter() + budget
    while len(samples) < 5 or (time.perf_counter() < deadline and len(samples) < 200):
        start = time.perf_counter()
        plan = plan_pass(spec, 1, snapshot, previous, now)
        render(ref, spec, plan)
        samples.append(time.perf_counter() - start)
    median = statistics.median(samples)
    return {"pods": size, "runs": len(samples), "median_ms": median * 1000, "per_pod_us": median / size * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/bench-core")
    parser.add_argument("--budget", type=float, default=3.0, help="seconds of repeats per size")
    args = parser.parse_args()
    rows = [measure(size, args.budget) for size in SIZES]
    lines = [
        "| pods | runs | median plan+render | per pod | growth per pod vs previous size |",
        "|---|---|---|---|---|",
    ]
    previous = None
    for row in rows:
        growth = "-" if previous is None else f"{row['per_pod_us'] / previous['per_pod_us']:.2f}x"
        lines.append(
            f"| {row['pods']} | {row['runs']} | {row['median_ms']:.2f} ms | {row['per_pod_us']:.1f} us | {growth} |"
        )
        previous = row
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.python_implementation()} {platform.python_version()} on {platform.machine()}"
    (out / "results.json").write_text(json.dumps({"machine": machine, "results": rows}, indent=2) + "\n")
    (out / "report.md").write_text(
        "# sluice core plan time\n\n"
        f"One steady-state reconcile pass (plan + Istio rendering), median of repeated runs; {machine}.\n\n"
        + table
        + "\n"
    )
    print(f"report: {out / 'report.md'}")


if __name__ == "__main__":
    main()
