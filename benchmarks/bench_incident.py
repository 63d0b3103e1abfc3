"""Where a degrading-node incident's P99 comes from: sluice against what ideal reactions would give, on one scenario.

    python benchmarks/bench_incident.py --scenario benchmarks/scenarios/degrading-tuning.yaml [--loads 0.5,0.7]

The scenario's first event slows a server and injects errors. Each variant replays the same traces (the scenario's
seeds) through the routing simulation (`sluice.bench.sim`) and reports the incident P99 TTFT (requests arriving in
the 60 s after the event), median and min-max over the seeds:
- `least-request`: Envoy LEAST_REQUEST, equal weights (power of two choices);
- `sluice`: the weights sluice publishes;
- `sluice, zeroed at evidence`: sluice's weights, the slowed pod removed from the first pass that reads a scrape taken
  after the event (what the fastest protection could do: no sample of the incident exists before that scrape);
- `equal, zeroed at evidence`: equal weights (so Envoy keeps power of two choices) and the same removal;
- `equal but one, zeroed at evidence`: equal weights except one healthy pod at maxWeight - 1, which puts Envoy in
  its weighted mode (EDF over weight / (active + 1)) with the same shares: power of two choices against EDF;
- `equal, zeroed 1 s after the event`: a reaction no loop that reads Prometheus can have (the physics bound).
Also, for `sluice`: how many of the incident's slowest 1 % ran on the slowed pod, and how many of those arrived
before the first pass that could see the incident.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable

from sluice.bench.capacity import fleet_capacity
from sluice.bench.control import Published
from sluice.bench.scenario import Scenario, load
from sluice.bench.sim import Outcome, Simulation, summarise
from sluice.bench.trace import Arrival, make_trace

Rewrite = Callable[[float, dict[str, int]], dict[str, int]]


class Rewritten(Simulation):
    """The sluice strategy with its published weights rewritten before the sidecars get them."""

    def __init__(self, scenario: Scenario, trace: list[Arrival], rewrite: Rewrite) -> None:
        super().__init__(scenario, "sluice", trace)
        self.rewrite = rewrite

    def _publish(self, t: float, published: Published | None) -> None:
        if published is None:
            super()._publish(t, published)
            return
        super()._publish(t, Published(self.rewrite(t, dict(published.weights)), published.split))


def first_evidence_pass(scenario: Scenario) -> float:
    """When the first pass that read a scrape taken after the event has its weights applied."""
    onset = scenario.events[0].at
    scrape, interval = scenario.sluice.scrape_interval, scenario.sluice.interval
    # A scrape at the event's own instant runs before it (the simulation orders scrapes first).
    first_scrape = (math.floor(onset / scrape) + 1) * scrape
    first_pass = math.ceil(first_scrape / interval) * interval
    return first_pass + scenario.dataplane.propagation_delay


def variants(scenario: Scenario) -> dict[str, Rewrite | None]:
    bad = scenario.events[0].server
    onset = scenario.events[0].at
    evidence = first_evidence_pass(scenario)
    top = 1000

    def removed(weights: dict[str, int]) -> dict[str, int]:
        return {n: w for n, w in weights.items() if n != bad}

    def zeroed(at: float) -> Rewrite:
        return lambda t, w: removed(w) if t >= at else w

    def equal(at: float, one_off: bool = False) -> Rewrite:
        def rewrite(t: float, w: dict[str, int]) -> dict[str, int]:
            out = dict.fromkeys(w, top)
            if one_off:
                out[min(n for n in out if n != bad)] = top - 1
            return removed(out) if t >= at else out

        return rewrite

    return {
        "least-request": None,
        "sluice": lambda t, w: w,
        "sluice, zeroed at evidence": zeroed(evidence),
        "equal, zeroed at evidence": equal(evidence),
        "equal but one, zeroed at evidence": equal(evidence, one_off=True),
        "equal, zeroed 1 s after the event": equal(onset + 1.0),
    }


def incident(outcomes: list[Outcome], onset: float) -> list[Outcome]:
    return [o for o in outcomes if onset <= o.arrival.at < onset + 60.0 and not o.failed]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--loads", default=None, help="comma-separated shares of capacity (default: the scenario's)")
    args = parser.parse_args()
    scenario = load(args.scenario)
    if not scenario.events:
        raise SystemExit(f"{args.scenario}: no events, nothing to diagnose")
    loads = [float(x) for x in args.loads.split(",")] if args.loads else scenario.loads
    capacity = fleet_capacity(scenario)
    onset, bad = scenario.events[0].at, scenario.events[0].server
    evidence = first_evidence_pass(scenario)
    print(f"{scenario.name}: {bad} degrades at {onset:g} s; first pass able to see it applied at {evidence:g} s")
    seeds = [scenario.seed + i for i in range(scenario.seeds)]
    for fraction in loads:
        rows: dict[str, list[float]] = {}
        tails: list[tuple[int, int, int]] = []
        for seed in seeds:
            seeded = scenario.model_copy(update={"seed": seed})
            trace = make_trace(
                seeded.workload, fraction * capacity, seeded.workload.duration, seed, seeded.dataplane.sidecars
            )
            for name, rewrite in variants(seeded).items():
                sim = Simulation(seeded, name, trace) if rewrite is None else Rewritten(seeded, trace, rewrite)
                result = sim.run()
                rows.setdefault(name, []).append(summarise(result)["incident_ttft_p99_ms"])
                if name == "sluice":
                    during = incident(result.outcomes, onset)
                    ranked = sorted(during, key=lambda o: o.ttft if o.ttft is not None else math.inf)
                    slowest = ranked[min(len(ranked) - 1, int(0.99 * len(ranked))) :]
                    slow_pod = [o for o in slowest if o.server == bad]
                    tails.append((len(slowest), len(slow_pod), sum(1 for o in slow_pod if o.arrival.at < evidence)))
        reference = statistics.median(rows["least-request"])
        print(f"\nload {fraction:.0%}: incident P99 TTFT (ms), median [min-max] over {len(seeds)} seeds")
        for name, values in rows.items():
            median = statistics.median(values)
            print(f"  {name:36s} {median:7.0f} [{min(values):.0f}-{max(values):.0f}]  {median / reference:.2f}x")
        total, on_slow, early = (sum(t[i] for t in tails) for i in range(3))
        print(f"  sluice's slowest 1 %: {on_slow} of {total} on {bad}, {early} of them arrived before {evidence:g} s")


if __name__ == "__main__":
    main()
