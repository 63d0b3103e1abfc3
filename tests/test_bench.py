"""The routing benchmark keeps working: a tiny scenario through every strategy, with the real sluice core."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.bench.report import run, targets
from sluice.bench.scenario import load
from sluice.bench.sim import STRATEGIES, Edf, Simulation

SCENARIOS = Path(__file__).resolve().parents[1] / "benchmarks" / "scenarios"


def test_smoke_scenario_runs_every_strategy_and_writes_the_report(tmp_path: Path) -> None:
    results = run([SCENARIOS / "smoke.yaml"], tmp_path, plots=True)
    figures = results["smoke"]["strategies"]
    assert set(figures) == set(STRATEGIES)
    for strategy, row in figures.items():
        assert row["completed"] + row["failed"] == 180, strategy  # 200 requests, 10% warm-up
        assert row["ttft_p99_ms"] >= row["ttft_p50_ms"] > 0
    # Two servers, one fast, one slow: round robin halves the traffic by construction; sluice's weights must
    # keep the slow server far below what least-request (active counts only) sends it.
    assert figures["round-robin"]["slowest_class_share"] == pytest.approx(0.5, abs=0.01)
    assert figures["sluice"]["slowest_class_share"] < figures["least-request"]["slowest_class_share"] / 3
    assert figures["sluice"]["ttft_mean_ms"] < figures["least-request"]["ttft_mean_ms"] / 2
    assert json.loads((tmp_path / "results.json").read_text())["smoke"]
    report = (tmp_path / "report.md").read_text()
    assert "| sluice |" in report
    assert (tmp_path / "smoke-ttft-cdf.png").stat().st_size > 1000
    assert (tmp_path / "smoke-sluice-weights.png").exists()


def test_the_simulation_is_deterministic_for_a_seed() -> None:
    scenario = load(SCENARIOS / "smoke.yaml")
    a = Simulation(scenario, "sluice").run()
    b = Simulation(scenario, "sluice").run()
    assert [(o.server, o.ttft) for o in a.outcomes] == [(o.server, o.ttft) for o in b.outcomes]


def test_sluice_in_the_loop_publishes_weights_from_the_real_core() -> None:
    result = Simulation(load(SCENARIOS / "smoke.yaml"), "sluice").run()
    assert result.weights, "the core never published"
    last = result.weights[-1][1]
    assert last["a100-0"] > last["cpu-0"] >= 1


def test_edf_shares_in_proportion_to_weight_when_idle() -> None:
    edf = Edf(["a", "b"], {"a": 3.0, "b": 1.0}.__getitem__)
    picks = [edf.pick() for _ in range(400)]
    assert picks.count("a") == 300


def test_targets_report_met_and_not_met() -> None:
    results = {
        "seed-000": {
            "strategies": {
                "round-robin": {"ttft_mean_ms": 100.0, "ttft_p99_ms": 1000.0, "output_tokens_per_s": 10.0},
                "least-request": {"ttft_mean_ms": 50.0, "ttft_p99_ms": 400.0, "output_tokens_per_s": 10.0},
                "sluice": {"ttft_mean_ms": 20.0, "ttft_p99_ms": 150.0, "output_tokens_per_s": 10.0},
                "oracle": {"ttft_mean_ms": 10.0, "ttft_p99_ms": 50.0, "output_tokens_per_s": 10.0},
            }
        }
    }
    verdicts = {label: met for label, _, met in targets(results)}
    assert verdicts["seed-000: sluice mean TTFT vs round robin"] is True
    assert verdicts["seed-000: sluice P99 TTFT vs round robin"] is False  # 0.15 > 0.10
    assert verdicts["seed-000: sluice P99 TTFT vs oracle"] is False  # 3x
