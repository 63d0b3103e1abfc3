"""A simulated vLLM server for the local stack: OpenAI-compatible completions paced by an iteration-level engine.

Local-stack tool. Each process plays one pod. Timing comes from the benchmark's engine (`sluice.bench.engine`:
vLLM's FCFS scheduler, token budget, chunked prefill, paged KV, preemption by recompute; step times from
vllm-sr-sim's roofline over the hardware and the model) advanced in wall-clock time, so the demo, the end-to-end
tests and the real-data-plane benchmark see the same servers as the simulation: a request's first SSE chunk leaves
when the engine's step produces its first token, and tokens stream as the engine generates them.

- `POST /v1/completions` (`stream: true` for SSE); the prompt's word count is its token count;
- `GET /metrics` with vLLM's metric names (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:kv_cache_usage_perc`, `vllm:time_to_first_token_seconds`, `vllm:e2e_request_latency_seconds`,
  `vllm:request_success_total{finished_reason}`, `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
  `vllm:num_preemptions_total`) plus, since no engine has a standard one, `sluice_sim_lora_loads_total` and
  `sluice_sim_lora_load_failures_total`;
- like vLLM's OpenAI server (instrumented with prometheus-fastapi-instrumentator), `http_requests_total{handler,
  method,status}` with statuses grouped as `2xx`/`4xx`/`5xx` for every API request;
- what the peer routers call: `GET /v1/models`, `GET /get_load` (`{"load": running + waiting}`, for vLLM router's
  `power_of_two`), `POST /v1/completions/render` (the prompt's token ids, for its `cache_aware`);
- every answer carries `X-Served-By: <hardware class>`;
- `GET /health`; `POST /admin/faults` to inject faults: `errorRate` (HTTP 500 before the engine finishes the
  request — as with real vLLM it shows only in `http_requests_total{status="5xx"}`, not in
  `vllm:request_success_total`), `slowdown` (multiplies modelled latency), `loraFailureRate` (adapter loads fail),
  `stallMetrics: true` (`/metrics` keeps answering the last exposition with its original sample timestamps, as a
  stuck exporter or a lagging federation does: Prometheus keeps old samples and no staleness marker),
  `oom: true` (the process exits with status 137, which the local kubelet reports as OOMKilled).

    python -m sluice.devstack.modelserver --host 127.0.0.11 --port 8000 --hardware a100 --model llama \
        --performance-model llama-3.1-8b
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import socket
import time
import zlib
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sluice.bench.engine import Engine, Sequence
from sluice.devstack.profiles import DEFAULT_MODEL, HARDWARE, MODELS, server_profile

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
STREAM_CHUNK_SECONDS = 0.02  # tokens are flushed at most this often
TICK_SECONDS = 0.005  # the longest the engine waits before looking at new arrivals again
SERVED_BY = "X-Served-By"  # the answering server's hardware class, on every answer


@dataclass
class Faults:
    error_rate: float = 0.0
    slowdown: float = 1.0
    lora_failure_rate: float = 0.0
    stall_metrics: bool = False


@dataclass
class _Flight:
    sequence: Sequence
    first_token: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)


class RealTimeEngine:
    """The iteration-level engine advanced in wall-clock time (1 simulated second = 1 wall second)."""

    def __init__(self, hardware: str, model: str) -> None:
        self.engine = Engine(server_profile(hardware, model))
        self.flights: dict[int, _Flight] = {}
        self.started = time.monotonic()
        self.ids = itertools.count()

    def now(self) -> float:
        return time.monotonic() - self.started

    def advance(self) -> None:
        for event in self.engine.advance_to(self.now()):
            flight = self.flights.get(event.sequence.req_id)
            if flight is None:
                continue
            if event.kind == "first_token":
                flight.first_token.set()
            else:
                flight.first_token.set()
                flight.finished.set()

    def seconds_to_next_step(self) -> float:
        return min(TICK_SECONDS, max(0.0, self.engine.next_event_time() - self.now()))

    def submit(self, l_in: int, l_out: int) -> _Flight | None:
        if not self.engine.fits(l_in, l_out):
            return None
        self.advance()
        sequence = self.engine.submit(next(self.ids), self.now(), l_in, l_out)
        flight = _Flight(sequence)
        self.flights[sequence.req_id] = flight
        return flight

    def kv_usage(self) -> float:
        return self.engine.kv_usage


def with_timestamps(exposition: bytes, at: float) -> bytes:
    """The exposition with an explicit timestamp (ms) on every sample line, as federation and some exporters send."""
    stamp = f" {int(at * 1000)}".encode()
    lines = [line if not line or line.startswith(b"#") else line + stamp for line in exposition.split(b"\n")]
    return b"\n".join(lines)


class ModelServer:
    def __init__(
        self, hardware: str, model: str, seed: int | None = None, performance_model: str = DEFAULT_MODEL
    ) -> None:
        self.engine = RealTimeEngine(hardware, performance_model)
        self.hardware = hardware
        self.model = model
        self.faults = Faults()
        self.random = random.Random(seed)
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.label_values = {"model_name": model, "engine": "0"}
        r = self.registry
        Gauge("vllm:num_requests_running", "Requests in model execution batches.", labels, registry=r).labels(
            **self.label_values
        ).set_function(lambda: self.engine.engine.num_running)
        Gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", labels, registry=r).labels(
            **self.label_values
        ).set_function(lambda: self.engine.engine.num_waiting)
        Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=r).labels(
            **self.label_values
        ).set_function(self.engine.kv_usage)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", labels, buckets=TTFT_BUCKETS, registry=r
        ).labels(**self.label_values)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end latency.", labels, buckets=E2E_BUCKETS, registry=r
        ).labels(**self.label_values)
        self.success = Counter("vllm:request_success", "Finished requests.", [*labels, "finished_reason"], registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens.", labels, registry=r).labels(
            **self.label_values
        )
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", labels, registry=r).labels(
            **self.label_values
        )
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions.", labels, registry=r).labels(
            **self.label_values
        )
        self._preemptions_counted = 0
        self.lora_loads = Counter("sluice_sim_lora_loads", "LoRA adapter loads.", labels, registry=r).labels(
            **self.label_values
        )
        self.http_requests = Counter(
            "http_requests",
            "Total number of requests by method, status and handler.",
            ["method", "status", "handler"],
            registry=r,
        )
        self._stalled_exposition: bytes | None = None
        self.lora_failures = Counter(
            "sluice_sim_lora_load_failures", "LoRA adapter loads that failed.", labels, registry=r
        ).labels(**self.label_values)

    # ------------------------------------------------------------------------------------ http

    @web.middleware
    async def _count_http(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """`http_requests_total` as prometheus-fastapi-instrumentator counts it in vLLM (status grouped by class)."""
        if not request.path.startswith("/v1/"):
            return await handler(request)
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        finally:
            self.http_requests.labels(request.method, f"{status // 100}xx", request.path).inc()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._count_http])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/get_load", self.get_load)
        app.router.add_post("/v1/completions/render", self.render)
        app.router.add_post("/admin/faults", self.set_faults)
        app.on_startup.append(self._start_ticker)
        app.on_response_prepare.append(self._served_by)
        return app

    async def _served_by(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every answer names the server's hardware class, so a benchmark behind a router can count where
        requests went (Envoy and the peer routers pass response headers through)."""
        response.headers[SERVED_BY] = self.hardware

    async def _start_ticker(self, app: web.Application) -> None:
        async def tick() -> None:
            while True:
                self.engine.advance()
                total = self.engine.engine.preemptions_total
                if total > self._preemptions_counted:
                    self.preemptions.inc(total - self._preemptions_counted)
                    self._preemptions_counted = total
                await asyncio.sleep(self.engine.seconds_to_next_step())

        app["ticker"] = asyncio.get_running_loop().create_task(tick())

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, _: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "owned_by": "sluice", "max_model_len": 8192}
        return web.json_response({"object": "list", "data": [card]})

    async def get_load(self, _: web.Request) -> web.Response:
        return web.json_response({"load": self.engine.engine.num_running + self.engine.engine.num_waiting})

    async def render(self, request: web.Request) -> web.Response:
        """The prompt as token ids (one per word: the same count `/v1/completions` charges)."""
        body = await request.json()
        prompt = body.get("prompt", "")
        words = prompt.split() if isinstance(prompt, str) else [str(t) for t in prompt]
        ids = [zlib.crc32(w.encode()) % 128_000 for w in words]
        return web.json_response({"prompt_token_ids": ids, "model": self.model})

    async def metrics(self, _: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        if self.faults.stall_metrics:
            if self._stalled_exposition is None:
                self._stalled_exposition = with_timestamps(body, time.time())
            body = self._stalled_exposition
        else:
            self._stalled_exposition = None
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def set_faults(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("oom"):
            asyncio.get_running_loop().call_later(0.05, os._exit, 137)
            return web.json_response({"oom": "exiting with 137"})
        self.faults = Faults(
            error_rate=float(body.get("errorRate", self.faults.error_rate)),
            slowdown=float(body.get("slowdown", self.faults.slowdown)),
            lora_failure_rate=float(body.get("loraFailureRate", self.faults.lora_failure_rate)),
            stall_metrics=bool(body.get("stallMetrics", self.faults.stall_metrics)),
        )
        self.engine.engine.slowdown = self.faults.slowdown
        return web.json_response(
            {
                "errorRate": self.faults.error_rate,
                "slowdown": self.faults.slowdown,
                "loraFailureRate": self.faults.lora_failure_rate,
                "stallMetrics": self.faults.stall_metrics,
            }
        )

    def _finished(self, reason: str) -> None:
        self.success.labels(**self.label_values, finished_reason=reason).inc()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        body = await request.json()
        prompt = body.get("prompt", "")
        l_in = max(1, len(prompt.split()) if isinstance(prompt, str) else len(prompt))
        l_out = max(1, int(body.get("max_tokens", 16)))
        model = str(body.get("model", self.model))
        if model != self.model:
            self.lora_loads.inc()
            if self.random.random() < self.faults.lora_failure_rate:
                self.lora_failures.inc()
                return web.json_response({"error": {"message": f"failed to load LoRA adapter {model}"}}, status=400)
        if self.random.random() < self.faults.error_rate:
            # Fails before the engine finishes it: counted by the HTTP instrumentation only, as in real vLLM.
            return web.json_response({"error": {"message": "internal engine error (injected)"}}, status=500)
        flight = self.engine.submit(l_in, l_out)
        if flight is None:
            message = f"This model's maximum context is shorter than {l_in + l_out} tokens"
            return web.json_response({"error": {"message": message}}, status=400)
        try:
            await flight.first_token.wait()
            self.ttft.observe(time.monotonic() - arrived)
            self.prompt_tokens.inc(l_in)
            if body.get("stream"):
                response = await self._stream(request, flight)
            else:
                await flight.finished.wait()
                response = web.json_response(
                    {
                        "object": "text_completion",
                        "model": self.model,
                        "choices": [{"index": 0, "text": " tok" * l_out, "finish_reason": "length"}],
                        "usage": {"prompt_tokens": l_in, "completion_tokens": l_out},
                    }
                )
            self.generation_tokens.inc(l_out)
            self.e2e.observe(time.monotonic() - arrived)
            self._finished("length")
            return response
        finally:
            self.engine.flights.pop(flight.sequence.req_id, None)

    async def _stream(self, request: web.Request, flight: _Flight) -> web.StreamResponse:
        """Tokens as the engine generates them, flushed at most every `STREAM_CHUNK_SECONDS`."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        sent = 0
        while True:
            due = flight.sequence.generated
            if due > sent:
                chunk = {
                    "object": "text_completion",
                    "model": self.model,
                    "choices": [{"index": 0, "text": " tok" * (due - sent), "finish_reason": None}],
                }
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
                sent = due
            if flight.finished.is_set() and sent >= flight.sequence.generated:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(flight.finished.wait(), STREAM_CHUNK_SECONDS)
        done = {
            "object": "text_completion",
            "model": self.model,
            "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
        }
        await response.write(f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response


def _nodelay_socket(host: str, port: int) -> socket.socket:
    """A listening socket with TCP_NODELAY inherited by accepted connections (Python upstreams need it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sluice.devstack.modelserver")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--hardware", choices=sorted(HARDWARE), default="a100")
    parser.add_argument("--model", default="llama", help="the served model name")
    parser.add_argument(
        "--performance-model", choices=sorted(MODELS), default=DEFAULT_MODEL, help="the model whose cost paces it"
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--error-rate", type=float, default=0.0, help="start with this injected error rate")
    args = parser.parse_args(argv)
    if not args.host.startswith("127."):
        parser.error("the simulated server binds to loopback addresses only (127.0.0.0/8)")
    server = ModelServer(args.hardware, args.model, args.seed, args.performance_model)
    server.faults.error_rate = args.error_rate
    with contextlib.suppress(KeyboardInterrupt):
        web.run_app(server.app(), sock=_nodelay_socket(args.host, args.port), print=None, access_log=None)


if __name__ == "__main__":
    main()
