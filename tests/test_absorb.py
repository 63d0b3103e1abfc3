"""Weighing a zeroing against what the other pods can absorb (`sluice.core.absorb`), alone and through plan_pass."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.api.v1alpha1 import EndpointStatus, InferencePoolStatus
from sluice.core.absorb import SERVES_MOST, Candidate, Other, weigh
from tests.helpers import T0, condition, pod, run, sig, spec, states, weights

HEADROOM = {"scoring": {"policy": "headroom"}}
UTILISATION_ONLY = {**HEADROOM, "protection": {"absorbTtftPercent": 1000}}
"""A tolerance no modelled TTFT rise reaches: only targetUtilization bounds what the others take."""
NAMES = ("a100-0", "a100-1", "a100-2")


def two(rate: float, capacity: float = 10.0, idle: float = 0.1) -> list[Other]:
    """Two other pods of `capacity` req/s and `idle` s idle TTFT, carrying `rate` req/s each."""
    return [Other(capacity, idle, rate), Other(capacity, idle, rate)]


def test_the_others_absorb_the_share_so_the_pod_is_zeroed_and_the_reason_says_at_what_cost():
    # a tolerance no latency rise exceeds: only targetUtilization bounds what the others take (9 of their 16)
    holds = weigh([Candidate("c", 3.0, 0.3, 1.5, 10.0, 0.1)], two(3.0), 2.0, 0.8, 100.0)
    assert holds["c"].share == 0
    assert not holds["c"].held
    assert holds["c"].others_load == pytest.approx(9.0 / 20.0)
    # the model's levels: 3 pods share 9 req/s at L = 0.1 / (1 - 0.3), 2 pods at 0.1 / (1 - 0.45): +27 %
    assert holds["c"].why == (
        "the other pods would be at 45% of their capacity, their TTFT +27% "
        "(within targetUtilization 80%, absorbTtftPercent 10000%)"
    )


def test_the_tolerance_decides_whether_the_pod_leaves():
    # 9 req/s over three pods of 10: without it the others' modelled TTFT rises 27 % (the test above): past a 10 %
    # tolerance the pod is not zeroed (it keeps an overflow share, below); within a 30 % one it leaves
    assert weigh([Candidate("c", 3.0, 0.3, 1.5, 10.0, 0.1)], two(3.0), 2.0, 0.8, 0.1)["c"].held
    assert not weigh([Candidate("c", 3.0, 0.3, 1.5, 10.0, 0.1)], two(3.0), 2.0, 0.8, 0.3)["c"].held


def test_a_pod_is_never_held_past_the_target_of_its_own_capacity():
    holds = weigh([Candidate("c", 9.0, 0.2, 1.0, 5.0, 0.1)], two(4.5, capacity=5.0), 2.0, 0.8, 100.0)
    assert holds["c"].share == pytest.approx(4.0)  # needs 10, takes 0.8 x 5


@pytest.mark.parametrize(
    ("candidate", "said"),
    [
        (Candidate("c", 7.0, SERVES_MOST, 1.0, 10.0), "it fails 50% of its requests"),
        (Candidate("c", 7.0, None, 1.0, 10.0), "its error rate is unknown"),
        (Candidate("c", 7.0, 0.3, 4.5, 10.0), "its TTFT is 4.5x its idle, the others' at most 2.0x"),
        (Candidate("c", 7.0, 0.3, None, 10.0), "TTFT or the others' is unknown"),
        (Candidate("c", 7.0, 0.3, 1.2, None), "no learned capacity"),
    ],
)
def test_a_pod_that_would_not_serve_its_share_is_zeroed_whatever_the_others_load(candidate, said):
    hold = weigh([candidate], two(7.0), 2.0, 0.8, 0.1)["c"]
    assert not hold.held
    assert said in hold.why
    assert "zeroed" in hold.why


def test_nothing_is_weighed_without_a_learned_capacity_among_the_others():
    hold = weigh([Candidate("c", 7.0, 0.3, 1.2, 10.0)], None, 2.0, 0.8, 0.1)["c"]
    assert not hold.held
    assert hold.others_load is None
    assert "no capacity learned" in hold.why


@given(
    st.lists(
        st.tuples(st.floats(0.0, 50.0), st.floats(0.0, 0.49), st.floats(0.5, 3.0), st.floats(0.1, 40.0)),
        min_size=1,
        max_size=6,
    ),
    st.lists(st.tuples(st.floats(0.1, 50.0), st.floats(0.01, 2.0), st.floats(0.0, 50.0)), min_size=1, max_size=6),
    st.floats(0.1, 1.0),
    st.floats(0.0, 1.0),
)
def test_holds_take_what_the_others_cannot_within_each_pods_own_target(pods, others, ceiling, tolerance):
    candidates = [Candidate(f"c{i}", r, e, inf, cap, 0.1) for i, (r, e, inf, cap) in enumerate(pods)]
    rest = [Other(c, s, r) for c, s, r in others]
    holds = weigh(candidates, rest, 3.0, ceiling, tolerance)
    demand = sum(o.rate for o in rest) + sum(c.rate for c in candidates)
    kept = sum(h.share for h in holds.values())
    # a held pod keeps at most the target of its capacity
    keeps = {c.name: ceiling * (c.capacity or 0) for c in candidates}
    for c in candidates:
        assert 0 <= holds[c.name].share <= keeps[c.name] + 1e-9
    # what the others are left with never puts them past halfway from the target to saturation while the
    # candidates have room
    room = sum(keeps.values())
    capacity = sum(o.capacity for o in rest)
    if kept < room - 1e-9:
        assert demand - kept <= (1.0 + ceiling) / 2.0 * capacity + 1e-6
    # and a stricter tolerance never makes the pods keep less
    looser = weigh(candidates, rest, 3.0, ceiling, tolerance + 0.5)
    assert kept >= sum(h.share for h in looser.values()) - 1e-9


# ------------------------------------------------------------------------------------------ through plan_pass


def learned(weight: int = 1000, capacity: float = 10.0, idle: float = 0.1) -> InferencePoolStatus:
    """Three A100 pods, each having learned 10 req/s and a 100 ms idle TTFT."""
    return InferencePoolStatus(
        endpoints=[
            EndpointStatus(
                pod=name,
                weight=weight,
                state="Routable",
                learned_capacity=capacity,
                idle_ttft_seconds=idle,
                score=capacity,
                since=T0,
            )
            for name in NAMES
        ]
    )


def failing(load: float, errors: float = 0.3, failing_p95: float | None = None) -> dict:
    """Each pod carries `load` of its 10 req/s (its TTFT p95 inflated as M/M/1 has it over a 100 ms idle TTFT);
    a100-2 fails `errors` of its requests."""
    p95 = 0.1 / (1.0 - load)
    out = {n: sig(rps=10.0 * load, p95=p95, kv=0.2, errors=0.0) for n in NAMES}
    out["a100-2"] = sig(rps=10.0 * load, p95=failing_p95 or p95, kv=0.2, errors=errors)
    return out


def test_a_failing_pod_the_others_cannot_replace_is_held_with_the_share_they_cannot_take():
    pods = [pod(n) for n in NAMES]
    first = run(spec(**UTILISATION_ONLY), pods, failing(0.7), 5, previous=learned())
    # the pass that sees the errors has no sample since they began: whether the pod also slowed down is unknown,
    # so it keeps only what would take the others past 90 % (halfway from the 80 % target to saturation): 21 - 18
    unproven = next(r for r in first.status.endpoints if r.pod == "a100-2")
    assert unproven.capacity_held
    assert unproven.reason.startswith("would be zeroed (error rate 30.0% >= 10.0%), held at 3.00/s")
    assert unproven.reason.endswith(
        "no sample since its incident yet: only what would take them past halfway to saturation"
    )
    assert [e.reason for e in first.events].count("PodHeld") == 1
    plan = run(spec(**UTILISATION_ONLY), pods, failing(0.7), 10, previous=first.status)
    rows = {r.pod: r for r in plan.status.endpoints}
    held = rows["a100-2"]
    assert held.incident == "ErrorRate"
    assert held.capacity_held
    assert held.state == "Routable"
    assert held.reason.startswith("would be zeroed (error rate 30.0% >= 10.0%), held at ")
    assert "the other pods would be at" in held.reason
    w = weights(plan)
    # the others take 0.9 x their capacity, the pod what is left (3 of the 21 req/s, the others 9 each)
    assert w["a100-2"] / w["a100-0"] == pytest.approx(3.0 / 9.0, abs=0.03)
    assert condition(plan, "Degraded") == ("True", "HeldForCapacity")
    assert "PodHeld" not in [e.reason for e in plan.events]  # said once
    assert "PodZeroed" not in [e.reason for e in plan.events]
    assert plan.status.routable == "3/3"


def test_at_low_load_the_others_take_the_share_and_the_pod_is_zeroed():
    plan = run(spec(**UTILISATION_ONLY), [pod(n) for n in NAMES], failing(0.3), 5, previous=learned())
    row = next(r for r in plan.status.endpoints if r.pod == "a100-2")
    assert (row.state, row.weight, row.capacity_held) == ("Zeroed", 0, False)
    assert "the other pods would be at 45% of their capacity, their TTFT +27% (within targetUtilization" in row.reason
    assert condition(plan, "Degraded") == ("True", "PodsZeroed")


def test_by_default_the_others_take_only_what_raises_their_ttft_by_a_tenth():
    pods = [pod(n) for n in NAMES]
    first = run(spec(**HEADROOM), pods, failing(0.3), 5, previous=learned())
    unproven = next(r for r in first.status.endpoints if r.pod == "a100-2")
    # at 45 % the others could take it, but until a sample since the incident says more it keeps its overflow share
    assert unproven.capacity_held
    assert unproven.reason.endswith("no sample since its incident yet: no more than its overflow share")
    plan = run(spec(**HEADROOM), pods, failing(0.3), 10, previous=first.status)
    row = next(r for r in plan.status.endpoints if r.pod == "a100-2")
    assert row.capacity_held
    # 9 req/s: the others' TTFT would rise 27 %, past the 10 % tolerance: the pod keeps a tenth of what they would
    # carry at its capacity (4.5 req/s)
    assert row.reason.startswith("would be zeroed (error rate 30.0% >= 10.0%), held at 0.45/s (it carried 3.00/s) as")
    assert "absorbTtftPercent 10%" in row.reason


def test_the_declared_policy_zeroes_whatever_the_others_load():
    s = spec(**HEADROOM, protection={"zeroWhenOthersFull": True})
    plan = run(s, [pod(n) for n in NAMES], failing(0.7), 5, previous=learned())
    assert states(plan)["a100-2"] == "Zeroed"
    assert not any(r.capacity_held for r in plan.status.endpoints)


@pytest.mark.parametrize(
    ("signals", "said"),
    [
        (failing(0.7, errors=0.6), "it fails 60% of its requests"),
        (failing(0.7, failing_p95=1.0), "its TTFT is 10.0x its idle, the others' at most 3.3x"),
    ],
)
def test_a_pod_failing_most_requests_or_slowed_down_is_zeroed_at_any_load(signals, said):
    plan = run(spec(**HEADROOM), [pod(n) for n in NAMES], signals, 5, previous=learned())
    row = next(r for r in plan.status.endpoints if r.pod == "a100-2")
    assert row.state == "Zeroed"
    assert said in row.reason


def test_a_pod_that_cannot_serve_leaves_at_once():
    pods = [pod(n) for n in NAMES[:2]] + [pod("a100-2", restarts=1, last_termination_reason="OOMKilled")]
    plan = run(spec(**HEADROOM), pods, failing(0.7, errors=0.0), 5, previous=learned())
    row = next(r for r in plan.status.endpoints if r.pod == "a100-2")
    assert (row.state, row.incident, row.capacity_held) == ("Zeroed", "OOMKilled", False)


def test_the_cube_knows_no_capacity_and_zeroes():
    plan = run(spec(), [pod(n) for n in NAMES], failing(0.7), 5, previous=learned())
    assert states(plan)["a100-2"] == "Zeroed"


def test_a_held_pod_is_zeroed_once_the_others_can_take_its_share():
    pods = [pod(n) for n in NAMES]
    first = run(spec(**UTILISATION_ONLY), pods, failing(0.7), 5, previous=learned())
    assert next(r for r in first.status.endpoints if r.pod == "a100-2").capacity_held
    second = run(spec(**UTILISATION_ONLY), pods, failing(0.7), 10, previous=first.status)
    assert next(r for r in second.status.endpoints if r.pod == "a100-2").capacity_held
    assert "PodHeld" not in [e.reason for e in second.events]  # said once
    calm = run(spec(**UTILISATION_ONLY), pods, failing(0.3), 15, previous=second.status)
    row = next(r for r in calm.status.endpoints if r.pod == "a100-2")
    assert (row.state, row.capacity_held) == ("Zeroed", False)
    assert [e.reason for e in calm.events] == ["PodZeroed"]


def test_without_fresh_signals_a_held_pod_keeps_its_weight():
    pods = [pod(n) for n in NAMES]
    first = run(spec(**HEADROOM), pods, failing(0.7), 5, previous=learned())
    held = weights(first)["a100-2"]
    assert held > 0
    blind = run(spec(**HEADROOM), pods, {}, 10, previous=first.status)
    row = next(r for r in blind.status.endpoints if r.pod == "a100-2")
    assert (row.weight, row.capacity_held) == (held, True)
    assert "no fresh signals to weigh on: held weight frozen" in row.reason


def test_a_held_pod_ramping_back_keeps_at_most_a_tenth_more_than_it_carried():
    # the others need 3 of the 21 req/s kept (they take 90 % of their 20), but it carried 2: it keeps 2.2
    ramping = Candidate("c", 2.0, 0.3, 1.5, 10.0, 0.1, floor=0.2, ramping=True, held_before=True)
    assert weigh([ramping], two(9.5), 2.0, 0.8, 100.0)["c"].share == pytest.approx(2.2)
    # a pod held on its quiet period keeps what the others need, within the target of its capacity
    quiet = Candidate("c", 2.0, 0.3, 1.5, 10.0, 0.1)
    assert weigh([quiet], two(9.5), 2.0, 0.8, 100.0)["c"].share == pytest.approx(3.0)


def test_without_a_sample_since_the_incident_only_what_would_take_the_others_past_halfway_is_kept():
    # 21 req/s on others of 20: past 90 % of it (18), 3 stay; at 45 % only the overflow share until a sample says
    # more (a tenth of what they would carry at its capacity: 0.1 x 9 / 20 x 10)
    fresh = Candidate("c", 7.0, 0.3, 1.5, 10.0, 0.1, evidence_since_incident=False)
    assert weigh([fresh], two(7.0), 2.0, 0.8, 100.0)["c"].share == pytest.approx(3.0)
    light = replace(fresh, rate=3.0)
    hold = weigh([light], two(3.0), 2.0, 0.8, 0.1)["c"]
    assert hold.share == pytest.approx(0.45)
    assert hold.why.endswith("no sample since its incident yet: no more than its overflow share")
    # its failures stopped: no overflow share, nothing is kept until a sample
    stopped = weigh([replace(light, still_failing=False)], two(3.0), 2.0, 0.8, 0.1)["c"]
    assert not stopped.held
    assert stopped.why.endswith("and no sample since its incident yet: zeroed until one")


def test_without_a_sample_since_the_incident_the_overflow_share_is_kept_within_the_halfway_mark():
    # 17.1 req/s on others of 20: 85.5 % of their capacity without the pod (within the 90 % halfway mark, so
    # nothing beyond it is kept): it keeps a tenth of what they would carry at its capacity (0.1 x 17.1 / 20 x 10).
    # Zeroed for the scrape, three L40S at 70 % went to 105 % of their capacity on failing-pod-tuning
    fresh = Candidate("c", 5.7, 0.3, 1.5, 10.0, 0.1, evidence_since_incident=False)
    hold = weigh([fresh], two(5.7), 2.0, 0.8, 100.0)["c"]
    assert hold.share == pytest.approx(0.1 * 17.1 / 20.0 * 10.0)
    assert hold.valve == hold.share
    assert hold.why.endswith("no sample since its incident yet: no more than its overflow share")


def test_a_held_pod_is_published_at_the_weight_that_gives_it_its_share_at_its_own_time_in_system():
    """Envoy's least-request divides a weight by (active + 1) per client sidecar: a pod kept at a small share runs
    few requests, so at the busy others' weight per req/s it would get more than its share (a pod held at 2.4
    req/s on failing-pod-tuning at 70 % carried 3.1). 21 requests running on each pod at 7 req/s (3 s each), 8
    client sidecars: the others planned at 9 req/s run 21 (capped at what they run now), weight 9 x (1 + 21 / 8);
    the pod at 3 req/s runs 9, weight 3 x (1 + 9 / 8): 0.195 of theirs, not 3 / 9."""
    busy = {n: s.model_copy(update={"running_requests": 21.0}) for n, s in failing(0.7).items()}
    plan = run(spec(**UTILISATION_ONLY), [pod(n) for n in NAMES], busy, 5, previous=learned())
    row = next(r for r in plan.status.endpoints if r.pod == "a100-2")
    assert row.reason.startswith("would be zeroed (error rate 30.0% >= 10.0%), held at 3.00/s (it carried 7.00/s)")
    w = weights(plan)
    assert w["a100-2"] / w["a100-0"] == pytest.approx((3.0 * (1 + 9 / 8)) / (9.0 * (1 + 21 / 8)), abs=0.005)


def test_a_request_spending_longer_on_the_pod_than_on_the_others_is_a_slowdown():
    slow = Candidate("c", 7.0, 0.3, 1.2, 10.0, 0.1, in_system=4.0)
    hold = weigh([slow], two(7.0), 2.0, 0.8, 100.0, others_in_system=2.0)["c"]
    assert not hold.held
    assert "a request spends 4.0s on it, at most 2.0s on the others" in hold.why
    assert weigh([replace(slow, in_system=2.9)], two(7.0), 2.0, 0.8, 100.0, others_in_system=2.0)["c"].held


def test_a_pod_ramping_back_from_a_zeroing_keeps_more_than_its_overflow_share_only_if_it_was_held_before():
    # 20 req/s on others of 20: they take 18, 2 would stay. Zeroed before, it keeps its ramp and the overflow share
    # (a tenth of what they carry per req/s of capacity, at its 10: 1.0), not the 2
    ramping = Candidate("c", 1.0, 0.3, 1.5, 10.0, 0.1, floor=0.2, ramping=True)
    hold = weigh([ramping], two(9.5), 2.0, 0.8, 100.0)["c"]
    assert hold.share == pytest.approx(1.0)
    assert hold.why.startswith("held at 1.00/s (it carried 1.00/s) as overflow")
    # its ramp already past that: the ramp stands
    past = weigh([replace(ramping, floor=1.5)], two(9.5), 2.0, 0.8, 100.0)["c"]
    assert not past.held
    assert past.why.endswith("its ramp already keeps what they cannot take")
    # held before: what the others need, within a tenth more than it carried
    held = weigh([replace(ramping, held_before=True)], two(9.5), 2.0, 0.8, 100.0)["c"]
    assert held.share == pytest.approx(1.1)


def test_a_pod_whose_failures_stopped_comes_back_by_its_ramp_not_as_overflow():
    recovered = Candidate("c", 1.0, 0.0, 1.0, 10.0, 0.1, floor=0.2, ramping=True, still_failing=False)
    assert not weigh([recovered], two(9.5), 2.0, 0.8, 100.0)["c"].held


def test_a_held_pod_ramping_back_that_carried_little_keeps_its_overflow_share():
    # it carried 0.05 req/s over the window (zeroed for most of it): a tenth more of that is no share at all, the
    # overflow share (0.1 x 9 / 20 x 10 = 0.45) is what keeps it taking the others' bursts
    trickle = Candidate("c", 0.05, 0.3, 1.5, 10.0, 0.1, floor=0.01, ramping=True, held_before=True)
    hold = weigh([trickle], two(4.5), 2.0, 0.8, 0.1)["c"]
    assert hold.share == pytest.approx(0.1 * 9.05 / 20.0 * 10.0)


def test_a_trickle_is_no_reading_of_the_time_a_request_spends_on_the_pod():
    # a pod given a trickle (12 completions in the minute) with 1.5 running reads 7.5 s in the system (Little):
    # that is no slowdown to zero it for, its TTFT says it is not slow (at 45 % the others' TTFT would rise 27 %:
    # it is held)
    pods = [pod(n) for n in NAMES]
    signals = failing(0.45)
    signals["a100-2"] = sig(rps=0.2, p95=0.1, kv=0.2, errors=0.3).model_copy(update={"running_requests": 1.5})
    first = run(spec(**HEADROOM), pods, signals, 5, previous=learned())
    second = run(spec(**HEADROOM), pods, signals, 10, previous=first.status)
    row = next(r for r in second.status.endpoints if r.pod == "a100-2")
    assert "spends" not in row.reason
    assert row.capacity_held


def test_a_held_pod_whose_own_reading_shows_a_third_less_capacity_is_held_within_what_it_shows():
    # the others carry 9 of their 10 req/s; a100-2, failing, carries 2 with its TTFT p95 at 5x its 100 ms idle:
    # rho 0.8, so it takes 2.5 req/s now, not the 10 it learned (a node that slowed down). The others need 4 of
    # the 20 kept; it is held within 0.8 x 2.5 = 2, not 0.8 x 10.
    pods = [pod(n) for n in NAMES]
    signals = {n: sig(rps=9.0, p95=1.0, kv=0.2, errors=0.0) for n in NAMES[:2]}
    # a request's time on it (running over rate) as on the others: only its TTFT tells
    signals["a100-2"] = sig(rps=2.0, p95=0.5, kv=0.2, errors=0.3).model_copy(update={"running_requests": 0.2})
    first = run(spec(**HEADROOM), pods, signals, 5, previous=learned())
    second = run(spec(**HEADROOM), pods, signals, 10, previous=first.status)
    row = next(r for r in second.status.endpoints if r.pod == "a100-2")
    assert row.capacity_held
    assert row.reason.startswith("would be zeroed (error rate 30.0% >= 10.0%), held at 2.00/s (it carried 2.00/s)")
    # a reading within a third of what it learned is noise: the learned capacity bounds the hold
    steady = {
        **{n: sig(rps=10.0, p95=1.0, kv=0.2, errors=0.0) for n in NAMES[:2]},
        "a100-2": sig(rps=7.0, p95=0.5, kv=0.2, errors=0.3).model_copy(update={"running_requests": 0.7}),
    }
    again = run(spec(**UTILISATION_ONLY), pods, steady, 10, previous=first.status)  # it shows 8.75 of 10
    # 27 req/s: the others take about 18, it keeps 0.8 x 10 = 8 (0.8 x 8.75 = 7 if its reading bounded it)
    assert (
        next(r for r in again.status.endpoints if r.pod == "a100-2").reason.split("), ")[1].startswith("held at 8.00/s")
    )


# --------------------------------------------------- the frontier of fixed weights (bench_failing_frontier.py)


def test_a_held_pod_keeps_what_would_take_the_others_past_halfway_to_saturation_not_past_the_target():
    # others 2 x 10/s carry 14/s, the pod 7/s: 21/s. The others take up to 90 % (18/s), the pod keeps 3: on
    # failing-pod-tuning a fixed weight leaving the others near 90 % cost 1.04x least-request's P99 at 70 % load,
    # and holding what takes them past 80 % kept twice the errors for no P99 gained
    holds = weigh([Candidate("c", 7.0, 0.3, 1.5, 10.0, 0.1)], two(7.0), 2.0, 0.8, 100.0)
    assert holds["c"].share == pytest.approx(3.0)
    assert holds["c"].why.startswith("held at 3.00/s (it carried 7.00/s): the other pods would be at 105%")


def test_a_held_pod_the_others_could_take_within_halfway_keeps_an_overflow_share():
    # 9 req/s over three pods of 10: the others could carry it all below 90 %, but their modelled TTFT would rise
    # 27 % (past the 10 % tolerance): the pod keeps a tenth of what they would carry at its capacity (9 x 10/20,
    # a tenth of their weight), so Envoy's least-request sends it requests mostly when the others are busy
    holds = weigh([Candidate("c", 3.0, 0.3, 1.5, 10.0, 0.1)], two(3.0), 2.0, 0.8, 0.1)
    assert holds["c"].held
    assert holds["c"].share == pytest.approx(0.1 * 9.0 / 20.0 * 10.0)
    assert holds["c"].why.startswith("held at 0.45/s (it carried 3.00/s) as overflow: the other pods would be at 45%")


def test_an_unproven_pod_keeps_only_its_overflow_share_where_the_others_could_take_it_all():
    # no sample since the incident: it might have slowed down too. At a tenth of the others' weight overflow reaches
    # it mostly when they are busy; zeroing it for the scrape cost failing-pod-tuning's 70 % point its tail (the
    # others' capacities, probed at light load, said they had room: they were at 105 % of it)
    hold = weigh([Candidate("c", 3.0, 0.3, 1.5, 10.0, 0.1, evidence_since_incident=False)], two(3.0), 2.0, 0.8, 0.1)
    assert hold["c"].share == pytest.approx(0.1 * 9.0 / 20.0 * 10.0) == hold["c"].valve


def test_a_pod_held_since_before_its_new_incident_stays_held_on_evidence():
    # the errors go on: after the rate window the same incident fires again. The pod has been held (and read)
    # since its first one, so the new one is no unknown: no "no sample since its incident" zeroing for a scrape
    # (on failing-pod-tuning at 70 % that gap zeroed the pod, the others went past capacity and the pod came
    # back at a share it had not carried: P99 370 ms against least-request's 287)
    pods = [pod(n) for n in NAMES]
    status = run(spec(**UTILISATION_ONLY), pods, failing(0.7), 5, previous=learned()).status
    first = next(r for r in status.endpoints if r.pod == "a100-2").last_incident_at
    t = 5
    while True:  # held pass after pass until the incident fires again
        t += 5
        plan = run(spec(**UTILISATION_ONLY), pods, failing(0.7), t, previous=status)
        row = next(r for r in plan.status.endpoints if r.pod == "a100-2")
        assert row.capacity_held
        status = plan.status
        if row.last_incident_at != first:
            break
        assert t < 120
    assert "no sample since its incident" not in row.reason  # the pass that sees it again
    after = run(spec(**UTILISATION_ONLY), pods, failing(0.7), t + 5, previous=status)
    row = next(r for r in after.status.endpoints if r.pod == "a100-2")
    assert row.capacity_held
    assert row.weight > 0
    assert "no sample since its incident" not in row.reason


def test_a_pod_zeroed_before_anything_was_learned_keeps_an_overflow_share_at_its_prior():
    """Nothing learned among the others (a quiet pool: their TTFT at its idle) when a pod starts failing 30 % of
    its requests: no share can be weighed, but once it is read again it keeps the overflow share at the proportions
    of the priors. Its own capacity is its K at the others' prior per unit of K: it is not planned while zeroed,
    and without one it was zeroed outright ("it has no learned capacity") for the whole quiet period."""
    pods = [pod(n) for n in NAMES]
    quiet = {n: sig(rps=3.0, p95=0.1, kv=0.2, errors=0.0) for n in NAMES}
    failing_quietly = {**quiet, "a100-2": sig(rps=3.0, p95=0.1, kv=0.2, errors=0.3)}
    previous = None
    for seconds in (0, 5, 10, 15):
        previous = run(spec(**HEADROOM), pods, quiet, seconds, previous=previous).status
    first = run(spec(**HEADROOM), pods, failing_quietly, 20, previous=previous)
    row = next(r for r in first.status.endpoints if r.pod == "a100-2")
    assert (row.state, row.weight) == ("Zeroed", 0)
    assert "nothing learned among the other pods" in row.reason
    assert "no sample since its incident yet" in row.reason
    plan = run(spec(**HEADROOM), pods, failing_quietly, 25, previous=first.status)
    held = next(r for r in plan.status.endpoints if r.pod == "a100-2")
    assert held.capacity_held
    assert held.reason.endswith("as overflow: nothing learned among the other pods to weigh its share on")
    # the overflow share at the priors' proportions: a tenth of the demand over the pool's capacity, times its own
    assert 0 < weights(plan)["a100-2"] < weights(plan)["a100-0"] / 5
