"""Table-driven tests of the core's small functions: scorers, penalty, bands, scaling, hysteresis, ramp, floor."""

from __future__ import annotations

from datetime import timedelta

import pytest

from sluice.api.v1alpha1 import EndpointStatus, ProtectionSpec, RecoverySpec, ScoringSpec
from sluice.core.observed import PodSignals
from sluice.core.protection import assess, floor_keep, recovery_phase
from sluice.core.scoring import band_factor, kv_cache_score, latency_penalty, queue_score, signal_factor
from sluice.core.weights import ramp, scale, with_hysteresis
from tests.helpers import T0, pod

S = ScoringSpec()  # alpha 0.7, baseline 100ms, floor 10ms, kv threshold 0.7, queue reference 8


@pytest.mark.parametrize(
    ("usage", "expected"),
    [(None, None), (0.0, 1.0), (0.7, 1.0), (0.85, 0.5), (1.0, 0.0), (1.2, 0.0)],
)
def test_kv_cache_score(usage, expected):
    result = kv_cache_score(S, PodSignals(kv_cache_usage=usage))
    assert result == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize(("waiting", "expected"), [(None, None), (0, 1.0), (8, 0.5), (24, 0.25), (-3, 1.0)])
def test_queue_score(waiting, expected):
    result = queue_score(S, PodSignals(queue_length=waiting))
    assert result == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize(
    ("ttft", "timeout", "expected"),
    [
        (0.1, None, 1.0),  # at the baseline
        (0.3, None, 0.7 * 3 + 0.3),
        (0.001, None, 0.7 * 0.1 + 0.3),  # floored at 10ms
        (0.5, 0.4, 5.0),  # past the timeout: alpha 1
        (0.3, 0.4, 0.7 * 3 + 0.3),
    ],
)
def test_latency_penalty(ttft, timeout, expected):
    scoring = ScoringSpec(ttft_timeout=timeout)
    assert latency_penalty(scoring, ttft) == pytest.approx(expected)


def test_signal_factor_multiplies_scorers_by_their_coefficients_and_ignores_missing():
    assert signal_factor(S, PodSignals()) == 1.0
    # kv 0.85 -> s=0.5, c=0.5 -> 0.75; queue 8 -> s=0.5, c=0.5 -> 0.75
    assert signal_factor(S, PodSignals(kv_cache_usage=0.85, queue_length=8)) == pytest.approx(0.5625)
    off = ScoringSpec(kv_cache_coefficient=0, queue_coefficient=0)
    assert signal_factor(off, PodSignals(kv_cache_usage=1.0, queue_length=100)) == 1.0


@pytest.mark.parametrize(
    ("errors", "p95", "expected"),
    [
        (None, None, (1.0, False)),
        (0.0, None, (1.0, False)),
        (0.005, None, (1.0, False)),
        (0.01, None, (0.75, False)),
        (0.02, None, (0.75, False)),
        (0.03, None, (0.2, True)),
    ],
)
def test_default_bands_follow_seed_003(errors, p95, expected):
    assert band_factor(ProtectionSpec(), PodSignals(error_rate=errors, ttft_p95_seconds=p95)) == expected


def test_bands_with_latency_limits_are_applied_in_error_rate_order():
    protection = ProtectionSpec.model_validate(
        {
            "bands": [
                {"maxErrorRate": 0.02, "maxTtftP95": "800ms", "weightPercent": 75},
                {"maxErrorRate": 0.005, "maxTtftP95": "200ms", "weightPercent": 100},
            ]
        }
    )
    assert band_factor(protection, PodSignals(error_rate=0.0, ttft_p95_seconds=0.1)) == (1.0, False)
    assert band_factor(protection, PodSignals(error_rate=0.0, ttft_p95_seconds=0.5)) == (0.75, False)
    assert band_factor(protection, PodSignals(error_rate=0.0, ttft_p95_seconds=0.9)) == (0.2, True)


@pytest.mark.parametrize(
    ("scores", "expected"),
    [
        ({"a": 10.0, "b": 5.0, "c": 0.001}, {"a": 1000, "b": 500, "c": 1}),
        ({"a": 3.0}, {"a": 1000}),
        ({"a": 0.0, "b": 0.0}, {"a": 1, "b": 1}),
        ({}, {}),
    ],
)
def test_scale(scores, expected):
    assert scale(scores, S) == expected


@pytest.mark.parametrize(
    ("new", "previous", "percent", "expected"),
    [
        (105, 100, 10, 100),
        (111, 100, 10, 111),
        (90, 100, 10, 100),
        (89, 100, 10, 89),
        (5, None, 10, 5),
        (0, 50, 10, 0),
        (7, 0, 10, 7),
    ],
)
def test_hysteresis(new, previous, percent, expected):
    assert with_hysteresis(new, previous, percent) == expected


@pytest.mark.parametrize(
    ("scored", "percent", "expected"), [(100, 1.0, 1), (1000, 1.0, 10), (100, 33.75, 34), (3, 1.0, 1)]
)
def test_ramp(scored, percent, expected):
    assert ramp(scored, percent, S) == expected


@pytest.mark.parametrize(
    ("elapsed", "phase", "percent"),
    [
        (0, "quiet", 0.0),
        (29.9, "quiet", 0.0),
        (30, "ramp", 1.0),
        (39.9, "ramp", 1.0),
        (40, "ramp", 1.5),
        (50, "ramp", 2.25),
        (120, "ramp", 1.5**9),  # 38.4%
        (130, "normal", 100.0),  # 57.7% > cap 50%
        (10_000, "normal", 100.0),
    ],
)
def test_recovery_phase(elapsed, phase, percent):
    result = recovery_phase(RecoverySpec(), T0, T0 + timedelta(seconds=elapsed))
    assert result.name == phase
    assert result.percent == pytest.approx(percent)


def test_no_incident_is_normal():
    assert recovery_phase(RecoverySpec(), None, T0).name == "normal"


@pytest.mark.parametrize(
    ("ready", "percent", "keep"), [(0, 50, 0), (1, 0, 1), (4, 50, 2), (5, 50, 3), (10, 0, 1), (10, 100, 10), (3, 34, 2)]
)
def test_floor_keep(ready, percent, keep):
    assert floor_keep(ready, percent) == keep


def _row(**fields):
    return EndpointStatus(pod="p", state="Routable", **fields)


@pytest.mark.parametrize(
    ("case", "pod_fields", "previous", "signals", "usable", "below", "kind", "streak"),
    [
        ("healthy", {}, {}, PodSignals(error_rate=0.0), True, False, None, 0),
        (
            "oom",
            {"restarts": 2, "last_termination_reason": "OOMKilled"},
            {"restarts": 1},
            PodSignals(),
            True,
            False,
            "OOMKilled",
            0,
        ),
        (
            "restart",
            {"restarts": 1, "last_termination_reason": "Error"},
            {"restarts": 0},
            PodSignals(),
            True,
            False,
            "Restarted",
            0,
        ),
        ("first sight of a restarted pod", {"restarts": 5}, None, PodSignals(), True, False, None, 0),
        (
            "oom during outage",
            {"restarts": 1, "last_termination_reason": "OOMKilled"},
            {"restarts": 0},
            PodSignals(),
            False,
            False,
            "OOMKilled",
            0,
        ),
        ("errors", {}, {}, PodSignals(error_rate=0.2), True, True, "ErrorRate", 0),
        ("errors during outage", {}, {}, PodSignals(error_rate=0.2), False, True, None, 0),
        ("lora", {}, {}, PodSignals(lora_failure_rate=0.05), True, False, "LoraFailures", 0),
        ("below bands once", {}, {"consecutive_failures": 0}, PodSignals(error_rate=0.05), True, True, None, 1),
        (
            "below bands third time",
            {},
            {"consecutive_failures": 2},
            PodSignals(error_rate=0.05),
            True,
            True,
            "ConsecutiveFailures",
            0,
        ),
        ("streak reset", {}, {"consecutive_failures": 2}, PodSignals(error_rate=0.0), True, False, None, 0),
    ],
)
def test_assess(case, pod_fields, previous, signals, usable, below, kind, streak):
    previous_row = None if previous is None else _row(**previous)
    result = assess(ProtectionSpec(), 60.0, pod("p", **pod_fields), previous_row, signals, usable, below, T0)
    assert (result.incident.kind if result.incident else None) == kind, case
    assert result.consecutive_failures == streak, case
