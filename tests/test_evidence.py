"""Decide only on evidence: each rule tested on the whole pass, one defect a test.

Every test here names the rule it holds the core to; each failed on the core as it was before the rule existed.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sluice.core.observed import Observed, SignalSnapshot
from sluice.core.reconcile import plan_pass
from tests.helpers import T0, at, condition, pod, run, sig, spec, states, weights

CANARY: dict[str, Any] = {
    "stableRevision": "v1",
    "candidateRevision": "v2",
    "steps": [5, 25, 50, 100],
    "stepInterval": "10s",
    "analysis": {"interval": "5s", "minRequests": 10},
    "comparableLoad": False,  # the steps as written: one candidate pod against three (test_canary_load.py)
}
STABLE = [pod("v1-a", "a100", "v1"), pod("v1-b", "a100", "v1"), pod("v1-c", "a100", "v1")]
CAND = [pod("v2-a", "a100", "v2")]


def drive(s: Any, pods: Any, signals: Any, until: int, every: int = 5, **snapshot: Any) -> list[Any]:
    status, plans = None, []
    for t in range(0, until + 1, every):
        plan = run(s, pods, signals, t, status, **snapshot)
        plans.append(plan)
        status = plan.status
    return plans


def reasons(plans: list[Any]) -> list[str]:
    return [e.reason for p in plans for e in p.events]


# ------------------------------------------------------------------------- 1. gates never pass on missing data


def test_a_candidate_reporting_only_its_request_rate_is_never_promoted():
    only_rate = sig(ttft=None, p95=None, errors=None, kv=0.3, rps=5.0)
    good = sig(ttft=0.05, rps=10.0)
    plans = drive(
        spec(canary=CANARY), STABLE + CAND, {"v1-a": good, "v1-b": good, "v1-c": good, "v2-a": only_rate}, 300
    )
    canary = plans[-1].status.canary
    assert canary.phase == "Progressing"
    assert canary.weight == 5
    assert canary.last_check == "Inconclusive"
    assert "no data for gate errorRate (candidate errorRate)" in canary.last_check_reason
    assert "CanaryPromoted" not in reasons(plans)


def test_tgi_without_ttft_is_told_at_apply_time_and_cannot_pass_the_ttft_gates():
    s = spec(engine="tgi", canary=CANARY)
    tgi = sig(ttft=None, p95=None, kv=None, rps=5.0)
    plans = drive(s, STABLE + CAND, dict.fromkeys(["v1-a", "v1-b", "v1-c", "v2-a"], tgi), 120)
    valid = next(c for c in plans[0].status.conditions if c.type == "SpecValid")
    assert (valid.status, valid.reason) == ("True", "GatesWithoutData")
    assert "ttftP95, ttftRatioToStable need ttftP95, which engine tgi does not provide" in valid.message
    assert reasons(plans).count("GatesWithoutData") == 1
    assert plans[-1].status.canary.weight == 5
    assert "ttftP95 (candidate ttftP95)" in plans[-1].status.canary.last_check_reason


def test_tgi_with_the_ttft_gates_disabled_explicitly_rolls_out_on_its_error_rate():
    s = spec(
        engine="tgi",
        canary={**CANARY, "analysis": {**CANARY["analysis"], "disabledGates": ["ttftP95", "ttftRatioToStable"]}},
    )
    tgi = sig(ttft=None, p95=None, kv=None, rps=5.0)
    plans = drive(s, STABLE + CAND, dict.fromkeys(["v1-a", "v1-b", "v1-c", "v2-a"], tgi), 200)
    assert condition(plans[0], "SpecValid") == ("True", "Valid")
    assert plans[-1].status.canary.phase == "Promoted"


# ------------------------------------------------------------------------- 2. staleness comes from the samples


def test_old_samples_answered_now_are_stale():
    s = spec(metrics={"staleAfter": "30s"})
    pods = [pod("a"), pod("b")]
    old = {name: at(-120) for name in ("a", "b")}
    first = run(s, pods, {"a": sig(), "b": sig()}, 0, sampled_at={n: at(0) for n in ("a", "b")}, freshness_known=True)
    later = run(s, pods, {"a": sig(ttft=0.5), "b": sig()}, 5, first.status, sampled_at=old, freshness_known=True)
    assert condition(later, "MetricsAvailable") == ("False", "Stale")
    assert (
        "newest sample is 125s old" in next(c for c in later.status.conditions if c.type == "MetricsAvailable").message
    )
    assert weights(later) == weights(first)


def test_signals_read_long_ago_are_stale_even_when_the_freshness_answer_is_new():
    """Each query's answer is shared on its own: a pass can pair a new freshness answer with older signals."""
    s = spec(metrics={"staleAfter": "30s"})
    pods = [pod("a"), pod("b")]
    first = run(s, pods, {"a": sig(), "b": sig()}, 0, sampled_at={n: at(0) for n in ("a", "b")}, freshness_known=True)
    asked = at(-40)
    later = plan_pass(
        s,
        1,
        Observed(
            pods=pods,
            signals=SignalSnapshot(
                collected_at=asked,
                pods={"a": sig(ttft=0.5), "b": sig()},
                sampled_at={n: at(4) for n in ("a", "b")},
                freshness_known=True,
            ),
        ),
        first.status,
        at(5),
    )
    assert condition(later, "MetricsAvailable") == ("False", "Stale")
    assert weights(later) == weights(first)


def test_one_pod_whose_samples_stopped_is_frozen_while_the_rest_follow_their_signals():
    s = spec(metrics={"staleAfter": "30s"}, scoring={"smoothing": 0})
    pods = [pod("a"), pod("b")]
    fresh = {"a": at(0), "b": at(0)}
    first = run(s, pods, {"a": sig(), "b": sig()}, 0, sampled_at=fresh, freshness_known=True)
    stalled = {"a": at(60), "b": at(-10)}
    later = run(
        s, pods, {"a": sig(ttft=0.02), "b": sig(ttft=2.0)}, 60, first.status, sampled_at=stalled, freshness_known=True
    )
    rows = {r.pod: r for r in later.status.endpoints}
    assert rows["b"].verdict == "frozen"
    assert rows["b"].weight == weights(first)["b"]  # its (stale) 2 s TTFT is not acted on
    assert condition(later, "Degraded") == ("True", "PodsUnobserved")


# ------------------------------------------------------------------------- 3. the split reported is the split published


def test_a_forced_split_is_reported_as_such_and_the_rollout_holds():
    stable_down = [pod("v1-a", "a100", "v1", ready=False), *CAND]
    plans = drive(spec(canary=CANARY), stable_down, {"v2-a": sig()}, 60)
    last = plans[-1]
    assert "CanaryAdvanced" not in reasons(plans)
    assert last.revision_weights == {"v2": 100}
    assert last.status.canary.weight == 100  # the real split, not the step's 5
    assert last.status.canary.step_weight == 5
    assert last.status.canary.split_forced == "stable revision v1 has no healthy routable pod"
    assert condition(last, "SplitForced") == ("True", "NoHealthyPods")
    assert "step 5% not applied" in last.status.canary.message
    assert reasons(plans).count("SplitForced") == 1
    assert "CanaryAdvanced" not in reasons(plans)
    recovered = run(
        spec(canary=CANARY), [*STABLE, *CAND], dict.fromkeys(["v1-a", "v1-b", "v1-c", "v2-a"], sig()), 65, last.status
    )
    assert recovered.revision_weights == {"v1": 95, "v2": 5}
    assert condition(recovered, "SplitForced") == ("False", "AsPlanned")
    assert "SplitRestored" in [e.reason for e in recovered.events]


# ------------------------------------------------------------------------- 4. the floor never sends traffic to the sick


def test_failing_stable_pods_held_by_the_floor_do_not_take_the_stable_share():
    s = spec(canary=CANARY, protection={"minRoutablePercent": 50})
    failing = {"v1-a": sig(errors=0.5), "v1-b": sig(errors=0.5), "v1-c": sig(errors=0.5), "v2-a": sig()}
    plan = run(s, STABLE + CAND, failing, 0)
    assert plan.revision_weights == {"v2": 100}  # not {v1: 95, v2: 5}
    held = [r for r in plan.status.endpoints if r.floor_held]
    assert held, "the floor keeps some stable pods routable"
    assert all(r.revision == "v1" for r in held)
    assert plan.revision_weights == {"v2": 100}  # not {v1: 95, v2: 5}
    assert plan.status.canary.split_forced == "stable revision v1 has no healthy routable pod"


def test_the_floor_counts_per_revision_subset():
    s = spec(canary=CANARY, protection={"minRoutablePercent": 50})
    failing = {"v1-a": sig(errors=0.5), "v1-b": sig(errors=0.5), "v1-c": sig(), "v2-a": sig()}
    plan = run(s, STABLE + CAND, failing, 0)
    rows = {r.pod: r for r in plan.status.endpoints}
    # v1 has 3 ready pods: 2 must stay routable, v1-c on its merits and one failing pod at minimum weight.
    assert sum(1 for r in rows.values() if r.revision == "v1" and r.weight > 0) == 2
    assert sum(1 for r in rows.values() if r.floor_held) == 1
    assert plan.revision_weights == {"v1": 95, "v2": 5}


# ------------------------------------------------------------------------- 6. missing evidence is never a default


def test_a_mislabelled_hardware_class_is_degraded_and_named_in_an_event():
    pods = [pod("a", "a100"), pod("b", "A100")]
    plan = run(spec(), pods, {"a": sig(), "b": sig()}, 0)
    assert condition(plan, "Degraded") == ("True", "UnknownHardwareClass")
    degraded = next(c for c in plan.status.conditions if c.type == "Degraded")
    assert "A100: b" in degraded.message
    events = [e for e in plan.events if e.reason == "UnknownHardwareClass"]
    assert len(events) == 1
    assert "'A100'" in events[0].message
    assert events[0].message.endswith(": b")
    again = run(spec(), pods, {"a": sig(), "b": sig()}, 5, plan.status)
    assert "UnknownHardwareClass" not in [e.reason for e in again.events]  # said once


def test_during_an_outage_a_zeroed_pod_does_not_ramp_back_on_elapsed_time_alone():
    s = spec()
    pods = [pod("a"), pod("b"), pod("c")]
    healthy = {"a": sig(), "b": sig(), "c": sig()}
    first = run(s, pods, healthy, 0)
    zeroed = run(s, pods, {**healthy, "c": sig(errors=0.5)}, 5, first.status)
    assert states(zeroed)["c"] == "Zeroed"
    # Prometheus goes down; the 30 s quiet period passes; the ramp would start at 1 %.
    down = plan_pass(
        s,
        1,
        Observed(pods=pods, signals=SignalSnapshot(collected_at=at(60), failed={"ttft": "down"})),
        zeroed.status,
        at(60),
    )
    rows = {r.pod: r for r in down.status.endpoints}
    assert rows["c"].weight == 0
    assert rows["c"].verdict == "awaiting"
    assert {n: rows[n].weight for n in ("a", "b")} == {n: weights(zeroed)[n] for n in ("a", "b")}


def test_a_new_pod_during_an_outage_is_not_scored_from_the_default_ttft():
    s = spec()
    first = run(s, [pod("a"), pod("b")], {"a": sig(), "b": sig()}, 0)
    joined = [pod("a"), pod("b"), pod("new")]
    down = plan_pass(
        s,
        1,
        Observed(pods=joined, signals=SignalSnapshot(collected_at=T0 + timedelta(seconds=5), failed={"ttft": "x"})),
        first.status,
        at(5),
    )
    row = next(r for r in down.status.endpoints if r.pod == "new")
    assert row.weight == 0
    assert row.verdict == "awaiting"
