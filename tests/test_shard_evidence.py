"""What the sharded chaos scene reads from its evidence (`sluice.devstack.shardevidence`): pools spread over the
shards, Lease hand-overs and the even share, the clock offset a replica's renewTime shows, (e) over Leases and the
audit (clean, and failing on a write put outside a term), the replicas' logged transitions, merged /metrics."""

from __future__ import annotations

from datetime import UTC, datetime

from sluice.api.jsontypes import JsonObject
from sluice.core.shards import lease_body, micro_time, shard_lease_name, shard_of
from sluice.devstack.invariants import LeaseSeen, Version
from sluice.devstack.shardevidence import (
    HandOver,
    balanced_at,
    hand_overs,
    lease_of_pool,
    median_offset,
    merged_readings,
    pool_written,
    renew_offsets,
    shard_transitions,
    spread_pools,
    term_violations,
)

WALL_MINUS_MONO = 1_800_000_000.0
"""The runner's wall clock at monotonic 0 (the evidence's `at` + this = the emulator's wall clock)."""


def lease(at: float, name: str, holder: str | None, skew: float = 0.0, role: str = "shard") -> Version:
    stamp = micro_time(datetime.fromtimestamp(WALL_MINUS_MONO + at + skew - 0.01, UTC))
    body = lease_body("llm", "sluice", name, role, holder, "1", 10, stamp, False)
    return Version(at, "MODIFIED", "leases", name, body)


def test_pools_are_spread_so_that_every_shard_has_one() -> None:
    pools = spread_pools("llm", 4)
    assert sorted(shard_of("llm", p, 4) for p in pools) == [0, 1, 2, 3]
    assert pools == spread_pools("llm", 4)  # the same names in every run
    assert sorted(shard_of("llm", p, 4) for p in spread_pools("llm", 4, per_shard=2)) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_a_write_is_for_the_pool_whose_status_events_or_istio_objects_it_touches() -> None:
    pools = ["pool-1", "pool-12"]
    assert pool_written("inferencepools", "pool-1", pools) == "pool-1"
    assert pool_written("events", "pool-12.18a2b", pools) == "pool-12"
    assert pool_written("serviceentries", "sluice-pool-12", pools) == "pool-12"
    assert pool_written("envoyfilters", "sluice-pool-1-lb", pools) == "pool-1"
    assert pool_written("leases", "sluice-pool-1", pools) is None
    assert pool_written("serviceentries", "sluice-other", pools) is None
    lease_of = lease_of_pool("llm", pools, 4)
    assert lease_of("inferencepools", "pool-12") == shard_lease_name("sluice", shard_of("llm", "pool-12", 4), 4)
    assert lease_of("leases", "sluice-shard-0-of-4") is None


def records() -> list[LeaseSeen]:
    return [
        LeaseSeen(0.0, "s0", "replica-a", 10.0),
        LeaseSeen(0.0, "s1", "replica-b", 10.0),
        LeaseSeen(3.0, "s0", "replica-a", 10.0),
        LeaseSeen(12.0, "s0", "replica-b", 10.0),  # taken over: replica-a stopped renewing
        LeaseSeen(30.0, "s1", None, 10.0),  # replica-b gives one back
        LeaseSeen(31.0, "s1", "replica-a", 10.0),
    ]


def test_hand_overs_are_every_change_of_holder() -> None:
    assert hand_overs(records()) == [
        HandOver(12.0, "s0", "replica-a", "replica-b"),
        HandOver(30.0, "s1", "replica-b", None),
        HandOver(31.0, "s1", None, "replica-a"),
    ]


def test_the_shards_are_even_again_when_each_replica_holds_its_share() -> None:
    replicas = ["replica-a", "replica-b"]
    assert balanced_at(records(), replicas, 2, 0.0) == 0.0
    assert balanced_at(records(), replicas, 2, 20.0) == 31.0  # replica-b held both from 12 s, one free at 30 s
    assert balanced_at(records()[:5], replicas, 2, 20.0) is None


def test_a_shifted_clock_shows_as_the_offset_of_its_renew_times() -> None:
    versions = [
        lease(1.0, "sluice-member-a", "replica-a", role="member"),
        lease(2.0, "sluice-shard-0-of-4", "replica-b", skew=30.0),
        lease(5.0, "sluice-member-b", "replica-b", skew=30.0, role="member"),
        lease(9.0, "sluice-member-b", "replica-b", skew=30.0, role="member"),  # after the window
        lease(3.0, "sluice-shard-1-of-4", None),  # released: no renewTime
    ]
    ahead = renew_offsets(versions, "replica-b", WALL_MINUS_MONO, 0.0, 8.0)
    assert [round(o, 2) for o in ahead] == [29.99, 29.99]
    assert [round(o, 2) for o in renew_offsets(versions, "replica-a", WALL_MINUS_MONO, 0.0, 8.0)] == [-0.01]
    assert median_offset(ahead) == "+29.99 s (n=2, +29.99..+29.99)"
    assert median_offset([]) == "none seen"


def answered(at: float, pid: int, resource: str, name: str) -> tuple[float, JsonObject]:
    entry: JsonObject = {
        "stage": "ResponseComplete",
        "verb": "patch",
        "resource": resource,
        "name": name,
        "userAgent": f"sluice-operator/node-a-{pid} OpenAPI",
        "code": "200",
    }
    return at, entry


def test_writes_inside_the_term_are_clean_and_one_after_the_take_over_is_named() -> None:
    pools = spread_pools("llm", 2)
    pool = pools[0]
    shard = shard_lease_name("sluice", shard_of("llm", pool, 2), 2)
    versions = [lease(0.0, shard, "replica-a"), lease(3.0, shard, "replica-a"), lease(14.0, shard, "replica-b")]
    identities = {"node-a-41": "replica-a"}
    lease_of = lease_of_pool("llm", pools, 2)
    clean = [answered(4.0, 41, "inferencepools", pool), answered(9.5, 41, "serviceentries", f"sluice-{pool}")]
    assert term_violations(versions, clean, identities, lease_of, 0.0, 20.0, 0.5) == ([], 2)
    late = [*clean, answered(15.0, 41, "inferencepools", pool)]
    found, judged = term_violations(versions, late, identities, lease_of, 0.0, 20.0, 0.5)
    assert judged == 3
    assert found == [
        f"write-outside-term at 15.00s: inferencepools/{pool}: written by replica-a while {shard} was held by replica-b"
    ]
    # The same write outside the case's window is another case's.
    assert term_violations(versions, late, identities, lease_of, 0.0, 14.5, 0.5) == ([], 2)


def test_the_shard_transitions_each_replica_logged_are_counted() -> None:
    log = (
        "[2026-12-05 14:00:01,100] sluice.sharding [INFO] shard 1/4 acquired by replica-a\n"
        "[2026-12-05 14:00:21,100] sluice.sharding [INFO] shard 1/4 lost (lapsed without a renewal) by replica-a\n"
        "[2026-12-05 14:00:21,200] sluice.sharding [INFO] shard 3/4 lost (lapsed without a renewal) by replica-a\n"
        "something else\n"
    )
    assert shard_transitions(log) == {
        ("replica-a", "acquired"): 1,
        ("replica-a", "lost (lapsed without a renewal)"): 2,
    }


def test_two_replicas_metrics_read_as_one() -> None:
    a = {
        'sluice_reconcile_total{pool="llm/p",result="ok"}': 3.0,
        'sluice_last_pass_timestamp_seconds{pool="llm/p"}': 100.0,
    }
    b = {
        'sluice_reconcile_total{pool="llm/p",result="ok"}': 2.0,
        'sluice_last_pass_timestamp_seconds{pool="llm/p"}': 130.0,
    }
    assert merged_readings([a, b]) == {
        'sluice_reconcile_total{pool="llm/p",result="ok"}': 5.0,
        'sluice_last_pass_timestamp_seconds{pool="llm/p"}': 130.0,
    }
