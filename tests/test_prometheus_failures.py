"""A shared namespace query that fails: the last good answer serves while it is fresh enough, and it is asked once.

Real prometheus-api-client against a local HTTP server that can be switched to failing. A failed or timed-out
query must not make every pass ask it again (single-flight, with backoff), and the answer passes fall back on
keeps the time it was asked, so the core's staleness rules judge it as what it is: never a fresh number.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest

from sluice.core.engines import SIDECAR
from sluice.core.evidence import judge_metrics
from sluice.core.presets import PRESETS
from sluice.io.prometheus import PromAuth, PromIO
from tests.helpers import T0, FakePrometheus, spec, stepped, vector


class _Prometheus(FakePrometheus):
    """Answers every query with pod `a`'s value, or (while `failing`) an error, as Prometheus does."""

    def __init__(self, port: int = 0) -> None:
        self.failing = False
        self.sample_age = 1.0
        """The newest sample's age when a query is evaluated (`timestamp(...) - time()` answers its negative)."""
        super().__init__(self._respond, port=port)

    def _respond(self, query: str) -> tuple[int, Any]:
        if self.failing:
            return 500, {"status": "error", "errorType": "internal", "error": "query failed"}
        value = str(-self.sample_age) if "(timestamp(" in query else "3"
        return 200, vector([{"metric": {"pod": "a"}, "value": [0, value]}])


@pytest.fixture
def prometheus() -> Iterator[_Prometheus]:
    with _Prometheus() as server:
        yield server


QUERIES = len(PRESETS["vllm"]) - len(SIDECAR) + 1  # the vLLM signals (not the sidecar's), the sample times


def test_after_a_failure_passes_use_the_last_good_answer_with_its_own_time_while_within_stale_after(
    prometheus: _Prometheus,
) -> None:
    io, clock = stepped(preflight=False)
    pool = spec(metrics={"prometheusUrl": prometheus.url, "staleAfter": "4s"}, interval="1s")
    try:
        good = io.read_signals(pool, "llm", ["a"], PromAuth(), T0)
        assert not good.failed
        prometheus.failing = True
        clock.advance(2.1)  # past two intervals: the next pass asks again, and the query fails
        now = T0 + timedelta(seconds=2.1)
        first = io.read_signals(pool, "llm", ["a"], PromAuth(), now)
        prometheus.wait_for(2 * QUERIES)
        clock.advance(0.1)
        after = io.read_signals(pool, "llm", ["a"], PromAuth(), now + timedelta(seconds=0.1))
    finally:
        io.close()
    for snapshot in (first, after):
        assert not snapshot.failed  # the last good answer is 2 s old, within staleAfter 4 s
        assert snapshot.pods["a"].queue_length == 3.0
        assert snapshot.collected_at == T0  # the time that answer was asked, not this pass's
        assert snapshot.sampled_at["a"] <= T0  # its samples keep their own time
    verdict = judge_metrics(pool, after, now + timedelta(seconds=0.1))
    assert verdict.usable


def test_a_last_good_answer_older_than_stale_after_is_not_used_the_failure_is_reported(prometheus: _Prometheus) -> None:
    io, clock = stepped(preflight=False)
    pool = spec(metrics={"prometheusUrl": prometheus.url, "staleAfter": "1s"}, interval="1s")
    try:
        io.read_signals(pool, "llm", ["a"], PromAuth(), T0)
        prometheus.failing = True
        clock.advance(2.1)  # past two intervals and past staleAfter: the next pass asks again, and it fails
        late = io.read_signals(pool, "llm", ["a"], PromAuth(), T0 + timedelta(seconds=2.1))
    finally:
        io.close()
    assert len(late.failed) == QUERIES
    assert late.pods == {}  # never the old numbers as if they were now
    assert not judge_metrics(pool, late, T0 + timedelta(seconds=2.1)).usable


def test_a_failed_query_is_asked_once_for_all_passes_and_not_again_before_its_backoff(prometheus: _Prometheus) -> None:
    io, clock = stepped(preflight=False)
    pool = spec(metrics={"prometheusUrl": prometheus.url, "staleAfter": "1s"}, interval="1s")
    prometheus.failing = True
    try:
        io.read_signals(pool, "llm", ["a"], PromAuth(), T0)
        assert len(prometheus.seen) == QUERIES
        clock.advance(1.1)  # one interval later: the backoff after one failure is one interval, so one more try

        def one_pass(_: int) -> float:
            start = time.monotonic()
            snapshot = io.read_signals(pool, "llm", ["a"], PromAuth(), T0 + timedelta(seconds=1.1))
            assert len(snapshot.failed) == QUERIES
            return time.monotonic() - start

        with ThreadPoolExecutor(max_workers=16) as passes:
            waited = list(passes.map(one_pass, range(32)))
        prometheus.wait_for(2 * QUERIES)
        clock.advance(0.2)
        assert len(prometheus.seen) == 2 * QUERIES  # 32 passes at once: asked once
        clock.advance(1.2)  # past one interval, but the backoff doubled after the second failure
        io.read_signals(pool, "llm", ["a"], PromAuth(), T0 + timedelta(seconds=2.5))
        clock.advance(0.2)
        assert len(prometheus.seen) == 2 * QUERIES
        clock.advance(1.0)  # two intervals after the second failure: asked once more
        io.read_signals(pool, "llm", ["a"], PromAuth(), T0 + timedelta(seconds=3.7))
        prometheus.wait_for(3 * QUERIES)
        assert len(prometheus.seen) == 3 * QUERIES
    finally:
        io.close()
    assert max(waited) < 1.0  # a pass that has a failure to report does not wait for the retry


def eight_failing_passes(io: PromIO, clock: Any, pool: Any) -> Any:
    """A pass each interval for eight intervals (the clock stepped, the refresher settled); the last one's read."""
    for second in range(1, 9):
        clock.advance(1.0)
        read = io.read_signals(pool, "llm", ["a"], PromAuth(), T0 + timedelta(seconds=second))
        clock.settle()
    return read


def test_a_refused_connection_does_not_double_the_backoff_passes_resume_within_an_interval_of_the_outage() -> None:
    """A Prometheus that refuses connections (restarting: its port closed) is asked nothing: trying again costs it
    nothing. The backoff doubled there too, so after an outage of 8 intervals the query waited 8 more, and the
    pool stayed blind for up to as long as the outage had lasted once Prometheus was back."""
    io, clock = stepped(preflight=False)
    server = _Prometheus()
    port = int(urllib.parse.urlsplit(server.url).port or 0)
    pool = spec(metrics={"prometheusUrl": server.url, "staleAfter": "1s"}, interval="1s")
    try:
        assert not io.read_signals(pool, "llm", ["a"], PromAuth(), T0).failed
        server.refuse()
        assert eight_failing_passes(io, clock, pool).failed  # eight intervals of outage
        server = _Prometheus(port=port)  # back on its port
        clock.advance(1.1)  # the query comes due within an interval of its last refused try
        clock.settle()
        clock.advance(0.1)
        back = io.read_signals(pool, "llm", ["a"], PromAuth(), T0 + timedelta(seconds=9.2))
    finally:
        io.close()
        server.__exit__(None, None, None)
    assert not back.failed
    assert back.pods["a"].queue_length == 3.0


def test_after_a_long_run_of_errors_the_query_is_asked_within_two_intervals_of_its_last_failed_try(
    prometheus: _Prometheus,
) -> None:
    """Prometheus answering every query with an error for 8 intervals (HTTP 500): the backoff
    doubled up to 60 s, so once it answered again a pool stayed blind until the next try — 6 intervals in the
    chaos matrix's prom-error case (docs/chaos-report.md), against its target of two. A query failing on and on is
    asked every other interval: a quarter of the pace of a healthy one (asked again at half an interval)."""
    io, clock = stepped(preflight=False)
    pool = spec(metrics={"prometheusUrl": prometheus.url, "staleAfter": "1s"}, interval="1s")
    try:
        assert not io.read_signals(pool, "llm", ["a"], PromAuth(), T0).failed
        prometheus.failing = True
        assert eight_failing_passes(io, clock, pool).failed  # eight intervals of errors
        asked = len(prometheus.seen)
        prometheus.failing = False
        clock.advance(2.1)  # the query comes due within two intervals of its last failed try
        clock.settle()
        clock.advance(0.1)
        back = io.read_signals(pool, "llm", ["a"], PromAuth(), T0 + timedelta(seconds=10.2))
    finally:
        io.close()
    assert not back.failed
    assert back.pods["a"].queue_length == 3.0
    assert asked <= 6 * QUERIES  # while it failed: the first answer, then tries 1, 2, 2, 2 intervals apart


def test_a_success_after_failures_ends_the_backoff(prometheus: _Prometheus) -> None:
    io, clock = stepped(preflight=False)
    pool = spec(metrics={"prometheusUrl": prometheus.url, "staleAfter": "1s"}, interval="1s")
    prometheus.failing = True
    try:
        io.read_signals(pool, "llm", ["a"], PromAuth(), T0)
        prometheus.failing = False
        clock.advance(0.5)
        io.read_signals(pool, "llm", ["a"], PromAuth(), T0 + timedelta(seconds=0.5))  # still failing: in backoff
        assert len(prometheus.seen) == QUERIES
        clock.advance(0.6)  # asked again when the backoff (one interval) ends
        assert len(prometheus.seen) == 2 * QUERIES
        healed = io.read_signals(pool, "llm", ["a"], PromAuth(), T0 + timedelta(seconds=1.2))
        assert not healed.failed
        assert T0 + timedelta(seconds=0.95) <= healed.collected_at <= T0 + timedelta(seconds=1.2)
        # No backoff left: refreshed every half interval again while passes read it.
        io.read_signals(pool, "llm", ["a"], PromAuth(), T0 + timedelta(seconds=1.5))
        clock.advance(1.0)
        assert len(prometheus.seen) >= 3 * QUERIES
    finally:
        io.close()


def _depth(failure: BaseException | None) -> int:
    depth, tb = 0, failure.__traceback__ if failure is not None else None
    while tb is not None:
        depth, tb = depth + 1, tb.tb_next
    return depth


def test_passes_reading_a_failed_shared_answer_do_not_grow_its_traceback(prometheus: _Prometheus) -> None:
    """Re-raising one stored exception prepends each reader's frames to its traceback: every pass that read a
    failed shared answer stayed alive (its status, spec and report) for as long as the answer was kept."""
    io = PromIO(preflight=False)
    pool = spec(metrics={"prometheusUrl": prometheus.url}, interval="30s")
    prometheus.failing = True
    try:
        io.read_signals(pool, "llm", ["a"], PromAuth(), T0)
        failures = [a.done.exception() for a in io._shares.answers.values()]
        before = max(_depth(f) for f in failures)
        for n in range(20):  # within the backoff: every pass reads the same failed answers
            snapshot = io.read_signals(pool, "llm", ["a"], PromAuth(), T0 + timedelta(seconds=n / 10))
            assert len(snapshot.failed) == QUERIES
        after = max(_depth(a.done.exception()) for a in io._shares.answers.values())
    finally:
        io.close()
    assert after == before


def test_a_step_of_the_wall_clock_does_not_age_an_answer_asked_just_before_it(prometheus: _Prometheus) -> None:
    """The operator's wall clock stepped 30 s forward (an NTP step, a skewed node put right) between asking and
    the next pass: the answer is as old as the process's monotonic clock says, not 30 s."""
    io, clock = stepped(preflight=False)
    pool = spec(metrics={"prometheusUrl": prometheus.url, "staleAfter": "15s"}, interval="2s")
    try:
        io.read_signals(pool, "llm", ["a"], PromAuth(), T0)
        clock.advance(0.5)  # within the answer's time to live: the next pass reads the same answer
        stepped_now = T0 + timedelta(seconds=30.5)
        snapshot = io.read_signals(pool, "llm", ["a"], PromAuth(), stepped_now)
    finally:
        io.close()
    assert snapshot.collected_at == stepped_now - timedelta(seconds=0.5)
    assert "were read" not in judge_metrics(pool, snapshot, stepped_now).message
