"""The shared answers' policy alone (`sluice.io.promshare`): no thread, no clock, no Prometheus — the test sends,
answers and steps time itself."""

from __future__ import annotations

from sluice.io.ports import PromAuth
from sluice.io.promrecords import Answer, QueryKey, Reading, Send, backoff_wait
from sluice.io.promshare import SharedAnswers
from tests.helpers import T0

KEY = QueryKey("http://prometheus:9090", PromAuth(), 5.0, "pod", "sum by (pod) (up)")


def _never(pods: frozenset[str] | None) -> dict[str, float]:
    raise AssertionError("the policy never runs a query itself")


def _shares() -> tuple[SharedAnswers, list[Send]]:
    sent: list[Send] = []
    return SharedAnswers(sent.append, lambda: None), sent


def _read(shares: SharedAnswers, at: float) -> Answer:
    """A pass of a pool with a 10 s interval and a 30 s staleAfter."""
    return shares.read(Reading(KEY, _never, 10.0, 30.0), T0, at)


def _answer(shares: SharedAnswers, send: Send, at: float, failure: Exception | None = None) -> None:
    if failure is None:
        send.answer.done.set_result({"a": 1.0})
    else:
        send.answer.done.set_exception(failure)
    shares.answered(send.key, send.answer, send.ttl, at)


def test_the_backoff_doubles_from_one_interval_up_to_two_and_never_past_a_minute_unless_one_interval_is() -> None:
    assert [backoff_wait(n, 5.0) for n in (1, 2, 3, 4, 5)] == [5.0, 10.0, 10.0, 10.0, 10.0]
    assert [backoff_wait(n, 40.0) for n in (1, 2, 3)] == [40.0, 60.0, 60.0]
    assert backoff_wait(3, 120.0) == 120.0  # never shorter than one interval


def test_passes_that_read_a_query_at_once_share_one_asking() -> None:
    shares, sent = _shares()
    first, second = _read(shares, 0.0), _read(shares, 0.0)
    assert len(sent) == 1
    assert first is second is sent[0].answer
    assert shares.in_flight() == 1


def test_an_answer_is_asked_again_ahead_of_the_passes_and_let_go_when_nobody_reads_it() -> None:
    shares, sent = _shares()
    _read(shares, 0.0)
    _answer(shares, sent[0], 0.0)
    shares.refresh(4.9)
    assert len(sent) == 1  # half an interval not over yet
    shares.refresh(5.0)
    assert len(sent) == 2
    _answer(shares, sent[1], 5.0)
    shares.refresh(25.1)  # nobody read it for two intervals
    assert len(sent) == 2
    assert KEY not in shares.wanted


def test_while_a_query_fails_passes_read_its_last_good_answer_and_it_is_asked_once_per_backoff() -> None:
    shares, sent = _shares()
    _read(shares, 0.0)
    _answer(shares, sent[0], 0.0)
    _read(shares, 6.0)  # past half an interval: asked again
    _answer(shares, sent[1], 6.0, OSError("refused"))
    assert _read(shares, 7.0) is sent[0].answer  # the last good one, within staleAfter
    assert len(sent) == 2  # not before the backoff's end (one interval)
    _read(shares, 16.0)
    assert len(sent) == 3
