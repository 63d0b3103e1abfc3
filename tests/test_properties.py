"""Invariants of the core over random multi-pass histories (hypothesis).

Every pass of every history must satisfy, checked against the spec and the history itself (never against the
pass's own bookkeeping such as `stepIndex`):
- weights within [0, maxWeight]; a zeroed pod gets nothing and is not published; a pod that is not ready gets
  nothing; the floor holds per revision subset; the pool is never all-zero while any pod is ready;
- the canary candidate's share moves at most one step per pass up the spec's steps; a forced split happens only
  when the side it drains has no healthy routable pod;
- no pod held only by the floor carries a larger share of all traffic (revision split x share in its subset)
  than the best routable pod that is not held;
- a pass with unusable metrics changes no weight it has no new facts about — nothing ramps, nothing is scored.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from sluice.api.v1alpha1 import EndpointStatus, InferencePoolSpec
from sluice.core.observed import Observed, ObservedPod, PodSignals, SignalSnapshot
from sluice.core.protection import floor_keep
from sluice.core.reconcile import Plan, plan_pass
from tests.helpers import T0, spec

CLASSES = ["a100", "rtx4090", "cpu", "unknown"]

maybe_rate = st.one_of(st.none(), st.floats(0, 1))
signals_st = st.builds(
    PodSignals,
    ttft_seconds=st.one_of(st.none(), st.floats(0.001, 20)),
    ttft_p95_seconds=st.one_of(st.none(), st.floats(0.001, 40)),
    kv_cache_usage=maybe_rate,
    queue_length=st.one_of(st.none(), st.floats(0, 500)),
    running_requests=st.one_of(st.none(), st.floats(0, 500)),
    request_rate=st.one_of(st.none(), st.floats(0, 1000)),
    error_rate=maybe_rate,
    lora_failure_rate=maybe_rate,
)


@st.composite
def histories(draw: Any) -> tuple[InferencePoolSpec, list[tuple[float, Observed]]]:
    n_pods = draw(st.integers(1, 8))
    use_canary = draw(st.booleans())
    steps = [*sorted(set(draw(st.lists(st.integers(1, 99), max_size=4)))), 100]
    wire: dict[str, Any] = {
        "protection": {
            "minRoutablePercent": draw(st.integers(0, 100)),
            "consecutiveFailures": draw(st.integers(1, 4)),
        },
        "scoring": {
            "smoothing": draw(st.sampled_from([0.0, 0.3, 0.9])),
            "hysteresisPercent": draw(st.sampled_from([0.0, 10.0, 50.0])),
            "maxWeight": draw(st.sampled_from([10, 100, 1000])),
        },
    }
    if use_canary:
        wire["canary"] = {
            "stableRevision": "v1",
            "candidateRevision": "v2",
            "steps": steps,
            "stepInterval": "20s",
            "analysis": {"interval": "10s", "minRequests": draw(st.integers(0, 50))},
            "paused": draw(st.booleans()),
        }
        if draw(st.booleans()):
            wire["canary"]["shadow"] = {
                "mirrorPercent": draw(st.sampled_from([0.5, 50.0, 100.0])),
                "duration": draw(st.sampled_from(["10s", "30s"])),
                "analysis": {"interval": "10s", "minRequests": draw(st.integers(0, 50))},
            }
    s = spec(**wire)
    names = [f"pod-{i}" for i in range(n_pods)]
    restarts = dict.fromkeys(names, 0)
    now = 0.0
    passes = []
    for _ in range(draw(st.integers(1, 12))):
        now += draw(st.sampled_from([1.0, 5.0, 15.0, 40.0]))
        pods = []
        for i, name in enumerate(names):
            if draw(st.integers(0, 9)) == 0:
                restarts[name] += 1
            labels = {"app": "llama", "sluice.dev/hardware-class": CLASSES[i % len(CLASSES)]}
            labels["sluice.dev/revision"] = "v2" if i % 3 == 2 else "v1"
            pods.append(
                ObservedPod(
                    name=name,
                    ip=f"10.0.0.{i + 1}",
                    labels=labels,
                    ready=draw(st.integers(0, 5)) > 0,
                    restarts=restarts[name],
                    last_termination_reason=draw(st.sampled_from([None, "OOMKilled", "Error"])),
                )
            )
        outage = draw(st.integers(0, 5)) == 0
        age = draw(st.sampled_from([0.0, 0.0, 0.0, 120.0]))
        seen = {name: draw(signals_st) for name in names if draw(st.integers(0, 6)) > 0}
        sample_age = {name: draw(st.sampled_from([0.0, 1.0, 90.0])) for name in seen}
        snapshot = SignalSnapshot(
            collected_at=T0 + timedelta(seconds=now - age),
            failed={"ttft": "connection refused"} if outage else {},
            pods=seen,
            freshness_known=draw(st.booleans()),
            sampled_at={name: T0 + timedelta(seconds=now - a) for name, a in sample_age.items()},
        )
        passes.append((now, Observed(pods=pods, signals=snapshot)))
    return s, passes


def traffic_shares(plan: Plan) -> dict[str, float]:
    """Each routable pod's share of all traffic: its revision's split x its weight within its subset."""
    rows = [row for row in plan.status.endpoints if row.weight > 0]
    split = plan.revision_weights
    totals: dict[str | None, int] = {}
    for row in rows:
        key = row.revision if split else None
        totals[key] = totals.get(key, 0) + row.weight
    shares = {}
    for row in rows:
        key = row.revision if split else None
        revision_share = (split.get(row.revision or "", 0) / 100.0) if split else 1.0
        shares[row.pod] = revision_share * row.weight / totals[key]
    return shares


def healthy(rows: list[EndpointStatus], revision: str | None) -> bool:
    return any(row.weight > 0 and not row.floor_held and row.revision == revision for row in rows)


def next_step(steps: list[int], high: int) -> int:
    return min((s for s in steps if s > high), default=100)


@given(histories())
def test_invariants_hold_on_every_pass(history):
    s, passes = history
    previous = None
    high = 0  # the highest candidate share published without a forced split, from this test's own record
    for seconds, observed in passes:
        plan = plan_pass(s, 1, observed, previous, T0 + timedelta(seconds=seconds))
        rows = plan.status.endpoints
        ready = {p.name for p in observed.pods if p.ready and p.ip and not p.deleting}
        published = {e.pod: e.weight for e in plan.endpoints}
        for row in rows:
            assert 0 <= row.weight <= s.scoring.max_weight
            if row.state == "Zeroed":
                assert row.weight == 0
                assert row.pod not in published
            if row.pod not in ready:
                assert row.weight == 0
        assert all(weight >= 1 for weight in published.values())
        for revision in {row.revision for row in rows}:
            subset = [row for row in rows if row.revision == revision and row.pod in ready]
            routable = sum(1 for row in subset if row.weight > 0)
            assert routable >= floor_keep(len(subset), s.protection.min_routable_percent)
        if ready:
            assert plan.publish
        assert sum(plan.revision_weights.values()) in (0, 100)

        shares = traffic_shares(plan)
        held = [row.pod for row in rows if row.floor_held and row.weight > 0]
        free = [shares[row.pod] for row in rows if not row.floor_held and row.weight > 0]
        if free:
            for pod in held:
                assert shares[pod] <= max(free) + 1e-9, (pod, shares)

        canary = plan.status.canary
        if s.canary is not None and canary is not None and canary.phase != "Promoted":
            share = plan.revision_weights.get("v2", 0)
            if canary.split_forced:
                if share == 100:
                    assert not healthy(rows, "v1")
                else:
                    assert share == 0
                    assert not healthy(rows, "v2")
            else:
                if canary.capacity_held:  # comparableLoad: published below the step, never above it
                    assert share <= (canary.step_weight or 0)
                else:
                    assert share in (0, *s.canary.steps)
                assert share <= next_step(s.canary.steps, high)
                high = max(high, share)
            assert canary.weight == share  # the status reports exactly the split published
            # the status reports exactly the mirror rendered, and there is one only in shadow with users on stable
            assert canary.mirror_percent == (plan.mirror.percent if plan.mirror else None)
            if plan.mirror is not None:
                assert canary.stage == "Shadow"
                assert plan.revision_weights == {"v1": 100}
                assert any(row.revision == "v2" and row.weight > 0 for row in rows)
            if canary.stage == "Shadow" and not canary.split_forced:
                assert share == 0  # no user is served by the candidate in shadow
        previous = plan.status


@given(histories())
def test_an_unusable_metrics_pass_changes_no_weight_without_pod_facts(history):
    """Fail-static: with Prometheus down and the same pods as before, no weight moves, nothing ramps."""
    s, passes = history
    previous = None
    for seconds, observed in passes:
        previous = plan_pass(s, 1, observed, previous, T0 + timedelta(seconds=seconds)).status
    last_seconds, last = passes[-1]
    assert previous is not None
    for later in (1, 60):  # one second later, and long enough for a quiet period or a ramp step to elapse
        when = T0 + timedelta(seconds=last_seconds + later)
        down = Observed(pods=last.pods, signals=SignalSnapshot(collected_at=when, failed={"ttft": "down"}))
        frozen = plan_pass(s, 1, down, previous, when)
        before = {row.pod: row for row in previous.endpoints}
        for row in frozen.status.endpoints:
            prior = before[row.pod]
            if prior.weight > 0:
                assert row.weight == prior.weight, (row.pod, row.reason)
            elif not row.floor_held:
                assert row.weight == 0, (row.pod, row.reason)
