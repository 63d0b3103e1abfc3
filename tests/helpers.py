"""Builders shared by the tests: specs, pods and signals with readable defaults; a loopback fake Prometheus."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any

from sluice.api.v1alpha1 import InferencePoolSpec, InferencePoolStatus
from sluice.core.observed import Observed, ObservedPod, PodSignals, SignalSnapshot
from sluice.core.reconcile import Plan, plan_pass

T0 = datetime(2026, 12, 1, 10, 0, 0, tzinfo=UTC)
CLASSES = {"a100": 10.0, "rtx4090": 4.0, "cpu": 1.0}
_POD_INDEX: dict[str, int] = {}


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def spec(**wire: Any) -> InferencePoolSpec:
    """A valid spec; keyword arguments are camelCase wire fields merged over the base."""
    base: dict[str, Any] = {
        "selector": {"matchLabels": {"app": "llama"}},
        "targetPort": 8000,
        "service": "llama",
        "capacity": {"classes": CLASSES},
        # The checks written against the cube's arithmetic pin it; the headroom policy (the default) has its
        # own tests (tests/test_headroom.py) and passes through plan_pass there.
        "scoring": {"policy": "cube"},
    }
    return InferencePoolSpec.model_validate(deep_merge(base, wire))


def pod(
    name: str,
    hw: str = "a100",
    revision: str | None = None,
    ip: str | None = "auto",
    **fields: Any,
) -> ObservedPod:
    labels = {"app": "llama", "sluice.dev/hardware-class": hw}
    if revision is not None:
        labels["sluice.dev/revision"] = revision
    index = _POD_INDEX.setdefault(name, len(_POD_INDEX))  # stable and distinct per name, unlike hash()
    address = f"10.{index // 250}.0.{index % 250 + 1}" if ip == "auto" else ip
    return ObservedPod(name=name, ip=address, labels=labels, **fields)


def sig(
    ttft: float | None = 0.05,
    errors: float | None = 0.0,
    rps: float | None = 5.0,
    kv: float | None = 0.3,
    queue: float | None = 0.0,
    p95: float | None = None,
    lora: float | None = None,
) -> PodSignals:
    return PodSignals(
        ttft_seconds=ttft,
        ttft_p95_seconds=p95 if p95 is not None else (ttft * 1.8 if ttft is not None else None),
        kv_cache_usage=kv,
        queue_length=queue,
        running_requests=1.0 if kv is not None else None,
        request_rate=rps,
        error_rate=errors,
        lora_failure_rate=lora,
    )


def observed(pods: list[ObservedPod], signals: dict[str, PodSignals], when: datetime, **snapshot: Any) -> Observed:
    return Observed(pods=pods, signals=SignalSnapshot(collected_at=when, pods=signals, **snapshot))


def run(
    s: InferencePoolSpec,
    pods: list[ObservedPod],
    signals: dict[str, PodSignals],
    seconds: float,
    previous: InferencePoolStatus | None = None,
    **snapshot: Any,
) -> Plan:
    when = at(seconds)
    return plan_pass(s, 1, observed(pods, signals, when, **snapshot), previous, when)


def weights(plan: Plan) -> dict[str, int]:
    return {row.pod: row.weight for row in plan.status.endpoints}


def states(plan: Plan) -> dict[str, str]:
    return {row.pod: row.state for row in plan.status.endpoints}


def condition(plan: Plan, type_: str) -> tuple[str, str]:
    found = next(c for c in plan.status.conditions if c.type == type_)
    return found.status, found.reason


def vector(result: list[dict[str, Any]]) -> dict[str, Any]:
    """A successful instant-vector answer, as Prometheus' HTTP API writes it."""
    return {"status": "success", "data": {"resultType": "vector", "result": result}}


@dataclass(frozen=True)
class Asked:
    """One request the fake Prometheus received."""

    query: str
    auth: str
    """The Authorization header ("" without one)."""
    at: float
    """When it came (monotonic)."""
    method: str = "GET"


class SteppedClock:
    """A clock for `PromIO` that a test moves: `advance` steps it forward, and before each step waits (in real
    time) until no query is in flight, so a query takes no time on it (as a fast Prometheus would) and a test of a
    few intervals takes milliseconds. The refresher, waiting on it, looks at it again every real millisecond."""

    def __init__(self, start: float = 1000.0, step: float = 0.05) -> None:
        self.time = start
        self.step = step
        self.io: Any = None
        """The `PromIO` whose queries each step waits for."""

    def now(self) -> float:
        return self.time

    def wait(self, condition: threading.Condition, seconds: float) -> None:
        condition.wait(timeout=0.001)

    def settle(self, seconds: float = 5.0) -> None:
        """Until the queries asked so far are answered (real seconds at most)."""
        deadline = time.monotonic() + seconds
        while self.io is not None and self.io.in_flight() and time.monotonic() < deadline:
            time.sleep(0.001)

    def advance(self, seconds: float) -> None:
        end = self.time + seconds
        while self.time < end:
            self.settle()
            self.time = min(end, self.time + self.step)
            time.sleep(0.002)  # the refresher's turn at the new time
        self.settle()


def stepped(**kwargs: Any) -> tuple[Any, SteppedClock]:
    """A `PromIO` on a clock the test steps (`SteppedClock`): intervals pass without sleeping."""
    from sluice.io.prometheus import PromIO  # noqa: PLC0415

    clock = SteppedClock()
    clock.io = PromIO(clock=clock, **kwargs)
    return clock.io, clock


class FakePrometheus:
    """Prometheus' query API on 127.0.0.1 (HTTPS with `tls`, a serving context), answering each query with what
    `answer(query)` returns: (HTTP status, a JSON body, or bytes as they are). It records every request as it
    arrives (`arrived`, the query) and as it is answered (`seen`), can be slowed down (`delay`), and keeps
    connections alive as Prometheus does, counting those open now (`connections`); an idle connection is closed
    after 30 s, the server when the `with` block ends; `refuse` closes the port and resets open connections (a
    Prometheus restarting), a new one on the same `port` opens it again."""

    def __init__(
        self, answer: Callable[[str], tuple[int, Any]], tls: ssl.SSLContext | None = None, port: int = 0
    ) -> None:
        self.answer = answer
        self._open: set[socket.socket] = set()
        self.seen: list[Asked] = []
        self.arrived: list[str] = []
        self.delay = 0.0
        self.connections = 0
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 30
            disable_nagle_algorithm = True  # as Go's server: headers and body without a 40 ms delayed-ACK stall

            def setup(self) -> None:
                super().setup()
                with fake._lock:
                    fake.connections += 1
                    fake._open.add(self.connection)

            def finish(self) -> None:
                with fake._lock:
                    fake.connections -= 1
                    fake._open.discard(self.connection)
                super().finish()

            def do_GET(self) -> None:
                self._serve(urllib.parse.urlsplit(self.path).query)

            def do_POST(self) -> None:  # Prometheus takes the same parameters as a form
                self._serve(self.rfile.read(int(self.headers.get("Content-Length", "0"))).decode())

            def _serve(self, encoded: str) -> None:
                query = urllib.parse.parse_qs(encoded).get("query", [""])[0]
                fake.arrived.append(query)
                time.sleep(fake.delay)
                auth = self.headers.get("Authorization", "")
                fake.seen.append(Asked(query, auth, time.monotonic(), self.command))
                status, body = fake.answer(query)
                # as Prometheus writes it: no spaces, UTF-8 as is
                if isinstance(body, bytes):
                    data = body
                else:
                    data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        if tls is not None:
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def __enter__(self) -> FakePrometheus:
        return self

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._server.shutdown()
        self._server.server_close()

    def refuse(self) -> None:
        """Close the port and reset every open connection: connections to it are refused from now on."""
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            for connection in self._open:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)

    def wait_for(self, count: int, seconds: float = 5.0) -> None:
        """Until `count` requests have come, or `seconds` have passed."""
        deadline = time.monotonic() + seconds
        while len(self.seen) < count and time.monotonic() < deadline:
            time.sleep(0.01)


def loopback_kubeconfig(path: Path, port: int) -> Path:
    """A kubeconfig at `path` for an API server on 127.0.0.1:`port` over plain HTTP, with a bearer token."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path.write_text(json.dumps(config))
    return path
