"""The runtime side of sharding: a pool's daemon passes only while its shard is held; writes are fenced."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime
from types import SimpleNamespace
from typing import Any

import kopf
import pytest
from kopf._cogs.aiokits.aioenums import AsyncFlagWaiter, FlagSetter
from kubernetes import client as k8s

from sluice.api.snapshot import PoolSnapshot
from sluice.core.events import Event
from sluice.io.memory import MemoryCluster
from sluice.io.ports import ClusterError
from sluice.runtime import handlers
from sluice.runtime.config import OperatorConfig
from sluice.runtime.metrics import OperatorMetrics
from sluice.runtime.report import PassReport
from sluice.runtime.sharding import FencedCluster, ShardLeases
from tests.test_handlers import BODY


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
    shards._valid_until[2] = clock.now + 8.0
    assert shards.holds(2)
    assert not shards.holds(1)
    clock.now += 7.9
    assert shards.holds(2)
    clock.now += 0.2
    assert not shards.holds(2)  # expired by its own deadline, whatever the renewal thread does
    shards._valid_until[2] = clock.now + 8.0
    shards._releasing[2] = clock.now + 2.0
    assert not shards.holds(2)  # the fence closes before the Lease is cleared


def test_writes_are_refused_outside_a_held_shard_and_allowed_inside() -> None:
    clock = Clock()
    shards = leases(clock)
    inner = MemoryCluster()
    fenced = FencedCluster(inner, shards)
    index = shards.shard("llm", "llama")
    with pytest.raises(ClusterError):
        fenced.write_status("llm", "llama", {})  # no pass in progress
    with shards.passing("llm", "llama"):
        with pytest.raises(ClusterError):
            fenced.write_status("llm", "llama", {})  # the shard is not held
        shards._valid_until[index] = clock.now + 8.0
        fenced.write_status("llm", "llama", {"routable": "1/1"})
        fenced.emit("llm", "llama", None, Event("Normal", "X", "y"))
        clock.now += 9.0  # the Lease lapsed mid-pass
        with pytest.raises(ClusterError):
            fenced.write_status("llm", "llama", {"routable": "2/2"})
    assert list(inner.statuses) == [("llm", "llama", {"routable": "1/1"})]


class Reconciler:
    def __init__(self, shards: ShardLeases, stop: Any) -> None:
        self.shards, self.stop = shards, stop
        self.runs: list[tuple[float, bool]] = []
        self.forgotten: list[str] = []

    def run(self, snapshot: PoolSnapshot, now: datetime) -> PassReport:
        index = self.shards.shard(snapshot.meta.namespace, snapshot.meta.name)
        fenced = FencedCluster(MemoryCluster(), self.shards)
        try:
            fenced.write_status(snapshot.meta.namespace, snapshot.meta.name, {})
            inside = True
        except ClusterError:
            inside = False
        self.runs.append((time.monotonic(), inside and self.shards.holds(index)))
        self.stop()
        return PassReport(pool=snapshot.key)

    def forget(self, uid: str) -> None:
        self.forgotten.append(uid)


def test_the_daemon_idles_until_the_shard_is_held_then_passes_inside_the_fence() -> None:
    shards = ShardLeases(k8s.ApiClient(), "llm", 4, identity="me")
    setter: FlagSetter[Any] = FlagSetter()
    runtime = handlers.Runtime(config=OperatorConfig(shards=4))
    loops: list[asyncio.AbstractEventLoop] = []
    reconciler = Reconciler(shards, lambda: loops[0].call_soon_threadsafe(setter.set))
    runtime.reconciler = reconciler  # type: ignore[assignment]
    runtime.metrics = OperatorMetrics(runtime.registry)
    runtime.shards = shards
    memo = SimpleNamespace(runtime=runtime)
    granted: list[float] = []

    async def grant_later() -> None:
        await asyncio.sleep(2.5)
        granted.append(time.monotonic())
        shards._valid_until[shards.shard("llm", "llama")] = time.monotonic() + 8.0

    async def go() -> None:
        loops.append(asyncio.get_running_loop())
        asyncio.get_running_loop().create_task(grant_later())
        await handlers.pool_loop(
            name="llama", namespace="llm", body=kopf.Body(BODY), memo=memo, stopped=AsyncFlagWaiter(setter)
        )

    asyncio.run(asyncio.wait_for(go(), timeout=15))
    ((ran_at, fenced_inside),) = reconciler.runs
    assert ran_at >= granted[0], "no pass before the shard was held"
    assert fenced_inside, "the pass ran with its writes fenced to the pool's shard"
