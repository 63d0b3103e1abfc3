"""The routing benchmark can tell good routing from bad: servers saturate, arrivals are shared, Envoy is Envoy."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest

from sluice.bench import targets
from sluice.bench.calibration import calibrate
from sluice.bench.capacity import best_split, fleet_capacity, run_alone, server_curves
from sluice.bench.dataplane import WeightedRandom
from sluice.bench.report import median_interval, run
from sluice.bench.scenario import load
from sluice.bench.sim import STRATEGIES, Outcome, Simulation, summarise
from sluice.bench.trace import make_trace, write_azure_csv
from sluice.sim.engine import Engine
from sluice.sim.leastrequest import EnvoyLeastRequest
from sluice.sim.profiles import server_profile

SCENARIOS = Path(__file__).resolve().parents[1] / "benchmarks" / "scenarios"


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, object], Path]:
    out = tmp_path_factory.mktemp("bench")
    return run([SCENARIOS / "smoke.yaml"], out, plots=True, jobs=1), out


# ---------------------------------------------------------------------------------------------- the servers


def test_a_server_s_p99_ttft_at_90_percent_of_capacity_is_at_least_three_times_idle() -> None:
    scenario = load(SCENARIOS / "smoke.yaml")
    for server in scenario.servers:
        curve = server_curves(scenario)[server.hardware]
        idle, busy = curve.runs[0].p99_ttft, curve.runs[8].p99_ttft
        assert busy >= 3 * idle, (server.hardware, idle, busy)


def test_overload_fills_the_kv_cache_queues_requests_and_preempts() -> None:
    scenario = load(SCENARIOS / "smoke.yaml")
    capacity = server_curves(scenario)["cpu"].capacity
    overload = run_alone(scenario, "cpu", 1.3 * capacity, seed=1)
    assert overload.peak_kv > 0.8
    assert overload.peak_waiting > 0
    assert overload.preemptions > 0


def test_preempted_requests_are_recomputed_and_still_finish() -> None:
    profile = dataclasses.replace(server_profile("rtx4090"), total_kv_blks=200)  # 3200 tokens of KV
    engine = Engine(profile)
    for i in range(6):
        engine.submit(i, 0.0, 600, 200)
    finished = set()
    while engine.next_event_time() < math.inf:
        finished |= {e.sequence.req_id for e in engine.advance_to(engine.next_event_time()) if e.kind == "finished"}
    assert finished == set(range(6))
    assert engine.preemptions_total > 0
    assert engine.free_blocks == engine.total_blocks


def test_requests_are_served_first_come_first_served() -> None:
    engine = Engine(dataclasses.replace(server_profile("cpu"), total_kv_blks=100))
    for i in range(5):
        engine.submit(i, 0.0, 1000, 10)
    order = []
    while engine.next_event_time() < math.inf:
        order += [e.sequence.req_id for e in engine.advance_to(engine.next_event_time()) if e.kind == "first_token"]
    assert order == sorted(order)


@pytest.mark.parametrize("hardware", ["a100", "rtx4090", "cpu"])
def test_prefill_rate_and_decode_step_are_within_2x_of_first_principles(hardware: str) -> None:
    row = calibrate(hardware, "llama-3.1-8b")
    assert 0.5 <= row.prefill_ratio <= 2.0
    assert 0.5 <= row.decode_ratio <= 2.0


# ---------------------------------------------------------------------------------------------- the data plane


def test_least_request_with_equal_weights_draws_with_replacement_and_keeps_the_first_on_ties() -> None:
    active = {"a": 0, "b": 5}
    balancer = EnvoyLeastRequest(active, random.Random(1), choice_count=2, bias=1.0)
    balancer.update({"a": 1.0, "b": 1.0})
    picks = [balancer.pick() for _ in range(4000)]
    assert picks.count("b") / len(picks) == pytest.approx(0.25, abs=0.03)  # both draws land on b
    active["b"] = 0
    ties = [balancer.pick() for _ in range(4000)]
    assert ties.count("a") / len(ties) == pytest.approx(0.5, abs=0.03)


def test_the_edf_schedule_is_rebuilt_only_when_the_weights_change() -> None:
    balancer = EnvoyLeastRequest({"a": 0, "b": 0}, random.Random(1), choice_count=2, bias=1.0)
    balancer.update({"a": 3.0, "b": 1.0})
    first = balancer.scheduler
    balancer.update({"a": 3.0, "b": 1.0})
    assert balancer.scheduler is first
    picks = [balancer.pick() for _ in range(400)]
    assert picks.count("a") == pytest.approx(300, abs=2)
    balancer.update({"a": 1.0, "b": 1.0})
    assert balancer.scheduler is None  # equal weights: back to power of two choices


def test_a_weighted_random_split_replays_its_shares() -> None:
    split = WeightedRandom({"a": 3.0, "b": 1.0, "c": 0.0}, random.Random(2))
    picks = [split.pick() for _ in range(8000)]
    assert picks.count("a") / len(picks) == pytest.approx(0.75, abs=0.02)
    assert "c" not in picks


# ---------------------------------------------------------------------------------------------- fair comparison


def test_every_strategy_replays_the_same_arrivals() -> None:
    scenario = load(SCENARIOS / "smoke.yaml")
    trace = make_trace(scenario.workload, 8.0, scenario.workload.duration, 3, 8)
    assert trace == make_trace(scenario.workload, 8.0, scenario.workload.duration, 3, 8)
    seen = {
        s: [o.arrival for o in Simulation(scenario, s, trace, best_split(scenario, 8.0)).run().outcomes]
        for s in ("round-robin", "sluice", "best-static")
    }
    assert seen["round-robin"] == seen["sluice"] == seen["best-static"] == trace


def test_a_faster_sweep_point_is_the_same_requests_arriving_sooner() -> None:
    work = load(SCENARIOS / "smoke.yaml").workload
    slow, fast = make_trace(work, 4.0, 60, 3, 8), make_trace(work, 8.0, 60, 3, 8)
    assert [a.at / 2 for a in slow] == pytest.approx([a.at for a in fast[: len(slow)]])


def test_the_best_static_split_adds_up_to_the_load_and_favours_the_faster_server() -> None:
    scenario = load(SCENARIOS / "smoke.yaml")
    rate = 0.6 * fleet_capacity(scenario)
    split = best_split(scenario, rate)
    assert sum(split.values()) == pytest.approx(rate)
    assert split["a100-0"] > 2 * split["cpu-0"]


def test_the_median_interval_is_the_range_for_five_seeds_and_narrower_for_many() -> None:
    assert median_interval([5, 1, 4, 2, 3]) == (3, 1, 5)
    med, lo, hi = median_interval([float(i) for i in range(30)])
    assert 0 < lo < med < hi < 29


def test_a_target_every_baseline_meets_is_removed() -> None:
    row = {"ttft_p99_ms": (100.0, 90.0, 110.0)}
    result = {
        "loads": [0.7],
        "capacity": 10.0,
        "slo_ttft_p99_ms": 1000.0,
        "goodput": dict.fromkeys(("sluice", "least-request", "round-robin", "best-static"), (9.0, 8.0, 9.0)),
        "strategies": {s: [row] for s in ("sluice", "least-request", "round-robin")},
    }
    checks = targets.check({"x": result})
    assert checks
    assert not any(c["kept"] for c in checks)
    result["strategies"]["round-robin"] = [{"ttft_p99_ms": (5000.0, 4000.0, 6000.0)}]
    kept = {c["target"]: c for c in targets.check({"x": result}) if c["kept"]}
    assert kept[f"P99 TTFT within the SLO at the load nearest {targets.NEAR:.0%}"]["failed_by"] == ["round-robin"]


def _issue_result(p99: dict[str, tuple[float, float, float]], goodput: dict[str, tuple[float, float, float]]):
    """A heterogeneous scenario at one load (0.7) with the given P99s and goodputs."""
    row = {s: [{"ttft_p99_ms": v, "ttft_mean_ms": v, "completed": (100.0, 100.0, 100.0)}] for s, v in p99.items()}
    return {
        "loads": [0.7],
        "capacity": 10.0,
        "slo_ttft_p99_ms": 1000.0,
        "servers": [{"hardware": "a100"}, {"hardware": "cpu"}],
        "goodput": goodput,
        "strategies": row,
    }


def _issue_row(result, target):
    return next(c for c in targets.issue_checks({"x": result}) if c["target"].startswith(target))


def test_an_unbounded_least_request_is_named_not_read_as_a_zero_ratio() -> None:
    inf = math.inf
    g = dict.fromkeys(("sluice", "sluice-cube", "least-request", "round-robin"), (5.0, 5.0, 5.0))
    result = _issue_result(
        {
            "sluice": (300.0, 200.0, 400.0),
            "sluice-cube": (inf, inf, inf),
            "least-request": (inf, inf, inf),
            "round-robin": (inf, inf, inf),
        },
        g,
    )
    row = _issue_row(result, "P99 TTFT ≤ 0.5 × least-request")
    assert row["sluice"] == ("least-request unbounded", "yes")
    assert row["sluice-cube"] == ("∞ (unbounded)", "**no**")  # ∞ against ∞ is no win
    assert "0.00x" not in targets.issue_table([row])


def test_a_difference_inside_the_intervals_is_not_a_win_and_baselines_are_checked_too() -> None:
    g = dict.fromkeys(("sluice", "sluice-cube", "least-request", "round-robin"), (5.0, 5.0, 5.0))
    p99 = {
        "sluice": (330.0, 306.0, 2743.0),  # median 0.77x least-request's, but its interval reaches past it
        "sluice-cube": (100.0, 90.0, 110.0),
        "least-request": (426.0, 394.0, 445.0),
        "round-robin": (100.0, 90.0, 120.0),  # a baseline meeting it too
    }
    row = _issue_row(_issue_result(p99, g), "P99 TTFT ≤ 0.8 × least-request, every load 70")
    assert row["sluice"][1] == "inside interval"
    assert row["sluice-cube"][1] == "yes"
    assert row["baselines_meeting"] == ["round-robin"]
    assert not row["degenerate"]  # least-request itself fails it
    never_worse = _issue_row(_issue_result(p99, g), "P99 TTFT ≤ least-request's at every load")
    assert never_worse["baselines_meeting"] == ["least-request", "round-robin"]
    assert never_worse["degenerate"]
    assert "degenerate, not a win" in targets.issue_table([never_worse])


def test_a_goodput_against_a_reference_of_zero_is_not_an_infinite_factor() -> None:
    g = {"sluice": (6.0, 5.0, 7.0), "sluice-cube": (0.0, 0.0, 0.0), "least-request": (0.0, 0.0, 0.0)}
    p99 = dict.fromkeys(g, (100.0, 90.0, 110.0))
    row = _issue_row(_issue_result(p99, g), "goodput at SLO ≥ 1.5 × least-request")
    assert row["sluice"] == ("reference has no goodput (0 req/s)", "yes")
    assert row["sluice-cube"] == ("1.00x", "**no**")


def test_the_report_is_rendered_again_from_stored_results_with_current_labels(tmp_path: Path) -> None:
    from sluice.bench.report import rerender  # noqa: PLC0415

    g = dict.fromkeys(("sluice", "sluice-cube", "least-request"), (5.0, 5.0, 5.0))
    r = _issue_result(dict.fromkeys(g, (100.0, 90.0, 110.0)), g)
    r["servers"] = [
        {
            "name": n,
            "hardware": h,
            "capacity": 5.0,
            "idle_p99_ms": 100.0,
            "p99_at_90_ms": 200.0,
            "peak_kv_at_90": 0.5,
            "peak_waiting_at_90": 1,
            "preemptions_at_110": 0,
        }
        for n, h in (("a100-0", "a100"), ("cpu-0", "cpu"))
    ]
    for rows in r["strategies"].values():
        rows[0].update(ttft_p50_ms=(50.0, 40.0, 60.0), share={})
    r.update(description="old", held_out=True, seeds=[7], seconds=1.0)
    stored = tmp_path / "results.json"
    stored.write_text(json.dumps({"scenarios": {"seed-000-fast": r}, "calibration": [], "seconds": 1.0}))
    scenario = tmp_path / "seed-000-fast.yaml"
    scenario.write_text(
        "name: seed-000-fast\ndescription: new\nservers: [{name: a, hardware: a100}]\nsame_traces_as: seed-000\n"
    )
    text = rerender(stored, [scenario], tmp_path / "out")
    assert "seed-000's traces (not held out)" in text
    assert "| seed-000-fast | held out |" not in text
    assert (tmp_path / "out" / "report.md").read_text() == text


def test_a_scenario_on_anothers_traces_cannot_be_held_out(tmp_path: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: s\nservers: [{name: a, hardware: a100}]\nsame_traces_as: seed-000\nheld_out: true\n")
    with pytest.raises(ValueError, match="same_traces_as"):
        load(scenario)


# ---------------------------------------------------------------------------------------------- the whole run


def test_the_smoke_benchmark_runs_every_strategy_and_writes_the_report(
    smoke_results: tuple[dict[str, object], Path],
) -> None:
    results, out = smoke_results
    smoke = results["scenarios"]["smoke"]  # type: ignore[index]
    assert set(smoke["strategies"]) == set(STRATEGIES)
    at_high = {s: rows[-1]["ttft_p99_ms"][0] for s, rows in smoke["strategies"].items()}
    # Round robin sends the CPU node half the load: far past its capacity at 70 % of the fleet's.
    assert smoke["strategies"]["round-robin"][-1]["share"]["cpu"] == pytest.approx(0.5, abs=0.03)
    assert at_high["round-robin"] > 10 * at_high["best-static"]
    assert json.loads((out / "results.json").read_text())["scenarios"]["smoke"]
    report = (out / "report.md").read_text()
    assert "| sluice |" in report
    assert "## Targets" in report
    assert "## Calibration" in report
    assert (out / "smoke-ttft-vs-load.png").stat().st_size > 1000
    assert (out / "smoke-sluice-weights.png").exists()


def test_sluice_in_the_loop_publishes_weights_from_the_real_core(
    smoke_results: tuple[dict[str, object], Path],
) -> None:
    weights = smoke_results[0]["scenarios"]["smoke"]["weights"]  # type: ignore[index]
    assert weights, "the core never published"
    last = weights[-1][1]
    assert last["a100-0"] > last["cpu-0"] >= 1


def test_the_simulation_is_deterministic_for_a_trace() -> None:
    scenario = load(SCENARIOS / "smoke.yaml")
    trace = make_trace(scenario.workload, 10.0, scenario.workload.duration, 3, 8)
    a, b = (summarise(Simulation(scenario, "sluice", trace).run()) for _ in range(2))
    assert a == b


def test_the_trace_is_written_as_an_azure_public_dataset_csv(tmp_path: Path) -> None:
    work = load(SCENARIOS / "smoke.yaml").workload
    trace = make_trace(work, 2.0, 10, 3, 1)
    write_azure_csv(trace, tmp_path / "trace.csv")
    lines = (tmp_path / "trace.csv").read_text().splitlines()
    assert lines[0] == "TIMESTAMP,ContextTokens,GeneratedTokens"
    assert len(lines) == len(trace) + 1
    assert lines[1].endswith(",1024,64")


# ---------------------------------------------------------------------------------------------- tenant shares


def test_tenants_are_drawn_from_their_own_stream_leaving_every_other_draw_alone() -> None:
    work = load(SCENARIOS / "smoke.yaml").workload
    plain = make_trace(work, 10.0, 60.0, 3, 4)
    shared = make_trace(work.model_copy(update={"tenants": {"a": 4.0, "b": 1.0}}), 10.0, 60.0, 3, 4)
    assert [dataclasses.replace(a, tenant=None) for a in shared] == plain
    counts = {t: sum(1 for a in shared if a.tenant == t) for t in ("a", "b")}
    assert counts["a"] > 2.5 * counts["b"]  # 4:1


def test_a_tenants_429_is_not_a_5xx_to_the_callers_outlier_detection() -> None:
    # Envoy's outlier detection counts 5xx (source/common/upstream/outlier_detection_impl.cc, putHttpResponseCode:
    # any other code resets the consecutive-5xx count), so a noisy tenant refused at every pod ejects none.
    scenario = load(SCENARIOS / "noisy-tenant.yaml")
    arrival = make_trace(scenario.workload, 10.0, 10.0, scenario.seed, 1)[0]
    for status, ejected in ((429, 0), (503, 1)):
        sim = Simulation(scenario, "sluice", [arrival])
        assert sim.outliers is not None
        threshold = sim.pool.protection.outlier_detection.consecutive_5xx_errors
        for _ in range(threshold):
            sim._refuse(arrival, Outcome(arrival, "a100-0"), "a100-0", 0, 2, frozenset(), status=status)
        assert sim.outliers[0].ejections == ejected


def test_a_429_is_retried_only_where_the_pools_retry_policy_names_it() -> None:
    scenario = load(SCENARIOS / "noisy-tenant.yaml")
    arrival = make_trace(scenario.workload, 10.0, 10.0, scenario.seed, 1)[0]
    without = {k: v for k, v in scenario.sluice.pool.items() if k != "routing"}
    for pool, given_up in ((scenario.sluice.pool, False), (without, True)):
        seeded = scenario.model_copy(update={"sluice": scenario.sluice.model_copy(update={"pool": pool})})
        sim = Simulation(seeded, "sluice", [arrival])
        outcome = Outcome(arrival, "a100-0")
        sim._refuse(arrival, outcome, "a100-0", 0, 0, frozenset(), status=429)
        assert outcome.refused is given_up


def test_a_simulated_pods_refusals_read_as_istio_counts_them() -> None:
    """The simulated Prometheus reads a pod's sidecar refusals as `refusedRate` over the window: nothing before
    its sidecar answered anything (Istio's counter has no series yet), 0 once it answered and refused none."""
    from sluice.bench.control import ScrapedServer  # noqa: PLC0415

    server = ScrapedServer("a", "a100", "v1")
    server.scrape(10.0, 0, 0, 0.0, 60.0)
    assert server.signals(30.0).refused_rate is None
    server.observe_outcome(12.0, True)
    server.scrape(20.0, 1, 0, 0.1, 60.0)
    assert server.signals(30.0).refused_rate == 0.0
    for at in (21.0, 22.0, 23.0):
        server.observe_refusal(at)
    server.scrape(30.0, 1, 0, 0.1, 60.0)
    assert server.signals(30.0).refused_rate == pytest.approx(3 / 30)
    server.scrape(70.0, 0, 0, 0.0, 60.0)  # the window has moved past them
    assert server.signals(30.0).refused_rate == 0.0
