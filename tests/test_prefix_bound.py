"""The floor under any router's TTFT on a trace with prefix reuse (`sluice.bench.prefixbound`), held to the
simulation: no request served by any strategy comes in under its floor, and the floor is reached (a request that
meets an idle engine of the fastest class with its prefix cached gets exactly it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.bench.capacity import fleet_capacity
from sluice.bench.prefixbound import alone_seconds, ttft_floor
from sluice.bench.scenario import load
from sluice.bench.sim import Simulation
from sluice.bench.trace import make_trace
from sluice.sim.engine import Engine, EngineConfig
from sluice.sim.profiles import server_profile

SCENARIOS = Path(__file__).resolve().parent.parent / "benchmarks" / "scenarios"


def test_alone_is_one_engine_step_per_chunk_and_a_cached_prefix_shortens_it() -> None:
    engine = Engine(server_profile("a100"), EngineConfig())
    whole, cached = alone_seconds(engine, 3000, 0), alone_seconds(engine, 3000, 2400)
    assert 0 < cached < whole
    served = Engine(server_profile("a100"), EngineConfig())
    sequence = served.submit(0, 0.0, 3000, 4)
    while sequence.first_token_at is None:
        served.advance_to(served.next_event_time())
    assert sequence.first_token_at == pytest.approx(whole)  # the engine itself, alone: two chunks of 2048 and 952


@pytest.mark.parametrize("name", ["chat-sessions.yaml", "chat-sessions-mixed.yaml"])
def test_no_strategy_serves_a_request_under_its_floor(name: str) -> None:
    scenario = load(SCENARIOS / name)
    work = scenario.workload.model_copy(update={"duration": 90.0, "warm_up": 0.0})
    scenario = scenario.model_copy(update={"workload": work})
    trace = make_trace(work, 0.8 * fleet_capacity(scenario), work.duration, scenario.seed, scenario.dataplane.sidecars)
    floor = ttft_floor(scenario, trace)
    for strategy in ("least-request", "cache-aware", "sluice-affinity"):
        ttfts = {o.arrival.index: o.ttft for o in Simulation(scenario, strategy, trace).run().outcomes}
        served = {index: ttft for index, ttft in ttfts.items() if ttft is not None}
        assert len(served) > 0.9 * len(trace)
        ratios = [ttft / floor[index] for index, ttft in served.items()]
        assert min(ratios) >= 1 - 1e-9, strategy
        assert min(ratios) <= 1.01, strategy  # and met: some request found an idle engine with its prefix cached
