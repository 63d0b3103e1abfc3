"""Per-pod inbound limits learned from evidence (`sluice.core.inbound`), and the status rows that show them
(`admission.mode: Report`)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.api.memory import decode, encode
from sluice.core.inbound import (
    BATCH_GAIN,
    HOLD_TURNOVERS,
    HYSTERESIS,
    KV_EVIDENCE,
    LIMIT_HOLD_MAX_SECONDS,
    LIMIT_HOLD_SECONDS,
    SHARE_DOWN,
    SHARE_RANGE,
    SHARE_UP,
    PodBatch,
    PodCapacity,
    binds,
    inbound_limit,
    learn_batch,
    learn_rate_at_limit,
    limit_hold,
    pod_limits,
    pod_rates,
    rate_limit,
    steer_share,
)
from sluice.core.mesh import TLS_MODE_LABEL
from sluice.core.observed import PodSignals
from tests.helpers import at, pod, run, sig, spec


def test_the_batch_is_what_a_full_cache_holds_read_once_the_cache_is_used_enough() -> None:
    assert learn_batch(None, running=2, kv_usage=KV_EVIDENCE - 0.01) is None  # too little of the cache to tell
    assert learn_batch(None, running=20, kv_usage=0.5) == 40  # the first reading, as it is
    assert learn_batch(40.0, running=1, kv_usage=0.1) == 40.0  # held between readings
    assert learn_batch(40.0, running=30, kv_usage=0.5) == pytest.approx(40 + BATCH_GAIN * 20)
    assert learn_batch(40.0, running=30, kv_usage=1.0) == pytest.approx(40 - BATCH_GAIN * 10)
    # a reading the engine never gives (usage past 1) counts as a full cache
    assert learn_batch(None, running=30, kv_usage=1.2) == 30


@pytest.mark.parametrize(
    ("running", "kv_usage"), [(None, 0.5), (40.0, None), (math.nan, 0.5), (40.0, math.inf), (0.0, 0.5)]
)
def test_a_missing_or_non_finite_reading_is_no_evidence(running: float | None, kv_usage: float | None) -> None:
    assert learn_batch(40.0, running, kv_usage) == 40.0
    assert learn_batch(None, running, kv_usage) is None


def test_the_limit_is_a_share_of_the_batch_and_moves_only_past_the_hysteresis() -> None:
    assert inbound_limit(None, 0.75, None) is None
    assert inbound_limit(None, 0.75, 30) is None  # the batch is gone (admission turned off and on): no limit
    assert inbound_limit(40.0, 0.75, None) == 30
    assert inbound_limit(0.5, 0.75, None) == 1  # never below one request
    assert inbound_limit(42.0, 0.75, 30) == 30  # 31 is within 10 % of 30
    assert inbound_limit(46.0, 0.75, 30) == 34  # 34 is not
    assert inbound_limit(4.0, 0.75, None, least=8) == 8  # admission.minLimit: a floor under a batch read low
    assert inbound_limit(None, 0.75, None, least=8) is None  # but no batch, no limit


@given(
    st.lists(
        st.tuples(
            st.one_of(st.none(), st.just(math.nan), st.floats(min_value=0, max_value=500)),
            st.one_of(st.none(), st.just(math.nan), st.floats(min_value=0, max_value=1)),
        ),
        max_size=40,
    )
)
def test_the_batch_never_leaves_the_readings_taken(readings: list[tuple[float | None, float | None]]) -> None:
    batch: float | None = None
    seen: list[float] = []
    for running, kv_usage in readings:
        before = batch
        batch = learn_batch(batch, running, kv_usage)
        if running is not None and kv_usage is not None and running >= 1 and kv_usage >= KV_EVIDENCE:
            seen.append(running / kv_usage)
        else:
            assert batch == before
        if seen:
            assert batch is not None
            assert min(seen) * (1 - 1e-9) <= batch <= max(seen) * (1 + 1e-9)
        else:
            assert batch is None


def _row(signals: PodSignals, mode: str = "Report", previous=None, seconds: float = 100, **snapshot):  # type: ignore[no-untyped-def]
    plan = run(
        spec(admission={"mode": mode, "batchShare": 0.75}), [pod("a")], {"a": signals}, seconds, previous, **snapshot
    )
    return plan.status, plan.status.endpoints[0]


def _holding(batch: float) -> PodSignals:
    """Signals whose reading is `batch`: half of it running in half the cache."""
    return sig(kv=0.5).model_copy(update={"running_requests": batch / 2})


def _light(running: float = 2) -> PodSignals:
    """Too little of the cache used to read a batch."""
    return sig(kv=0.1).model_copy(update={"running_requests": running})


def test_a_pool_reporting_admission_shows_each_pods_batch_and_limit_and_holds_them_while_idle() -> None:
    status, row = _row(_holding(40))
    assert (row.saturated_batch, row.inbound_limit) == (40, 30)
    status, row = _row(_light(), previous=status)  # nearly idle: what it read before stands
    assert (row.saturated_batch, row.inbound_limit) == (40, 30)
    _, row = _row(_holding(80), previous=status, seconds=100 + LIMIT_HOLD_SECONDS)
    assert row.saturated_batch == pytest.approx(40 + BATCH_GAIN * 40)
    assert row.inbound_limit == math.floor(0.75 * (40 + BATCH_GAIN * 40))


def test_a_limit_shown_holds_for_a_minute_before_it_moves() -> None:
    # a changed limit is a new Envoy cluster counting from zero (test_envoy_inbound_limit.py): one change a minute
    status, row = _row(_holding(40))
    assert (row.inbound_limit, row.limit_since) == (30, at(100))
    status, row = _row(_holding(80), previous=status, seconds=100 + LIMIT_HOLD_SECONDS - 1)
    assert row.saturated_batch == pytest.approx(40 + BATCH_GAIN * 40)  # the batch moves
    assert (row.inbound_limit, row.limit_since) == (30, at(100))  # the limit does not, yet
    status, row = _row(_holding(80), previous=status, seconds=100 + LIMIT_HOLD_SECONDS)
    assert row.inbound_limit == math.floor(0.75 * row.saturated_batch)
    assert row.limit_since == at(100 + LIMIT_HOLD_SECONDS)
    # kept across a restart: the compact memory carries when it was set
    remembered_row = decode(encode([row]))[0]
    assert remembered_row.limit_since == at(100 + LIMIT_HOLD_SECONDS)


def test_the_hold_follows_the_pods_time_in_system_between_a_minute_and_ten() -> None:
    # by Little's law: 40 running and 10 waiting, finishing 0.5/s, stay 100 s in the engine
    assert limit_hold(40, 10, 0.5) == HOLD_TURNOVERS * 100
    assert limit_hold(40, None, 1.0) == HOLD_TURNOVERS * 40  # no queue reading: the running requests alone
    assert limit_hold(8, 0, 4.0) == LIMIT_HOLD_SECONDS  # short requests: the floor
    assert limit_hold(400, 0, 0.5) == LIMIT_HOLD_MAX_SECONDS  # never past ten minutes
    assert limit_hold(40, 0, 0.0) == LIMIT_HOLD_MAX_SECONDS  # in flight and none finished: longer than the window
    assert limit_hold(0, 0, 0.0) == LIMIT_HOLD_SECONDS  # idle


@pytest.mark.parametrize(("running", "served"), [(None, 1.0), (40.0, None), (math.nan, 1.0), (40.0, math.inf)])
def test_no_reading_of_the_time_in_system_holds_only_the_floor(running: float | None, served: float | None) -> None:
    assert limit_hold(running, 0, served) == LIMIT_HOLD_SECONDS


def _lasting(batch: float, seconds_in_system: float) -> PodSignals:
    """`_holding(batch)` with requests that stay `seconds_in_system` in the engine."""
    return _holding(batch).model_copy(update={"request_rate": batch / 2 / seconds_in_system})


def test_a_limit_on_pods_whose_requests_last_minutes_holds_for_several_of_them() -> None:
    # agent-heavy at 150 % on the real data plane: requests lasting minutes, a limit moved once a minute stacked the
    # counts of three clusters; held HOLD_TURNOVERS times 40 s, the second change waits for the old requests
    status, row = _row(_lasting(40, 40))
    assert (row.inbound_limit, row.limit_since) == (30, at(100))
    hold = HOLD_TURNOVERS * 40
    status, row = _row(_lasting(80, 40), previous=status, seconds=100 + hold - 1)
    assert (row.inbound_limit, row.limit_since) == (30, at(100))
    status, row = _row(_lasting(80, 40), previous=status, seconds=100 + hold)
    assert row.inbound_limit == math.floor(0.75 * row.saturated_batch) != 30
    assert row.limit_since == at(100 + hold)


def test_a_pod_never_read_has_no_limit_and_admission_off_shows_none() -> None:
    _, row = _row(_light())
    assert (row.saturated_batch, row.inbound_limit) == (None, None)
    _, row = _row(_holding(40), mode="Off")
    assert (row.saturated_batch, row.inbound_limit) == (None, None)


def test_passes_between_two_scrapes_count_the_scrape_once() -> None:
    # A 5 s pass reads a 15 s scrape's gauges three times: the engine says when the sample was taken.
    status, _ = _row(_holding(40), sampled_at={"a": at(75)}, freshness_known=True)
    status, row = _row(_holding(80), previous=status, sampled_at={"a": at(90)}, freshness_known=True)
    assert row.saturated_batch == pytest.approx(40 + BATCH_GAIN * 40)
    _, row = _row(_holding(80), previous=status, sampled_at={"a": at(90)}, freshness_known=True)
    assert row.saturated_batch == pytest.approx(40 + BATCH_GAIN * 40)  # the same sample: one step, not two


def test_pods_of_one_class_share_its_median_batch_from_their_first_pass() -> None:
    s = spec(admission={"mode": "Report", "batchShare": 0.75})
    unlabelled = pod("x").model_copy(update={"labels": {"app": "llama"}})
    pods = [pod("a1"), pod("a2"), pod("a3"), pod("l1", hw="l40s"), unlabelled, pod("e", hw="")]
    signals = {
        "a1": _holding(40),
        "a2": _holding(80),
        "a3": _light(),  # not read yet: its class says what it can hold
        "l1": _light(),  # nor this one, and no pod of its class was
        "x": _holding(16),  # no class: its own batch
        "e": _holding(24),  # a class label with an empty value is no class either
    }
    plan = run(s, pods, signals, 100)
    rows = {r.pod: r for r in plan.status.endpoints}
    assert {name: r.saturated_batch for name, r in rows.items()} == {
        "a1": 40,
        "a2": 80,
        "a3": None,
        "l1": None,
        "x": 16,
        "e": 24,
    }
    limits = {name: r.inbound_limit for name, r in rows.items()}
    assert limits == {"a1": 45, "a2": 45, "a3": 45, "l1": None, "x": 12, "e": 18}


def test_a_class_limit_moves_only_past_the_hysteresis_of_each_pods_shown_limit() -> None:
    s = spec(admission={"mode": "Report", "batchShare": 0.75})
    pods = [pod("a1"), pod("a2")]
    first = run(s, pods, {"a1": _holding(40), "a2": _holding(40)}, 100)
    assert {r.inbound_limit for r in first.status.endpoints} == {30}
    # a2 reads 50 (batch 40 + 0.3 x 10 = 43): the median 41.5 gives 31, within 10 % of the 30 shown
    second = run(s, pods, {"a1": _holding(40), "a2": _holding(50)}, 105, first.status)
    assert {r.inbound_limit for r in second.status.endpoints} == {30}


def test_a_pools_min_limit_is_the_floor_of_every_pods_limit() -> None:
    s = spec(admission={"mode": "Report", "batchShare": 0.75, "minLimit": 20})
    plan = run(s, [pod("a1"), pod("r1", hw="rtx4090")], {"a1": _holding(40), "r1": _holding(8)}, 100)
    assert {r.pod: r.inbound_limit for r in plan.status.endpoints} == {"a1": 30, "r1": 20}


def test_a_pod_joining_a_class_takes_the_limit_its_class_shows() -> None:
    pods = [PodBatch("a1", "a100", 40.0), PodBatch("a2", "a100", 43.0), PodBatch("a3", "a100", None)]
    # the class shows 30; its batch now gives 31 (within 10 %): every pod, the new one too, keeps 30
    assert pod_limits(pods, 0.75, {"a1": 30, "a2": 30}) == {"a1": 30, "a2": 30, "a3": 30}
    # pods that showed different limits (one had its own before): the class takes the one most of them showed
    assert pod_limits(pods, 0.75, {"a1": 30, "a2": 33, "a3": 30}) == {"a1": 30, "a2": 30, "a3": 30}


def test_a_classs_admitted_rate_is_its_median_measured_capacity_moved_only_past_the_hysteresis() -> None:
    pods = [
        PodCapacity("a1", "a100", 10.0),
        PodCapacity("a2", "a100", 12.0),
        PodCapacity("a3", "a100", None),  # a prior only: takes its class's rate, adds nothing to it
        PodCapacity("r1", "rtx4090", None),  # nothing measured in its class: no rate
        PodCapacity("x", None, 3.0),  # no class: its own
    ]
    assert pod_rates(pods, {}) == {"a1": 11.0, "a2": 11.0, "a3": 11.0, "r1": None, "x": 3.0}
    # 11.0 shown; the median moves to 11.5 (within 10 %): held; to 12.5 (past it): moved
    assert pod_rates([*pods[:1], PodCapacity("a2", "a100", 13.0)], {"a1": 11.0, "a2": 11.0})["a1"] == 11.0
    assert pod_rates([*pods[:1], PodCapacity("a2", "a100", 15.0)], {"a1": 11.0, "a2": 11.0})["a1"] == 12.5
    # a non-finite or non-positive reading is no measurement
    assert pod_rates([PodCapacity("y", None, math.nan), PodCapacity("z", None, 0.0)], {}) == {"y": None, "z": None}


def test_the_rate_at_a_full_limit_is_read_by_littles_law_once_the_pod_runs_enough_of_its_limit() -> None:
    # 20 req/s served with 40 running: a request spends 2 s in the engine, so 100 at once serve 50 req/s
    assert learn_rate_at_limit(None, 20.0, 40.0, 100) == 50.0
    # past its limit (Report: nothing enforces it) the same law scales it down
    assert learn_rate_at_limit(None, 30.0, 120.0, 100) == 25.0
    # later readings move it part of the way; below a fifth of the limit, without a limit or a reading: held
    assert learn_rate_at_limit(50.0, 30.0, 50.0, 100) == pytest.approx(50.0 + 0.3 * (60.0 - 50.0))
    assert learn_rate_at_limit(50.0, 5.0, 19.0, 100) == 50.0
    assert learn_rate_at_limit(50.0, 20.0, 40.0, None) == 50.0
    for rate, running in ((None, 40.0), (20.0, None), (math.nan, 40.0), (20.0, math.inf), (0.0, 40.0)):
        assert learn_rate_at_limit(50.0, rate, running, 100) == 50.0
        assert learn_rate_at_limit(None, rate, running, 100) is None


def test_a_tenant_pool_reports_each_pods_rate_at_its_limit_and_its_class_rate() -> None:
    tenants = {"header": "x-tenant-id", "shares": [{"value": "a", "percent": 50}], "othersPercent": 50}
    s = spec(admission={"mode": "Report", "batchShare": 0.75, "tenants": tenants})
    pods = [pod("a1"), pod("a2")]
    running = {"a1": 30.0, "a2": 20.0}
    # batch 80 (40 running in half the cache): limit 60; nothing to read the rate against on the first pass
    first = run(s, pods, {n: _holding(80) for n in running}, 100)
    assert {r.pod: (r.inbound_limit, r.rate_limit) for r in first.status.endpoints} == {
        "a1": (60, None),
        "a2": (60, None),
    }
    signals = {
        n: _holding(80).model_copy(update={"running_requests": r, "request_rate": 10.0}) for n, r in running.items()
    }
    second = run(s, pods, signals, 120, first.status)
    rows = {r.pod: r for r in second.status.endpoints}
    assert (rows["a1"].rate_at_limit, rows["a2"].rate_at_limit) == (20.0, 30.0)  # 10 x 60 / running
    assert rows["a1"].rate_limit == rows["a2"].rate_limit == 25.0  # the class median


def test_enforcing_pools_say_in_events_when_their_sidecars_limits_move() -> None:
    s = spec(admission={"mode": "Enforce", "batchShare": 0.75})
    pods = [
        p.model_copy(update={"labels": {**p.labels, TLS_MODE_LABEL: "istio"}})
        for p in (pod("a1"), pod("r1", hw="rtx4090"))
    ]
    first = run(s, pods, {"a1": _holding(40), "r1": _light()}, 100)
    assert {(e.type, e.reason) for e in first.events} >= {
        ("Warning", "AdmissionPartlyEnforced"),
        ("Normal", "AdmissionLimits"),
    }
    assert "a100 30 (new)" in next(e.message for e in first.events if e.reason == "AdmissionLimits")
    second = run(s, pods, {"a1": _holding(40), "r1": _holding(12)}, 115, first.status)
    reasons = {e.reason: e.message for e in second.events}
    assert reasons["AdmissionEnforced"].startswith("every pod's sidecar has its class's limit")
    assert reasons["AdmissionLimits"] == "sidecar limits per hardware class: rtx4090 9 (new)"
    third = run(s, pods, {"a1": _holding(40), "r1": _holding(12)}, 130, second.status)
    assert not [e for e in third.events if e.reason.startswith("Admission")]  # nothing moved: nothing said


def test_a_limit_read_low_rises_while_it_binds_without_the_engine_ever_queueing() -> None:
    # The first reading (a burst) says 20: limit 15. The sidecar then lets 15 through at once and the engine never
    # queues; its cache, a quarter full with those 15, shows it holds 60. The limit follows the cache, not the queue.
    s = spec(admission={"mode": "Report", "batchShare": 0.75})
    status = run(s, [pod("a")], {"a": _holding(20)}, 100).status
    assert status.endpoints[0].inbound_limit == 15
    at_limit = sig(kv=0.25, queue=0).model_copy(update={"running_requests": 15})
    for k in range(1, 11):
        status = run(s, [pod("a")], {"a": at_limit}, 100 + 15 * k, status).status
    row = status.endpoints[0]
    assert row.saturated_batch is not None
    assert row.saturated_batch > 55
    assert row.inbound_limit is not None
    assert row.inbound_limit >= 41


def _running(running: float, kv: float) -> PodSignals:
    return sig(kv=kv).model_copy(update={"running_requests": running})


def test_a_pool_says_when_its_sidecars_start_and_stop_shedding() -> None:
    s = spec(admission={"mode": "Enforce", "batchShare": 0.75})
    pods = [p.model_copy(update={"labels": {**p.labels, TLS_MODE_LABEL: "istio"}}) for p in (pod("a1"), pod("a2"))]
    # both read a batch of 40 (limit 30); a1 runs 40 at once: its sidecar is refusing past 30
    first = run(s, pods, {"a1": _running(40, 1.0), "a2": _running(20, 0.5)}, 100)
    shedding = next(c for c in first.status.conditions if c.type == "Shedding")
    assert (shedding.status, shedding.reason) == ("True", "AtLimit")
    assert shedding.message == (
        "1 of 2 limited pods ran at their limit at their last scrape (their sidecars refuse past it): a1; refusals "
        "not counted for a1, a2"
    )
    assert first.status.admission is not None
    assert (first.status.admission.refused_rate, first.status.admission.uncounted) == (None, ["a1", "a2"])
    assert ("Warning", "SheddingStarted") in {(e.type, e.reason) for e in first.events}
    second = run(s, pods, {"a1": _running(20, 0.5), "a2": _running(20, 0.5)}, 115, first.status)
    shedding = next(c for c in second.status.conditions if c.type == "Shedding")
    assert (shedding.status, shedding.reason) == ("False", "BelowLimits")
    assert ("Normal", "SheddingStopped") in {(e.type, e.reason) for e in second.events}
    # no reading to compare with a limit: not known, and nothing said either way
    third = run(s, pods, {"a1": sig(kv=None), "a2": sig(kv=None)}, 130, second.status)
    shedding = next(c for c in third.status.conditions if c.type == "Shedding")
    assert shedding.status == "Unknown"
    assert not [e for e in third.events if e.reason.startswith("Shedding")]


def _counted(running: float, kv: float, served: float, refused: float | None) -> PodSignals:
    return _running(running, kv).model_copy(update={"request_rate": served, "refused_rate": refused})


def test_where_istio_counts_every_sidecars_refusals_shedding_is_judged_by_the_count_not_the_sample() -> None:
    s = spec(admission={"mode": "Enforce", "batchShare": 0.75})
    pods = [p.model_copy(update={"labels": {**p.labels, TLS_MODE_LABEL: "istio"}}) for p in (pod("a1"), pod("a2"))]
    # a1 refused 2 requests/s while both served 9: shedding. The sample alone (a1 runs below its limit of 30
    # now) would have said BelowLimits.
    first = run(s, pods, {"a1": _counted(20, 0.5, 4.0, 2.0), "a2": _counted(20, 0.5, 5.0, 0.0)}, 100)
    shedding = next(c for c in first.status.conditions if c.type == "Shedding")
    assert (shedding.status, shedding.reason) == ("True", "Refusing")
    assert shedding.message == "sidecars refused requests over the signals' window: a1"
    admission = first.status.admission
    assert admission is not None
    assert (admission.refused_rate, admission.served_rate, admission.uncounted) == (2.0, 9.0, [])
    assert admission.refused_share == pytest.approx(2 / 11)
    assert ("Warning", "SheddingStarted") in {(e.type, e.reason) for e in first.events}
    # a1 runs at its limit but its sidecar refused nothing over the window: counted, not shedding
    second = run(s, pods, {"a1": _counted(40, 1.0, 4.0, 0.0), "a2": _counted(20, 0.5, 5.0, 0.0)}, 115, first.status)
    shedding = next(c for c in second.status.conditions if c.type == "Shedding")
    assert (shedding.status, shedding.reason) == ("False", "NoRefusals")
    assert ("Normal", "SheddingStopped") in {(e.type, e.reason) for e in second.events}
    # a2 serves with its count unread: the pool's refusals are unknown, and the sample decides, saying so
    third = run(s, pods, {"a1": _counted(40, 1.0, 4.0, 0.0), "a2": _counted(20, 0.5, 5.0, None)}, 130, second.status)
    shedding = next(c for c in third.status.conditions if c.type == "Shedding")
    assert (shedding.status, shedding.reason) == ("True", "AtLimit")
    assert shedding.message.endswith("; refusals not counted for a2")
    assert third.status.admission is not None
    assert (third.status.admission.refused_rate, third.status.admission.refused_share) == (None, None)
    assert third.status.admission.served_rate == 9.0
    # ... but a counted sidecar that refused is shedding whatever the others: True, naming the uncounted
    fourth = run(s, pods, {"a1": _counted(20, 0.5, 4.0, 1.0), "a2": _counted(20, 0.5, 5.0, None)}, 145, third.status)
    shedding = next(c for c in fourth.status.conditions if c.type == "Shedding")
    assert (shedding.status, shedding.reason) == ("True", "Refusing")
    assert shedding.message == "sidecars refused requests over the signals' window: a1; refusals not counted for a2"


def test_a_pod_that_answered_nothing_has_refused_nothing_and_one_without_a_served_rate_is_not_counted() -> None:
    s = spec(admission={"mode": "Enforce", "batchShare": 0.75})
    pods = [p.model_copy(update={"labels": {**p.labels, TLS_MODE_LABEL: "istio"}}) for p in (pod("a1"), pod("a2"))]
    # a2 is new: no Istio series yet, and its engine finished nothing: no request reached it, none was refused
    plan = run(s, pods, {"a1": _counted(20, 0.5, 4.0, 0.0), "a2": _counted(0, 0.5, 0.0, None)}, 100)
    assert plan.status.admission is not None
    assert (plan.status.admission.refused_rate, plan.status.admission.uncounted) == (0.0, [])
    # without the engine's served rate either, nothing says it answered nothing: not counted, and no served rate
    plan = run(s, pods, {"a1": _counted(20, 0.5, 4.0, 0.0), "a2": _counted(0, 0.5, None, None)}, 100)
    assert plan.status.admission is not None
    assert plan.status.admission.uncounted == ["a2"]
    assert (plan.status.admission.refused_rate, plan.status.admission.served_rate) == (None, None)


def test_refusal_rates_that_move_alone_are_observations_and_do_not_write_the_status_at_once() -> None:
    from sluice.runtime.reconciler import _change, _Compared  # noqa: PLC0415

    s = spec(admission={"mode": "Enforce", "batchShare": 0.75})
    pods = [p.model_copy(update={"labels": {**p.labels, TLS_MODE_LABEL: "istio"}}) for p in (pod("a1"), pod("a2"))]
    first = run(s, pods, {"a1": _counted(20, 0.5, 4.0, 2.0), "a2": _counted(20, 0.5, 5.0, 0.0)}, 100)
    second = run(s, pods, {"a1": _counted(20, 0.5, 4.0, 2.1), "a2": _counted(20, 0.5, 5.0, 0.0)}, 100, first.status)
    assert first.status.admission != second.status.admission
    assert _change(_Compared.of(first.status), _Compared.of(second.status)) == "observations"


def test_a_failed_refusal_query_freezes_no_weight() -> None:
    s = spec(admission={"mode": "Enforce", "batchShare": 0.75})
    pods = [pod("a1").model_copy(update={"labels": {**pod("a1").labels, TLS_MODE_LABEL: "istio"}})]
    plan = run(s, pods, {"a1": _counted(20, 0.5, 4.0, None)}, 100, failed={"refusedRate": "timed out"})
    metrics = next(c for c in plan.status.conditions if c.type == "MetricsAvailable")
    assert metrics.status == "True"
    assert plan.status.admission is not None
    assert plan.status.admission.uncounted == ["a1"]
    frozen = run(s, pods, {"a1": _counted(20, 0.5, 4.0, None)}, 100, failed={"ttft": "timed out"})
    assert next(c for c in frozen.status.conditions if c.type == "MetricsAvailable").status == "False"


def test_a_pool_without_enforce_has_no_admission_block_and_reads_no_refusals() -> None:
    s = spec(admission={"mode": "Report"})
    status = run(s, [pod("a")], {"a": _counted(20, 0.5, 4.0, 2.0)}, 100).status
    assert status.admission is None
    assert not [c for c in status.conditions if c.type == "Shedding"]


def test_an_enforcing_pool_says_which_pods_split_a_rate_among_tenants_and_when_that_changes() -> None:
    tenants = {"header": "x-tenant-id", "shares": [{"value": "a", "percent": 50}], "othersPercent": 50}
    s = spec(admission={"mode": "Enforce", "batchShare": 0.75, "tenants": tenants})
    pods = [pod(n).model_copy(update={"labels": {**pod(n).labels, TLS_MODE_LABEL: "istio"}}) for n in ("a1", "a2")]
    first = run(s, pods, {n: _holding(80) for n in ("a1", "a2")}, 100)
    shares = next(c for c in first.status.conditions if c.type == "TenantSharesEnforced")
    assert (shares.status, shares.reason) == ("False", "NoRates")
    assert "admitted without tenant shares: a1, a2" in shares.message
    assert [e.reason for e in first.events if e.reason.startswith("TenantShares")] == ["TenantSharesNoRates"]
    busy = {n: _holding(80).model_copy(update={"request_rate": 10.0}) for n in ("a1", "a2")}
    second = run(s, pods, busy, 120, first.status)
    shares = next(c for c in second.status.conditions if c.type == "TenantSharesEnforced")
    assert (shares.status, shares.reason) == ("True", "Enforced"), shares.message
    assert "a100 15/s" in shares.message  # 10 req/s with 40 running against a limit of 60
    assert [e.reason for e in second.events if e.reason.startswith("TenantShares")] == ["TenantSharesEnforced"]
    third = run(s, pods, busy, 125, second.status)
    assert not [e for e in third.events if e.reason.startswith("TenantShares")]


def test_a_rate_too_small_for_a_bucket_is_no_rate() -> None:
    # rendered to a thousandth of a request a second; below it a bucket would refill at 0 (Envoy refuses that)
    assert rate_limit(0.0004, None) is None
    assert rate_limit(0.0006, None) == 0.001


def test_a_non_finite_reading_is_left_out_of_its_classs_rate() -> None:
    # one pod's remembered reading is NaN (a stored memory can carry one): its class's rate is the others' median
    pods = [PodCapacity("a1", "a100", 10.0), PodCapacity("a2", "a100", math.nan), PodCapacity("a3", "a100", 12.0)]
    assert pod_rates(pods, {}) == {"a1": 11.0, "a2": 11.0, "a3": 11.0}


# ------------------------------------------------------------------------------------- admission.ttftTarget


@pytest.mark.parametrize(
    ("p95", "binding", "after"),
    [
        (0.9, False, 0.6 * SHARE_DOWN),  # above the target: down, whether or not the limit binds (floor 0 here)
        (0.9, True, 0.6 * SHARE_DOWN),
        (0.3, True, 0.6 * SHARE_UP),  # well below it and binding: up
        (0.3, False, 0.6),  # below it but not binding: nothing shows the pod could take more
        (0.45, True, 0.6),  # between SHARE_SLACK x target and the target: held
        (None, True, 0.6),  # no p95: no evidence, no move
        (math.nan, True, 0.6),
    ],
)
def test_a_share_moves_by_the_ttft_p95_against_the_target(p95: float | None, binding: bool, after: float) -> None:
    assert steer_share(0.6, p95, binding, target=0.5) == pytest.approx(after, abs=1e-4)


def test_a_share_stays_within_its_range_and_above_its_floor() -> None:
    low, high = SHARE_RANGE
    assert steer_share(low, 9.0, True, 0.5) == low
    assert steer_share(high, 0.01, True, 0.5) == high
    assert steer_share(0.62, 9.0, True, 0.5, floor=0.6) == 0.6  # batchShare: the target only ever adds room


def test_a_limit_binds_when_its_sidecar_refused_or_its_engine_ran_as_many() -> None:
    assert binds(30, 30.0, None)
    assert binds(30, 12.0, 0.5)
    assert not binds(30, 12.0, 0.0)
    assert not binds(None, 80.0, 3.0)  # no limit: nothing to bind
    assert not binds(30, math.nan, None)


def test_a_class_takes_the_median_of_its_pods_shares() -> None:
    pods = [PodBatch(name, "a100", 100.0) for name in ("a", "b", "c")] + [PodBatch("x", None, 50.0)]
    limits = pod_limits(pods, 0.6, {}, shares={"a": 0.3, "b": 0.5, "c": 0.9, "x": 0.2})
    assert limits == {"a": 50, "b": 50, "c": 50, "x": 10}
    assert pod_limits(pods, 0.6, {}) == {"a": 60, "b": 60, "c": 60, "x": 30}  # no shares: batchShare


def test_under_a_target_a_binding_limit_rises_while_the_p95_is_well_within_it_and_falls_back_to_batch_share() -> None:
    # Batch 80 read from the cache: limit 0.5 x 80 = 40, and the engine runs 40 (the limit binds) with a p95 of
    # 0.2 s against a 0.5 s target: each fresh sample raises the share; a pass on the same sample does not.
    s = spec(admission={"mode": "Report", "batchShare": 0.5, "ttftTarget": "500ms"})
    fast = _holding(80).model_copy(update={"ttft_p95_seconds": 0.2})
    known = {"freshness_known": True}
    status = run(s, [pod("a")], {"a": fast}, 100, sampled_at={"a": at(99)}, **known).status
    assert status.endpoints[0].inbound_limit == 40  # no limit before this pass: nothing bound yet
    assert status.endpoints[0].admission_share == 0.5
    status = run(s, [pod("a")], {"a": fast}, 115, status, sampled_at={"a": at(114)}, **known).status
    assert status.endpoints[0].admission_share == pytest.approx(0.5 * SHARE_UP, abs=1e-4)
    again = run(s, [pod("a")], {"a": fast}, 120, status, sampled_at={"a": at(114)}, **known).status
    assert again.endpoints[0].admission_share == status.endpoints[0].admission_share
    for k in range(2, 12):  # demand past the limit: the engine runs as many as the limit lets through
        limit = status.endpoints[0].inbound_limit
        assert limit is not None
        full = fast.model_copy(update={"running_requests": float(limit), "kv_cache_usage": limit / 80})
        status = run(s, [pod("a")], {"a": full}, 100 + 15 * k, status, sampled_at={"a": at(99 + 15 * k)}, **known)
        status = status.status
    row = status.endpoints[0]
    assert row.admission_share == pytest.approx(0.5 * SHARE_UP**11, abs=1e-3)
    assert row.inbound_limit is not None
    assert 40 < row.inbound_limit <= math.floor(row.admission_share * 80)  # moved past the hysteresis
    # the p95 goes past the target: the share comes down, to batchShare and no lower
    slow = fast.model_copy(update={"ttft_p95_seconds": 0.9})
    for k in range(12, 30):
        status = run(s, [pod("a")], {"a": slow}, 100 + 15 * k, status, sampled_at={"a": at(99 + 15 * k)}, **known)
        status = status.status
    assert status.endpoints[0].admission_share == 0.5
    limit = status.endpoints[0].inbound_limit
    assert limit is not None
    assert abs(limit - 40) <= HYSTERESIS * limit  # 0.5 x 80, or the one shown while within the hysteresis


def test_a_share_above_one_is_kept_and_a_raised_batch_share_lifts_a_share_kept_below_it() -> None:
    assert steer_share(1.5, 0.01, True, 0.5, floor=1.5) == 1.5  # batchShare 1.5: a target never cuts it to 1
    s = spec(admission={"mode": "Report", "batchShare": 0.5, "ttftTarget": "500ms"})
    held = _holding(80).model_copy(update={"ttft_p95_seconds": 0.45})  # between 0.8 x target and target: holds
    known = {"freshness_known": True}
    status = run(s, [pod("a")], {"a": held}, 100, sampled_at={"a": at(99)}, **known).status
    assert status.endpoints[0].admission_share == 0.5
    raised = spec(admission={"mode": "Report", "batchShare": 0.75, "ttftTarget": "500ms"})
    later = 100 + LIMIT_HOLD_SECONDS  # the limit shown at 100 s moves no sooner
    status = run(raised, [pod("a")], {"a": held}, later, status, sampled_at={"a": at(later - 1)}, **known).status
    assert status.endpoints[0].admission_share == 0.75
    assert status.endpoints[0].inbound_limit == 60


def test_without_a_sample_time_the_share_does_not_move_between_scrapes() -> None:
    # An engine whose sample times are not known (custom): every pass would look fresh, so the share holds.
    s = spec(admission={"mode": "Report", "batchShare": 0.5, "ttftTarget": "500ms"})
    fast = _holding(80).model_copy(update={"ttft_p95_seconds": 0.1})
    status = run(s, [pod("a")], {"a": fast}, 100).status
    for k in range(1, 5):
        status = run(s, [pod("a")], {"a": fast}, 100 + 5 * k, status).status
    assert status.endpoints[0].admission_share == 0.5


def test_removing_the_target_clears_the_share() -> None:
    s = spec(admission={"mode": "Report", "batchShare": 0.5, "ttftTarget": "500ms"})
    status = run(s, [pod("a")], {"a": _holding(80)}, 100).status
    assert status.endpoints[0].admission_share == 0.5
    plain = spec(admission={"mode": "Report", "batchShare": 0.5})
    assert run(plain, [pod("a")], {"a": _holding(80)}, 115, status).status.endpoints[0].admission_share is None


def test_without_a_target_the_share_is_batch_share_and_no_share_is_shown() -> None:
    s = spec(admission={"mode": "Report", "batchShare": 0.75})
    slow = _holding(80).model_copy(update={"ttft_p95_seconds": 2.0})
    row = run(s, [pod("a")], {"a": slow}, 100).status.endpoints[0]
    assert (row.admission_share, row.inbound_limit) == (None, 60)


def test_a_held_class_keeps_its_limit_and_a_pod_joining_it_takes_that_one() -> None:
    pods = [PodBatch("a1", "a100", 80.0), PodBatch("a2", "a100", 80.0), PodBatch("a3", "a100", None)]
    shown = {"a1": 30, "a2": 30}
    assert pod_limits(pods, 0.75, shown, held={"a1", "a2"}) == {"a1": 30, "a2": 30, "a3": 30}
    assert pod_limits(pods, 0.75, shown) == {"a1": 60, "a2": 60, "a3": 60}  # not held: it moves
    # a held pod showing another limit than its class's does not hold the class
    assert pod_limits(pods, 0.75, {**shown, "a3": 12}, held={"a3"}) == {"a1": 60, "a2": 60, "a3": 60}
