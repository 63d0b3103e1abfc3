"""Tenant shares past capacity: each tenant's P99 TTFT, refusals and served rate, with and without shares.

    PYTHONPATH=operator:. python benchmarks/bench_tenants.py [--scenario benchmarks/scenarios/noisy-tenant.yaml]
        [--loads 1.85] [--even] [--shares-only]

Replays the scenario's traces (its seeds; every tenant's requests drawn from the same stream for every variant)
through the routing simulation with the pool's `admission.tenants` (the scenario's `sluice.pool`), the sidecars
enforcing the rates sluice reports with the buckets it renders (`sluice.istio.envoyfilters.tenant_buckets`) and
its inbound limits (`admission.mode: Report` enforced, `reported_limits`). Variants on the same traces:
least-request (no limits), sluice without tenant shares (its inbound limits only), sluice with them. A refused
request is retried on another pod twice (Istio's default policy for a 503; a 429 needs `retries.statusCodes: [429]`).
Per tenant group (the one sending most, the others): P99 TTFT of its served requests, its share refused, its
served rate within the SLO as a share of the fleet's capacity; median [min-max] over the seeds.
Targets (issue "Overload without collapse"): the other tenants' P99 within their SLO and their refusals < 1 %.
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

from sluice.api.v1alpha1 import TenantsSpec
from sluice.bench.capacity import fleet_capacity
from sluice.bench.scenario import Scenario, load
from sluice.bench.sim import Outcome, Simulation
from sluice.bench.trace import make_trace


def spread(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    finite = [v * scale for v in values if math.isfinite(v)]
    if len(finite) < len(values):
        return f"inf ({len(values) - len(finite)} of {len(values)} seeds)"
    return f"{statistics.median(finite):.{digits}f} [{min(finite):.{digits}f}-{max(finite):.{digits}f}]"


def figures(outcomes: list[Outcome], span: float, slo_ms: float, capacity: float) -> dict[str, float]:
    ttfts = sorted((o.ttft if o.ttft is not None else math.inf) * 1000 for o in outcomes if not o.failed)
    p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else math.inf
    in_slo = sum(1 for o in outcomes if o.ok and o.ttft is not None and o.ttft * 1000 <= slo_ms)
    return {
        "p99": p99,
        "refused": sum(1 for o in outcomes if o.refused) / len(outcomes) if outcomes else 0.0,
        "served": in_slo / span / capacity,
    }


def within_shares(scenario: Scenario) -> dict[str, float]:
    """The scenario's tenants sending in proportion to their shares in the pool (the unnamed ones splitting
    othersPercent): at a load below capacity, each below its share."""
    shares = TenantsSpec.model_validate(scenario.sluice.pool["admission"]["tenants"])
    named = {s.value: float(s.percent) for s in shares.shares}
    unnamed = [t for t in scenario.workload.tenants if t not in named]
    return {t: named.get(t, shares.others_percent / max(1, len(unnamed))) for t in scenario.workload.tenants}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="benchmarks/scenarios/noisy-tenant.yaml")
    parser.add_argument("--loads", default="", help="comma-separated shares of capacity (default: the scenario's)")
    parser.add_argument("--shares-only", action="store_true", help="only sluice with tenant shares")
    parser.add_argument("--even", action="store_true", help="every tenant sends in proportion to its share")
    args = parser.parse_args()
    scenario = load(args.scenario)
    if args.even:
        work = scenario.workload.model_copy(update={"tenants": within_shares(scenario)})
        scenario = scenario.model_copy(update={"workload": work})
    capacity = fleet_capacity(scenario)
    seeds = [scenario.seed + i for i in range(scenario.seeds)]
    tenants = scenario.workload.tenants
    noisy = max(tenants, key=lambda t: tenants[t])  # with --even: the one with the largest share
    slo = scenario.slo.ttft_p99_ms
    pool: dict[str, Any] = dict(scenario.sluice.pool)
    without = {**pool, "admission": {k: v for k, v in pool.get("admission", {}).items() if k != "tenants"}}
    variants = [
        ("least-request", "least-request", pool),
        ("sluice, limits only", "sluice", without),
        ("sluice, tenant shares", "sluice", pool),
    ]
    if args.shares_only:
        variants = variants[2:]
    loads = [float(x) for x in args.loads.split(",") if x] or list(scenario.loads)
    print(f"{scenario.name}: capacity {capacity:.1f} req/s, SLO P99 TTFT {slo:.0f} ms, {len(seeds)} seeds")
    for fraction in loads:
        print(f"\nload {fraction:.0%} ({fraction * capacity:.1f} req/s); tenants' weights {tenants}")
        print(f"  {'variant':24s} {'group':8s} {'P99 ms':22s} {'refused %':18s} in SLO / capacity")
        for label, strategy, spec in variants:
            runs: dict[str, list[dict[str, float]]] = {"noisy": [], "others": []}
            for seed in seeds:
                loop = scenario.sluice.model_copy(update={"pool": spec})
                seeded = scenario.model_copy(update={"seed": seed, "sluice": loop})
                trace = make_trace(
                    seeded.workload, fraction * capacity, seeded.workload.duration, seed, scenario.dataplane.sidecars
                )
                result = Simulation(seeded, strategy, trace).run()
                span = result.measured_until - result.measured_from
                measured = [o for o in result.outcomes if result.measured_from <= o.arrival.at <= result.measured_until]
                runs["noisy"].append(figures([o for o in measured if o.arrival.tenant == noisy], span, slo, capacity))
                runs["others"].append(figures([o for o in measured if o.arrival.tenant != noisy], span, slo, capacity))
            for group, found in runs.items():
                print(
                    f"  {label:24s} {group:8s} {spread([f['p99'] for f in found]):22s} "
                    f"{spread([f['refused'] for f in found], 100, 2):18s} {spread([f['served'] for f in found], 1, 2)}"
                )


if __name__ == "__main__":
    main()
