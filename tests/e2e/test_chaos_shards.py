"""The sharded chaos scene's bounded form (`python -m sluice.devstack.chaos --sharded --fast`): two replicas with
`--shards`, each through its own TCP proxy; the replica holding the canary's shard is partitioned from the API
server. Asserted, from the recorded evidence: its shards were taken over by the other replica during the partition
and shared evenly again after it, and every invariant held, (e) no write outside a shard term among them, judged
over writes of both replicas. The times are reported by `make chaos-shards`, not asserted here. The same scene with
the partitioned replica's fence removed, in which (e) must find its writes: `test_broken_operator_shards.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.devstack.chaosshards import CASES, SHARDS, run
from sluice.devstack.invariants import Version, lease_records
from sluice.devstack.shardevidence import balanced_at, hand_overs

pytestmark = pytest.mark.slow


def test_a_partitioned_replicas_shards_are_taken_over_and_no_write_leaves_a_shard_term(tmp_path: Path) -> None:
    (result,) = run(tmp_path / "stack", fast=True)
    assert result.name == next(c.name for c in CASES if c.fast)
    broken = {k: v for k, v in result.violations.items() if v}
    assert broken == {}
    assert "e" in result.violations
    assert result.served["connections left hanging"] > 0
    evidence = [Version(**json.loads(line)) for line in (tmp_path / "evidence.jsonl").read_text().splitlines()]
    records = lease_records(evidence)
    started, cleared, _ = result.window
    target = next(line for line in result.observed if line.startswith("acted on ")).removeprefix("acted on ")
    taken = [h for h in hand_overs(records) if started <= h.at < cleared and h.before == target]
    assert len(taken) == SHARDS // 2, "the partitioned replica's shards went to the other one"
    assert all(h.after not in (None, target) for h in taken)
    assert balanced_at(records, ["replica-a", "replica-b"], SHARDS, cleared) is not None
