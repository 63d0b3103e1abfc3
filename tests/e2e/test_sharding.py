"""Sharding on the local stack: replicas share pools through Leases, never two on one pool, and take over a dead one.

The API emulator serves coordination.k8s.io/v1 Leases with resourceVersion conflicts as kube-apiserver does; its
audit trail records every allowed write again once answered, with the response code, in the order the writes
took effect. That trace is the evidence: for every write to a pool (its status, its Istio objects, its Events),
the last successful write to the pool's shard Lease before it was made by the same process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from kubernetes import client as k8s

from sluice.core.shards import LeaseView, shard_lease_name, shard_of
from sluice.devstack.stack import Stack
from sluice.io.kubereads import load_api_client
from sluice.runtime.sharding import ShardLeases
from tests.e2e.conftest import (
    BASE_PODS,
    Background,
    audit_trail,
    module_stack,
    operator_pid,
    pool_manifest,
    replica,
    wait_until,
)
from tests.test_chart import render, rules_of

pytestmark = pytest.mark.slow
SHARDS = 4
POOLS = [f"pool-{c}" for c in "abcdef"]


@pytest.fixture(scope="module")
def shard_stack(tmp_path_factory: pytest.TempPathFactory, background: Background) -> Iterator[Stack]:
    yield from module_stack(Path(tmp_path_factory.mktemp("shards")), background, BASE_PODS[:2])


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def wall(self) -> datetime:
        return datetime(2026, 12, 1, tzinfo=UTC) + timedelta(seconds=self.now)


def test_lease_rounds_share_shards_fairly_never_overlap_and_take_over_a_silent_replica(shard_stack: Stack) -> None:
    """Three replicas' lease rounds against the emulator on one simulated clock (no sleeping for lease terms)."""
    clock = FakeClock()
    replicas = {
        name: ShardLeases(
            load_api_client(str(shard_stack.kubeconfig)),
            "llm",
            SHARDS,
            identity=name,
            prefix="t1",
            clock=clock,
            wall=clock.wall,
        )
        for name in ("a", "b", "c")
    }
    alive = set(replicas)

    def holders() -> dict[int, list[str]]:
        return {i: [n for n, r in replicas.items() if r.holds(i)] for i in range(SHARDS)}

    def run(rounds: int) -> None:
        for _ in range(rounds):
            for name in sorted(alive):
                replicas[name].step()
                overlap = {i: who for i, who in holders().items() if len(who) > 1}
                assert not overlap, f"two replicas hold one shard at t={clock.now}: {overlap}"
            clock.now += 1.0

    run(25)
    held = holders()
    assert all(len(who) == 1 for who in held.values()), held
    counts = {n: sum(1 for who in held.values() if who == [n]) for n in replicas}
    assert sorted(counts.values()) == [1, 1, 2], counts  # ceil(4 / 3) at most, floor at least
    silent = max(counts, key=lambda n: counts[n])
    lost = [i for i, who in held.items() if who == [silent]]
    alive.discard(silent)  # it stops renewing (a SIGKILLed process), its clock runs on
    stopped_at = clock.now
    while any(replicas[silent].holds(i) or not holders()[i] for i in lost):
        run(1)
        assert clock.now - stopped_at <= 15, f"shards {lost} not taken over within 15 s"
    print(f"\nsimulated takeover of {lost} after {clock.now - stopped_at:.0f} s (10 s leases, 1 s rounds)")
    assert {who[0] for i, who in holders().items()} <= alive
    for name in alive:
        replicas[name].stop()
    leases = k8s.CoordinationV1Api(load_api_client(str(shard_stack.kubeconfig))).list_namespaced_lease("llm")
    shard_leases = [x for x in leases.items if x.metadata.name.startswith("t1-shard-")]
    assert len(shard_leases) == SHARDS
    assert all(not x.spec.holder_identity for x in shard_leases), "a stopped replica clears its Leases"


def test_two_replicas_racing_for_one_lease_get_one_success(shard_stack: Stack) -> None:
    clock = FakeClock()
    a, b = (
        ShardLeases(
            load_api_client(str(shard_stack.kubeconfig)),
            "llm",
            1,
            identity=n,
            prefix="t2",
            clock=clock,
            wall=clock.wall,
        )
        for n in ("a", "b")
    )
    # Both list before either writes: both see no Lease and try to create it.
    a._list(), b._list()
    a._acquire(0, None)
    b._acquire(0, None)
    assert a.holds(0) != b.holds(0)
    # Both see the same released record and update it with the same resourceVersion.
    winner = a if a.holds(0) else b
    winner.stop()
    listed = a._list()[shard_lease_name("t2", 0, 1)]
    view = LeaseView(None, listed["metadata"]["resourceVersion"], 10.0, 0.0)
    a._acquire(0, view)
    b._acquire(0, view)
    assert a.holds(0) != b.holds(0)
    a.stop()
    b.stop()


# ------------------------------------------------------------------------------------ three operator processes


def sharded(stack: Stack, name: str) -> subprocess.Popen[bytes]:
    # `--status-refresh 0`: every pass writes its pool's status (the signals move at every scrape), so the trace
    # has a pool write of every pass to check against the Leases, and the victim is killed right after a pool
    # write of its own rather than after the 20 s fallback
    flags = ["--shards", str(SHARDS), "--lease-namespace", "llm", "--identity", f"replica-{name}"]
    flags += ["--status-refresh", "0"]
    return replica(stack, name, flags)


def pool_written(entry: dict[str, str]) -> str | None:
    """The pool a write is for: its status, its Istio objects (sluice-<pool>[-...]), its Events (<pool>.<id>)."""
    name, resource = entry["name"], entry["resource"]
    if resource == "inferencepools":
        return name if name in POOLS else None
    if resource == "events":
        pool = name.split(".", 1)[0]
        return pool if pool in POOLS else None
    for pool in POOLS:
        if name == f"sluice-{pool}" or name.startswith(f"sluice-{pool}-"):
            return pool
    return None


def overlaps(entries: list[dict[str, str]]) -> tuple[list[str], dict[str, set[int]]]:
    """Writes to a pool by a process that was not the last to write the pool's shard Lease; and writes checked."""
    lease_of = {pool: shard_lease_name("sluice", shard_of("llm", pool, SHARDS), SHARDS) for pool in POOLS}
    last_lease_writer: dict[str, int] = {}
    problems: list[str] = []
    writers: dict[str, set[int]] = {}
    for entry in entries:
        if entry.get("stage") != "ResponseComplete" or not entry["code"].startswith("2"):
            continue
        pid = operator_pid(entry)
        if pid is None:
            continue
        if entry["resource"] == "leases":
            last_lease_writer[entry["name"]] = pid
            continue
        pool = pool_written(entry)
        if pool is None:
            continue
        writers.setdefault(pool, set()).add(pid)
        holder = last_lease_writer.get(lease_of[pool])
        if holder != pid:
            problems.append(f"{entry['verb']} {entry['resource']}/{entry['name']} by {pid}, lease last by {holder}")
    return problems, writers


def synced(stack: Stack, pool: str) -> bool:
    found = [c for c in stack.pool(pool).get("status", {}).get("conditions", []) if c["type"] == "IstioSynced"]
    return bool(found) and found[0]["status"] == "True"


def signals_read(stack: Stack, pool: str) -> bool:
    """The pool's last pass read every pod's gauges (these pods serve no traffic, so the rate-based signals are
    missing by design): each replica asks Prometheus for its own pools' pods by name."""
    status = stack.pool(pool).get("status", {})
    found = [c for c in status.get("conditions", []) if c["type"] == "MetricsAvailable"]
    rows = status.get("endpoints", [])
    gauges = bool(rows) and all(
        row.get("signals", {}).get("kvCacheUsage") is not None and row.get("signals", {}).get("queueLength") is not None
        for row in rows
    )
    return bool(found) and found[0]["status"] == "True" and gauges


def shard_holders(stack: Stack) -> dict[str, str | None]:
    api = k8s.CoordinationV1Api(load_api_client(str(stack.kubeconfig)))
    items = api.list_namespaced_lease("llm", label_selector="sluice.dev/shard-set=sluice").items
    return {x.metadata.name: x.spec.holder_identity for x in items if "-shard-" in x.metadata.name}


def test_replicas_share_the_pools_never_overlap_and_a_killed_one_is_replaced(shard_stack: Stack) -> None:
    stack = shard_stack
    processes = {name: sharded(stack, name) for name in "abc"}
    manifest = pool_manifest(stack)
    for pool in POOLS:
        stack.kubectl("apply", "-f", "-", stdin=manifest.replace("name: llama", f"name: {pool}", 1))
    wait_until(
        lambda: all(synced(stack, p) for p in POOLS),
        90,
        "every pool reconciled",
    )
    wait_until(lambda: len(set(shard_holders(stack).values()) - {None}) == 3, 30, "every replica holds a shard")
    time.sleep(6)  # passes with all three alive
    holders = shard_holders(stack)
    assert len(holders) == SHARDS
    assert all(holders.values()), holders

    # SIGKILL the replica holding the most pools while it is at work: just after a pool write of its own (a pass's
    # status or Istio write) reached the trail; at worst, after 20 s, wherever it is.
    pools_of = {
        h: [p for p in POOLS if holders[shard_lease_name("sluice", shard_of("llm", p, SHARDS), SHARDS)] == h]
        for h in set(holders.values())
    }
    victim_id = max(pools_of, key=lambda h: len(pools_of[h]))
    victim = processes[str(victim_id).removeprefix("replica-")]
    seen = len(audit_trail(stack))
    deadline, moment = time.monotonic() + 20, "20 s after the pools settled (no pool write of its own seen)"
    while time.monotonic() < deadline:
        fresh = audit_trail(stack)[seen:]
        seen += len(fresh)
        if any(e["resource"] != "leases" and e["verb"] == "patch" and operator_pid(e) == victim.pid for e in fresh):
            moment = "right after a pool write of its own"
            break
        time.sleep(0.1)
    os.killpg(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    time.sleep(0.5)  # the audit file catches up with what was answered before the kill
    kill_index = len(audit_trail(stack))
    orphaned = [lease for lease, h in holders.items() if h == victim_id]
    wait_until(
        lambda: all(shard_holders(stack)[lease] not in (None, victim_id) for lease in orphaned),
        30,
        f"the shards {orphaned} of the killed replica taken over",
        every=0.2,
    )
    took = time.monotonic() - killed_at  # reported below; the ~15 s bound is tested on a simulated clock above
    time.sleep(6)  # passes by the successors
    for pool in pools_of[victim_id]:
        assert synced(stack, pool)
    # Every pool's gauges read through the replicas' by-name queries, after the takeover too (the pools share
    # their pods here: this checks that the queries name them and real Prometheus answers, not how they split).
    wait_until(lambda: all(signals_read(stack, p) for p in POOLS), 30, "every pool's signals read")
    for process in processes.values():  # the survivors stop cleanly: their Leases cleared for a successor
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=20)
    assert all(h is None for h in shard_holders(stack).values())

    entries = audit_trail(stack)
    problems, writers = overlaps(entries)
    checked = sum(1 for e in entries if e.get("stage") == "ResponseComplete" and pool_written(e) and operator_pid(e))
    assert set(writers) == set(POOLS), "every pool's writes are in the trace"
    # Every replica holding a shard with pools wrote (a shard may hold none of the six pools).
    holding = {processes[str(h).removeprefix("replica-")].pid for h, pools in pools_of.items() if pools}
    assert holding <= set().union(*writers.values())
    # The successors ran the killed replica's pools: each one's pass reads the pool's Istio objects (a fresh
    # holder verifies them before it trusts them) and writes only what changed.
    after_kill = entries[kill_index:]
    for pool in pools_of[victim_id]:
        assert victim.pid in writers[pool], "the killed replica had written its pools"
        successors = {operator_pid(e) for e in after_kill if pool_written(e) == pool} - {None, victim.pid}
        assert successors, f"no other replica passed {pool} after the kill"
    assert problems == [], problems[:10]
    # Only lease verbs the chart grants, and every one it grants is used.
    used = {
        (e["group"], e["resource"], e["verb"])
        for e in audit_trail(stack)
        if e["resource"] == "leases" and operator_pid(e) is not None and e.get("stage") != "ResponseComplete"
    }
    granted = {r for r in rules_of(render({"shards": SHARDS, "replicas": 3})) if r[1] == "leases"}
    assert used == granted
    print(
        f"\nsharding: {len(POOLS)} pools, {SHARDS} shards, 3 replicas; {checked} pool writes checked against the "
        f"lease trail, none overlapping; replica {victim_id} SIGKILLed {moment}, its shards {orphaned} taken over "
        f"in {took:.1f}s"
    )


def test_the_trace_check_finds_a_write_after_another_replica_took_the_lease() -> None:
    lease = shard_lease_name("sluice", shard_of("llm", "pool-a", SHARDS), SHARDS)

    def entry(pid: int, resource: str, name: str) -> dict[str, str]:
        return {
            "stage": "ResponseComplete",
            "code": "200",
            "userAgent": f"sluice-operator/host-{pid} x",
            "resource": resource,
            "name": name,
            "verb": "update",
        }

    fine = [entry(1, "leases", lease), entry(1, "inferencepools", "pool-a"), entry(2, "leases", lease)]
    assert overlaps(fine)[0] == []
    late = [*fine, entry(1, "serviceentries", "sluice-pool-a")]
    assert len(overlaps(late)[0]) == 1
