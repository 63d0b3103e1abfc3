"""What a live step and the shadow share in a canary pass: the rollout as the pass sees it, the split actually
published (forced to one side when the other has no healthy routable pod), the check round, and the one builder
of the next status. Pure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

from sluice.api.v1alpha1 import CanaryPhase, CanaryStage, CanaryStatus, CheckResult
from sluice.core.canarycheck import Check, RevisionStats


@dataclass(frozen=True)
class Mirror:
    """A request mirror on the route: a copy of `percent` % of the requests goes to `revision`'s subset."""

    revision: str
    percent: float


@dataclass(frozen=True)
class CanaryOutcome:
    status: CanaryStatus | None
    weights: dict[str, int]
    """Traffic % per revision as published; empty means no split (route to every pod of the pool)."""
    mirror: Mirror | None = None
    """The mirror to render (shadow phase only); `status.mirrorPercent` is its percent."""
    steer: str | None = None
    """The revision the header routes (`spec.canary.match`) send matching requests to; None: none rendered."""


@dataclass(frozen=True)
class Rollout:
    """A rollout in progress as this pass sees it: its previous state, the two revisions and their figures."""

    state: CanaryStatus
    candidate: str
    stable: str | None
    cand: RevisionStats
    stable_stats: RevisionStats | None

    @classmethod
    def of(cls, state: CanaryStatus, revisions: dict[str, RevisionStats]) -> Rollout:
        candidate = state.candidate_revision or ""
        stable = state.stable_revision
        cand = revisions.get(candidate, RevisionStats())
        return cls(state, candidate, stable, cand, revisions.get(stable) if stable else None)


def forced_split(
    stable: str | None, candidate: str, revisions: dict[str, RevisionStats]
) -> tuple[str | None, str | None]:
    """(revision that must take all traffic, why), or (None, None) when both sides can carry their share."""
    empty = RevisionStats()
    stable_ok = stable is not None and revisions.get(stable, empty).healthy_pods > 0
    candidate_ok = revisions.get(candidate, empty).healthy_pods > 0
    if not stable_ok and candidate_ok:
        return candidate, f"stable revision {stable or '(none)'} has no healthy routable pod"
    if stable_ok and not candidate_ok and revisions.get(candidate, empty).routable_pods > 0:
        return stable, f"candidate {candidate} has no healthy routable pod"
    return None, None


def serves(weights: dict[str, int], candidate: str, cand: RevisionStats) -> bool:
    """Whether the published routing sends user requests to the candidate (no split: every routable pod)."""
    return weights.get(candidate, 0) > 0 or (not weights and cand.routable_pods > 0)


class Split(NamedTuple):
    """The split as published: traffic % per revision (empty: no split), the candidate's % as the status shows
    it, and why it is not the step's (`splitForced`; None: as planned)."""

    weights: dict[str, int]
    weight: int
    forced: str | None


def publish(
    stable: str | None, candidate: str, planned: int, forced_to: str | None, cand: RevisionStats, why: str | None
) -> Split:
    """The split of `planned` % (or all to `forced_to`, for `why`) as rendered: no split with candidate pods
    routable sends users to them."""
    weights = _split(stable, candidate, planned, forced_to)
    if not weights and cand.routable_pods > 0:
        return Split(
            weights,
            100,
            "no stable revision with a routable pod: no split rendered, users go to every routable pod of the pool, "
            f"the candidate {candidate}'s",
        )
    return Split(weights, weights.get(candidate, 0), why)


def _split(stable: str | None, candidate: str, planned: int, forced_to: str | None) -> dict[str, int]:
    if forced_to is not None:
        return {forced_to: 100}
    if planned >= 100 or stable is None:
        return {candidate: 100} if planned > 0 else {}
    if planned <= 0:
        return {stable: 100}
    return {stable: 100 - planned, candidate: planned}


@dataclass(frozen=True)
class Round:
    """One pass's check round: the check run now (None when none was due) and where the checks stand after it."""

    ran: Check | None
    failed: int
    """Failed checks at this step, this one included."""
    result: CheckResult | None
    reason: str
    checked_at: datetime | None


def check_round(
    state: CanaryStatus,
    interval: float,
    cand: RevisionStats,
    now: datetime,
    run: Callable[[], Check],
    may_check: bool = True,
) -> Round:
    """Run `run` when a check is due (`interval` after the last one, `may_check`) and the candidate has routable
    pods, or at once on an incident on a candidate pod (a failed check even if it leaves the candidate without
    pods)."""
    due = may_check and (state.last_check_at is None or (now - state.last_check_at).total_seconds() >= interval)
    ran = run() if cand.incidents or (due and cand.routable_pods > 0) else None
    if ran is None:
        return Round(None, state.failed_checks, state.last_check, state.last_check_reason, state.last_check_at)
    return Round(ran, state.failed_checks + (ran.result == "Fail"), ran.result, ran.reason, now)


@dataclass(frozen=True)
class Position:
    """Where this pass leaves a rollout in progress."""

    phase: CanaryPhase
    step_index: int
    step_weight: int
    started: datetime | None
    """When the step's (or the shadow's) clock started."""
    stage: CanaryStage = "Live"
    shows_check: bool = True
    """False when the rollout moved to a new step: its check is pending, the last one was the previous step's."""
    capacity_held: str | None = None
    mirror_percent: float | None = None
    shadow_verdict: str | None = None


def next_status(rollout: Rollout, checks: Round, split: Split, position: Position) -> CanaryStatus:
    """The next status of a rollout in progress: what it carries over from the previous one, this pass's check
    round, the split published and where the rollout stands (the message is the caller's)."""
    state = rollout.state
    return CanaryStatus(
        stable_revision=state.stable_revision,
        candidate_revision=rollout.candidate,
        failed_checks=checks.failed,
        last_check_at=checks.checked_at,
        paused_by=state.paused_by,
        last_operation=state.last_operation,
        served_users=state.served_users or serves(split.weights, rollout.candidate, rollout.cand),
        phase=position.phase,
        stage=position.stage,
        step_index=position.step_index,
        weight=split.weight,
        step_weight=position.step_weight,
        capacity_held=position.capacity_held,
        split_forced=split.forced,
        step_started_at=position.started,
        last_check=checks.result if position.shows_check else None,
        last_check_reason=checks.reason if position.shows_check else "",
        mirror_percent=position.mirror_percent,
        shadow_verdict=position.shadow_verdict,
    )
