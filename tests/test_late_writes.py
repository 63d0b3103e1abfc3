"""A write the operator gave up on must not reach the API server later.

A fenced write is sent only while its shard's Lease is valid, with a timeout that ends with that validity
(`sluice.runtime.fence`). Behind a network partition the request hangs; when its timeout ends the client closes the
connection. A normal close (FIN) leaves the request's unacknowledged bytes to the kernel, which goes on
retransmitting them: once the partition heals they reach the API server, which applies the write after another
replica took the shard over (the chaos matrix's replica-partition case saw two status writes land so). The
operator's API clients (`operator_api_client`) abort their connections instead (`SO_LINGER` 0: RST, the bytes
dropped).

The partition is `sluice.devstack.tcpproxy.TcpProxy`'s (it holds bytes as a retransmitting sender would, and drops
them when the sender aborts); the API server is a small HTTP server that records what reaches it.
"""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3
from kubernetes import client as k8s

from sluice.devstack.tcpproxy import TcpProxy
from sluice.io.kubereads import operator_api_client
from tests.helpers import loopback_kubeconfig


class Recorder(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the write goes out on the connection already open
    seen: list[str] = []  # noqa: RUF012 - one server per test, reset by the fixture

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        Recorder.seen.append(f"{self.command} {self.path}")
        body = b'{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "llm"}}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PATCH = _answer

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def api_server() -> Iterator[tuple[str, int]]:
    Recorder.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    yield str(host), int(port)
    server.shutdown()
    server.server_close()


def test_a_write_given_up_during_a_partition_does_not_reach_the_api_server_after_it(
    api_server: tuple[str, int], tmp_path: Path
) -> None:
    with TcpProxy(api_server, lifetime=30) as proxy:
        api = k8s.CoreV1Api(operator_api_client(str(loopback_kubeconfig(tmp_path / "kubeconfig", proxy.port))))
        api.read_namespace("llm", _request_timeout=2)  # the connection the write will use is open
        assert Recorder.seen == ["GET /api/v1/namespaces/llm"]
        proxy.partition()
        with pytest.raises(urllib3.exceptions.ReadTimeoutError):  # the fence's timeout: the write is given up
            api.patch_namespace("llm", {"metadata": {"labels": {"late": "yes"}}}, _request_timeout=0.5)
        time.sleep(0.5)
        proxy.heal()
        time.sleep(1.5)
    assert Recorder.seen == ["GET /api/v1/namespaces/llm"], "a write given up on was applied after the partition"
