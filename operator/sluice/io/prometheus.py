"""Prometheus I/O: run a pool's preset queries with prometheus-api-client and turn the answers into signals.

One vector query per signal per pool (built by `sluice.core.presets`; pools above a few hundred pods select by
namespace so the request stays short), run concurrently with the pool's timeout, bearer token and CA bundle,
and one retry on a dropped connection or a 502/503/504. Every failure is kept per signal (`SignalSnapshot.failed`),
so the core freezes weights and the pool says why: a failed, slow or partial answer is never read as zero.
Called by the reconciler, in a worker thread (the client is blocking).
"""

from __future__ import annotations

import math
import re
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, cast

import requests
from prometheus_api_client import PrometheusConnect
from prometheus_api_client.exceptions import PrometheusApiClientException
from urllib3.util.retry import Retry

from sluice.api.v1alpha1 import InferencePoolSpec
from sluice.core.observed import SIGNAL_FIELD, PodSignals, SignalName, SignalSnapshot
from sluice.core.presets import build_queries
from sluice.io.ports import PromAuth

FRESHNESS_KEY = "sampleTime"
"""Name under which the freshness query's failure is reported (it is not a signal)."""


def parse_value(sample: Any) -> float | None:
    """A Prometheus instant-vector sample value; NaN and infinities (0/0, empty histograms) are missing, not 0."""
    try:
        value = float(sample[1])
    except (TypeError, ValueError, IndexError):
        return None
    return value if math.isfinite(value) else None


def sample_times(series: list[dict[str, Any]] | None, pods: set[str], pod_label: str) -> dict[str, datetime]:
    """Pod -> time of its newest sample, from the answer of the freshness query (`timestamp()` values)."""
    out: dict[str, datetime] = {}
    for item in series or []:
        pod = item.get("metric", {}).get(pod_label)
        stamp = parse_value(item.get("value"))
        if pod in pods and stamp is not None:
            out[pod] = datetime.fromtimestamp(stamp, UTC)
    return out


def to_snapshot(
    answers: dict[SignalName, list[dict[str, Any]]],
    failed: dict[str, str],
    unsupported: tuple[SignalName, ...],
    pods: set[str],
    pod_label: str,
    collected_at: datetime,
    freshness: list[dict[str, Any]] | None = None,
) -> SignalSnapshot:
    """Per-pod signals from the raw query answers, keeping only the pool's pods. Pure.

    `freshness` is the answer of the freshness query, or None when the engine has none (then sample age is
    unknown and the core judges freshness by `collected_at`).
    """
    values: dict[str, dict[str, float]] = {}
    for signal, series in answers.items():
        field = SIGNAL_FIELD[signal]
        for item in series:
            pod = item.get("metric", {}).get(pod_label)
            if pod not in pods:
                continue
            value = parse_value(item.get("value"))
            if value is not None:
                values.setdefault(pod, {})[field] = value
    return SignalSnapshot(
        collected_at=collected_at,
        failed=failed,
        unsupported=list(unsupported),
        pods={pod: PodSignals.model_validate(fields) for pod, fields in values.items()},
        sampled_at=sample_times(freshness, pods, pod_label),
        freshness_known=freshness is not None,
    )


def describe_failure(failure: Exception) -> str:
    """A short reason for a status condition (the client's own messages embed the whole query URL)."""
    if isinstance(failure, requests.Timeout | TimeoutError):
        return "timed out"
    inner = failure.args[0] if failure.args else None
    reason = getattr(inner, "reason", None)
    if isinstance(failure, requests.exceptions.RetryError):
        return f"gave up after a retry: {reason or 'too many error responses'}"
    if isinstance(failure, requests.ConnectionError):
        errno = re.search(r"\[Errno -?\d+\] [^'\")]+", str(reason or failure))
        return "connection failed: " + (errno.group(0) if errno else type(reason or failure).__name__)
    return str(failure).replace("\n", " ")[:200]


class PromIO:
    """Prometheus clients per (URL, credentials), reused across passes."""

    def __init__(self) -> None:
        self._clients: dict[tuple[Any, ...], PrometheusConnect] = {}
        self._ca_files: dict[str, str] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sluice-prom")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for client in self._clients.values():
            client._session.close()

    def _client(self, url: str, auth: PromAuth, timeout: float) -> PrometheusConnect:
        key = (url, auth, timeout)
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                headers = {"Authorization": f"Bearer {auth.bearer_token}"} if auth.bearer_token else None
                session = requests.Session()
                if auth.insecure_skip_verify:
                    session.verify = False
                elif auth.ca_pem:
                    session.verify = self._ca_file(auth.ca_pem)
                retry = Retry(total=1, backoff_factor=0.1, status_forcelist=(502, 503, 504), allowed_methods=None)
                client = PrometheusConnect(
                    url=url, headers=headers, session=session, timeout=max(1, math.ceil(timeout)), retry=retry
                )
                self._clients[key] = client
            return client

    def _ca_file(self, pem: str) -> str:
        path = self._ca_files.get(pem)
        if path is None:
            with tempfile.NamedTemporaryFile("w", suffix=".pem", delete=False) as handle:
                handle.write(pem)
                path = handle.name
            self._ca_files[pem] = path
        return path

    def read_signals(
        self, spec: InferencePoolSpec, namespace: str, pod_names: list[str], auth: PromAuth, now: datetime
    ) -> SignalSnapshot:
        plan = build_queries(spec, namespace, pod_names)
        client = self._client(spec.metrics.prometheus_url, auth, spec.metrics.timeout)
        params = {"timeout": f"{spec.metrics.timeout:g}s"}

        def run(query: str) -> list[dict[str, Any]]:
            result = client.custom_query(query, params=params)
            return list(result) if isinstance(result, list) else []

        queries: dict[str, str] = {str(name): query for name, query in plan.queries.items()}
        if plan.freshness is not None:
            queries[FRESHNESS_KEY] = plan.freshness
        futures = {signal: self._pool.submit(run, query) for signal, query in queries.items()}
        answers: dict[str, list[dict[str, Any]]] = {}
        failed: dict[str, str] = {}
        for signal, future in futures.items():
            try:
                answers[signal] = future.result(timeout=spec.metrics.timeout + 2)
            except (PrometheusApiClientException, requests.RequestException, TimeoutError, ValueError) as failure:
                failed[signal] = describe_failure(failure)
        freshness = answers.pop(FRESHNESS_KEY, None) if plan.freshness is not None else None
        if plan.freshness is not None and freshness is None:
            freshness = []  # the freshness query failed: it is in `failed`, which freezes the pool
        signal_answers = {cast(SignalName, name): series for name, series in answers.items()}
        return to_snapshot(
            signal_answers, failed, plan.unsupported, set(pod_names), spec.metrics.pod_label, now, freshness
        )


__all__ = ["FRESHNESS_KEY", "PromAuth", "PromIO", "describe_failure", "parse_value", "sample_times", "to_snapshot"]
