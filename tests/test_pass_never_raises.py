"""Any spec the CRD accepts, with any observation, makes a pass that returns — it never raises.

Specs come from `accepted_pool_specs()` (the API's edges, filtered by the CRD exactly as an API server would);
observations are random pods of the pool with random (finite) signals, restarts, readiness, sample times and
query failures, over several passes so the status feeds back. A pass that raised would leave the pool with its
old healthy-looking status; `test_reconciler.py` checks the runtime reports it if it ever does.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.api.v1alpha1 import InferencePoolSpec
from sluice.core.observed import Observed, ObservedPod, PodSignals, SignalSnapshot
from sluice.core.reconcile import plan_pass
from tests.helpers import T0
from tests.strategies import accepted_pool_specs

finite = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)
signals = st.builds(
    PodSignals,
    ttft_seconds=st.none() | finite,
    ttft_p95_seconds=st.none() | finite,
    kv_cache_usage=st.none() | st.floats(0, 1),
    queue_length=st.none() | finite,
    running_requests=st.none() | finite,
    request_rate=st.none() | finite,
    error_rate=st.none() | st.floats(0, 1),
    lora_failure_rate=st.none() | st.floats(0, 1),
)


@st.composite
def pools_and_histories(draw: Any) -> tuple[InferencePoolSpec, list[tuple[float, Observed]]]:
    spec = InferencePoolSpec.model_validate(draw(accepted_pool_specs()))
    classes = [*spec.capacity.classes, "unlisted"]
    revisions = [r for r in (spec.canary.stable_revision, spec.canary.candidate_revision) if r] if spec.canary else []
    names = [f"pod-{i}" for i in range(draw(st.integers(0, 6)))]
    restarts = dict.fromkeys(names, 0)
    history, now = [], 0.0
    for _ in range(draw(st.integers(1, 4))):
        now += draw(st.sampled_from([0.5, 5.0, 45.0, 4000.0]))
        pods = []
        for name in names:
            restarts[name] += draw(st.sampled_from([0, 0, 1]))
            labels = dict(spec.selector.match_labels)
            labels[spec.capacity.class_label] = draw(st.sampled_from(classes))
            if spec.canary and revisions:
                labels[spec.canary.revision_label] = draw(st.sampled_from(revisions))
            pods.append(
                ObservedPod(
                    name=name,
                    ip=draw(st.sampled_from(["10.0.0.1", None])),
                    labels=labels,
                    ready=draw(st.booleans()),
                    restarts=restarts[name],
                    last_termination_reason=draw(st.sampled_from([None, "OOMKilled", "Error"])),
                )
            )
        seen = {name: draw(signals) for name in names if draw(st.booleans())}
        snapshot = SignalSnapshot(
            collected_at=T0 + timedelta(seconds=now) if draw(st.integers(0, 5)) else None,
            failed={"ttft": "timed out"} if draw(st.integers(0, 4)) == 0 else {},
            pods=seen,
            freshness_known=draw(st.booleans()),
            sampled_at={n: T0 + timedelta(seconds=now - draw(st.sampled_from([0, 30, 600]))) for n in seen},
        )
        history.append((now, Observed(pods=pods, signals=snapshot)))
    return spec, history


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(pools_and_histories())
def test_a_pass_never_raises_on_any_accepted_spec(case):
    spec, history = case
    previous = None
    for seconds, observed in history:
        plan = plan_pass(spec, 1, observed, previous, T0 + timedelta(seconds=seconds))
        for row in plan.status.endpoints:
            assert 0 <= row.weight <= spec.scoring.max_weight
        assert sum(plan.revision_weights.values()) in (0, 100)
        previous = plan.status
