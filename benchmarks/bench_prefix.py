"""Prefix reuse: P50/P99 TTFT, the prefix cache's hit rate and goodput per strategy on traces of chat sessions.

    PYTHONPATH=operator:. python benchmarks/bench_prefix.py [--scenario benchmarks/scenarios/chat-sessions.yaml]
        [--loads 0.5,1,1.5,2] [--strategies least-request,ring-hash-bounded,sluice-affinity]

Every strategy replays the same trace of a seed (the scenario's seeds) through the routing simulation, whose
servers run vLLM's automatic prefix caching (`sluice.sim.engine`). Loads are fractions of the fleet's capacity
measured without a cache (`sluice.bench.capacity`), so a router that keeps a session's prefix where it is cached
has room to spare past 1. Per strategy and load: P50 and P99 TTFT (ms), the share of prompt tokens found cached,
the rate served within the SLO as a share of that capacity (goodput), and for the Envoy ring hashes the ring
rebuilds per sidecar per minute (each weight change sluice publishes rebuilds them); median [min-max] over seeds.
Each load ends with the floor no router can beat (`sluice.bench.prefixbound`): every request alone on the fastest
class with every block seen before cached.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

from sluice.bench.capacity import fleet_capacity
from sluice.bench.prefixbound import ttft_floor
from sluice.bench.scenario import load
from sluice.bench.sim import Simulation, nearest_rank, summarise
from sluice.bench.trace import make_trace


def spread(values: list[float], digits: int = 0) -> str:
    if any(math.isnan(v) for v in values):
        return "- (no cache)"
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < len(values):
        return f"inf ({len(values) - len(finite)} of {len(values)})"
    return f"{statistics.median(finite):.{digits}f} [{min(finite):.{digits}f}-{max(finite):.{digits}f}]"


FLOOR = "floor (no router)"


def one(path: str, load_fraction: float, seed: int, strategies: list[str]) -> dict[str, dict[str, float]]:
    scenario = load(path).model_copy(update={"seed": seed})
    capacity = fleet_capacity(load(path))  # strategy- and seed-independent: the scenario's first seed
    work = scenario.workload
    trace = make_trace(work, load_fraction * capacity, work.duration, seed, scenario.dataplane.sidecars)
    span = work.duration - work.warm_up
    slo = scenario.slo.ttft_p99_ms
    out: dict[str, dict[str, float]] = {}
    floor = ttft_floor(scenario, trace)
    lows = sorted(1000 * floor[a.index] for a in trace if work.warm_up <= a.at <= work.duration)
    quantiles = {"p50": nearest_rank(lows, 0.5), "p99": nearest_rank(lows, 0.99)}
    out[FLOOR] = {q: math.nan if value is None else value for q, value in quantiles.items()}
    for strategy in strategies:
        sim = Simulation(scenario, strategy, trace)
        result = sim.run()
        figures = summarise(result)
        measured = [o for o in result.outcomes if work.warm_up <= o.arrival.at <= work.duration]
        good = sum(1 for o in measured if o.ok and o.ttft is not None and o.ttft * 1000 <= slo)
        rebuilds = [r.rebuilds for rings in sim.rings for r in rings.values()]
        out[strategy] = {
            "p50": figures["ttft_p50_ms"] if figures["ttft_p50_ms"] is not None else math.inf,
            "p99": figures["ttft_p99_ms"] if figures["ttft_p99_ms"] is not None else math.inf,
            "hit": figures["prefix_hit_rate"] if figures["prefix_hit_rate"] is not None else math.nan,
            "goodput": good / span / capacity,
            "rebuilds": statistics.fmean(rebuilds) / (work.duration / 60.0) if rebuilds else 0.0,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="benchmarks/scenarios/chat-sessions.yaml")
    parser.add_argument("--loads", default="")
    parser.add_argument("--strategies", default="")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    scenario = load(args.scenario)
    loads = [float(x) for x in args.loads.split(",")] if args.loads else scenario.loads
    strategies = args.strategies.split(",") if args.strategies else list(scenario.strategies or [])
    seeds = [scenario.seed + k for k in range(scenario.seeds)]
    print(f"{scenario.name}: capacity without a cache {fleet_capacity(scenario):.2f} req/s; seeds {seeds}")
    with ProcessPoolExecutor(args.workers) as pool:
        jobs = {pool.submit(one, args.scenario, f, s, strategies): (f, s) for f in loads for s in seeds}
        results: dict[tuple[float, int], Any] = {}
        for job in as_completed(jobs):  # each (load, seed) as it ends, so a run cut short keeps what it measured
            results[jobs[job]] = job.result()
            print(f"load {jobs[job][0]:g} seed {jobs[job][1]}: {json.dumps(results[jobs[job]])}", flush=True)
    print("| load | strategy | P50 TTFT ms | P99 TTFT ms | hit rate | goodput (x capacity) | ring rebuilds/min |")
    print("|---|---|---|---|---|---|---|")
    for f in loads:
        for strategy in strategies:
            rows = [results[(f, s)][strategy] for s in seeds]
            print(
                f"| {f:g} | {strategy} | {spread([r['p50'] for r in rows])} | {spread([r['p99'] for r in rows])} "
                f"| {spread([r['hit'] for r in rows], 3)} | {spread([r['goodput'] for r in rows], 2)} "
                f"| {spread([r['rebuilds'] for r in rows], 1)} |"
            )
        floors = [results[(f, s)][FLOOR] for s in seeds]
        print(
            f"| {f:g} | {FLOOR} | {spread([r['p50'] for r in floors])} | {spread([r['p99'] for r in floors])} | | | |"
        )


if __name__ == "__main__":
    main()
