"""Strategy-independent figures of a fleet: each server's capacity and TTFT-vs-load curve, and the best static split.

Called by `sluice.bench.report`. Everything here runs one server alone on the scenario's request lengths:
- capacity: the completion rate of a server under a sustained overload (its queue never empties), counted over the
  second half of the run — the fleet's capacity is the sum;
- the TTFT curve: P99 TTFT of the server alone under Poisson arrivals at 10 %…110 % of its capacity;
- `best_split`: water-filling on those curves: the per-server rates that give every server the same P99 TTFT level
  (the lowest level whose rates add up to the offered load) — the best any static weighting can do, a reference.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from sluice.bench.scenario import Scenario, WorkloadSpec
from sluice.bench.trace import make_trace
from sluice.sim.engine import Engine, EngineConfig
from sluice.sim.profiles import server_profile

CURVE_POINTS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1)
CURVE_SECONDS = 240.0
SATURATION_REQUESTS = 400
OVERLOAD_SECONDS = 240.0


@dataclass(frozen=True)
class AloneRun:
    """One server alone at one rate: what the contention checks need."""

    rate: float
    p99_ttft: float
    peak_kv: float
    peak_waiting: int
    preemptions: int


@dataclass(frozen=True)
class ServerCurve:
    hardware: str
    capacity: float
    """Requests per second at saturation."""
    points: tuple[tuple[float, float], ...]
    """(rate, P99 TTFT seconds), rates ascending, P99 made non-decreasing."""
    runs: tuple[AloneRun, ...]

    def rate_at(self, level: float) -> float:
        """The highest rate whose P99 TTFT stays within `level` (linear between measured points)."""
        best = 0.0
        previous = (0.0, 0.0)
        for rate, p99 in self.points:
            if p99 <= level:
                best = rate
            elif previous[1] <= level:
                span = p99 - previous[1]
                best = previous[0] + (rate - previous[0]) * ((level - previous[1]) / span if span > 0 else 0.0)
                break
            previous = (rate, p99)
        return best


def _engine(scenario: Scenario, hardware: str) -> Engine:
    config = EngineConfig(scenario.engine.max_num_batched_tokens, scenario.engine.max_num_seqs)
    return Engine(server_profile(hardware, scenario.model), config)


def _batch_throughput(scenario: Scenario, hardware: str) -> float:
    """A first guess: every request queued at t=0, completions between the 10th and the 90th percentile."""
    engine = _engine(scenario, hardware)
    candidates = make_trace(scenario.workload, 1.0, 10 * SATURATION_REQUESTS, scenario.seed, 1)
    trace = [a for a in candidates if engine.fits(a.prompt, a.output)][:SATURATION_REQUESTS]
    for a in trace:
        engine.submit(a.index, 0.0, a.prompt, a.output)
    finished: list[float] = []
    while engine.next_event_time() < math.inf:
        finished += [e.at for e in engine.advance_to(engine.next_event_time()) if e.kind == "finished"]
    lo, hi = finished[len(finished) // 10], finished[(9 * len(finished)) // 10]
    return (len(finished) * 0.8) / (hi - lo) if hi > lo else 1.0


def saturated_throughput(scenario: Scenario, hardware: str) -> float:
    """Completions per second under a sustained overload (Poisson at 1.5x a first guess, raised until the queue
    grows), counted over the second half of the run: the engine's throughput with a full token budget every step."""
    rate = 1.5 * _batch_throughput(scenario, hardware)
    for _ in range(4):
        engine = _engine(scenario, hardware)
        trace = make_trace(scenario.workload, rate, OVERLOAD_SECONDS, scenario.seed, 1)
        finished = 0
        for a in trace:
            events = engine.advance_to(a.at)
            finished += sum(1 for e in events if e.kind == "finished" and e.at >= OVERLOAD_SECONDS / 2)
            if engine.fits(a.prompt, a.output):
                engine.submit(a.index, a.at, a.prompt, a.output)
        events = engine.advance_to(OVERLOAD_SECONDS)
        finished += sum(1 for e in events if e.kind == "finished" and e.at >= OVERLOAD_SECONDS / 2)
        if engine.num_waiting > 0:
            return finished / (OVERLOAD_SECONDS / 2)
        rate *= 2  # it kept up: not an overload yet
    return rate


def run_alone(scenario: Scenario, hardware: str, rate: float, seed: int) -> AloneRun:
    """One server alone under the scenario's arrival process at `rate`: its P99 TTFT (seconds) and peaks."""
    engine = _engine(scenario, hardware)
    work: WorkloadSpec = scenario.workload.model_copy(update={"duration": CURVE_SECONDS, "warm_up": 30.0})
    trace = make_trace(work, rate, work.duration, seed, 1)
    arrivals: dict[int, float] = {}
    ttfts: dict[int, float] = {}
    peak_kv, peak_waiting = 0.0, 0
    for a in trace:
        for e in engine.advance_to(a.at):
            if e.kind == "first_token":
                ttfts[e.sequence.req_id] = e.at - e.sequence.arrival
        if engine.fits(a.prompt, a.output):
            engine.submit(a.index, a.at, a.prompt, a.output)
            arrivals[a.index] = a.at
        peak_kv, peak_waiting = max(peak_kv, engine.kv_usage), max(peak_waiting, engine.num_waiting)
    deadline = work.duration + 600.0
    while engine.next_event_time() <= deadline:
        for e in engine.advance_to(engine.next_event_time()):
            if e.kind == "first_token":
                ttfts[e.sequence.req_id] = e.at - e.sequence.arrival
    measured = sorted(ttfts.get(i, math.inf) for i, at in arrivals.items() if at >= work.warm_up)
    p99 = measured[min(len(measured) - 1, int(0.99 * len(measured)))] if measured else math.inf
    return AloneRun(rate, p99, peak_kv, peak_waiting, engine.preemptions_total)


@functools.lru_cache(maxsize=64)
def _saturated(scenario_json: str, hardware: str) -> float:
    return saturated_throughput(Scenario.model_validate_json(scenario_json), hardware)


@functools.lru_cache(maxsize=64)
def _curve(scenario_json: str, hardware: str) -> ServerCurve:
    scenario = Scenario.model_validate_json(scenario_json)
    capacity = _saturated(scenario_json, hardware)
    points, runs, worst = [], [], 0.0
    for fraction in CURVE_POINTS:
        run = run_alone(scenario, hardware, fraction * capacity, scenario.seed)
        worst = max(worst, run.p99_ttft)
        points.append((fraction * capacity, worst))
        runs.append(run)
    return ServerCurve(hardware, capacity, tuple(points), tuple(runs))


def _key(scenario: Scenario) -> str:
    """What a server's curve depends on (model, engine, lengths, seed), as a cache key."""
    key = scenario.model_copy(update={"servers": [], "events": [], "loads": [1.0], "name": "", "description": ""})
    return key.model_dump_json()


def server_curves(scenario: Scenario) -> dict[str, ServerCurve]:
    """Hardware class -> its curve, measured once per (model, engine, lengths) in a process."""
    key = _key(scenario)
    return {s.hardware: _curve(key, s.hardware) for s in scenario.servers}


def fleet_capacity(scenario: Scenario) -> float:
    """Requests per second the fleet completes at saturation on the scenario's lengths: each server's engine alone
    under a sustained overload (`saturated_throughput`, the top of its curve), summed; measured once per hardware
    class in a process, without the curves."""
    key = _key(scenario)
    return sum(_saturated(key, s.hardware) for s in scenario.servers)


def best_split(scenario: Scenario, rate: float) -> dict[str, float]:
    """Per-server rates (summing to `rate`) that equalise the servers' P99 TTFT at the lowest common level."""
    curves = server_curves(scenario)
    servers = [(s.name, curves[s.hardware]) for s in scenario.servers]
    top = max(p99 for _, c in servers for _, p99 in c.points)

    def total(level: float) -> float:
        return sum(c.rate_at(level) for _, c in servers)

    if total(top) < rate:  # past every curve: split in proportion to capacity
        whole = sum(c.capacity for _, c in servers)
        return {name: rate * c.capacity / whole for name, c in servers}
    lo, hi = 1e-4, top
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if total(mid) < rate else (lo, mid)
    rates = {name: c.rate_at(hi) for name, c in servers}
    scale = rate / sum(rates.values())
    return {name: r * scale for name, r in rates.items()}
