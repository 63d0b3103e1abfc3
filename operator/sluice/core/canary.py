"""Canary: staged rollout of a candidate revision with analysis gates and automatic rollback. Pure.

One function, `step_canary`, takes the spec, the previous `status.canary` and this pass's per-revision figures and
returns the next `status.canary`, the revision traffic split and events. All rollout state lives in the status,
so an operator restart resumes at the same step.

Rules: a check runs at most once per `analysis.interval`; too little traffic is Inconclusive, never Pass; a step
advances only after `stepInterval` at that step *and* a passing check at that step; `maxFailedChecks` failed
checks roll the candidate back to 0, where it stays until the candidate revision changes; a new candidate
restarts at the first step; a candidate with no routable pods gets no traffic (phase Waiting).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime

from sluice.api.v1alpha1 import AnalysisSpec, CanarySpec, CanaryStatus, CheckResult
from sluice.core.events import Event


@dataclass(frozen=True)
class RevisionStats:
    """One revision's figures this pass, aggregated over its routable pods (request-weighted)."""

    routable_pods: int = 0
    requests: float | None = None
    error_rate: float | None = None
    ttft_p95: float | None = None
    incidents: int = 0


@dataclass(frozen=True)
class CanaryOutcome:
    status: CanaryStatus | None
    weights: dict[str, int]
    """Traffic % per revision; empty means no split (route to every pod of the pool)."""
    events: tuple[Event, ...] = ()


def pick_stable(spec: CanarySpec, previous: CanaryStatus | None, revisions: dict[str, RevisionStats]) -> str | None:
    """The status' stable revision; else the spec's; else the non-candidate revision with most routable pods."""
    if previous is not None and previous.stable_revision:
        return previous.stable_revision
    if spec.stable_revision:
        return spec.stable_revision
    others = sorted(
        (-stats.routable_pods, name) for name, stats in revisions.items() if name != spec.candidate_revision
    )
    return others[0][1] if others else None


def check(
    analysis: AnalysisSpec, candidate: RevisionStats, stable: RevisionStats | None, metrics_usable: bool
) -> tuple[CheckResult, str]:
    """One analysis check of the candidate, with the reason in words."""
    if candidate.incidents:
        return "Fail", f"{candidate.incidents} candidate pod(s) zeroed for an incident"
    if not metrics_usable:
        return "Inconclusive", "metrics unavailable"
    if candidate.requests is None or candidate.requests < analysis.min_requests:
        seen = 0 if candidate.requests is None else round(candidate.requests)
        return "Inconclusive", f"{seen} requests in the window, need {analysis.min_requests}"
    if candidate.error_rate is not None and candidate.error_rate > analysis.max_error_rate:
        return "Fail", f"error rate {candidate.error_rate:.2%} > {analysis.max_error_rate:.2%}"
    p95 = candidate.ttft_p95
    if p95 is not None and analysis.max_ttft_p95 is not None and p95 > analysis.max_ttft_p95:
        return "Fail", f"TTFT p95 {p95 * 1000:.0f}ms > {analysis.max_ttft_p95 * 1000:.0f}ms"
    ratio_limit = analysis.max_ttft_ratio_to_stable
    if p95 is not None and ratio_limit is not None and stable is not None and stable.ttft_p95:
        ratio = p95 / stable.ttft_p95
        if ratio > ratio_limit:
            return "Fail", f"TTFT p95 {ratio:.2f}x stable > {ratio_limit:.2f}x"
    return "Pass", "within every gate"


def _split(stable: str | None, candidate: str, weight: int, revisions: dict[str, RevisionStats]) -> dict[str, int]:
    if weight <= 0:
        return {stable: 100} if stable else {}
    stable_up = stable is not None and revisions.get(stable, RevisionStats()).routable_pods > 0
    if weight >= 100 or stable is None or not stable_up:
        # Sending the stable share to a subset with no endpoints would fail those requests outright.
        return {candidate: 100}
    return {stable: 100 - weight, candidate: weight}


def step_canary(
    spec: CanarySpec | None,
    previous: CanaryStatus | None,
    revisions: dict[str, RevisionStats],
    metrics_usable: bool,
    now: datetime,
) -> CanaryOutcome:
    if spec is None:
        return CanaryOutcome(None, {})
    stable = pick_stable(spec, previous, revisions)
    candidate = spec.candidate_revision
    if candidate is None or candidate == stable:
        events: tuple[Event, ...] = ()
        phase = "Idle"
        if previous is not None and previous.phase == "Promoted" and previous.stable_revision == stable:
            phase = "Promoted"
        elif previous is not None and previous.phase in ("Progressing", "Paused", "Waiting") and candidate is None:
            events = (
                Event(
                    "Normal",
                    "CanaryAborted",
                    f"candidate {previous.candidate_revision} removed: traffic back to {stable}",
                ),
            )
        status = CanaryStatus(
            phase=phase,
            stable_revision=stable,
            candidate_revision=stable if phase == "Promoted" else None,
            weight=100 if phase == "Promoted" else 0,
            message=f"all traffic to {stable}" if stable else "no revision has routable pods",
        )
        return CanaryOutcome(status, {stable: 100} if stable else {}, events)

    if previous is None or previous.candidate_revision != candidate:
        restarted = previous is not None and previous.phase in ("Progressing", "Paused", "Waiting")
        reason = "CanaryRestarted" if restarted else "CanaryStarted"
        state = CanaryStatus(
            phase="Progressing",
            stable_revision=stable,
            candidate_revision=candidate,
            step_index=0,
            weight=spec.steps[0],
            step_started_at=now,
        )
        start_event = Event("Normal", reason, f"rolling out {candidate} over {stable}: steps {spec.steps}")
        outcome = _advance(spec, state, revisions, metrics_usable, now)
        return replace(outcome, events=(start_event, *outcome.events))

    if previous.phase == "RolledBack":
        return CanaryOutcome(previous, _split(stable, candidate, 0, revisions))
    return _advance(spec, replace_status(previous, stable_revision=stable), revisions, metrics_usable, now)


def replace_status(status: CanaryStatus, **changes: object) -> CanaryStatus:
    return status.model_copy(update=changes)


def _advance(
    spec: CanarySpec,
    state: CanaryStatus,
    revisions: dict[str, RevisionStats],
    metrics_usable: bool,
    now: datetime,
) -> CanaryOutcome:
    candidate = state.candidate_revision or ""
    stable = state.stable_revision
    cand = revisions.get(candidate, RevisionStats())
    step_index = state.step_index or 0
    step_weight = spec.steps[min(step_index, len(spec.steps) - 1)]
    events: list[Event] = []

    due = state.last_check_at is None or (now - state.last_check_at).total_seconds() >= spec.analysis.interval
    result, why = state.last_check, state.last_check_reason
    failed = state.failed_checks
    last_check_at = state.last_check_at
    # An incident on a candidate pod is a failed check at once, even if it leaves the candidate without pods.
    if cand.incidents or (due and cand.routable_pods > 0):
        stable_stats = revisions.get(stable) if stable else None
        result, why = check(spec.analysis, cand, stable_stats, metrics_usable)
        last_check_at = now
        if result == "Fail":
            failed += 1
            events.append(
                Event(
                    "Warning",
                    "CanaryCheckFailed",
                    f"{candidate} at {step_weight}%: {why} ({failed}/{spec.max_failed_checks})",
                )
            )

    if failed >= spec.max_failed_checks:
        rolled = replace_status(
            state,
            phase="RolledBack",
            weight=0,
            failed_checks=failed,
            last_check=result,
            last_check_reason=why,
            last_check_at=last_check_at,
            message=f"rolled back {candidate} after {failed} failed checks: {why}",
        )
        events.append(Event("Warning", "CanaryRolledBack", rolled.message))
        return CanaryOutcome(rolled, _split(stable, candidate, 0, revisions), tuple(events))

    if cand.routable_pods == 0:
        waiting = replace_status(
            state,
            phase="Waiting",
            weight=0,
            failed_checks=failed,
            last_check=result,
            last_check_reason=why,
            last_check_at=last_check_at,
            step_started_at=None,
            message=f"candidate {candidate} has no routable pods: it gets no traffic until it has",
        )
        return CanaryOutcome(waiting, _split(stable, candidate, 0, revisions), tuple(events))

    step_started = state.step_started_at or now
    if state.phase in ("Paused", "Waiting") and not spec.paused:
        step_started = now  # a full step interval is observed at this weight after a pause or a wait

    at_step_for = (now - step_started).total_seconds()
    if spec.paused:
        paused = replace_status(
            state,
            phase="Paused",
            step_index=step_index,
            weight=step_weight,
            failed_checks=failed,
            last_check=result,
            last_check_reason=why,
            last_check_at=last_check_at,
            step_started_at=step_started,
            message=f"paused at {step_weight}% (last check {result or 'none'}: {why})",
        )
        return CanaryOutcome(paused, _split(stable, candidate, step_weight, revisions), tuple(events))

    if at_step_for >= spec.step_interval and result == "Pass":
        if step_index >= len(spec.steps) - 1:
            promoted = CanaryStatus(
                phase="Promoted",
                stable_revision=candidate,
                candidate_revision=candidate,
                weight=100,
                last_check=result,
                last_check_reason=why,
                last_check_at=last_check_at,
                message=f"{candidate} promoted: it is now the stable revision",
            )
            events.append(Event("Normal", "CanaryPromoted", promoted.message))
            return CanaryOutcome(promoted, {candidate: 100}, tuple(events))
        step_index += 1
        step_weight = spec.steps[step_index]
        events.append(
            Event(
                "Normal",
                "CanaryAdvanced",
                f"{candidate} to {step_weight}% (step {step_index + 1}/{len(spec.steps)})",
            )
        )
        progressing = replace_status(
            state,
            phase="Progressing",
            step_index=step_index,
            weight=step_weight,
            failed_checks=failed,
            last_check=None,
            last_check_reason="",
            last_check_at=last_check_at,
            step_started_at=now,
            message=f"at {step_weight}%: waiting for a passing check",
        )
        return CanaryOutcome(progressing, _split(stable, candidate, step_weight, revisions), tuple(events))

    remaining = max(0.0, spec.step_interval - at_step_for)
    message = (
        f"at {step_weight}% for {at_step_for:.0f}s of {spec.step_interval:.0f}s; "
        f"last check {result or 'pending'}: {why}"
    )
    if remaining == 0 and result != "Pass":
        message = f"at {step_weight}%: holding until a check passes (last {result or 'pending'}: {why})"
    progressing = replace_status(
        state,
        phase="Progressing",
        step_index=step_index,
        weight=step_weight,
        failed_checks=failed,
        last_check=result,
        last_check_reason=why,
        last_check_at=last_check_at,
        step_started_at=step_started,
        message=message,
    )
    return CanaryOutcome(progressing, _split(stable, candidate, step_weight, revisions), tuple(events))
