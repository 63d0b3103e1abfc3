"""Fast-zeroing of a fresh incident: the errors that entered the rate window since the previous reading.

A pod that starts failing 25 % of its requests one 5 s scrape before a pass shows 25 % x 5 / 60 = 2.1 % over a 60 s
window: below the 10 % fast-zeroing threshold, so it used to be judged a band (x0.75), then below every band for
three passes, while it went on taking its share. With the time of the samples (`signalsSampledAt`), the rise since
the previous reading is read as the rate of the requests since it, on a lower confidence bound.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from sluice.api.v1alpha1 import EndpointStatus, ProtectionSpec
from sluice.core.observed import PodSignals
from sluice.core.protection import assess, fresh_error_rate
from tests.helpers import T0, at, pod, run, sig, spec, weights

WINDOW = 60.0


def _previous(errors: float | None, sampled_seconds_ago: float | None, **fields: object) -> EndpointStatus:
    sampled = None if sampled_seconds_ago is None else T0 - timedelta(seconds=sampled_seconds_ago)
    return EndpointStatus(
        pod="p",
        state="Routable",
        signals=PodSignals(error_rate=errors, request_rate=5.0),
        signals_sampled_at=sampled,
        **fields,
    )


def _now(errors: float, rate: float = 5.0) -> PodSignals:
    return PodSignals(error_rate=errors, request_rate=rate)


def test_an_incident_that_began_a_scrape_ago_is_read_at_its_own_rate() -> None:
    fresh = fresh_error_rate(WINDOW, _previous(0.0, 5.0), _now(0.25 * 5 / 60), T0)
    assert fresh is not None
    assert fresh.rate == pytest.approx(0.25)
    assert fresh.requests == pytest.approx(25.0)
    assert 0.10 < fresh.lower_bound < 0.25


def test_it_zeroes_the_pod_at_once_where_the_window_alone_would_not() -> None:
    protection = ProtectionSpec()
    signals = _now(0.25 * 5 / 60)
    assert signals.error_rate is not None
    assert signals.error_rate < protection.fast_zero_error_rate
    result = assess(protection, WINDOW, pod("p"), _previous(0.0, 5.0), signals, True, True, T0, sampled_at=T0)
    assert result.incident is not None
    assert result.incident.kind == "ErrorRate"
    assert "since the last reading 25.0%" in result.incident.message
    # Without the samples' times (an engine without a freshness query) the old judgement stands: one pass below
    # every band.
    blind = assess(protection, WINDOW, pod("p"), _previous(0.0, None), signals, True, True, T0, sampled_at=None)
    assert blind.incident is None
    assert blind.consecutive_failures == 1


@pytest.mark.parametrize(
    ("case", "previous", "errors", "rate"),
    [
        # One failure among the five requests since: 20 %, but its lower bound is 3.6 %: noise, not a rate.
        ("one error in five requests", (0.0, 5.0), 1 / 60, 1.0),
        ("the same samples read again", (0.02, 0.0), 0.03, 5.0),
        ("samples a window apart", (0.0, 60.0), 0.05, 5.0),
        ("errors falling", (0.05, 5.0), 0.03, 5.0),
        ("no previous error reading", (None, 5.0), 0.03, 5.0),
    ],
)
def test_no_fresh_judgement_without_evidence(
    case: str, previous: tuple[float | None, float], errors: float, rate: float
) -> None:
    fresh = fresh_error_rate(WINDOW, _previous(*previous), _now(errors, rate), T0)
    bound = fresh.lower_bound if fresh is not None else 0.0
    assert bound < ProtectionSpec().fast_zero_error_rate, case


def test_errors_counted_at_a_zeroing_are_not_judged_again_within_the_window() -> None:
    previous = _previous(0.0, 5.0, last_incident_at=T0 - timedelta(seconds=30))
    result = assess(ProtectionSpec(), WINDOW, pod("p"), previous, _now(0.03), True, True, T0, sampled_at=T0)
    assert result.incident is None


def test_two_passes_zero_a_fresh_incident_and_the_row_keeps_the_samples_time() -> None:
    s = spec()
    pods = [pod("a"), pod("b"), pod("c"), pod("d")]
    clean = {p.name: sig() for p in pods}
    first = run(s, pods, clean, 0, sampled_at={p.name: at(0) for p in pods}, freshness_known=True)
    assert {row.pod: row.signals_sampled_at for row in first.status.endpoints} == dict.fromkeys("abcd", at(0))
    # Five seconds later d has failed a quarter of its requests since: 2.1 % over the window.
    failing = {**clean, "d": sig(errors=0.25 * 5 / 60)}
    second = run(s, pods, failing, 5, first.status, sampled_at={p.name: at(5) for p in pods}, freshness_known=True)
    assert weights(second)["d"] == 0
    row = next(r for r in second.status.endpoints if r.pod == "d")
    assert row.incident == "ErrorRate"
    # The same without the samples' times: d is only below every band, still routed.
    blind = run(s, pods, failing, 5, first.status)
    assert weights(blind)["d"] > 0
