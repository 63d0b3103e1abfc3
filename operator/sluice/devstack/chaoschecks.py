"""What one fault case of a chaos run did, read from the recorded evidence: the invariants, the weights kept while
the control plane was blind, and the conditions the pools showed. Pure functions, no clock.

Local-stack tool, called by `sluice.devstack.chaos` once per case. The evidence is the whole run's
(`sluice.devstack.recorder`: every watched version with the time it was seen); a case is the window
[`started`, `ended`) on the same clock. The checkers of `sluice.devstack.invariants` read the evidence up to the
window's end (a pairwise check needs the version before the window), and a violation counts for the case in whose
window it happened:
- (a) `weight_after_deletion`, over the pods whose deletion was seen in the window;
- (b) `foreign_writes`; (c) `recreation_loops` (more than `RECREATION_LIMIT` re-creations within 60 s);
- (d) `canary_regressions`;
- (f) `weights_kept`: while the control plane was blind, every ServiceEntry version keeps the endpoints and
  weights of the version in effect before it went blind, but for the endpoints of pods deleted meanwhile. A pool
  is blind when the evidence shows it: `blind_spans` reads the pool's MetricsAvailable=False stretches. A pass
  publishes the ServiceEntry before it writes the pool's status, so a blind stretch is judged from the last
  status version that was not blind (its pass's ServiceEntry is the reference) to the last blind status version
  (the ServiceEntry versions up to it were written by blind passes); a stretch not over when the case ends is
  judged to the case's end. With no operator running (`Window.operator_down`) the span is the fault's: there is no
  writer, so that span holds no version by construction and the report says how many versions each check judged.
(e) (no write outside a shard term) needs sharded replicas: the single-replica run has no terms to judge; the
sharded scene (`sluice.devstack.chaosshards`) judges it with `sluice.devstack.shardevidence`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from sluice.api.jsontypes import JsonObject, members, text
from sluice.devstack.invariants import (
    PodGone,
    Version,
    Violation,
    canary_records,
    canary_regressions,
    foreign_writes,
    pods_gone,
    recreation_loops,
    weight_after_deletion,
    weighted_endpoints,
)

RECREATION_LIMIT = 2
"""Re-creations of one object allowed within a minute: another writer deleting it once is answered by one."""
RECREATION_WINDOW = 60.0
INVARIANTS = {
    "a": "no weight to a pod gone longer than one pass",
    "b": "no foreign object written",
    "c": "nothing re-created in a loop",
    "d": "no canary progress lost or repeated",
    "f": "last weights kept while blind",
}
SHARDED_INVARIANTS = {"e": "no write outside a shard term"}
"""Judged in the sharded scene only (`sluice.devstack.chaosshards`): the single-replica run has no shard terms."""


@dataclass(frozen=True)
class Window:
    """A case on the evidence's clock: the fault from `started` to `cleared`, the run judged until `ended`.
    `operator_down`: no operator ran from `started` to `cleared` (the control plane blind throughout)."""

    started: float
    cleared: float
    ended: float
    operator_down: bool = False


@dataclass(frozen=True)
class Judged:
    """What (f) judged for one case: the violations, and pool -> ServiceEntry versions judged."""

    violations: list[Violation]
    versions: dict[str, int]


def weights_kept(
    versions: Iterable[Version], entry: str, since: float, until: float, gone: Iterable[PodGone]
) -> tuple[list[Violation], int]:
    """(f) Each version of the ServiceEntry `entry` seen in (`since`, `until`] against the one in effect at
    `since`: the same addresses with the same weights, but for the addresses of pods deleted meanwhile. Returns
    the violations and how many versions were judged."""
    history = sorted((v for v in versions if v.resource == "serviceentries" and v.name == entry), key=lambda v: v.at)
    before = [v for v in history if v.at <= since]
    if not before:
        return [], 0
    reference = weighted_endpoints(before[-1].body)
    dropped = {g.ip for g in gone if g.at <= until}
    judged = [v for v in history if since < v.at <= until]
    violations = []
    for version in judged:
        if version.event == "DELETED":
            detail = "deleted while the control plane was blind"
        else:
            now = weighted_endpoints(version.body)
            kept = {a: w for a, w in reference.items() if a not in dropped}
            if {a: w for a, w in now.items() if a not in dropped} == kept:
                continue
            detail = f"weights changed while blind: {_changes(kept, now)}"
        violations.append(Violation("weights-kept", version.at, f"serviceentries/{entry}", detail))
    return violations, len(judged)


def blind_spans(versions: Iterable[Version], pool: str, since: float, until: float) -> list[tuple[float, float]]:
    """The stretches in which the pool showed MetricsAvailable=False, for each one that began in [`since`,
    `until`]: (the last status version before it that was not blind, the last blind status version of the
    stretch; `until` when the stretch had not ended by then). A stretch with no earlier status is left out."""
    history = sorted((v for v in versions if v.resource == "inferencepools" and v.name == pool), key=lambda v: v.at)
    spans = []
    sighted: float | None = None  # the last status version that was not blind
    last_blind: float | None = None  # the stretch's last blind version, while a stretch that counts lasts
    blind = counts = False
    for version in (v for v in history if v.at <= until):
        if condition_states(version.body).get("MetricsAvailable", ("", ""))[0] == "False":
            if not blind:
                blind = True
                counts = sighted is not None and version.at >= since
            last_blind = version.at if counts else None
            continue
        if blind and sighted is not None and last_blind is not None:
            spans.append((sighted, last_blind))
        sighted, last_blind, blind = version.at, None, False
    if blind and sighted is not None and last_blind is not None:
        spans.append((sighted, until))
    return spans


def _changes(before: Mapping[str, int], after: Mapping[str, int]) -> str:
    keys = sorted(set(before) | set(after))
    return ", ".join(f"{k} {before.get(k, '-')}->{after.get(k, '-')}" for k in keys if before.get(k) != after.get(k))


def weights_kept_while_blind(versions: Sequence[Version], window: Window, entries: Mapping[str, str]) -> Judged:
    """(f) over a case: for each pool (`entries` maps it to its ServiceEntry's name), every blind span of the
    evidence that began in the case's window, and the fault's span when no operator ran."""
    gone = pods_gone(versions)
    found: list[Violation] = []
    counted: dict[str, int] = {}
    for pool, entry in entries.items():
        spans = blind_spans(versions, pool, window.started, window.ended)
        if window.operator_down:
            spans.append((window.started, window.cleared))
        for since, until in spans:
            violations, judged = weights_kept(versions, entry, since, until, gone)
            found += violations
            counted[pool] = counted.get(pool, 0) + judged
    return Judged(found, counted)


def condition_states(body: Mapping[str, object]) -> dict[str, tuple[str, str]]:
    """Condition type -> (status, reason) of one pool version."""
    listed = members(body, "status").get("conditions")
    return {
        text(c, "type"): (text(c, "status"), text(c, "reason")) for c in (listed if isinstance(listed, list) else [])
    }


def conditions_seen(
    versions: Iterable[Version], pool: str, baseline: Mapping[str, tuple[str, str]], since: float, until: float
) -> list[str]:
    """The condition states the pool showed in [`since`, `until`] that differ from its `baseline`, in the order
    first seen, as `Type=Status (Reason)`."""
    seen: list[str] = []
    for version in sorted(versions, key=lambda v: v.at):
        if version.resource != "inferencepools" or version.name != pool or not since <= version.at <= until:
            continue
        for kind, (status, reason) in condition_states(version.body).items():
            label = f"{kind}={status} ({reason})"
            if baseline.get(kind) != (status, reason) and label not in seen:
                seen.append(label)
    return seen


def case_violations(
    versions: Sequence[Version], window: Window, entries: Mapping[str, str], one_pass: float
) -> tuple[dict[str, list[str]], dict[str, int]]:
    """Invariant letter -> the violations of the case (empty lists: held), and pool -> the ServiceEntry versions
    (f) judged. `entries` maps each pool to its ServiceEntry's name; (f) is judged only when the evidence shows a
    pool blind in the window, or no operator ran."""
    upto = [v for v in versions if v.at < window.ended]
    gone = [g for g in pods_gone(upto) if window.started <= g.at < window.ended]

    def inside(found: Iterable[Violation]) -> list[str]:
        return [str(v) for v in found if window.started <= v.at < window.ended]

    found = {
        "a": inside(weight_after_deletion(upto, gone, one_pass)),
        "b": inside(foreign_writes(upto)),
        "c": inside(recreation_loops(upto, RECREATION_LIMIT, RECREATION_WINDOW)),
        "d": inside(canary_regressions(canary_records(upto))),
    }
    judged = weights_kept_while_blind(upto, window, entries)
    if judged.versions:
        found["f"] = [str(v) for v in judged.violations]
    return found, judged.versions


def canary_changes(versions: Iterable[Version], pool: str, since: float, until: float, origin: float) -> list[str]:
    """The pool's canary each time it changed in (`since`, `until`], as `state at +S s` (seconds from `origin`,
    the fault's start), so a step taken while the fault lasted is seen as such."""
    changes: list[str] = []
    last = ""
    for version in sorted(versions, key=lambda v: v.at):
        if version.resource != "inferencepools" or version.name != pool or version.at > until:
            continue
        state = canary_state(version.body)
        if state != last and version.at > since and last:
            changes.append(f"{state} at {version.at - origin:+.1f} s")
        last = state
    return changes


def canary_state(body: JsonObject) -> str:
    """A pool version's canary as `phase step N (W%)` ("" without a canary)."""
    canary = members(body, "status", "canary")
    if not canary:
        return ""
    return f"{text(canary, 'phase')} step {canary.get('stepIndex')} ({canary.get('weight')}%)"


__all__ = [
    "INVARIANTS",
    "RECREATION_LIMIT",
    "SHARDED_INVARIANTS",
    "Judged",
    "Window",
    "blind_spans",
    "canary_changes",
    "canary_state",
    "case_violations",
    "condition_states",
    "conditions_seen",
    "weights_kept",
    "weights_kept_while_blind",
]
