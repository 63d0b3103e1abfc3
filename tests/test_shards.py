"""Sharding, the pure part: a stable shard per pool, fair shares, and when a Lease may be taken."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

from sluice.core.shards import (
    LeaseView,
    PoolTurn,
    after_pass,
    decide,
    fair_share,
    next_turn,
    shard_lease_name,
    shard_of,
)


def test_the_shard_of_a_pool_does_not_depend_on_the_process() -> None:
    """Python's own hash() is salted per process; the shard must be the same in every replica."""
    code = "from sluice.core.shards import shard_of; print([shard_of('llm', f'pool-{i}', 7) for i in range(50)])"
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2", "random")
    }
    assert len(runs) == 1
    assert runs.pop().strip() == str([shard_of("llm", f"pool-{i}", 7) for i in range(50)])


def test_the_shard_of_a_pool_is_fixed_across_versions() -> None:
    """Replicas of two versions run side by side during a rolling upgrade: a pool's shard must not depend on the
    version. The values: the first 8 bytes of SHA-256 of "namespace/name", big-endian, modulo the shard count,
    taken from coreutils (`printf 'llm/pool-0' | sha256sum` -> af5207597a9a162f...), not from this code."""
    assert [shard_of("llm", f"pool-{i}", 7) for i in range(5)] == [2, 0, 5, 4, 3]
    assert [shard_of("llm", f"pool-{i}", 4) for i in range(5)] == [3, 1, 0, 3, 2]


def test_pools_spread_evenly_over_the_shards() -> None:
    counts = Counter(shard_of(f"ns-{i % 13}", f"pool-{i}", 4) for i in range(4000))
    assert set(counts) == {0, 1, 2, 3}
    assert max(counts.values()) - min(counts.values()) < 200


def test_namespace_and_name_both_count() -> None:
    assert [shard_of("a", f"p{i}", 16) for i in range(30)] != [shard_of("b", f"p{i}", 16) for i in range(30)]


def test_lease_names_carry_the_shard_count() -> None:
    assert shard_lease_name("sluice", 1, 4) != shard_lease_name("sluice", 1, 2)


def view(holder: str | None, unchanged_for: float = 0.0) -> LeaseView:
    return LeaseView(holder=holder, resource_version="7", duration=10.0, unchanged_for=unchanged_for)


def test_a_lease_is_free_when_released_expired_or_ones_own() -> None:
    assert view(None).free_for("a")
    assert view("a").free_for("a")
    assert not view("b", unchanged_for=9.9).free_for("a")
    assert view("b", unchanged_for=10.0).free_for("a")


def test_a_replica_takes_its_fair_share_and_no_more() -> None:
    leases: dict[int, LeaseView | None] = dict.fromkeys(range(4))
    assert fair_share(4, 3) == 2
    assert len(decide("a", 4, set(), leases, live_replicas=3).acquire) == 2
    assert len(decide("a", 4, set(), leases, live_replicas=1).acquire) == 4
    assert decide("a", 4, {0, 1}, leases, live_replicas=2).acquire == []


def test_a_replica_over_its_share_releases_the_surplus() -> None:
    leases: dict[int, LeaseView | None] = {i: view("a") for i in range(4)}
    decision = decide("a", 4, {0, 1, 2, 3}, leases, live_replicas=2)
    assert len(decision.release) == 2
    assert decision.acquire == []


def test_a_live_holder_is_never_displaced() -> None:
    leases: dict[int, LeaseView | None] = {i: view("b", unchanged_for=3.0) for i in range(4)}
    assert decide("a", 4, set(), leases, live_replicas=2).acquire == []
    leases[2] = view("b", unchanged_for=11.0)
    assert decide("a", 4, set(), leases, live_replicas=2).acquire == [2]


def test_replicas_starting_together_prefer_different_shards() -> None:
    leases: dict[int, LeaseView | None] = dict.fromkeys(range(8))
    firsts = {decide(f"replica-{i}", 8, set(), leases, live_replicas=4).acquire[0] for i in range(6)}
    assert len(firsts) > 1


def test_a_replica_over_the_floor_gives_one_up_to_a_replica_with_none() -> None:
    leases: dict[int, LeaseView | None] = {0: view("a"), 1: view("a"), 2: view("b"), 3: view("b")}
    assert len(decide("a", 4, {0, 1}, leases, live_replicas=3, others={"b": 2, "c": 0}).release) == 1
    assert decide("a", 4, {0, 1}, leases, live_replicas=3, others={"b": 1, "c": 1}).release == []


def test_a_pools_turns_idle_resume_and_lose_as_its_shard_comes_and_goes() -> None:
    turn = PoolTurn()
    # not held yet: idle, and its gauges go once (not at every idle check)
    step = next_turn(turn, sharded=True, term=None)
    assert (step.pass_now, step.forget_gauges, step.resume) == (False, True, False)
    step = next_turn(step.turn, sharded=True, term=None)
    assert (step.pass_now, step.forget_gauges, step.resume) == (False, False, False)
    # taken: passes, and what the process remembered is stale (it idled)
    step = next_turn(step.turn, sharded=True, term=1)
    assert (step.pass_now, step.resume) == (True, True)
    turn, lost = after_pass(step.turn, sharded=True, term_now=1)
    assert not lost
    step = next_turn(turn, sharded=True, term=1)
    assert (step.pass_now, step.resume) == (True, False)  # the same term: nothing to forget
    # lost and taken back between two passes: a new term, so the memory is stale although it never idled here
    step = next_turn(step.turn, sharded=True, term=2)
    assert (step.pass_now, step.resume) == (True, True)
    # lost during a pass: reported as lost, then idle without forgetting the gauges a second time
    turn, lost = after_pass(step.turn, sharded=True, term_now=None)
    assert lost
    assert turn.idle
    step = next_turn(turn, sharded=True, term=None)
    assert (step.pass_now, step.forget_gauges) == (False, False)
    # retaken in another term during the pass: lost all the same (its writes were fenced to the old term)
    assert after_pass(PoolTurn(seen=3), sharded=True, term_now=4) == (PoolTurn(idle=True, seen=3), True)


def test_a_pool_held_from_its_first_pass_or_unsharded_never_resumes() -> None:
    step = next_turn(PoolTurn(), sharded=True, term=1)
    assert (step.pass_now, step.resume) == (True, False)
    turn = PoolTurn()
    for _ in range(3):
        step = next_turn(turn, sharded=False, term=None)
        assert (step.pass_now, step.resume, step.forget_gauges) == (True, False, False)
        turn, lost = after_pass(step.turn, sharded=False, term_now=None)
        assert not lost
