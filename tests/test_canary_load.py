"""A candidate judged at the stable revision's load (`spec.canary.comparableLoad`): steps held at the share its
capacity carries at the stable revision's utilisation, promotion waiting until it can carry the pool, and a ratio
failure taken while it was busier Inconclusive."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sluice.api.v1alpha1 import AnalysisSpec, CanarySpec
from sluice.core.canary import step_canary
from sluice.core.canarycheck import Capacities, RevisionStats, check
from sluice.core.observed import PodSignals
from tests.helpers import at, pod, run, sig, spec

WINDOW = 60.0
STEPS: dict[str, Any] = {
    "stableRevision": "v1",
    "candidateRevision": "v2",
    "steps": [10, 25, 50, 100],
    "stepInterval": "30s",
    "analysis": {"interval": "10s", "minRequests": 20, "maxErrorRate": 0.02, "maxTtftRatioToStable": 1.5},
}


def stats(rate: float, capacity: float | None, classes: float, pods: int, ttft: float = 0.3) -> RevisionStats:
    per_k = capacity / classes if capacity and classes else None
    return RevisionStats(
        per_k=per_k,
        routable_pods=pods,
        healthy_pods=pods,
        requests=rate * WINDOW,
        error_rate=0.0,
        ttft_p95=ttft,
        window=WINDOW,
        capacity=capacity,
        classes=classes,
    )


def walk(canary: dict[str, Any], revisions: dict[str, RevisionStats], seconds: int, target: float = 0.8):
    """The rollout every 10 s over `seconds` with the same figures: (step weight, published weight, status)."""
    s = CanarySpec.model_validate(canary)
    status = None
    out = []
    for t in range(0, seconds + 1, 10):
        outcome = step_canary(s, status, revisions, True, at(t), None, target)
        status = outcome.status
        assert status is not None
        out.append((status.step_weight, status.weight, status))
    return out


# Three stable pods that learned 10 req/s each and carry 15 req/s (50 %); one candidate pod of the same class
# (K 10 each): at one utilisation it carries a quarter of the traffic.
STABLE = stats(15.0, 30.0, 30.0, 3)
ONE_POD = stats(2.0, None, 10.0, 1)


def test_a_step_past_what_the_candidate_carries_at_the_stable_utilisation_is_published_at_that_share():
    seen = walk(STEPS, {"v1": STABLE, "v2": ONE_POD}, 200)
    pairs = list(dict.fromkeys((step, weight) for step, weight, _ in seen))
    # 10 and 25 as written; 50 published at 25; the last step too, never promoted: one pod cannot carry the
    # pool's 17 req/s within 80 % of its 10.
    assert pairs == [(10, 10), (25, 25), (50, 25), (100, 25)]
    last = seen[-1][2]
    assert last.phase == "Progressing"
    assert "promotion waits" in (last.capacity_held or "")
    held_at_50 = next(status for step, _, status in seen if step == 50)
    assert held_at_50.capacity_held is not None
    assert "carries 25% at the stable revision's utilisation" in held_at_50.capacity_held
    assert "its classes' K at the stable revision's learned capacity per unit of K" in held_at_50.capacity_held
    assert "step 50% published at 25%" in held_at_50.message


def test_a_candidate_that_can_carry_the_pool_walks_every_step_and_is_promoted():
    three = stats(5.0, 30.0, 30.0, 3)  # as many pods as the stable revision, its own learned capacity
    seen = walk(STEPS, {"v1": STABLE, "v2": three}, 200)
    assert list(dict.fromkeys(weight for _, weight, _ in seen)) == [10, 25, 50, 100]
    assert seen[-1][2].phase == "Promoted"
    assert all(status.capacity_held is None for _, _, status in seen)


def test_without_comparable_load_the_steps_are_published_as_written():
    off = walk({**STEPS, "comparableLoad": False}, {"v1": STABLE, "v2": ONE_POD}, 200)
    assert list(dict.fromkeys(weight for _, weight, _ in off)) == [10, 25, 50, 100]


def test_without_a_learned_capacity_steps_are_held_by_declared_classes() -> None:
    # The cube learns no capacity: the split follows the declared classes (K 10 against 30), and the last step is
    # held the same way until the candidate's classes add up to the stable revision's (publishing it as written
    # put underprovisioned-canary's one pod under the whole load and promoted it: P99 28.6 s at 50 %).
    unknown = walk(STEPS, {"v1": stats(15.0, None, 30.0, 3), "v2": ONE_POD}, 200)
    pairs = list(dict.fromkeys((step, weight) for step, weight, _ in unknown))
    assert pairs == [(10, 10), (25, 25), (50, 25), (100, 25)]
    midway = next(status for step, _, status in unknown if step == 50)
    assert midway.capacity_held is not None
    assert "classes (K 10 against the stable revision's 30) carry 25% at the stable revision's load" in (
        midway.capacity_held
    )
    last = unknown[-1][2]
    assert last.phase == "Progressing"
    assert "promotion waits until its classes add up to the stable revision's" in (last.capacity_held or "")
    # as many declared classes on each side: promoted
    even = walk(STEPS, {"v1": stats(15.0, None, 30.0, 3), "v2": stats(5.0, None, 30.0, 3)}, 200)
    assert even[-1][2].phase == "Promoted"
    # a pod of no known class on one side and nothing learned: nothing to compare, as written
    unknown_class = walk(STEPS, {"v1": stats(15.0, None, 0.0, 3), "v2": ONE_POD}, 200)
    assert list(dict.fromkeys(weight for _, weight, _ in unknown_class)) == [10, 25, 50, 100]
    halfway = next(status for step, _, status in unknown_class if step == 50)
    assert "load not compared (canary.comparableLoad)" in halfway.message


def test_a_ratio_failure_taken_while_the_candidate_was_busier_is_inconclusive():
    gates = AnalysisSpec.model_validate({"minRequests": 20, "maxTtftRatioToStable": 1.5})
    stable = stats(15.0, 30.0, 30.0, 3, ttft=0.2)
    slower = stats(9.5, None, 10.0, 1, ttft=0.4)  # 2x the stable p95
    caps = Capacities(10.0, 30.0, "by class", absolute=True)
    busier = check(gates, slower, stable, True, loads=(caps, (0.95, 0.5)))
    assert busier.result == "Inconclusive"
    assert "not at comparable load: the candidate at 95% of its capacity, the stable revision at 50%" in busier.reason
    # within 1.25x + 5 points it is a failure; and without loads (comparableLoad off) as before
    assert check(gates, slower, stable, True, loads=(caps, (0.65, 0.5))).result == "Fail"
    assert check(gates, slower, stable, True).result == "Fail"
    # by declared classes alone (no learned capacity) the loads are per unit of K, compared without the slack
    relative = Capacities(10.0, 30.0, "by class", absolute=False)
    assert check(gates, slower, stable, True, loads=(relative, (0.95, 0.5))).result == "Inconclusive"
    assert check(gates, slower, stable, True, loads=(relative, (0.65, 0.5))).result == "Inconclusive"
    assert check(gates, slower, stable, True, loads=(relative, (0.6, 0.5))).result == "Fail"
    # a busier candidate that is not slower passes; other gates still fail it
    faster = stats(9.5, None, 10.0, 1, ttft=0.25)
    assert check(gates, faster, stable, True, loads=(caps, (0.95, 0.5))).result == "Pass"
    failing = RevisionStats(**{**slower.__dict__, "error_rate": 0.05})
    assert check(gates, failing, stable, True, loads=(caps, (0.95, 0.5))).result == "Fail"


POOL_PODS = [pod(f"v1-{i}", "a100", "v1") for i in range(3)] + [pod("v2-0", "a100", "v2")]
"""Three stable A100 pods and one candidate A100 pod, for the tests that run the whole pass."""
POOL_SPEC = spec(scoring={"policy": "headroom"}, canary={**STEPS, "steps": [50, 100]})


def signals(p95: float) -> dict[str, PodSignals]:
    """The stable pods at 6 req/s with TTFT p95 `p95` (0.1 s idle), the candidate lightly loaded."""
    stable = {f"v1-{i}": sig(ttft=0.1, p95=p95, rps=6.0, kv=0.1) for i in range(3)}
    return {**stable, "v2-0": sig(ttft=0.1, p95=0.1, rps=1.0, kv=0.05)}


def test_the_pool_pass_holds_a_step_on_the_capacity_its_stable_pods_learned() -> None:
    # Through the whole pass: the stable pods learn their capacity from load shown (their TTFT p95 inflated over
    # the idle one learned first), the candidate pod has none of its own and takes its class's.
    pods, s = POOL_PODS, POOL_SPEC

    status = run(s, pods, signals(0.1), 0).status
    plan = run(s, pods, signals(0.25), 10, status)
    rows = {r.pod: r for r in plan.status.endpoints}
    assert all(rows[f"v1-{i}"].learned_capacity for i in range(3)), [r.reason for r in rows.values()]
    canary = plan.status.canary
    assert canary is not None
    assert canary.step_weight == 50
    assert canary.weight == 25
    assert canary.capacity_held is not None
    assert "carries 25%" in canary.capacity_held
    assert plan.status.revision_weights == {"v1": 75, "v2": 25}


def test_held_weights_are_what_is_published():
    seen = walk(STEPS, {"v1": STABLE, "v2": ONE_POD}, 120)
    for step, weight, status in seen:
        assert status.weight == weight
        assert (status.capacity_held is None) == (weight == step)


def test_a_held_step_is_an_event_and_the_split_condition_says_so() -> None:
    pods, s = POOL_PODS, POOL_SPEC

    # the first pass: nothing learned yet, held by the declared classes; an Event once for the step
    first = run(s, pods, signals(0.1), 0)
    held = [e for e in first.events if e.reason == "CanaryHeldForCapacity"]
    assert len(held) == 1
    assert "v2 at 25% of step 50%" in held[0].message
    split = next(c for c in first.status.conditions if c.type == "SplitForced")
    assert (split.status, split.reason) == ("False", "HeldForCapacity")
    assert "step 50% published at 25%" in split.message
    # the stable pods learn their capacity: the same hold, now in requests/s, and no second Event
    plan = run(s, pods, signals(0.25), 10, first.status)
    assert not [e for e in plan.events if e.reason == "CanaryHeldForCapacity"]
    assert plan.status.canary is not None
    assert "its classes' K at the stable revision's learned capacity" in (plan.status.canary.capacity_held or "")


def test_an_ab_test_is_promoted_only_once_the_candidate_can_carry_the_pool() -> None:
    ab = {
        "stableRevision": "v1",
        "candidateRevision": "v2",
        "match": [{"headers": {"x-tester": {"exact": "yes"}}}],
        "abTest": {"key": {"header": "x-user-id"}, "percent": 20, "duration": "30s"},
        "analysis": {"interval": "10s", "minRequests": 20},
    }
    small = walk(ab, {"v1": STABLE, "v2": ONE_POD}, 120)
    last = small[-1][2]
    assert last.phase == "Progressing"
    assert last.weight == 0
    assert "promotion waits until it can carry the pool's 17.00/s" in (last.capacity_held or "")
    assert "promotion waits" in last.message
    light = walk(ab, {"v1": stats(3.0, 30.0, 30.0, 3), "v2": stats(1.0, None, 10.0, 1)}, 120)
    assert light[-1][2].phase == "Promoted"


def test_with_nothing_learned_a_quiet_stable_revision_lets_a_candidate_of_fewer_classes_be_promoted():
    """No capacity learned on either side, so the split is judged in units of K. A candidate of two A100s (K 20)
    against a stable revision of two A100s, an RTX 4090 and a CPU node (K 25) never added up to it, and waited
    at the last step for good, at a load the two A100s carry easily (the local stack's demo). While no stable pod
    shows load, the pool runs below INFORMATIVE of the stable revision's capacity: a candidate whose classes
    carry that within targetUtilization (here 0.8 x 20 >= 0.3 x 25) is promoted."""
    stable = replace(stats(5.0, None, 25.0, 4), quiet=True)
    cand = stats(5.0, None, 20.0, 2)
    promoted = walk(STEPS, {"v1": stable, "v2": cand}, 200)
    assert promoted[-1][2].phase == "Promoted", promoted[-1][2]
    # the same figures with a stable pod showing load: it waits at the last step, and says for what
    waits = walk(STEPS, {"v1": replace(stable, quiet=False), "v2": cand}, 200)
    last = waits[-1][2]
    assert last.phase != "Promoted"
    assert "promotion waits until its classes add up to the stable revision's" in (last.capacity_held or "")
    # and a candidate too small for even a quiet pool (0.8 x 5 < 0.3 x 25) waits too
    small = walk(STEPS, {"v1": stable, "v2": stats(5.0, None, 5.0, 1)}, 200)
    assert small[-1][2].phase != "Promoted"
