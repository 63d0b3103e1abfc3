"""Prometheus I/O with the real prometheus-api-client against a local HTTP server that checks what it receives."""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from sluice.io.prometheus import PromAuth, PromIO, parse_value, to_snapshot
from tests.helpers import T0, spec

SAMPLE_TIME = T0.timestamp() - 42.5  # the pod's newest sample, as `timestamp()` reports it
ANSWERS: dict[str, list[dict[str, Any]]] = {
    "timestamp(": [{"metric": {"pod": "a"}, "value": [0, str(SAMPLE_TIME)]}],
    "vllm:num_requests_waiting": [
        {"metric": {"pod": "a"}, "value": [0, "3"]},
        {"metric": {"pod": "stranger"}, "value": [0, "9"]},
    ],
    "vllm:kv_cache_usage_perc": [{"metric": {"pod": "a"}, "value": [0, "0.5"]}],
    "_sum": [{"metric": {"pod": "a"}, "value": [0, "NaN"]}],  # no traffic: 0/0
}


class _Handler(BaseHTTPRequestHandler):
    seen: ClassVar[list[dict[str, str]]] = []

    def do_GET(self) -> None:
        form = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        query = form.get("query", [""])[0]
        _Handler.seen.append({"query": query, "auth": self.headers.get("Authorization", "")})
        if "request_success_total" in query and "error" not in query:
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b"overloaded")
            return
        result = next((series for key, series in ANSWERS.items() if key in query), [])
        body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def prometheus() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Handler.seen.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_queries_carry_the_bearer_token_and_answers_become_signals(prometheus: str) -> None:
    io = PromIO()
    try:
        snapshot = io.read_signals(
            spec(metrics={"prometheusUrl": prometheus}), "llm", ["a", "b"], PromAuth(bearer_token="s3cret"), T0
        )
    finally:
        io.close()
    assert {seen["auth"] for seen in _Handler.seen} == {"Bearer s3cret"}
    queries = {seen["query"] for seen in _Handler.seen}
    assert len(queries) == 8  # one query per supported vLLM signal and one for sample times, for the whole pool
    a = snapshot.pods["a"]
    assert a.queue_length == 3.0
    assert a.kv_cache_usage == 0.5
    assert a.ttft_seconds is None  # NaN is missing, not 0
    assert "stranger" not in snapshot.pods  # not in the pool
    assert "b" not in snapshot.pods  # no samples: absent, not zero
    assert set(snapshot.failed) == {"requestRate"}  # the 503 is kept, per signal
    assert snapshot.failed["requestRate"] == "gave up after a retry: too many 503 error responses"
    assert snapshot.unsupported == ["loraFailureRate"]
    assert snapshot.freshness_known
    assert snapshot.sampled_at == {"a": datetime.fromtimestamp(SAMPLE_TIME, UTC)}  # from the sample, not the query


def test_an_unreachable_prometheus_fails_every_signal_quickly() -> None:
    io = PromIO()
    try:
        snapshot = io.read_signals(
            spec(metrics={"prometheusUrl": "http://127.0.0.1:9", "timeout": "1s"}), "llm", ["a"], PromAuth(), T0
        )
    finally:
        io.close()
    assert len(snapshot.failed) == 8  # every signal and the sample-time query
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
