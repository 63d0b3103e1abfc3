"""Protection: fast-zeroing, consecutive-failure breaking, gradual recovery and the routable floor. Pure.

A pod's protection phase is a function of its last incident time and `now` alone (zeroed during the quiet
period, then a geometric ramp, then normal scoring), so it survives an operator restart: the incident time
lives in the pool's status.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Literal, NamedTuple

from sluice.api.v1alpha1 import EndpointStatus, ProtectionSpec, RecoverySpec
from sluice.core.observed import ObservedPod, PodSignals

IncidentKind = Literal["OOMKilled", "Restarted", "LoraFailures", "ErrorRate", "ConsecutiveFailures"]
SEVERITY: dict[str, int] = {
    "OOMKilled": 5,
    "Restarted": 4,
    "LoraFailures": 3,
    "ErrorRate": 2,
    "ConsecutiveFailures": 1,
}


class Incident(NamedTuple):
    kind: IncidentKind
    message: str


class Assessment(NamedTuple):
    """This pass's verdict on one pod's health evidence."""

    incident: Incident | None
    consecutive_failures: int


def assess(
    protection: ProtectionSpec,
    window: float,
    pod: ObservedPod,
    previous: EndpointStatus | None,
    signals: PodSignals,
    metrics_usable: bool,
    below_bands: bool,
    now: datetime,
    repeated: bool = False,
    sampled_at: datetime | None = None,
) -> Assessment:
    """Look for an incident: restarts from the pod's status (always), metric thresholds (only with fresh metrics).

    `repeated`: the error-rate reading is the one the previous pass judged — it cannot be another pass in a row
    below every band (an error rate past the fast-zeroing threshold still zeroes: the window guard below keeps one
    reading from firing twice).

    Metric evidence is ignored until a full rate window has passed since the last incident, so the errors that
    caused a zeroing are not counted again when the pod comes back.

    `sampled_at`: when this reading's samples were scraped (None where the engine does not tell). With it and the
    previous pass's reading, the errors that entered the window since then are judged too (`fresh_error_rate`):
    a window-long rate dilutes an incident that began a scrape ago by the window's length.
    """
    streak = previous.consecutive_failures if previous else 0
    restart = _restart_incident(protection, pod, previous)
    if restart is not None:
        return Assessment(restart, 0)
    if not metrics_usable:
        return Assessment(None, streak)
    last = previous.last_incident_at if previous else None
    if last is not None and (now - last).total_seconds() < window:
        return Assessment(None, streak)
    incident = _metric_incident(protection, window, previous, signals, sampled_at)
    if incident is not None:
        return Assessment(incident, 0)
    return _failure_streak(protection, streak, below_bands, repeated, signals.error_rate)


def _restart_incident(protection: ProtectionSpec, pod: ObservedPod, previous: EndpointStatus | None) -> Incident | None:
    """A restart since the previous pass, from the pod's status: an OOM kill or any restart, as configured."""
    if previous is not None and pod.restarts > previous.restarts:
        reason = pod.last_termination_reason or "unknown"
        if reason == "OOMKilled" and protection.zero_on_oom:
            return Incident("OOMKilled", f"container OOMKilled (restart #{pod.restarts})")
        if protection.zero_on_restart:
            return Incident("Restarted", f"container restarted, reason {reason} (#{pod.restarts})")
    return None


def _metric_incident(
    protection: ProtectionSpec,
    window: float,
    previous: EndpointStatus | None,
    signals: PodSignals,
    sampled_at: datetime | None,
) -> Incident | None:
    """A metric past its fast-zeroing threshold: LoRA load failures, the error rate over the window, or the error
    rate since the previous reading (`fresh_error_rate`)."""
    lora = signals.lora_failure_rate
    if lora is not None and lora >= protection.lora_failure_rate:
        return Incident("LoraFailures", f"LoRA load failures {lora:.1%} >= {protection.lora_failure_rate:.1%}")
    errors = signals.error_rate
    if errors is not None and errors >= protection.fast_zero_error_rate:
        return Incident("ErrorRate", f"error rate {errors:.1%} >= {protection.fast_zero_error_rate:.1%}")
    fresh = fresh_error_rate(window, previous, signals, sampled_at)
    if fresh is not None and fresh.lower_bound >= protection.fast_zero_error_rate:
        return Incident(
            "ErrorRate",
            f"error rate since the last reading {fresh.rate:.1%} of ~{fresh.requests:.0f} requests "
            f"(at least {fresh.lower_bound:.1%}) >= {protection.fast_zero_error_rate:.1%}; "
            f"{errors:.1%} over the window",
        )
    return None


def _failure_streak(
    protection: ProtectionSpec, streak: int, below_bands: bool, repeated: bool, errors: float | None
) -> Assessment:
    """Passes in a row below every health band (a repeated reading is not another pass): an incident from
    `consecutiveFailures` of them."""
    if not below_bands:
        return Assessment(None, 0)
    if repeated:
        return Assessment(None, streak)
    streak += 1
    if streak >= protection.consecutive_failures:
        return Assessment(
            Incident(
                "ConsecutiveFailures",
                f"below every health band {streak} passes in a row (errors {errors:.1%})",
            ),
            0,
        )
    return Assessment(None, streak)


CONFIDENCE_Z = 1.96
"""Normal quantile of the one-sided bound a fresh error rate must clear (97.5 %): a few failures among a handful of
requests since the last reading are no evidence of a rate (one error in five requests is 20 %, its bound 3.6 %)."""


class FreshErrors(NamedTuple):
    """The errors that entered the rate window since the previous reading, as a share of the requests since."""

    rate: float
    requests: float
    lower_bound: float


def fresh_error_rate(
    window: float, previous: EndpointStatus | None, signals: PodSignals, sampled_at: datetime | None
) -> FreshErrors | None:
    """The error share of the requests since the previous reading, d seconds of samples ago, or None.

    A rate over a window W at t2 counts the errors of (t2 - W, t2]; those of (t2 - W, t1] are a subset of what the
    previous reading at t1 counted. So at a steady request rate N / W the requests of (t1, t2] hold at least
    (e2 - e1) N errors of N d / W requests: a share of at least (e2 - e1) W / d. An incident that began a scrape ago
    shows e2 = rate x d / W over the window, which this reads back as the rate. Only when the samples moved on
    (0 < d < W), the window's error rate rose and the requests since are known (request rate x d); judged on the
    Wilson lower bound (`CONFIDENCE_Z`) of that share among those requests, so noise does not zero a pod.
    """
    if previous is None or sampled_at is None or previous.signals_sampled_at is None:
        return None
    before, now_errors, rate = previous.signals.error_rate, signals.error_rate, signals.request_rate
    if before is None or now_errors is None or rate is None or now_errors <= before:
        return None
    elapsed = (sampled_at - previous.signals_sampled_at).total_seconds()
    if not 0 < elapsed < window:
        return None
    share = min(1.0, (now_errors - before) * window / elapsed)
    requests = rate * elapsed
    if requests <= 0:
        return None
    z2 = CONFIDENCE_Z * CONFIDENCE_Z
    centre = share + z2 / (2 * requests)
    spread = CONFIDENCE_Z * math.sqrt(share * (1 - share) / requests + z2 / (4 * requests * requests))
    return FreshErrors(share, requests, max(0.0, (centre - spread) / (1 + z2 / requests)))


PhaseName = Literal["normal", "quiet", "ramp"]


class Phase(NamedTuple):
    """Where a pod stands after its last incident: zeroed (quiet), ramping at `percent`, or normal."""

    name: PhaseName
    percent: float = 100.0
    remaining_quiet: float = 0.0


def recovery_phase(recovery: RecoverySpec, last_incident_at: datetime | None, now: datetime) -> Phase:
    """Seed 003's ramp: quiet period, then initial% x growth^k every step interval, until past the cap."""
    if last_incident_at is None:
        return Phase("normal")
    elapsed = (now - last_incident_at).total_seconds()
    if elapsed < recovery.quiet_period:
        return Phase("quiet", 0.0, recovery.quiet_period - elapsed)
    steps = math.floor((elapsed - recovery.quiet_period) / recovery.step_interval)
    # Past ~60 steps the ramp is over whatever the factors; this also keeps the power finite.
    percent = recovery.initial_percent * recovery.growth_factor ** min(steps, 60)
    if percent > recovery.cap_percent:
        return Phase("normal")
    return Phase("ramp", percent)


def floor_keep(ready_pods: int, min_routable_percent: int) -> int:
    """How many ready pods must stay routable: the floor, and never zero (one pod at least)."""
    if ready_pods == 0:
        return 0
    return max(1, math.ceil(ready_pods * min_routable_percent / 100.0))


def spare_order(
    kind: str | None, error_rate: float | None, last_incident_at: datetime | None
) -> tuple[int, float, float]:
    """Sort key among pods sluice wants zeroed when the floor spares some: the mildest, oldest incident first."""
    stamp = last_incident_at.timestamp() if last_incident_at else 0.0
    return (SEVERITY.get(kind or "", 0), error_rate or 0.0, stamp)
