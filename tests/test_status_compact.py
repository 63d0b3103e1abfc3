"""A large pool's status as stored: it fits in etcd, keeps every pod that needs a row, and loses no memory."""

from __future__ import annotations

import json
import random

import pytest

from sluice.api.memory import MemoryUnreadable, decode, encode, remembered
from sluice.api.snapshot import parse_snapshot
from sluice.api.v1alpha1 import InferencePoolStatus
from sluice.core.compact import FULL_ROWS_UP_TO, MAX_ROWS, SAMPLE, plainly_routable, stored_form
from sluice.core.reconcile import plan_pass
from sluice.plugin import render_status
from tests.helpers import at, observed, pod, sig, spec

MEMORY_FIELDS = (
    "pod",
    "weight",
    "score",
    "state",
    "since",
    "ttft_estimate_seconds",
    "restarts",
    "consecutive_failures",
    "verdict",
    "floor_held",
    "last_incident_at",
    "incident",
    "incident_message",
    "class_known",
    "revision",
    "hardware_class",
    "idle_ttft_seconds",
    "learned_capacity",
    "saturated_batch",
    "inbound_limit",
    "rate_limit",
    "rate_at_limit",
    "admission_share",
)


def fleet(n: int, seed: int = 1) -> tuple[list, dict]:
    """n pods named as a Deployment names them, on mixed hardware, with varied healthy signals."""
    rng = random.Random(seed)
    alphabet = "bcdfghjklmnpqrstvwxz2456789"
    names = {f"vllm-llama-70b-6c9f7d8b5d-{''.join(rng.choices(alphabet, k=5))}" for _ in range(n * 2)}
    pods = [pod(name, hw=rng.choice(["a100", "rtx4090"])) for name in sorted(names)[:n]]
    signals = {p.name: sig(ttft=rng.uniform(0.03, 0.4), rps=rng.uniform(1, 20), kv=rng.uniform(0.1, 0.8)) for p in pods}
    return pods, signals


def stored_bytes(status: InferencePoolStatus) -> int:
    wire = stored_form(status).model_dump(mode="json", by_alias=True, exclude_none=True)
    return len(json.dumps(wire, separators=(",", ":")).encode())


def memory_of(status: InferencePoolStatus) -> dict[str, tuple]:
    return {name: tuple(getattr(row, f) for f in MEMORY_FIELDS) for name, row in remembered(status).items()}


@pytest.mark.parametrize("policy", ["cube", "headroom"])
def test_a_4096_pod_pool_stores_at_most_256_kib_where_full_rows_would_not_fit_in_etcd(policy: str) -> None:
    s = spec(scoring={"policy": policy})
    pods, signals = fleet(4096)
    first = plan_pass(s, 1, observed(pods, signals, at(0)), None, at(0))
    second = plan_pass(s, 1, observed(pods, signals, at(10)), first.status, at(10))
    full = len(json.dumps(second.status.model_dump(mode="json", by_alias=True, exclude_none=True)).encode())
    assert full > 1572864  # the uncompacted status is over etcd's request limit
    stored = stored_bytes(second.status)
    print(f"\n4096 pods, {policy}: {stored / 1000:.0f} KB stored, {full / 1e6:.1f} MB uncompacted")  # the docs' figure
    assert stored <= 256 * 1024


@pytest.mark.parametrize("policy", ["cube", "headroom"])
def test_a_4096_pod_pool_with_every_pod_frozen_still_fits(policy: str) -> None:
    """Prometheus down: every pod is frozen (not plainly Routable); rows are capped, the rest kept in memory."""
    s = spec(scoring={"policy": policy})
    pods, signals = fleet(4096)
    first = plan_pass(s, 1, observed(pods, signals, at(0)), None, at(0))
    down = plan_pass(s, 1, observed(pods, {}, at(10), failed={"ttft": "connection refused"}), first.status, at(10))
    assert all(row.verdict == "frozen" for row in down.status.endpoints)
    stored = stored_form(down.status)
    print(f"\n4096 pods frozen, {policy}: {stored_bytes(down.status) / 1000:.0f} KB stored")  # the docs' figure
    assert stored_bytes(down.status) <= 256 * 1024
    assert len(stored.endpoints) == MAX_ROWS
    assert stored.endpoint_summary is not None
    assert stored.endpoint_summary.unlisted == 4096 - MAX_ROWS
    degraded = next(c for c in down.status.conditions if c.type == "Degraded")
    assert len(degraded.message) < 4000


def test_every_pod_that_is_not_plainly_routable_keeps_its_row_and_the_rest_are_counted() -> None:
    s = spec()
    pods, signals = fleet(300)
    pods[100] = pods[100].model_copy(update={"ready": False})  # excluded
    signals[pods[7].name] = sig(errors=0.5)  # zeroed for its error rate
    signals.pop(pods[250].name)  # no samples yet: awaiting
    first = plan_pass(s, 1, observed(pods, signals, at(0)), None, at(0))
    stored = stored_form(first.status)
    by_pod = {row.pod: row for row in first.status.endpoints}
    not_plain = {name for name, row in by_pod.items() if not plainly_routable(row)}
    assert {pods[7].name, pods[100].name, pods[250].name} <= not_plain
    listed = {row.pod for row in stored.endpoints}
    assert not_plain <= listed
    summary = stored.endpoint_summary
    assert summary is not None
    assert summary.pods == 300
    assert summary.listed == len(stored.endpoints) == len(not_plain) + SAMPLE
    assert summary.aggregated == 300 - len(not_plain) - SAMPLE
    assert sum(summary.by_state.values()) == 300
    assert sum(b.pods for b in summary.weights) == sum(1 for r in by_pod.values() if r.weight > 0)


def test_small_pools_keep_a_row_per_pod() -> None:
    s = spec()
    pods, signals = fleet(FULL_ROWS_UP_TO)
    plan = plan_pass(s, 1, observed(pods, signals, at(0)), None, at(0))
    stored = stored_form(plan.status)
    assert len(stored.endpoints) == FULL_ROWS_UP_TO
    assert stored.pod_memory is None
    assert stored.endpoint_summary is None


def _wire_round_trip(status: InferencePoolStatus) -> InferencePoolStatus:
    body = {
        "apiVersion": "inference.sluice.dev/v1alpha1",
        "kind": "InferencePool",
        "metadata": {"name": "p", "namespace": "default"},
        "spec": {"selector": {"matchLabels": {"app": "llama"}}, "targetPort": 8000, "service": "llama"},
        "status": json.loads(json.dumps(stored_form(status).model_dump(mode="json", by_alias=True, exclude_none=True))),
    }
    snapshot = parse_snapshot(body)
    assert snapshot.status is not None
    assert not snapshot.status_problems
    return snapshot.status


@pytest.mark.parametrize("policy", ["cube", "headroom"])
def test_incidents_and_ramps_survive_the_compact_form_exactly_as_they_survive_full_rows(policy: str) -> None:
    """Two runs of the same passes, one reading back full statuses, one the stored compact form: same decisions."""
    s = spec(protection={"recovery": {"quietPeriod": "30s", "stepInterval": "10s"}}, scoring={"policy": policy})
    pods, signals = fleet(200, seed=3)
    victims = [pods[3].name, pods[50].name, pods[199].name]
    full_prev = compact_prev = None
    for step in range(16):
        now = at(step * 10)
        these = dict(signals)
        if step == 2:
            for name in victims:
                these[name] = sig(errors=0.6)
        full = plan_pass(s, 1, observed(pods, these, now), full_prev, now)
        compact = plan_pass(s, 1, observed(pods, these, now), compact_prev, now)
        assert memory_of(full.status) == memory_of(compact.status), f"step {step}"
        assert [e.weight for e in full.endpoints] == [e.weight for e in compact.endpoints]
        assert full.events == compact.events, f"step {step}"
        full_prev, compact_prev = full.status, _wire_round_trip(compact.status)
        if step == 2:
            assert all(remembered(compact_prev)[n].incident == "ErrorRate" for n in victims)
        if step == 6:  # past the quiet period: ramping, Recovering
            assert {remembered(compact_prev)[n].state for n in victims} == {"Recovering"}
    # After the ramp the victims are plainly Routable again: aggregated, and their incident still remembered.
    assert all(plainly_routable(remembered(compact_prev)[n]) for n in victims)
    assert all(remembered(compact_prev)[n].last_incident_at == at(20) for n in victims)


@pytest.mark.parametrize("policy", ["cube", "headroom"])
def test_memory_round_trip_is_exact(policy: str) -> None:
    s = spec(scoring={"policy": policy})
    pods, signals = fleet(100, seed=5)
    plan = plan_pass(s, 1, observed(pods, signals, at(0)), None, at(0))
    rows = plan.status.endpoints
    back = decode(encode(rows))
    assert [tuple(getattr(r, f) for f in MEMORY_FIELDS) for r in back] == [
        tuple(getattr(r, f) for f in MEMORY_FIELDS) for r in rows
    ]


def test_a_reported_admission_limit_survives_the_compact_form() -> None:
    s = spec(admission={"mode": "Report", "batchShare": 0.75})
    pods, signals = fleet(100, seed=5)
    queued = {n: v.model_copy(update={"kv_cache_usage": 0.5, "running_requests": 20.0}) for n, v in signals.items()}
    rows = plan_pass(s, 1, observed(pods, queued, at(0)), None, at(0)).status.endpoints
    back = decode(encode(rows))
    assert {(r.saturated_batch, r.inbound_limit) for r in back} == {(40.0, 30)}


def test_a_steered_share_survives_the_compact_form() -> None:
    s = spec(admission={"mode": "Report", "batchShare": 0.5, "ttftTarget": "1s"})
    pods, signals = fleet(100, seed=5)
    held = {n: v.model_copy(update={"kv_cache_usage": 0.5, "running_requests": 20.0}) for n, v in signals.items()}
    first = plan_pass(
        s, 1, observed(pods, held, at(0), sampled_at=dict.fromkeys(held, at(0)), freshness_known=True), None, at(0)
    )
    fast = {n: v.model_copy(update={"ttft_p95_seconds": 0.1}) for n, v in held.items()}  # binding, well under 1 s
    second = plan_pass(
        s,
        1,
        observed(pods, fast, at(15), sampled_at=dict.fromkeys(fast, at(15)), freshness_known=True),
        first.status,
        at(15),
    )
    rows = second.status.endpoints
    assert {r.admission_share for r in rows} == {0.515}
    assert {r.admission_share for r in decode(encode(rows))} == {0.515}


def test_a_tenant_pools_rates_survive_the_compact_form() -> None:
    tenants = {"header": "x-tenant-id", "shares": [{"value": "a", "percent": 50}], "othersPercent": 50}
    s = spec(admission={"mode": "Report", "batchShare": 0.75, "tenants": tenants})
    pods, signals = fleet(100, seed=5)
    queued = {n: v.model_copy(update={"kv_cache_usage": 0.5, "running_requests": 20.0}) for n, v in signals.items()}
    first = plan_pass(s, 1, observed(pods, queued, at(0)), None, at(0))
    busy = {n: v.model_copy(update={"request_rate": 6.0}) for n, v in queued.items()}
    rows = plan_pass(s, 1, observed(pods, busy, at(15)), first.status, at(15)).status.endpoints
    assert all(r.rate_at_limit == 9.0 and r.rate_limit == 9.0 for r in rows)  # 6 x 30 / 20
    back = decode(encode(rows))
    assert {(r.rate_at_limit, r.rate_limit) for r in back} == {(9.0, 9.0)}


@pytest.mark.parametrize("stored", ["x9:abc", "z1:not-base64!!", "z1:" + "eJzLSM3JyQcABiwCFQ=="])
def test_unreadable_memory_is_refused_with_a_reason(stored: str) -> None:
    with pytest.raises(MemoryUnreadable, match="podMemory"):
        decode(stored)


def test_an_unreadable_memory_is_dropped_and_reported_not_fatal() -> None:
    body = {
        "metadata": {"name": "p", "namespace": "default"},
        "spec": {"selector": {"matchLabels": {"app": "llama"}}, "targetPort": 8000, "service": "llama"},
        "status": {"podMemory": "z1:garbage", "routable": "1/1"},
    }
    snapshot = parse_snapshot(body)
    assert snapshot.status is not None
    assert snapshot.status.pod_memory is None
    assert any("podMemory" in problem for problem in snapshot.status_problems)


def test_kubectl_sluice_status_says_where_rows_are_aggregated() -> None:
    s = spec()
    pods, signals = fleet(300)
    plan = plan_pass(s, 1, observed(pods, signals, at(0)), None, at(0))
    body = {
        "metadata": {"name": "p", "namespace": "default"},
        "spec": {"selector": {"matchLabels": {"app": "llama"}}, "targetPort": 8000, "service": "llama"},
        "status": stored_form(plan.status).model_dump(mode="json", by_alias=True, exclude_none=True),
    }
    text = render_status(body)
    assert f"rows: {SAMPLE} of 300 pods listed ({300 - SAMPLE} plainly Routable pods aggregated" in text
    assert "every row: kubectl sluice plan" in text


def _healthy(n: int) -> InferencePoolStatus:
    pods, signals = fleet(n)
    status = plan_pass(spec(), 1, observed(pods, signals, at(0)), None, at(0)).status
    assert all(plainly_routable(row) for row in status.endpoints)
    return status


def test_each_thing_worth_reporting_keeps_its_pod_a_row_of_its_own() -> None:
    """One pod per condition that makes a row worth keeping, set by hand on an otherwise healthy pool: each one
    keeps its own row (the predicate under test is not used to pick them)."""
    status = _healthy(300)
    marks = {
        "floor_held": {"floor_held": True},
        "failures": {"consecutive_failures": 2},
        "missing": {"missing_signals": ["ttftSeconds"]},
        "unknown class": {"class_known": False},
        "zeroed": {"state": "Zeroed", "weight": 0},
        "recovering": {"state": "Recovering"},
        "frozen": {"verdict": "frozen"},
    }
    rows = list(status.endpoints)
    marked: dict[str, str] = {}
    for i, (what, update) in enumerate(marks.items()):
        index = 20 + 37 * i  # spread over the pool, away from the weight sample's ends
        rows[index] = rows[index].model_copy(update=update)
        marked[what] = rows[index].pod
    stored = stored_form(status.model_copy(update={"endpoints": rows}))
    listed = {row.pod for row in stored.endpoints}
    assert {what for what, name in marked.items() if name not in listed} == set()
    assert stored.endpoint_summary is not None
    assert stored.endpoint_summary.listed == len(marks) + SAMPLE


def test_over_the_row_cap_the_most_serious_rows_are_kept_whatever_their_names() -> None:
    status = _healthy(300)
    rows = [row.model_copy(update={"verdict": "frozen"}) for row in status.endpoints]  # none plainly Routable
    last = sorted(row.pod for row in rows)[-5:]  # the names a cap by name would drop first
    rows = [row.model_copy(update={"state": "Zeroed", "weight": 0}) if row.pod in last else row for row in rows]
    stored = stored_form(status.model_copy(update={"endpoints": rows}))
    assert len(stored.endpoints) == MAX_ROWS
    assert set(last) <= {row.pod for row in stored.endpoints}


def test_the_sample_of_plain_rows_holds_the_lowest_and_the_highest_weights() -> None:
    status = _healthy(300)
    weights = {row.pod: row.weight for row in status.endpoints}
    assert len(set(weights.values())) > SAMPLE  # varied enough that the two ends differ
    stored = stored_form(status)
    shown = [row.weight for row in stored.endpoints]
    assert min(shown) == min(weights.values())
    assert max(shown) == max(weights.values())
