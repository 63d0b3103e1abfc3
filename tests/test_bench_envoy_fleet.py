"""The real data-plane benchmark runs a scenario's servers (`--scenario`): their addresses, classes, SLO and the
capacity its `--load` is a fraction of; scenarios the local servers cannot honour are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.bench.envoy import SEED_000, Fleet, fleet, fleet_capacity, main, run_workload
from sluice.bench.scenario import WorkloadSpec, load

SCENARIOS = Path(__file__).resolve().parents[1] / "benchmarks" / "scenarios"
FIXED = WorkloadSpec(prompt_tokens=2048, output_tokens=32)


def test_the_default_fleet_is_seed_000s() -> None:
    run = fleet(load(SEED_000))
    assert [(s.name, s.hardware) for s in run.servers] == [
        ("a100-0", "a100"),
        ("rtx4090-0", "rtx4090"),
        ("cpu-0", "cpu"),
    ]
    assert run.slo_seconds == 1.0
    assert run.classes == {"a100": 10.0, "rtx4090": 4.0, "cpu": 1.0}  # the guesses seed 000's pool declared


def test_a_scenarios_servers_get_their_own_loopback_addresses_and_its_slo() -> None:
    run = fleet(load(SCENARIOS / "agent-overdeclared.yaml"))
    assert [s.hardware for s in run.servers] == ["h100", "a100", "a100", "rtx4090"]
    assert len({s.ip for s in run.servers}) == 4
    assert all(s.ip.startswith("127.") for s in run.servers)
    assert run.slo_seconds == 2.0
    assert set(run.classes) == {"h100", "a100", "rtx4090"}


def test_capacity_counts_every_server_of_a_class() -> None:
    a100 = fleet(load(SEED_000)).servers[0]
    one = fleet_capacity(Fleet("one", (a100,), 1.0), FIXED)
    assert 5 < one < 20  # requests per second an A100 completes on 2048-token prompts
    four = fleet(load(SCENARIOS / "homogeneous.yaml"))  # four A100s
    assert fleet_capacity(four, FIXED) == pytest.approx(4 * one)


def test_a_scenario_the_local_servers_cannot_honour_is_refused(tmp_path: Path) -> None:
    scenario = tmp_path / "faulty.yaml"
    scenario.write_text(
        "name: faulty\nservers:\n  - {name: a100-0, hardware: a100, error_rate: 0.3}\nengine: {max_num_seqs: 64}\n"
    )
    with pytest.raises(SystemExit) as exit_:
        main(["--scenario", str(scenario), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    with pytest.raises(ValueError, match=r"engine, servers\[a100-0\]"):
        fleet(load(scenario))


def test_the_scenarios_lengths_are_replayed_as_poisson_arrivals_and_change_the_capacity() -> None:
    run = fleet(load(SCENARIOS / "agent-overdeclared.yaml"))
    fixed = run_workload(run, "fixed", 2048, 32)
    assert (fixed.lengths, fixed.prompt_tokens, fixed.output_tokens) == ("fixed", 2048, 32)
    agent = run_workload(run, "scenario", 2048, 32)
    assert (agent.lengths, agent.arrival, agent.warm_up) == ("agent_heavy", "poisson", 0.0)
    # agent-heavy requests (about 4000 tokens in, 1000 out) take far longer than 2048 in, 32 out
    assert fleet_capacity(run, agent) < fleet_capacity(run, fixed) / 3
