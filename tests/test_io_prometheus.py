"""Prometheus I/O with the real prometheus-api-client against a local HTTP server that checks what it receives."""

from __future__ import annotations

import gc
import itertools
import json
import re
import tempfile
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.core.engines import SIDECAR
from sluice.core.observed import SignalSnapshot
from sluice.core.presets import PRESETS, build_queries
from sluice.emulator import apitls
from sluice.io import prometheus as prometheus_io
from sluice.io.promanswers import parse_value, plain_vector_values, pod_values, to_snapshot, vector_values
from sluice.io.prometheus import PromAuth, PromIO
from sluice.io.promtransport import POST_OVER
from tests.helpers import T0, FakePrometheus, spec, stepped, vector

SAMPLE_TIME = T0.timestamp() - 42.5  # the pod's newest sample
ANSWERS: dict[str, list[dict[str, Any]]] = {
    # `timestamp(...) - time()`: the sample's time less the evaluation's, asked at T0
    "timestamp(": [{"metric": {"pod": "a"}, "value": [0, str(SAMPLE_TIME - T0.timestamp())]}],
    "vllm:num_requests_waiting": [
        {"metric": {"pod": "a"}, "value": [0, "3"]},
        {"metric": {"pod": "stranger"}, "value": [0, "9"]},
    ],
    "vllm:kv_cache_usage_perc": [{"metric": {"pod": "a"}, "value": [0, "0.5"]}],
    "_sum": [{"metric": {"pod": "a"}, "value": [0, "NaN"]}],  # no traffic: 0/0
}

QUERIES = len(PRESETS["vllm"]) - len(SIDECAR) + 1
"""Queries per vLLM pool and pass: one per signal of the preset (the sidecar's only under admission Enforce) and one
for the sample times."""


def _answer(query: str) -> tuple[int, Any]:
    if "request_success_total" in query and "error" not in query:
        return 503, b"overloaded"
    return 200, vector(next((series for key, series in ANSWERS.items() if key in query), []))


@pytest.fixture
def prometheus() -> Iterator[FakePrometheus]:
    with FakePrometheus(_answer) as server:
        yield server


def test_queries_carry_the_bearer_token_and_answers_become_signals(prometheus: FakePrometheus) -> None:
    io = PromIO(preflight=False)
    try:
        snapshot = io.read_signals(
            spec(metrics={"prometheusUrl": prometheus.url}), "llm", ["a", "b"], PromAuth(bearer_token="s3cret"), T0
        )
    finally:
        io.close()
    assert {seen.auth for seen in prometheus.seen} == {"Bearer s3cret"}
    queries = {seen.query for seen in prometheus.seen}
    assert len(queries) == QUERIES  # one query per supported vLLM signal and one for sample times, for the whole pool
    a = snapshot.pods["a"]
    assert a.queue_length == 3.0
    assert a.kv_cache_usage == 0.5
    assert a.ttft_seconds is None  # NaN is missing, not 0
    assert "stranger" not in snapshot.pods  # not in the pool
    assert "b" not in snapshot.pods  # no samples: absent, not zero
    assert set(snapshot.failed) == {"requestRate"}  # the 503 is kept, per signal
    assert snapshot.failed["requestRate"] == "HTTP Status Code 503 (b'overloaded')"  # not sent again at once
    assert snapshot.unsupported == ["loraFailureRate"]
    assert snapshot.freshness_known
    assert set(snapshot.sampled_at) == {"a"}
    # from the sample, not the query: 42.5 s before the ask (its age since, microseconds here, taken off)
    assert abs(snapshot.sampled_at["a"].timestamp() - SAMPLE_TIME) < 0.1


def test_an_unreachable_prometheus_fails_every_signal_quickly() -> None:
    io = PromIO(preflight=False)
    try:
        snapshot = io.read_signals(
            spec(metrics={"prometheusUrl": "http://127.0.0.1:9", "timeout": "1s"}), "llm", ["a"], PromAuth(), T0
        )
    finally:
        io.close()
    assert len(snapshot.failed) == QUERIES  # every signal and the sample-time query
    assert "sampleTime" in snapshot.failed
    assert set(snapshot.failed.values()) == {"connection failed: [Errno 111] Connection refused"}
    assert snapshot.pods == {}


@pytest.mark.parametrize(
    ("sample", "expected"),
    [([0, "1.5"], 1.5), ([0, "NaN"], None), ([0, "+Inf"], None), ([0, "-Inf"], None), ([0, "x"], None), (None, None)],
)
def test_parse_value(sample: Any, expected: float | None) -> None:
    assert parse_value(sample) == expected


def test_to_snapshot_keeps_only_pool_pods_and_custom_pod_label() -> None:
    answers = {"queueLength": [{"metric": {"kubernetes_pod": "a"}, "value": [0, "2"]}]}
    snapshot = to_snapshot(answers, {}, (), {"a"}, "kubernetes_pod", T0)
    assert snapshot.pods["a"].queue_length == 2.0


def test_one_namespace_wide_query_per_signal_serves_every_pool_and_each_keeps_its_own_pods(
    prometheus: FakePrometheus,
) -> None:
    io = PromIO(preflight=False)
    pools = {"p1": ["a"], "p2": ["stranger"], "p3": ["b"]}  # b has no samples at all
    try:
        snapshots = {
            name: io.read_signals(
                spec(metrics={"prometheusUrl": prometheus.url}, selector={"matchLabels": {"app": name}}),
                "llm",
                pods,
                PromAuth(),
                T0,
            )
            for name, pods in pools.items()
        }
        sent = len(prometheus.seen)
        later = io.read_signals(spec(metrics={"prometheusUrl": prometheus.url}), "other", ["a"], PromAuth(), T0)
    finally:
        io.close()
    assert sent == QUERIES  # every signal + sample times (a 503 is not sent again), once for the three pools
    assert len(prometheus.seen) == 2 * QUERIES  # another namespace renders other queries
    assert all('namespace="llm"' in seen.query and "pod=~" not in seen.query for seen in prometheus.seen[:QUERIES])
    assert 'namespace="other"' in prometheus.seen[QUERIES].query
    assert snapshots["p1"].pods["a"].queue_length == 3.0
    assert set(snapshots["p1"].pods) == {"a"}  # the namespace's other pods are not the pool's
    assert snapshots["p2"].pods["stranger"].queue_length == 9.0
    assert snapshots["p3"].pods == {}  # missing, not 0
    assert snapshots["p3"].sampled_at == {}
    assert set(snapshots["p2"].failed) == {"requestRate"}  # the shared 503 reaches every pool
    assert later.pods["a"].queue_length == 3.0


def test_a_shared_answer_is_refreshed_ahead_of_the_passes_and_keeps_its_time(prometheus: FakePrometheus) -> None:
    io, clock = stepped(preflight=False)
    pool = spec(metrics={"prometheusUrl": prometheus.url}, interval="2s")
    try:
        first = io.read_signals(pool, "llm", ["a"], PromAuth(), T0)
        reused = io.read_signals(pool, "llm", ["a"], PromAuth(), T0)  # at once (the test's clock has not moved)
        assert len(prometheus.seen) == QUERIES  # shared, the 503 included (not sent again at once)
        assert reused.collected_at == first.collected_at == T0  # the time the shared answer was asked
        # each signal says which answer it read: the same one twice is how a pass knows a reading is repeated
        assert reused.answered_at["errorRate"] == first.answered_at["errorRate"] == T0
        # Half an interval after it was asked, the refresher asks again without any pass (the failing query
        # waits out its backoff: one interval).
        clock.advance(0.95)
        assert len(prometheus.seen) == QUERIES  # not before half an interval
        clock.advance(0.1)
        assert len(prometheus.seen) == QUERIES + QUERIES - 1
        later = io.read_signals(pool, "llm", ["a"], PromAuth(), T0 + timedelta(seconds=1.4))
        assert T0 + timedelta(seconds=0.9) <= later.collected_at <= T0 + timedelta(seconds=1.4)
        assert later.answered_at["errorRate"] >= T0 + timedelta(seconds=0.9)  # the refreshed answer: a new reading
        assert "requestRate" not in later.answered_at  # failed: no answer read
        assert later.pods["a"].queue_length == 3.0
    finally:
        io.close()


def test_no_pass_waits_behind_a_refresh_while_the_previous_answer_is_within_stale_after(
    prometheus: FakePrometheus,
) -> None:
    io = PromIO(preflight=False)
    pool = spec(metrics={"prometheusUrl": prometheus.url}, interval="1s")
    try:
        io.read_signals(pool, "llm", ["a"], PromAuth(), T0)
        prometheus.delay = 3.0  # Prometheus slows down: every refresh now takes longer than an interval
        time.sleep(1.2)
        read = io.read_signals(pool, "llm", ["a"], PromAuth(), T0 + timedelta(seconds=1.2))
        # the previous answer, with the time it was asked: a pass waiting behind the refresh asked at ~0.5 s
        # would have read that one (at ~3.5 s); its age is the process's monotonic time since it was asked
        assert read.answered_at["queueLength"] == T0
        assert abs(read.collected_at - T0) < timedelta(seconds=0.3)
        assert read.pods["a"].queue_length == 3.0
    finally:
        prometheus.delay = 0.0
        io.close()


def test_a_query_no_pass_reads_any_more_is_not_refreshed(prometheus: FakePrometheus) -> None:
    io, clock = stepped(preflight=False)
    pool = spec(metrics={"prometheusUrl": prometheus.url}, interval="1s")
    try:
        io.read_signals(pool, "llm", ["a"], PromAuth(), T0)
        clock.advance(2.6)  # past two intervals without a read: the refresher lets it go
        settled = len(prometheus.seen)
        assert settled > QUERIES  # it was refreshed while read recently
        clock.advance(2.0)
        assert len(prometheus.seen) == settled
    finally:
        io.close()


def test_a_pools_next_pass_never_gets_the_answer_its_own_previous_pass_asked_for(prometheus: FakePrometheus) -> None:
    """Passes one interval apart: each reads an answer asked since the previous pass."""
    io, clock = stepped(preflight=False)
    pool = spec(metrics={"prometheusUrl": prometheus.url}, interval="1s")
    try:
        previous = None
        for n in range(3):
            now = T0 + timedelta(seconds=n)
            read = io.read_signals(pool, "llm", ["a"], PromAuth(), now)
            if previous is not None:
                assert read.collected_at > previous, f"pass {n} got an answer asked at {read.collected_at}"
            previous = now
            clock.advance(1.0)
    finally:
        io.close()


def test_a_query_one_pool_alone_reads_is_asked_once_per_interval_just_before_its_pass(
    prometheus: FakePrometheus,
) -> None:
    """One pool in its namespace: one query per signal per interval (two before), each pass reading an answer
    asked a fifth of an interval earlier."""
    io, clock = stepped(preflight=False)
    pool = spec(metrics={"prometheusUrl": prometheus.url}, interval="1s")
    try:
        ages = []
        for n in range(6):
            read = io.read_signals(pool, "llm", ["a"], PromAuth(), T0 + timedelta(seconds=n))
            ages.append((T0 + timedelta(seconds=n) - read.collected_at).total_seconds())
            clock.advance(1.0)
        waiting = [asked.at for asked in prometheus.seen if "num_requests_waiting" in asked.query]
        # the first pass asks, the refresher half an interval later (one read: nothing says it is alone yet),
        # then once before each pass: 7 or 8 over six intervals, against 12 at two per interval
        assert len(waiting) <= 8, [round(b - a, 2) for a, b in itertools.pairwise(waiting)]
        assert all(0.0 < age <= 0.35 for age in ages[2:]), ages
    finally:
        io.close()


def test_pod_values_keeps_finite_values_of_labelled_series_last_one_winning() -> None:
    series = [
        {"metric": {"pod": "a"}, "value": [0, "1"]},
        {"metric": {"pod": "a"}, "value": [0, "2"]},
        {"metric": {"pod": "a"}, "value": [0, "NaN"]},  # a later NaN does not erase a number
        {"metric": {"pod": "b"}, "value": [0, "+Inf"]},
        {"metric": {}, "value": [0, "5"]},  # no pod label: nobody's
    ]
    assert pod_values(series, "pod") == {"a": 2.0}


def _tracked_reachable(root: object) -> int:
    """Objects the garbage collector tracks (containers) reachable from `root`, `root` excluded."""
    seen: set[int] = {id(root)}
    todo = list(gc.get_referents(root))
    while todo:
        item = todo.pop()
        if id(item) in seen or not gc.is_tracked(item) or isinstance(item, type):
            continue
        seen.add(id(item))
        todo.extend(gc.get_referents(item))
    return len(seen) - 1


def test_a_shared_answer_is_kept_without_an_object_per_series(prometheus: FakePrometheus) -> None:
    """A kept answer over N pods is a few containers, not Prometheus' JSON (a dict, a dict and a list per series):
    at 1000 pools x 16 pods those were most of the objects every full garbage collection walked."""
    many = [{"metric": {"pod": f"p{i}"}, "value": [0, str(i)]} for i in range(2000)]
    ANSWERS["vllm:num_requests_running"] = many
    io = PromIO(preflight=False)
    try:
        snapshot = io.read_signals(spec(metrics={"prometheusUrl": prometheus.url}), "llm", ["p7"], PromAuth(), T0)
        kept = [answer for key, answer in io._shares.answers.items() if "vllm:num_requests_running" in key[-1]]
        assert snapshot.pods["p7"].running_requests == 7.0
        assert kept
        assert max(_tracked_reachable(answer.done.result()) for answer in kept) < 20
    finally:
        io.close()
        del ANSWERS["vllm:num_requests_running"]


def test_a_scalar_answer_is_a_query_failure_not_a_number() -> None:
    with pytest.raises(ValueError, match="instant vector"):
        pod_values([1796119200.0, "3"], "pod")  # type: ignore[list-item]


def test_the_refresh_pace_follows_the_pools_that_still_read_a_query(prometheus: FakePrometheus) -> None:
    io, clock = stepped(preflight=False)
    fast = spec(metrics={"prometheusUrl": prometheus.url}, interval="1s")
    slow = spec(metrics={"prometheusUrl": prometheus.url}, interval="4s")
    try:
        io.read_signals(fast, "llm", ["a"], PromAuth(), T0)
        io.read_signals(slow, "llm", ["a"], PromAuth(), T0)
        assert {w.ttl for w in io._shares.wanted.values()} == {1.0}
        clock.advance(2.2)  # the 1 s pool has not read for two of its intervals: it no longer sets the pace
        io.read_signals(slow, "llm", ["a"], PromAuth(), T0 + timedelta(seconds=2.2))
        assert {w.ttl for w in io._shares.wanted.values()} == {4.0}
    finally:
        io.close()


@pytest.fixture
def https_prometheus(tmp_path: Path) -> Iterator[tuple[FakePrometheus, str]]:
    """The fake over TLS with a throwaway certificate, and that certificate as the pool's CA bundle."""
    cert, key = apitls.serving_certificate(tmp_path / "tls")
    with FakePrometheus(_answer, tls=apitls.server_context(cert, key)) as server:
        yield server, cert.read_text()


@pytest.fixture
def ca_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where PromIO writes its CA bundles during the test (the temporary directory)."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _until(check: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    return check()


def test_a_rotated_token_keeps_one_connection_pool_and_one_ca_file_removed_on_close(
    https_prometheus: tuple[FakePrometheus, str], ca_files: Path
) -> None:
    """A projected service-account token is re-read about hourly, a Secret can change: each new token is sent,
    over the same keep-alive connections and CA file, not a new session and file per token kept forever."""
    server, ca = https_prometheus
    io = PromIO(preflight=False, max_workers=4)
    pool = spec(metrics={"prometheusUrl": server.url}, interval="30s")  # no refresh during the test
    try:
        for n in range(20):
            begin = len(server.seen)
            auth = PromAuth(bearer_token=f"token-{n}", ca_pem=ca)
            snapshot = io.read_signals(pool, "llm", ["a"], auth, T0 + timedelta(seconds=n))
            assert snapshot.pods["a"].queue_length == 3.0  # TLS verified against the bundle, answered
            assert len(server.seen) - begin == QUERIES  # answers asked with another token are not shared
            assert {asked.auth for asked in server.seen[begin:]} == {f"Bearer token-{n}"}
        connections, files = server.connections, [path.read_text() for path in ca_files.iterdir()]
    finally:
        io.close()
    assert connections <= 4, f"{connections} connections open after 20 tokens (4 queries at a time at most)"
    assert files == [ca]
    assert _until(lambda: server.connections == 0), "close() closes the connections"
    assert list(ca_files.iterdir()) == [], "close() removes the CA file"


def test_pools_with_other_tokens_on_one_prometheus_each_send_their_own(prometheus: FakePrometheus) -> None:
    io = PromIO(preflight=False, max_workers=4)

    def passes(namespace: str) -> None:
        pool = spec(metrics={"prometheusUrl": prometheus.url}, interval="30s")
        for n in range(10):
            io.read_signals(pool, namespace, ["a"], PromAuth(bearer_token=f"{namespace}-{n}"), T0)

    try:
        with ThreadPoolExecutor(max_workers=2) as both:
            list(both.map(passes, ["one", "two"]))
    finally:
        io.close()
    assert len(prometheus.seen) == 2 * 10 * QUERIES
    for asked in prometheus.seen:
        namespace = "one" if 'namespace="one"' in asked.query else "two"
        assert asked.auth.startswith(f"Bearer {namespace}-"), (asked.auth, asked.query[:80])


def test_a_session_no_pass_uses_any_more_is_closed_and_its_ca_file_removed(
    https_prometheus: tuple[FakePrometheus, str], ca_files: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CA bundle that changed (a rotated CA) leaves the old one's session idle: closed, its file removed."""
    monkeypatch.setattr(prometheus_io, "IDLE_CLIENT_SECONDS", 1.0)
    monkeypatch.setattr(prometheus_io, "SWEEP_EVERY", 0.0)
    server, ca = https_prometheus
    other, _ = apitls.serving_certificate(tmp_path / "other")
    rotated = ca + other.read_text()  # the serving certificate's CA and a new one
    io = PromIO(preflight=False, max_workers=4)
    pool = spec(metrics={"prometheusUrl": server.url}, interval="30s")
    try:
        first = io.read_signals(pool, "llm", ["a"], PromAuth(bearer_token="t", ca_pem=ca), T0)
        assert first.pods["a"].queue_length == 3.0
        before = [path.read_text() for path in ca_files.iterdir()]
        began = time.monotonic()
        n = 0
        while time.monotonic() - began < 2.0:  # the rotated bundle in use, the first one idle
            n += 1
            read = io.read_signals(pool, "llm", ["a"], PromAuth(bearer_token=f"t{n}", ca_pem=rotated), T0)
            assert read.pods["a"].queue_length == 3.0
            time.sleep(0.2)
        left = [path.read_text() for path in ca_files.iterdir()]
    finally:
        io.close()
    assert before == [ca]
    assert left == [rotated], "the first bundle's file is removed once its session is idle"
    assert list(ca_files.iterdir()) == []


NAMESPACE_PODS = ("a1", "a2", "b1", "c1", "stranger")


def _by_name(query: str) -> tuple[int, Any]:
    """Every pod of the namespace the query's pod matcher selects (all of them without one), value 1."""
    asked = re.search(r'pod=~"([^"]*)"', query)
    names = set(asked.group(1).split("|")) if asked else set(NAMESPACE_PODS)
    return 200, vector([{"metric": {"pod": pod}, "value": [0, "1"]} for pod in NAMESPACE_PODS if pod in names])


def _pod_matchers(server: FakePrometheus) -> list[set[str] | None]:
    out: list[set[str] | None] = []
    for seen in server.seen:
        asked = re.search(r'pod=~"([^"]*)"', seen.query)
        out.append(set(asked.group(1).split("|")) if asked else None)
    return out


def _answered_per_query(server: FakePrometheus) -> list[tuple[float, float]]:
    """(when the first, when the second was answered) for each of a pass's queries asked twice (by its metric)."""
    times: dict[str, list[float]] = {}
    for seen in server.seen:
        times.setdefault(seen.query.split("{")[0], []).append(seen.at)
    assert all(len(answered) == 2 for answered in times.values()), times
    assert len(times) == QUERIES
    return [(answered[0], answered[1]) for answered in times.values()]


def _two_pools(io: PromIO, server: FakePrometheus) -> tuple[SignalSnapshot, SignalSnapshot]:
    """One pass of a pool of a1, a2 and then of a pool of b1 (same namespace and metrics), then `io` closed."""
    pool = spec(metrics={"prometheusUrl": server.url})
    try:
        return (
            io.read_signals(pool, "llm", ["a1", "a2"], PromAuth(), T0),
            io.read_signals(pool, "llm", ["b1"], PromAuth(), T0),
        )
    finally:
        io.close()


def test_by_default_the_namespace_is_asked_once_for_every_pool() -> None:
    with FakePrometheus(_by_name) as server:
        first, second = _two_pools(PromIO(preflight=False), server)
    assert _pod_matchers(server) == [None] * QUERIES  # namespace-wide: one query per signal serves both pools
    assert set(first.pods) == {"a1", "a2"}
    assert set(second.pods) == {"b1"}


def test_a_scoped_reader_asks_for_the_pods_of_its_pools_only() -> None:
    """A replica that owns some of a namespace's pools (`PromIO(scoped=True)`) asks Prometheus for their pods by
    name: the pods of pools other replicas own ("c1", "stranger") are never asked for."""
    with FakePrometheus(_by_name) as server:
        io = PromIO(preflight=False, scoped=True)
        pool = spec(metrics={"prometheusUrl": server.url})
        try:
            first = io.read_signals(pool, "llm", ["a1", "a2"], PromAuth(), T0)
            assert _pod_matchers(server) == [{"a1", "a2"}] * QUERIES
            # Another pool of this replica: the answer was not asked for its pod, so it is asked again, for both.
            second = io.read_signals(pool, "llm", ["b1"], PromAuth(), T0)
            assert _pod_matchers(server)[QUERIES:] == [{"a1", "a2", "b1"}] * QUERIES
            # The first pool again: served by that answer, nothing asked.
            again = io.read_signals(pool, "llm", ["a1", "a2"], PromAuth(), T0)
            assert len(server.seen) == 2 * QUERIES
        finally:
            io.close()
    assert set(first.pods) == {"a1", "a2"}
    assert set(second.pods) == {"b1"}
    assert set(again.pods) == {"a1", "a2"}
    assert first.failed == second.failed == {}
    assert {seen.method for seen in server.seen} == {"GET"}  # short queries stay GETs


def test_a_long_scoped_query_is_sent_as_a_post_form() -> None:
    """Thousands of pods by name make a query tens of kilobytes long: a form body, not a URL."""
    many = ["a1", *(f"gone-{i:04d}" for i in range(300))]
    with FakePrometheus(_by_name) as server:
        io = PromIO(preflight=False, scoped=True)
        try:
            snapshot = io.read_signals(spec(metrics={"prometheusUrl": server.url}), "llm", many, PromAuth(), T0)
        finally:
            io.close()
    assert {seen.method for seen in server.seen} == {"POST"}
    assert {len(seen.query) > POST_OVER for seen in server.seen} == {True}
    assert snapshot.failed == {}
    assert set(snapshot.pods) == {"a1"}
    assert snapshot.pods["a1"].queue_length == 1.0


def test_pools_that_come_while_a_scoped_query_is_asked_wait_for_one_more_query_not_one_each() -> None:
    """A replica starting (or taking over a shard) reads many pools at once: those whose pods the query in
    flight was not asked for share the next one, asked `EXTEND_GAP` after it."""
    with FakePrometheus(_by_name) as server:
        server.delay = 0.3
        io = PromIO(preflight=False, scoped=True, max_workers=16)
        pool = spec(metrics={"prometheusUrl": server.url})
        try:
            with ThreadPoolExecutor(max_workers=4) as passes:
                first = passes.submit(io.read_signals, pool, "llm", ["a1"], PromAuth(), T0)
                time.sleep(0.1)  # the first pool's queries are in flight
                later = [
                    passes.submit(io.read_signals, pool, "llm", [pod], PromAuth(), T0) for pod in ("a2", "b1", "c1")
                ]
                snapshots = [first.result(timeout=10), *(done.result(timeout=10) for done in later)]
        finally:
            io.close()
    assert [set(snapshot.pods) for snapshot in snapshots] == [{"a1"}, {"a2"}, {"b1"}, {"c1"}]
    assert all(snapshot.failed == {} for snapshot in snapshots)
    rounds = Counter(frozenset(matcher or ()) for matcher in _pod_matchers(server))
    assert rounds == {frozenset({"a1"}): QUERIES, frozenset({"a1", "a2", "b1", "c1"}): QUERIES}  # two, not four


def test_a_replica_asks_at_once_for_the_pods_of_every_pool_it_runs() -> None:
    """With the pods of the replica's pools (`owned`), the first pass's query takes in the pools that have not
    passed yet: their first passes are served by it, and nothing else is asked."""
    with FakePrometheus(_by_name) as server:
        io = PromIO(preflight=False, owned=lambda ns: {"a1", "a2", "b1"} if ns == "llm" else set())
        first, second = _two_pools(io, server)
    assert _pod_matchers(server) == [{"a1", "a2", "b1"}] * QUERIES
    assert set(first.pods) == {"a1", "a2"}
    assert set(second.pods) == {"b1"}


def test_a_slow_prometheus_is_not_asked_for_more_pods_faster_than_it_answers() -> None:
    """The next query for pods an answer was not asked for waits twice the last answer's time after the last one
    was sent (a replica taking in pools one by one must not pile queries onto a Prometheus that is falling behind)."""
    with FakePrometheus(_by_name) as server:
        server.delay = 0.4
        io = PromIO(preflight=False, scoped=True, max_workers=16)
        pool = spec(metrics={"prometheusUrl": server.url})
        try:
            io.read_signals(pool, "llm", ["a1"], PromAuth(), T0)
            second = io.read_signals(pool, "llm", ["b1"], PromAuth(), T0)
        finally:
            io.close()
    assert set(second.pods) == {"b1"}
    assert _pod_matchers(server)[QUERIES:] == [{"a1", "b1"}] * QUERIES
    # Each first-round query took at least 0.4 s to answer: the second round came at least 0.8 s after it was sent.
    # Per query (`at` is when the server answered, 0.4 s after it came): the second came 0.8 s after the first.
    assert all(second - first >= 2 * 0.4 - 0.05 for first, second in _answered_per_query(server))


def test_one_scoped_query_is_in_flight_at_a_time_and_the_next_takes_in_every_pool_that_came() -> None:
    """Pools that come while a slow query is in flight wait for one more query, sent when that one has answered,
    not one each every half second piling onto Prometheus."""
    with FakePrometheus(_by_name) as server:
        server.delay = 0.8
        io = PromIO(preflight=False, scoped=True, max_workers=16)
        pool = spec(metrics={"prometheusUrl": server.url})
        try:
            with ThreadPoolExecutor(max_workers=4) as passes:
                reads = [passes.submit(io.read_signals, pool, "llm", ["a1"], PromAuth(), T0)]
                for pod in ("a2", "b1", "c1"):
                    time.sleep(0.2)  # each comes while the first query is in flight
                    reads.append(passes.submit(io.read_signals, pool, "llm", [pod], PromAuth(), T0))
                snapshots = [read.result(timeout=15) for read in reads]
        finally:
            io.close()
    assert [set(snapshot.pods) for snapshot in snapshots] == [{"a1"}, {"a2"}, {"b1"}, {"c1"}]
    assert _pod_matchers(server) == [{"a1"}] * QUERIES + [{"a1", "a2", "b1", "c1"}] * QUERIES
    # Per query (`at` is when the server answered, 0.8 s after it came): the second came after the first answered.
    assert all(second - first >= 0.8 - 0.05 for first, second in _answered_per_query(server))


def test_a_query_over_the_pools_own_pods_is_not_asked_for_other_pods() -> None:
    """A `$pods` override is the pool's own query (it may aggregate over those pods): scoping does not widen it."""
    override = {"queueLength": 'sum by ($podLabel) (vllm:num_requests_waiting{pod=~"$pods"})'}
    with FakePrometheus(_by_name) as server:
        io = PromIO(preflight=False, owned=lambda namespace: {"a1", "a2", "b1"})
        pool = spec(metrics={"prometheusUrl": server.url, "queries": override})
        try:
            io.read_signals(pool, "llm", ["a1"], PromAuth(), T0)
        finally:
            io.close()
    by_query = {
        seen.query.split("{")[0]: matcher for seen, matcher in zip(server.seen, _pod_matchers(server), strict=True)
    }
    assert by_query["sum by (pod) (vllm:num_requests_waiting"] == {"a1"}
    assert [m for q, m in by_query.items() if "num_requests_waiting" not in q] == [{"a1", "a2", "b1"}] * (QUERIES - 1)


def test_a_query_over_the_pools_own_pods_follows_its_pods_and_the_rest_are_rendered_once(
    prometheus: FakePrometheus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool's queries are rendered once per spec (the same spec object at every pass of a generation), but a
    `$pods` query again when the pool's pods change."""
    override = {"queueLength": 'sum by ($podLabel) (vllm:num_requests_waiting{pod=~"$pods"})'}
    pool = spec(metrics={"prometheusUrl": prometheus.url, "queries": override})
    plain = spec(metrics={"prometheusUrl": prometheus.url})
    io = PromIO(preflight=False)
    rendered: list[list[str]] = []

    def counted(spec: Any, namespace: str, pod_names: list[str], **options: Any) -> Any:
        rendered.append(list(pod_names))
        return build_queries(spec, namespace, pod_names, **options)

    monkeypatch.setattr("sluice.io.promqueries.build_queries", counted)
    try:
        io.read_signals(pool, "llm", ["a"], PromAuth(), T0)
        io.read_signals(pool, "llm", ["a"], PromAuth(), T0)
        io.read_signals(pool, "llm", ["a", "b"], PromAuth(), T0 + timedelta(seconds=1))
        io.read_signals(pool, "llm", ["b", "a"], PromAuth(), T0 + timedelta(seconds=1))  # the same pods
        for pods in (["a"], ["a", "b"], ["c"]):  # no `$pods`: the pods do not matter
            io.read_signals(plain, "llm", pods, PromAuth(), T0)
    finally:
        io.close()
    assert rendered == [["a"], ["a", "b"], ["a"]]
    waiting = [seen.query for seen in prometheus.seen if "num_requests_waiting{pod=~" in seen.query]
    assert waiting == [
        'sum by (pod) (vllm:num_requests_waiting{pod=~"a"})',
        'sum by (pod) (vllm:num_requests_waiting{pod=~"a|b"})',
    ]


def test_a_scoped_query_stops_naming_the_pods_no_pass_reads_any_more() -> None:
    """A pod set not read within two of its pool's intervals (the pool moved to another replica, or its pods
    changed) drops out of the next query."""
    with FakePrometheus(_by_name) as server:
        io = PromIO(preflight=False, scoped=True)
        pool = spec(metrics={"prometheusUrl": server.url}, interval="1s")
        try:
            io.read_signals(pool, "llm", ["a1"], PromAuth(), T0)
            io.read_signals(pool, "llm", ["b1"], PromAuth(), T0)
            deadline = time.monotonic() + 3.5
            while time.monotonic() < deadline:  # only the first pool passes from now on
                io.read_signals(pool, "llm", ["a1"], PromAuth(), T0)
                time.sleep(0.25)
        finally:
            io.close()
    matchers = _pod_matchers(server)
    assert {"a1", "b1"} in matchers  # b1 was asked for while read
    assert matchers[-1] == {"a1"}  # and no longer, two intervals after its last read


def test_a_query_slower_than_half_its_timeout_is_logged_with_its_size(caplog: pytest.LogCaptureFixture) -> None:
    with FakePrometheus(_by_name) as server:
        server.delay = 0.7
        io = PromIO(preflight=False, scoped=True)
        try:
            with caplog.at_level("WARNING", logger="sluice"):
                io.read_signals(
                    spec(metrics={"prometheusUrl": server.url, "timeout": "1s"}), "llm", ["a1"], PromAuth(), T0
                )
        finally:
            io.close()
    slow = [r.getMessage() for r in caplog.records if "Prometheus query for 1 pods by name took" in r.getMessage()]
    assert len(slow) == QUERIES


# ------------------------------------------------------------------------------------- answers read as text

_LABEL_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
_SAMPLE = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False).map(repr), st.sampled_from(["NaN", "+Inf", "-Inf", "1e-05", "x"])
)
_SERIES = st.fixed_dictionaries(
    {"metric": st.dictionaries(st.sampled_from(["pod", "namespace", "le", "__name__"]), _LABEL_TEXT, max_size=3)},
).flatmap(
    lambda head: st.builds(lambda sample, at: {**head, "value": [at, sample]}, _SAMPLE, st.floats(0, 2e9).map(round))
)


def _prometheus_json(answer: dict[str, Any]) -> bytes:
    """As Prometheus' API writes it: no spaces, UTF-8 as is."""
    return json.dumps(answer, separators=(",", ":"), ensure_ascii=False).encode()


@settings(max_examples=300, deadline=None)
@given(st.lists(_SERIES, max_size=6))
def test_an_answer_read_as_text_reads_what_the_json_decoder_reads(series: list[dict[str, Any]]) -> None:
    """Whatever the labels hold (quotes, backslashes, other labels, non-ASCII) and whatever the values (NaN,
    infinities, junk), the text reading gives the values `pod_values` gives from the decoded JSON."""
    assert vector_values(_prometheus_json(vector(series)), "pod") == pod_values(series, "pod")


def test_an_answer_aggregated_by_pod_is_read_without_the_json_decoder() -> None:
    series = [{"metric": {"pod": f"p{i}"}, "value": [1764636000.123, str(i / 10)]} for i in range(50)]
    series += [
        {"metric": {"pod": "nan"}, "value": [1764636000.123, "NaN"]},
        {"metric": {"pod": "p3"}, "value": [1, "9"]},
    ]
    text = _prometheus_json(vector(series)).decode()
    plain = plain_vector_values(text, "pod")
    assert plain is not None
    assert plain == pod_values(series, "pod")
    assert plain["p3"] == 9.0  # the last series of a pod counts
    assert "nan" not in plain  # NaN is missing
    assert plain_vector_values(text, "kubernetes_pod") is None  # another pod label: not this shape


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t.replace('"pod":"p1"', '"namespace":"x","pod":"p1"'),  # one series with another label
        lambda t: t.replace('"pod":"p1"', '"pod":"p\\"1"'),  # an escape
        lambda t: t[:-1] + ',"warnings":["partial"]}',  # warnings after the data
        lambda t: t.replace('"resultType":"vector"', '"resultType":"matrix"'),
    ],
)
def test_an_answer_of_another_shape_goes_through_the_json_decoder(change: Callable[[str], str]) -> None:
    series = [{"metric": {"pod": f"p{i}"}, "value": [1, str(i)]} for i in range(3)]
    text = change(_prometheus_json(vector(series)).decode())
    assert plain_vector_values(text, "pod") is None
    result = json.loads(text)["data"]["result"]
    assert vector_values(text.encode(), "pod") == pod_values(result, "pod")


def test_a_cut_answer_is_an_error_not_the_series_before_the_cut() -> None:
    series = [{"metric": {"pod": f"p{i}"}, "value": [1, str(i)]} for i in range(3)]
    text = _prometheus_json(vector(series)).decode()
    cut = text[: text.index('{"metric":{"pod":"p2"}') - 1]  # ends after p1's series
    with pytest.raises(json.JSONDecodeError):
        vector_values(cut.encode(), "pod")


def test_a_query_that_times_out_is_not_sent_again_at_once_and_reads_as_timed_out() -> None:
    """Prometheus goes on evaluating a query whose client gave up (until its own timeout): sending it again at
    once doubled the load where Prometheus was slowest, and the failure read "connection failed"."""

    def answer(query: str) -> tuple[int, Any]:
        if "num_requests_waiting" in query:
            time.sleep(2.6)  # past the client's wait: the timeout and a second
        return _answer(query)

    with FakePrometheus(answer) as server:
        io = PromIO(preflight=False)
        try:
            snapshot = io.read_signals(
                spec(metrics={"prometheusUrl": server.url, "timeout": "1s"}), "llm", ["a"], PromAuth(), T0
            )
        finally:
            io.close()
        # A retry would be sent as the wait ran out (urllib3 2.8.0, util/retry.py `Retry.get_backoff_time`: no
        # backoff while consecutive errors <= 1): it arrives within this second, long before its answer would be
        # recorded.
        time.sleep(1.0)
        asked = list(server.arrived)
    assert len(asked) == QUERIES  # each query once
    assert len(set(asked)) == QUERIES
    timed_out = {signal for signal, why in snapshot.failed.items() if why == "timed out"}
    assert timed_out == {"queueLength"}


def test_prometheus_own_timeout_is_not_sent_again_and_a_bad_gateway_is_retried_once() -> None:
    """Prometheus answers 503 when a query's `timeout` ran out: sending it again at once doubles its load. A 502
    (a proxy that could not reach it) is asked again once."""
    timed_out = b'{"status":"error","errorType":"timeout","error":"query timed out in expression evaluation"}'
    first: set[str] = set()

    def answer(query: str) -> tuple[int, Any]:
        if "kv_cache_usage" in query and query not in first:
            first.add(query)
            return 502, b"bad gateway"
        if "num_requests_waiting" in query:
            return 503, timed_out
        return _answer(query)

    with FakePrometheus(answer) as server:
        io = PromIO(preflight=False)
        try:
            snapshot = io.read_signals(spec(metrics={"prometheusUrl": server.url}), "llm", ["a"], PromAuth(), T0)
        finally:
            io.close()
        asked = [seen.query for seen in server.seen]
    assert sum("num_requests_waiting" in q for q in asked) == 1
    assert snapshot.failed["queueLength"] == "timed out (Prometheus stopped it at the query's timeout)"
    assert sum("kv_cache_usage" in q for q in asked) == 2
    assert snapshot.pods["a"].kv_cache_usage == 0.5


def test_an_answer_that_is_not_a_query_answer_fails_its_signal_not_the_pass() -> None:
    with pytest.raises(ValueError, match="not a Prometheus query answer"):
        vector_values(b'{"status":"success"}', "pod")
    with pytest.raises(ValueError, match="not a Prometheus query answer"):
        vector_values(b"[1, 2]", "pod")


def test_an_answer_that_stalls_halfway_reads_as_timed_out() -> None:
    """Prometheus (or a proxy) sends the head of an answer and stops: the read times out in the body, which the
    status said as "connection failed"."""

    class Stalling(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if "num_requests_waiting" not in urllib.parse.unquote_plus(self.path):
                body = json.dumps(vector([])).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "100000")
            self.end_headers()
            self.wfile.write(b'{"status":"success","data":{"resultType":"vector","result":[')
            self.wfile.flush()
            time.sleep(3.5)

        def log_message(self, *_: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stalling)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    io = PromIO(preflight=False)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        snapshot = io.read_signals(spec(metrics={"prometheusUrl": url, "timeout": "1s"}), "llm", ["a"], PromAuth(), T0)
    finally:
        io.close()
        server.shutdown()
        server.server_close()
    assert snapshot.failed == {"queueLength": "timed out"}
