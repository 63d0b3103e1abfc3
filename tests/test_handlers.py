"""The kopf handlers as adapters: async wakers on the loop's own thread, settings from the memo, cleanup on exit."""

from __future__ import annotations

import asyncio
import inspect
import itertools
from datetime import datetime
from types import SimpleNamespace
from typing import Any

import kopf
import looptime
import pytest
from kopf._cogs.aiokits.aioenums import AsyncFlagWaiter, FlagSetter

from sluice.api.operation import OPERATION_ANNOTATION
from sluice.api.snapshot import PoolSnapshot
from sluice.runtime import handlers, snapshots
from sluice.runtime.config import OperatorConfig
from sluice.runtime.metrics import OperatorMetrics
from sluice.runtime.report import PassReport
from sluice.runtime.snapshots import SnapshotReader

BODY = {
    "apiVersion": "inference.sluice.dev/v1alpha1",
    "kind": "InferencePool",
    "metadata": {"name": "llama", "namespace": "llm", "uid": "u1", "generation": 1},
    "spec": {"selector": {"matchLabels": {"app": "llama"}}, "targetPort": 8000, "service": "llama", "interval": "1s"},
}


def test_wake_handlers_are_coroutines_so_they_run_on_the_event_loop_thread():
    # kopf runs plain `def` handlers in executor threads, where asyncio.Event.set() is not thread-safe.
    wakers = (handlers.spec_changed, handlers.pod_event, handlers.operation_requested, handlers.pool_deleted)
    for handler in (*wakers, handlers.pool_loop):
        assert inspect.iscoroutinefunction(handler), handler.__name__


class FakeReconciler:
    def __init__(self, stop: Any) -> None:
        self.stop = stop
        self.snapshots: list[PoolSnapshot] = []
        self.forgotten: list[str] = []

    def run(self, snapshot: PoolSnapshot, now: datetime) -> PassReport:
        self.snapshots.append(snapshot)
        self.stop()  # called from the worker thread the pass runs in
        return PassReport(pool=snapshot.key)

    def forget(self, uid: str) -> None:
        self.forgotten.append(uid)

    def written_at(self, uid: str) -> datetime | None:
        return None


def runtime_with(reconciler: FakeReconciler) -> handlers.Runtime:
    runtime = handlers.Runtime(config=OperatorConfig())
    runtime.reconciler = reconciler  # type: ignore[assignment]
    runtime.metrics = OperatorMetrics(runtime.registry)
    return runtime


async def daemon(memo: SimpleNamespace, setter: FlagSetter[Any], interval: str = "1s") -> None:
    """The pool's daemon as kopf runs it, until `setter` is set (kopf's `stopped`)."""
    body = {**BODY, "spec": {**BODY["spec"], "interval": interval}}
    await handlers.pool_loop(
        name="llama", namespace="llm", body=kopf.Body(body), memo=memo, stopped=AsyncFlagWaiter(setter)
    )


def one_pass(during: Any = None) -> tuple[handlers.Runtime, FakeReconciler, SimpleNamespace]:
    """Run a pool's daemon for one pass (the fake reconciler stops it), calling `during(runtime)` inside it."""
    setter: FlagSetter[Any] = FlagSetter()
    loops: list[asyncio.AbstractEventLoop] = []
    reconciler = FakeReconciler(lambda: loops[0].call_soon_threadsafe(setter.set))
    runtime = runtime_with(reconciler)
    if during is not None:
        real_run = reconciler.run
        reconciler.run = lambda snapshot, now: during(runtime) or real_run(snapshot, now)  # type: ignore[method-assign]
    memo = SimpleNamespace(runtime=runtime)

    async def go() -> None:
        loops.append(asyncio.get_running_loop())
        await daemon(memo, setter)

    asyncio.run(asyncio.wait_for(go(), timeout=10))
    return runtime, reconciler, memo


def test_the_daemon_parses_the_body_once_into_a_snapshot_and_cleans_up_when_it_stops():
    runtime, reconciler, _ = one_pass()
    (snapshot,) = reconciler.snapshots
    assert snapshot.spec is not None
    assert snapshot.spec.interval == 1.0
    assert runtime.wakers == {}  # the daemon's waker is gone with it
    assert reconciler.forgotten == ["u1"]


def test_a_pod_event_wakes_the_pools_whose_daemon_selects_the_pod():
    seen: list[Any] = []
    runtime, _, memo = one_pass(lambda rt: seen.append({ns: dict(pools) for ns, pools in rt.selectors.items()}))
    runtime.selectors = {"llm": {"llama": {"app": "llama"}, "other": {"app": "other"}, "invalid": {}}}

    async def event(kind: str, ready: bool) -> None:
        conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
        pod = {"metadata": {"name": "p", "labels": {"app": "llama"}}, "status": {"conditions": conditions}}
        await handlers.pod_event(
            event={"type": kind, "object": pod}, namespace="llm", labels={"app": "llama"}, memo=memo
        )

    asyncio.run(event("MODIFIED", ready=True))  # nothing that matters
    assert not any(waker.is_set() for waker in runtime.wakers.values())
    asyncio.run(event("MODIFIED", ready=False))
    assert {key for key, waker in runtime.wakers.items() if waker.is_set()} == {("llm", "llama")}


@pytest.mark.parametrize(
    ("stored", "mine", "parsed"),
    [
        ("2026-12-01T10:00:05Z", "2026-12-01T10:00:05+00:00", False),  # this process's own write
        ("2026-12-01T10:00:00Z", "2026-12-01T10:00:05+00:00", False),  # older (the watch lags behind)
        ("2026-12-01T10:00:09Z", "2026-12-01T10:00:05+00:00", True),  # newer: somebody else wrote it
        ("2026-12-01T10:00:05Z", None, True),  # nothing remembered
        ("2026-12-01T10:00:00", "2026-12-01T10:00:05+00:00", True),  # no zone (an edit): parsed, not compared
        ("yesterday", "2026-12-01T10:00:05+00:00", True),  # unreadable: parsed (and reported)
    ],
)
def test_the_stored_status_is_parsed_unless_this_process_wrote_it_or_a_newer_one(stored, mine, parsed):
    body = {**BODY, "status": {"lastReconcileTime": stored, "routable": "2/2"}}
    snapshot = SnapshotReader().read(kopf.Body(body), datetime.fromisoformat(mine) if mine else None)
    assert (snapshot.status is not None) == parsed
    if parsed:
        assert snapshot.status is not None
        assert snapshot.status.routable == "2/2"


def test_a_pass_parses_the_spec_once_per_generation_and_annotations_but_sees_every_change(monkeypatch):
    parsed: list[Any] = []
    real = snapshots.parse_snapshot
    monkeypatch.setattr(snapshots, "parse_snapshot", lambda body: parsed.append(1) or real(body))
    reader, mine = SnapshotReader(), datetime.fromisoformat("2026-12-01T10:00:05+00:00")
    own = {**BODY, "status": {"lastReconcileTime": "2026-12-01T10:00:05Z"}}
    first = reader.read(kopf.Body(own), mine)
    assert reader.read(kopf.Body(own), mine) is first  # the pass's own status write: nothing new to parse
    assert len(parsed) == 1
    assert first.spec is not None
    assert first.spec.interval == 1.0
    operation = '{"action": "pause"}'
    annotated = {**own, "metadata": {**own["metadata"], "annotations": {OPERATION_ANNOTATION: operation}}}
    assert reader.read(kopf.Body(annotated), mine).operation is not None  # no new generation, still seen
    respec = {
        **annotated,
        "metadata": {**annotated["metadata"], "generation": 2},
        "spec": {**BODY["spec"], "interval": "7s"},
    }
    changed = reader.read(kopf.Body(respec), mine)
    assert changed.spec is not None
    assert changed.spec.interval == 7.0
    assert len(parsed) == 3
    reader.forget("u1")
    reader.read(kopf.Body(respec), mine)
    assert len(parsed) == 4


def test_settings_come_from_the_config_not_the_environment(monkeypatch):
    monkeypatch.setenv("SLUICE_PEERING", "x")  # read at import time before; ignored now
    assert OperatorConfig().first_pass_delay == 0.0
    assert OperatorConfig(peering="sluice").first_pass_delay == 5.0
    assert "os.environ" not in inspect.getsource(handlers)


def on_virtual_time(main: Any) -> None:
    """Run `main()` on an event loop whose clock fast-forwards over every wait (looptime): timings are exact,
    and a test of a 60 s interval takes no 60 s."""
    with asyncio.Runner(loop_factory=looptime.new_event_loop) as runner:
        runner.run(asyncio.wait_for(main(), timeout=600))


def passes_taking(seconds: float) -> handlers.PassRunner:
    """Passes that run on the loop's thread and take `seconds` of the loop's time."""

    async def run(work: handlers.Pass) -> tuple[float, PassReport]:
        result = work()
        await asyncio.sleep(seconds)
        return result

    return run


class TimedReconciler(FakeReconciler):
    """Records the loop time each pass starts at; stops after `passes` passes."""

    def __init__(self, stop: Any, passes: int) -> None:
        super().__init__(stop)
        self.passes = passes
        self.started: list[float] = []

    def run(self, snapshot: PoolSnapshot, now: datetime) -> PassReport:
        self.started.append(asyncio.get_running_loop().time())
        if len(self.started) >= self.passes:
            self.stop()
        return PassReport(pool=snapshot.key)


@pytest.mark.parametrize(("took", "gap"), [(0.5, 2.0), (1.5, 2.5)])
def test_passes_start_one_interval_apart_however_long_each_takes(took, gap):
    # The loop used to wait a whole interval after each pass ended: passes drifted by their own duration (2.5 s
    # and 3.5 s apart here), and the pass-lag metric reported that drift as the operator falling behind. A pass
    # that ends less than MIN_GAP before the next one is due waits MIN_GAP (1 s) after it ends.
    setter: FlagSetter[Any] = FlagSetter()
    reconciler = TimedReconciler(setter.set, passes=3)
    runtime = runtime_with(reconciler)
    runtime.run_pass = passes_taking(took)

    async def go() -> None:
        await daemon(SimpleNamespace(runtime=runtime), setter, interval="2s")

    on_virtual_time(go)
    gaps = [b - a for a, b in itertools.pairwise(reconciler.started)]
    assert gaps == [pytest.approx(gap), pytest.approx(gap)]


def test_a_sharded_replica_asks_prometheus_for_the_pods_of_the_pools_it_runs():
    runtime = handlers.Runtime(config=OperatorConfig())

    def pod(name: str, app: str) -> dict[str, Any]:
        return {"metadata": {"name": name, "namespace": "llm", "labels": {"app": app}}, "status": {}}

    runtime.pods.finish_seed("llm", [pod("a-0", "a"), pod("a-1", "a"), pod("b-0", "b"), pod("c-0", "c")])
    # pool-c: another replica's; pool-x: its spec does not parse (no selector): it selects nothing
    runtime.selectors = {"llm": {"pool-a": {"app": "a"}, "pool-b": {"app": "b"}, "pool-x": {}}}
    assert handlers.owned_pods(runtime, "llm") == {"a-0", "a-1", "b-0"}
    assert handlers.owned_pods(runtime, "other") == frozenset()


def test_a_daemon_told_to_stop_while_it_waits_for_its_next_pass_exits_at_once():
    """kopf stopping the daemon (pool deleted, operator shutting down) must not wait out a 60 s interval: the
    daemon used to wait on its waker alone, until the interval ended or kopf cancelled it 10 s later."""
    setter: FlagSetter[Any] = FlagSetter()
    reconciler = FakeReconciler(lambda: None)  # the pass does not stop it: the stop comes while it waits
    runtime = runtime_with(reconciler)
    runtime.run_pass = passes_taking(0.0)
    times: dict[str, float] = {}

    async def go() -> None:
        clock = asyncio.get_running_loop().time
        times["start"] = clock()

        async def stop_later() -> None:
            await asyncio.sleep(1.5)  # the first pass and its 1 s gap are done; the daemon waits for its next one
            times["stop"] = clock()
            setter.set()

        stopper = asyncio.create_task(stop_later())
        await daemon(SimpleNamespace(runtime=runtime), setter, interval="60s")
        times["exit"] = clock()
        await stopper

    on_virtual_time(go)
    assert len(reconciler.snapshots) == 1
    assert times["stop"] - times["start"] == pytest.approx(1.5)
    assert times["exit"] == pytest.approx(times["stop"])  # not at the end of the interval (60 s)
    assert runtime.wakers == {}


def test_a_daemon_told_to_stop_during_the_gap_after_a_pass_does_not_wait_it_out(monkeypatch):
    """The gap between two passes of a pool (MIN_GAP, here 5 s) is no reason to keep kopf waiting on a stop."""
    monkeypatch.setattr(handlers, "MIN_GAP", 5.0)
    setter: FlagSetter[Any] = FlagSetter()
    times: dict[str, float] = {}

    def stop_soon() -> None:  # during the pass: the stop lands 0.3 s after it, inside the gap
        loop = asyncio.get_running_loop()

        def stop() -> None:
            times["stop"] = loop.time()
            setter.set()

        loop.call_later(0.3, stop)

    reconciler = FakeReconciler(stop_soon)
    runtime = runtime_with(reconciler)
    runtime.run_pass = passes_taking(0.0)

    async def go() -> None:
        await daemon(SimpleNamespace(runtime=runtime), setter, interval="60s")
        times["exit"] = asyncio.get_running_loop().time()

    on_virtual_time(go)
    assert len(reconciler.snapshots) == 1
    assert times["exit"] == pytest.approx(times["stop"])  # not 5 s later
