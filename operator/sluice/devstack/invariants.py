"""Invariants of a run, checked over recorded evidence: pure functions, each returning the violations it found.

Local-stack tool (fault runs and their tests; never imported by the operator). The evidence is what
`sluice.devstack.recorder` records from the API server's watches (every version of every object, with the time
it was seen) and from its audit log; the checkers read nothing else and take no clock:
- `weight_after_deletion` (a): no ServiceEntry carries a pod's endpoint longer than one pass after the pod's
  deletion was seen (Istio has no weight 0: an endpoint listed is an endpoint weighted);
- `foreign_writes` (b): sluice never writes an object that is not its own (`sluice.istio.ownership`: labelled
  managed-by sluice or owned by the pool; an adopted object is one sluice was told to take over);
- `recreation_loops` (c): no object deleted and created again more than `limit` times within `window` seconds;
- `canary_regressions` (d): a pool's canary stepIndex never goes backwards without a rollback, an abort, a retry
  or a new candidate, never skips a step without a promotion, and is not lost mid-rollout;
- `writes_outside_terms` (e): no write by a replica to a shard's pool outside its term on the shard's Lease (its
  evidence read by `lease_records` from the Lease versions and by `audit_writes` from the audit entries).
Times are seconds on the recorder's clock (monotonic, one clock for all the evidence of a run).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from sluice.api.jsontypes import JsonObject, members, text
from sluice.core.shards import duration_of, role_of
from sluice.istio.kinds import ISTIO_KINDS
from sluice.istio.ownership import ownership


@dataclass(frozen=True)
class Version:
    """One version of an object as the watch delivered it."""

    at: float
    event: str
    """ADDED, MODIFIED or DELETED."""
    resource: str
    """The plural: serviceentries, destinationrules, inferencepools, pods, leases..."""
    name: str
    body: JsonObject


@dataclass(frozen=True)
class PodGone:
    """A pod's deletion as it was first seen (its deletionTimestamp set, or its DELETED event)."""

    pod: str
    ip: str
    at: float


@dataclass(frozen=True)
class Write:
    """A write a replica made (from the audit log, stamped when it was read) to a pool of a shard's Lease."""

    at: float
    writer: str
    """The replica's Lease holder identity."""
    lease: str
    subject: str
    """What was written, for the message (resource/name)."""


@dataclass(frozen=True)
class LeaseSeen:
    """One version of a shard Lease: its holder (None when released) and duration, seen at `at`."""

    at: float
    lease: str
    holder: str | None
    duration: float


@dataclass(frozen=True)
class Violation:
    invariant: str
    at: float
    subject: str
    detail: str

    def __str__(self) -> str:
        return f"{self.invariant} at {self.at:.2f}s: {self.subject}: {self.detail}"


def _key(version: Version) -> tuple[str, str, str]:
    return version.resource, text(version.body, "metadata", "namespace"), version.name


def _by_object(versions: Iterable[Version], resource: str | None = None) -> dict[tuple[str, str, str], list[Version]]:
    """Versions per object (resource, namespace, name), in the order seen."""
    found: dict[tuple[str, str, str], list[Version]] = {}
    for version in sorted(versions, key=lambda v: v.at):
        if resource is None or version.resource == resource:
            found.setdefault(_key(version), []).append(version)
    return found


# ------------------------------------------------------------------------------------ (a) weight after deletion


def weighted_endpoints(body: Mapping[str, object]) -> dict[str, int]:
    """Address -> weight of a ServiceEntry version (an endpoint without a weight counts as 1, as Istio reads it)."""
    listed = members(body, "spec").get("endpoints")
    found = {}
    for endpoint in listed if isinstance(listed, list) else []:
        weight = endpoint.get("weight", 1) if isinstance(endpoint, dict) else 1
        found[text(endpoint, "address")] = weight if isinstance(weight, int) else 1
    return found


def endpoint_addresses(body: Mapping[str, object]) -> set[str]:
    """The addresses a ServiceEntry routes to (its `spec.endpoints[].address`)."""
    return {address for address in weighted_endpoints(body) if address}


def _listed_at(history: Sequence[Version], ip: str, when: float) -> Version | None:
    """The version in effect at `when` when it lists `ip` (None when it does not, or nothing was written yet)."""
    current = None
    for version in history:
        if version.at > when:
            break
        current = version
    if current is None or current.event == "DELETED" or ip not in endpoint_addresses(current.body):
        return None
    return current


def pods_gone(versions: Iterable[Version]) -> list[PodGone]:
    """Each pod's deletion as first seen: the first version with a deletionTimestamp, or its DELETED event (with
    the address its last status gave)."""
    found: dict[str, PodGone] = {}
    for version in sorted(versions, key=lambda v: v.at):
        meta = members(version.body, "metadata")
        if version.resource != "pods" or version.name in found:
            continue
        if version.event == "DELETED" or meta.get("deletionTimestamp"):
            found[version.name] = PodGone(version.name, text(version.body, "status", "podIP"), version.at)
    return list(found.values())


def weight_after_deletion(versions: Iterable[Version], gone: Iterable[PodGone], one_pass: float) -> list[Violation]:
    """(a) A pod's endpoint still listed `one_pass` seconds after its deletion was seen, or listed again later."""
    entries = _by_object(versions, "serviceentries")
    violations = []
    for pod in gone:
        deadline = pod.at + one_pass
        for (_, _, name), history in entries.items():
            late = [
                v for v in history if v.at > deadline and v.event != "DELETED" and pod.ip in endpoint_addresses(v.body)
            ]
            still = _listed_at(history, pod.ip, deadline)
            if still is not None:
                late.insert(0, still)
            if late:
                after = late[-1].at - pod.at
                detail = f"pod {pod.pod} ({pod.ip}) still has an endpoint {after:.2f}s after its deletion was seen"
                violations.append(Violation("weight-after-deletion", deadline, f"serviceentries/{name}", detail))
    return violations


# ------------------------------------------------------------------------------------ (b) foreign writes


def _entries_of(body: Mapping[str, object], manager: str) -> list[str]:
    """The managedFields entries of `manager`, each as canonical JSON (so two versions compare)."""
    fields = members(body, "metadata").get("managedFields")
    listed = fields if isinstance(fields, list) else []
    return sorted(json.dumps(e, sort_keys=True) for e in listed if text(e, "manager") == manager)


ISTIO_PLURALS = frozenset(kind.plural for kind in ISTIO_KINDS.values())


def foreign_writes(
    versions: Iterable[Version], manager: str = "sluice", resources: frozenset[str] = ISTIO_PLURALS
) -> list[Violation]:
    """(b) A version that `manager` wrote (its managedFields entries changed) of an Istio object (of `resources`)
    that was foreign just before, unless the write adopted it (sluice's `adoptExisting`: the original kept in an
    annotation). The pools are not judged: sluice writes their status, and they are the user's.

    A write is told by the manager's entries changing; managedFields times have one-second resolution, so an
    apply of the very same fields within the second that changed nothing else is not seen (it wrote nothing)."""
    violations = []
    for (resource, namespace, name), history in _by_object(versions).items():
        if resource not in resources:
            continue
        for before, after in itertools.pairwise(history):
            if before.event == "DELETED" or after.event == "DELETED":
                continue
            if ownership(before.body, None) != "foreign":
                continue
            if _entries_of(before.body, manager) == _entries_of(after.body, manager):
                continue
            if ownership(after.body, None) == "adopted":
                continue
            detail = f"written by {manager} while it was not sluice's (no managed-by label, not adopted)"
            violations.append(Violation("foreign-write", after.at, f"{resource}/{namespace}/{name}", detail))
    return violations


# ------------------------------------------------------------------------------------ (c) re-creation loops


def recreation_loops(versions: Iterable[Version], limit: int, window: float) -> list[Violation]:
    """(c) An object created again after a deletion more than `limit` times within `window` seconds (one
    violation per object, at the re-creation that went over)."""
    violations = []
    for (resource, namespace, name), history in _by_object(versions).items():
        recreated, deleted = [], False
        for version in history:
            if version.event == "DELETED":
                deleted = True
            elif version.event == "ADDED" and deleted:
                recreated.append(version.at)
                deleted = False
        for index, at in enumerate(recreated):
            within = [t for t in recreated[: index + 1] if at - t <= window]
            if len(within) > limit:
                detail = f"deleted and created again {len(within)} times within {window:.0f}s (limit {limit})"
                violations.append(Violation("recreation-loop", at, f"{resource}/{namespace}/{name}", detail))
                break
    return violations


# ------------------------------------------------------------------------------------ (d) canary progress


@dataclass(frozen=True)
class CanaryRecord:
    """A pool's canary as one status version had it."""

    at: float
    pool: str
    phase: str
    step_index: int | None
    candidate: str | None
    operation: str
    """The last operation's id and op ("" when none): a new one explains a jump."""


def canary_records(versions: Iterable[Version]) -> list[CanaryRecord]:
    """The canary of every pool version (those with a canary status), in the order seen."""
    records = []
    for version in sorted(versions, key=lambda v: v.at):
        canary = members(version.body, "status", "canary")
        if version.resource != "inferencepools" or version.event == "DELETED" or not canary:
            continue
        index = canary.get("stepIndex")
        operation = members(canary, "lastOperation")
        records.append(
            CanaryRecord(
                at=version.at,
                pool=version.name,
                phase=text(canary, "phase"),
                step_index=index if isinstance(index, int) and not isinstance(index, bool) else None,
                candidate=text(canary, "candidateRevision") or None,
                operation=f"{text(operation, 'id')}:{text(operation, 'op')}" if operation else "",
            )
        )
    return records


RESTARTS = frozenset({"abort", "retry"})
LIVE_PHASES = frozenset({"Progressing", "Paused", "Waiting"})


def _regression(before: CanaryRecord, after: CanaryRecord) -> str | None:
    """Why going from `before` to `after` lost or repeated progress (None when it did not)."""
    if before.candidate != after.candidate:
        return None  # a new rollout starts over
    new_op = after.operation.split(":")[-1] if after.operation != before.operation else ""
    if before.step_index is not None and after.step_index is None:
        if after.phase in LIVE_PHASES and before.phase in LIVE_PHASES:
            return f"step {before.step_index} lost mid-rollout (phase {after.phase})"
        return None
    if before.step_index is None or after.step_index is None:
        return None
    if after.step_index < before.step_index:
        if "RolledBack" in (before.phase, after.phase) or new_op in RESTARTS:
            return None
        return f"stepIndex went back from {before.step_index} to {after.step_index} without a rollback"
    if after.step_index > before.step_index + 1 and after.phase != "Promoted" and new_op != "promote":
        return f"stepIndex jumped from {before.step_index} to {after.step_index} without a promotion"
    return None


def canary_regressions(records: Iterable[CanaryRecord]) -> list[Violation]:
    """(d) Each pool's stepIndex sequence, read pairwise: backwards only by a rollback, an abort or a retry (or a
    new candidate), forwards one step at a time unless promoted, never dropped while the rollout is live."""
    by_pool: dict[str, list[CanaryRecord]] = {}
    for record in sorted(records, key=lambda r: r.at):
        by_pool.setdefault(record.pool, []).append(record)
    violations = []
    for pool, history in by_pool.items():
        for before, after in itertools.pairwise(history):
            why = _regression(before, after)
            if why is not None:
                violations.append(Violation("canary-progress", after.at, f"inferencepools/{pool}", why))
    return violations


# ------------------------------------------------------------------------------------ (e) shard terms


def lease_records(versions: Iterable[Version]) -> list[LeaseSeen]:
    """Every version of a shard Lease (`sluice.core.shards`' role label "shard"): each one a renewal, a take-over
    or a release."""
    records = []
    for version in sorted(versions, key=lambda v: v.at):
        if version.resource != "leases" or version.event == "DELETED" or role_of(version.body) != "shard":
            continue
        holder = text(version.body, "spec", "holderIdentity") or None
        records.append(LeaseSeen(version.at, version.name, holder, duration_of(version.body, 15.0)))
    return records


WRITE_VERBS = frozenset({"create", "update", "patch", "delete"})


def audit_writes(
    audit: Iterable[tuple[float, Mapping[str, object]]],
    holders: Iterable[str],
    lease_of: Callable[[str, str], str | None],
    identities: Mapping[str, str] | None = None,
) -> list[Write]:
    """The operator's answered writes (ResponseComplete entries of `sluice-operator/<host>-<pid>` user agents),
    each with the holder identity of its process (`<host>-<pid>-<tag>`, or what `identities` maps `<host>-<pid>`
    to: replicas started with `--identity`) and the Lease `lease_of(resource, name)` names for what it wrote
    (None: not a shard's object, e.g. the Leases themselves or Events)."""
    known = sorted(set(holders))
    named = identities or {}
    writes = []
    for at, entry in audit:
        agent = text(entry, "userAgent").split(" ")[0]
        if text(entry, "stage") != "ResponseComplete" or text(entry, "verb") not in WRITE_VERBS:
            continue
        if not agent.startswith("sluice-operator/") or not text(entry, "code").startswith("2"):
            continue
        process = agent.split("/", 1)[1]
        writer = named.get(process) or next((h for h in known if h.startswith(process + "-")), process)
        resource, name = text(entry, "resource"), text(entry, "name")
        lease = lease_of(resource, name)
        if lease is not None:
            writes.append(Write(at, writer, lease, f"{resource}/{name}"))
    return writes


def writes_outside_terms(writes: Iterable[Write], leases: Iterable[LeaseSeen], slack: float = 0.0) -> list[Violation]:
    """(e) A write by a replica when the last version of its shard's Lease seen before it names another holder
    (or none), or was renewed longer than its duration (plus `slack`, the recorder's stamping delay) ago.

    The term is judged on the evidence's clock, as another replica would: a Lease not renewed for its duration
    is expired, whatever its holder believes."""
    by_lease: dict[str, list[LeaseSeen]] = {}
    for seen in sorted(leases, key=lambda s: s.at):
        by_lease.setdefault(seen.lease, []).append(seen)
    violations = []
    for write in sorted(writes, key=lambda w: w.at):
        before = [s for s in by_lease.get(write.lease, []) if s.at <= write.at]
        last = before[-1] if before else None
        if last is None or last.holder != write.writer:
            holder = "nobody" if last is None or last.holder is None else last.holder
            detail = f"written by {write.writer} while {write.lease} was held by {holder}"
        elif write.at - last.at > last.duration + slack:
            late = write.at - last.at - last.duration
            detail = f"written by {write.writer} {late:.2f}s after its term on {write.lease} ended"
        else:
            continue
        violations.append(Violation("write-outside-term", write.at, write.subject, detail))
    return violations


__all__ = [
    "CanaryRecord",
    "LeaseSeen",
    "PodGone",
    "Version",
    "Violation",
    "Write",
    "audit_writes",
    "canary_records",
    "canary_regressions",
    "endpoint_addresses",
    "foreign_writes",
    "lease_records",
    "pods_gone",
    "recreation_loops",
    "weight_after_deletion",
    "weighted_endpoints",
    "writes_outside_terms",
]
