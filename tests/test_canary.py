"""Canary stepping through the whole pass: steps, gates, rollback, promotion, pause, restart, waiting."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.api.v1alpha1 import AnalysisSpec
from sluice.core.canarycheck import RevisionStats, check
from sluice.core.observed import PodSignals
from sluice.core.reconcile import Plan
from tests.helpers import at, pod, run, sig, spec

STABLE = [pod("v1-a", "a100", "v1"), pod("v1-b", "a100", "v1")]
CAND = [pod("v2-a", "a100", "v2")]
CANARY: dict[str, Any] = {
    "stableRevision": "v1",
    "candidateRevision": "v2",
    "steps": [5, 25, 50, 100],
    "stepInterval": "60s",
    "analysis": {"interval": "30s", "minRequests": 20, "maxErrorRate": 0.01, "maxTtftP95": "800ms"},
    "maxFailedChecks": 2,
    # the steps as written: the candidate's one pod against two stable ones would otherwise hold steps past a third
    # (canary.comparableLoad, tests/test_canary_load.py)
    "comparableLoad": False,
}


def signals(candidate: PodSignals | None = None) -> dict[str, PodSignals]:
    good = sig(ttft=0.05, rps=2.0)
    return {"v1-a": sig(ttft=0.05, rps=10), "v1-b": sig(ttft=0.05, rps=10), "v2-a": candidate or good}


def drive(canary: dict[str, Any], cand_signals: PodSignals | None, until: int, every: int = 10, pods=None, start=None):
    s = spec(canary=canary)
    status = start
    plans: list[tuple[int, Plan]] = []
    for t in range(0, until + 1, every):
        plan = run(s, pods if pods is not None else STABLE + CAND, signals(cand_signals), t, status)
        status = plan.status
        plans.append((t, plan))
    return plans


def weights_over_time(plans):
    return [(t, p.status.canary.weight, p.status.canary.phase) for t, p in plans]


def test_good_candidate_walks_every_step_then_is_promoted():
    plans = drive(CANARY, None, 400)
    phases = [p.status.canary.phase for _, p in plans]
    weights = [p.status.canary.weight for _, p in plans]
    assert weights[0] == 5
    assert list(dict.fromkeys(weights)) == [5, 25, 50, 100]
    assert "Promoted" in phases
    final = plans[-1][1].status
    assert final.canary.phase == "Promoted"
    assert final.canary.stable_revision == "v2"
    assert final.revision_weights == {"v2": 100}
    reasons = [e.reason for _, p in plans for e in p.events]
    assert reasons.count("CanaryAdvanced") == 3
    assert reasons.count("CanaryPromoted") == 1


def test_each_step_lasts_at_least_the_step_interval():
    plans = drive(CANARY, None, 400)
    changes = [(t, p.status.canary.weight) for t, p in plans]
    first_at = {}
    for t, w in changes:
        first_at.setdefault(w, t)
    assert first_at[25] - first_at[5] >= 60
    assert first_at[50] - first_at[25] >= 60


def test_route_split_matches_the_step():
    plans = drive(CANARY, None, 0)
    plan = plans[0][1]
    assert plan.revision_weights == {"v1": 95, "v2": 5}


def test_bad_candidate_is_rolled_back_to_zero_and_stays_there():
    plans = drive(CANARY, sig(ttft=0.05, rps=2.0, errors=0.05), 300)
    phases = [p.status.canary.phase for _, p in plans]
    assert "RolledBack" in phases
    rolled_at = phases.index("RolledBack")
    assert all(phase == "RolledBack" for phase in phases[rolled_at:])
    assert all(p.revision_weights == {"v1": 100} for _, p in plans[rolled_at:])
    assert max(p.status.canary.weight for _, p in plans) == 5  # it never advanced
    assert [e.reason for _, p in plans for e in p.events].count("CanaryRolledBack") == 1


def test_slow_candidate_fails_the_ttft_gate():
    plans = drive(CANARY, sig(ttft=0.6, p95=1.2, rps=2.0), 200)
    assert plans[-1][1].status.canary.phase == "RolledBack"
    assert "TTFT p95" in plans[-1][1].status.canary.message


def test_candidate_much_slower_than_stable_fails_the_ratio_gate():
    canary = {**CANARY, "analysis": {**CANARY["analysis"], "maxTtftP95": None, "maxTtftRatioToStable": 1.5}}
    plans = drive(canary, sig(ttft=0.2, p95=0.4, rps=2.0), 200)  # stable p95 is 0.09
    assert plans[-1][1].status.canary.phase == "RolledBack"
    assert "x stable" in plans[-1][1].status.canary.message


def test_too_little_traffic_is_inconclusive_and_never_advances():
    plans = drive(CANARY, sig(ttft=0.05, rps=0.1), 400)  # 6 requests a minute < 20
    assert {p.status.canary.weight for _, p in plans} == {5}
    assert plans[-1][1].status.canary.last_check == "Inconclusive"
    assert plans[-1][1].status.canary.phase == "Progressing"
    assert "need 20" in plans[-1][1].status.canary.message


def test_missing_metrics_hold_the_step():
    s = spec(canary=CANARY)
    status = None
    for t in range(0, 300, 10):
        plan = run(s, STABLE + CAND, {}, t, status, failed={"ttft": "connection refused"})
        status = plan.status
    assert status.canary.weight == 5
    assert status.canary.last_check == "Inconclusive"


def test_paused_rollout_holds_its_step_and_resumes_with_a_full_interval():
    paused = {**CANARY, "paused": True}
    plans = drive(paused, None, 300)
    assert {p.status.canary.weight for _, p in plans} == {5}
    assert plans[-1][1].status.canary.phase == "Paused"
    resumed = drive(CANARY, None, 50, start=plans[-1][1].status)
    assert all(p.status.canary.weight == 5 for _, p in resumed)  # a full step interval at 5% first


def test_a_new_candidate_mid_rollout_restarts_at_the_first_step():
    plans = drive(CANARY, None, 150)
    assert plans[-1][1].status.canary.weight > 5
    v3 = {**CANARY, "candidateRevision": "v3"}
    pods = [*STABLE, pod("v3-a", "a100", "v3")]
    s = spec(canary=v3)
    plan = run(s, pods, {"v1-a": sig(), "v1-b": sig(), "v3-a": sig(rps=2.0)}, 160, plans[-1][1].status)
    assert plan.status.canary.candidate_revision == "v3"
    assert plan.status.canary.weight == 5
    assert plan.status.canary.step_index == 0
    assert any(e.reason == "CanaryRestarted" for e in plan.events)


def test_candidate_without_ready_pods_never_receives_weight():
    not_ready = [pod("v2-a", "a100", "v2", ready=False)]
    plans = drive(CANARY, None, 200, pods=STABLE + not_ready)
    assert all(p.revision_weights == {"v1": 100} for _, p in plans)
    assert plans[-1][1].status.canary.phase == "Waiting"


def test_candidate_oom_counts_as_a_failed_check_at_once():
    s = spec(canary=CANARY)
    status = run(s, STABLE + CAND, signals(), 0).status
    oomed = [*STABLE, pod("v2-a", "a100", "v2", restarts=1, last_termination_reason="OOMKilled")]
    plan = run(s, oomed, signals(), 5, status)
    assert plan.status.canary.failed_checks == 1
    assert plan.status.canary.last_check == "Fail"


def test_removing_the_candidate_aborts_back_to_stable():
    plans = drive(CANARY, None, 100)
    aborted = {k: v for k, v in CANARY.items() if k != "candidateRevision"}
    plan = run(spec(canary=aborted), STABLE + CAND, signals(), 110, plans[-1][1].status)
    assert plan.revision_weights == {"v1": 100}
    assert plan.status.canary.phase == "Idle"
    assert any(e.reason == "CanaryAborted" for e in plan.events)


def test_stable_revision_is_inferred_when_not_given():
    canary = {k: v for k, v in CANARY.items() if k != "stableRevision"}
    plan = drive(canary, None, 0)[0][1]
    assert plan.status.canary.stable_revision == "v1"


def test_no_canary_means_no_split():
    plan = run(spec(), STABLE, {"v1-a": sig(), "v1-b": sig()}, 0)
    assert plan.revision_weights == {}
    assert plan.status.canary is None


GATES = AnalysisSpec(min_requests=10, max_error_rate=0.01, max_ttft_p95=1.0, max_ttft_ratio_to_stable=2.0)
STABLE_STATS = RevisionStats(routable_pods=2, healthy_pods=2, requests=500, error_rate=0.0, ttft_p95=0.2)


def cand(**fields: object) -> RevisionStats:
    base: dict[str, object] = {"routable_pods": 1, "healthy_pods": 1, "requests": 100, "error_rate": 0.0}
    return RevisionStats(**{**base, "ttft_p95": 0.3, **fields})  # type: ignore[arg-type]


def test_the_ratio_to_stable_does_not_apply_where_the_stable_revision_takes_no_traffic():
    slower = cand(ttft_p95=0.9)  # 4.5x the stable p95, within maxTtftP95
    assert check(GATES, slower, STABLE_STATS, True).result == "Fail"
    at_100 = check(GATES, slower, STABLE_STATS, True, stable_serves=False)
    assert at_100.result == "Pass"
    assert "ttftRatioToStable does not apply" in at_100.reason


@pytest.mark.parametrize(
    ("candidate", "usable", "gates", "stable", "expected", "says"),
    [
        (cand(), True, GATES, STABLE_STATS, "Pass", "within every gate"),
        (cand(requests=5), True, GATES, STABLE_STATS, "Inconclusive", "5 requests"),
        (cand(requests=None, error_rate=None, ttft_p95=None), True, GATES, STABLE_STATS, "Inconclusive", "0 requests"),
        (cand(error_rate=0.02), True, GATES, STABLE_STATS, "Fail", "error rate 2.00%"),
        (cand(ttft_p95=1.5), True, GATES, STABLE_STATS, "Fail", "TTFT p95 1500ms"),
        (cand(ttft_p95=0.5), True, GATES, STABLE_STATS, "Fail", "2.50x stable"),
        (cand(), False, GATES, STABLE_STATS, "Inconclusive", "metrics unavailable"),
        (cand(incidents=1), True, GATES, STABLE_STATS, "Fail", "zeroed for an incident"),
        # Missing data never passes: each enabled gate must be evaluated on data.
        (cand(ttft_p95=None), True, GATES, STABLE_STATS, "Inconclusive", "ttftP95 (candidate ttftP95)"),
        (cand(error_rate=None), True, GATES, STABLE_STATS, "Inconclusive", "errorRate (candidate errorRate)"),
        (cand(), True, GATES, RevisionStats(routable_pods=2), "Inconclusive", "ttftRatioToStable (stable ttftP95)"),
        (cand(), True, GATES, None, "Inconclusive", "stable ttftP95"),
        # ...but a failing gate with data fails even when another gate has none.
        (cand(ttft_p95=None, error_rate=0.5), True, GATES, STABLE_STATS, "Fail", "error rate 50.00%"),
        # A gate switched off explicitly is not evaluated.
        (
            cand(ttft_p95=None),
            True,
            GATES.model_copy(update={"disabled_gates": ["ttftP95", "ttftRatioToStable"]}),
            STABLE_STATS,
            "Pass",
            "(errorRate)",
        ),
    ],
)
def test_check_gates(candidate, usable, gates, stable, expected, says):
    result = check(gates, candidate, stable, usable)
    assert result.result == expected
    assert says in result.reason


def test_stale_candidate_signals_hold_a_live_step_inconclusive():
    s = spec(canary=CANARY, metrics={"staleAfter": "15s"})
    status = None
    plans = []
    for t in range(0, 301, 10):
        sampled = {"v1-a": at(t), "v1-b": at(t), "v2-a": at(0)}
        plan = run(s, STABLE + CAND, signals(), t, status, sampled_at=sampled, freshness_known=True)
        status = plan.status
        plans.append((t, plan))
    final = plans[-1][1].status.canary
    assert final is not None
    assert (final.phase, final.step_index) == ("Progressing", 0)
    assert final.last_check == "Inconclusive"
    assert "stale signals for pod v2-a" in final.last_check_reason


def test_a_step_stamped_by_a_replica_whose_clock_is_ahead_is_not_held_until_this_clock_catches_up():
    """`stepStartedAt` and `lastCheckAt` written 30 s in the future (a replica 30 s ahead ran the last pass): this
    replica takes them as its own now, so the 60 s step lasts 60 s from here, not 90 (the chaos matrix's
    clock-skew case stepped 58 s late)."""
    s = spec(canary=CANARY)
    first = run(s, STABLE + CAND, signals(), 0, None).status
    assert first.canary is not None
    ahead = first.canary.model_copy(update={"step_started_at": at(30), "last_check_at": at(30)})
    status = first.model_copy(update={"canary": ahead})
    weights = {}
    for t in range(10, 101, 10):
        status = run(s, STABLE + CAND, signals(), t, status).status
        weights[t] = status.canary.weight
    assert weights[70] == 25, weights  # 60 s after it was read (at 10 s), not 60 s after the stamp (at 90 s)
