"""Prometheus transport: one keep-alive session per (URL, CA bundle, TLS verification, timeout), the query request
prometheus-api-client's `custom_query` makes (its body kept undecoded), one retry on a dropped connection or a
502 and none after a timeout (`QueryRetry`), and failures described for a status condition. Used by
`sluice.io.prometheus.PromIO`.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from types import TracebackType
from typing import NamedTuple, Self

import requests
from prometheus_api_client import PrometheusConnect
from prometheus_api_client.exceptions import PrometheusApiClientException
from requests.adapters import HTTPAdapter
from urllib3.connectionpool import ConnectionPool
from urllib3.exceptions import MaxRetryError, NewConnectionError, ReadTimeoutError
from urllib3.response import BaseHTTPResponse
from urllib3.util.retry import Retry


def describe_failure(failure: Exception) -> str:
    """A short reason for a status condition (the client's own messages embed the whole query URL)."""
    if isinstance(failure, requests.Timeout | TimeoutError):
        return "timed out"
    if isinstance(failure, requests.ConnectionError) and failure.args and isinstance(failure.args[0], ReadTimeoutError):
        return "timed out"  # while reading the body (requests says ConnectionError there)
    if isinstance(failure, PrometheusApiClientException) and '"errorType":"timeout"' in str(failure):
        return "timed out (Prometheus stopped it at the query's timeout)"
    inner = failure.args[0] if failure.args else None
    reason = getattr(inner, "reason", None)
    if isinstance(failure, requests.exceptions.RetryError):
        return f"gave up after a retry: {reason or 'too many error responses'}"
    if isinstance(failure, requests.ConnectionError):
        errno = re.search(r"\[Errno -?\d+\] [^'\")]+", str(reason or failure))
        return "connection failed: " + (errno.group(0) if errno else type(reason or failure).__name__)
    return str(failure).replace("\n", " ")[:200]


def unreached(failure: BaseException) -> bool:
    """Whether a query failed without reaching Prometheus: its connection refused or not made (a Prometheus
    restarting, its address not resolving). Asking again costs Prometheus nothing, unlike a timeout or a 5xx,
    which come from a Prometheus that was asked (`sluice.io.promshare` doubles the wait after those only).
    requests 2.34.2 (adapters.py `HTTPAdapter.send`) raises its ConnectionError around urllib3's MaxRetryError, whose
    `reason` is urllib3 2.8.0's NewConnectionError (NameResolutionError among its subclasses)."""
    inner = failure.args[0] if isinstance(failure, requests.ConnectionError) and failure.args else failure
    if isinstance(inner, MaxRetryError):
        inner = inner.reason
    return isinstance(inner, NewConnectionError | ConnectionRefusedError)


QUERY_FAILURES = (PrometheusApiClientException, requests.RequestException, OSError, ValueError)
"""What a query may fail with: reported per signal. Anything else is a fault and fails the pass."""


POST_OVER = 2048
"""Queries longer than this (characters) go as a POST form: a replica's pods by name make a query of tens of
kilobytes, past what proxies in front of Prometheus take in a URL."""


def ask(transport: Transport, query: str, timeout: str, headers: dict[str, str] | None) -> bytes:
    """The request `custom_query` makes, over the client's session (its retrying adapter, TLS settings and
    timeout), returning the answer's body undecoded for `vector_values` (`custom_query` decodes it with
    `response.json()`, three times the cost); a long query as a POST form, which the query API takes as it takes
    a GET."""
    session = transport.session
    url, form = f"{transport.client.url}/api/v1/query", {"query": query, "timeout": timeout}
    long = len(query) > POST_OVER
    response = session.request(
        "POST" if long else "GET",
        url,
        params=None if long else form,
        data=form if long else None,
        headers=headers,
        timeout=transport.timeout,
        verify=session.verify,
        cert=session.cert,
    )
    if response.status_code != 200:
        raise PrometheusApiClientException(f"HTTP Status Code {response.status_code} ({response.content!r})")
    return bytes(response.content)


def close_session(session: requests.Session) -> None:
    """Close a session's pooled connections now. `Session.close` alone only drops urllib3's pools (urllib3 2
    closes a pool's connections when the pool is garbage-collected), and a failed answer's traceback keeps its
    pool alive for as long as the answer is kept."""
    for adapter in session.adapters.values():
        if isinstance(adapter, HTTPAdapter):
            pools = adapter.poolmanager.pools
            for key in list(pools.keys()):
                with contextlib.suppress(KeyError):
                    pools[key].close()
    session.close()


class QueryRetry(Retry):
    """One retry for a dropped keep-alive connection or a 502 (a proxy that could not reach Prometheus), none
    for a timeout: not for a read timeout (Prometheus is still evaluating the query, until its own `timeout`),
    nor for a 503 (Prometheus' answer when that timeout ran out, or when it is overloaded) or a 504 (a proxy's
    timeout). Sending a slow query again at once doubles the load where it is slowest. A read timeout is
    reported as such ("timed out"), not as a failed connection. The cost: a keep-alive connection that died
    without a reset costs one failed answer (the next refresh asks on a new one)."""

    def increment(
        self,
        method: str | None = None,
        url: str | None = None,
        response: BaseHTTPResponse | None = None,
        error: Exception | None = None,
        _pool: ConnectionPool | None = None,
        _stacktrace: TracebackType | None = None,
    ) -> Self:
        if isinstance(error, ReadTimeoutError):
            raise error
        return super().increment(method, url, response, error, _pool, _stacktrace)


@dataclass
class Transport:
    """One keep-alive session to a Prometheus, for every token: per (URL, CA bundle, TLS verification, timeout)."""

    client: PrometheusConnect
    """Built over `session`: its constructor mounts the retrying adapter (`QueryRetry`) on it."""
    session: requests.Session
    timeout: float
    """Seconds requests waits for an answer."""
    ca_pem: str | None
    used_at: float
    """When a query last began or ended on it (monotonic)."""
    busy: int = 0
    """Queries on it now (it is not closed under them)."""


class TransportKey(NamedTuple):
    """What a session is shared by (never the bearer token: it goes with each request)."""

    url: str
    ca_pem: str | None
    """The CA bundle (None: the system's, or none when `insecure`)."""
    insecure: bool
    timeout: float
    """The query's timeout, seconds."""


def open_transport(key: TransportKey, verify: bool | str) -> Transport:
    """A new session for `key` = (URL, CA bundle, insecure, query timeout); `verify` as requests takes it (False,
    or the CA file of the bundle). requests waits a second past the query's own timeout, so Prometheus' answer
    that it timed out comes first."""
    url, ca_pem, _, timeout = key
    session = requests.Session()
    if verify is not True:
        session.verify = verify
    retry = QueryRetry(total=1, backoff_factor=0.1, status_forcelist=(502,), allowed_methods=None)
    seconds = math.ceil(timeout) + 1
    client = PrometheusConnect(url=url, session=session, timeout=seconds, retry=retry)
    return Transport(client, session, seconds, ca_pem, 0.0)


__all__ = [
    "POST_OVER",
    "QUERY_FAILURES",
    "QueryRetry",
    "Transport",
    "TransportKey",
    "ask",
    "close_session",
    "describe_failure",
    "open_transport",
    "unreached",
]
