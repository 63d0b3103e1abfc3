"""Invariant (e), no write by a replica to a shard's pool outside its term on the shard's Lease, finds a replica
whose write fence was removed: the sharded chaos scene's partition (`sluice.devstack.chaosshards`, as
`test_chaos_shards.py` runs it) with replica `a` run by `tests.e2e.broken_operator fence-removed` (a pass's writes
go whatever the term, with no timeout) and partitioned from the API server until replica `b` holds every shard.
The writes `a`'s passes sent during the partition, before its shards lapsed on its own clock, wait on the partitioned
connections; on the heal they land while `b` holds the shards, and the passes go on writing. `writes_outside_terms`
must find them, each naming `a`, the Lease `b` held and a pool of a shard `b` took over from `a`. The control, the
same scene with the real operator, whose fence withholds those writes and gives them up with the Lease's validity,
is `test_chaos_shards.py`: no violation. Bounded as that one is (the stack's deadline, the case's hold).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from sluice.core.shards import shard_lease_name, shard_of
from sluice.devstack.chaosshards import NAMESPACE, POOLS, SHARDS, TERM_SLACK, run
from sluice.devstack.invariants import Version, lease_records
from sluice.devstack.shardevidence import hand_overs, pool_written

pytestmark = pytest.mark.slow
BROKEN = [sys.executable, "-m", "tests.e2e.broken_operator", "fence-removed"]
OUTSIDE = re.compile(
    r"write-outside-term at (?P<at>[\d.]+)s: (?P<resource>[^/]+)/(?P<name>\S+): "
    r"written by (?P<writer>\S+) while (?P<lease>\S+) was held by (?P<holder>\S+)"
)


def lease_of(pool: str) -> str:
    return shard_lease_name("sluice", shard_of(NAMESPACE, pool, SHARDS), SHARDS)


def test_writes_of_a_replica_without_its_fence_that_land_outside_its_term_are_found(tmp_path: Path) -> None:
    (result,) = run(tmp_path / "stack", fast=True, broken=BROKEN)
    assert "acted on replica-a" in result.observed
    evidence = [Version(**json.loads(line)) for line in (tmp_path / "evidence.jsonl").read_text().splitlines()]
    started, cleared, _ = result.window
    taken = {
        h.lease for h in hand_overs(lease_records(evidence)) if started <= h.at < cleared and h.before == "replica-a"
    }
    assert len(taken) == SHARDS // 2, "replica-b took replica-a's shards over during the partition"
    outside = result.violations["e"]
    assert outside, "(e) found no write of replica-a outside its term"
    print(f"\n(e) found {len(outside)} writes outside replica-a's terms, relative to the heal:")
    found = [OUTSIDE.fullmatch(v) for v in outside]
    assert all(found), outside
    for match in filter(None, found):
        pool = pool_written(match["resource"], match["name"], POOLS)
        assert (match["writer"], match["holder"]) == ("replica-a", "replica-b"), match.string
        assert pool is not None, match.string
        assert match["lease"] == lease_of(pool), match.string
        assert match["lease"] in taken, match.string
        print(f"  {float(match['at']) - cleared:+.2f} s {match['resource']}/{match['name']} ({match['lease']})")
        assert float(match["at"]) >= cleared - TERM_SLACK, f"landed before the heal: {match.string}"
