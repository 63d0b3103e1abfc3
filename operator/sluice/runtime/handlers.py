"""kopf handlers: thin adapters that parse once, call the reconciler and wake it.

- startup/cleanup build and close the adapters from the `OperatorConfig` in kopf's memo (built by `sluice.cli`);
- one daemon per InferencePool runs a pass every `spec.interval` (one interval from the start of the previous
  one), on a pool of `--workers` threads (the clients are blocking; nothing blocks the event loop), its first
  pass (at start, or once its shard is taken over) in its turn, `--first-passes` at a time (`FirstPassGate`); the
  body is parsed into a `PoolSnapshot` by `sluice.runtime.snapshots` (the spec once per generation, a stored
  status only when somebody else wrote it);
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

import kopf
from prometheus_client import CollectorRegistry, disable_created_metrics, start_http_server

from sluice.api.jsontypes import members, text
from sluice.api.operation import OPERATION_ANNOTATION
from sluice.api.snapshot import PoolSnapshot
from sluice.api.v1alpha1 import GROUP, PLURAL, VERSION
from sluice.core.shards import PoolTurn, after_pass, next_turn
from sluice.io.kube import KubeCluster
from sluice.io.kubereads import SIDECARS, operator_api_client
from sluice.io.ports import Cluster, ObjectKey, WriteResult
from sluice.io.prometheus import PromIO
from sluice.istio.kinds import ISTIO_KINDS
from sluice.runtime.config import OperatorConfig
from sluice.runtime.diffbase import SpecDiffBase
from sluice.runtime.heap import HeapKeeper
from sluice.runtime.kubemetrics import KubeRetries
from sluice.runtime.metrics import GcPauses, OperatorMetrics
from sluice.runtime.podcache import PodCache
from sluice.runtime.reconciler import Reconciler
from sluice.runtime.report import PassReport
from sluice.runtime.sharding import ShardLeases
from sluice.runtime.snapshots import SnapshotReader
from sluice.runtime.wakeups import FirstPassGate, pod_matters, wait_for_next_pass, wake_shard, wake_when_stopped

log = logging.getLogger("sluice")
MIN_GAP = 1.0  # seconds between two passes of one pool, however often it is woken
UNHELD_RECHECK = 30.0
"""How long the daemon of a pool whose shard this replica does not hold waits before it looks again, unless woken: a
shard taken wakes its pools (`wakeups.wake_shard`), so this is only a safety net. (At 1 s, the 1,500 daemons of the
shards another replica holds at 3,000 pools woke 1,500 times a second for nothing.)"""
ISTIO_RESYNC_SECONDS = 600.0
"""How long an Istio object this process applied or found as wanted is trusted without a GET: the watch of the Istio
kinds (`istio_event`) drops the trust as soon as someone else changes or deletes it; this bounds what a missed event
could cost. (Without the watch it was a minute: 48 GETs/s at 1000 pools.)"""
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
    first_passes: FirstPassGate = field(init=False)  # the pools' first passes, `config.first_pass_limit` at a time

    def __post_init__(self) -> None:
        self.first_passes = FirstPassGate(self.config.first_pass_limit)


Pass = Callable[[], tuple[float, PassReport]]  # one pass as a daemon hands it over: (the loop time it began, report)
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


def runtime_of(memo: kopf.Memo) -> Runtime:
    runtime: Runtime = memo.runtime
    return runtime


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: object) -> None:
    runtime = runtime_of(memo)
    config = runtime.config
    settings.posting.level = logging.WARNING
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="sluice.dev")
    settings.persistence.diffbase_storage = SpecDiffBase(prefix="sluice.dev")
    settings.watching.server_timeout = 300
    settings.peering.lifetime = config.peering_lifetime
    settings.peering.stealth = True
    runtime.workers = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="sluice-pass")
    # urllib3 sends nothing again by itself (past any deadline): the adapter's `Retrying` decides
    api_client = operator_api_client(config.kubeconfig, connections=config.workers + 4)
    runtime.cluster = KubeCluster(api_client, resync_seconds=ISTIO_RESYNC_SECONDS)
    runtime.cluster.pod_cache = runtime.pods
    runtime.cluster.namespaces = frozenset(config.namespaces) or None
    # A replica that owns a shard of the pools asks Prometheus for its pools' pods only, not the whole namespace.
    runtime.prom = PromIO(owned=functools.partial(owned_pods, runtime)) if config.shards > 1 else PromIO()
    refresh = timedelta(seconds=config.status_refresh)
    runtime.reconciler = Reconciler(runtime.cluster, runtime.prom, refresh)
    if config.shards > 1:
        runtime.shards = ShardLeases(
            operator_api_client(config.kubeconfig), config.lease_namespace, config.shards, config.identity
        )
        runtime.shards.start()
    # No `_created` twin of every counter and histogram on the page.
    disable_created_metrics()  # type: ignore[no-untyped-call]
    runtime.metrics = OperatorMetrics(runtime.registry, pod_series=config.pod_metrics)
    runtime.gc.install()
    runtime.registry.register(runtime.gc)
    leases = {} if runtime.shards is None else {"leases": runtime.shards.retrying.counts}
    runtime.registry.register(KubeRetries({"passes": runtime.cluster.retrying.counts, **leases}))
    runtime.heap.start()
    if config.metrics_port:
        start_http_server(config.metrics_port, addr=config.metrics_address, registry=runtime.registry)


@kopf.on.cleanup()
def cleanup(memo: kopf.Memo, **_: object) -> None:
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


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0)
async def pool_loop(
    name: str, namespace: str | None, body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **_: object
) -> None:
    runtime = runtime_of(memo)
    reconciler, metrics = runtime.reconciler, runtime.metrics
    assert reconciler is not None, "startup builds it before any daemon runs"
    assert metrics is not None, "startup builds it before any daemon runs"
    daemon = _PoolDaemon(runtime, reconciler, metrics, namespace, name)
    await stopped.wait(runtime.config.first_pass_delay)
    await daemon.run(body, stopped)


class _PoolDaemon:
    """One pool's daemon: passes every interval (sooner when woken), only while its shard is held here."""

    def __init__(
        self, runtime: Runtime, reconciler: Reconciler, metrics: OperatorMetrics, namespace: str | None, name: str
    ) -> None:
        self.runtime, self.reconciler, self.metrics = runtime, reconciler, metrics
        self.namespace, self.name, self.pool = namespace, name, f"{namespace}/{name}"
        self.waker = _waker(runtime, namespace, name)
        # The loop's clock (monotonic; virtual under a test's fast-forwarding loop), read by the pass's thread too.
        self.clock = asyncio.get_running_loop().time
        self.shards, self.turn, self.first = runtime.shards, PoolTurn(), True  # first: its first pass is to come
        self.uid, self.due = "", 0.0
        """`due`: when the next pass is due (the loop's time)."""

    def _term(self) -> int | None:
        return None if self.shards is None else self.shards.pool_term(self.namespace or "default", self.name)

    async def run(self, body: kopf.Body, stopped: kopf.DaemonStopped) -> None:
        shards, self.due = self.shards, self.clock()
        if shards is not None and shards.on_change is None:  # the loop is known here, not in the threaded startup
            shards.on_change = functools.partial(wake_shard, self.runtime.wakers, shards, asyncio.get_running_loop())
        # kopf stopping the daemon (the pool deleted, the operator shutting down) ends the wait for the next pass
        # at once, not at the end of the interval or at kopf's cancellation
        stopping = asyncio.create_task(wake_when_stopped(stopped, self.waker), name=f"sluice-stop-{self.pool}")
        try:
            while not stopped:
                term = self._term()
                step = next_turn(self.turn, shards is not None, term)
                self.turn = step.turn
                if step.forget_gauges:
                    self.metrics.forget(self.pool)
                if not step.pass_now:  # another replica's shard (or none held yet): woken when this one takes it
                    await self._idle()
                    continue
                if step.resume:
                    self._resume()
                async with self.runtime.first_passes.turn(self.pool, self.first or step.resume):  # a first: its turn
                    self.waker.clear()
                    snapshot = self._read(body)
                    submitted = self.clock()
                    interval = snapshot.spec.interval if snapshot.spec is not None else DEFAULT_INTERVAL
                    await self._pass(snapshot, term, submitted, interval)
                self.first = False
                self.due = submitted + interval  # the next pass is due one interval after this one began
                await stopped.wait(MIN_GAP)  # however late (a wake-up before `due` is early); a stop ends it
                await wait_for_next_pass(self.waker, self.due, shards, self.namespace or "default", self.name, term)
        finally:
            stopping.cancel()
            self._forget()

    async def _idle(self) -> None:
        self.runtime.selectors.get(self.namespace, {}).pop(self.name, None)  # its pods are not asked for here
        self.waker.clear()  # (the hook was set before the first look: a shard taken after it wakes its pools)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.waker.wait(), timeout=UNHELD_RECHECK)

    def _resume(self) -> None:
        """The shard came back: what this process remembers of the pool may be stale; the pass is due now."""
        self.reconciler.forget(self.uid)
        if self.runtime.cluster is not None:
            self.runtime.cluster.resync()
        self.due = self.clock()

    def _read(self, body: kopf.Body) -> PoolSnapshot:
        snapshot = self.runtime.snapshots.read(body, self.reconciler.written_at(text(body, "metadata", "uid")))
        self.uid = snapshot.meta.uid or ""
        selector = dict(snapshot.spec.selector.match_labels) if snapshot.spec is not None else {}
        self.runtime.selectors.setdefault(self.namespace, {})[self.name] = selector
        return snapshot

    async def _pass(self, snapshot: PoolSnapshot, term: int | None, submitted: float, interval: float) -> None:
        shards, reconciler, clock = self.shards, self.reconciler, self.clock

        def timed() -> tuple[float, PassReport]:
            if shards is None:
                return clock(), reconciler.run(snapshot, datetime.now(UTC))
            # every write fenced to the term seen here: a pass that outlives it writes nothing more
            fence = shards.fence(snapshot.meta.namespace, snapshot.meta.name, term)
            return clock(), reconciler.run(snapshot, datetime.now(UTC), fence)

        run_pass = self.runtime.run_pass or functools.partial(run_on_workers, self.runtime)
        try:
            started, report = await run_pass(timed)
        except Exception:  # a pass that crashed is logged, reported in the status, and retried
            log.exception("pass failed for %s", snapshot.key)
            self.metrics.passes.labels(snapshot.key, "error").inc()
            return
        # the shard went away during the pass: what it did is counted, but what it saw must not outdo the new
        # owner's gauges
        self.turn, lost = after_pass(self.turn, shards is not None, self._term())
        self.metrics.record(report, gauges=not lost)
        if lost:
            self.metrics.forget(self.pool)
        else:
            wall = time.time() - (clock() - started)
            self.metrics.timing(report.pool, started - self.due, started - submitted, interval, wall)
        written = [f"{w.kind}:{w.action}" for w in report.writes if w.action not in ("unchanged", "refused")]
        # a pass that changed the mesh at info; every pass at debug (1000 pools: 200 lines a second)
        level = logging.INFO if written else logging.DEBUG
        log.log(
            level, "pass %s in %.0f ms%s", report.pool, report.seconds * 1000, f" wrote {written}" if written else ""
        )

    def _forget(self) -> None:
        self.runtime.wakers.pop((self.namespace, self.name), None)
        self.runtime.selectors.get(self.namespace, {}).pop(self.name, None)
        self.reconciler.forget(self.uid)
        self.runtime.snapshots.forget(self.uid)
        self.metrics.forget(self.pool)


@kopf.on.delete(GROUP, VERSION, PLURAL)
async def pool_deleted(
    name: str,
    namespace: str | None,
    memo: kopf.Memo,
    uid: str | None = None,
    status: kopf.Status | None = None,
    **_: object,
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

    written = members(status, "mesh").get("envoyFilterNamespaces")
    elsewhere = frozenset(str(where) for where in written) if isinstance(written, list | tuple) else frozenset()

    def give_back() -> list[tuple[ObjectKey, WriteResult]]:
        return [(key, writer.release(ns, key)) for key in cluster.owned(ns, name, elsewhere)]  # fenced as a pass

    for key, result in await asyncio.to_thread(give_back):
        log.info("pool %s/%s deleted: %s %s %s", ns, name, key.kind, key.name, result.action)
    runtime.snapshots.forget(uid or "")


@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def spec_changed(name: str, namespace: str | None, memo: kopf.Memo, **_: object) -> None:
    _waker(runtime_of(memo), namespace, name).set()


@kopf.on.update(GROUP, VERSION, PLURAL, field=("metadata", "annotations", OPERATION_ANNOTATION))
async def operation_requested(name: str, namespace: str | None, memo: kopf.Memo, **_: object) -> None:
    """`kubectl sluice promote|abort|...` wrote a rollout operation: act on it now, not at the next tick."""
    _waker(runtime_of(memo), namespace, name).set()


async def istio_event(event: kopf.RawEvent, memo: kopf.Memo, **_: object) -> None:
    """Every event of the Istio kinds sluice writes (`KubeCluster.observed`: someone else's edit of an object
    sluice verified makes the next pass read it again and correct it)."""
    cluster = runtime_of(memo).cluster
    if cluster is not None:
        cluster.observed(dict(event.get("object") or {}), deleted=event.get("type") == "DELETED")


for _kind in ISTIO_KINDS.values():
    kopf.on.event(_kind.group, _kind.version, _kind.plural, id=f"istio-{_kind.plural}")(istio_event)


def _mesh_event(kind: str) -> Callable[..., Awaitable[None]]:
    async def mesh_event(event: kopf.RawEvent, memo: kopf.Memo, **_: object) -> None:
        """A Service, Namespace or Sidecar listed or changed: the pools' reads of it (`KubeCluster.mesh`) are read
        again at their next pass."""
        cluster = runtime_of(memo).cluster
        obj = event.get("object")
        if cluster is not None:
            cluster.mesh_observed(kind, text(obj, "metadata", "namespace"), text(obj, "metadata", "name"))

    return mesh_event


for _mesh_kind, (_group, _version, _plural) in (
    ("Service", ("", "v1", "services")),
    ("Namespace", ("", "v1", "namespaces")),
    ("Sidecar", SIDECARS),
):
    kopf.on.event(_group, _version, _plural, id=f"mesh-{_plural}")(_mesh_event(_mesh_kind))


@kopf.on.event("", "v1", "pods")
async def pod_event(
    event: kopf.RawEvent, namespace: str | None, labels: Mapping[str, str], memo: kopf.Memo, **_: object
) -> None:
    runtime = runtime_of(memo)
    pod = dict(event.get("object") or {})
    if event.get("type") == "DELETED":
        runtime.pods.drop(namespace or "", text(pod, "metadata", "name"))
    else:
        # the pod cache (`sluice.runtime.podcache`); type None: an object of kopf's (re)listing
        runtime.pods.put(namespace or "", pod, listing=event.get("type") is None)
    if not pod_matters(str(event.get("type")), pod):
        return
    for name, selector in list(runtime.selectors.get(namespace, {}).items()):
        if selector and all(labels.get(k) == v for k, v in selector.items()):
            _waker(runtime, namespace, name).set()
