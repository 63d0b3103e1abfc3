"""Canary: staged rollout of a candidate revision with analysis gates and automatic rollback. Pure.

`step_canary` takes the spec, the previous `status.canary` and this pass's per-revision figures and returns the
next `status.canary` and the traffic split actually published. All rollout state lives in the status, so an
operator restart resumes at the same step. Events are derived from the previous and next status elsewhere
(`sluice.core.events`).

Rules: a check runs at most once per `analysis.interval` (at once on a candidate incident) and passes only on
data (`sluice.core.canarycheck`); a rollout goes through its live steps (`sluice.core.canarysteps`), first through
a shadow when `spec.canary.shadow` asks for one (`sluice.core.canaryshadow`); `maxFailedChecks` failed checks roll
the candidate back, where it stays until the candidate revision changes; a new candidate restarts at the first
step (or the shadow); operations (`sluice.core.operations`) are applied before the stepping.
"""

from __future__ import annotations

from datetime import datetime

from sluice.api.operation import Operation
from sluice.api.v1alpha1 import CanaryPhase, CanarySpec, CanaryStatus, OperationRecord
from sluice.core.abtest import buckets
from sluice.core.canarycheck import RevisionStats
from sluice.core.canaryround import CanaryOutcome, forced_split, publish, serves
from sluice.core.canaryshadow import shadow_pass
from sluice.core.canarysteps import progress, promoted_outcome
from sluice.core.operations import (
    apply_operation,
    first_state,
    go_live,
    is_new,
    refuse_without_rollout,
)


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


STEERED_PHASES: tuple[CanaryPhase, ...] = ("Shadow", "Progressing", "Paused")


def not_ahead(previous: CanaryStatus | None, now: datetime) -> CanaryStatus | None:
    """The rollout's stamps no later than `now`: `stepStartedAt` and `lastCheckAt` are written by the replica that
    ran the pass and read by whichever runs the next, and one stamped by a replica whose clock is ahead would hold
    the step (or the next check) until this one's clock caught up: the chaos matrix's replica 30 s ahead made a
    step 58 s late. Taken as now, such a stamp costs at most the time since it was written."""
    if previous is None:
        return None
    update = {
        name: now
        for name in ("step_started_at", "last_check_at")
        if (stamp := getattr(previous, name)) is not None and stamp > now
    }
    return previous.model_copy(update=update) if update else previous


def step_canary(
    spec: CanarySpec | None,
    previous: CanaryStatus | None,
    revisions: dict[str, RevisionStats],
    metrics_usable: bool,
    now: datetime,
    operation: Operation | None = None,
    target_utilisation: float = 0.8,
) -> CanaryOutcome:
    """The rollout's next state and what to publish; header routes (`spec.match`) to the candidate while the
    rollout is in flight (shadow and paused included) and the candidate has a routable pod.
    `target_utilisation` (`scoring.targetUtilization`): how much of its capacity the candidate may carry at the
    last step (`spec.canary.comparableLoad`)."""
    previous = not_ahead(previous, now)
    ab = spec.ab_test if spec is not None else None
    if spec is not None and ab is not None:
        # an A/B test is one step at 0 % on the weighted route, held for its duration: the candidate's users come
        # through the key's route (`sluice.core.abtest`), then the promotion or the rollback as after a last step
        spec = spec.model_copy(update={"steps": [0], "step_interval": ab.duration})
        if previous is not None and (previous.step_index or 0) > 0:  # turned into an A/B test mid-rollout
            previous = previous.model_copy(update={"step_index": 0, "step_started_at": None})
    outcome = _step(spec, previous, revisions, metrics_usable, now, operation, target_utilisation)
    status = outcome.status
    if spec is None or (spec.match is None and ab is None) or status is None or status.candidate_revision is None:
        return outcome
    candidate = status.candidate_revision
    # users (and testers) are steered only to a candidate with a healthy pod: one the floor merely keeps is not
    steered = status.phase in STEERED_PHASES and revisions.get(candidate, RevisionStats()).healthy_pods > 0
    update: dict[str, object] = {"header_routes": steered and spec.match is not None}
    if ab is not None and steered:
        update["served_users"] = True
    notes = [f"header routes to {candidate}"] if steered and spec.match is not None else []
    if ab is None and status.step_weight == 0 and status.stage == "Live" and status.phase in STEERED_PHASES:
        notes.append("testers only: checks can fail this step, never pass it; `kubectl sluice skip-step` ends it")
    if ab is not None:
        split = buckets(ab.key_alphabet, ab.percent)
        key = f"header {ab.key.header}" if ab.key.header else f"cookie {ab.key.cookie}"
        update["ab_share"] = round(split.share, 4) if steered else None
        if steered:
            notes.append(
                f"A/B: keys ({key}) in {split.buckets} of {split.of} buckets on {candidate}, {split.share:.2f}% of "
                f"uniform {ab.key_alphabet} keys ({ab.percent:g}% asked)"
            )
    update["message"] = "; ".join([status.message, *notes])
    return CanaryOutcome(
        status.model_copy(update=update), outcome.weights, outcome.mirror, candidate if steered else None
    )


def _step(
    spec: CanarySpec | None,
    previous: CanaryStatus | None,
    revisions: dict[str, RevisionStats],
    metrics_usable: bool,
    now: datetime,
    operation: Operation | None = None,
    target_utilisation: float = 0.8,
) -> CanaryOutcome:
    if spec is None:
        return CanaryOutcome(None, {})
    stable = pick_stable(spec, previous, revisions)
    candidate = spec.candidate_revision
    fresh_op = operation if is_new(operation, previous) else None
    window = max((stats.window for stats in revisions.values()), default=0.0)
    remembered = previous.last_operation if previous else None
    if candidate is None or candidate == stable:
        record = refuse_without_rollout(fresh_op, now) if fresh_op else remembered
        return _settled(stable, previous, record)
    if previous is None or previous.candidate_revision != candidate:
        previous = first_state(spec, stable, candidate, now).model_copy(update={"last_operation": remembered})
    previous = previous.model_copy(update={"stable_revision": stable})
    if fresh_op is not None:
        applied = apply_operation(spec, previous, fresh_op, now, window)
        previous = applied.state.model_copy(update={"last_operation": applied.record})
        if applied.effect == "promote":
            return promoted_outcome(
                candidate, previous.last_check, previous.last_check_reason, previous.last_check_at, applied.record
            )
    if previous.stage == "Shadow" and spec.shadow is None and previous.phase != "RolledBack":
        previous = go_live(previous, now, "ended: spec.canary.shadow was removed")
    if previous.phase == "RolledBack":
        return _rolled_back(stable, candidate, previous, revisions)
    if previous.stage == "Shadow" and spec.shadow is not None:
        shadowed = shadow_pass(spec, spec.shadow, previous, revisions, metrics_usable, now, window)
        if isinstance(shadowed, CanaryOutcome):
            return shadowed
        previous = shadowed  # the shadow passed: its first live step is this pass's
    return progress(spec, previous, revisions, metrics_usable, now, window, target_utilisation)


def _rolled_back(
    stable: str | None, candidate: str, previous: CanaryStatus, revisions: dict[str, RevisionStats]
) -> CanaryOutcome:
    """A rolled-back candidate stays without traffic (and without a mirror) until the candidate revision changes."""
    forced_to, why = forced_split(stable, candidate, revisions)
    forced_to = forced_to if forced_to == candidate else None  # serving beats a 503, nothing else overrides
    cand = revisions.get(candidate, RevisionStats())
    split = publish(stable, candidate, 0, forced_to, cand, why if forced_to else None)
    status = previous.model_copy(
        update={
            "weight": split.weight,
            "split_forced": split.forced,
            "mirror_percent": None,
            "served_users": previous.served_users or serves(split.weights, candidate, cand),
        }
    )
    return CanaryOutcome(status, split.weights)


def _settled(stable: str | None, previous: CanaryStatus | None, operation: OperationRecord | None) -> CanaryOutcome:
    """No rollout in flight: all traffic to the stable revision (Promoted if it got there by a rollout)."""
    promoted = previous is not None and previous.phase == "Promoted" and previous.stable_revision == stable
    status = CanaryStatus(
        phase="Promoted" if promoted else "Idle",
        stable_revision=stable,
        candidate_revision=stable if promoted else None,
        weight=100 if promoted else 0,
        message=f"all traffic to {stable}" if stable else "no revision has routable pods",
        last_operation=operation,
    )
    return CanaryOutcome(status, {stable: 100} if stable else {})
