"""A 429 over real HTTP: the official client, urllib3 and sluice's retries together, against a loopback server that
answers as API Priority and Fairness does (429, `Retry-After`) before it answers 200."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from kubernetes import client as k8s

from sluice.api.v1alpha1 import InferencePoolStatus
from sluice.io.kube import KubeCluster
from sluice.io.kubereads import get_istio_object, load_api_client, tallied
from sluice.io.ports import ClusterError
from tests.helpers import loopback_kubeconfig
from tests.test_kube_cluster import SteppedTime

OBJECT = {
    "apiVersion": "networking.istio.io/v1",
    "kind": "ServiceEntry",
    "metadata": {"name": "sluice-llama", "namespace": "llm"},
    "spec": {"hosts": ["llama.llm.sluice.internal"]},
}


class Throttling(BaseHTTPRequestHandler):
    """Answers the first `throttle` requests 429 with `Retry-After` (kube-apiserver's `tooManyRequests`), the
    others with the object; counts what it was sent."""

    throttle = 1
    retry_after = "1"
    requests: ClassVar[list[str]] = []

    def _answer(self) -> None:
        type(self).requests.append(self.command)
        if len(type(self).requests) <= type(self).throttle:
            body = b"Too many requests, please try again later.\n"
            self.send_response(429)
            self.send_header("Retry-After", type(self).retry_after)
        else:
            body = json.dumps(OBJECT).encode()
            self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PATCH = do_PUT = _answer

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Path]:
    Throttling.requests, Throttling.throttle, Throttling.retry_after = [], 1, "1"
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Throttling)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    kubeconfig = loopback_kubeconfig(tmp_path / "kubeconfig", httpd.server_port)
    try:
        yield kubeconfig
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_429_with_retry_after_is_sent_again_by_sluice_after_the_wait_it_asks(server: Path) -> None:
    time = SteppedTime()
    adapter = KubeCluster(load_api_client(str(server), retries=0), retrying=time.retrying())
    try:
        found = get_istio_object(adapter.custom, "ServiceEntry", "llm", "sluice-llama", adapter.retrying)
    finally:
        adapter.close()
    assert found == OBJECT
    assert Throttling.requests == ["GET", "GET"]
    assert time.slept == [1.0]  # the Retry-After the answer carried, read from the client's exception


def test_with_retries_0_urllib3_sends_nothing_again_by_itself(server: Path) -> None:
    """The operator's client: a 429 comes back to sluice after one request (urllib3's default `Retry(3)` would
    have slept out the Retry-After and sent the PUT again by itself, deadline or not)."""
    Throttling.throttle = 5
    Throttling.retry_after = "0"
    api = k8s.CustomObjectsApi(load_api_client(str(server), retries=0))
    with pytest.raises(k8s.ApiException) as refused:
        api.replace_namespaced_custom_object("networking.istio.io", "v1", "llm", "serviceentries", "x", OBJECT)
    assert refused.value.status == 429
    assert Throttling.requests == ["PUT"]
    Throttling.requests.clear()
    default = k8s.CustomObjectsApi(load_api_client(str(server)))
    with pytest.raises(k8s.ApiException):
        default.replace_namespaced_custom_object("networking.istio.io", "v1", "llm", "serviceentries", "x", OBJECT)
    assert Throttling.requests == ["PUT"] * 4  # urllib3 2.x's Retry(3): the first and three more


def test_a_write_still_throttled_past_the_retries_is_a_cluster_error_429(server: Path) -> None:
    Throttling.throttle = 100
    Throttling.retry_after = "1"
    time = SteppedTime()
    adapter = KubeCluster(load_api_client(str(server), retries=0), retrying=time.retrying())
    try:
        with pytest.raises(ClusterError) as failed:
            adapter.write_status("llm", "llama", InferencePoolStatus())
    finally:
        adapter.close()
    assert failed.value.status == 429
    assert Throttling.requests == ["PATCH"] * 11  # the first and 10 more, a second apart
    assert time.slept == [1.0] * 10


def test_a_pass_tally_counts_the_failures_its_requests_met_and_the_time_they_took(server: Path) -> None:
    """What `KubeApiHealthy` is built from: the 429 the GET met (sent again, then answered) and the second it
    waited, counted for the thread inside `tallied` only."""
    time = SteppedTime()
    adapter = KubeCluster(load_api_client(str(server), retries=0), retrying=time.retrying())
    try:
        with tallied() as tally:
            get_istio_object(adapter.custom, "ServiceEntry", "llm", "sluice-llama", adapter.retrying)
        Throttling.requests.clear()
        get_istio_object(adapter.custom, "ServiceEntry", "llm", "sluice-llama", adapter.retrying)  # outside
    finally:
        adapter.close()
    assert tally.met == {"throttled": 1}
    assert tally.seconds == pytest.approx(1.0)  # the Retry-After waited (the stepped clock moves only then)
    assert tally.slowest == 0.0  # each answer came at once (on the stepped clock)
