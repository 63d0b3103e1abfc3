"""A canary's shadow stage (`spec.canary.shadow`): the candidate gets no live traffic, only a mirrored copy of
`mirrorPercent` % of the stable revision's requests (Envoy discards the candidate's answers). Pure.

It is judged by the shadow's own analysis on its own signals under that load; `maxFailedChecks` failed checks roll
it back before any user request reached it (unless the split was forced to it: `servedUsers`, sticky, and the
message say so); after `duration` and a passing check taken with the mirror in place it goes to the first live
step. The shadow's clock runs only while the mirror is rendered; the mirror is rendered only while the candidate
has routable pods and the stage is Shadow (not after a rollback, nor once live), and `status.canary.mirrorPercent`
is exactly what is rendered.
"""

from __future__ import annotations

from datetime import datetime

from sluice.api.v1alpha1 import CanaryPhase, CanarySpec, CanaryStatus, ShadowSpec
from sluice.core.canarycheck import Check, RevisionStats, check, split_share
from sluice.core.canaryround import (
    CanaryOutcome,
    Mirror,
    Position,
    Rollout,
    Round,
    check_round,
    forced_split,
    next_status,
    publish,
)
from sluice.core.operations import go_live, mirrored_evidence


def shadow_pass(
    spec: CanarySpec,
    shadow: ShadowSpec,
    state: CanaryStatus,
    revisions: dict[str, RevisionStats],
    metrics_usable: bool,
    now: datetime,
    window: float,
) -> CanaryOutcome | CanaryStatus:
    """The shadow stage: users stay on the stable revision; the candidate gets the mirror and is judged on it.
    The outcome, or the state gone live when the shadow passed (the first live step is the caller's).

    The pass that ends it must be a check whose whole window (`metrics.window`) had the mirror in place: one taken
    at least `window` seconds after the shadow's clock started (a check from before the mirror judged no copy)."""
    rollout = Rollout.of(state, revisions)
    candidate, stable, cand = rollout.candidate, rollout.stable, rollout.cand
    forced_to, forced_why = forced_split(stable, candidate, revisions)
    if forced_to != candidate:  # users are on the stable revision anyway; only serving beats a 503
        forced_to, forced_why = None, None

    def run() -> Check:
        return _shadow_check(spec, shadow, rollout, forced_to, metrics_usable)

    checks = check_round(state, shadow.analysis.interval, cand, now, run)
    split = publish(stable, candidate, 0, forced_to, cand, forced_why)
    # A mirror copies the stable route's requests: none without that route, or once users are on the candidate.
    users_on_stable = stable is not None and split.weights.get(stable, 0) == 100
    phase, started, passed = _shadow_clock(spec, shadow, state, cand, checks, users_on_stable, now, window)
    if passed is not None:
        live = go_live(state, now, passed)
        return live.model_copy(update={"failed_checks": checks.failed, "last_check_at": checks.checked_at})
    mirrored = phase in ("Shadow", "Paused") and users_on_stable and cand.routable_pods > 0
    mirror = Mirror(candidate, shadow.mirror_percent) if mirrored else None
    position = Position(phase, 0, 0, started, stage="Shadow", mirror_percent=mirror.percent if mirror else None)
    status = next_status(rollout, checks, split, position)
    message = _shadow_message(shadow, status, now, window)
    return CanaryOutcome(status.model_copy(update={"message": message}), split.weights, mirror)


def _shadow_check(
    spec: CanarySpec, shadow: ShadowSpec, rollout: Rollout, forced_to: str | None, metrics_usable: bool
) -> Check:
    """The shadow's check, on its own analysis; with header routes it counts at most the mirrored share."""
    stable_stats = rollout.stable_stats
    cap = split_share(stable_stats, shadow.mirror_percent / 100) if spec.match and forced_to is None else None
    return check(
        shadow.analysis, rollout.cand, stable_stats, metrics_usable, stable_serves=forced_to is None, requests_cap=cap
    )


def _shadow_clock(
    spec: CanarySpec,
    shadow: ShadowSpec,
    state: CanaryStatus,
    cand: RevisionStats,
    checks: Round,
    users_on_stable: bool,
    now: datetime,
    window: float,
) -> tuple[CanaryPhase, datetime, str | None]:
    """(phase, when the shadow's clock started, the verdict when the shadow passed and goes live now)."""
    started = state.step_started_at or now
    if checks.failed >= spec.max_failed_checks:
        return "RolledBack", started, None
    if cand.routable_pods == 0:
        return "Waiting", now, None  # nothing to mirror to: the shadow's clock restarts when there is
    if not users_on_stable:
        return "Shadow", now, None  # no mirror (users on the candidate, or no stable route): no shadow time
    paused = spec.paused or state.paused_by is not None
    if state.phase == "Waiting" or state.mirror_percent is None:
        started = now  # the clock runs only while the mirror is rendered
    elapsed = (now - started).total_seconds()
    evidence = mirrored_evidence(checks.result, checks.checked_at, started, window)
    if not paused and elapsed >= shadow.duration and evidence:
        return "Shadow", started, f"passed after {elapsed:.0f}s: {checks.reason}"
    return "Paused" if paused else "Shadow", started, None


def _shadow_message(shadow: ShadowSpec, status: CanaryStatus, now: datetime, window: float) -> str:
    candidate = status.candidate_revision
    last = f"last check {status.last_check or 'pending'}: {status.last_check_reason or 'none yet'}"
    if status.phase == "RolledBack":
        return (
            f"rolled back {candidate} in shadow after {status.failed_checks} failed checks, {_reached(status)}: "
            f"{status.last_check_reason}"
        )
    if status.phase == "Waiting":
        return f"shadow: candidate {candidate} has no routable pods: no mirror rendered until it has"
    if status.split_forced:
        return f"shadow held, {candidate} at {status.weight}%, no mirror: {status.split_forced}"
    if status.mirror_percent is None:
        return f"shadow: no mirror rendered: no stable revision whose requests could be copied to {candidate}"
    mirror = f"mirroring {status.mirror_percent:g}% of requests to {candidate}, answers discarded"
    if status.phase == "Paused":
        return f"shadow paused ({mirror}; {last})"
    at = (now - status.step_started_at).total_seconds() if status.step_started_at else 0.0
    if at >= shadow.duration and status.last_check != "Pass":
        return f"shadow: {mirror}; holding until a check passes ({last})"
    if at >= shadow.duration and not mirrored_evidence(
        status.last_check, status.last_check_at, status.step_started_at, window
    ):
        return (
            f"shadow: {mirror}; holding until a check over {window:g}s of mirrored traffic passes "
            f"(metrics.window; the last passing check was taken before: {last})"
        )
    return f"shadow: {mirror}, {at:.0f}s of {shadow.duration:g}s; {last}"


def _reached(status: CanaryStatus) -> str:
    """Whether users reached a candidate rolled back in shadow, in words (the claim only when it is true)."""
    if status.served_users:
        return "after users were routed to it while the stable revision had no healthy pod"
    return "before any user request was routed to it"
