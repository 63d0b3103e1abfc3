"""A simulated vLLM server for the local stack: OpenAI-compatible completions paced by a third-party LLM model.

Local-stack tool. Each process plays one pod. Timing comes from `vllm-sr-sim`'s `fleet_sim.core.instance.Instance`
(continuous-batching slots, paged KV blocks, preemption) with its calibrated GPU profiles, driven in real time:
a request is admitted into the model on arrival, its modelled first-token time paces the first SSE chunk and its
modelled completion paces the rest, so TTFT grows with load as the model says, not as sluice would like.

- `POST /v1/completions` (`stream: true` for SSE); the prompt's word count is its token count;
- `GET /metrics` with vLLM's metric names (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:kv_cache_usage_perc`, `vllm:time_to_first_token_seconds`, `vllm:e2e_request_latency_seconds`,
  `vllm:request_success_total{finished_reason}`, `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
  `vllm:num_preemptions_total`) plus, since no engine has a standard one, `sluice_sim_lora_loads_total` and
  `sluice_sim_lora_load_failures_total`;
- like vLLM's OpenAI server (instrumented with prometheus-fastapi-instrumentator), `http_requests_total{handler,
  method,status}` with statuses grouped as `2xx`/`4xx`/`5xx` for every API request;
- `GET /health`; `POST /admin/faults` to inject faults: `errorRate` (HTTP 500 before the engine finishes the
  request — as with real vLLM it shows only in `http_requests_total{status="5xx"}`, not in
  `vllm:request_success_total`), `slowdown` (multiplies modelled latency), `loraFailureRate` (adapter loads fail),
  `stallMetrics: true` (`/metrics` keeps answering the last exposition with its original sample timestamps, as a
  stuck exporter or a lagging federation does: Prometheus keeps old samples and no staleness marker),
  `oom: true` (the process exits with status 137, which the local kubelet reports as OOMKilled).

    python -m sluice.devstack.modelserver --host 127.0.0.11 --port 8000 --hardware a100 --model llama
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import socket
import time
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.typedefs import Handler
from fleet_sim.core.instance import Instance
from fleet_sim.core.request import Request
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sluice.devstack.profiles import PROFILES, ManualProfile

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
STREAM_CHUNK_SECONDS = 0.02  # tokens are flushed at most this often


@dataclass
class Faults:
    error_rate: float = 0.0
    slowdown: float = 1.0
    lora_failure_rate: float = 0.0
    stall_metrics: bool = False


@dataclass
class _Flight:
    request: Request
    admitted: asyncio.Event = field(default_factory=asyncio.Event)


class Engine:
    """fleet_sim's Instance advanced in real time (1 simulated second = 1 wall second)."""

    def __init__(self, profile: ManualProfile, max_ctx: int = 4096) -> None:
        self.profile = profile
        self.flights: dict[int, _Flight] = {}
        self.instance = Instance(0, "pod", profile, max_ctx=max_ctx, on_ttft=self._admitted)
        self.started = time.monotonic()
        self.ids = itertools.count()
        self.running: dict[int, Request] = {}  # between admission and the last token

    def now(self) -> float:
        return time.monotonic() - self.started

    def _admitted(self, request: Request) -> None:
        flight = self.flights.get(request.req_id)
        if flight is not None:
            flight.admitted.set()

    def advance(self) -> None:
        self.instance.advance_to(self.now())

    def submit(self, l_in: int, l_out: int) -> _Flight | None:
        self.advance()
        request = Request(req_id=next(self.ids), arrival_time=self.now(), l_in=l_in, l_out=l_out)
        flight = _Flight(request)
        self.flights[request.req_id] = flight
        if not self.instance.accept(request):
            self.flights.pop(request.req_id)
            return None
        self.advance()
        return flight

    def kv_usage(self) -> float:
        block: int = self.profile.blk_size
        total: int = self.profile.total_kv_blks
        used: int = sum(math.ceil((r.l_in + r.l_out) / block) for r in self.running.values())
        return min(1.0, used / total)


def with_timestamps(exposition: bytes, at: float) -> bytes:
    """The exposition with an explicit timestamp (ms) on every sample line, as federation and some exporters send."""
    stamp = f" {int(at * 1000)}".encode()
    lines = [line if not line or line.startswith(b"#") else line + stamp for line in exposition.split(b"\n")]
    return b"\n".join(lines)


class ModelServer:
    def __init__(self, hardware: str, model: str, seed: int | None = None) -> None:
        self.engine = Engine(PROFILES[hardware])
        self.model = model
        self.faults = Faults()
        self.random = random.Random(seed)
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.label_values = {"model_name": model, "engine": "0"}
        r = self.registry
        Gauge("vllm:num_requests_running", "Requests in model execution batches.", labels, registry=r).labels(
            **self.label_values
        ).set_function(lambda: len(self.engine.running))
        Gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", labels, registry=r).labels(
            **self.label_values
        ).set_function(lambda: self.engine.instance.queue_depth)
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
        app.router.add_post("/admin/faults", self.set_faults)
        app.on_startup.append(self._start_ticker)
        return app

    async def _start_ticker(self, app: web.Application) -> None:
        async def tick() -> None:
            while True:
                self.engine.advance()
                total = self.engine.instance.total_preempted
                if total > self._preemptions_counted:
                    self.preemptions.inc(total - self._preemptions_counted)
                    self._preemptions_counted = total
                await asyncio.sleep(0.002)

        app["ticker"] = asyncio.get_running_loop().create_task(tick())

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

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
            return web.json_response({"error": {"message": "queue full"}}, status=503)
        try:
            await flight.admitted.wait()
            req = flight.request
            self.engine.running[req.req_id] = req
            slow = self.faults.slowdown
            first_at = self.engine.started + req.arrival_time + (req.first_token_time - req.arrival_time) * slow
            end_at = self.engine.started + req.arrival_time + (req.physical_end_time - req.arrival_time) * slow
            await asyncio.sleep(max(0.0, first_at - time.monotonic()))
            ttft = time.monotonic() - arrived
            self.ttft.observe(ttft)
            self.prompt_tokens.inc(l_in)
            if body.get("stream"):
                response = await self._stream(request, l_out, first_at, end_at)
            else:
                await asyncio.sleep(max(0.0, end_at - time.monotonic()))
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
            self.engine.running.pop(flight.request.req_id, None)
            self.engine.flights.pop(flight.request.req_id, None)

    async def _stream(self, request: web.Request, l_out: int, first_at: float, end_at: float) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        sent = 0
        per_token = (end_at - first_at) / max(1, l_out)
        while sent < l_out:
            due = min(
                l_out, max(sent + 1, int((time.monotonic() - first_at) / per_token) + 1 if per_token > 0 else l_out)
            )
            chunk = {
                "object": "text_completion",
                "model": self.model,
                "choices": [{"index": 0, "text": " tok" * (due - sent), "finish_reason": None}],
            }
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            sent = due
            if sent < l_out:
                await asyncio.sleep(min(STREAM_CHUNK_SECONDS, max(0.0, first_at + sent * per_token - time.monotonic())))
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
    parser.add_argument("--hardware", choices=sorted(PROFILES), default="a100")
    parser.add_argument("--model", default="llama")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--error-rate", type=float, default=0.0, help="start with this injected error rate")
    args = parser.parse_args(argv)
    if not args.host.startswith("127."):
        parser.error("the simulated server binds to loopback addresses only (127.0.0.0/8)")
    server = ModelServer(args.hardware, args.model, args.seed)
    server.faults.error_rate = args.error_rate
    with contextlib.suppress(KeyboardInterrupt):
        web.run_app(server.app(), sock=_nodelay_socket(args.host, args.port), print=None, access_log=None)


if __name__ == "__main__":
    main()
