"""First passes admitted a few at a time (`sluice.core.admission`, `sluice.runtime.wakeups.FirstPassGate`, the
daemons): when a replica starts or takes over shards, its pools' first passes do not all hit the API server at
once."""

from __future__ import annotations

import asyncio
from datetime import datetime
from types import SimpleNamespace
from typing import Any

import kopf
import pytest
from kopf._cogs.aiokits.aioenums import AsyncFlagWaiter, FlagSetter

from sluice.api.snapshot import PoolSnapshot
from sluice.core.admission import Admission
from sluice.runtime import handlers
from sluice.runtime.config import OperatorConfig
from sluice.runtime.metrics import OperatorMetrics
from sluice.runtime.report import PassReport
from sluice.runtime.wakeups import FirstPassGate
from tests.test_handlers import BODY


def test_at_most_limit_first_passes_run_and_the_others_wait_their_turn_in_order():
    state = Admission(2)
    admitted = []
    for pool in "abcd":
        state, now = state.ask(pool)
        admitted.append(now)
    assert admitted == [True, True, False, False]
    assert state.waiting == ("c", "d")
    state, next_in = state.done("a")
    assert next_in == ("c",)
    assert state.running == frozenset({"b", "c"})
    state, next_in = state.done("d")  # stopped waiting (deleted): leaves the line, admits nobody
    assert next_in == ()
    assert state.waiting == ()
    state, now = state.ask("e")
    assert not now  # b and c run
    state, next_in = state.done("b")
    assert next_in == ("e",)


def test_asking_again_keeps_a_pools_place():
    state, _ = Admission(1).ask("a")
    state, _ = state.ask("b")
    assert state.ask("b") == (state, False)
    assert state.ask("a") == (state, True)


def test_no_first_pass_at_all_is_refused_by_its_flag():
    with pytest.raises(ValueError, match=r"--first-passes\) must be at least 1, not 0"):
        Admission(0)


def test_the_default_is_half_the_workers_and_at_least_one():
    assert OperatorConfig().first_pass_limit == 8  # of the default 16 workers
    assert OperatorConfig(workers=8).first_pass_limit == 4
    assert OperatorConfig(workers=1).first_pass_limit == 1
    assert OperatorConfig(first_passes=9).first_pass_limit == 9


def test_the_gate_holds_a_pool_until_one_ahead_of_it_ends_and_lets_a_cancelled_wait_go():
    async def go() -> list[str]:
        gate = FirstPassGate(1)
        order: list[str] = []
        release = asyncio.Event()

        async def first_pass(pool: str) -> None:
            async with gate.turn(pool, first=True):
                order.append(pool)
                await release.wait()

        tasks = {pool: asyncio.create_task(first_pass(pool)) for pool in "abc"}
        await asyncio.sleep(0.01)
        assert order == ["a"]
        tasks["b"].cancel()  # b's daemon stopped while it waited
        async with gate.turn("steady", first=False):  # a pool's later passes are not held
            order.append("steady")
        release.set()
        await asyncio.gather(tasks["a"], tasks["c"])
        assert gate.state == Admission(1)
        return order

    assert asyncio.run(asyncio.wait_for(go(), timeout=5)) == ["a", "steady", "c"]


class StoppingReconciler:
    """Stops each pool's daemon after its first pass."""

    def __init__(self, stops: dict[str, Any]) -> None:
        self.stops = stops

    def run(self, snapshot: PoolSnapshot, now: datetime) -> PassReport:
        self.stops[snapshot.meta.name]()
        return PassReport(pool=snapshot.key)

    def forget(self, uid: str) -> None: ...

    def written_at(self, uid: str) -> datetime | None:
        return None


def test_a_replica_starting_with_many_pools_runs_their_first_passes_a_few_at_a_time():
    pools = [f"pool-{i}" for i in range(6)]
    runtime = handlers.Runtime(config=OperatorConfig(first_passes=2))
    runtime.metrics = OperatorMetrics(runtime.registry)
    in_flight = {"now": 0, "peak": 0, "passes": 0}

    async def run_pass(work: Any) -> Any:
        in_flight["now"] += 1
        in_flight["peak"] = max(in_flight["peak"], in_flight["now"])
        await asyncio.sleep(0.02)  # the API server answering a first pass's reads
        in_flight["now"] -= 1
        in_flight["passes"] += 1
        return work()

    runtime.run_pass = run_pass

    async def go() -> None:
        loop = asyncio.get_running_loop()
        setters = {pool: FlagSetter[Any]() for pool in pools}
        stops = {pool: (lambda s=setter: loop.call_soon(s.set)) for pool, setter in setters.items()}
        runtime.reconciler = StoppingReconciler(stops)  # type: ignore[assignment]
        memo = SimpleNamespace(runtime=runtime)
        daemons = []
        for pool in pools:
            body = {**BODY, "metadata": {**BODY["metadata"], "name": pool, "uid": pool}}
            stopped = AsyncFlagWaiter(setters[pool])
            daemons.append(
                handlers.pool_loop(name=pool, namespace="llm", body=kopf.Body(body), memo=memo, stopped=stopped)
            )
        await asyncio.gather(*daemons)

    asyncio.run(asyncio.wait_for(go(), timeout=10))
    assert in_flight["passes"] == 6
    assert in_flight["peak"] == 2


def test_the_flag_reaches_the_operator_config_and_zero_is_refused_by_name(capsys):
    from sluice.cli import build_parser, operator_config  # noqa: PLC0415

    assert operator_config(build_parser().parse_args(["operator", "--first-passes", "3"])).first_pass_limit == 3
    assert operator_config(build_parser().parse_args(["operator"])).first_passes is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["operator", "--first-passes", "0"])
    assert "argument --first-passes: must be at least 1, not 0" in capsys.readouterr().err
