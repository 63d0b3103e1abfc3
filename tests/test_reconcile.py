"""One reconcile pass end to end through the pure core: weights, fast-zeroing, recovery, fail-static, floor."""

from __future__ import annotations

import pytest

from sluice.api.v1alpha1 import InferencePoolStatus
from sluice.core.observed import PodSignals
from sluice.core.reconcile import plan_pass
from tests.helpers import at, condition, observed, pod, run, sig, spec, states, weights

HETERO = [pod("a100-0", "a100"), pod("a100-1", "a100"), pod("4090-0", "rtx4090"), pod("cpu-0", "cpu")]
HETERO_SIGNALS = {
    "a100-0": sig(ttft=0.035),
    "a100-1": sig(ttft=0.040),
    "4090-0": sig(ttft=0.080),
    "cpu-0": sig(ttft=0.300),
}


def test_weights_follow_capacity_and_ttft_a100_over_4090_over_cpu():
    plan = run(spec(), HETERO, HETERO_SIGNALS, 0)
    w = weights(plan)
    assert w["a100-0"] == 1000
    assert w["a100-0"] >= w["a100-1"] > w["4090-0"] > w["cpu-0"] >= 1
    assert plan.publish
    assert condition(plan, "Ready") == ("True", "WeightsPublished")
    assert plan.status.routable == "4/4"


def test_weight_ratio_is_capacity_over_latency_penalty_with_linear_sharpness():
    # Seed 000's score: alpha 0.7, baseline 100ms: penalty(35ms)=0.545, penalty(300ms)=2.4; K 10 vs 1 -> 44x.
    s = spec(scoring={"kvCacheCoefficient": 0, "queueCoefficient": 0, "maxWeight": 1000, "sharpness": 1})
    plan = run(s, [HETERO[0], HETERO[3]], {"a100-0": sig(ttft=0.035), "cpu-0": sig(ttft=0.3)}, 0)
    w = weights(plan)
    assert w["a100-0"] == 1000
    assert w["cpu-0"] == round(1000 * (1 / 2.4) / (10 / 0.545))


def test_default_sharpness_cubes_the_capacity_latency_ratio():
    s = spec(scoring={"kvCacheCoefficient": 0, "queueCoefficient": 0, "maxWeight": 100000})
    plan = run(s, [HETERO[0], HETERO[2]], {"a100-0": sig(ttft=0.035), "4090-0": sig(ttft=0.08)}, 0)
    ratio = (4 / (0.7 * 0.8 + 0.3)) / (10 / 0.545)
    assert weights(plan)["4090-0"] == round(100000 * ratio**3)


def test_tiny_score_changes_publish_nothing_hysteresis():
    s = spec()
    first = run(s, HETERO, HETERO_SIGNALS, 0)
    nudged = {**HETERO_SIGNALS, "4090-0": sig(ttft=0.083)}
    second = run(s, HETERO, nudged, 5, first.status)
    assert weights(second) == weights(first)


def test_large_score_change_is_published():
    s = spec(scoring={"smoothing": 0})
    first = run(s, HETERO, HETERO_SIGNALS, 0)
    slowed = {**HETERO_SIGNALS, "4090-0": sig(ttft=0.400)}
    second = run(s, HETERO, slowed, 5, first.status)
    assert weights(second)["4090-0"] < weights(first)["4090-0"]


def test_error_rate_over_threshold_zeroes_pod_at_once_and_removes_it_from_endpoints():
    bad = {**HETERO_SIGNALS, "a100-1": sig(errors=0.35)}
    plan = run(spec(), HETERO, bad, 0)
    assert weights(plan)["a100-1"] == 0
    assert states(plan)["a100-1"] == "Zeroed"
    assert "a100-1" not in {e.pod for e in plan.endpoints}
    row = next(r for r in plan.status.endpoints if r.pod == "a100-1")
    assert "error rate 35.0%" in row.reason
    assert any(e.reason == "PodZeroed" for e in plan.events)
    assert condition(plan, "Degraded") == ("True", "PodsZeroed")


def test_lora_failure_rate_zeroes_pod():
    bad = {**HETERO_SIGNALS, "a100-1": sig(lora=0.06)}
    plan = run(spec(), HETERO, bad, 0)
    assert states(plan)["a100-1"] == "Zeroed"
    row = next(r for r in plan.status.endpoints if r.pod == "a100-1")
    assert row.incident == "LoraFailures"


def test_oom_restart_seen_in_pod_status_zeroes_pod():
    first = run(spec(), HETERO, HETERO_SIGNALS, 0)
    oomed = [*HETERO[:2], pod("4090-0", "rtx4090", restarts=1, last_termination_reason="OOMKilled"), HETERO[3]]
    second = run(spec(), oomed, HETERO_SIGNALS, 5, first.status)
    assert states(second)["4090-0"] == "Zeroed"
    assert next(r for r in second.status.endpoints if r.pod == "4090-0").incident == "OOMKilled"


def test_restart_without_oom_is_ignored_when_zero_on_restart_is_off():
    s = spec(protection={"zeroOnRestart": False})
    first = run(s, HETERO, HETERO_SIGNALS, 0)
    restarted = [*HETERO[:2], pod("4090-0", "rtx4090", restarts=1, last_termination_reason="Error"), HETERO[3]]
    second = run(s, restarted, HETERO_SIGNALS, 5, first.status)
    assert states(second)["4090-0"] == "Routable"


def test_consecutive_failing_passes_break_the_circuit_on_the_third():
    s = spec(protection={"consecutiveFailures": 3})
    flaky = {**HETERO_SIGNALS, "a100-1": sig(errors=0.05)}  # above every band, below fast-zero (10%)
    status = None
    seen = []
    for i in range(3):
        plan = run(s, HETERO, flaky, i * 5, status)
        status = plan.status
        seen.append(states(plan)["a100-1"])
    assert seen == ["Routable", "Routable", "Zeroed"]


def test_pod_between_bands_keeps_band_share_of_weight():
    s = spec(scoring={"smoothing": 0, "hysteresisPercent": 0})
    clean = run(s, HETERO, HETERO_SIGNALS, 0)
    mild = run(s, HETERO, {**HETERO_SIGNALS, "a100-1": sig(ttft=0.040, errors=0.01)}, 0)
    assert weights(mild)["a100-1"] == pytest.approx(weights(clean)["a100-1"] * 0.75, abs=1)


def test_recovery_waits_quiet_period_then_ramps_geometrically_then_resumes_normal_scoring():
    s = spec(scoring={"smoothing": 0, "hysteresisPercent": 0, "maxWeight": 1000})
    bad = {**HETERO_SIGNALS, "a100-1": sig(ttft=0.035, errors=0.5)}
    good = {**HETERO_SIGNALS, "a100-1": PodSignals(ttft_seconds=0.035, kv_cache_usage=0.3, queue_length=0)}
    plan = run(s, HETERO, bad, 0)
    assert states(plan)["a100-1"] == "Zeroed"
    status = plan.status
    timeline = {}
    for t in range(5, 140, 5):
        plan = run(s, HETERO, good, t, status)
        status = plan.status
        timeline[t] = (states(plan)["a100-1"], weights(plan)["a100-1"])
    assert all(timeline[t] == ("Zeroed", 0) for t in (5, 10, 25))
    assert timeline[30][0] == "Recovering"
    assert timeline[30][1] == 10  # 1% of 1000
    assert timeline[40][1] == 15  # x1.5 after one step interval
    assert timeline[50][1] == 22
    ramp = [timeline[t][1] for t in range(30, 125, 10)]
    assert ramp == sorted(ramp)
    assert max(w for state, w in timeline.values() if state == "Recovering") <= 500  # cap 50%
    assert timeline[135] == ("Routable", 1000)


def test_recovered_event_is_emitted_when_ramp_ends():
    s = spec(scoring={"smoothing": 0})
    bad = {**HETERO_SIGNALS, "a100-1": sig(errors=0.5)}
    status = run(s, HETERO, bad, 0).status
    reasons = []
    for t in range(5, 200, 5):
        plan = run(s, HETERO, HETERO_SIGNALS, t, status)
        status = plan.status
        reasons += [e.reason for e in plan.events]
    assert reasons.count("PodRecovering") == 1
    assert reasons.count("PodRecovered") == 1


def test_old_errors_in_the_rate_window_do_not_rezero_a_recovering_pod():
    s = spec(metrics={"window": "1m"})
    bad = {**HETERO_SIGNALS, "a100-1": sig(errors=0.5)}
    status = run(s, HETERO, bad, 0).status
    # The window still shows the old errors at 35 s; only fresh evidence (after a full window) counts.
    plan = run(s, HETERO, bad, 35, status)
    assert states(plan)["a100-1"] == "Recovering"
    plan = run(s, HETERO, bad, 65, plan.status)
    assert states(plan)["a100-1"] == "Zeroed"


def test_prometheus_failure_freezes_every_weight_and_says_so():
    first = run(spec(), HETERO, HETERO_SIGNALS, 0)
    plan = run(spec(), HETERO, {}, 5, first.status, failed={"ttft": "connection refused"})
    assert weights(plan) == weights(first)
    assert condition(plan, "MetricsAvailable") == ("False", "QueryFailed")
    assert any(e.reason == "MetricsUnavailable" for e in plan.events)
    assert all("frozen" in r.reason for r in plan.status.endpoints)


def test_stale_signals_freeze_weights_even_if_they_look_alarming():
    first = run(spec(), HETERO, HETERO_SIGNALS, 0)
    terrible = {name: sig(errors=0.9, ttft=5.0) for name in HETERO_SIGNALS}
    # Collected at t=0, used at t=300: older than staleAfter (1m).
    plan = plan_pass(spec(), 1, observed(HETERO, terrible, at(0)), first.status, at(300))
    assert weights(plan) == weights(first)
    assert condition(plan, "MetricsAvailable") == ("False", "Stale")


def test_recovering_pod_does_not_ramp_blind_while_metrics_are_down():
    s = spec()
    status = run(s, HETERO, {**HETERO_SIGNALS, "a100-1": sig(errors=0.5)}, 0).status
    status = run(s, HETERO, HETERO_SIGNALS, 30, status).status
    before = {row.pod: row.weight for row in status.endpoints}["a100-1"]
    plan = run(s, HETERO, {}, 60, status, failed={"queueLength": "timeout"})
    assert weights(plan)["a100-1"] == before


def test_oom_still_zeroes_during_a_prometheus_outage():
    first = run(spec(), HETERO, HETERO_SIGNALS, 0)
    oomed = [*HETERO[:2], pod("4090-0", "rtx4090", restarts=1, last_termination_reason="OOMKilled"), HETERO[3]]
    plan = run(spec(), oomed, {}, 5, first.status, failed={"ttft": "down"})
    assert states(plan)["4090-0"] == "Zeroed"


def test_pod_missing_from_prometheus_keeps_its_weight_and_is_reported():
    first = run(spec(), HETERO, HETERO_SIGNALS, 0)
    partial = {k: v for k, v in HETERO_SIGNALS.items() if k != "4090-0"}
    plan = run(spec(), HETERO, partial, 5, first.status)
    assert weights(plan)["4090-0"] == weights(first)["4090-0"]
    assert condition(plan, "Degraded") == ("True", "PodsUnobserved")


def test_pod_with_samples_but_no_ttft_yet_is_scored_from_the_default_ttft_and_reported():
    no_traffic = {**HETERO_SIGNALS, "cpu-0": sig(ttft=None, p95=None, rps=0.0, errors=None)}
    plan = run(spec(), HETERO, no_traffic, 0)
    row = next(r for r in plan.status.endpoints if r.pod == "cpu-0")
    assert row.weight >= 1
    assert "(default)" in row.reason
    assert row.missing_signals == ["ttft", "ttftP95", "errorRate"]
    assert condition(plan, "Degraded") == ("True", "SignalsMissing")


def test_new_pod_without_any_samples_is_not_routed_until_it_has_evidence():
    plan = run(spec(), HETERO, {k: v for k, v in HETERO_SIGNALS.items() if k != "cpu-0"}, 0)
    row = next(r for r in plan.status.endpoints if r.pod == "cpu-0")
    assert (row.weight, row.verdict) == (0, "awaiting")
    assert "cpu-0" not in {e.pod for e in plan.endpoints}
    assert condition(plan, "Degraded") == ("True", "AwaitingEvidence")


def test_floor_keeps_half_the_pool_routable_and_zeroes_the_worst_first():
    s = spec(protection={"minRoutablePercent": 50})
    failing = {
        "a100-0": sig(errors=0.9),
        "a100-1": sig(errors=0.2),
        "4090-0": sig(errors=0.5),
        "cpu-0": sig(ttft=0.3),
    }
    plan = run(s, HETERO, failing, 0)
    routable = [r for r in plan.status.endpoints if r.weight > 0]
    assert len(routable) == 2
    # Two could be zeroed; the mildest failure (a100-1 at 20%) is held at minimum weight.
    assert weights(plan)["a100-1"] == 1
    assert weights(plan)["a100-0"] == 0
    assert weights(plan)["4090-0"] == 0
    assert condition(plan, "Degraded") == ("True", "FloorHeld")
    assert any(e.reason == "FloorHeld" for e in plan.events)


def test_every_pod_failing_never_publishes_an_all_zero_pool():
    s = spec(protection={"minRoutablePercent": 0})
    failing = {name: sig(errors=0.9) for name in HETERO_SIGNALS}
    plan = run(s, HETERO, failing, 0)
    assert sum(weights(plan).values()) > 0
    assert plan.publish


def test_no_ready_pod_publishes_nothing():
    pods = [pod("a", ready=False), pod("b", deleting=True), pod("c", ip=None, ready=True)]
    plan = run(spec(), pods, {}, 0)
    assert not plan.publish
    assert condition(plan, "Ready") == ("False", "NoReadyPods")
    reasons = {r.pod: r.reason for r in plan.status.endpoints}
    assert reasons == {"a": "pod is not Ready", "b": "pod is terminating", "c": "pod has no IP yet"}


def test_pods_outside_the_selector_are_ignored():
    stranger = pod("other", "a100").model_copy(update={"labels": {"app": "mistral"}})
    plan = run(spec(), [*HETERO, stranger], HETERO_SIGNALS, 0)
    assert "other" not in weights(plan)


def test_condition_keeps_its_transition_time_while_unchanged():
    first = run(spec(), HETERO, HETERO_SIGNALS, 0)
    second = run(spec(), HETERO, HETERO_SIGNALS, 5, first.status)
    t1 = next(c for c in first.status.conditions if c.type == "Ready").last_transition_time
    t2 = next(c for c in second.status.conditions if c.type == "Ready").last_transition_time
    assert t1 == t2


def test_status_survives_a_round_trip_through_json_like_an_operator_restart():
    s = spec()
    status = run(s, HETERO, {**HETERO_SIGNALS, "a100-1": sig(errors=0.5)}, 0).status
    wire = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    restored = InferencePoolStatus.model_validate(wire)
    assert restored == status
    a = run(s, HETERO, HETERO_SIGNALS, 40, status)
    b = run(s, HETERO, HETERO_SIGNALS, 40, restored)
    assert weights(a) == weights(b)


def test_floor_held_event_is_emitted_once_not_every_pass():
    s = spec(protection={"minRoutablePercent": 100})
    failing = {**HETERO_SIGNALS, "a100-1": sig(errors=0.5)}
    first = run(s, HETERO, failing, 0)
    second = run(s, HETERO, failing, 5, first.status)
    assert [e.reason for e in first.events].count("FloorHeld") == 1
    assert [e.reason for e in second.events].count("FloorHeld") == 0
    assert weights(second)["a100-1"] == 1


def test_a_pod_that_is_not_ready_after_an_oom_says_both():
    first = run(spec(), HETERO, HETERO_SIGNALS, 0)
    oomed = [
        *HETERO[:2],
        pod("4090-0", "rtx4090", restarts=1, last_termination_reason="OOMKilled", ready=False),
        HETERO[3],
    ]
    plan = run(spec(), oomed, HETERO_SIGNALS, 1, first.status)
    row = next(r for r in plan.status.endpoints if r.pod == "4090-0")
    assert row.reason.startswith("pod is not Ready; container OOMKilled")
