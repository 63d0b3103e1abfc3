"""The Prometheus fault proxy: error answers shaped as Prometheus' API writes them, partial answers, fault settings
refused with the field named, and the proxy itself in front of a small upstream (forwarding, latency, errors,
partial answers, a hang the client gives up on, an outage that refuses connections, its own end)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from sluice.devstack.promfaults import (
    ERROR_STATUS,
    FaultProxy,
    Faults,
    FaultsError,
    error_answer,
    parse_faults,
    partial_answer,
)


def vector(*pods: str) -> bytes:
    result = [{"metric": {"pod": pod}, "value": [1.5, "1"]} for pod in pods]
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()


def pods_in(body: bytes) -> list[str]:
    return [series["metric"]["pod"] for series in json.loads(body)["data"]["result"]]


@pytest.mark.parametrize(
    ("error_type", "status"),
    [("bad_data", 400), ("execution", 422), ("timeout", 503), ("canceled", 503), ("internal", 500)],
)
def test_error_answers_carry_prometheus_status_code_per_error_type(error_type: str, status: int) -> None:
    code, body = error_answer(error_type)
    assert code == status
    assert body.startswith(b'{"status":"error","errorType":"' + error_type.encode() + b'","error":"')


def test_a_timeout_answer_is_what_sluice_reads_as_prometheus_stopping_the_query() -> None:
    # sluice.io.promtransport.describe_failure looks for the compact `"errorType":"timeout"` of api.go's encoder
    assert b'"errorType":"timeout"' in error_answer("timeout")[1]


def test_partial_answer_drops_the_named_pods_series() -> None:
    body = partial_answer(vector("a", "b", "c"), Faults(drop_pods=frozenset({"b"})), random.Random(0))
    assert pods_in(body) == ["a", "c"]


def test_partial_answer_drops_a_seeded_fraction_the_same_way_each_time() -> None:
    pods = [f"p{i}" for i in range(200)]
    first = pods_in(partial_answer(vector(*pods), Faults(drop_fraction=0.25), random.Random(7)))
    again = pods_in(partial_answer(vector(*pods), Faults(drop_fraction=0.25), random.Random(7)))
    assert first == again
    assert 120 < len(first) < 180  # 150 expected of 200


def test_partial_answer_leaves_non_vector_answers_and_clean_faults_alone() -> None:
    scalar = json.dumps({"status": "success", "data": {"resultType": "scalar", "result": [1, "2"]}}).encode()
    assert partial_answer(scalar, Faults(drop_fraction=1.0), random.Random(0)) == scalar
    clean = vector("a")
    assert partial_answer(clean, Faults(), random.Random(0)) is clean


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"latency": -1}, "latency"),
        ({"drop_fraction": 1.5}, "drop_fraction"),
        ({"error": "teapot"}, "error"),
        ({"outage": "yes"}, "outage"),
        ({"drop_pods": "a"}, "drop_pods"),
        ({"latncy": 1}, "latncy"),
    ],
)
def test_bad_fault_settings_are_refused_naming_the_field(body: dict[str, object], field: str) -> None:
    with pytest.raises(FaultsError, match=f"^{field}:"):
        parse_faults(body)  # type: ignore[arg-type]


def test_fault_settings_parse() -> None:
    faults = parse_faults({"latency": 0.5, "error": "execution", "drop_pods": ["x"], "outage": True})
    assert faults == Faults(latency=0.5, error="execution", drop_pods=frozenset({"x"}), outage=True)
    assert set(ERROR_STATUS) >= {"timeout", "execution", "bad_data"}


# ------------------------------------------------------------------------------------ the proxy, with an upstream


@pytest_asyncio.fixture
async def upstream() -> AsyncIterator[str]:
    """A stand-in upstream answering /api/v1/query with a vector of pods a, b, c (the e2e test uses Prometheus)."""

    async def query(request: web.Request) -> web.Response:
        form = await request.post() if request.method == "POST" else request.query
        assert form["query"] == "up"
        return web.Response(body=vector("a", "b", "c"), content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/api/v1/query", query)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


async def ask(http: aiohttp.ClientSession, url: str, method: str = "GET") -> tuple[int, bytes]:
    target = f"{url}/api/v1/query"
    if method == "POST":
        async with http.post(target, data={"query": "up"}) as answer:
            return answer.status, await answer.read()
    async with http.get(target, params={"query": "up"}) as answer:
        return answer.status, await answer.read()


@pytest.mark.asyncio
async def test_the_proxy_forwards_and_applies_faults_set_on_its_admin_path(upstream: str) -> None:
    proxy = FaultProxy(upstream, lifetime=30, seed=1)
    await proxy.start()
    try:
        async with aiohttp.ClientSession() as http:
            assert pods_in((await ask(http, proxy.url, "POST"))[1]) == ["a", "b", "c"]
            async with http.post(f"{proxy.admin_url}/faults", json={"drop_pods": ["a"]}) as set_:
                assert set_.status == 200
            assert pods_in((await ask(http, proxy.url))[1]) == ["b", "c"]
            async with http.post(f"{proxy.admin_url}/faults", json={"error": "execution"}):
                pass
            status, body = await ask(http, proxy.url)
            assert (status, json.loads(body)["errorType"]) == (422, "execution")
            async with http.post(f"{proxy.admin_url}/faults", json={"error": "nope"}) as refused:
                assert refused.status == 400
                assert (await refused.json())["error"].startswith("error:")
            async with http.delete(f"{proxy.admin_url}/faults") as cleared:
                counters = (await cleared.json())["counters"]
            assert (counters["partial"], counters["errors"]) == (1, 1)
            assert (await ask(http, proxy.url))[0] == 200
    finally:
        await proxy.stop()


@pytest.mark.asyncio
async def test_an_outage_refuses_connections_until_cleared(upstream: str) -> None:
    proxy = FaultProxy(upstream, lifetime=30)
    await proxy.start()
    try:
        async with aiohttp.ClientSession() as http:
            assert (await ask(http, proxy.url))[0] == 200  # a keep-alive connection now exists
            await proxy.set_faults(Faults(outage=True))
            with pytest.raises(aiohttp.ClientConnectionError):
                await ask(http, proxy.url)
            async with http.get(f"{proxy.admin_url}/faults") as admin:  # the admin path stays up
                assert (await admin.json())["faults"]["outage"] is True
            await proxy.set_faults(Faults())
            assert (await ask(http, proxy.url))[0] == 200
    finally:
        await proxy.stop()


@pytest.mark.asyncio
async def test_a_hang_gives_no_answer_until_the_client_gives_up(upstream: str) -> None:
    proxy = FaultProxy(upstream, lifetime=30)
    await proxy.start()
    try:
        await proxy.set_faults(Faults(hang=True))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as http:
            with pytest.raises(asyncio.TimeoutError):
                await ask(http, proxy.url)
        assert proxy.counters.hung == 1
        for _ in range(100):  # the proxy notices the client left (at most 5 s, though hang_limit is 30 s)
            if proxy.counters.abandoned:
                break
            await asyncio.sleep(0.05)
        assert proxy.counters.abandoned == 1
    finally:
        await proxy.stop()


@pytest.mark.asyncio
async def test_the_proxy_stops_by_itself_at_the_end_of_its_lifetime(upstream: str) -> None:
    proxy = FaultProxy(upstream, lifetime=0.2)
    await proxy.start()
    await asyncio.wait_for(proxy.stopped.wait(), timeout=5)
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientConnectionError):
            await ask(http, proxy.url)


def test_a_lifetime_is_required() -> None:
    with pytest.raises(FaultsError, match=r"^lifetime:"):
        FaultProxy("http://127.0.0.1:1", lifetime=0)
