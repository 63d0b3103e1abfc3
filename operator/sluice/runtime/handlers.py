"""kopf handlers: thin adapters that parse once, call the reconciler and wake it.

- startup/cleanup build and close the adapters from the `OperatorConfig` in kopf's memo (built by `sluice.cli`);
- one daemon per InferencePool runs a pass every `spec.interval` (one interval from the start of the previous
  one), on a pool of `--workers` threads (the clients are blocking; nothing blocks the event loop); the body is
  parsed into a `PoolSnapshot` by `sluice.runtime.snapshots` (the spec once per generation, a stored status
  only when somebody else wrote it);
- every pod event feeds the pod cache the passes read (`sluice.runtime.podcache`); every event of an Istio kind
  sluice writes tells the cluster adapter whether an object it verified was changed by someone else
  (`istio_event`), so steady passes make no GET;
- a spec change, or a pod event that matters (restart, OOMKilled, readiness, deletion) for a pool selecting the
  pod (as its daemon last parsed the selector: no kopf index, which re-ran on every status write), wakes that
  pool's daemon at once; these handlers are `async`, so they set the daemon's asyncio.Event on the event loop's
  own thread;
- deleting a pool gives every adopted object its original back before kopf releases the finalizer (objects sluice
  created are deleted by Kubernetes' garbage collector through their ownerReference).
Run with `python -m sluice operator` (see sluice.cli).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import kopf
from prometheus_client import CollectorRegistry, disable_created_metrics, start_http_server

from sluice.api.operation import OPERATION_ANNOTATION
from sluice.api.snapshot import PoolSnapshot
from sluice.api.v1alpha1 import GROUP, PLURAL, VERSION
from sluice.core.shards import PoolTurn, after_pass, next_turn
from sluice.io.kube import SIDECARS, KubeCluster, load_api_client
from sluice.io.ports import Cluster, ObjectKey, WriteResult
from sluice.io.prometheus import PromIO
from sluice.istio.kinds import ISTIO_KINDS
from sluice.runtime.config import OperatorConfig
from sluice.runtime.diffbase import SpecDiffBase
from sluice.runtime.heap import HeapKeeper
from sluice.runtime.metrics import GcPauses, OperatorMetrics
from sluice.runtime.podcache import PodCache
from sluice.runtime.reconciler import Reconciler
from sluice.runtime.report import PassReport
from sluice.runtime.sharding import ShardLeases
from sluice.runtime.snapshots import SnapshotReader

log = logging.getLogger("sluice")
MIN_GAP = 1.0  # seconds between two passes of one pool, however often it is woken
UNHELD_RECHECK = 30.0
"""How long the daemon of a pool whose shard this replica does not hold waits before it looks again, unless
woken: a shard taken wakes its pools (`_wake_shard`), so this is only a safety net. (At 1 s, the 1,500 daemons
of the shards another replica holds at 3,000 pools woke 1,500 times a second for nothing.)"""
ISTIO_RESYNC_SECONDS = 600.0
"""How long an Istio object this process applied or found as wanted is trusted without a GET: the watch of the
Istio kinds (`istio_event`) drops the trust as soon as someone else changes or deletes it; this bounds what a
missed event could cost. (Without the watch it was a minute: 48 GETs/s at 1000 pools.)"""
DEFAULT_INTERVAL = 5.0


@dataclass
class Runtime:
    """What the handlers share, kept in kopf's memo."""

    config: OperatorConfig
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    cluster: KubeCluster | None = None
    prom: PromIO | None = None
    reconciler: Reconciler | None = None
    metrics: OperatorMetrics | None = None
    wakers: dict[tuple[str | None, str], asyncio.Event] = field(default_factory=dict)
    shards: ShardLeases | None = None
    """With --shards > 1: the Leases this replica holds; a pool passes only while its shard is held."""
    pods: PodCache = field(default_factory=PodCache)
    workers: ThreadPoolExecutor | None = None
    gc: GcPauses = field(default_factory=GcPauses)
    snapshots: SnapshotReader = field(default_factory=SnapshotReader)
    selectors: dict[str | None, dict[str, dict[str, str]]] = field(default_factory=dict)
    """Namespace -> pool -> its pods' labels, as its daemon last parsed them: which pools a pod event wakes."""
    heap: HeapKeeper = field(default_factory=HeapKeeper)
    run_pass: PassRunner | None = None
    """How a daemon runs a pass off the event loop; default: on `workers` (`run_on_workers`)."""


Pass = Callable[[], tuple[float, PassReport]]
"""One pass as a daemon hands it over: returns (the loop time it began, its report)."""
PassRunner = Callable[[Pass], Awaitable[tuple[float, PassReport]]]


async def run_on_workers(runtime: Runtime, work: Pass) -> tuple[float, PassReport]:
    """A pass on the worker threads (passes block on Prometheus and the API server)."""
    return await asyncio.get_running_loop().run_in_executor(runtime.workers, work)


def owned_pods(runtime: Runtime, namespace: str) -> frozenset[str]:
    """The pods of the pools whose daemons pass in `namespace` (their selectors as last parsed, the pod cache):
    what a sharded replica asks Prometheus for. Called from the query threads: the selectors are copied in one
    step (the event loop writes them), the pod cache has its lock."""
    selectors = list(dict(runtime.selectors.get(namespace, {})).values())
    names: set[str] = set()
    for selector in selectors:
        if selector:  # a pool whose spec does not parse selects nothing (the cache's empty selector is "all")
            names.update(pod.name for pod in runtime.pods.select(namespace, selector))
    return frozenset(names)


def runtime_of(memo: Any) -> Runtime:
    runtime: Runtime = memo.runtime
    return runtime


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    runtime = runtime_of(memo)
    config = runtime.config
    settings.posting.level = logging.WARNING
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="sluice.dev")
    settings.persistence.diffbase_storage = SpecDiffBase(prefix="sluice.dev")
    settings.watching.server_timeout = 300
    settings.peering.lifetime = config.peering_lifetime
    settings.peering.stealth = True
    runtime.workers = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="sluice-pass")
    runtime.cluster = KubeCluster(
        load_api_client(config.kubeconfig, connections=config.workers + 4), resync_seconds=ISTIO_RESYNC_SECONDS
    )
    runtime.cluster.pod_cache = runtime.pods
    runtime.cluster.namespaces = frozenset(config.namespaces) or None
    # A replica that owns a shard of the pools asks Prometheus for its pools' pods only, not the whole namespace.
    runtime.prom = PromIO(owned=functools.partial(owned_pods, runtime)) if config.shards > 1 else PromIO()
    refresh = timedelta(seconds=config.status_refresh)
    runtime.reconciler = Reconciler(runtime.cluster, runtime.prom, refresh)
    if config.shards > 1:
        runtime.shards = ShardLeases(
            load_api_client(config.kubeconfig, retries=0), config.lease_namespace, config.shards, config.identity
        )
        runtime.shards.start()
    # No `_created` twin of every counter and histogram on the page.
    disable_created_metrics()  # type: ignore[no-untyped-call]
    runtime.metrics = OperatorMetrics(runtime.registry, pod_series=config.pod_metrics)
    runtime.gc.install()
    runtime.registry.register(runtime.gc)
    runtime.heap.start()
    if config.metrics_port:
        start_http_server(config.metrics_port, addr=config.metrics_address, registry=runtime.registry)


@kopf.on.cleanup()
def cleanup(memo: Any, **_: Any) -> None:
    runtime = runtime_of(memo)
    if runtime.shards is not None:
        runtime.shards.on_change = None  # the daemons and their loop are gone
        with contextlib.suppress(Exception):
            runtime.shards.stop()  # Leases cleared: a successor takes over at once
    if runtime.prom is not None:
        with contextlib.suppress(Exception):
            runtime.prom.close()
    runtime.heap.stop()
    runtime.gc.uninstall()
    if runtime.workers is not None:
        runtime.workers.shutdown(wait=False, cancel_futures=True)
    if runtime.cluster is not None:
        with contextlib.suppress(Exception):
            runtime.cluster.close()


def _waker(runtime: Runtime, namespace: str | None, name: str) -> asyncio.Event:
    return runtime.wakers.setdefault((namespace, name), asyncio.Event())


async def _wait_for_next_pass(
    waker: asyncio.Event, due: float, shards: ShardLeases | None, namespace: str, name: str, term: int | None
) -> None:
    """Until `due` (the event loop's time) or a wake-up; with shards, also no longer than the shard's validity in
    `term`: a shard that lapses with no lease round to say so (the lease thread stalled) is seen when it lapses,
    its gauges gone then, not at the next pass."""
    clock = asyncio.get_running_loop().time
    while (left := due - clock()) > 0:
        timeout = left
        if shards is not None:
            valid = shards.valid_for(namespace, name, term)
            if valid is None:
                return
            timeout = min(left, max(valid, 0.0) + 0.1)
        try:
            await asyncio.wait_for(waker.wait(), timeout=timeout)
            return
        except TimeoutError:
            continue


async def _wake_when_stopped(stopped: kopf.DaemonStopped, waker: asyncio.Event) -> None:
    await stopped.wait()
    waker.set()


def _wake_shard(runtime: Runtime, loop: asyncio.AbstractEventLoop, index: int) -> None:
    """From the lease thread: wake, on the operator's loop, the daemons of the pools in shard `index`."""

    def wake() -> None:
        shards = runtime.shards
        if shards is None:
            return
        for (namespace, name), waker in list(runtime.wakers.items()):
            if shards.shard(namespace or "default", name) == index:
                waker.set()

    loop.call_soon_threadsafe(wake)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0)
async def pool_loop(
    name: str, namespace: str | None, body: kopf.Body, memo: Any, stopped: kopf.DaemonStopped, **_: Any
) -> None:
    runtime = runtime_of(memo)
    waker = _waker(runtime, namespace, name)
    reconciler, metrics = runtime.reconciler, runtime.metrics
    assert reconciler is not None, "startup builds it before any daemon runs"
    assert metrics is not None, "startup builds it before any daemon runs"
    await stopped.wait(runtime.config.first_pass_delay)
    # The loop's clock (monotonic; virtual under a test's fast-forwarding loop), read by the pass's thread too.
    clock = asyncio.get_running_loop().time
    run_pass = runtime.run_pass or functools.partial(run_on_workers, runtime)
    uid = ""
    due = clock()
    shards, turn = runtime.shards, PoolTurn()
    sharded = shards is not None
    if shards is not None and shards.on_change is None:  # the loop is known here, not in the threaded startup
        shards.on_change = functools.partial(_wake_shard, runtime, asyncio.get_running_loop())
    # kopf stopping the daemon (the pool deleted, the operator shutting down) ends the wait for the next pass
    # at once, not at the end of the interval or at kopf's cancellation
    stopping = asyncio.create_task(_wake_when_stopped(stopped, waker), name=f"sluice-stop-{namespace}/{name}")
    try:
        while not stopped:
            term = None if shards is None else shards.pool_term(namespace or "default", name)
            step = next_turn(turn, sharded, term)
            turn = step.turn
            if step.forget_gauges:
                metrics.forget(f"{namespace}/{name}")
            if not step.pass_now:  # another replica's shard (or none held yet): woken when this replica takes it
                runtime.selectors.get(namespace, {}).pop(name, None)  # its pods are not asked for here
                waker.clear()  # (the hook was set before the first look: a shard taken after it wakes its pools)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waker.wait(), timeout=UNHELD_RECHECK)
                continue
            if step.resume:
                reconciler.forget(uid)
                if runtime.cluster is not None:
                    runtime.cluster.resync()
                due = clock()
            waker.clear()
            snapshot = runtime.snapshots.read(body, reconciler.written_at(str(body.metadata.get("uid") or "")))
            uid = snapshot.meta.uid or ""
            selector = dict(snapshot.spec.selector.match_labels) if snapshot.spec is not None else {}
            runtime.selectors.setdefault(namespace, {})[name] = selector
            submitted = clock()
            interval = snapshot.spec.interval if snapshot.spec is not None else DEFAULT_INTERVAL

            def timed(snapshot: PoolSnapshot = snapshot, term: int | None = term) -> tuple[float, PassReport]:
                if shards is None:
                    return clock(), reconciler.run(snapshot, datetime.now(UTC))
                # every write fenced to the term seen here: a pass that outlives it writes nothing more
                fence = shards.fence(snapshot.meta.namespace, snapshot.meta.name, term)
                return clock(), reconciler.run(snapshot, datetime.now(UTC), fence)

            try:
                started, report = await run_pass(timed)
            except Exception:  # a pass that crashed is logged, reported in the status, and retried
                log.exception("pass failed for %s", snapshot.key)
                metrics.passes.labels(snapshot.key, "error").inc()
            else:
                # the shard went away during the pass: what it did is counted, but what it saw must not outdo
                # the new owner's gauges
                now_term = None if shards is None else shards.pool_term(namespace or "default", name)
                turn, lost = after_pass(turn, sharded, now_term)
                metrics.record(report, gauges=not lost)
                if lost:
                    metrics.forget(f"{namespace}/{name}")
                else:
                    wall = time.time() - (clock() - started)
                    metrics.timing(report.pool, started - due, started - submitted, interval, wall)
                written = [f"{w.kind}:{w.action}" for w in report.writes if w.action not in ("unchanged", "refused")]
                # a pass that changed the mesh at info; every pass at debug (1000 pools: 200 lines a second)
                log.log(
                    logging.INFO if written else logging.DEBUG,
                    "pass %s in %.0f ms%s",
                    report.pool,
                    report.seconds * 1000,
                    f" wrote {written}" if written else "",
                )
            due = submitted + interval  # the next pass is due one interval after this one began
            await stopped.wait(MIN_GAP)  # however late (a wake-up before `due` is early, never late); a stop ends it
            await _wait_for_next_pass(waker, due, shards, namespace or "default", name, term)
    finally:
        stopping.cancel()
        runtime.wakers.pop((namespace, name), None)
        runtime.selectors.get(namespace, {}).pop(name, None)
        reconciler.forget(uid)
        runtime.snapshots.forget(uid)
        metrics.forget(f"{namespace}/{name}")


@kopf.on.delete(GROUP, VERSION, PLURAL)
async def pool_deleted(
    name: str, namespace: str | None, memo: Any, uid: str | None = None, status: Any = None, **_: Any
) -> None:
    """Give adopted objects back, and delete the EnvoyFilters written in other namespaces (no ownerReference can
    reach them), before the pool goes (the finalizer holds the pool until this returns)."""
    runtime = runtime_of(memo)
    cluster = runtime.cluster
    assert cluster is not None
    ns = namespace or "default"
    shards = runtime.shards
    term = None if shards is None else shards.pool_term(ns, name)
    if shards is not None and term is None:
        raise kopf.TemporaryError("the pool's shard is held by another replica", delay=5)
    writer: Cluster = cluster if shards is None else shards.fence(ns, name, term).around(cluster)

    mesh = (status or {}).get("mesh") or {}
    elsewhere = frozenset(str(where) for where in mesh.get("envoyFilterNamespaces") or ())

    def give_back() -> list[tuple[ObjectKey, WriteResult]]:
        return [(key, writer.release(ns, key)) for key in cluster.owned(ns, name, elsewhere)]  # fenced as a pass

    for key, result in await asyncio.to_thread(give_back):
        log.info("pool %s/%s deleted: %s %s %s", ns, name, key.kind, key.name, result.action)
    runtime.snapshots.forget(uid or "")


@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def spec_changed(name: str, namespace: str | None, memo: Any, **_: Any) -> None:
    _waker(runtime_of(memo), namespace, name).set()


@kopf.on.update(GROUP, VERSION, PLURAL, field=("metadata", "annotations", OPERATION_ANNOTATION))
async def operation_requested(name: str, namespace: str | None, memo: Any, **_: Any) -> None:
    """`kubectl sluice promote|abort|...` wrote a rollout operation: act on it now, not at the next tick."""
    _waker(runtime_of(memo), namespace, name).set()


async def istio_event(event: kopf.RawEvent, memo: Any, **_: Any) -> None:
    """Every event of the Istio kinds sluice writes (`KubeCluster.observed`: someone else's edit of an object
    sluice verified makes the next pass read it again and correct it)."""
    cluster = runtime_of(memo).cluster
    if cluster is not None:
        cluster.observed(dict(event.get("object") or {}), deleted=event.get("type") == "DELETED")


for _kind in ISTIO_KINDS.values():
    kopf.on.event(_kind.group, _kind.version, _kind.plural, id=f"istio-{_kind.plural}")(istio_event)


def _mesh_event(kind: str) -> Callable[..., Awaitable[None]]:
    async def mesh_event(event: kopf.RawEvent, memo: Any, **_: Any) -> None:
        """A Service, Namespace or Sidecar listed or changed: the pools' reads of it (`KubeCluster.mesh`) are read
        again at their next pass."""
        cluster = runtime_of(memo).cluster
        obj: dict[str, Any] = dict(event.get("object") or {})
        meta = obj.get("metadata") or {}
        if cluster is not None:
            cluster.mesh_observed(kind, str(meta.get("namespace") or ""), str(meta.get("name") or ""))

    return mesh_event


for _mesh_kind, (_group, _version, _plural) in (
    ("Service", ("", "v1", "services")),
    ("Namespace", ("", "v1", "namespaces")),
    ("Sidecar", SIDECARS),
):
    kopf.on.event(_group, _version, _plural, id=f"mesh-{_plural}")(_mesh_event(_mesh_kind))


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
async def pod_event(
    event: kopf.RawEvent, namespace: str | None, labels: Mapping[str, str], memo: Any, **_: Any
) -> None:
    runtime = runtime_of(memo)
    pod: dict[str, Any] = dict(event.get("object") or {})
    if event.get("type") == "DELETED":
        runtime.pods.drop(namespace or "", str(pod.get("metadata", {}).get("name", "")))
    else:
        # the pod cache (`sluice.runtime.podcache`); type None: an object of kopf's (re)listing
        runtime.pods.put(namespace or "", pod, listing=event.get("type") is None)
    if not pod_matters(str(event.get("type")), pod):
        return
    for name, selector in list(runtime.selectors.get(namespace, {}).items()):
        if selector and all(labels.get(k) == v for k, v in selector.items()):
            _waker(runtime, namespace, name).set()
