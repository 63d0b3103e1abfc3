"""The API emulator wakes its watchers without making the write wait: a write's answer never queues behind them."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import kmock
import pytest

from sluice.emulator.apiserver import ApiServer, _HttpServer

LEASES = "/apis/coordination.k8s.io/v1/namespaces/default/leases"


def completes_at_once(coroutine: Any) -> bool:
    """Whether the coroutine finishes without giving the event loop a turn."""
    try:
        coroutine.send(None)
    except StopIteration:
        return True
    coroutine.close()
    return False


@pytest.mark.asyncio
async def test_a_write_wakes_the_watchers_without_waiting_for_them() -> None:
    server = ApiServer()
    server.store.create(server.store.find_type("", "namespaces"), "v1", None, {"metadata": {"name": "default"}})
    leases = server.store.find_type("coordination.k8s.io", "leases")
    headers = {"Authorization": "Bearer local-stack"}
    async with (
        server,
        kmock.Server(server, host="127.0.0.1", port=0, server_cls=_HttpServer) as http,
        aiohttp.ClientSession(f"http://127.0.0.1:{http.port}", headers=headers) as session,
    ):
        listed = await (await session.get(LEASES)).json()
        since = listed["metadata"]["resourceVersion"]
        watches = [await session.get(LEASES, params={"watch": "true", "resourceVersion": since}) for _ in range(20)]
        await asyncio.sleep(0.2)  # the watchers are waiting for a change
        for _ in range(3):
            assert completes_at_once(server._notify(leases))
            # the watchers are woken and take their turns; the next write must not wait for them
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        lease = {"metadata": {"name": "a"}, "spec": {"holderIdentity": "x", "leaseDurationSeconds": 10}}
        created = await session.post(LEASES, json=lease)
        assert created.status == 201
        for watch in watches:  # and every watcher still sees the write that followed
            line = await asyncio.wait_for(watch.content.readline(), timeout=10)
            assert b'"ADDED"' in line
            watch.close()
