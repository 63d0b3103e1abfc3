"""What a per-pod inbound limit can do past capacity: admitted P99 TTFT, served rate and refusals of fixed limits.

    python benchmarks/bench_admission_frontier.py --scenario benchmarks/scenarios/seed-000.yaml \
        [--loads 0.8,1.1,1.5,2] [--limits none,16,32,64] [--strategies least-request,sluice] [--retries 2]

Each variant replays the scenario's traces (its seeds) through the routing simulation (`sluice.bench.sim`) with
every pod's sidecar letting at most `limit` requests through to its engine at once (Istio's
`Sidecar.inboundConnectionPool`, `DataPlaneSpec.inbound_max_requests`); past it the sidecar answers 503 at once
and the caller's Envoy retries on a pod not tried before, `--retries` times (2: Istio's default route policy).
The limits are fixed and the same on every pod: an oracle sweep, not what sluice would set from learned capacity.
Per load and variant it prints, median [min-max] over the seeds: P99 TTFT of the admitted (served) requests, the
served rate as a share of the fleet's capacity (`sluice.bench.capacity.fleet_capacity`), the share refused for good
and the share retried. The overload targets: admitted P99 within the scenario's SLO, served within it >= 0.9 x capacity;
below capacity, nothing refused.
"""

from __future__ import annotations

import argparse
import math
import statistics

from sluice.bench.capacity import fleet_capacity
from sluice.bench.scenario import load
from sluice.bench.sim import Simulation, summarise
from sluice.bench.trace import make_trace


def spread(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    finite = [v * scale for v in values if math.isfinite(v)]
    if len(finite) < len(values):
        return f"inf ({len(values) - len(finite)} of {len(values)} seeds)"
    return f"{statistics.median(finite):.{digits}f} [{min(finite):.{digits}f}-{max(finite):.{digits}f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--loads", default="0.8,1.1,1.5,2", help="comma-separated shares of capacity")
    parser.add_argument("--limits", default="none,16,32,64", help="comma-separated per-pod limits (none: no limit)")
    parser.add_argument("--strategies", default="least-request", help="comma-separated strategies")
    parser.add_argument("--retries", type=int, default=2, help="retries of a refused request on another pod")
    args = parser.parse_args()
    scenario = load(args.scenario)
    capacity = fleet_capacity(scenario)
    seeds = [scenario.seed + i for i in range(scenario.seeds)]
    limits = [None if x == "none" else int(x) for x in args.limits.split(",")]
    strategies = args.strategies.split(",")
    slo = scenario.slo.ttft_p99_ms
    print(f"{scenario.name}: capacity {capacity:.1f} req/s, SLO P99 TTFT {slo:.0f} ms, {len(seeds)} seeds")
    for fraction in (float(x) for x in args.loads.split(",")):
        print(f"\nload {fraction:.0%} ({fraction * capacity:.1f} req/s)")
        print("  variant                        admitted P99 ms          in SLO / capacity      refused       retried")
        for strategy in strategies:
            for limit in limits:
                figures = []
                for seed in seeds:
                    plane = scenario.dataplane.model_copy(
                        update={"inbound_max_requests": limit, "refusal_retries": args.retries}
                    )
                    seeded = scenario.model_copy(update={"seed": seed, "dataplane": plane})
                    trace = make_trace(
                        seeded.workload, fraction * capacity, seeded.workload.duration, seed, plane.sidecars
                    )
                    result = Simulation(seeded, strategy, trace).run()
                    span = result.measured_until - result.measured_from
                    in_slo = sum(
                        1
                        for o in result.outcomes
                        if result.measured_from <= o.arrival.at <= result.measured_until
                        and o.ok
                        and o.ttft is not None
                        and o.ttft * 1000 <= slo
                    )
                    figures.append({**summarise(result), "in_slo_per_s": in_slo / span})
                p99 = [f["ttft_p99_ms"] if f["ttft_p99_ms"] is not None else math.inf for f in figures]
                served = [f["in_slo_per_s"] / capacity for f in figures]
                refused = [f["refused"] for f in figures]
                retried = [f["retried"] for f in figures]
                label = f"{strategy}, limit {limit if limit is not None else 'none'}"
                print(
                    f"  {label:30s} {spread(p99):24s} {spread(served, 1, 2):20s} "
                    f"{spread(refused, 100, 1)} %  {spread(retried, 100, 1)} %"
                )


if __name__ == "__main__":
    main()
