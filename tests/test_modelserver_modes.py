"""The simulated model server's modes: data parallelism, vLLM's sleep mode, SGLang's exposition, and the local
kubelet's OOMKilled-versus-Error rule fed by the server's memory.events record."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from sluice.devstack.kubelet import read_oom_kills, termination_reason
from sluice.devstack.modelserver import ModelServer, read_memory_events, record_oom_kill
from sluice.devstack.stack import ROOT, free_port

DEADLINE = 20.0  # every wait in these tests is bounded by this


@asynccontextmanager
async def serving(server: ModelServer) -> AsyncIterator[TestClient[Any, Any]]:
    """The server's app on an ephemeral 127.0.0.1 port, in this event loop."""
    client: TestClient[Any, Any] = TestClient(TestServer(server.app(), host="127.0.0.1"))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


async def scrape(client: TestClient[Any, Any]) -> dict[str, list[Sample]]:
    """`/metrics` parsed: every sample by its family's name."""
    response = await client.get("/metrics")
    assert response.status == 200
    return {family.name: family.samples for family in text_string_to_metric_families(await response.text())}


def value(samples: list[Sample], **labels: str) -> float:
    matching = [s.value for s in samples if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matching) == 1, (labels, samples)
    return matching[0]


async def complete(client: TestClient[Any, Any], max_tokens: int, stream: bool = False) -> dict[str, Any]:
    """One completion; the SSE stream's last chunk when streaming."""
    body = {"prompt": "one two three four five six seven eight", "max_tokens": max_tokens, "stream": stream}
    response = await client.post("/v1/completions", json=body)
    assert response.status == 200
    if not stream:
        return dict(await response.json())
    chunks = [line[6:] for line in (await response.text()).splitlines() if line.startswith("data: {")]
    return dict(json.loads(chunks[-1]))


async def until(check: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def bounded(awaitable: Awaitable[Any]) -> Any:
    return await asyncio.wait_for(awaitable, DEADLINE)


PER_ENGINE_FAMILIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:engine_sleep_state",
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:num_preemptions",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
)


# ---------------------------------------------------------------------------------------------- data parallelism


@pytest.mark.asyncio
async def test_data_parallel_exports_every_engine_family_per_rank_and_splits_the_load() -> None:
    server = ModelServer("a100", "llama", seed=0, data_parallel_size=2)
    async with serving(server) as client:
        in_flight = [asyncio.create_task(complete(client, max_tokens=120)) for _ in range(6)]
        await until(lambda: sum(len(e.flights) for e in server.engines) == 6, "six requests in flight")
        metrics = await scrape(client)
        assert not any(task.done() for task in in_flight), "a request finished before the scrape: not all in flight"

        for family in PER_ENGINE_FAMILIES:
            engines = {s.labels["engine"] for s in metrics[family]}
            assert engines == {"0", "1"}, (family, engines)
            assert {s.labels["model_name"] for s in metrics[family]} == {"llama"}
        running = [value(metrics["vllm:num_requests_running"], engine=e) for e in "01"]
        waiting = [value(metrics["vllm:num_requests_waiting"], engine=e) for e in "01"]
        assert sum(running) + sum(waiting) == len(in_flight)
        assert all(r + w >= 1 for r, w in zip(running, waiting, strict=True)), "the balancer left an engine idle"

        answers = await bounded(asyncio.gather(*in_flight))
        assert all(a["choices"][0]["finish_reason"] == "length" for a in answers)
        metrics = await scrape(client)
        finished = [value(metrics["vllm:request_success"], engine=e, finished_reason="length") for e in "01"]
        assert sum(finished) == 6
        assert all(f >= 1 for f in finished)
        assert all("engine" not in s.labels for s in metrics["http_requests"])  # the instrumentator's: no engine


@pytest.mark.asyncio
async def test_one_engine_keeps_the_single_engine_exposition() -> None:
    server = ModelServer("a100", "llama", seed=0)
    async with serving(server) as client:
        await bounded(complete(client, max_tokens=2))
        metrics = await scrape(client)
    for family in PER_ENGINE_FAMILIES:
        assert {s.labels["engine"] for s in metrics[family]} == {"0"}, family
    assert value(metrics["vllm:request_success"], finished_reason="length") == 1
    assert value(metrics["http_requests"], handler="/v1/completions", status="2xx", method="POST") == 1


# ---------------------------------------------------------------------------------------------- prefix caching


async def _answered(client: TestClient[Any, Any], prompt: str) -> None:
    response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert response.status == 200
    await response.read()


@pytest.mark.asyncio
@pytest.mark.parametrize("caching", [True, False])
async def test_a_prompt_sharing_words_with_an_earlier_one_finds_them_cached(caching: bool) -> None:
    # What the cache saves in time is the engine's (tests/test_prefix_cache.py, in simulated time); here, that the
    # server looks its prompts up by word and counts it as vLLM does, and that the flag turns it off.
    server = ModelServer("a100", "llama", seed=0, enable_prefix_caching=caching)
    shared = " ".join(f"s{k}" for k in range(4000))
    async with serving(server) as client:
        await bounded(_answered(client, f"{shared} first question"))
        await bounded(_answered(client, f"{shared} second question"))
        if caching:
            await until(lambda: server._prefix_counted[0][0] >= 2 * 4002, "the lookups counted by the ticker")
        metrics = await scrape(client)
    queries = value(metrics["vllm:prefix_cache_queries"], engine="0")
    hits = value(metrics["vllm:prefix_cache_hits"], engine="0")
    if caching:
        assert (queries, hits) == (2 * 4002, 4000 // 16 * 16)  # the shared words' full blocks
    else:
        assert (queries, hits) == (0, 0)


# ---------------------------------------------------------------------------------------------- sleep mode


def sleep_state(metrics: dict[str, list[Sample]], engine: str = "0") -> dict[str, float]:
    samples = [s for s in metrics["vllm:engine_sleep_state"] if s.labels["engine"] == engine]
    return {s.labels["sleep_state"]: s.value for s in samples}


@pytest.mark.asyncio
async def test_sleep_stops_the_engine_and_wake_up_resumes_it() -> None:
    server = ModelServer("a100", "llama", seed=0, enable_sleep_mode=True, data_parallel_size=2)
    async with serving(server) as client:
        assert (await (await client.get("/is_sleeping")).json()) == {"is_sleeping": False}
        for engine in "01":
            assert sleep_state(await scrape(client), engine) == {
                "awake": 1,
                "weights_offloaded": 0,
                "discard_all": 0,
            }

        # A request in flight when /sleep comes (default mode=abort) is finished as aborted.
        in_flight = asyncio.create_task(complete(client, max_tokens=400, stream=True))
        await until(lambda: any(e.flights for e in server.engines), "a request in flight")
        answer = await bounded(client.post("/sleep", params={"level": "1"}))
        assert answer.status == 200
        assert await answer.read() == b""
        assert (await bounded(in_flight))["choices"][0]["finish_reason"] == "abort"

        assert (await (await client.get("/is_sleeping")).json()) == {"is_sleeping": True}
        metrics = await scrape(client)
        for engine in "01":
            assert sleep_state(metrics, engine) == {"awake": 0, "weights_offloaded": 1, "discard_all": 0}
        assert value(metrics["vllm:request_success"], engine="0", finished_reason="abort") == 1

        # Asleep, the engine does not run: a new request is accepted and waits.
        asleep = asyncio.create_task(complete(client, max_tokens=2))
        await until(lambda: sum(e.num_waiting for e in server.engines) == 1, "the request queued")
        await asyncio.sleep(0.3)
        assert not asleep.done()
        metrics = await scrape(client)
        assert sum(value(metrics["vllm:num_requests_waiting"], engine=e) for e in "01") == 1
        assert sum(value(metrics["vllm:num_requests_running"], engine=e) for e in "01") == 0

        answer = await bounded(client.post("/wake_up"))
        assert answer.status == 200
        assert await answer.read() == b""
        assert (await bounded(asleep))["choices"][0]["finish_reason"] == "length"
        assert (await (await client.get("/is_sleeping")).json()) == {"is_sleeping": False}
        assert sleep_state(await scrape(client), "1") == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}

        await bounded(client.post("/sleep", params={"level": "2", "mode": "wait"}))
        assert sleep_state(await scrape(client)) == {"awake": 0, "weights_offloaded": 0, "discard_all": 1}
        await bounded(client.post("/wake_up"))


@pytest.mark.asyncio
async def test_sleep_endpoints_need_sleep_mode_but_the_gauge_is_always_there() -> None:
    server = ModelServer("a100", "llama", seed=0)
    async with serving(server) as client:
        assert (await client.post("/sleep")).status == 404
        assert (await client.get("/is_sleeping")).status == 404
        assert sleep_state(await scrape(client)) == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}


# ---------------------------------------------------------------------------------------------- SGLang's exposition


@pytest.mark.asyncio
async def test_sglang_exposition_speaks_sglang_names_and_labels() -> None:
    server = ModelServer("a100", "llama", seed=0, exposition="sglang", data_parallel_size=2)
    async with serving(server) as client:
        answer = await bounded(complete(client, max_tokens=3))
        assert answer["choices"][0]["finish_reason"] == "length"
        metrics = await scrape(client)

    assert not [name for name in metrics if name.startswith("vllm:")]
    assert "http_requests" not in metrics  # vLLM's instrumentator is not there either
    scheduler = {"model_name": "llama", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
    for family in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"):
        assert sorted(s.labels["dp_rank"] for s in metrics[family]) == ["0", "1"], family
        for sample in metrics[family]:
            assert sample.name == family
            assert {k: v for k, v in sample.labels.items() if k != "dp_rank"} == scheduler
    tokenizer = {"model_name": "llama", "engine_type": "unified"}
    assert value(metrics["sglang:num_requests"], **tokenizer) == 1
    assert [s.name for s in metrics["sglang:num_requests"] if s.name.endswith("_total")] == [
        "sglang:num_requests_total"
    ]
    assert value(metrics["sglang:prompt_tokens"], **tokenizer) == 8
    assert value(metrics["sglang:generation_tokens"], **tokenizer) == 3
    for family in ("sglang:time_to_first_token_seconds", "sglang:e2e_request_latency_seconds"):
        count = [s for s in metrics[family] if s.name == f"{family}_count"]
        assert [(s.labels, s.value) for s in count] == [(tokenizer, 1)], family
    responses = metrics["sglang:http_responses"]
    assert value(responses, endpoint="/v1/completions", status_code="200", method="POST") == 1
    assert value(metrics["sglang:http_requests"], endpoint="/v1/completions", method="POST") == 1
    # The LoRA simulation counters stay as they are.
    assert value(metrics["sluice_sim_lora_loads"], model_name="llama", engine="0") == 0


# ---------------------------------------------------------------------------------------------- the kubelet's rule


def test_kubelet_reports_oomkilled_only_when_the_oom_killer_fired() -> None:
    assert termination_reason(137, 0, 1) == ("OOMKilled", 137)
    assert termination_reason(137, 2, 3) == ("OOMKilled", 137)
    # A SIGKILL from elsewhere (a liveness probe, kill -9) is an Error with exit code 137, however it is reported.
    assert termination_reason(137, 0, 0) == ("Error", 137)
    assert termination_reason(-9, 0, 0) == ("Error", 137)
    assert termination_reason(-9, 1, 1) == ("Error", 137)  # an OOM kill of an earlier run does not count
    assert termination_reason(1, 0, 0) == ("Error", 1)
    assert termination_reason(0, 0, 0) == ("Completed", 0)


def test_oom_kill_is_recorded_in_memory_events_format(tmp_path: Path) -> None:
    events = tmp_path / "memory.events"
    assert read_oom_kills(events) == 0
    assert record_oom_kill(events) == 1
    assert record_oom_kill(events) == 2
    lines = events.read_text().splitlines()
    assert lines == ["low 0", "high 0", "max 2", "oom 2", "oom_kill 2", "oom_group_kill 0"]
    assert read_oom_kills(events) == 2
    assert read_memory_events(events)["oom_kill"] == 2


def _run_fault(tmp_path: Path, fault: dict[str, bool]) -> tuple[int, int, int]:
    """Start a model server process, inject `fault`, and return (status, oom_kill before, oom_kill after)."""
    events = tmp_path / "memory.events"
    before = read_oom_kills(events)
    port = free_port()
    args = ["-m", "sluice.devstack.modelserver", "--host", "127.0.0.1", "--port", str(port)]
    process = subprocess.Popen(
        [sys.executable, *args, "--memory-events", str(events)],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "operator")},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + DEADLINE
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    break
            except OSError:
                assert process.poll() is None, "the server exited before it answered"
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.05)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/admin/faults",
            data=json.dumps(fault).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5):
            pass
        status = process.wait(timeout=DEADLINE)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=DEADLINE)
    return status, before, read_oom_kills(events)


def test_the_oom_fault_is_oomkilled_and_a_plain_sigkill_is_an_error(tmp_path: Path) -> None:
    status, before, after = _run_fault(tmp_path, {"oom": True})
    assert (status, before, after) == (137, 0, 1)
    assert termination_reason(status, before, after) == ("OOMKilled", 137)

    status, before, after = _run_fault(tmp_path, {"kill": True})
    assert (status, before, after) == (-9, 1, 1)
    assert termination_reason(status, before, after) == ("Error", 137)
