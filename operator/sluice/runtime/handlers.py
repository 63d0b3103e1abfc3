"""kopf handlers: thin adapters that only parse, call the reconciler and wake it.

- startup/cleanup create and close the Kubernetes and Prometheus clients;
- one daemon per InferencePool runs a pass every `spec.interval` (read afresh each time), in a worker thread
  (the clients are blocking; nothing blocks the event loop);
- a spec change, or a pod event that matters (restart, OOMKilled, readiness, deletion) for a pool selecting the
  pod, wakes that pool's daemon at once instead of waiting for the next tick.
Run with `python -m sluice operator` (see sluice.cli) or `kopf run -m sluice.runtime.handlers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import kopf
from prometheus_client import CollectorRegistry, start_http_server

from sluice.api.durations import parse_duration
from sluice.api.v1alpha1 import GROUP, PLURAL, VERSION
from sluice.io.kube import KubeIO, load_api_client
from sluice.io.prometheus import PromIO
from sluice.runtime.metrics import OperatorMetrics
from sluice.runtime.reconciler import Reconciler

REGISTRY = CollectorRegistry()

log = logging.getLogger("sluice")
MIN_GAP = 1.0  # seconds between two passes of one pool, however often it is woken


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    settings.posting.level = logging.WARNING
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="sluice.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="sluice.dev")
    settings.watching.server_timeout = 300
    # With peering: a replica that stops refreshing its record is replaced after this many seconds.
    settings.peering.lifetime = int(os.environ.get("SLUICE_PEERING_LIFETIME", "15"))
    settings.peering.stealth = True
    kube = KubeIO(load_api_client(os.environ.get("KUBECONFIG")))
    memo.kube = kube
    memo.prom = PromIO()
    memo.reconciler = Reconciler(kube, memo.prom)
    memo.wakers = {}
    memo.metrics = OperatorMetrics(REGISTRY)
    port = os.environ.get("SLUICE_METRICS_PORT")
    if port:
        start_http_server(int(port), addr=os.environ.get("SLUICE_METRICS_ADDRESS", "0.0.0.0"), registry=REGISTRY)


@kopf.on.cleanup()
def cleanup(memo: Any, **_: Any) -> None:
    with contextlib.suppress(Exception):
        memo.prom.close()
    with contextlib.suppress(Exception):
        memo.kube.close()


@kopf.index(GROUP, VERSION, PLURAL)
def pools_by_namespace(
    namespace: str | None, name: str, spec: kopf.Spec, **_: Any
) -> dict[str | None, tuple[str, dict[str, str]]]:
    labels = dict((spec.get("selector") or {}).get("matchLabels") or {})
    return {namespace: (name, labels)}


def _waker(memo: Any, namespace: str | None, name: str) -> asyncio.Event:
    key = (namespace, name)
    if key not in memo.wakers:
        memo.wakers[key] = asyncio.Event()
    waker: asyncio.Event = memo.wakers[key]
    return waker


def _interval(spec: Any) -> float:
    try:
        return max(1.0, parse_duration(spec.get("interval", "5s")))
    except ValueError:
        return 5.0


# With peering, replicas exchange records at start; the first pass waits so a lower-priority replica has paused
# before it could write (otherwise two replicas starting together both act once).
FIRST_PASS_DELAY = 5.0 if os.environ.get("SLUICE_PEERING") else 0.0


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0, initial_delay=FIRST_PASS_DELAY)
async def pool_loop(
    name: str,
    namespace: str | None,
    body: kopf.Body,
    spec: kopf.Spec,
    memo: Any,
    stopped: kopf.DaemonStopped,
    **_: Any,
) -> None:
    waker = _waker(memo, namespace, name)
    reconciler: Reconciler = memo.reconciler
    while not stopped:
        waker.clear()
        snapshot = {"metadata": dict(body.metadata), "spec": dict(body.spec), "status": dict(body.status)}
        snapshot = _plain(snapshot)
        try:
            report = await asyncio.to_thread(reconciler.run, snapshot, datetime.now(UTC))
        except Exception:  # a pass that crashed is logged and retried; the daemon must outlive it
            log.exception("pass failed for %s/%s", namespace, name)
            memo.metrics.passes.labels(f"{namespace}/{name}", "error").inc()
        else:
            memo.metrics.record(report)
            written = [f"{w.kind}:{w.action}" for w in report.writes if w.action != "unchanged"]
            log.info("pass %s in %.0f ms%s", report.pool, report.seconds * 1000, f" wrote {written}" if written else "")
        await asyncio.sleep(MIN_GAP)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(waker.wait(), timeout=max(0.0, _interval(spec) - MIN_GAP))
    reconciler.forget(str(body.metadata.get("uid", "")))
    memo.metrics.forget(f"{namespace}/{name}")


def _plain(value: Any) -> Any:
    """Deep-copy kopf's read-only views into plain dicts and lists."""
    if isinstance(value, dict) or hasattr(value, "items"):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def spec_changed(name: str, namespace: str | None, memo: Any, **_: Any) -> None:
    _waker(memo, namespace, name).set()


def pod_matters(event_type: str, pod: dict[str, Any]) -> bool:
    """A pod event worth an immediate pass: deletion, not Ready, a restart, a terminating pod."""
    if event_type == "DELETED":
        return True
    meta, status = pod.get("metadata", {}), pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return True
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    restarted = any(int(c.get("restartCount", 0)) > 0 for c in status.get("containerStatuses") or [])
    return not ready or restarted


@kopf.on.event("", "v1", "pods")
def pod_event(event: kopf.RawEvent, namespace: str | None, labels: Mapping[str, str], memo: Any, **kwargs: Any) -> None:
    pools_by_namespace: kopf.Index[str | None, tuple[str, dict[str, str]]] = kwargs["pools_by_namespace"]
    if not pod_matters(str(event.get("type")), dict(event.get("object") or {})):
        return
    for name, selector in pools_by_namespace.get(namespace, []):
        if selector and all(labels.get(k) == v for k, v in selector.items()):
            _waker(memo, namespace, name).set()
