"""What any fixed weight on a failing pod can reach: the P99 TTFT / error-rate frontier of one failing-pod scenario.

    python benchmarks/bench_failing_frontier.py --scenario benchmarks/scenarios/failing-pod-tuning.yaml \
        [--loads 0.3,0.7] [--weights 0,0.1,0.2,0.5,1] [--delays 0,15]

The scenario's first event makes a server fail a share of its requests. Each variant replays the same traces (the
scenario's seeds) through the routing simulation (`sluice.bench.sim`, Envoy's weighted least-request on every
sidecar): from the event on (or `d` seconds after it: `--delays`), every healthy pod is published at 1000 and the
failing one at `w` x 1000 (w = 0: removed, as a zeroing does); before it, all equal. A delay is the time any
controller needs to see the fault (its errors reach a scrape and a rate window) before it can act; with none the
variant is an oracle. Against least-request (equal weights throughout), and with
sluice on the same traces, it prints the whole measured window's P99 TTFT and error rate, median [min-max] over
the seeds, and whether each meets the failing-pod targets of `sluice.bench.targets` on the medians: "no worse"
(P99 <= 1.1 x and errors <= least-request's) and "halves one" (P99 or errors <= 0.5 x least-request's). A load
where no fixed weight meets both is one where no static split can; a dynamic policy could still, in principle —
unless it must first see the fault, and no fixed weight meets both even taken at that delay.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

from bench_incident import Rewritten  # type: ignore[import-not-found]

from sluice.bench.capacity import fleet_capacity
from sluice.bench.scenario import load
from sluice.bench.sim import Simulation, summarise
from sluice.bench.trace import make_trace

TOP = 1000


def fixed(names: list[str], bad: str, onset: float, weight: float) -> Callable[[float, dict[str, int]], dict[str, int]]:
    """Equal weights before `onset`; from it, the failing pod at `weight` x the others' (0: removed)."""

    def rewrite(t: float, weights: dict[str, int]) -> dict[str, int]:
        out = dict.fromkeys(names, TOP)
        if t < onset:
            return out
        if weight <= 0:
            del out[bad]
        else:
            out[bad] = max(1, round(weight * TOP))
        return out

    return rewrite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--loads", default=None, help="comma-separated shares of capacity (default: the scenario's)")
    parser.add_argument("--weights", default="0,0.05,0.1,0.2,0.3,0.5,0.7,1", help="failing pod's weight / healthy")
    parser.add_argument("--delays", default="0", help="comma-separated seconds from the fault to the fixed weights")
    args = parser.parse_args()
    scenario = load(args.scenario)
    failing = [e for e in scenario.events if e.error_rate and not e.slowdown]
    if not failing:
        raise SystemExit(f"{args.scenario}: no event that only injects errors")
    bad, onset = failing[0].server, failing[0].at
    loads = [float(x) for x in args.loads.split(",")] if args.loads else scenario.loads
    weights = [float(x) for x in args.weights.split(",")]
    delays = [float(x) for x in args.delays.split(",")]
    capacity = fleet_capacity(scenario)
    seeds = [scenario.seed + i for i in range(scenario.seeds)]
    print(f"{scenario.name}: {bad} fails {failing[0].error_rate:.0%} of its requests from {onset:g} s")
    for fraction in loads:
        p99: dict[str, list[float]] = {}
        errors: dict[str, list[float]] = {}
        for seed in seeds:
            seeded = scenario.model_copy(update={"seed": seed})
            trace = make_trace(
                seeded.workload, fraction * capacity, seeded.workload.duration, seed, seeded.dataplane.sidecars
            )
            runs = {name: Simulation(seeded, name, trace) for name in ("least-request", "sluice")}
            for delay in delays:
                for w in weights:
                    label = f"w={w:g}" + (f" +{delay:g}s" if delay else "")
                    names = [x.name for x in seeded.servers]
                    runs[label] = Rewritten(seeded, trace, fixed(names, bad, onset + delay, w))
            for name, sim in runs.items():
                figures = summarise(sim.run())
                p99.setdefault(name, []).append(figures["ttft_p99_ms"])
                errors.setdefault(name, []).append(figures["error_rate"])
        ref_p99, ref_errors = statistics.median(p99["least-request"]), statistics.median(errors["least-request"])
        print(
            f"\nload {fraction:.0%}: P99 TTFT (ms) and error rate, median [min-max] over {len(seeds)} seeds; "
            f"no worse: P99 <= {1.1 * ref_p99:.0f} and errors <= {ref_errors:.2%}; "
            f"halves one: P99 <= {0.5 * ref_p99:.0f} or errors <= {0.5 * ref_errors:.2%}"
        )
        for name, values in p99.items():
            p, e = statistics.median(values), statistics.median(errors[name])
            no_worse = p <= 1.1 * ref_p99 and e <= ref_errors
            halves = p <= 0.5 * ref_p99 or e <= 0.5 * ref_errors
            print(
                f"  {name:14s} {p:8.0f} [{min(values):.0f}-{max(values):.0f}] {p / ref_p99:6.2f}x   "
                f"errors {e:6.2%} [{min(errors[name]):.2%}-{max(errors[name]):.2%}] {e / ref_errors:5.2f}x   "
                f"no worse {'yes' if no_worse else 'no '}  halves one {'yes' if halves else 'no'}"
            )


if __name__ == "__main__":
    main()
