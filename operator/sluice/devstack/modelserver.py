"""A simulated vLLM server for the local stack: OpenAI-compatible completions paced by an iteration-level engine.

Local-stack tool. Each process plays one pod. Timing comes from the benchmark's engine (`sluice.sim.engine`:
vLLM's FCFS scheduler, token budget, chunked prefill, paged KV, preemption by recompute; step times from
vllm-sr-sim's roofline over the hardware and the model) advanced in wall-clock time, so the demo, the end-to-end
tests and the real-data-plane benchmark see the same servers as the simulation: a request's first SSE chunk leaves
when the engine's step produces its first token, and tokens stream as the engine generates them.

- `POST /v1/completions` (`stream: true` for SSE); the prompt's word count is its token count, and each word is a
  token for the engine's prefix cache (vLLM's automatic prefix caching, on as in vLLM: two prompts share the blocks
  their words agree on); an answer is `tok` repeated, so a conversation that sends it back finds it cached;
- `GET /metrics` with vLLM's metric names (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:kv_cache_usage_perc`, `vllm:engine_sleep_state{sleep_state}`, `vllm:time_to_first_token_seconds`,
  `vllm:e2e_request_latency_seconds`, `vllm:request_success_total{finished_reason}`, `vllm:prompt_tokens_total`,
  `vllm:generation_tokens_total`, `vllm:num_preemptions_total`, `vllm:prefix_cache_queries_total` and
  `vllm:prefix_cache_hits_total` (tokens, as vLLM v0.34 `vllm/v1/metrics/loggers.py`)), each labelled
  `model_name` and `engine`, plus,
  since no engine has a standard one, `sluice_sim_lora_loads_total` and `sluice_sim_lora_load_failures_total`;
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
  `oom: true` (the cgroup OOM killer fires: the server adds one to `oom_kill` (and `oom`, `max`) in the
  cgroup v2 `memory.events`-format file named by `--memory-events`, then exits with status 137),
  `kill: true` (the process SIGKILLs itself, as a liveness-probe kill or `kill -9` does: status 137, no OOM event).

The local kubelet (`sluice.devstack.stack`) follows a real kubelet's rule: a container that exited is `OOMKilled`
only if the OOM killer fired in its cgroup (its `memory.events` `oom_kill` count went up while it ran); otherwise
`Error` with the exit code (137 for a SIGKILL from anywhere else), `Completed` for status 0.

Options beyond the defaults (which keep one engine, vLLM's exposition and no sleep endpoints):
- `--data-parallel-size N` (vLLM's option): N engine instances (DP ranks, each a whole replica of the hardware),
  each request going to the rank with the lowest `4 * waiting + running`, as vLLM's DP load balancer scores them;
  every per-engine family is exported once per rank with `engine="0"`..`engine="N-1"`; `http_requests_total`
  (the HTTP instrumentator's) and the LoRA simulation counters are not per engine;
- `--enable-sleep-mode`: vLLM's sleep endpoints (upstream they also need `VLLM_SERVER_DEV_MODE=1`):
  `POST /sleep?level=0|1|2&mode=abort|wait|keep` (empty 200 once asleep; `abort`, the default, finishes the
  in-flight requests with `finish_reason: "abort"`, `wait` lets them finish first, `keep` freezes them),
  `POST /wake_up[?tags=weights&tags=kv_cache]` (empty 200), `GET /is_sleeping` (`{"is_sleeping": bool}`).
  While asleep the engines do not run: new completions are accepted and wait (counted as waiting) until
  `/wake_up`, as vLLM's paused scheduler queues them. `vllm:engine_sleep_state{sleep_state="awake"|
  "weights_offloaded"|"discard_all"}` is exported whether or not sleep mode is enabled, as vLLM does;
- `--no-enable-prefix-caching` (vLLM's flag): no prefix cache (vLLM V1 caches prefixes by default);
- `--disable-log-stats` (vLLM's flag): no `vllm:` family on `/metrics`, only the HTTP instrumentator's;
- `--exposition sglang`: `/metrics` speaks SGLang's names and labels for the same engine state instead:
  `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`, `sglang:num_used_tokens`,
  `sglang:max_total_num_tokens`, `sglang:num_retracted_requests_total` (labels `model_name`, `engine_type`,
  `tp_rank`, `pp_rank`, `moe_ep_rank`, and `dp_rank` per rank when N > 1), `sglang:prompt_tokens_total`,
  `sglang:generation_tokens_total`, `sglang:num_requests_total`, `sglang:num_aborted_requests_total`,
  `sglang:time_to_first_token_seconds`, `sglang:e2e_request_latency_seconds` (labels `model_name`,
  `engine_type`), and `sglang:http_requests_total{endpoint,method}`, `sglang:http_responses_total{endpoint,
  status_code,method}`, `sglang:http_requests_active{endpoint,method}` for every request; the API is the same.

    python -m sluice.devstack.modelserver --host 127.0.0.11 --port 8000 --hardware a100 --model llama \
        --performance-model llama-3.1-8b
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import random
import signal
import socket
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sluice.sim.engine import Engine, EngineConfig, Segments, Sequence
from sluice.sim.profiles import DEFAULT_MODEL, HARDWARE, MODELS, server_profile

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
# SGLang's default buckets (TokenizerMetricsCollector, python/sglang/srt/metrics/collector.py).
SGLANG_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
SGLANG_E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
STREAM_CHUNK_SECONDS = 0.02  # tokens are flushed at most this often
TICK_SECONDS = 0.005  # the longest the engine waits before looking at new arrivals again
SERVED_BY = "X-Served-By"  # the answering server's hardware class, on every answer
EXPOSITIONS = ("vllm", "sglang")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # vLLM's `sleep_state` label values
PAUSE_MODES = ("abort", "wait", "keep")  # vLLM's PauseMode
SLEEP_TAGS = frozenset({"weights", "kv_cache"})  # what a level 1 or 2 sleep releases (vLLM executor's sleeping_tags)
MEMORY_EVENTS_KEYS = ("low", "high", "max", "oom", "oom_kill", "oom_group_kill")  # cgroup v2 memory.events

# Upstream sources transcribed here (read at these commits):
# - vLLM vllm-project/vllm@9aaf83ef502fc37bc647f6e474314d48ba36cd1c:
#   vllm/v1/metrics/loggers.py (PrometheusStatLogger: labelnames ["model_name", "engine"], one child per engine
#   index, engine=str(idx); `vllm:engine_sleep_state` with labelnames + ["sleep_state"], states awake /
#   weights_offloaded / discard_all, always registered, record_sleep_state(1, level) on sleep and (0, 0) on wake_up),
#   vllm/entrypoints/serve/sleep/api_router.py (POST /sleep?level=1&mode=abort -> empty 200, POST /wake_up?tags=..
#   -> empty 200, GET /is_sleeping -> {"is_sleeping": bool}), vllm/v1/engine/core.py (sleep pauses the scheduler:
#   "abort" aborts every request, all modes queue new adds until wake_up), vllm/v1/engine/core_client.py
#   (DPLBAsyncMPClient.get_core_engine_for_request: score = waiting * 4 + running, lowest wins).
# - SGLang sgl-project/sglang: python/sglang/srt/metrics/collector.py@00ae9c1590d2d0bb6c0bfff39e312c34ae3dd538
#   (SchedulerMetricsCollector, TokenizerMetricsCollector names, help texts and buckets),
#   python/sglang/srt/utils/common.py@004f0c7a8d398a9c4b6844c1d8071502fa88e78c
#   (add_prometheus_track_response_middleware: sglang:http_requests_total{endpoint,method},
#   sglang:http_responses_total{endpoint,status_code,method}, sglang:http_requests_active{endpoint,method}),
#   python/sglang/srt/managers/tokenizer_manager.py@001067fffe33427bee0ed2f007fb7551a1d76b44 (tokenizer labels
#   model_name, engine_type); scheduler labels model_name, engine_type, tp_rank, pp_rank, moe_ep_rank (+ dp_rank
#   under DP) as the scheduler's init_metrics builds them (collector.py above reads labels["moe_ep_rank"]).


@dataclass
class Faults:
    error_rate: float = 0.0
    slowdown: float = 1.0
    lora_failure_rate: float = 0.0
    stall_metrics: bool = False


@dataclass
class _Flight:
    sequence: Sequence
    segments: Segments | None = None
    first_token: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: bool = False


class RealTimeEngine:
    """The iteration-level engine advanced in wall-clock time (1 simulated second = 1 wall second).

    `pause` stops its clock (a sleeping engine does not run) and `resume` starts it again where it stopped; while
    it does not admit (paused, or draining before a sleep), new requests are held and join the queue on `resume`.
    """

    def __init__(self, hardware: str, model: str, prefix_caching: bool = True) -> None:
        self.profile = server_profile(hardware, model)
        self.config = EngineConfig(prefix_caching=prefix_caching)
        self.engine = Engine(self.profile, self.config)
        self.flights: dict[int, _Flight] = {}
        self.started = time.monotonic()
        self.ids = itertools.count()
        self.paused_at: float | None = None
        self.admitting = True
        self.held: list[_Flight] = []
        self._preemptions_before = 0  # preemptions of the engines that `abort_all` replaced
        self._prefix_before = (0, 0)  # their prefix cache's queries and hits

    def now(self) -> float:
        return (time.monotonic() if self.paused_at is None else self.paused_at) - self.started

    def advance(self) -> None:
        if self.paused_at is not None:
            return
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
        if self.paused_at is not None:
            return TICK_SECONDS
        return min(TICK_SECONDS, max(0.0, self.engine.next_event_time() - self.now()))

    def submit(self, l_in: int, l_out: int, segments: Segments | None = None) -> _Flight | None:
        if not self.engine.fits(l_in, l_out):
            return None
        self.advance()
        if self.paused_at is not None or not self.admitting:
            sequence = Sequence(req_id=next(self.ids), arrival=self.now(), prompt=max(1, l_in), output=max(1, l_out))
            flight = _Flight(sequence, segments)
            self.held.append(flight)
        else:
            sequence = self.engine.submit(next(self.ids), self.now(), l_in, l_out, segments)
            flight = _Flight(sequence, segments)
        self.flights[sequence.req_id] = flight
        return flight

    def kv_usage(self) -> float:
        return self.engine.kv_usage

    def running_count(self) -> float:
        return self.num_running

    def waiting_count(self) -> float:
        return self.num_waiting

    def used_tokens(self) -> float:
        return (self.engine.total_blocks - self.engine.free_blocks) * self.engine.config.block_size

    def capacity_tokens(self) -> float:
        return self.engine.total_blocks * self.engine.config.block_size

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + len(self.held)

    @property
    def preemptions_total(self) -> int:
        return self._preemptions_before + self.engine.preemptions_total

    @property
    def prefix_cache_totals(self) -> tuple[int, int]:
        """Prompt tokens looked up in the prefix cache, and of those found cached, since the server started."""
        queries, hits = self._prefix_before
        return queries + self.engine.prefix_queries_total, hits + self.engine.prefix_hits_total

    def idle(self) -> bool:
        return not self.engine.num_running and not self.engine.num_waiting

    def hold(self) -> None:
        """Stop admitting: new requests wait in `held` (the scheduler's PAUSED_NEW) while the engine runs on."""
        self.admitting = False

    def pause(self) -> None:
        self.advance()
        self.admitting = False
        if self.paused_at is None:
            self.paused_at = time.monotonic()

    def resume(self) -> None:
        if self.paused_at is not None:
            self.started += time.monotonic() - self.paused_at  # the clock goes on from where it stopped
            self.paused_at = None
        self.admitting = True
        for flight in self.held:
            old = flight.sequence
            flight.sequence = self.engine.submit(old.req_id, self.now(), old.prompt, old.output, flight.segments)
        self.held.clear()

    def abort_all(self) -> None:
        """Finish every request (running, waiting, held) as aborted and free the KV cache, as vLLM's `abort` pause."""
        self.advance()
        for flight in self.flights.values():
            flight.aborted = True
            flight.first_token.set()
            flight.finished.set()
        self.held.clear()
        self._preemptions_before += self.engine.preemptions_total
        self._prefix_before = self.prefix_cache_totals
        slowdown = self.engine.slowdown
        self.engine = Engine(self.profile, self.config)
        self.engine.slowdown = slowdown


def with_timestamps(exposition: bytes, at: float) -> bytes:
    """The exposition with an explicit timestamp (ms) on every sample line, as federation and some exporters send."""
    stamp = f" {int(at * 1000)}".encode()
    lines = [line if not line or line.startswith(b"#") else line + stamp for line in exposition.split(b"\n")]
    return b"\n".join(lines)


def read_memory_events(path: Path) -> dict[str, int]:
    """A cgroup v2 `memory.events` file (`key count` lines); every key 0 if the file does not exist yet."""
    events = dict.fromkeys(MEMORY_EVENTS_KEYS, 0)
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key and value.strip().isdigit():
                events[key] = int(value)
    return events


def record_oom_kill(path: Path) -> int:
    """What the kernel does when the cgroup's OOM killer kills a process in it: `max`, `oom` and `oom_kill` go up.
    Written whole (rename) so a reader never sees half a file. Returns the new `oom_kill` count."""
    events = read_memory_events(path)
    for key in ("max", "oom", "oom_kill"):
        events[key] += 1
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(f"{key} {count}\n" for key, count in events.items()))
    os.replace(partial, path)
    return events["oom_kill"]


@dataclass
class _Meters:
    """What one engine's requests are counted in (vLLM: that engine's children; SGLang: the tokenizer's, shared)."""

    ttft: Histogram
    e2e: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    preemptions: Counter
    finished: Callable[[str], None]
    prefix_queries: Counter | None = None
    """vLLM's prefix cache counters (tokens); SGLang's exposition here has none."""
    prefix_hits: Counter | None = None


class ModelServer:
    def __init__(
        self,
        hardware: str,
        model: str,
        seed: int | None = None,
        performance_model: str = DEFAULT_MODEL,
        *,
        data_parallel_size: int = 1,
        enable_sleep_mode: bool = False,
        exposition: str = "vllm",
        memory_events: Path | None = None,
        disable_log_stats: bool = False,
        enable_prefix_caching: bool = True,
    ) -> None:
        if data_parallel_size < 1:
            raise ValueError("data_parallel_size must be at least 1")
        if exposition not in EXPOSITIONS:
            raise ValueError(f"exposition must be one of {EXPOSITIONS}")
        if enable_sleep_mode and exposition != "vllm":
            raise ValueError("sleep mode is vLLM's: it needs the vllm exposition")
        self.engines = [
            RealTimeEngine(hardware, performance_model, enable_prefix_caching) for _ in range(data_parallel_size)
        ]
        self.engine = self.engines[0]
        self.hardware = hardware
        self.model = model
        self.exposition = exposition
        self.enable_sleep_mode = enable_sleep_mode
        self.memory_events = memory_events
        self.disable_log_stats = disable_log_stats
        """vLLM's --disable-log-stats: no stat logger, so no `vllm:` family on /metrics (the HTTP instrumentator's
        families stay; vllm/v1/engine/async_llm.py builds the Prometheus logger only with log_stats)."""
        self.faults = Faults()
        self.random = random.Random(seed)
        self.registry = CollectorRegistry()
        self.sleep_level: int | None = None  # None: awake (scheduling runs)
        self.sleeping_tags: set[str] = set()  # memory still released (vLLM executor's sleeping_tags)
        self._recorded_sleep = (0, 0)  # what vLLM's record_sleep_state last got: (sleep, level)
        self._preemptions_counted = [0] * data_parallel_size
        self._prefix_counted = [(0, 0)] * data_parallel_size
        self._stalled_exposition: bytes | None = None
        labels = ["model_name", "engine"]
        self.label_values = {"model_name": model, "engine": "0"}
        if exposition == "vllm":
            self.meters = self._vllm_metrics()
        else:
            self.meters = self._sglang_metrics()
        r = self.registry
        # The LoRA simulation counters are the same in either exposition, not per engine.
        self.lora_loads = Counter("sluice_sim_lora_loads", "LoRA adapter loads.", labels, registry=r).labels(
            **self.label_values
        )
        if exposition == "vllm":
            self.http_requests = Counter(
                "http_requests",
                "Total number of requests by method, status and handler.",
                ["method", "status", "handler"],
                registry=r,
            )
        self.lora_failures = Counter(
            "sluice_sim_lora_load_failures", "LoRA adapter loads that failed.", labels, registry=r
        ).labels(**self.label_values)

    # ------------------------------------------------------------------------------------ metrics

    def _vllm_metrics(self) -> list[_Meters]:
        """vLLM's PrometheusStatLogger: every family labelled (model_name, engine), one child per engine index."""
        r = self.registry
        labels = ["model_name", "engine"]
        running = Gauge("vllm:num_requests_running", "Requests in model execution batches.", labels, registry=r)
        waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", labels, registry=r)
        sleep_state = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            [*labels, "sleep_state"],
            registry=r,
        )
        kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=r)
        ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", labels, buckets=TTFT_BUCKETS, registry=r
        )
        e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end latency.", labels, buckets=E2E_BUCKETS, registry=r
        )
        success = Counter("vllm:request_success", "Finished requests.", [*labels, "finished_reason"], registry=r)
        prompt = Counter("vllm:prompt_tokens", "Prefill tokens.", labels, registry=r)
        generation = Counter("vllm:generation_tokens", "Generated tokens.", labels, registry=r)
        preemptions = Counter("vllm:num_preemptions", "Preemptions.", labels, registry=r)
        queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=r,
        )
        hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", labels, registry=r
        )
        meters: list[_Meters] = []
        for index, engine in enumerate(self.engines):
            values = {"model_name": self.model, "engine": str(index)}
            running.labels(**values).set_function(engine.running_count)
            waiting.labels(**values).set_function(engine.waiting_count)
            for state in SLEEP_STATES:
                sleep_state.labels(**values, sleep_state=state).set_function(
                    functools.partial(self._sleep_gauge, state)
                )
            kv.labels(**values).set_function(engine.kv_usage)

            def finished(reason: str, values: dict[str, str] = values) -> None:
                success.labels(**values, finished_reason=reason).inc()

            meters.append(
                _Meters(
                    ttft=ttft.labels(**values),
                    e2e=e2e.labels(**values),
                    prompt_tokens=prompt.labels(**values),
                    generation_tokens=generation.labels(**values),
                    preemptions=preemptions.labels(**values),
                    finished=finished,
                    prefix_queries=queries.labels(**values),
                    prefix_hits=hits.labels(**values),
                )
            )
        return meters

    def _sglang_metrics(self) -> list[_Meters]:
        """SGLang's: scheduler gauges per DP rank, tokenizer counters and histograms once, HTTP by endpoint."""
        r = self.registry
        tokenizer_values = {"model_name": self.model, "engine_type": "unified"}
        tokenizer_labels = list(tokenizer_values)
        scheduler_base = {**tokenizer_values, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        scheduler_labels = [*scheduler_base, "dp_rank"] if len(self.engines) > 1 else list(scheduler_base)
        running = Gauge("sglang:num_running_reqs", "The number of running requests.", scheduler_labels, registry=r)
        used = Gauge("sglang:num_used_tokens", "The number of used tokens.", scheduler_labels, registry=r)
        usage = Gauge("sglang:token_usage", "The token usage.", scheduler_labels, registry=r)
        queue = Gauge(
            "sglang:num_queue_reqs", "The number of requests in the waiting queue.", scheduler_labels, registry=r
        )
        capacity = Gauge(
            "sglang:max_total_num_tokens",
            "Maximum total number of tokens in the KV cache pool.",
            scheduler_labels,
            registry=r,
        )
        retracted = Counter(
            "sglang:num_retracted_requests_total", "Total number of retracted requests.", scheduler_labels, registry=r
        )
        prompt = Counter(
            "sglang:prompt_tokens_total", "Number of prefill tokens processed.", tokenizer_labels, registry=r
        ).labels(**tokenizer_values)
        generation = Counter(
            "sglang:generation_tokens_total", "Number of generation tokens processed.", tokenizer_labels, registry=r
        ).labels(**tokenizer_values)
        requests = Counter(
            "sglang:num_requests_total", "Number of requests processed.", tokenizer_labels, registry=r
        ).labels(**tokenizer_values)
        aborted = Counter(
            "sglang:num_aborted_requests_total", "Number of requests aborted.", tokenizer_labels, registry=r
        ).labels(**tokenizer_values)
        ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            tokenizer_labels,
            buckets=SGLANG_TTFT_BUCKETS,
            registry=r,
        ).labels(**tokenizer_values)
        e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            tokenizer_labels,
            buckets=SGLANG_E2E_BUCKETS,
            registry=r,
        ).labels(**tokenizer_values)
        self.sglang_http_requests = Counter(
            "sglang:http_requests_total",
            "Total number of HTTP requests by endpoint and method",
            ["endpoint", "method"],
            registry=r,
        )
        self.sglang_http_responses = Counter(
            "sglang:http_responses_total",
            "Total number of HTTP responses by endpoint and status code",
            ["endpoint", "status_code", "method"],
            registry=r,
        )
        self.sglang_http_active = Gauge(
            "sglang:http_requests_active",
            "Number of currently active HTTP requests",
            ["endpoint", "method"],
            registry=r,
        )

        def finished(reason: str) -> None:
            (aborted if reason == "abort" else requests).inc()

        meters: list[_Meters] = []
        for index, engine in enumerate(self.engines):
            values = {**scheduler_base, "dp_rank": str(index)} if len(self.engines) > 1 else scheduler_base
            running.labels(**values).set_function(engine.running_count)
            queue.labels(**values).set_function(engine.waiting_count)
            usage.labels(**values).set_function(engine.kv_usage)
            used.labels(**values).set_function(engine.used_tokens)
            capacity.labels(**values).set_function(engine.capacity_tokens)
            meters.append(
                _Meters(
                    ttft=ttft,
                    e2e=e2e,
                    prompt_tokens=prompt,
                    generation_tokens=generation,
                    preemptions=retracted.labels(**values),
                    finished=finished,
                )
            )
        return meters

    def _sleep_gauge(self, state: str) -> float:
        """vLLM's record_sleep_state: (1, level) on /sleep, (0, 0) on /wake_up, the same for every engine."""
        sleeping, level = self._recorded_sleep
        if state == "awake":
            return 0 if sleeping else 1
        if state == "weights_offloaded":
            return 1 if sleeping and level == 1 else 0
        return 1 if sleeping and level == 2 else 0

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

    @web.middleware
    async def _count_http_sglang(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """SGLang's track_http_status_code middleware: every request, by route path, exact status code."""
        resource = getattr(request.match_info.route, "resource", None)
        endpoint = resource.canonical if resource is not None else request.path
        method = request.method
        self.sglang_http_requests.labels(endpoint=endpoint, method=method).inc()
        active = self.sglang_http_active.labels(endpoint=endpoint, method=method)
        active.inc()
        try:
            try:
                response = await handler(request)
            except web.HTTPException as answer:  # aiohttp raises its 404/405 answers
                self.sglang_http_responses.labels(
                    endpoint=endpoint, status_code=str(answer.status), method=method
                ).inc()
                raise
            self.sglang_http_responses.labels(endpoint=endpoint, status_code=str(response.status), method=method).inc()
            return response
        finally:
            active.dec()

    def app(self) -> web.Application:
        middleware = self._count_http if self.exposition == "vllm" else self._count_http_sglang
        app = web.Application(middlewares=[middleware])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/get_load", self.get_load)
        app.router.add_post("/v1/completions/render", self.render)
        app.router.add_post("/admin/faults", self.set_faults)
        if self.enable_sleep_mode:
            app.router.add_post("/sleep", self.sleep)
            app.router.add_post("/wake_up", self.wake_up)
            app.router.add_get("/is_sleeping", self.is_sleeping)
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
                for index, engine in enumerate(self.engines):
                    engine.advance()
                    total = engine.preemptions_total
                    if total > self._preemptions_counted[index]:
                        self.meters[index].preemptions.inc(total - self._preemptions_counted[index])
                        self._preemptions_counted[index] = total
                    self._count_prefix_cache(index)
                await asyncio.sleep(min(engine.seconds_to_next_step() for engine in self.engines))

        app["ticker"] = asyncio.get_running_loop().create_task(tick())

    def _count_prefix_cache(self, index: int) -> None:
        meters, counted = self.meters[index], self._prefix_counted[index]
        queries, hits = self.engines[index].prefix_cache_totals
        if meters.prefix_queries is not None and meters.prefix_hits is not None and queries > counted[0]:
            meters.prefix_queries.inc(queries - counted[0])
            meters.prefix_hits.inc(hits - counted[1])
            self._prefix_counted[index] = (queries, hits)

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, _: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "owned_by": "sluice", "max_model_len": 8192}
        return web.json_response({"object": "list", "data": [card]})

    async def get_load(self, _: web.Request) -> web.Response:
        return web.json_response({"load": sum(e.num_running + e.num_waiting for e in self.engines)})

    async def render(self, request: web.Request) -> web.Response:
        """The prompt as token ids (one per word: the same count `/v1/completions` charges)."""
        body = await request.json()
        prompt = body.get("prompt", "")
        words = prompt.split() if isinstance(prompt, str) else [str(t) for t in prompt]
        ids = [zlib.crc32(w.encode()) % 128_000 for w in words]
        return web.json_response({"prompt_token_ids": ids, "model": self.model})

    async def metrics(self, _: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        if self.disable_log_stats:
            body = without_families(body, "vllm:")
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
            if self.memory_events is not None:
                record_oom_kill(self.memory_events)  # the cgroup's OOM killer fired: the kubelet will see it
            asyncio.get_running_loop().call_later(0.05, os._exit, 137)
            return web.json_response({"oom": "exiting with 137"})
        if body.get("kill"):
            asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGKILL)
            return web.json_response({"kill": "SIGKILL"})
        self.faults = Faults(
            error_rate=float(body.get("errorRate", self.faults.error_rate)),
            slowdown=float(body.get("slowdown", self.faults.slowdown)),
            lora_failure_rate=float(body.get("loraFailureRate", self.faults.lora_failure_rate)),
            stall_metrics=bool(body.get("stallMetrics", self.faults.stall_metrics)),
        )
        for engine in self.engines:
            engine.engine.slowdown = self.faults.slowdown
        return web.json_response(
            {
                "errorRate": self.faults.error_rate,
                "slowdown": self.faults.slowdown,
                "loraFailureRate": self.faults.lora_failure_rate,
                "stallMetrics": self.faults.stall_metrics,
            }
        )

    # ------------------------------------------------------------------------------------ sleep mode

    async def sleep(self, request: web.Request) -> web.Response:
        """vLLM's POST /sleep: pause the scheduler (per `mode`), release memory (level 1: weights offloaded, KV
        dropped; level 2: both discarded; level 0: scheduling only), then an empty 200."""
        try:
            level = int(request.query.get("level", "1"))
        except ValueError:
            return web.json_response({"error": {"message": "level must be an integer"}}, status=400)
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return web.json_response({"error": {"message": f"Invalid pause mode: {mode}"}}, status=400)
        if mode == "abort":
            for engine in self.engines:
                engine.abort_all()
        elif mode == "wait":
            for engine in self.engines:
                engine.hold()
            while not all(engine.idle() for engine in self.engines):
                await asyncio.sleep(TICK_SECONDS)
        for engine in self.engines:
            engine.pause()
        self.sleep_level = level
        if level >= 1:
            self.sleeping_tags = set(SLEEP_TAGS)
        self._recorded_sleep = (1, level)
        return web.Response(status=200)

    async def wake_up(self, request: web.Request) -> web.Response:
        """vLLM's POST /wake_up: bring back the released memory (all, or the `tags` given), resume scheduling."""
        tags = request.query.getall("tags", [])
        if tags:
            self.sleeping_tags -= set(tags)
        else:
            self.sleeping_tags.clear()
        if not self.sleeping_tags:  # the simulated engine runs again once nothing is left released
            self.sleep_level = None
            for engine in self.engines:
                engine.resume()
        self._recorded_sleep = (0, 0)
        return web.Response(status=200)

    async def is_sleeping(self, _: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": self.sleep_level is not None or bool(self.sleeping_tags)})

    # ------------------------------------------------------------------------------------ inference

    def _least_loaded(self) -> int:
        """vLLM's DP load balancer: the engine with the lowest `waiting * 4 + running`, the first on a tie."""
        scores = [engine.num_waiting * 4 + engine.num_running for engine in self.engines]
        return scores.index(min(scores))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        body = await request.json()
        prompt = body.get("prompt", "")
        words = prompt.split() if isinstance(prompt, str) else [str(t) for t in prompt]
        l_in = max(1, len(words))
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
        index = self._least_loaded()
        engine = self.engines[index]
        meters = self.meters[index]
        flight = engine.submit(l_in, l_out, token_segments(words, l_out))
        if flight is None:
            message = f"This model's maximum context is shorter than {l_in + l_out} tokens"
            return web.json_response({"error": {"message": message}}, status=400)
        try:
            await flight.first_token.wait()
            if flight.sequence.first_token_at is not None:  # not aborted before its first token
                meters.ttft.observe(time.monotonic() - arrived)
                meters.prompt_tokens.inc(l_in)
            if body.get("stream"):
                response = await self._stream(request, flight)
            else:
                await flight.finished.wait()
                generated = flight.sequence.generated if flight.aborted else l_out
                response = web.json_response(
                    {
                        "object": "text_completion",
                        "model": self.model,
                        "choices": [{"index": 0, "text": " tok" * generated, "finish_reason": self._reason(flight)}],
                        "usage": {"prompt_tokens": l_in, "completion_tokens": generated},
                    }
                )
            meters.generation_tokens.inc(flight.sequence.generated if flight.aborted else l_out)
            meters.e2e.observe(time.monotonic() - arrived)
            meters.finished(self._reason(flight))
            return response
        finally:
            engine.flights.pop(flight.sequence.req_id, None)

    @staticmethod
    def _reason(flight: _Flight) -> str:
        return "abort" if flight.aborted else "length"

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
            "choices": [{"index": 0, "text": "", "finish_reason": self._reason(flight)}],
        }
        await response.write(f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response


NO_PREFIX_CACHING = "--no-enable-prefix-caching"
"""vLLM's flag (V1 caches prefixes unless told not to), as the server takes it."""
ANSWER_WORD = "tok"
"""Every token an answer streams (`" tok"` each)."""


def token_segments(words: list[str], output: int) -> list[tuple[int, int]]:
    """The prompt's words and the answer's, one token each, as the engine's prefix cache identifies them."""
    answer = zlib.crc32(ANSWER_WORD.encode())
    return [(zlib.crc32(w.encode()), 1) for w in words] + [(answer, 1)] * output


def _nodelay_socket(host: str, port: int) -> socket.socket:
    """A listening socket with TCP_NODELAY inherited by accepted connections (Python upstreams need it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock


def without_families(exposition: bytes, prefix: str) -> bytes:
    """The exposition without the families whose names start with `prefix` (their HELP, TYPE and samples)."""
    dropped = (prefix.encode(), b"# HELP " + prefix.encode(), b"# TYPE " + prefix.encode())
    return b"".join(line for line in exposition.splitlines(keepends=True) if not line.startswith(dropped))


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
    parser.add_argument(
        "--data-parallel-size", type=int, default=1, help="engine instances (DP ranks), each labelled engine=<rank>"
    )
    parser.add_argument(
        "--enable-sleep-mode", action="store_true", help="serve vLLM's /sleep, /wake_up and /is_sleeping"
    )
    parser.add_argument("--exposition", choices=EXPOSITIONS, default="vllm", help="whose metric names /metrics uses")
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="as vLLM's flag (on by default in V1): the engine's automatic prefix caching",
    )
    parser.add_argument(
        "--disable-log-stats", action="store_true", help="as vLLM's flag: no vllm: family on /metrics (HTTP ones stay)"
    )
    parser.add_argument(
        "--memory-events",
        type=Path,
        default=None,
        help="a cgroup v2 memory.events-format file where the `oom` fault records the OOM kill",
    )
    args = parser.parse_args(argv)
    if not args.host.startswith("127."):
        parser.error("the simulated server binds to loopback addresses only (127.0.0.0/8)")
    if args.data_parallel_size < 1:
        parser.error("--data-parallel-size must be at least 1")
    if args.enable_sleep_mode and args.exposition != "vllm":
        parser.error("--enable-sleep-mode is vLLM's: it needs --exposition vllm")
    server = ModelServer(
        args.hardware,
        args.model,
        args.seed,
        args.performance_model,
        data_parallel_size=args.data_parallel_size,
        enable_sleep_mode=args.enable_sleep_mode,
        exposition=args.exposition,
        memory_events=args.memory_events,
        disable_log_stats=args.disable_log_stats,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    server.faults.error_rate = args.error_rate
    with contextlib.suppress(KeyboardInterrupt):
        web.run_app(server.app(), sock=_nodelay_socket(args.host, args.port), print=None, access_log=None)


if __name__ == "__main__":
    main()
