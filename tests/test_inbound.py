"""Per-pod inbound limits learned from evidence (`sluice.core.inbound`), and the status rows that show them
(`admission.mode: Report`)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.core.inbound import BATCH_GAIN, inbound_limit, learn_batch
from sluice.core.observed import PodSignals
from sluice.core.podload import QUEUE_EVIDENCE
from tests.helpers import at, pod, run, sig, spec


def test_a_running_count_is_the_batch_only_while_requests_wait() -> None:
    assert learn_batch(None, running=40, queue=0) is None  # room left: nothing says what it can hold
    assert learn_batch(None, running=40, queue=QUEUE_EVIDENCE - 1) is None
    assert learn_batch(None, running=40, queue=QUEUE_EVIDENCE) == 40  # the first reading, as it is
    assert learn_batch(40.0, running=10, queue=0) == 40.0  # held between readings
    assert learn_batch(40.0, running=60, queue=5) == pytest.approx(40 + BATCH_GAIN * 20)


@pytest.mark.parametrize(
    ("running", "queue"), [(None, 5.0), (40.0, None), (math.nan, 5.0), (40.0, math.inf), (0.0, 5.0)]
)
def test_a_missing_or_non_finite_reading_is_no_evidence(running: float | None, queue: float | None) -> None:
    assert learn_batch(40.0, running, queue) == 40.0
    assert learn_batch(None, running, queue) is None


def test_the_limit_is_a_share_of_the_batch_and_moves_only_past_the_hysteresis() -> None:
    assert inbound_limit(None, 0.75, None) is None
    assert inbound_limit(None, 0.75, 30) is None  # the batch is gone (admission turned off and on): no limit
    assert inbound_limit(40.0, 0.75, None) == 30
    assert inbound_limit(0.5, 0.75, None) == 1  # never below one request
    assert inbound_limit(42.0, 0.75, 30) == 30  # 31 is within 10 % of 30
    assert inbound_limit(46.0, 0.75, 30) == 34  # 34 is not


@given(
    st.lists(
        st.tuples(
            st.one_of(st.none(), st.just(math.nan), st.floats(min_value=0, max_value=500)),
            st.one_of(st.none(), st.just(math.nan), st.floats(min_value=0, max_value=50)),
        ),
        max_size=40,
    )
)
def test_the_batch_never_leaves_the_running_counts_seen_while_requests_waited(
    readings: list[tuple[float | None, float | None]],
) -> None:
    batch: float | None = None
    seen: list[float] = []
    for running, queue in readings:
        before = batch
        batch = learn_batch(batch, running, queue)
        evidence = (
            running is not None
            and queue is not None
            and math.isfinite(running)
            and math.isfinite(queue)
            and queue >= QUEUE_EVIDENCE
            and running >= 1
        )
        if evidence:
            assert running is not None
            seen.append(running)
        else:
            assert batch == before
        if seen:
            assert batch is not None
            assert min(seen) - 1e-9 <= batch <= max(seen) + 1e-9
        else:
            assert batch is None


def _row(signals: PodSignals, mode: str = "Report", previous=None, **snapshot):  # type: ignore[no-untyped-def]
    plan = run(spec(admission={"mode": mode}), [pod("a")], {"a": signals}, 100, previous, **snapshot)
    return plan.status, plan.status.endpoints[0]


def _queued(running: float, queue: float) -> PodSignals:
    return sig(queue=queue).model_copy(update={"running_requests": running})


def test_a_pool_reporting_admission_shows_each_pods_batch_and_limit_and_holds_them_between_saturations() -> None:
    status, row = _row(_queued(40, 5))
    assert (row.saturated_batch, row.inbound_limit) == (40, 30)
    status, row = _row(_queued(12, 0), previous=status)  # idle again: what it held when saturated stands
    assert (row.saturated_batch, row.inbound_limit) == (40, 30)
    _, row = _row(_queued(80, 9), previous=status)
    assert row.saturated_batch == pytest.approx(40 + BATCH_GAIN * 40)
    assert row.inbound_limit == math.floor(0.75 * (40 + BATCH_GAIN * 40))


def test_a_pod_never_seen_saturated_has_no_limit_and_admission_off_shows_none() -> None:
    _, row = _row(_queued(40, 0))
    assert (row.saturated_batch, row.inbound_limit) == (None, None)
    _, row = _row(_queued(40, 5), mode="Off")
    assert (row.saturated_batch, row.inbound_limit) == (None, None)


def test_passes_between_two_scrapes_count_the_scrape_once() -> None:
    # A 5 s pass reads a 15 s scrape's gauges three times: the engine says when the sample was taken.
    status, _ = _row(_queued(40, 5), sampled_at={"a": at(75)}, freshness_known=True)
    status, row = _row(_queued(80, 9), previous=status, sampled_at={"a": at(90)}, freshness_known=True)
    assert row.saturated_batch == pytest.approx(40 + BATCH_GAIN * 40)
    _, row = _row(_queued(80, 9), previous=status, sampled_at={"a": at(90)}, freshness_known=True)
    assert row.saturated_batch == pytest.approx(40 + BATCH_GAIN * 40)  # the same sample: one step, not two
