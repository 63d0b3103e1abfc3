"""A canary's live steps: the check round at the step, the next step, the split published, the promotion. Pure.

A step advances only after `stepInterval` at that step *and* a passing check at that step; `maxFailedChecks`
failed checks roll the candidate back; a candidate with no routable pods waits with no traffic. When one side of
the split has no healthy routable pod, the published split is forced to the other side, `splitForced` says why,
and the rollout does not advance while it lasts. With `comparableLoad`, a step that asks more of the candidate
than its capacity carries at the stable revision's utilisation is published at what it carries
(`capacityHeld`), and promotion waits until it can carry the pool.
"""

from __future__ import annotations

from datetime import datetime

from sluice.api.v1alpha1 import CanaryPhase, CanarySpec, CanaryStatus, CheckResult, OperationRecord
from sluice.core.canarycheck import Capacities, Check, RevisionStats, capacities, check, requests_cap
from sluice.core.canaryround import (
    CanaryOutcome,
    Position,
    Rollout,
    check_round,
    forced_split,
    next_status,
    publish,
)
from sluice.core.capacity import INFORMATIVE


def progress(
    spec: CanarySpec,
    state: CanaryStatus,
    revisions: dict[str, RevisionStats],
    metrics_usable: bool,
    now: datetime,
    window: float,
    target_utilisation: float,
) -> CanaryOutcome:
    """One pass at a live step: a check when one is due, then the step the rollout is at, the split published
    there (held to what the candidate carries), or the promotion."""
    rollout = Rollout.of(state, revisions)
    candidate, cand, stable_stats = rollout.candidate, rollout.cand, rollout.stable_stats
    caps = capacities(stable_stats, cand) if spec.comparable_load else None
    forced_to, forced_why = forced_split(rollout.stable, candidate, revisions)

    def run() -> Check:
        return _live_check(spec, rollout, caps, forced_to, metrics_usable)

    # the first live check's window must hold user traffic at this step, not the mirrored copies
    checks = check_round(state, spec.analysis.interval, cand, now, run, may_check=not after_shadow(state, now, window))
    phase, step_index, started = _next_step(spec, state, cand, checks.result, checks.failed, forced_why, now)
    waits = None
    if phase == "Promoted":
        waits = _held(caps, 100, cand, stable_stats, target_utilisation)
        if waits is None:
            return promoted_outcome(candidate, checks.result, checks.reason, checks.checked_at, state.last_operation)
        # the candidate cannot carry the pool yet: the last step waits on its clock (capacityHeld)
        phase, started = "Progressing", state.step_started_at or now
    planned = 0 if phase in ("RolledBack", "Waiting") else spec.steps[step_index]
    if phase in ("RolledBack", "Waiting"):
        forced_to = forced_to if forced_to == candidate else None
        forced_why = forced_why if forced_to else None
    held = (
        None
        if phase in ("RolledBack", "Waiting") or forced_to is not None
        else (_held(caps, planned, cand, stable_stats, target_utilisation))
    )
    if held is None and waits is not None:  # an A/B test's 0 % step: published as it is, promotion waits
        held = (planned, waits[1])
    split = publish(rollout.stable, candidate, planned if held is None else held[0], forced_to, cand, forced_why)
    position = Position(
        phase,
        step_index,
        planned,
        started,
        shows_check=step_index == state.step_index,
        capacity_held=held[1] if held is not None else None,
        shadow_verdict=state.shadow_verdict,
    )
    status = next_status(rollout, checks, split, position)
    return CanaryOutcome(status.model_copy(update={"message": _live_message(spec, status, now, caps)}), split.weights)


def _live_check(
    spec: CanarySpec, rollout: Rollout, caps: Capacities | None, forced_to: str | None, metrics_usable: bool
) -> Check:
    """The step's check: the requests the split accounts for with header routes, the loads compared."""
    stable_stats = rollout.stable_stats
    planned_now = spec.steps[min(rollout.state.step_index or 0, len(spec.steps) - 1)]
    cap = requests_cap(spec, stable_stats, planned_now, forced_to)
    shown = caps.loads(rollout.cand, stable_stats) if caps is not None and stable_stats is not None else None
    loads = (caps, shown) if caps is not None and shown is not None else None
    return check(
        spec.analysis,
        rollout.cand,
        stable_stats,
        metrics_usable,
        stable_serves=planned_now < 100,
        requests_cap=cap,
        loads=loads,
    )


def _held(
    caps: Capacities | None,
    planned: int,
    cand: RevisionStats,
    stable: RevisionStats | None,
    target_utilisation: float,
) -> tuple[int, str] | None:
    """(published %, why) when the step asks more of the candidate than it carries at the stable revision's
    utilisation (`comparableLoad`). The last step (100 %) is held the same way unless the candidate can carry the
    pool's whole rate within `target_utilisation` (without a learned capacity: unless its classes add up to the
    stable revision's, or, while no stable pod shows load, to INFORMATIVE / target_utilisation of them: the pool
    then runs below INFORMATIVE of the stable revision's capacity); promotion waits for that. None: the step as
    written."""
    if caps is None or planned <= 0:
        return None
    limit = caps.percent
    if caps.absolute:
        why = (
            f"the candidate's capacity ({caps.candidate:.2f}/s, {caps.basis}) carries {limit:.0f}% at the stable "
            f"revision's utilisation (its capacity {caps.stable:.2f}/s)"
        )
    else:
        why = (
            f"the candidate's classes (K {caps.candidate:g} against the stable revision's {caps.stable:g}) carry "
            f"{limit:.0f}% at the stable revision's load per unit of K"
        )
    if planned >= 100:
        total = (cand.rate or 0.0) + ((stable.rate or 0.0) if stable is not None else 0.0)
        if caps.absolute and total <= target_utilisation * caps.candidate:
            return None
        if not caps.absolute and caps.candidate >= caps.stable:
            return None  # without a learned capacity: as much declared capacity as the stable revision has
        quiet = not caps.absolute and stable is not None and stable.quiet
        if quiet and caps.candidate * target_utilisation >= INFORMATIVE * caps.stable:
            # No stable pod shows load: the pool runs below INFORMATIVE of the stable revision's capacity, which
            # the candidate's classes carry within target_utilisation.
            return None
        why += (
            f"; promotion waits until it can carry the pool's {total:.2f}/s within targetUtilization "
            f"{target_utilisation:.0%}"
            if caps.absolute
            else "; promotion waits until its classes add up to the stable revision's, or to "
            f"{INFORMATIVE / target_utilisation:.0%} of them while no stable pod shows load (no learned capacity "
            "to tell what it can carry)"
        )
    if planned <= limit:
        return None
    return max(1, int(limit)), why


def after_shadow(state: CanaryStatus, now: datetime, window: float) -> bool:
    """At the first live step after a shadow, less than a metrics window after it started: a check now would judge
    mostly mirrored traffic, so none is due (an incident still fails a check at once)."""
    if state.shadow_verdict is None or (state.step_index or 0) != 0 or state.step_started_at is None:
        return False
    return (now - state.step_started_at).total_seconds() < window


def promoted_outcome(
    candidate: str,
    result: CheckResult | None,
    reason: str,
    checked_at: datetime | None,
    operation: OperationRecord | None,
) -> CanaryOutcome:
    status = CanaryStatus(
        phase="Promoted",
        stage="Live",
        stable_revision=candidate,
        candidate_revision=candidate,
        weight=100,
        step_weight=100,
        last_check=result,
        last_check_reason=reason,
        last_check_at=checked_at,
        message=f"{candidate} promoted: it is now the stable revision",
        last_operation=operation,
    )
    return CanaryOutcome(status, {candidate: 100})


def _next_step(
    spec: CanarySpec,
    state: CanaryStatus,
    cand: RevisionStats,
    result: CheckResult | None,
    failed: int,
    forced_why: str | None,
    now: datetime,
) -> tuple[CanaryPhase, int, datetime | None]:
    """(phase, step index, when the step's clock started) after this pass."""
    index = state.step_index or 0
    if failed >= spec.max_failed_checks:
        return "RolledBack", index, state.step_started_at
    if cand.routable_pods == 0:
        return "Waiting", index, None
    started = state.step_started_at or now
    paused = spec.paused or state.paused_by is not None
    if state.phase in ("Paused", "Waiting") and not paused:
        started = now  # a full step interval is observed at this weight after a pause or a wait
    if paused:
        return "Paused", index, started
    if forced_why is not None:
        return "Progressing", index, now  # the step's clock runs only while its split is really published
    if (now - started).total_seconds() >= spec.step_interval and result == "Pass":
        if index >= len(spec.steps) - 1:
            return "Promoted", index, None
        return "Progressing", index + 1, now
    return "Progressing", index, started


def _message(spec: CanarySpec, status: CanaryStatus, now: datetime) -> str:
    candidate, step = status.candidate_revision, status.step_weight
    last = f"last check {status.last_check or 'pending'}: {status.last_check_reason or 'none yet'}"
    if status.phase == "RolledBack":
        return f"rolled back {candidate} after {status.failed_checks} failed checks: {status.last_check_reason}"
    if status.phase == "Waiting":
        return f"candidate {candidate} has no routable pods: it gets no traffic until it has"
    if status.split_forced:
        return f"step {step}% not applied, {candidate} at {status.weight}%: {status.split_forced}; holding"
    if status.capacity_held:
        held = f"step {step}% published at {status.weight}%: {status.capacity_held}"
        if status.phase == "Paused":
            return f"paused, {held} ({last})"
        return f"{held}; {last}"
    if status.phase == "Paused":
        return f"paused at {step}% ({last})"
    at_step = (now - status.step_started_at).total_seconds() if status.step_started_at else 0.0
    if at_step >= spec.step_interval and status.last_check != "Pass":
        return f"at {step}%: holding until a check passes ({last})"
    return f"at {step}% for {at_step:.0f}s of {spec.step_interval:g}s; {last}"


def _live_message(spec: CanarySpec, status: CanaryStatus, now: datetime, caps: Capacities | None) -> str:
    """The step's message, and that the loads were not compared when `comparableLoad` could not."""
    message = _message(spec, status, now)
    uncompared = spec.comparable_load and status.phase == "Progressing" and (status.step_weight or 0) > 0
    if uncompared and not status.split_forced and caps is None:
        message += (
            "; load not compared (canary.comparableLoad): a pod without a known class and no learned capacity "
            "on both revisions"
        )
    return message
