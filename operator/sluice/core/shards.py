"""Sharding: which shard a pool belongs to, what a replica should do with the shard Leases it sees, and when a
pass's write may go. Pure.

Pools are split into `shards` by a stable hash of `namespace/name` (SHA-256, so every replica and every Python
process agrees; Python's own `hash` is salted per process). Each shard is owned through a
`coordination.k8s.io/v1` Lease (written as `lease_body` says, read with `lease_view` and its readers); the I/O
is `sluice.runtime.sharding`. The rules, as client-go's leader election has them, per shard:
- a Lease is expired when its record (holder, resourceVersion) has not changed for `leaseDurationSeconds` as
  observed by this replica's own monotonic clock (no trust in other clocks); a released Lease (no holder) is
  free at once;
- a replica takes at most its fair share, ceil(shards / live replicas), live replicas being those whose member
  Lease changed within its duration; over its share it releases the surplus; candidates are tried in an order
  hashed from the replica's identity, so replicas starting together go for different shards;
- a replica acts on a shard only while `now < renewal sent + duration - margin`: it stops writing before any
  other replica can consider the Lease expired; a pass's writes go only while the shard is held in the term the
  pass began in (`Fence`).
A pool's daemon follows its shard from pass to pass (`next_turn`, `after_pass`): it idles while the shard is not
held here, forgets what it remembered of the pool when the shard comes back or returns in a new term, and counts a
pass during which the shard went away as lost.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime

from sluice.api.jsontypes import JsonObject, members, text

SHARD_LABEL = "sluice.dev/shard-set"
ROLE_LABEL = "sluice.dev/lease-role"


def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def shard_of(namespace: str, name: str, shards: int) -> int:
    """The shard of a pool: the same on every replica, in every process, for a given shard count."""
    if shards < 1:
        raise ValueError("shards must be at least 1")
    return stable_hash(f"{namespace}/{name}") % shards


def shard_lease_name(prefix: str, index: int, shards: int) -> str:
    """The count is in the name: replicas run with different counts never share a Lease by accident."""
    return f"{prefix}-shard-{index}-of-{shards}"


def member_lease_name(prefix: str, identity: str) -> str:
    digest = hashlib.sha256(identity.encode()).hexdigest()[:10]
    return f"{prefix}-member-{digest}"


def fair_share(shards: int, live_replicas: int) -> int:
    return -(-shards // max(1, live_replicas))


def preference(identity: str, shards: int) -> list[int]:
    """The order in which a replica tries the shards (rendezvous hashing on its identity)."""
    return sorted(range(shards), key=lambda i: stable_hash(f"{identity}/{i}"))


@dataclass(frozen=True)
class LeaseView:
    """A shard Lease as this replica last listed it."""

    holder: str | None
    resource_version: str
    duration: float
    unchanged_for: float
    """Seconds since this replica first saw the record (holder, resourceVersion) as it is now."""

    def free_for(self, identity: str) -> bool:
        """May `identity` take it: released, its own record, or expired (its holder stopped renewing)."""
        if not self.holder or self.holder == identity:
            return True
        return self.unchanged_for >= self.duration


def micro_time(now: datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_body(
    namespace: str,
    prefix: str,
    name: str,
    role: str,
    holder: str | None,
    version: str | None,
    duration: int,
    stamp: str,
    acquired: bool,
) -> JsonObject:
    """A Lease of the shard set `prefix` as written: `holder` None clears it; `version` None creates it."""
    spec: JsonObject = {"holderIdentity": holder, "leaseDurationSeconds": duration}
    if holder:
        spec["renewTime"] = stamp
        if acquired:
            spec["acquireTime"] = stamp
    meta: JsonObject = {"name": name, "namespace": namespace, "labels": {SHARD_LABEL: prefix, ROLE_LABEL: role}}
    if version is not None:
        meta["resourceVersion"] = version
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}


def holder_of(lease: Mapping[str, object] | None) -> str | None:
    found = members(lease, "spec").get("holderIdentity")
    return found if isinstance(found, str) else None


def version_of(lease: Mapping[str, object]) -> str:
    return text(lease, "metadata", "resourceVersion")


def role_of(lease: Mapping[str, object]) -> str:
    return text(lease, "metadata", "labels", ROLE_LABEL)


def duration_of(lease: Mapping[str, object], default: float) -> float:
    seconds = members(lease, "spec").get("leaseDurationSeconds")
    return float(seconds) if isinstance(seconds, int | float) and seconds else default


def lease_view(lease: Mapping[str, object], default_duration: float, unchanged_for: float) -> LeaseView:
    return LeaseView(
        holder=holder_of(lease) or None,
        resource_version=version_of(lease),
        duration=duration_of(lease, default_duration),
        unchanged_for=unchanged_for,
    )


@dataclass(frozen=True)
class Decision:
    acquire: list[int] = field(default_factory=list)
    """Shards to take: create their Lease (None in `leases`) or update it with the listed resourceVersion."""
    release: list[int] = field(default_factory=list)
    """Held shards over the fair share: stop acting now, give the Lease up after the fencing margin."""


def decide(
    identity: str,
    shards: int,
    held: set[int],
    leases: dict[int, LeaseView | None],
    live_replicas: int,
    others: dict[str, int] | None = None,
) -> Decision:
    """What to acquire and release this tick (renewing held shards is the caller's routine).

    `others`: the other live replicas and how many shards each holds. A replica over the floor share gives one
    shard up while another holds less than the floor (4 shards, 3 replicas: 2-1-1, never 2-2-0)."""
    share = fair_share(shards, live_replicas)
    order = preference(identity, shards)
    if len(held) > share:
        surplus = [i for i in reversed(order) if i in held][: len(held) - share]
        return Decision(release=surplus)
    floor = shards // max(1, live_replicas)
    if len(held) > floor and any(count < floor for count in (others or {}).values()):
        return Decision(release=[next(i for i in reversed(order) if i in held)])
    wanted = share - len(held)
    candidates = [i for i in order if i not in held and (leases.get(i) is None or _free(leases[i], identity))]
    return Decision(acquire=candidates[:wanted])


def _free(view: LeaseView | None, identity: str) -> bool:
    return view is None or view.free_for(identity)


@dataclass(frozen=True)
class Tenure:
    """A shard as this replica holds it: the term it was taken in (a number never reused) and until when this
    replica may act on it (`renewal sent + duration - margin`, monotonic seconds)."""

    term: int
    valid_until: float


@dataclass(frozen=True)
class Fence:
    """The write fence of one pass: its pool's shard and the term in which the pass began (None: not held then).
    A pass that outlives its term writes nothing more, even once its replica has taken the shard back."""

    shard: int
    term: int | None

    def deadline(self, held: Tenure | None, now: float) -> float | None:
        """May a write go `now`: the seconds it may take (what is left of the validity, its request timeout), or
        None when it may not. `held`: the shard's tenure now (None: not held, being given up, or the fence closed
        for good)."""
        if self.term is None or held is None or held.term != self.term or now >= held.valid_until:
            return None
        return held.valid_until - now


@dataclass(frozen=True)
class PoolTurn:
    """What a pool's daemon knows of its shard between passes: whether it idles (the shard is not held here) and
    the term of its last pass. A term is taken anew at each acquisition, so a term that differs from the last
    pass's means the shard was lost and taken back meanwhile."""

    idle: bool = False
    seen: int | None = None


@dataclass(frozen=True)
class TurnStep:
    turn: PoolTurn
    pass_now: bool
    """Pass now (else idle: check again in a second, or when a shard taken wakes the pool)."""
    forget_gauges: bool = False
    """Going idle: the pool's freshness, lag and weights are the new owner's to say, not stale ones here."""
    resume: bool = False
    """The shard came back, or was lost and taken again since the last pass: what this process remembers of the
    pool may be stale (forget it, read the cluster again) and the pass is due from now (idling is not lag)."""


def next_turn(turn: PoolTurn, sharded: bool, term: int | None) -> TurnStep:
    """Before a pass: `term` is the pool's shard's term now (None: not held here; always None unsharded)."""
    if sharded and term is None:
        return TurnStep(PoolTurn(idle=True, seen=turn.seen), pass_now=False, forget_gauges=not turn.idle)
    resume = turn.idle or (turn.seen is not None and term != turn.seen)
    return TurnStep(PoolTurn(idle=False, seen=term), pass_now=True, resume=resume)


def after_pass(turn: PoolTurn, sharded: bool, term_now: int | None) -> tuple[PoolTurn, bool]:
    """After a pass begun in `turn.seen`: whether the shard went away during it (its writes were fenced; what it
    saw is not this replica's to report), and the turn that follows (idle if so)."""
    lost = sharded and term_now != turn.seen
    return (replace(turn, idle=True) if lost else turn), lost
