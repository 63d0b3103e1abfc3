"""The runtime side of sharding: a pool's daemon passes only while its shard is held; writes are fenced."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Coroutine
from datetime import datetime
from types import SimpleNamespace
from typing import Any

import kopf
import pytest
from kopf._cogs.aiokits.aioenums import AsyncFlagWaiter, FlagSetter
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from sluice.api.snapshot import PoolSnapshot
from sluice.api.v1alpha1 import InferencePoolStatus
from sluice.core.events import Event
from sluice.core.shards import Fence
from sluice.io.kube import KubeCluster
from sluice.io.memory import MemoryCluster
from sluice.io.ports import ClusterError, ObjectKey, WriteResult
from sluice.runtime import handlers
from sluice.runtime.config import OperatorConfig
from sluice.runtime.fence import FencedCluster, PassFence
from sluice.runtime.metrics import OperatorMetrics
from sluice.runtime.report import PassReport
from sluice.runtime.sharding import ShardLeases
from tests.test_handlers import BODY
from tests.test_kube_cluster import DESIRED, FakeCustom, rendered


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def leases(clock: Clock) -> ShardLeases:
    return ShardLeases(k8s.ApiClient(), "llm", 4, identity="me", clock=clock)


def test_a_shard_is_held_until_its_validity_ends_and_not_while_it_is_given_up() -> None:
    clock = Clock()
    shards = leases(clock)
    shards.tenures.valid_until[2] = clock.now + 8.0
    assert shards.holds(2)
    assert not shards.holds(1)
    clock.now += 7.9
    assert shards.holds(2)
    clock.now += 0.2
    assert not shards.holds(2)  # expired by its own deadline, whatever the renewal thread does
    shards.tenures.valid_until[2] = clock.now + 8.0
    shards.tenures.releasing[2] = clock.now + 2.0
    assert not shards.holds(2)  # the fence closes before the Lease is cleared


def test_writes_are_refused_outside_a_held_shard_and_allowed_inside() -> None:
    clock = Clock()
    shards = leases(clock)
    inner = MemoryCluster()
    index = shards.shard("llm", "llama")
    fenced = FencedCluster(inner, PassFence(shards.tenures, Fence(index, None)))
    with pytest.raises(ClusterError):
        fenced.write_status("llm", "llama", InferencePoolStatus())  # a pass begun with no term
    fenced = shards.fence("llm", "llama").around(inner)
    with pytest.raises(ClusterError):
        fenced.write_status("llm", "llama", InferencePoolStatus())  # the shard is not held
    shards._acquired(index, clock.now)
    with pytest.raises(ClusterError):
        fenced.write_status("llm", "llama", InferencePoolStatus())  # nor was it when this pass began
    fenced = shards.fence("llm", "llama").around(inner)
    fenced.write_status("llm", "llama", InferencePoolStatus(routable="1/1"))
    fenced.emit("llm", "llama", None, Event("Normal", "X", "y"))
    clock.now += 9.0  # the Lease lapsed mid-pass
    with pytest.raises(ClusterError):
        fenced.write_status("llm", "llama", InferencePoolStatus(routable="2/2"))
    assert [(ns, name, status["routable"]) for ns, name, status in inner.statuses] == [("llm", "llama", "1/1")]


class Reconciler:
    def __init__(self, shards: ShardLeases, stop: Any) -> None:
        self.shards, self.stop = shards, stop
        self.runs: list[tuple[float, bool]] = []
        self.forgotten: list[str] = []

    def written_at(self, uid: str) -> datetime | None:
        return None

    def run(self, snapshot: PoolSnapshot, now: datetime, fence: PassFence | None = None) -> PassReport:
        index = self.shards.shard(snapshot.meta.namespace, snapshot.meta.name)
        fenced = FencedCluster(MemoryCluster(), fence or PassFence(self.shards.tenures, Fence(index, None)))
        try:
            fenced.write_status(snapshot.meta.namespace, snapshot.meta.name, InferencePoolStatus())
            inside = True
        except ClusterError:
            inside = False
        self.runs.append((time.monotonic(), inside and self.shards.holds(index)))
        self.stop()
        return PassReport(pool=snapshot.key)

    def forget(self, uid: str) -> None:
        self.forgotten.append(uid)


def run_daemon(
    shards: ShardLeases,
    make: Callable[[ShardLeases, Callable[[], None]], Reconciler],
    runtime: handlers.Runtime | None = None,
    interval: str | None = None,
    beside: Callable[[Callable[[], None]], Coroutine[Any, Any, None]] | None = None,
) -> Reconciler:
    """Run the pool's daemon (`pool_loop`) over `shards` with the reconciler `make(shards, stop)` until it is
    stopped (15 s at most); `beside(stop)` runs on the same event loop meanwhile."""
    setter: FlagSetter[Any] = FlagSetter()
    runtime = runtime or handlers.Runtime(config=OperatorConfig(shards=4))
    loops: list[asyncio.AbstractEventLoop] = []
    reconciler = make(shards, lambda: loops[0].call_soon_threadsafe(setter.set))
    runtime.reconciler = reconciler  # type: ignore[assignment]
    runtime.metrics = OperatorMetrics(runtime.registry)
    runtime.shards = shards
    memo = SimpleNamespace(runtime=runtime)
    body = BODY if interval is None else {**BODY, "spec": {**BODY["spec"], "interval": interval}}

    async def go() -> None:
        loops.append(asyncio.get_running_loop())
        if beside is not None:
            asyncio.get_running_loop().create_task(beside(setter.set))
        await handlers.pool_loop(
            name="llama", namespace="llm", body=kopf.Body(body), memo=memo, stopped=AsyncFlagWaiter(setter)
        )

    asyncio.run(asyncio.wait_for(go(), timeout=15))
    return reconciler


def test_the_daemon_idles_until_the_shard_is_held_then_passes_inside_the_fence() -> None:
    shards = ShardLeases(k8s.ApiClient(), "llm", 4, identity="me")
    granted: list[float] = []

    async def grant_later(_: Callable[[], None]) -> None:
        await asyncio.sleep(2.5)
        granted.append(time.monotonic())
        shards._acquired(shards.shard("llm", "llama"), time.monotonic())

    runtime = handlers.Runtime(config=OperatorConfig(shards=4))
    reconciler = run_daemon(shards, Reconciler, runtime, beside=grant_later)
    ((ran_at, fenced_inside),) = reconciler.runs
    assert ran_at >= granted[0], "no pass before the shard was held"
    assert fenced_inside, "the pass ran with its writes fenced to the pool's shard"
    # the 2.5 s spent idle is not lag: the first pass is due when the shard is taken (it reported 2.5 s late)
    lag = runtime.registry.get_sample_value("sluice_pass_lag_seconds_sum")
    assert lag is not None
    assert lag < 1.5


class FakeLeaseApi:
    """coordination.k8s.io/v1 leases in memory, with resourceVersions and 409 on a stale one."""

    def __init__(self) -> None:
        self.items: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.calls: list[tuple[float, str, str, str | None]] = []
        """(monotonic time, verb, lease name, holder written)."""

    def _answer(self, value: Any) -> Any:
        return SimpleNamespace(data=json.dumps(value).encode())

    def list_namespaced_lease(self, namespace: str, **_: Any) -> Any:
        return self._answer({"items": list(self.items.values())})

    def _store(self, verb: str, body: dict[str, Any]) -> Any:
        name = body["metadata"]["name"]
        self.version += 1
        stored = json.loads(json.dumps(body))
        stored["metadata"]["resourceVersion"] = str(self.version)
        self.items[name] = stored
        self.calls.append((time.monotonic(), verb, name, body["spec"].get("holderIdentity")))
        return self._answer(stored)

    def create_namespaced_lease(self, namespace: str, body: dict[str, Any], **_: Any) -> Any:
        if body["metadata"]["name"] in self.items:
            raise ApiException(status=409, reason="AlreadyExists")
        return self._store("create", body)

    def replace_namespaced_lease(self, name: str, namespace: str, body: dict[str, Any], **_: Any) -> Any:
        current = self.items.get(name)
        if current is None:
            raise ApiException(status=404, reason="Not Found")
        if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            raise ApiException(status=409, reason="Conflict")
        return self._store("replace", body)

    def delete_namespaced_lease(self, name: str, namespace: str, **_: Any) -> None:
        self.items.pop(name, None)
        self.calls.append((time.monotonic(), "delete", name, None))


def faked(shards: int = 4, identity: str = "me", clock: Any = time.monotonic, api: Any = None) -> ShardLeases:
    leases = ShardLeases(k8s.ApiClient(), "llm", shards, identity=identity, clock=clock)
    leases.api = api or FakeLeaseApi()
    return leases


def test_a_write_is_checked_right_before_it_is_sent_not_only_when_the_call_begins() -> None:
    clock = Clock()
    shards = leases(clock)
    index = shards.shard("llm", "llama")
    shards._acquired(index, clock.now)
    adapter = KubeCluster(k8s.ApiClient(), resync_seconds=60)
    custom = FakeCustom()

    def slow_get(*args: Any, **kwargs: Any) -> Any:
        clock.now += 9.0  # the read hangs past the Lease's validity
        raise ApiException(status=404, reason="Not Found")

    custom.get_namespaced_custom_object = slow_get  # type: ignore[method-assign]
    adapter.custom = custom  # type: ignore[assignment]
    fenced = FencedCluster(adapter, shards.fence("llm", "llama"))
    with pytest.raises(ClusterError):
        fenced.apply(rendered(DESIRED), None, adopt=False)
    assert custom.patches == 0, "the patch after the hung read was withheld"


def test_a_fenced_write_carries_a_request_timeout_within_the_remaining_validity() -> None:
    clock = Clock()
    shards = leases(clock)
    index = shards.shard("llm", "llama")
    shards._acquired(index, clock.now)  # valid until now + 10 - 2
    clock.now += 5.0
    adapter = KubeCluster(k8s.ApiClient(), resync_seconds=60)
    timeouts: list[Any] = []

    class Custom(FakeCustom):
        def patch_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> Any:
            timeouts.append(kwargs.get("_request_timeout"))
            return super().patch_namespaced_custom_object(*args, **kwargs)

    adapter.custom = Custom()  # type: ignore[assignment]
    FencedCluster(adapter, shards.fence("llm", "llama")).apply(rendered(DESIRED), None, adopt=False)
    assert timeouts == [pytest.approx(3.0)]


def test_a_pass_begun_in_one_term_writes_nothing_in_the_next() -> None:
    clock = Clock()
    shards = leases(clock)
    inner = MemoryCluster()
    index = shards.shard("llm", "llama")
    shards._acquired(index, clock.now)
    fenced = FencedCluster(inner, shards.fence("llm", "llama"))
    fenced.write_status("llm", "llama", InferencePoolStatus(routable="1/1"))
    shards._lose(index, "lapsed while the pass hung")
    clock.now += 20.0
    shards._acquired(index, clock.now)  # another replica had it meanwhile; this one took it back
    assert shards.holds(index)
    with pytest.raises(ClusterError):
        fenced.write_status("llm", "llama", InferencePoolStatus(routable="2/2"))
    fenced = FencedCluster(inner, shards.fence("llm", "llama"))
    fenced.write_status("llm", "llama", InferencePoolStatus(routable="3/3"))  # a pass of the new term writes
    assert [s[2]["routable"] for s in inner.statuses] == ["1/1", "3/3"]


def test_the_daemon_resyncs_when_the_shard_was_lost_and_regained_between_two_passes() -> None:
    shards = ShardLeases(k8s.ApiClient(), "llm", 4, identity="me")
    index = shards.shard("llm", "llama")
    shards._acquired(index, time.monotonic())
    runtime = handlers.Runtime(config=OperatorConfig(shards=4))
    resyncs: list[float] = []
    runtime.cluster = SimpleNamespace(resync=lambda: resyncs.append(time.monotonic()))  # type: ignore[assignment]

    class Twice(Reconciler):
        def run(self, snapshot: PoolSnapshot, now: datetime, fence: PassFence | None = None) -> PassReport:
            self.runs.append((time.monotonic(), True))
            if len(self.runs) == 1:  # lost and taken back within one interval: the daemon never saw it idle
                shards._lose(index, "lapsed")
                shards._acquired(index, time.monotonic())
            else:
                self.stop()
            return PassReport(pool=snapshot.key)

    reconciler = run_daemon(shards, Twice, runtime, interval="1s")
    assert len(reconciler.runs) == 2
    assert len(resyncs) == 1
    assert reconciler.runs[0][0] < resyncs[0] < reconciler.runs[1][0]
    assert reconciler.forgotten[:1] == [BODY["metadata"]["uid"]]


def test_stop_waits_for_a_write_in_flight_before_clearing_the_lease() -> None:
    api = FakeLeaseApi()
    shards = faked(shards=1, api=api)
    shards.step()  # alone: takes the only shard
    assert shards.holds(0)
    ended: list[float] = []

    class Slow(MemoryCluster):
        def write_status(self, namespace: str, name: str, status: InferencePoolStatus) -> None:
            time.sleep(0.6)
            ended.append(time.monotonic())

    def write() -> None:
        fenced = FencedCluster(Slow(), shards.fence("llm", "llama"))
        fenced.write_status("llm", "llama", InferencePoolStatus())

    writer = threading.Thread(target=write)
    writer.start()
    time.sleep(0.1)
    shards.stop()
    writer.join()
    assert not shards.holds(0)
    cleared = [at for at, verb, name, holder in api.calls if name.endswith("shard-0-of-1") and holder is None]
    assert cleared
    assert ended
    assert cleared[0] >= ended[0], "the Lease was cleared while the write was in flight"


def test_nothing_is_acquired_once_stopped() -> None:
    api = FakeLeaseApi()
    shards = faked(shards=2, api=api)
    shards.stop()
    shards._acquire(0, None)
    assert not [c for c in api.calls if c[1] == "create" and "shard" in c[2]]
    assert not shards.holds(0)


def test_pool_deletion_writes_through_the_fence() -> None:
    clock = Clock()
    shards = leases(clock)
    index = shards.shard("llm", "llama")
    shards._acquired(index, clock.now)
    released: list[Any] = []

    class Lapsing(MemoryCluster):
        def owned(self, namespace: str, pool: str, elsewhere: frozenset[str] = frozenset()) -> list[ObjectKey]:
            clock.now += 9.0  # the Lease lapses while the owned objects are listed
            return [ObjectKey("ServiceEntry", "sluice-llama")]

        def release(self, namespace: str, key: ObjectKey) -> WriteResult:
            released.append(key)
            return WriteResult(key.kind, key.name, "restored")

    runtime = handlers.Runtime(config=OperatorConfig(shards=4))
    runtime.cluster = Lapsing()  # type: ignore[assignment]
    runtime.shards = shards
    with pytest.raises(ClusterError):
        asyncio.run(handlers.pool_deleted(name="llama", namespace="llm", memo=SimpleNamespace(runtime=runtime)))
    assert released == []


def last_pass(runtime: handlers.Runtime) -> float | None:
    return runtime.registry.get_sample_value("sluice_last_pass_timestamp_seconds", {"pool": "llm/llama"})


def holding_the_pool(valid_for: float | None = None) -> tuple[ShardLeases, int, handlers.Runtime]:
    """A replica holding pool llm/llama's shard (for `valid_for` more seconds, else a whole term), no lease thread."""
    shards = ShardLeases(k8s.ApiClient(), "llm", 4, identity="me")
    index = shards.shard("llm", "llama")
    sent = time.monotonic() if valid_for is None else time.monotonic() - shards.duration + shards.margin + valid_for
    shards._acquired(index, sent)
    return shards, index, handlers.Runtime(config=OperatorConfig(shards=4))


class Stays(Reconciler):
    """Passes and goes on (the stub's own run stops the daemon after one pass)."""

    def run(self, snapshot: PoolSnapshot, now: datetime, fence: PassFence | None = None) -> PassReport:
        self.runs.append((time.monotonic(), True))
        return PassReport(pool=snapshot.key)


def test_a_pool_whose_shard_moved_away_leaves_no_gauge_on_this_replica() -> None:
    """Its last-pass time, lag and weights here would go stale: `time() - sluice_last_pass_timestamp_seconds`
    would call a pool another replica runs behind, and `sluice_pools_behind` kept counting it. A pass during
    which the shard went away records nothing (it used to record its time, which outdid the new owner's under
    `max by (pool)`, until the daemon idled a second later)."""
    shards, index, runtime = holding_the_pool()
    seen: list[float | None] = []
    ran: list[float] = []

    class LosesItsShard(Reconciler):
        def run(self, snapshot: PoolSnapshot, now: datetime, fence: PassFence | None = None) -> PassReport:
            self.runs.append((time.monotonic(), True))
            ran.append(time.monotonic())
            shards._lose(index, "taken over")
            return PassReport(pool=snapshot.key)

    async def watch(stop: Callable[[], None]) -> None:
        while not ran:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        seen.append(last_pass(runtime))  # right after the pass
        await asyncio.sleep(1.5)
        seen.append(last_pass(runtime))  # once it idles
        stop()

    reconciler = run_daemon(shards, LosesItsShard, runtime, interval="1s", beside=watch)
    assert len(reconciler.runs) == 1
    assert seen == [None, None]
    # what the pass did is still counted here (counters stay where they were counted)
    assert runtime.registry.get_sample_value("sluice_reconcile_total", {"pool": "llm/llama", "result": "ok"}) == 1
    assert runtime.registry.get_sample_value("sluice_reconcile_duration_seconds_count") == 1


def test_a_shard_lost_between_two_passes_removes_its_pools_gauges_at_once_not_at_the_next_interval() -> None:
    """The loss comes from the lease thread while the daemon waits out a 60 s interval: the pool's gauges here go
    within a second (they stayed until the next wake-up, up to an interval of another replica's pool)."""
    shards, index, runtime = holding_the_pool()
    seen: list[float | None] = []

    async def lose_while_waiting(stop: Callable[[], None]) -> None:
        while last_pass(runtime) is None:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # the daemon is in its wait now
        seen.append(last_pass(runtime))
        threading.Thread(target=shards._lose, args=(index, "taken over")).start()
        await asyncio.sleep(1.0)
        seen.append(last_pass(runtime))
        stop()
        handlers._waker(runtime, "llm", "llama").set()  # out of its interval's wait, to see the stop

    reconciler = run_daemon(shards, Stays, runtime, interval="60s", beside=lose_while_waiting)
    assert len(reconciler.runs) == 1
    assert seen[0] is not None
    assert seen[1] is None, "the gauges outlived the shard"


def test_a_shard_that_lapses_with_no_lease_round_removes_its_pools_gauges_when_it_lapses() -> None:
    """No lease thread runs here (as if it had stalled): nothing reports the lapse, and the daemon waits out a
    60 s interval. Its wait ends when the shard's validity does, so the gauges go then (they stayed until the
    next pass)."""
    shards, _, runtime = holding_the_pool(valid_for=2.0)
    seen: list[float | None] = []

    async def watch(stop: Callable[[], None]) -> None:
        while last_pass(runtime) is None:
            await asyncio.sleep(0.05)
        seen.append(last_pass(runtime))  # the pass, within the validity
        await asyncio.sleep(3.0)  # the validity has ended meanwhile
        seen.append(last_pass(runtime))
        stop()

    reconciler = run_daemon(shards, Stays, runtime, interval="60s", beside=watch)
    assert len(reconciler.runs) == 1
    assert seen[0] is not None
    assert seen[1] is None, "the gauges outlived the shard's validity"
