"""Whether a failed Kubernetes request is sent again (`sluice.core.apiretry.next_try`): table-driven, with the
random draw given."""

from __future__ import annotations

import random

import pytest

from sluice.core.apiretry import Episode, Failure, GiveUp, RetryPolicy, Wait, backoff, next_episode, next_try, troubles
from sluice.core.status import Want, kube_api

POLICY = RetryPolicy()


def test_a_429_with_retry_after_1_waits_1_second_and_sends_again():
    assert next_try(Failure(429, 1.0), 0, left=30.0, draw=0.9, policy=POLICY) == Wait(1.0, "throttled")


def test_a_retry_after_is_waited_out_whatever_the_draw():
    """The server said when: no jitter shortens or stretches it."""
    for draw in (0.0, 0.5, 0.99):
        assert next_try(Failure(429, 4.0), 3, left=30.0, draw=draw, policy=POLICY) == Wait(4.0, "throttled")


def test_a_retry_after_that_ends_past_the_deadline_gives_up_rather_than_send_early():
    assert isinstance(next_try(Failure(429, 5.0), 0, left=4.0, draw=0.0, policy=POLICY), GiveUp)
    assert isinstance(next_try(Failure(429, 5.0), 0, left=5.0, draw=0.0, policy=POLICY), GiveUp)
    assert next_try(Failure(429, 5.0), 0, left=5.1, draw=0.0, policy=POLICY) == Wait(5.0, "throttled")


def test_a_retry_after_longer_than_priority_and_fairness_ever_asks_gives_up():
    decision = next_try(Failure(429, 33.0), 0, left=1000.0, draw=0.0, policy=POLICY)
    assert isinstance(decision, GiveUp)
    assert "33" in decision.why
    assert next_try(Failure(429, 32.0), 0, left=1000.0, draw=0.0, policy=POLICY) == Wait(32.0, "throttled")


def test_a_fenced_write_never_waits_past_the_validity_left():
    """`left` is the Lease's remaining validity for a fenced write: a back-off that would end after it gives up, so
    the write is not sent after the validity."""
    rng = random.Random(7)
    for retries in range(10):
        for left in (0.05, 0.3, 1.0, 2.5, 7.9):
            for failure in (Failure(500), Failure(0), Failure(503, 2.0), Failure(429, 1.0)):
                decision = next_try(failure, retries, left, rng.random(), POLICY)
                assert isinstance(decision, GiveUp) or decision.seconds < left


def test_a_500_backs_off_exponentially_with_jitter_and_gives_up_after_the_limit():
    rng = random.Random(42)
    waits = []
    retries = 0
    while True:
        draw = rng.random()
        decision = next_try(Failure(500), retries, left=1000.0, draw=draw, policy=POLICY)
        if isinstance(decision, GiveUp):
            break
        base = min(POLICY.cap, POLICY.backoff * POLICY.factor**retries)
        assert decision == Wait(pytest.approx(base * (1 + POLICY.jitter * draw)), "server_error")
        waits.append(decision.seconds)
        retries += 1
    assert retries == POLICY.max_retries == 10
    assert "10 retries" in decision.why
    assert waits[0] < waits[1] < waits[2] < waits[3]  # doubling outgrows the jitter (at most x1.5)
    assert max(waits) <= POLICY.cap * (1 + POLICY.jitter)


def test_no_answer_backs_off_as_a_5xx_does():
    assert next_try(Failure(0), 0, left=30.0, draw=0.0, policy=POLICY) == Wait(0.2, "no_answer")
    assert next_try(Failure(504), 2, left=30.0, draw=0.0, policy=POLICY) == Wait(0.8, "server_error")


def test_a_5xx_with_a_retry_after_longer_than_the_back_off_waits_the_retry_after():
    assert next_try(Failure(503, 3.0), 0, left=30.0, draw=0.0, policy=POLICY) == Wait(3.0, "server_error")
    assert next_try(Failure(503, 0.0), 0, left=30.0, draw=0.0, policy=POLICY) == Wait(0.2, "server_error")


def test_a_429_without_retry_after_backs_off():
    assert next_try(Failure(429), 1, left=30.0, draw=0.0, policy=POLICY) == Wait(0.4, "throttled")


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 410, 422])
def test_an_answer_that_would_be_the_same_again_is_not_retried(status):
    decision = next_try(Failure(status, 1.0), 0, left=30.0, draw=0.0, policy=POLICY)
    assert isinstance(decision, GiveUp)
    assert str(status) in decision.why


def test_a_costly_list_waits_only_for_a_retry_after():
    lists = RetryPolicy(backs_off=False)
    assert next_try(Failure(429, 1.0), 0, left=30.0, draw=0.0, policy=lists) == Wait(1.0, "throttled")
    for failure in (Failure(429), Failure(500), Failure(503, 1.0), Failure(0)):
        assert isinstance(next_try(failure, 0, left=30.0, draw=0.0, policy=lists), GiveUp)


def test_the_back_off_is_capped_before_its_jitter():
    assert backoff(POLICY, 30, 0.0) == POLICY.cap
    assert backoff(POLICY, 30, 0.999) == pytest.approx(POLICY.cap * 1.4995)


@pytest.mark.parametrize("name", ["max_retries", "max_retry_after", "backoff", "factor", "cap", "jitter"])
def test_a_negative_setting_is_refused_by_name(name):
    with pytest.raises(ValueError, match=f"RetryPolicy.{name} must not be negative"):
        RetryPolicy(**{name: -1})


def test_a_request_cut_off_from_the_api_is_sent_again_at_client_gos_pace_whatever_the_retry():
    """client-go sends a request that got no answer again after a second (`Retry-After: 1`); the back-off after a
    5xx or no answer never waits much longer (its 50 % jitter on top), so a pass cut off from the API resumes
    within about a second and a half of the API answering again, not 7.5 s later (a 5 s cap did: the chaos
    matrix's API blackout resumed in 3.5 intervals of 2 s)."""
    for failure in (Failure(0), Failure(503), Failure(500)):
        waits = [next_try(failure, retries, left=1000.0, draw=0.999, policy=POLICY) for retries in range(10)]
        assert all(isinstance(w, Wait) for w in waits)
        assert max(w.seconds for w in waits if isinstance(w, Wait)) <= 1.5


# ------------------------------------------------------------------------- API trouble episodes (KubeApiHealthy)


def test_a_pass_that_met_failures_or_slow_answers_met_trouble() -> None:
    assert troubles({}, 0.5, 0.2, 2.0) == frozenset()
    assert troubles({"throttled": 0}, 0.5, 0.2, 2.0) == frozenset()
    assert troubles({"throttled": 2, "server_error": 1}, 0.5, 0.2, 2.0) == {"throttled", "server_error"}
    assert troubles({}, 2.5, 0.5, 2.0) == {"slow"}  # every answer quick, together past the interval
    assert troubles({}, 1.2, 1.1, 2.0) == {"slow"}  # one answer past the API call latency SLO (1 s)
    assert troubles({}, 1.0, 1.0, 2.0) == frozenset()


def test_an_episode_grows_with_each_kind_met_and_ends_three_intervals_after_the_last_trouble() -> None:
    """A fault failing one request in twenty is one episode: the passes between two failures do not end it."""
    first = next_episode(None, frozenset({"throttled"}), 100.0, 2.0)
    assert first == Episode(frozenset({"throttled"}), 100.0)
    grown = next_episode(first, frozenset({"server_error"}), 102.0, 2.0)
    assert grown == Episode(frozenset({"throttled", "server_error"}), 102.0)
    assert next_episode(grown, frozenset(), 107.9, 2.0) is grown  # 5.9 s < 3 intervals
    assert next_episode(grown, frozenset(), 108.0, 2.0) is None
    assert next_episode(None, frozenset(), 108.0, 2.0) is None


def test_kube_api_healthy_names_every_kind_met_worst_first_and_stays_the_same_while_they_do() -> None:
    assert kube_api(None) == Want("KubeApiHealthy", "True", "Answering", "the API server answered this pool's passes")
    want = kube_api(Episode(frozenset({"throttled", "slow", "server_error"}), 0.0))
    assert (want.status, want.reason) == ("False", "ServerErrors")
    assert want.message.index("server errors") < want.message.index("throttled") < want.message.index("slowly")
    later = kube_api(Episode(frozenset({"throttled", "slow", "server_error"}), 500.0))
    assert later == want  # the same kinds, the same condition: no status write from one pass to the next
    assert kube_api(Episode(frozenset({"no_answer", "throttled"}), 0.0)).reason == "NoAnswer"
