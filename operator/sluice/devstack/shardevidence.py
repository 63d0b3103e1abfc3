"""What a sharded chaos case did, read from its evidence: who held each shard Lease and when it changed hands,
when the replicas were back to an even share, the clock a replica stamps its Leases with against the evidence's,
invariant (e) over the Lease versions and the audit log, and the replicas' own log of their shard transitions.
Pure functions, no clock.

Local-stack tool, called by `sluice.devstack.chaosshards`. The evidence is `sluice.devstack.recorder`'s: Lease
versions and audit entries stamped with the recorder's monotonic clock (`at`); `wall_minus_mono` converts it to
the runner's wall clock, which is the API emulator's (one machine), when a replica's `renewTime` is compared with
it.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from sluice.api.jsontypes import JsonObject
from sluice.core.shards import holder_of, role_of, shard_lease_name, shard_of
from sluice.devstack.invariants import LeaseSeen, Version, audit_writes, lease_records, writes_outside_terms


def spread_pools(namespace: str, shards: int, per_shard: int = 1, prefix: str = "pool") -> list[str]:
    """Pool names (`prefix-N`, N from 0) chosen so that every shard gets `per_shard` of them: each replica of a
    sharded scene then holds pools, whichever shards it takes."""
    names: list[str] = []
    counts = dict.fromkeys(range(shards), 0)
    index = 0
    while any(n < per_shard for n in counts.values()):
        name = f"{prefix}-{index}"
        shard = shard_of(namespace, name, shards)
        if counts[shard] < per_shard:
            counts[shard] += 1
            names.append(name)
        index += 1
    return names


def pool_written(resource: str, name: str, pools: Iterable[str]) -> str | None:
    """The pool a write is for: its status (inferencepools/<pool>), its Events (<pool>.<id>), its Istio objects
    (sluice-<pool>[-...]); None for anything else (the Leases themselves)."""
    for pool in pools:
        if resource == "inferencepools" and name == pool:
            return pool
        if resource == "events" and name.split(".", 1)[0] == pool:
            return pool
        if resource not in ("inferencepools", "events", "leases") and (
            name == f"sluice-{pool}" or name.startswith(f"sluice-{pool}-")
        ):
            return pool
    return None


def lease_of_pool(
    namespace: str, pools: Sequence[str], shards: int, prefix: str = "sluice"
) -> Callable[[str, str], str | None]:
    """`lease_of(resource, name)` for `audit_writes`: the shard Lease of the pool a write is for."""

    def lease_of(resource: str, name: str) -> str | None:
        pool = pool_written(resource, name, pools)
        return None if pool is None else shard_lease_name(prefix, shard_of(namespace, pool, shards), shards)

    return lease_of


@dataclass(frozen=True)
class HandOver:
    at: float
    lease: str
    before: str | None
    after: str | None


def hand_overs(records: Iterable[LeaseSeen]) -> list[HandOver]:
    """Every change of holder of a shard Lease (a release to nobody included), in order."""
    last: dict[str, str | None] = {}
    found = []
    for seen in sorted(records, key=lambda s: s.at):
        if seen.lease in last and last[seen.lease] != seen.holder:
            found.append(HandOver(seen.at, seen.lease, last[seen.lease], seen.holder))
        last[seen.lease] = seen.holder
    return found


def holders_at(records: Iterable[LeaseSeen], when: float) -> dict[str, str | None]:
    """Shard Lease -> its holder in the last version seen at or before `when`."""
    held: dict[str, str | None] = {}
    for seen in sorted(records, key=lambda s: s.at):
        if seen.at <= when:
            held[seen.lease] = seen.holder
    return held


def balanced_at(records: Iterable[LeaseSeen], replicas: Sequence[str], shards: int, since: float) -> float | None:
    """The first moment at or after `since` at which every shard Lease is held and each of `replicas` holds an
    even share (shards // replicas, the remainder one more at most), read from the Lease versions; None if never."""
    ordered = sorted(records, key=lambda s: s.at)
    floor = shards // len(replicas)
    moments = [since, *(s.at for s in ordered if s.at > since)]
    for moment in moments:
        held = holders_at(ordered, moment)
        counts = Counter(h for h in held.values() if h)
        if len(held) == shards and all(held.values()) and all(floor <= counts[r] <= floor + 1 for r in replicas):
            return moment
    return None


def renew_offsets(
    versions: Iterable[Version], holder: str, wall_minus_mono: float, since: float, until: float
) -> list[float]:
    """For each version of a Lease (shard or member) held by `holder` seen in [`since`, `until`]: its `renewTime`
    (the holder's wall clock when it wrote it) minus the moment the recorder saw it, on the runner's wall clock.
    A replica whose clock agrees with the runner's reads a little under 0 (the watch's delivery); one shifted by
    S seconds reads S less that."""
    offsets = []
    for version in sorted(versions, key=lambda v: v.at):
        if version.resource != "leases" or not since <= version.at <= until or version.event == "DELETED":
            continue
        if holder_of(version.body) != holder or role_of(version.body) not in ("shard", "member"):
            continue
        stamp = _renew_time(version.body)
        if stamp is not None:
            offsets.append(stamp - (version.at + wall_minus_mono))
    return offsets


def _renew_time(body: JsonObject) -> float | None:
    spec = body.get("spec")
    value = spec.get("renewTime") if isinstance(spec, dict) else None
    if not isinstance(value, str):
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def median_offset(offsets: Sequence[float]) -> str:
    """`+29.98 s (n=9, -0.01..+30.00)`, or `none seen`."""
    if not offsets:
        return "none seen"
    return f"{statistics.median(offsets):+.2f} s (n={len(offsets)}, {min(offsets):+.2f}..{max(offsets):+.2f})"


def term_violations(
    versions: Sequence[Version],
    audit: Sequence[tuple[float, JsonObject]],
    identities: Mapping[str, str],
    lease_of: Callable[[str, str], str | None],
    since: float,
    until: float,
    slack: float,
) -> tuple[list[str], int]:
    """(e) over a case: the operator's answered writes to the pools in [`since`, `until`) each judged against the
    Lease versions seen before it (`writes_outside_terms`, with `slack` for the recorder's stamping of the audit
    file); the violations, and how many writes were judged."""
    leases = [s for s in lease_records(versions) if s.at < until]
    writes = [
        w
        for w in audit_writes([(at, e) for at, e in audit if at < until], identities.values(), lease_of, identities)
        if since <= w.at < until
    ]
    return [str(v) for v in writes_outside_terms(writes, leases, slack)], len(writes)


SHARD_LINE = re.compile(r"shard (\d+)/(\d+) (.+?) by (\S+)\s*$")


def shard_transitions(log: str) -> Counter[tuple[str, str]]:
    """(identity, what) -> count of the shard transitions a replica logged (`sluice.runtime.sharding`: `shard
    I/N acquired by ID`, `... lost (lapsed without a renewal) by ID`, `releasing`, `released`)."""
    found: Counter[tuple[str, str]] = Counter()
    for line in log.splitlines():
        match = SHARD_LINE.search(line)
        if match:
            found[(match.group(4), match.group(3))] += 1
    return found


def merged_readings(readings: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Several replicas' /metrics as one: counters added, `sluice_last_pass_timestamp_seconds` the latest (a pool
    passed by either replica)."""
    merged: dict[str, float] = {}
    for reading in readings:
        for key, value in reading.items():
            if key.startswith("sluice_last_pass_timestamp_seconds"):
                merged[key] = max(merged.get(key, value), value)
            else:
                merged[key] = merged.get(key, 0.0) + value
    return merged


__all__ = [
    "HandOver",
    "balanced_at",
    "hand_overs",
    "holders_at",
    "lease_of_pool",
    "median_offset",
    "merged_readings",
    "pool_written",
    "renew_offsets",
    "shard_transitions",
    "spread_pools",
    "term_violations",
]
