"""What a per-pod inbound limit can do past capacity: admitted P99 TTFT, served rate and refusals of fixed limits.

    python benchmarks/bench_admission_frontier.py --scenario benchmarks/scenarios/seed-000.yaml \
        [--loads 0.8,1.1,1.5,2] [--limits none,16,32,64] [--batches 1,1.5] [--learned 0.6] \
        [--strategies least-request,sluice] [--retries 2]

Each variant replays the scenario's traces (its seeds) through the routing simulation (`sluice.bench.sim`) with
every pod's sidecar letting at most `limit` requests through to its engine at once (Istio's
`Sidecar.inboundConnectionPool`, `DataPlaneSpec.inbound_max_requests`); past it the sidecar answers 503 at once
and the caller's Envoy retries on a pod not tried before, `--retries` times (2: Istio's default route policy);
each refusal is a 5xx to the caller's outlier detection, which ejects a pod after the pool's consecutive-5xx
count (`--no-outlier-detection`: without it).
The limits are fixed: the same on every pod (`--limits`), or each pod's at `b` times its engine's batch at
saturation (`--batches`: the requests it runs at once when its queue never empties, measured alone on the
scenario's lengths, the median over the second half of a 240 s overload) — oracle sweeps — or, with `--learned
s`, the limits sluice itself reports (`admission: {mode: Report, batchShare: s}`, learned from its pods' running
counts over their KV-cache usage, one per hardware class) enforced by the simulated sidecars from the pass that
reports them (what `mode: Enforce` renders on real sidecars).
Per load and variant it prints, median [min-max] over the seeds: P99 TTFT of the admitted (served) requests, the
rate served within the SLO (TTFT) as a share of the fleet's capacity (`sluice.bench.capacity.fleet_capacity`), the
share refused for good and the share retried. The header gives what the pods can serve within the SLO at all:
each alone at the rate where its P99 TTFT reaches it (`ServerCurve.rate_at`), as a share of capacity. The overload
targets: admitted P99 within the scenario's SLO, served within it >= 0.9 x capacity; below capacity, nothing
refused.
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

from sluice.bench.capacity import OVERLOAD_SECONDS, fleet_capacity, server_curves
from sluice.bench.scenario import Scenario, load
from sluice.bench.sim import Simulation, summarise
from sluice.bench.trace import make_trace
from sluice.sim.engine import Engine, EngineConfig
from sluice.sim.profiles import server_profile


def spread(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    finite = [v * scale for v in values if math.isfinite(v)]
    if len(finite) < len(values):
        return f"inf ({len(values) - len(finite)} of {len(values)} seeds)"
    return f"{statistics.median(finite):.{digits}f} [{min(finite):.{digits}f}-{max(finite):.{digits}f}]"


def saturated_batch(scenario: Scenario, hardware: str) -> float:
    """The requests one server alone runs at once while its queue never empties (Poisson at 1.5 x its capacity):
    the median of the running count at each arrival over the second half of the run."""
    engine = Engine(
        server_profile(hardware, scenario.model),
        EngineConfig(scenario.engine.max_num_batched_tokens, scenario.engine.max_num_seqs),
    )
    rate = 1.5 * server_curves(scenario)[hardware].capacity
    running: list[int] = []
    for a in make_trace(scenario.workload, rate, OVERLOAD_SECONDS, scenario.seed, 1):
        engine.advance_to(a.at)
        if a.at >= OVERLOAD_SECONDS / 2:
            running.append(engine.num_running)
        if engine.fits(a.prompt, a.output):
            engine.submit(a.index, a.at, a.prompt, a.output)
    return statistics.median(running) if running else 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--loads", default="0.8,1.1,1.5,2", help="comma-separated shares of capacity")
    parser.add_argument("--limits", default="none,16,32,64", help="comma-separated per-pod limits (none: no limit)")
    parser.add_argument("--batches", default="", help="comma-separated multiples of each pod's saturated batch")
    parser.add_argument(
        "--learned", default="", help="comma-separated batchShare values: sluice's own reported limits, enforced"
    )
    parser.add_argument(
        "--steered",
        default="",
        help="comma-separated shares of the SLO: with --learned, also each share's variant with admission.ttftTarget "
        "at that share of the scenario's P99 TTFT SLO (the limits steered by the engines' TTFT p95)",
    )
    parser.add_argument("--strategies", default="least-request", help="comma-separated strategies")
    parser.add_argument(
        "--no-outlier-detection", action="store_true", help="the callers do not eject pods on consecutive 5xx"
    )
    parser.add_argument("--retries", type=int, default=2, help="retries of a refused request on another pod")
    args = parser.parse_args()
    scenario = load(args.scenario)
    capacity = fleet_capacity(scenario)
    seeds = [scenario.seed + i for i in range(scenario.seeds)]
    variants: list[tuple[str, int | None, dict[str, int], float | None]] = [
        (f"limit {x}", None if x == "none" else int(x), {}, None) for x in args.limits.split(",") if x
    ]
    targets: dict[str, float] = {}  # variant -> admission.ttftTarget, seconds
    if args.batches:
        batch = {hw: saturated_batch(scenario, hw) for hw in {s.hardware for s in scenario.servers}}
        print("engine batch at saturation: " + ", ".join(f"{hw} {b:g}" for hw, b in sorted(batch.items())))
        for factor in (float(x) for x in args.batches.split(",")):
            per_pod = {s.name: max(1, round(factor * batch[s.hardware])) for s in scenario.servers}
            variants.append((f"{factor:g} x batch", None, per_pod, None))
    for share in (float(x) for x in args.learned.split(",") if x):
        variants.append((f"learned {share:g}", None, {}, share))
        for ratio in (float(x) for x in args.steered.split(",") if x):
            name = f"learned {share:g}, target {ratio:g} SLO"
            variants.append((name, None, {}, share))
            targets[name] = ratio * scenario.slo.ttft_p99_ms / 1000
    strategies = args.strategies.split(",")
    plane_detection = scenario.dataplane.outlier_detection and not args.no_outlier_detection
    slo = scenario.slo.ttft_p99_ms
    curves = server_curves(scenario)
    reachable = sum(curves[s.hardware].rate_at(slo / 1000) for s in scenario.servers)
    print(
        f"{scenario.name}: capacity {capacity:.1f} req/s, SLO P99 TTFT {slo:.0f} ms, {len(seeds)} seeds; each pod "
        f"alone at the rate its P99 reaches the SLO: {reachable:.1f} req/s ({reachable / capacity:.2f} x capacity)"
    )
    for fraction in (float(x) for x in args.loads.split(",")):
        print(f"\nload {fraction:.0%} ({fraction * capacity:.1f} req/s)")
        print(f"  {'variant':42s} admitted P99 ms          in SLO / capacity      refused       retried")
        for strategy in strategies:
            for name, limit, per_pod, learned in variants:
                if learned is not None and not strategy.startswith("sluice"):
                    continue  # only sluice reports limits
                figures = []
                servers = [s.model_copy(update={"inbound_max_requests": per_pod.get(s.name)}) for s in scenario.servers]
                for seed in seeds:
                    plane = scenario.dataplane.model_copy(
                        update={
                            "inbound_max_requests": limit,
                            "refusal_retries": args.retries,
                            "outlier_detection": plane_detection,
                            "reported_limits": learned is not None,
                        }
                    )
                    loop = scenario.sluice
                    if learned is not None:
                        admission: dict[str, Any] = {"admission": {"mode": "Report", "batchShare": learned}}
                        if name in targets:
                            admission["admission"]["ttftTarget"] = f"{targets[name]:g}s"
                        loop = loop.model_copy(update={"pool": {**loop.pool, **admission}})
                    seeded = scenario.model_copy(
                        update={"seed": seed, "dataplane": plane, "servers": servers, "sluice": loop}
                    )
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
                label = f"{strategy}, {name}"
                print(
                    f"  {label:42s} {spread(p99):24s} {spread(served, 1, 2):20s} "
                    f"{spread(refused, 100, 1)} %  {spread(retried, 100, 1)} %"
                )


if __name__ == "__main__":
    main()
