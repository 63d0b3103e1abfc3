"""Shadow canaries through the whole pass and the renderer: mirror only, own gates, rollback before any user.

Every pass of every scenario is also rendered, and the request mirror in the rendered VirtualService must be
exactly what `status.canary.mirrorPercent` reports (and absent whenever the status says none).
"""

from __future__ import annotations

from typing import Any

from sluice.api.operation import Operation
from sluice.api.v1alpha1 import InferencePoolStatus
from sluice.core.observed import ObservedPod, PodSignals
from sluice.core.reconcile import Plan, plan_pass
from sluice.istio.objects import PoolRef
from sluice.istio.render import render
from tests.helpers import at, observed, pod, sig, spec

POOL = PoolRef("llama", "llm")
STABLE = [pod("v1-a", "a100", "v1"), pod("v1-b", "a100", "v1")]
CAND = [pod("v2-a", "a100", "v2")]
SHADOW: dict[str, Any] = {
    "mirrorPercent": 50,
    "duration": "60s",
    "analysis": {"interval": "20s", "minRequests": 10, "maxErrorRate": 0.02, "maxTtftP95": "500ms"},
}
CANARY: dict[str, Any] = {
    "stableRevision": "v1",
    "candidateRevision": "v2",
    "steps": [10, 50, 100],
    "stepInterval": "60s",
    "analysis": {"interval": "30s", "minRequests": 10, "maxErrorRate": 0.05, "maxTtftP95": "2s"},
    "maxFailedChecks": 2,
    "shadow": SHADOW,
    # the steps as written: one candidate pod against two stable ones (canary.comparableLoad: test_canary_load.py)
    "comparableLoad": False,
}
GOOD = sig(ttft=0.05, rps=2.0)


def signals(candidate: PodSignals | None, stable: PodSignals | None = None) -> dict[str, PodSignals]:
    base = stable or sig(ttft=0.05, rps=10)
    return {"v1-a": base, "v1-b": base, "v2-a": candidate or GOOD}


def rendered_mirror(s: Any, plan: Plan) -> float | None:
    """The mirror percentage in the rendered VirtualService route (None when it has no mirror)."""
    vs = next(o.body for o in render(POOL, s, plan) if o.kind == "VirtualService")
    mirrors = vs["spec"]["http"][0].get("mirrors")
    if not mirrors:
        return None
    assert len(mirrors) == 1
    assert mirrors[0]["destination"]["subset"] == "rev-v2"
    return float(mirrors[0]["percentage"]["value"])


def drive(
    canary: dict[str, Any],
    candidate: PodSignals | None,
    until: int,
    every: int = 10,
    pods: list[ObservedPod] | None = None,
    start: InferencePoolStatus | None = None,
    ops: dict[int, Operation] | None = None,
    stable: PodSignals | None = None,
) -> list[tuple[int, Plan]]:
    s = spec(canary=canary)
    status = start
    plans = []
    for t in range(0 if start is None else every, until + 1, every):
        when = at(t if start is None else t + 1000)
        seen = observed(pods if pods is not None else STABLE + CAND, signals(candidate, stable), when)
        plan = plan_pass(s, 1, seen, status, when, (ops or {}).get(t))
        assert plan.status.canary is not None
        assert rendered_mirror(s, plan) == plan.status.canary.mirror_percent, t
        # the status is the whole memory: what is read back is what the next pass starts from
        status = InferencePoolStatus.model_validate(plan.status.model_dump(mode="json", by_alias=True))
        plans.append((t, plan))
    return plans


def trail(plans: list[tuple[int, Plan]]) -> list[tuple[int, str, str, int, float | None]]:
    out = []
    for t, p in plans:
        c = p.status.canary
        assert c is not None
        out.append((t, c.phase, c.stage, c.weight, c.mirror_percent))
    return out


def reasons(plans: list[tuple[int, Plan]]) -> list[str]:
    return [e.reason for _, p in plans for e in p.events]


def test_a_good_candidate_is_mirrored_for_the_duration_then_goes_to_the_first_live_step():
    plans = drive(CANARY, None, 300)
    shadow = [(t, p) for t, p in plans if p.status.canary and p.status.canary.stage == "Shadow"]
    assert [t for t, _ in shadow] == [0, 10, 20, 30, 40, 50]  # duration 60s: live from the pass at 60s
    for _, p in shadow:
        assert p.revision_weights == {"v1": 100}
        assert p.mirror is not None
        assert (p.mirror.revision, p.mirror.percent) == ("v2", 50.0)
        assert p.status.canary
        assert p.status.canary.phase == "Shadow"
        assert p.status.canary.weight == 0
    live = dict(plans)[60]
    assert live.status.canary
    assert live.status.canary.stage == "Live"
    assert live.revision_weights == {"v1": 90, "v2": 10}
    assert live.mirror is None
    assert live.status.canary.mirror_percent is None
    assert live.status.canary.last_check is None  # the first live step needs its own passing check
    assert live.status.canary.shadow_verdict
    assert live.status.canary.shadow_verdict.startswith("passed after 60s")
    final = plans[-1][1].status.canary
    assert final is not None
    assert final.phase == "Promoted"
    assert final.stable_revision == "v2"
    assert reasons(plans).count("ShadowPassed") == 1
    assert reasons(plans).count("ShadowMirroring") == 1
    started = next(e for _, p in plans for e in p.events if e.reason == "CanaryStarted")
    assert "in shadow first" in started.message


def test_a_failing_candidate_is_rolled_back_in_shadow_without_ever_getting_user_traffic():
    plans = drive(CANARY, sig(ttft=0.05, rps=2.0, errors=0.08), 300)
    assert all(p.revision_weights == {"v1": 100} for _, p in plans)
    assert all(p.status.canary and p.status.canary.weight == 0 for _, p in plans)
    back = next(p for _, p in plans if p.status.canary and p.status.canary.phase == "RolledBack")
    assert back.status.canary
    assert back.status.canary.stage == "Shadow"
    assert "in shadow" in back.status.canary.message
    assert "before any user request" in back.status.canary.message
    after = [p for _, p in plans if p.status.canary and p.status.canary.phase == "RolledBack"]
    assert len(after) > 20  # and it stays there
    assert all(p.mirror is None and p.status.canary and p.status.canary.mirror_percent is None for p in after)
    assert reasons(plans).count("CanaryRolledBack") == 1
    assert "ShadowPassed" not in reasons(plans)


def test_the_shadow_is_judged_by_its_own_thresholds_not_the_live_ones():
    # 900 ms p95: within the live gate (2s), beyond the shadow's (500 ms)
    slow = sig(ttft=0.5, rps=2.0, p95=0.9)
    lenient = {**CANARY["analysis"], "disabledGates": ["ttftRatioToStable"]}
    plans = drive({**CANARY, "analysis": lenient}, slow, 200)
    last = plans[-1][1].status.canary
    assert last is not None
    assert (last.phase, last.stage) == ("RolledBack", "Shadow")
    assert "TTFT p95 900ms > 500ms" in last.last_check_reason
    # the same candidate without the shadow goes live and is promoted on the live thresholds
    live_only = {k: v for k, v in CANARY.items() if k != "shadow"} | {"analysis": lenient}
    plain = drive(live_only, slow, 400)[-1][1].status.canary
    assert plain is not None
    assert plain.phase == "Promoted"


def test_the_ratio_to_stable_compares_the_mirrored_candidate_with_the_stable_under_live_load():
    shadow = {**SHADOW, "analysis": {**SHADOW["analysis"], "maxTtftP95": "5s", "maxTtftRatioToStable": 1.5}}
    plans = drive({**CANARY, "shadow": shadow}, sig(ttft=0.2, rps=2.0), 100)
    last = plans[-1][1].status.canary
    assert last is not None
    assert last.phase == "RolledBack"
    assert "x stable > 1.50x" in last.last_check_reason


def test_too_little_mirrored_traffic_never_passes_the_shadow():
    plans = drive(CANARY, sig(ttft=0.05, rps=0.1), 400)  # 1 request per 10 s window < minRequests 10
    assert all(p.status.canary and p.status.canary.stage == "Shadow" for _, p in plans)
    last = plans[-1][1].status.canary
    assert last is not None
    assert last.last_check == "Inconclusive"
    assert last.phase == "Shadow"
    assert "holding until a check passes" in last.message
    assert "need 10" in last.message
    assert last.mirror_percent == 50.0  # still mirrored: the evidence may come


def test_no_mirror_while_the_candidate_has_no_routable_pod_and_the_clock_restarts_when_it_has():
    not_ready = [pod("v2-a", "a100", "v2", ready=False)]
    waiting = drive(CANARY, None, 100, pods=STABLE + not_ready)
    assert [x[1:] for x in trail(waiting)] == [("Waiting", "Shadow", 0, None)] * len(waiting)
    assert all(p.mirror is None for _, p in waiting)
    ready = drive(CANARY, None, 100, start=waiting[-1][1].status)
    phases = trail(ready)
    assert phases[0][1:] == ("Shadow", "Shadow", 0, 50.0)
    first_live = next(t for t, phase, stage, _, _ in phases if stage == "Live")
    assert first_live >= 60  # a full shadow duration with the mirror rendered


def test_an_incident_on_a_candidate_pod_in_shadow_is_a_failed_check_at_once():
    s = spec(canary=CANARY)
    first = plan_pass(s, 1, observed(STABLE + CAND, signals(None), at(0)), None, at(0))
    oomed = [*STABLE, pod("v2-a", "a100", "v2", restarts=1, last_termination_reason="OOMKilled")]
    plan = plan_pass(s, 1, observed(oomed, signals(None), at(5)), first.status, at(5))
    assert plan.status.canary
    assert plan.status.canary.failed_checks == 1
    assert "zeroed for an incident" in plan.status.canary.last_check_reason
    assert any(e.reason == "CanaryCheckFailed" and "in shadow" in e.message for e in plan.events)


def test_lora_failures_on_the_candidate_fail_the_shadow():
    plans = drive(CANARY, sig(ttft=0.05, rps=2.0, lora=0.5), 100)
    last = plans[-1][1].status.canary
    assert last is not None
    assert (last.phase, last.stage) == ("RolledBack", "Shadow")
    assert all(p.revision_weights == {"v1": 100} for _, p in plans)


def test_when_the_stable_revision_cannot_serve_users_go_to_the_candidate_without_a_mirror_and_no_shadow_time():
    unready = [pod("v1-a", "a100", "v1", ready=False), pod("v1-b", "a100", "v1", ready=False)]
    plans = drive(CANARY, None, 120, pods=unready + CAND)
    for _, p in plans:
        c = p.status.canary
        assert c is not None
        assert c.stage == "Shadow"
        assert c.split_forced
        assert p.revision_weights == {"v2": 100}
        assert p.mirror is None
        assert c.mirror_percent is None


def test_paused_in_shadow_keeps_mirroring_and_checking_but_does_not_go_live():
    plans = drive({**CANARY, "paused": True}, None, 200)
    assert {x[1:] for x in trail(plans)} == {("Paused", "Shadow", 0, 50.0)}
    failing = drive({**CANARY, "paused": True}, sig(ttft=0.05, rps=2.0, errors=0.5), 60)
    assert failing[-1][1].status.canary
    assert failing[-1][1].status.canary.phase == "RolledBack"
    resumed = drive(CANARY, None, 10, start=plans[-1][1].status)
    assert trail(resumed)[-1][2] == "Live"  # the duration ran while paused (the mirror was rendered)


def test_removing_the_shadow_from_the_spec_mid_shadow_goes_to_the_first_live_step():
    plans = drive(CANARY, None, 20)
    no_shadow = {k: v for k, v in CANARY.items() if k != "shadow"}
    after = drive(no_shadow, None, 10, start=plans[-1][1].status)
    c = after[0][1].status.canary
    assert c is not None
    assert (c.phase, c.stage, c.weight, c.mirror_percent) == ("Progressing", "Live", 10, None)
    assert c.shadow_verdict == "ended: spec.canary.shadow was removed"


def test_a_new_candidate_mid_shadow_starts_its_own_shadow():
    plans = drive(CANARY, None, 30)
    pods = [*STABLE, pod("v3-a", "a100", "v3")]
    s = spec(canary={**CANARY, "candidateRevision": "v3"})
    seen = observed(pods, {"v1-a": sig(rps=10), "v1-b": sig(rps=10), "v3-a": GOOD}, at(40))
    plan = plan_pass(s, 1, seen, plans[-1][1].status, at(40))
    c = plan.status.canary
    assert c is not None
    assert (c.candidate_revision, c.phase, c.stage) == ("v3", "Shadow", "Shadow")
    assert plan.mirror is not None
    assert plan.mirror.revision == "v3"
    assert c.step_started_at == at(40)


def op(name: str, id_: str = "1", **fields: Any) -> Operation:
    return Operation(id=id_, op=name, by="alice@prod", **fields)  # type: ignore[arg-type]


def test_skip_step_in_shadow_ends_the_shadow_only_after_a_passing_check_unless_forced():
    slow_start = sig(ttft=0.05, rps=0.1)  # Inconclusive: too few requests
    refused = drive(CANARY, slow_start, 10, ops={10: op("skip-step")})
    record = refused[-1][1].status.canary and refused[-1][1].status.canary.last_operation
    assert record
    assert record.result == "Refused"
    assert "no passing check in shadow" in record.message
    assert refused[-1][1].status.canary
    assert refused[-1][1].status.canary.stage == "Shadow"
    forced = drive(CANARY, slow_start, 10, ops={10: op("skip-step", "2", force=True)})
    c = forced[-1][1].status.canary
    assert c is not None
    assert (c.stage, c.weight) == ("Live", 10)
    assert c.last_operation
    assert c.last_operation.forced
    assert c.shadow_verdict == "skipped by alice@prod (analysis skipped)"
    long = {**CANARY, "shadow": {**SHADOW, "duration": "10m"}}
    early = drive(long, None, 10, ops={10: op("skip-step", "3")})  # the check at 0s passed, on no mirrored copy
    c = early[-1][1].status.canary
    assert c is not None
    assert c.last_operation
    assert (c.last_operation.result, c.stage) == ("Refused", "Shadow")
    passed = drive(long, None, 70, ops={70: op("skip-step", "3")})  # the check at 60s: a whole window mirrored
    c = passed[-1][1].status.canary
    assert c is not None
    assert (c.stage, c.step_index, c.weight, c.mirror_percent) == ("Live", 0, 10, None)
    assert c.last_operation
    assert not c.last_operation.forced
    assert "ShadowPassed" in reasons(passed)


def test_promote_from_shadow_needs_a_passing_shadow_check():
    long = {**CANARY, "shadow": {**SHADOW, "duration": "10m"}}
    promoted = drive(long, None, 70, ops={70: op("promote")})
    c = promoted[-1][1].status.canary
    assert c is not None
    assert c.phase == "Promoted"
    assert promoted[-1][1].revision_weights == {"v2": 100}
    assert c.last_operation
    assert c.last_operation.message == "promoted now from shadow"
    refused = drive(CANARY, sig(ttft=0.05, rps=0.1), 10, ops={10: op("promote")})
    c = refused[-1][1].status.canary
    assert c is not None
    assert c.phase == "Shadow"
    assert c.last_operation
    assert c.last_operation.result == "Refused"


def test_abort_in_shadow_removes_the_mirror_and_retry_starts_the_shadow_again():
    aborted = drive(CANARY, None, 20, ops={10: op("abort")})
    c = aborted[-1][1].status.canary
    assert c is not None
    assert (c.phase, c.stage, c.mirror_percent) == ("RolledBack", "Shadow", None)
    assert c.last_operation
    assert "before any user request" in c.last_operation.message
    assert aborted[-1][1].mirror is None
    retried = drive(CANARY, None, 10, start=aborted[-1][1].status, ops={10: op("retry", "2")})
    c = retried[-1][1].status.canary
    assert c is not None
    assert (c.phase, c.stage, c.mirror_percent) == ("Shadow", "Shadow", 50.0)
    assert c.last_operation
    assert c.last_operation.message == "v2 again in shadow first"


def test_shadow_gates_without_data_are_named_in_the_spec_condition():
    tgi = spec(engine="tgi", canary=CANARY)
    plan = plan_pass(tgi, 1, observed(STABLE + CAND, signals(None), at(0)), None, at(0))
    spec_valid = next(c for c in plan.status.conditions if c.type == "SpecValid")
    assert "canary.shadow.analysis.disabledGates" in spec_valid.message, spec_valid.message


def test_without_any_stable_revision_there_is_nothing_to_mirror_and_the_status_says_so():
    """Found by the pass-never-raises property: a shadow with no stable revision and an unproven candidate."""
    s = spec(canary={k: v for k, v in CANARY.items() if k != "stableRevision"})
    plan = plan_pass(s, 1, observed(CAND, {}, at(0)), None, at(0))  # no signals yet: routable, not healthy
    c = plan.status.canary
    assert c is not None
    assert (c.phase, c.stage, c.mirror_percent) == ("Shadow", "Shadow", None)
    assert plan.mirror is None
    assert "no stable revision" in c.message


def test_the_shadow_clock_runs_only_while_the_mirror_is_rendered():
    unready = [pod("v1-a", "a100", "v1", ready=False), pod("v1-b", "a100", "v1", ready=False)]
    forced = drive(CANARY, None, 120, pods=unready + CAND)  # two minutes with users forced to the candidate
    back = drive(CANARY, None, 120, start=forced[-1][1].status)  # the stable revision serves again
    trail_back = trail(back)
    assert trail_back[0][1:] == ("Shadow", "Shadow", 0, 50.0)
    first_live = next(t for t, _, stage, _, _ in trail_back if stage == "Live")
    assert first_live >= 60  # the forced minutes did not count as shadow time


def test_stale_candidate_signals_are_not_evidence_the_shadow_holds_inconclusive_naming_the_pod():
    """The candidate's scrape stops after t=0: its last values are not numbers to judge it on."""
    s = spec(canary=CANARY, metrics={"staleAfter": "15s"})
    status = None
    plans = []
    for t in range(0, 121, 10):
        sampled = {"v1-a": at(t), "v1-b": at(t), "v2-a": at(0)}
        seen = observed(STABLE + CAND, signals(None), at(t), sampled_at=sampled, freshness_known=True)
        plan = plan_pass(s, 1, seen, status, at(t))
        status = InferencePoolStatus.model_validate(plan.status.model_dump(mode="json", by_alias=True))
        plans.append((t, plan))
    late = [(t, p) for t, p in plans if t >= 20]
    row = next(r for r in late[-1][1].status.endpoints if r.pod == "v2-a")
    assert row.verdict == "frozen"
    for t, p in late:
        c = p.status.canary
        assert c is not None
        assert c.stage == "Shadow", t
        assert c.last_check in ("Inconclusive", "Pass"), t
    last = plans[-1][1].status.canary
    assert last is not None
    assert last.last_check == "Inconclusive"
    assert "stale signals for pod v2-a" in last.last_check_reason
    assert "ShadowPassed" not in reasons(plans)


def test_a_shadow_rollback_after_users_were_forced_to_the_candidate_does_not_claim_none_reached_it():
    unready = [pod("v1-a", "a100", "v1", ready=False), pod("v1-b", "a100", "v1", ready=False)]
    forced = drive(CANARY, sig(ttft=0.05, rps=2.0), 20, pods=unready + CAND)
    assert forced[-1][1].revision_weights == {"v2": 100}
    back = drive(CANARY, sig(ttft=0.05, rps=2.0, errors=0.08), 100, start=forced[-1][1].status)
    c = back[-1][1].status.canary
    assert c is not None
    assert (c.phase, c.stage) == ("RolledBack", "Shadow")
    assert c.served_users
    assert "before any user request" not in c.message
    assert "users were routed to it" in c.message
    aborted = drive(CANARY, None, 10, start=forced[-1][1].status, ops={10: op("abort")})
    c = aborted[-1][1].status.canary
    assert c is not None
    assert c.last_operation
    assert c.phase == "RolledBack"
    assert "before any user request" not in c.last_operation.message
    assert "before any user request" not in c.message


def test_a_shadow_that_never_served_users_says_so_in_the_status():
    plans = drive(CANARY, sig(ttft=0.05, rps=2.0, errors=0.08), 100)
    c = plans[-1][1].status.canary
    assert c is not None
    assert c.phase == "RolledBack"
    assert not c.served_users
    assert "before any user request" in c.message


def test_the_shadow_ends_only_on_a_check_whose_window_had_the_mirror_in_place():
    """A check from the pass the mirror appeared (or before it) judged no mirrored copy: it cannot end the shadow."""
    short = {**CANARY, "shadow": {**SHADOW, "duration": "10s", "analysis": {**SHADOW["analysis"], "interval": "60s"}}}
    unready = [pod("v1-a", "a100", "v1", ready=False), pod("v1-b", "a100", "v1", ready=False)]
    forced = drive(short, None, 0, pods=unready + CAND)  # a passing check with users forced to the candidate
    assert forced[-1][1].status.canary
    assert forced[-1][1].status.canary.last_check == "Pass"
    back = drive(short, None, 120, start=forced[-1][1].status)  # the mirror is rendered from t=10 (window 60s)
    first_live = next(t for t, _, stage, _, _ in trail(back) if stage == "Live")
    assert first_live >= 70
    held = next(p for t, p in back if t == 30).status.canary
    assert held is not None
    assert "of mirrored traffic passes" in held.message
    refused = drive(short, None, 20, start=forced[-1][1].status, ops={20: op("skip-step", "7")})
    c = refused[-1][1].status.canary
    assert c is not None
    assert c.last_operation
    assert c.last_operation.result == "Refused"
    assert "in shadow over 60s of mirrored traffic" in c.last_operation.message
    assert c.stage == "Shadow"


def test_the_first_live_check_after_the_shadow_judges_a_whole_window_of_user_traffic():
    plans = drive(CANARY, None, 300)
    went_live = next(t for t, _, stage, _, _ in trail(plans) if stage == "Live")
    first_live_check = next(
        t for t, p in plans if t > went_live and p.status.canary and p.status.canary.last_check is not None
    )
    assert first_live_check >= went_live + 60  # metrics.window: no mirrored data in the check's window
    pending = next(p for t, p in plans if t == went_live + 40).status.canary
    assert pending is not None
    assert pending.last_check is None


def test_with_no_stable_revision_and_an_unproven_candidate_the_status_reports_that_users_reach_the_candidate():
    """No split is rendered then (route to every routable pod): the candidate's pods serve the users."""
    s = spec(canary={k: v for k, v in CANARY.items() if k != "stableRevision"})
    plan = plan_pass(s, 1, observed(CAND, {}, at(0)), None, at(0))  # no signals yet: routable, not healthy
    assert plan.revision_weights == {}
    assert [e.pod for e in plan.endpoints] == ["v2-a"]
    c = plan.status.canary
    assert c is not None
    assert c.weight == 100
    assert c.split_forced
    assert "no split" in c.split_forced
    assert c.served_users
