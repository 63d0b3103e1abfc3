"""Invariants of the core over random multi-pass histories (hypothesis).

Every pass of every history must satisfy: no negative weights; weights within [0, maxWeight]; a zeroed pod gets
nothing and is not published; pods that are not ready get nothing; the floor holds; the pool is never all-zero
while any pod is ready; the canary candidate never gets more than its current step (unless the stable revision
has no routable pod at all); an unusable metrics pass never changes a weight it has no new facts about.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from sluice.core.observed import Observed, ObservedPod, PodSignals, SignalSnapshot
from sluice.core.protection import floor_keep
from sluice.core.reconcile import plan_pass
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
def histories(draw: Any) -> tuple[Any, list[tuple[float, Observed]]]:
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
        snapshot = SignalSnapshot(
            collected_at=T0 + timedelta(seconds=now - age),
            failed={"ttft": "connection refused"} if outage else {},
            pods={name: draw(signals_st) for name in names if draw(st.integers(0, 6)) > 0},
        )
        passes.append((now, Observed(pods=pods, signals=snapshot)))
    return s, passes


@given(histories())
def test_invariants_hold_on_every_pass(history):
    s, passes = history
    previous = None
    for seconds, observed in passes:
        now = T0 + timedelta(seconds=seconds)
        plan = plan_pass(s, 1, observed, previous, now)
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
        routable = sum(1 for row in rows if row.weight > 0)
        assert routable >= floor_keep(len(ready), s.protection.min_routable_percent)
        if ready:
            assert routable >= 1
            assert plan.publish
        canary = plan.status.canary
        if canary is not None and canary.candidate_revision and canary.phase not in ("Promoted",):
            stable_up = any(row.weight > 0 and row.revision == canary.stable_revision for row in rows)
            if stable_up and canary.step_index is not None:
                step = s.canary.steps[canary.step_index] if s.canary else 0
                assert plan.revision_weights.get(canary.candidate_revision, 0) <= step
            if canary.phase in ("RolledBack", "Waiting"):
                assert plan.revision_weights.get(canary.candidate_revision, 0) in (0, 100)
                if stable_up:
                    assert plan.revision_weights.get(canary.candidate_revision, 0) == 0
        assert sum(plan.revision_weights.values()) in (0, 100)
        previous = plan.status


@given(histories())
def test_an_unusable_metrics_pass_changes_no_weight_without_pod_facts(history):
    """Fail-static: with Prometheus down and the same pods as before, every weight stays as it was."""
    s, passes = history
    previous = None
    for seconds, observed in passes:
        plan = plan_pass(s, 1, observed, previous, T0 + timedelta(seconds=seconds))
        previous = plan.status
    last_seconds, last = passes[-1]
    down = Observed(
        pods=last.pods,
        signals=SignalSnapshot(collected_at=T0 + timedelta(seconds=last_seconds + 1), failed={"ttft": "down"}),
    )
    assert previous is not None
    # Same pods (no restart, no readiness change), one second later, queries failing.
    frozen = plan_pass(s, 1, down, previous, T0 + timedelta(seconds=last_seconds + 1))
    before = {row.pod: row.weight for row in previous.endpoints}
    after = {row.pod: row.weight for row in frozen.status.endpoints}
    for name, weight in before.items():
        row = next(r for r in frozen.status.endpoints if r.pod == name)
        if weight > 0 and row.state != "Zeroed":
            assert after[name] == weight, (name, row.reason)
