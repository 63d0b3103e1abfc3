"""The Lease loop of `ShardLeases`, round by round, against Leases kept in memory (resourceVersions, 409s)."""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from sluice.core.shards import Fence
from sluice.io.kubereads import load_api_client
from sluice.runtime.sharding import ShardLeases, _Stopping
from tests.helpers import loopback_kubeconfig
from tests.test_sharding_runtime import Clock, FakeLeaseApi, faked

SHARD = "sluice-shard-{}-of-4"


def holders(api: FakeLeaseApi) -> dict[int, str | None]:
    return {
        i: api.items[SHARD.format(i)]["spec"].get("holderIdentity") for i in range(4) if SHARD.format(i) in api.items
    }


def test_a_replica_alone_takes_every_shard_and_renews_them_before_they_lapse() -> None:
    api, clock = FakeLeaseApi(), Clock()
    a = faked(api=api, identity="a", clock=clock)
    a.step()
    assert a.held() == [0, 1, 2, 3]
    assert holders(api) == {0: "a", 1: "a", 2: "a", 3: "a"}
    versions = {i: api.items[SHARD.format(i)]["metadata"]["resourceVersion"] for i in range(4)}
    clock.now += 2.0
    a.step()  # within renew_every (3 s): nothing written
    assert {i: api.items[SHARD.format(i)]["metadata"]["resourceVersion"] for i in range(4)} == versions
    clock.now += 1.5
    a.step()
    assert all(api.items[SHARD.format(i)]["metadata"]["resourceVersion"] != versions[i] for i in range(4))
    clock.now += 7.9  # 8 s after the renewal sent at +3.5, less a tenth
    assert a.held() == [0, 1, 2, 3]
    clock.now += 0.2
    assert a.held() == [], "without a renewal the replica stops acting 2 s before the Lease expires"


def test_a_second_replica_gets_its_share_after_the_first_gives_it_up_with_the_margin() -> None:
    api, clock_a, clock_b = FakeLeaseApi(), Clock(), Clock()
    a = faked(api=api, identity="a", clock=clock_a)
    b = faked(api=api, identity="b", clock=clock_b)
    a.step()
    b.step()  # b's member Lease appears; every shard is a's and not expired: b takes nothing
    assert b.held() == []
    clock_a.now += 1.0
    a.step()  # two live replicas: a is over its share (2) and gives two up; their fence closes at once
    given = [i for i in range(4) if not a.holds(i)]
    assert len(given) == 2
    assert all(holders(api)[i] == "a" for i in given), "the Leases are not cleared before the margin"
    clock_a.now += 2.0
    a.step()
    assert all(holders(api)[i] is None for i in given)
    clock_b.now += 3.0
    b.step()
    assert sorted(b.held()) == given
    assert sorted(a.held() + b.held()) == [0, 1, 2, 3]


def test_a_lease_taken_by_another_or_a_conflicting_renewal_loses_the_shard() -> None:
    api, clock = FakeLeaseApi(), Clock()
    a = faked(api=api, identity="a", clock=clock)
    a.step()
    api.items[SHARD.format(1)]["spec"]["holderIdentity"] = "other"
    clock.now += 1.0
    a.step()
    assert not a.holds(1)
    original = api.replace_namespaced_lease

    def conflict(name: str, *args: object, **kwargs: object) -> object:
        if name == SHARD.format(2):
            raise ApiException(status=409, reason="Conflict")
        return original(name, *args, **kwargs)  # type: ignore[arg-type]

    api.replace_namespaced_lease = conflict  # type: ignore[method-assign]
    clock.now += 3.0
    a.step()
    assert not a.holds(2)
    assert a.holds(0)
    assert a.holds(3)
    assert [what for _, i, what in a.transitions if i in (1, 2) and what.startswith("lost")] == [
        "lost (taken by other)",
        "lost (conflict on renewal)",
    ]


def test_the_shards_of_a_replica_that_stopped_renewing_are_taken_once_their_record_is_duration_old() -> None:
    api, clock_a, clock_b = FakeLeaseApi(), Clock(), Clock()
    a = faked(api=api, identity="a", clock=clock_a)
    b = faked(api=api, identity="b", clock=clock_b)
    a.step()  # then a dies: no more rounds
    b.step()
    assert b.held() == []
    clock_b.now += 9.5
    b.step()
    assert b.held() == [], "not before leaseDurationSeconds on b's own clock"
    clock_b.now += 1.0
    b.step()
    assert b.held() == [0, 1, 2, 3]


def test_stop_clears_the_shard_leases_and_deletes_the_member_lease() -> None:
    api, clock = FakeLeaseApi(), Clock()
    a = faked(api=api, identity="a", clock=clock)
    a.step()
    member = a.member
    assert member in api.items
    a.stop()
    assert holders(api) == {0: None, 1: None, 2: None, 3: None}
    assert member not in api.items
    assert a.held() == []
    writes = len(api.calls)
    clock.now += 1.0
    with pytest.raises(_Stopping):
        a.step()  # a round after stop (its thread stuck past the join) writes nothing that takes or keeps a shard
    assert len(api.calls) == writes
    assert holders(api) == {0: None, 1: None, 2: None, 3: None}


def test_a_shard_given_up_is_cleared_only_once_its_calls_in_flight_have_ended_or_its_validity_has() -> None:
    api, clock = FakeLeaseApi(), Clock()
    a = faked(api=api, identity="a", clock=clock)
    a.step()
    index = 1
    term = a.term(index)
    with a.tenures.writing(Fence(index, term)):  # a fenced call under way when the shard is given up
        a.tenures.releasing[index] = clock.now + a.margin
        clock.now += a.margin
        a.step()
        assert holders(api)[index] == "a", "cleared while a call of the shard was in flight"
    clock.now += 0.5
    a.step()
    assert holders(api)[index] is None
    with a.tenures.writing(Fence(2, a.term(2))):  # one that does not return: cleared once the validity ended
        a.tenures.releasing[2] = clock.now + a.margin
        clock.now += 8.0
        a.step()
        assert holders(api)[2] is None


def test_shards_that_lapse_while_the_api_is_unreachable_are_lost_and_their_pools_woken() -> None:
    """The API down: no round gets past its list, and no renewal fails with an answer. The shards' validity runs
    out all the same; that is a loss like any other (their pools' daemons are woken to stop reporting them),
    and taking them back later begins a new term."""
    api, clock = FakeLeaseApi(), Clock()
    a = faked(api=api, identity="a", clock=clock)
    woken: list[int] = []
    a.on_change = woken.append
    a.step()
    terms = {i: a.term(i) for i in range(4)}
    woken.clear()
    working = api.list_namespaced_lease

    def unreachable(*_: object, **__: object) -> object:
        raise ConnectionError("the API server is unreachable")

    renew = api.replace_namespaced_lease
    api.list_namespaced_lease = unreachable  # type: ignore[method-assign]
    api.replace_namespaced_lease = unreachable  # type: ignore[method-assign]
    clock.now += 7.9  # within the 8 s of validity: nothing lost yet
    with pytest.raises(ConnectionError):
        a.step()
    assert woken == []
    clock.now += 0.2
    with pytest.raises(ConnectionError):
        a.step()
    assert sorted(woken) == [0, 1, 2, 3]
    assert all(what == "lost (lapsed without a renewal)" for _, _, what in a.transitions[-4:])
    api.list_namespaced_lease = working  # type: ignore[method-assign]
    api.replace_namespaced_lease = renew  # type: ignore[method-assign]
    clock.now += 1.0
    a.step()  # the Leases are still its own (nobody took them): taken again, in new terms
    assert a.held() == [0, 1, 2, 3]
    assert all(a.term(i) != terms[i] for i in range(4))


def test_a_renewal_without_an_answer_does_not_stop_the_other_shards_renewing() -> None:
    api, clock = FakeLeaseApi(), Clock()
    a = faked(api=api, identity="a", clock=clock)
    a.step()
    versions = {i: api.items[SHARD.format(i)]["metadata"]["resourceVersion"] for i in range(4)}
    original = api.replace_namespaced_lease

    def timing_out(name: str, *args: object, **kwargs: object) -> object:
        if name == SHARD.format(0):
            raise TimeoutError("read timed out")
        return original(name, *args, **kwargs)  # type: ignore[arg-type]

    api.replace_namespaced_lease = timing_out  # type: ignore[method-assign]
    clock.now += 3.5
    a.step()
    assert [i for i in range(4) if api.items[SHARD.format(i)]["metadata"]["resourceVersion"] != versions[i]] == [
        1,
        2,
        3,
    ]
    assert a.held() == [0, 1, 2, 3]  # shard 0 still within its validity


def test_a_shard_that_lapses_during_a_round_is_not_renewed_in_its_term() -> None:
    """The round began within the validity, but its list took long enough for the validity to end: the shard is
    lost and taken back in a new term, not renewed as if it had been held all along (a pass of the old term
    would have found its fence open again)."""
    api, clock = FakeLeaseApi(), Clock()
    a = faked(api=api, identity="a", clock=clock)
    a.step()
    terms = {i: a.term(i) for i in range(4)}
    listed = api.list_namespaced_lease

    def slow_list(*args: object, **kwargs: object) -> object:
        clock.now += 8.5  # the validity (8 s) ends while the list is on the wire
        return listed(*args, **kwargs)  # type: ignore[arg-type]

    api.list_namespaced_lease = slow_list  # type: ignore[method-assign]
    a.step()
    assert (
        sorted(what for _, _, what in a.transitions if what.startswith("lost"))
        == ["lost (lapsed without a renewal)"] * 4
    )
    assert a.held() == [0, 1, 2, 3]
    assert all(a.term(i) != terms[i] for i in range(4))


def test_a_failing_wake_hook_is_logged_and_does_not_stop_the_round(caplog: pytest.LogCaptureFixture) -> None:
    """Waking the pools is the hook's business; an error in it must neither end the lease round half-way (the
    shards after it would go untaken) nor pass unseen."""
    api, clock = FakeLeaseApi(), Clock()
    a = faked(api=api, identity="a", clock=clock)
    calls: list[int] = []

    def broken(index: int) -> None:
        calls.append(index)
        raise ValueError("no such pool")

    a.on_change = broken
    with caplog.at_level("ERROR", logger="sluice"):
        a.step()
    assert a.held() == [0, 1, 2, 3]  # every shard taken although each wake-up raised
    assert sorted(calls) == [0, 1, 2, 3]
    failures = [r for r in caplog.records if "waking its pools failed" in r.getMessage()]
    assert len(failures) == 4
    assert all(r.exc_info for r in failures)


def test_a_wake_hook_meeting_a_closed_loop_at_shutdown_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    api, clock = FakeLeaseApi(), Clock()
    a = faked(api=api, identity="a", clock=clock)

    def closed(index: int) -> None:
        raise RuntimeError("Event loop is closed")

    a.on_change = closed
    with caplog.at_level("WARNING", logger="sluice"):
        a.step()
    assert a.held() == [0, 1, 2, 3]
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]


def test_held_shards_are_renewed_when_the_list_fails() -> None:
    """A renewal needs only the resourceVersion this replica last wrote (a 409 says someone else wrote since):
    a list that times out against a busy API server must not cost the shards already held."""
    api, clock = FakeLeaseApi(), Clock()
    a = faked(api=api, identity="a", clock=clock)
    a.step()
    terms = {i: a.term(i) for i in range(4)}

    def busy(*_: object, **__: object) -> object:
        raise TimeoutError("read timed out")

    api.list_namespaced_lease = busy  # type: ignore[method-assign]
    for _ in range(4):  # 14 s of failed lists, past the 8 s validity of the first renewal
        clock.now += 3.5
        with pytest.raises(TimeoutError):
            a.step()
    assert a.held() == [0, 1, 2, 3]
    assert {i: a.term(i) for i in range(4)} == terms, "renewed in their terms, not lost and retaken"
    assert not [what for _, _, what in a.transitions if what.startswith("lost")]


def test_a_renewal_taken_over_while_the_list_fails_is_lost_by_its_conflict() -> None:
    api, clock = FakeLeaseApi(), Clock()
    a = faked(api=api, identity="a", clock=clock)
    a.step()
    api.items[SHARD.format(2)]["metadata"]["resourceVersion"] = "taken"  # another replica wrote it since

    def busy(*_: object, **__: object) -> object:
        raise TimeoutError("read timed out")

    api.list_namespaced_lease = busy  # type: ignore[method-assign]
    clock.now += 3.5
    with pytest.raises(TimeoutError):
        a.step()
    assert a.held() == [0, 1, 3]
    assert [what for _, i, what in a.transitions if i == 2 and what.startswith("lost")] == [
        "lost (conflict on renewal)"
    ]


def test_a_renewal_waits_for_its_answer_no_longer_than_the_validity_left() -> None:
    api, clock = FakeLeaseApi(), Clock()
    a = faked(api=api, identity="a", clock=clock)
    a.step()
    timeouts: list[float] = []
    original = api.replace_namespaced_lease

    def timed(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith("sluice-shard-"):
            timeouts.append(float(kwargs["_request_timeout"]))  # type: ignore[arg-type]
        return original(name, *args, **kwargs)  # type: ignore[arg-type]

    api.replace_namespaced_lease = timed  # type: ignore[method-assign]
    clock.now += 7.0  # 1 s of validity left
    a.step()
    assert len(timeouts) == 4
    assert all(0 < t <= 1.0 for t in timeouts)


def test_a_lease_call_without_an_answer_is_sent_once(tmp_path: Path) -> None:
    """Through the real client against a loopback server that accepts and never answers: with `retries=0` the
    HTTP client does not send the call again (its default sends it four times, each with the full timeout,
    which outlasts the Lease)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    kubeconfig = loopback_kubeconfig(tmp_path / "kubeconfig", port)
    accepted: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                accepted.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        leases = ShardLeases(load_api_client(str(kubeconfig), retries=0), "llm", 4, identity="a", call_timeout=0.3)
        with pytest.raises(Exception, match="timed out"):
            leases.step()
        time.sleep(0.5)  # a retry, if any, would connect now
    finally:
        done.set()
        thread.join()
        for conn in accepted:
            conn.close()
        listener.close()
    assert len(accepted) == 1


def test_a_member_lease_renewal_without_an_answer_does_not_stop_the_round() -> None:
    """The member Lease only tells the others this replica is live: its write timing out must not keep the
    round from taking the shards (at 3,000 pools every round stopped there while the API server lagged)."""
    api, clock = FakeLeaseApi(), Clock()
    a = faked(api=api, identity="a", clock=clock)
    original_create = api.create_namespaced_lease

    def timing_out(namespace: str, body: dict[str, object], **kwargs: object) -> object:
        if body["metadata"]["name"] == a.member:  # type: ignore[index]
            raise TimeoutError("read timed out")
        return original_create(namespace, body, **kwargs)  # type: ignore[arg-type]

    api.create_namespaced_lease = timing_out  # type: ignore[method-assign]
    a.step()
    assert a.held() == [0, 1, 2, 3]


def test_the_member_lease_of_a_replica_gone_for_three_lease_durations_is_deleted() -> None:
    api, clock_a, clock_b = FakeLeaseApi(), Clock(), Clock()
    a = faked(api=api, identity="a", clock=clock_a)
    b = faked(api=api, identity="b", clock=clock_b)
    a.step()
    b.step()  # b's member Lease is written; then b is gone
    gone = b.member
    for _ in range(31):  # rounds a second apart; a first sees b's record 1 s in: 30 s later, three durations old
        clock_a.now += 1.0
        a.step()
    assert gone in api.items
    for _ in range(4):  # deleted at the next round that renews a's own member Lease (every 3 s)
        clock_a.now += 1.0
        a.step()
    assert gone not in api.items
    assert a.member in api.items


class StoppedWhileCreating(FakeLeaseApi):
    """Runs `during` (once) while a shard Lease's create is on the wire: stored, not yet answered."""

    def __init__(self) -> None:
        super().__init__()
        self.during: Any = None

    def create_namespaced_lease(self, namespace: str, body: dict[str, Any], **kwargs: Any) -> Any:
        answer = super().create_namespaced_lease(namespace, body, **kwargs)
        if self.during is not None and "-shard-" in body["metadata"]["name"]:
            during, self.during = self.during, None
            during()
        return answer


def test_a_shard_taken_by_a_write_answered_after_stop_is_given_back() -> None:
    api = StoppedWhileCreating()
    a = faked(api=api, identity="a", clock=Clock())
    api.during = a.stop
    with contextlib.suppress(_Stopping):
        a.step()
    taken = [name for _, verb, name, _ in api.calls if verb == "create" and "-shard-" in name]
    assert len(taken) == 1  # no other shard taken once stopped
    assert len(holders(api)) == 1
    assert all(holder is None for holder in holders(api).values())
    assert a.held() == []


# ---- renewals sent again within the validity


def retrying_on(clock: Any) -> Any:
    """The lease thread's `Retrying` on the test's clock: a wait steps it, the draw is seeded."""
    import random  # noqa: PLC0415

    from sluice.io.kubereads import Retrying  # noqa: PLC0415

    def sleep(seconds: float) -> None:
        clock.now += seconds

    return Retrying(clock=clock, sleep=sleep, draw=random.Random(3).random)


def renewing(api: FakeLeaseApi, clock: Any, failures: dict[int, list[BaseException]]) -> list[tuple[int, float, Any]]:
    """Renewals of shard i fail with `failures[i]`, one per send; every renewal send is recorded as (shard, clock,
    request timeout)."""
    sent: list[tuple[int, float, Any]] = []
    original = api.replace_namespaced_lease

    def replace(name: str, namespace: str, body: dict[str, Any], **kwargs: Any) -> Any:
        index = next((i for i in range(4) if name == SHARD.format(i)), None)
        if index is None:  # the member Lease
            return original(name, namespace, body, **kwargs)
        sent.append((index, clock.now, kwargs.get("_request_timeout")))
        if failures.get(index):
            raise failures[index].pop(0)
        return original(name, namespace, body, **kwargs)

    api.replace_namespaced_lease = replace  # type: ignore[method-assign]
    return sent


def throttled(seconds: str = "1") -> ApiException:
    error = ApiException(status=429, reason="Too Many Requests")
    error.headers = {"Retry-After": seconds}
    return error


def test_a_renewal_answered_429_is_sent_again_after_its_retry_after_and_the_shard_kept() -> None:
    api, clock = FakeLeaseApi(), Clock()
    a = faked(api=api, identity="a", clock=clock)
    a.retrying = retrying_on(clock)
    a.step()
    terms = {i: a.term(i) for i in range(4)}
    sent = renewing(api, clock, {1: [throttled("1")]})
    clock.now += 3.5
    a.step()
    # every shard's first send, then shard 1 again once its Retry-After (1 s) is over, with the short timeout
    assert sorted((i, at) for i, at, _ in sent[:4]) == [(0, 103.5), (1, 103.5), (2, 103.5), (3, 103.5)]
    assert [(i, at) for i, at, _ in sent[4:]] == [(1, 104.5)]
    assert all(timeout == a.renew_timeout for _, _, timeout in sent)
    assert {i: a.term(i) for i in range(4)} == terms
    assert a.tenures.valid_until[1] == 104.5 + a.duration - a.margin  # from the send that succeeded
    assert a.retrying.counts.retries == {"throttled": 1}


def test_a_renewal_that_keeps_failing_is_never_sent_after_the_validity() -> None:
    api, clock = FakeLeaseApi(), Clock()
    a = faked(api=api, identity="a", clock=clock)
    a.retrying = retrying_on(clock)
    a.step()
    until = a.tenures.valid_until[0]
    sent = renewing(api, clock, {0: [ApiException(status=503, reason="Unavailable") for _ in range(50)]})
    clock.now += 3.5
    a.step()
    resends = [(at, timeout) for i, at, timeout in sent if i == 0]
    assert len(resends) > 3  # sent again with a back-off while the validity lasted
    assert all(at < until and at + timeout <= until + 1e-9 for at, timeout in resends)
    assert clock.now < until  # given up before the validity ended
    assert a.term(0) is not None  # held till then


def test_a_conflict_on_a_renewal_sent_again_after_no_answer_is_left_to_the_list() -> None:
    """The first send landed but its answer was lost: sent again with the same resourceVersion, it meets a 409.
    That is not someone else's write: the list of the round shows the Lease still held by this replica."""
    from urllib3.exceptions import ReadTimeoutError  # noqa: PLC0415

    api, clock = FakeLeaseApi(), Clock()
    a = faked(api=api, identity="a", clock=clock)
    a.retrying = retrying_on(clock)
    a.step()
    terms = {i: a.term(i) for i in range(4)}
    original = api.replace_namespaced_lease
    lost_answer = {"once": True}

    def landed_unanswered(name: str, namespace: str, body: dict[str, Any], **kwargs: Any) -> Any:
        answer = original(name, namespace, body, **kwargs)
        if name == SHARD.format(2) and lost_answer.pop("once", False):
            raise ReadTimeoutError(None, "/leases", "Read timed out.")
        return answer

    api.replace_namespaced_lease = landed_unanswered  # type: ignore[method-assign]
    clock.now += 3.5
    a.step()
    assert {i: a.term(i) for i in range(4)} == terms, "kept in its term"
    assert not [what for _, _, what in a.transitions if what.startswith("lost")]


def test_the_member_lease_is_renewed_while_the_list_fails() -> None:
    """The member Lease tells the other replicas this one is live. It was renewed after the list, so lists
    failing round after round (a throttling API server: seen as lease rounds failing on the list's 429 in `make
    chaos-scale`) left it unrenewed; past its duration a live replica reads as gone. It is now renewed before the
    list, with the resourceVersion this replica last wrote: never unrenewed for more than `renew_every` and a round."""
    api, clock = FakeLeaseApi(), Clock()
    a = faked(api=api, identity="a", clock=clock)
    a.step()
    versions = [api.items[a.member]["metadata"]["resourceVersion"]]

    def throttled_list(*_: object, **__: object) -> object:
        raise throttled("1")

    api.list_namespaced_lease = throttled_list  # type: ignore[method-assign]
    for _ in range(6):  # 6 s of rounds a second apart, every list answered 429, past a third of the 10 s duration
        clock.now += 1.0
        with pytest.raises(ApiException):
            a.step()
        versions.append(api.items[a.member]["metadata"]["resourceVersion"])
    renewals = [at for at, (old, new) in enumerate(itertools.pairwise(versions), start=1) if old != new]
    assert renewals == [3, 6]  # every renew_every (3 s), with no list between
    assert api.items[a.member]["spec"]["holderIdentity"] == "a"
    assert a.held() == [0, 1, 2, 3]
