"""KV-cache usage, running batch, queue and TTFT p95 of one simulated server alone, by load.

    python benchmarks/bench_kv_usage.py --lengths azure --hardware h100,a100,l40s [--seconds 200]
    python benchmarks/bench_kv_usage.py --lengths fixed --prompt 2048 --output 128 --hardware a100,rtx4090,cpu

One engine of the routing benchmark (`sluice.sim.engine`, vLLM's scheduler semantics) under Poisson arrivals at
20-100 % of its saturated throughput (`sluice.bench.capacity.saturated_throughput`), gauges sampled every second
after a 30 s warm-up: what the headroom policy's KV-cache bound rests on (docs/design.md, "The KV-cache bound").
"""

from __future__ import annotations

import argparse
import statistics

from sluice.bench.capacity import _engine, saturated_throughput
from sluice.bench.scenario import Scenario
from sluice.bench.trace import make_trace

FRACTIONS = (0.2, 0.4, 0.6, 0.8, 0.9, 1.0)
WARM_UP = 30.0


def run_one(scenario: Scenario, hardware: str, rate: float, seconds: float, seed: int) -> str:
    """One table row: the engine alone at `rate` for `seconds`."""
    engine = _engine(scenario, hardware)
    kv: list[float] = []
    running: list[int] = []
    waiting: list[int] = []
    ttfts: list[float] = []
    sample = WARM_UP

    def advance(t: float) -> None:
        for event in engine.advance_to(t):
            if event.kind == "first_token" and event.at > WARM_UP:
                ttfts.append(event.at - event.sequence.arrival)

    for arrival in make_trace(scenario.workload, rate, seconds, seed, 1):
        while arrival.at > sample:
            advance(sample)
            kv.append(engine.kv_usage)
            running.append(engine.num_running)
            waiting.append(engine.num_waiting)
            sample += 1.0
        advance(arrival.at)
        if engine.fits(arrival.prompt, arrival.output):
            engine.submit(arrival.index, arrival.at, arrival.prompt, arrival.output)
    ttfts.sort()
    p95 = ttfts[int(0.95 * len(ttfts))] * 1000 if ttfts else float("nan")
    return (
        f"{rate:.2f} | {statistics.fmean(kv):.2f} | {max(kv):.2f} | {statistics.fmean(running):.1f} | "
        f"{statistics.fmean(waiting):.1f} | {p95:.0f} ms |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--lengths", default="azure", choices=["fixed", "lmsys", "azure", "agent_heavy"])
    parser.add_argument("--hardware", default="h100,a100,l40s")
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens (fixed lengths)")
    parser.add_argument("--output", type=int, default=128, help="output tokens (fixed lengths)")
    parser.add_argument("--seconds", type=float, default=200.0)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    work = {"lengths": args.lengths, "duration": args.seconds, "prompt_tokens": args.prompt}
    work["output_tokens"] = args.output
    scenario = Scenario.model_validate({"name": "kv", "servers": [{"name": "x", "hardware": "a100"}], "workload": work})
    print(f"{args.lengths} lengths:")
    print("| hardware | load | req/s | KV mean | KV max | running mean | waiting mean | TTFT p95 |")
    print("|---|---|---|---|---|---|---|---|")
    for hardware in args.hardware.split(","):
        capacity = saturated_throughput(scenario, hardware)
        for fraction in FRACTIONS:
            row = run_one(scenario, hardware, fraction * capacity, args.seconds, args.seed)
            print(f"| {hardware} | {fraction:.0%} | {row}", flush=True)


if __name__ == "__main__":
    main()
