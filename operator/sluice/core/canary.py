"""Canary: staged rollout of a candidate revision with analysis gates and automatic rollback. Pure.

`step_canary` takes the spec, the previous `status.canary` and this pass's per-revision figures and returns the
next `status.canary` and the traffic split actually published. All rollout state lives in the status, so an
operator restart resumes at the same step. Events are derived from the previous and next status elsewhere
(`sluice.core.events`).

Rules: a check runs at most once per `analysis.interval` (at once on a candidate incident); too little traffic,
an enabled gate without data, or a routable candidate pod without fresh samples, is Inconclusive — never Pass; a
step advances only after `stepInterval` at that step *and* a passing check at that step; `maxFailedChecks` failed
checks roll the candidate back, where it stays until the candidate revision changes; a new candidate restarts at
the first step; a candidate with no routable pods waits with no traffic. When one side of the split has no
healthy routable pod, the published split is forced to the other side, `splitForced` says why, and the rollout
does not advance while it lasts.

Shadow (`spec.canary.shadow`): a new candidate first gets no live traffic, only a mirrored copy of
`mirrorPercent` % of the stable revision's requests (Envoy discards the candidate's answers). It is judged by the
shadow's own analysis on its own signals under that load; `maxFailedChecks` failed checks roll it back before any
user request reached it (unless the split was forced to it: `servedUsers`, sticky, and the message say so); after
`duration` and a passing check taken with the mirror in place it goes to the first live step. The shadow's clock
runs only while the mirror is rendered; the mirror is rendered only while the candidate has routable pods and the
stage is Shadow (not after a rollback, nor once live), and `status.canary.mirrorPercent` is exactly what is
rendered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TypedDict

from sluice.api.operation import Operation
from sluice.api.v1alpha1 import (
    AnalysisSpec,
    CanaryPhase,
    CanarySpec,
    CanaryStatus,
    CheckResult,
    Gate,
    OperationRecord,
    ShadowSpec,
)
from sluice.core.abtest import buckets
from sluice.core.operations import (
    apply_operation,
    first_state,
    go_live,
    is_new,
    mirrored_evidence,
    refuse_without_rollout,
)


@dataclass(frozen=True)
class RevisionStats:
    """One revision's figures this pass: pod counts, and request-weighted signals over its pods with data."""

    routable_pods: int = 0
    healthy_pods: int = 0
    """Routable pods that the floor does not merely keep."""
    requests: float | None = None
    error_rate: float | None = None
    ttft_p95: float | None = None
    incidents: int = 0
    stale_pods: tuple[str, ...] = ()
    """Routable pods without fresh samples: their last values are not evidence, so no check can pass."""
    window: float = 0.0
    """The span the figures cover (`metrics.window`): a check judges the last `window` seconds."""
    capacity: float | None = None
    """Requests/s the healthy routable pods can take, when each one's rests on a measurement (headroom policy);
    None otherwise."""
    classes: float = 0.0
    """The healthy routable pods' class coefficients K summed (0 when one has no known class)."""
    per_k: float | None = None
    """Requests/s per unit of K learned by those of them with a learned capacity and a known class; None without."""

    @property
    def rate(self) -> float | None:
        return self.requests / self.window if self.requests is not None and self.window > 0 else None


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
class Check:
    result: CheckResult
    reason: str


COMPARABLE = 1.25
"""A candidate is judged against the stable revision at comparable load while its utilisation is at most this
multiple of the stable revision's, plus `COMPARABLE_SLACK` (`spec.canary.comparableLoad`): an M/M/1 TTFT at 0.6
against 0.48 is 1.3x for load alone. Provenance: hand-set, not swept."""
COMPARABLE_SLACK = 0.05


@dataclass(frozen=True)
class Capacities:
    """What the candidate and the stable revision can take: requests/s when `absolute` (the stable revision's
    learned capacity per unit of K), else in units of K (their declared classes alone)."""

    candidate: float
    stable: float
    basis: str
    absolute: bool

    @property
    def percent(self) -> float:
        """The candidate's share at which both revisions run at one utilisation."""
        return 100.0 * self.candidate / (self.candidate + self.stable)

    def loads(self, cand: RevisionStats, stable: RevisionStats) -> tuple[float, float] | None:
        """(candidate, stable) load over the window — a share of capacity when `absolute`, requests/s per unit of
        K otherwise — when both rates are known."""
        if cand.rate is None or stable.rate is None:
            return None
        return cand.rate / self.candidate, stable.rate / self.stable

    def comparable(self, loads: tuple[float, float] | None) -> bool:
        if loads is None:
            return True
        return loads[0] <= COMPARABLE * loads[1] + (COMPARABLE_SLACK if self.absolute else 0.0)

    def describe(self, loads: tuple[float, float]) -> str:
        if self.absolute:
            return f"the candidate at {loads[0]:.0%} of its capacity, the stable revision at {loads[1]:.0%}"
        return (
            f"the candidate at {loads[0]:.2f} req/s per unit of K, the stable revision at {loads[1]:.2f} (no learned "
            "capacity: by declared classes)"
        )


def capacities(stable: RevisionStats | None, cand: RevisionStats) -> Capacities | None:
    """The two revisions' capacities: the candidate's classes' K against the stable revision's, in requests/s at
    the stable revision's learned capacity per unit of K when some of its pods learned one (`absolute`), in units
    of K otherwise; with a candidate pod of no known class, its own learned capacity against the stable
    revision's. None when neither can be had.

    Not the candidate's own figure first: one or two pods learn theirs from the few requests of the first steps,
    and on underprovisioned-canary it ranged 4.5-11.8 req/s for an A100 the stable ones put at 15, so the split
    it gave moved 11-32 % from pass to pass and put the stable pods past their knee. A candidate slower per unit
    of K than the stable revision is then judged at the stable revision's load per unit of K: what it would
    serve after promotion, and what its TTFT gates should see."""
    if stable is None:
        return None
    if cand.classes > 0 and stable.classes > 0:
        if stable.per_k:
            basis = "its classes' K at the stable revision's learned capacity per unit of K"
            return Capacities(cand.classes * stable.per_k, stable.classes * stable.per_k, basis, True)
        return Capacities(cand.classes, stable.classes, "its classes' K against the stable revision's", False)
    if cand.capacity and stable.capacity:
        return Capacities(cand.capacity, stable.capacity, "learned", True)
    return None


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


def _gate(gate: Gate, analysis: AnalysisSpec, cand: RevisionStats, stable: RevisionStats | None) -> str | None:
    """None when the gate holds; the failure in words when it does not; raises LookupError naming missing data."""
    if gate == "errorRate":
        if cand.error_rate is None:
            raise LookupError("candidate errorRate")
        if cand.error_rate > analysis.max_error_rate:
            return f"error rate {cand.error_rate:.2%} > {analysis.max_error_rate:.2%}"
        return None
    limit = analysis.max_ttft_p95 if gate == "ttftP95" else analysis.max_ttft_ratio_to_stable
    if limit is None:
        return None
    if cand.ttft_p95 is None:
        raise LookupError("candidate ttftP95")
    if gate == "ttftP95":
        if cand.ttft_p95 > limit:
            return f"TTFT p95 {cand.ttft_p95 * 1000:.0f}ms > {limit * 1000:.0f}ms"
        return None
    if stable is None or not stable.ttft_p95:
        raise LookupError("stable ttftP95")
    ratio = cand.ttft_p95 / stable.ttft_p95
    return f"TTFT p95 {ratio:.2f}x stable > {limit:.2f}x" if ratio > limit else None


GATES: tuple[Gate, ...] = ("errorRate", "ttftP95", "ttftRatioToStable")


def enabled_gates(analysis: AnalysisSpec) -> tuple[Gate, ...]:
    limits = {"ttftP95": analysis.max_ttft_p95, "ttftRatioToStable": analysis.max_ttft_ratio_to_stable}
    return tuple(g for g in GATES if g not in analysis.disabled_gates and (g == "errorRate" or limits[g] is not None))


def check(
    analysis: AnalysisSpec,
    candidate: RevisionStats,
    stable: RevisionStats | None,
    metrics_usable: bool,
    stable_serves: bool = True,
    requests_cap: float | None = None,
    loads: tuple[Capacities, tuple[float, float]] | None = None,
) -> Check:
    """One analysis check of the candidate. Pass only when every enabled gate was evaluated on data.

    The ratio to stable compares two revisions serving side by side; at a step where the stable revision takes
    no traffic (100 %) there is nothing to compare with, so that gate does not apply (and the reason says so).
    `loads` (the capacities and the (candidate, stable) loads on them; `spec.canary.comparableLoad`): a ratio
    failure taken while the candidate was busier than the stable revision beyond `COMPARABLE` says nothing of the
    candidate itself, so it makes the check Inconclusive, not Fail.
    """
    if candidate.incidents:
        return Check("Fail", f"{candidate.incidents} candidate pod(s) zeroed for an incident")
    if not metrics_usable:
        return Check("Inconclusive", "metrics unavailable")
    if candidate.stale_pods:
        return Check("Inconclusive", f"stale signals for pod {', '.join(candidate.stale_pods)}: not evidence")
    if candidate.requests is None or candidate.requests < analysis.min_requests:
        seen = 0 if candidate.requests is None else round(candidate.requests)
        return Check("Inconclusive", f"{seen} requests in the window, need {analysis.min_requests}")
    failures: list[str] = []
    missing: list[str] = []
    incomparable = ""
    gates = [g for g in enabled_gates(analysis) if stable_serves or g != "ttftRatioToStable"]
    for gate in gates:
        try:
            failure = _gate(gate, analysis, candidate, stable)
        except LookupError as lack:
            missing.append(f"{gate} ({lack.args[0]})")
            continue
        if failure and gate == "ttftRatioToStable" and loads is not None and not loads[0].comparable(loads[1]):
            incomparable = f"{failure}, but not at comparable load: {loads[0].describe(loads[1])}"
        elif failure:
            failures.append(failure)
    if failures:  # every request is evidence of a failure, the testers' included
        return Check("Fail", "; ".join(failures))
    if incomparable:
        return Check("Inconclusive", incomparable)
    if missing:
        return Check("Inconclusive", "no data for gate " + ", ".join(missing))
    if requests_cap is not None and candidate.requests is not None:
        counted = min(candidate.requests, requests_cap)
        if counted < analysis.min_requests:  # but not of a pass: the testers' requests alone never make one
            return Check(
                "Inconclusive",
                f"{round(counted)} requests in the window counted (header-routed ones excluded: at most what the "
                f"split and mirror send, estimated from the stable revision's), need {analysis.min_requests}",
            )
    applied = ", ".join(gates) or "none enabled"
    skipped = "" if stable_serves or "ttftRatioToStable" not in enabled_gates(analysis) else "; ttftRatioToStable "
    skipped += "does not apply: the stable revision takes no traffic at this step" if skipped else ""
    return Check("Pass", f"within every gate ({applied}){skipped}")


def _requests_cap(spec: CanarySpec, stable: RevisionStats | None, planned: int, forced_to: str | None) -> float | None:
    """The most candidate requests a check counts while header routes carry testers (None: no cap): the share
    the split sends — for an A/B test, its buckets' share — estimated from the stable revision's requests. No cap
    at 100 % or with the split forced to one side: the stable revision then serves nobody to estimate from, and
    every user is on the candidate anyway."""
    if spec.match is None or forced_to is not None:
        return None
    share = buckets(spec.ab_test.key_alphabet, spec.ab_test.percent).share if spec.ab_test else float(planned)
    if share >= 100:
        return None
    return _split_share(stable, share / (100 - share))


def _split_share(stable: RevisionStats | None, ratio: float) -> float:
    """The candidate requests the split (or the mirror) accounts for: `ratio` times the stable revision's. With
    header routes, the candidate's own count also holds the testers' requests, which the engines' metrics cannot
    tell apart (no request carries its route); counting at most this share keeps them from passing a check's
    minRequests alone. No stable figure: nothing is counted."""
    if stable is None or stable.requests is None:
        return 0.0
    return stable.requests * ratio


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


def _serves(weights: dict[str, int], candidate: str, cand: RevisionStats) -> bool:
    """Whether the published routing sends user requests to the candidate (no split: every routable pod)."""
    return weights.get(candidate, 0) > 0 or (not weights and cand.routable_pods > 0)


def _published(weights: dict[str, int], candidate: str, cand: RevisionStats, why: str | None) -> tuple[int, str | None]:
    """(status weight, splitForced) as rendered: no split with candidate pods routable sends users to them."""
    if not weights and cand.routable_pods > 0:
        return 100, (
            "no stable revision with a routable pod: no split rendered, users go to every routable pod of the pool, "
            f"the candidate {candidate}'s"
        )
    return weights.get(candidate, 0), why


def _split(stable: str | None, candidate: str, planned: int, forced_to: str | None) -> dict[str, int]:
    if forced_to is not None:
        return {forced_to: 100}
    if planned >= 100 or stable is None:
        return {candidate: 100} if planned > 0 else {}
    if planned <= 0:
        return {stable: 100}
    return {stable: 100 - planned, candidate: planned}


STEERED_PHASES: tuple[CanaryPhase, ...] = ("Shadow", "Progressing", "Paused")


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
            return _promoted(
                candidate, previous.last_check, previous.last_check_reason, previous.last_check_at, applied.record
            )
    if previous.stage == "Shadow" and spec.shadow is None and previous.phase != "RolledBack":
        previous = go_live(previous, now, "ended: spec.canary.shadow was removed")
    if previous.phase == "RolledBack":
        forced_to, why = forced_split(stable, candidate, revisions)
        forced_to = forced_to if forced_to == candidate else None  # serving beats a 503, nothing else overrides
        weights = _split(stable, candidate, 0, forced_to)
        cand = revisions.get(candidate, RevisionStats())
        weight, why = _published(weights, candidate, cand, why if forced_to else None)
        status = previous.model_copy(
            update={
                "weight": weight,
                "split_forced": why,
                "mirror_percent": None,
                "served_users": previous.served_users or _serves(weights, candidate, cand),
            }
        )
        return CanaryOutcome(status, weights)
    return _progress(spec, previous, revisions, metrics_usable, now, window, target_utilisation)


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


@dataclass(frozen=True)
class _Round:
    """One pass's check round: the check run now (None when none was due) and where the checks stand after it."""

    ran: Check | None
    failed: int
    """Failed checks at this step, this one included."""
    result: CheckResult | None
    reason: str
    checked_at: datetime | None


def _check_round(
    state: CanaryStatus,
    interval: float,
    cand: RevisionStats,
    now: datetime,
    run: Callable[[], Check],
    may_check: bool = True,
) -> _Round:
    """Run `run` when a check is due (`interval` after the last one, `may_check`) and the candidate has routable
    pods, or at once on an incident on a candidate pod (a failed check even if it leaves the candidate without
    pods)."""
    due = may_check and (state.last_check_at is None or (now - state.last_check_at).total_seconds() >= interval)
    ran = run() if cand.incidents or (due and cand.routable_pods > 0) else None
    if ran is None:
        return _Round(None, state.failed_checks, state.last_check, state.last_check_reason, state.last_check_at)
    return _Round(ran, state.failed_checks + (ran.result == "Fail"), ran.result, ran.reason, now)


class _Carried(TypedDict):
    stable_revision: str | None
    candidate_revision: str
    failed_checks: int
    last_check_at: datetime | None
    paused_by: str | None
    last_operation: OperationRecord | None
    served_users: bool


def _carried(
    state: CanaryStatus, candidate: str, cand: RevisionStats, weights: dict[str, int], checks: _Round
) -> _Carried:
    """What the next status of a rollout in progress carries over from `state` and this pass's `checks`."""
    return _Carried(
        stable_revision=state.stable_revision,
        candidate_revision=candidate,
        failed_checks=checks.failed,
        last_check_at=checks.checked_at,
        paused_by=state.paused_by,
        last_operation=state.last_operation,
        served_users=state.served_users or _serves(weights, candidate, cand),
    )


def _progress(
    spec: CanarySpec,
    state: CanaryStatus,
    revisions: dict[str, RevisionStats],
    metrics_usable: bool,
    now: datetime,
    window: float,
    target_utilisation: float,
) -> CanaryOutcome:
    if state.stage == "Shadow" and spec.shadow is not None:
        return _shadow(spec, spec.shadow, state, revisions, metrics_usable, now, window, target_utilisation)
    candidate = state.candidate_revision or ""
    stable = state.stable_revision
    cand = revisions.get(candidate, RevisionStats())
    stable_stats = revisions.get(stable) if stable else None
    caps = capacities(stable_stats, cand) if spec.comparable_load else None

    def run() -> Check:
        planned_now = spec.steps[min(state.step_index or 0, len(spec.steps) - 1)]
        cap = _requests_cap(spec, stable_stats, planned_now, forced_split(stable, candidate, revisions)[0])
        shown = caps.loads(cand, stable_stats) if caps is not None and stable_stats is not None else None
        loads = (caps, shown) if caps is not None and shown is not None else None
        return check(
            spec.analysis,
            cand,
            stable_stats,
            metrics_usable,
            stable_serves=planned_now < 100,
            requests_cap=cap,
            loads=loads,
        )

    # the first live check's window must hold user traffic at this step, not the mirrored copies
    checks = _check_round(state, spec.analysis.interval, cand, now, run, may_check=not after_shadow(state, now, window))
    result, reason = checks.result, checks.reason
    forced_to, forced_why = forced_split(stable, candidate, revisions)
    phase, step_index, started = _next_step(spec, state, cand, result, checks.failed, forced_why, now)
    waits = None
    if phase == "Promoted":
        waits = _held(caps, 100, cand, stable_stats, target_utilisation)
        if waits is None:
            return _promoted(candidate, result, reason, checks.checked_at, state.last_operation)
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
    published = planned if held is None else held[0]
    weights = _split(stable, candidate, published, forced_to)
    weight, forced_why = _published(weights, candidate, cand, forced_why)
    advanced = step_index != state.step_index
    status = CanaryStatus(
        **_carried(state, candidate, cand, weights, checks),
        phase=phase,
        step_index=step_index,
        weight=weight,
        step_weight=planned,
        capacity_held=held[1] if held is not None else None,
        split_forced=forced_why,
        step_started_at=started,
        last_check=None if advanced else result,
        last_check_reason="" if advanced else reason,
        shadow_verdict=state.shadow_verdict,
    )
    message = _message(spec, status, now)
    uncompared = spec.comparable_load and phase == "Progressing" and planned > 0 and not forced_why
    if uncompared and caps is None:
        message += (
            "; load not compared (canary.comparableLoad): a pod without a known class and no learned capacity "
            "on both revisions"
        )
    return CanaryOutcome(status.model_copy(update={"message": message}), weights)


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
    stable revision's); promotion waits for that. None: the step as written."""
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
        why += (
            f"; promotion waits until it can carry the pool's {total:.2f}/s within targetUtilization "
            f"{target_utilisation:.0%}"
            if caps.absolute
            else "; promotion waits until its classes add up to the stable revision's (no learned capacity to "
            "tell what it can carry)"
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


def _shadow(
    spec: CanarySpec,
    shadow: ShadowSpec,
    state: CanaryStatus,
    revisions: dict[str, RevisionStats],
    metrics_usable: bool,
    now: datetime,
    window: float,
    target_utilisation: float,
) -> CanaryOutcome:
    """The shadow stage: users stay on the stable revision; the candidate gets the mirror and is judged on it.

    The pass that ends it must be a check whose whole window (`metrics.window`) had the mirror in place: one taken
    at least `window` seconds after the shadow's clock started (a check from before the mirror judged no copy)."""
    candidate = state.candidate_revision or ""
    stable = state.stable_revision
    cand = revisions.get(candidate, RevisionStats())
    forced_to, forced_why = forced_split(stable, candidate, revisions)
    if forced_to != candidate:  # users are on the stable revision anyway; only serving beats a 503
        forced_to, forced_why = None, None

    def run() -> Check:
        stable_stats = revisions.get(stable) if stable else None
        cap = _split_share(stable_stats, shadow.mirror_percent / 100) if spec.match and forced_to is None else None
        return check(
            shadow.analysis, cand, stable_stats, metrics_usable, stable_serves=forced_to is None, requests_cap=cap
        )

    checks = _check_round(state, shadow.analysis.interval, cand, now, run)
    failed, result, reason, checked_at = checks.failed, checks.result, checks.reason, checks.checked_at
    paused = spec.paused or state.paused_by is not None
    weights = _split(stable, candidate, 0, forced_to)
    weight, forced_why = _published(weights, candidate, cand, forced_why)
    # A mirror copies the stable route's requests: none without that route, or once users are on the candidate.
    users_on_stable = stable is not None and weights.get(stable, 0) == 100
    phase: CanaryPhase
    started = state.step_started_at or now
    if failed >= spec.max_failed_checks:
        phase = "RolledBack"
    elif cand.routable_pods == 0:
        phase, started = "Waiting", now  # nothing to mirror to: the shadow's clock restarts when there is
    elif not users_on_stable:
        phase, started = "Shadow", now  # no mirror (users on the candidate, or no stable route): no shadow time
    else:
        phase = "Paused" if paused else "Shadow"
        if state.phase == "Waiting" or state.mirror_percent is None:
            started = now  # the clock runs only while the mirror is rendered
        elapsed = (now - started).total_seconds()
        evidence = mirrored_evidence(result, checked_at, started, window)
        if phase == "Shadow" and elapsed >= shadow.duration and evidence:
            live = go_live(state, now, f"passed after {elapsed:.0f}s: {reason}")
            return _progress(
                spec,
                live.model_copy(update={"failed_checks": failed, "last_check_at": checked_at}),
                revisions,
                metrics_usable,
                now,
                window,
                target_utilisation,
            )
    mirrored = phase in ("Shadow", "Paused") and users_on_stable and cand.routable_pods > 0
    mirror = Mirror(candidate, shadow.mirror_percent) if mirrored else None
    status = CanaryStatus(
        **_carried(state, candidate, cand, weights, checks),
        phase=phase,
        stage="Shadow",
        step_index=0,
        weight=weight,
        step_weight=0,
        split_forced=forced_why,
        step_started_at=started,
        last_check=result,
        last_check_reason=reason,
        mirror_percent=mirror.percent if mirror else None,
    )
    message = _shadow_message(shadow, status, now, window)
    return CanaryOutcome(status.model_copy(update={"message": message}), weights, mirror)


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


def _promoted(
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
