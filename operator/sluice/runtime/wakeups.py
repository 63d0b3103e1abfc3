"""When a pool's daemon wakes: its wait for the next pass, the shard's pools woken from the lease thread, the pod
events worth a pass at once, and its first pass's turn (`FirstPassGate`).

A daemon waits on its pool's `asyncio.Event` (its waker, set on the event loop's thread by the handlers), until the
next pass is due, kopf stops it, or, with shards, its shard's validity ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping

import kopf

from sluice.api.jsontypes import members
from sluice.core.admission import Admission
from sluice.runtime.sharding import ShardLeases

Wakers = dict[tuple[str | None, str], asyncio.Event]
"""(namespace, name) -> the pool daemon's waker."""


async def wait_for_next_pass(
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


async def wake_when_stopped(stopped: kopf.DaemonStopped, waker: asyncio.Event) -> None:
    await stopped.wait()
    waker.set()


class FirstPassGate:
    """Pools' first passes admitted as `sluice.core.admission.Admission` says; used on the event loop's thread
    only (the daemons'), so it needs no lock: a pool waits on a future its turn resolves."""

    def __init__(self, limit: int) -> None:
        self.state = Admission(limit)
        self._turns: dict[str, asyncio.Future[None]] = {}

    def turn(self, pool: str, first: bool) -> contextlib.AbstractAsyncContextManager[None]:
        """Around a pool's pass: its first waits its turn (`admitted`), the others go at once."""
        return self.admitted(pool) if first else contextlib.nullcontext()

    @contextlib.asynccontextmanager
    async def admitted(self, pool: str) -> AsyncIterator[None]:
        """Around a pool's first pass: waits for its turn; its place goes to the next in line when it ends (or
        the wait is cancelled)."""
        self.state, now = self.state.ask(pool)
        try:
            if not now:
                self._turns[pool] = turn = asyncio.get_running_loop().create_future()
                await turn
            yield
        finally:
            self._turns.pop(pool, None)
            self.state, admitted = self.state.done(pool)
            for other in admitted:
                waiting = self._turns.get(other)
                if waiting is not None and not waiting.done():
                    waiting.set_result(None)


def wake_shard(wakers: Wakers, shards: ShardLeases, loop: asyncio.AbstractEventLoop, index: int) -> None:
    """From the lease thread: wake, on the operator's loop, the daemons of the pools in shard `index`."""

    def wake() -> None:
        for (namespace, name), waker in list(wakers.items()):
            if shards.shard(namespace or "default", name) == index:
                waker.set()

    loop.call_soon_threadsafe(wake)


def _rows(status: Mapping[str, object], key: str) -> Iterator[Mapping[str, object]]:
    found = status.get(key)
    if isinstance(found, list | tuple):
        yield from (row for row in found if isinstance(row, Mapping))


def pod_matters(event_type: str, pod: Mapping[str, object]) -> bool:
    """A pod event worth an immediate pass: deletion, not Ready, a restart, a terminating pod."""
    if event_type == "DELETED":
        return True
    status = members(pod, "status")
    if members(pod, "metadata").get("deletionTimestamp"):
        return True
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in _rows(status, "conditions"))
    restarted = any(_count(c.get("restartCount", 0)) > 0 for c in _rows(status, "containerStatuses"))
    return not ready or restarted


def _count(value: object) -> int:
    return int(value) if isinstance(value, int | float | str) else 0
