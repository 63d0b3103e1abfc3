"""Server errors in the benchmark's data plane: Envoy's consecutive-5xx outlier detection and retries of a 5xx.

The detector follows Envoy 1.38's `source/common/upstream/outlier_detection_impl.cc` (ejectHost,
checkHostForUneject, onIntervalTimer's back-off count-down) with what Istio writes for a DestinationRule's
`consecutive5xxErrors` (no success-rate or gateway-failure enforcement).
"""

from __future__ import annotations

from dataclasses import replace

from sluice.bench import targets
from sluice.bench.capacity import fleet_capacity, saturated_throughput
from sluice.bench.control import Published
from sluice.bench.dataplane import OutlierDetector
from sluice.bench.scenario import Scenario
from sluice.bench.sim import Simulation, summarise
from sluice.bench.trace import make_trace


def detector(hosts: int = 4, max_percent: int = 50) -> OutlierDetector:
    return OutlierDetector([f"h{i}" for i in range(hosts)], 5, 10.0, 30.0, max_percent)


def test_five_5xx_in_a_row_eject_a_host_and_a_success_between_them_resets_the_count() -> None:
    d = detector()
    for t in range(4):
        d.result("h0", t, True)
    d.result("h0", 4.5, False)
    for t in range(5, 9):
        d.result("h0", t, True)
    assert d.ejected(9.0) == frozenset()
    d.result("h0", 9.5, True)
    assert d.ejected(9.5) == {"h0"}


def test_an_ejected_host_returns_at_the_first_sweep_after_base_times_its_ejections() -> None:
    d = detector()
    for _ in range(5):
        d.result("h0", 12.0, True)
    assert d.ejected(49.9) == {"h0"}  # the sweep at 40 s finds 28 s served of 30
    assert d.ejected(50.0) == frozenset()  # the one at 50 s returns it
    for _ in range(5):  # ejected again before a full interval back: twice the base
        d.result("h0", 52.0, True)
    assert d.ejected(109.0) == {"h0"}
    assert d.ejected(120.0) == frozenset()


def test_the_back_off_counts_down_once_per_interval_spent_back_in_service() -> None:
    d = detector()
    for _ in range(5):
        d.result("h0", 1.0, True)
    d.ejected(40.0)  # back at 40 s, back-off 1
    d.ejected(200.0)  # many sweeps in service: back to 0
    for _ in range(5):
        d.result("h0", 201.0, True)
    assert d.ejected(239.0) == {"h0"}  # the sweep at 230 s finds 29 s served
    assert d.ejected(240.0) == frozenset()  # 30 s again, not 60


def test_no_ejection_takes_the_ejected_share_past_max_ejection_percent() -> None:
    d = detector(hosts=3, max_percent=50)
    for host in ("h0", "h1"):
        for _ in range(5):
            d.result(host, 1.0, True)
    assert d.ejected(1.0) == {"h0"}  # a second would be 67 % of the hosts
    assert d.ejections == 1


def _three_a100s(
    name: str, output_tokens: int, duration: float, own: dict[str, int] | None = None, **fields: object
) -> Scenario:
    """Three A100s on 512-token prompts (seed 5); `own`: per-pod inbound limits; `fields`: the scenario's others."""
    servers = [
        {"name": f"a100-{i}", "hardware": "a100", "inbound_max_requests": (own or {}).get(f"a100-{i}")}
        for i in range(3)
    ]
    workload = {"prompt_tokens": 512, "output_tokens": output_tokens, "duration": duration, "warm_up": 0}
    return Scenario.model_validate({"name": name, "seed": 5, "servers": servers, "workload": workload, **fields})


def _failing_fleet(retries: int, detection: bool) -> dict[str, float]:
    scenario = _three_a100s(
        "failing",
        output_tokens=32,
        duration=90,
        dataplane={"retries": retries, "outlier_detection": detection},
        events=[{"at": 0, "server": "a100-2", "error_rate": 0.5}],
    )
    trace = make_trace(scenario.workload, 0.3 * fleet_capacity(scenario), 90, 5, scenario.dataplane.sidecars)
    figures = summarise(Simulation(scenario, "least-request", trace).run())
    return {"errors": figures["error_rate"], "retried": figures["retried"], "share": figures["share"]["a100"]}


def test_retries_of_a_5xx_go_to_another_pod_and_outlier_detection_sends_less_to_a_failing_one() -> None:
    bare = _failing_fleet(0, False)
    ejecting = _failing_fleet(0, True)
    retrying = _failing_fleet(2, False)
    # a pod failing half its requests, a third of the traffic: about 1/6 of the requests fail without either
    assert 0.12 < bare["errors"] < 0.22
    assert bare["retried"] == 0
    # five 5xx in a row (1/32 per request at 50 %) eject it from a sidecar for 30 s and more: fewer errors
    assert ejecting["errors"] < 0.8 * bare["errors"]
    # a retry never lands on the pod that failed it (previous hosts): only a request failing there twice is lost
    assert retrying["errors"] < 0.01
    assert 0.12 < retrying["retried"] < 0.22


def _failing_result(figures: dict[str, list[tuple[tuple[float, float, float], tuple[float, float, float]]]]):
    """A failing-pod scenario (errors, no slowdown) at two loads: per strategy, (P99, error rate) per load."""
    return {
        "loads": [0.3, 0.7],
        "capacity": 10.0,
        "slo_ttft_p99_ms": 1000.0,
        "servers": [{"hardware": "l40s"}] * 3,
        "faults": [{"at": 90.0, "server": "l40s-2", "error_rate": 0.3}],
        "goodput": dict.fromkeys(figures, (5.0, 5.0, 5.0)),
        "strategies": {
            s: [{"ttft_p99_ms": p, "ttft_mean_ms": p, "error_rate": e} for p, e in rows] for s, rows in figures.items()
        },
    }


def _row(result, target):
    return next(c for c in targets.issue_checks({"x": result}) if c["target"].startswith(target))


def test_the_failing_pod_targets_weigh_latency_and_errors_together() -> None:
    lr = [((172.0, 160.0, 180.0), (0.10, 0.09, 0.11)), ((287.0, 280.0, 300.0), (0.10, 0.09, 0.11))]
    result = _failing_result(
        {
            "least-request": lr,
            # 1.13x the P99 at 30 % (errors 0.1x), 0.93x at 70 % (errors 0.9x)
            "sluice": [((195.0, 190.0, 200.0), (0.011, 0.01, 0.02)), ((267.0, 260.0, 270.0), (0.09, 0.085, 0.095))],
            # zeroes and queues: errors 0.1x, P99 39x
            "sluice-cube": [((203.0, 200.0, 210.0), (0.01, 0.01, 0.01)), ((11176.0, 9000.0, 12000.0), (0.05,) * 3)],
            "round-robin": [((160.0, 150.0, 170.0), (0.08, 0.07, 0.09)), ((262.0, 250.0, 270.0), (0.08, 0.07, 0.09))],
        }
    )
    no_worse = _row(result, "failing pod: P99 TTFT ≤ 1.1 × and errors")
    assert no_worse["sluice"] == ("1.03x", "**no**")  # 195 / (1.1 x 172)
    assert no_worse["sluice-cube"][1] == "**no**"
    assert no_worse["baselines_meeting"] == ["least-request", "round-robin"]
    halves = _row(result, "failing pod: P99 TTFT or errors ≤ 0.5 ×")
    assert halves["sluice"] == ("0.90x", "**no**")  # at 70 %: P99 0.93x, errors 0.90x
    # its errors at 70 %: 0.50x on the medians, 0.05 / 0.09 = 0.56x on the bounds
    assert halves["sluice-cube"] == ("0.50x", "inside interval")
    assert halves["baselines_meeting"] == []
    # a scenario whose faulty pod also slows down is not a failing-pod scenario
    slowed = {**result, "faults": [{"at": 90.0, "server": "l40s-2", "error_rate": 0.3, "slowdown": 4.0}]}
    assert not [c for c in targets.issue_checks({"x": slowed}) if c["target"].startswith("failing pod")]


def test_no_errors_on_either_side_is_equal_not_an_infinite_ratio() -> None:
    zero = (0.0, 0.0, 0.0)
    result = _failing_result({"least-request": [((100.0,) * 3, zero)] * 2, "sluice": [((105.0,) * 3, zero)] * 2})
    assert _row(result, "failing pod: P99 TTFT ≤ 1.1 × and errors")["sluice"] == ("1.00x", "yes")


def _capacity(scenario: Scenario) -> float:
    """The fleet's capacity as `fleet_capacity` measures it (each server's saturated throughput), without the
    TTFT curves it also draws."""
    return sum(saturated_throughput(scenario, s.hardware) for s in scenario.servers)


class _PeakActive(Simulation):
    """Records the most requests any one pod held at once (what its sidecar lets through to the engine)."""

    peak = 0
    peaks: dict[str, int]

    def _track(self, server: str, sidecar: int, delta: int) -> None:
        super()._track(server, sidecar, delta)
        self.peak = max(self.peak, self.global_active[server])
        self.peaks = getattr(self, "peaks", {})
        self.peaks[server] = max(self.peaks.get(server, 0), self.global_active[server])


def _overloaded(
    limit: int | None, retries: int, load: float = 1.5, own: dict[str, int] | None = None
) -> tuple[dict[str, float], int]:
    sim = _overloaded_run(limit, retries, load, own or {})
    return summarise(sim.run()), sim.peak


def _overloaded_run(limit: int | None, retries: int, load: float, own: dict[str, int]) -> _PeakActive:
    scenario = _three_a100s(
        "overloaded",
        output_tokens=128,
        duration=45,
        own=own,
        dataplane={"inbound_max_requests": limit, "refusal_retries": retries, "outlier_detection": False},
    )
    trace = make_trace(scenario.workload, load * _capacity(scenario), 45, 5, scenario.dataplane.sidecars)
    return _PeakActive(scenario, "least-request", trace)


def test_a_pods_inbound_limit_refuses_past_it_and_the_caller_retries_the_refusal_on_another_pod() -> None:
    unbounded, unbounded_peak = _overloaded(None, 2)
    bounded, peak = _overloaded(8, 0)
    # At 150 % of capacity and no limit, every request is admitted and the engines queue: nothing refused.
    assert unbounded["refused"] == 0
    assert unbounded_peak > 8
    # With 8 at most per pod, no engine ever holds more, what found its pod full failed at once, and the
    # admitted requests wait less.
    assert peak <= 8
    assert bounded["refused"] > 0.2
    assert bounded["retried"] == 0
    assert bounded["ttft_p99_ms"] < unbounded["ttft_p99_ms"]
    # Where a pod is full while another has room (80 %, 64 a pod), a refusal the route retries on another pod is
    # served there: fewer are refused for good. (At 150 % every pod is full and a retry finds no room.)
    alone, _ = _overloaded(64, 0, load=0.8)
    retried, retried_peak = _overloaded(64, 2, load=0.8)
    assert retried_peak <= 64
    assert 0 < retried["refused"] < alone["refused"]
    assert retried["retried"] > 0


def test_a_pods_own_inbound_limit_takes_the_place_of_the_data_planes() -> None:
    sim = _overloaded_run(64, 2, 1.5, {"a100-0": 4})
    figures = summarise(sim.run())
    assert sim.peaks["a100-0"] <= 4
    assert max(sim.peaks["a100-1"], sim.peaks["a100-2"]) == 64  # the others fill up to the data plane's limit
    assert figures["refused"] > 0


class _Admitted(Simulation):
    """Records every admission under a limit (the one sluice last published for its pod): past what its sidecar's
    circuit breaker counts, and past what the pod runs."""

    over: int = 0
    limited: int = 0
    past_in_flight: int = 0

    def _track(self, server: str, sidecar: int, delta: int) -> None:
        super()._track(server, sidecar, delta)
        limit = self.published.limits.get(server) if delta > 0 and self.published is not None else None
        if limit is not None:
            self.limited += 1
            _, _, counted = self.limit_counts[server]  # before this admission is counted
            self.over += counted >= limit
            self.past_in_flight += self.global_active[server] > limit


def _reporting(mode: str, enforced: bool) -> dict[str, float]:
    scenario = _three_a100s(
        "reporting",
        output_tokens=128,
        duration=40,
        dataplane={"reported_limits": enforced, "outlier_detection": False},
        sluice={"pool": {"admission": {"mode": mode}}},
    )
    trace = make_trace(scenario.workload, 1.5 * _capacity(scenario), 40, 5, scenario.dataplane.sidecars)
    sim = _Admitted(scenario, "sluice", trace)
    return {
        **summarise(sim.run()),
        "admitted_under_a_limit": sim.limited,
        "admitted_past_it": sim.over,
        "past_in_flight": sim.past_in_flight,
    }


def test_the_sidecars_enforce_the_limits_sluice_reports_only_when_the_data_plane_is_told_to() -> None:
    # Saturated from the start, every pod gets a limit in its status row within a pass or two, and from the pass
    # that publishes it no pod is given a request past it.
    enforced = _reporting("Report", enforced=True)
    assert enforced["refused"] > 0
    assert enforced["admitted_under_a_limit"] > 0
    assert enforced["admitted_past_it"] == 0
    # as Envoy does, the sidecar's new cluster counts from zero: the requests admitted before the first limit are
    # not counted, and for a while a pod runs more than its limit
    assert enforced["past_in_flight"] > 0
    reported = _reporting("Report", enforced=False)  # reported, not enforced: Report mode
    assert reported["refused"] == 0
    assert reported["admitted_past_it"] > 0
    assert _reporting("Off", enforced=True)["refused"] == 0  # nothing reported, nothing to enforce


class _Moving(Simulation):
    """The published limit of every pod alternates between 8 and 9 at each pass (a limit moved by one request
    at a time), or stays at 8; records the most requests a pod ran at once after `SETTLED` seconds (the requests
    admitted before the first limit are done by then)."""

    moving = True
    passes = 0
    peak = 0

    def _publish(self, t: float, published: Published | None) -> None:
        if published is not None:
            self.passes += 1
            limit = 8 + (self.passes % 2 if self.moving else 0)
            published = replace(published, limits=dict.fromkeys(self.names, limit))
        super()._publish(t, published)

    def _track(self, server: str, sidecar: int, delta: int) -> None:
        super()._track(server, sidecar, delta)
        if self.now > SETTLED:
            self.peak = max(self.peak, self.global_active[server])


SETTLED = 40.0


def test_a_limit_that_keeps_moving_lets_a_pod_run_far_past_it() -> None:
    # Each change is a new Envoy cluster counting from zero (tests/test_envoy_inbound_limit.py shows it on real
    # Envoy): the simulated sidecars count the same way, so a limit moved every pass bounds little.
    scenario = _three_a100s(
        "moving",
        output_tokens=256,
        duration=80,
        dataplane={"reported_limits": True, "outlier_detection": False},
        sluice={"interval": 2, "scrape_interval": 1, "pool": {"admission": {"mode": "Report"}}},
    )
    trace = make_trace(scenario.workload, 1.5 * _capacity(scenario), 80, 5, scenario.dataplane.sidecars)
    steady = _Moving(scenario, "sluice", trace)
    steady.moving = False
    steady.run()
    moving = _Moving(scenario, "sluice", trace)
    moving.run()
    assert moving.passes > 20
    assert steady.peak == 8
    assert moving.peak > 9  # past the largest limit it was ever given (17 here: nearly two limits at once)
