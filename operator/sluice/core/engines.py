"""Each engine's preset: per signal the PromQL that reads it from vLLM, SGLang, TRT-LLM, Triton or TGI and the raw
series that query reads, what an engine cannot provide, what it needs to export what its preset reads, and the
gauge whose newest sample tells that a pod's signals are fresh. Pure data.

Every name and label is cited from the engine's own source; `tests/fixtures/engines/` holds real expositions.
"""

from __future__ import annotations

from collections.abc import Callable

from sluice.api.v1alpha1 import Engine
from sluice.core.observed import SignalName
from sluice.core.promql import (
    Reading,
    Series,
    all_requests,
    gauge,
    mean_of_histogram,
    p95_of_histogram,
    rate,
    ratio,
    worst_of,
)

# ---------------------------------------------------------------------------------------------------- vLLM
# vllm/v1/metrics/loggers.py (PrometheusStatLogger): every engine family is labelled (model_name, engine), one
# series per data-parallel engine; the OpenAI server's HTTP families come from prometheus-fastapi-instrumentator
# (handler = the route template, statuses grouped 2xx/4xx/5xx). tests/fixtures/engines/vllm/ cites each.
_VLLM_ENGINE = ("model_name", "engine")
_VLLM_LOGS = "vLLM exports it unless started with --disable-log-stats (which removes every vllm: family)"
_VLLM_TTFT = Series("vllm:time_to_first_token_seconds_count", _VLLM_ENGINE, fix=_VLLM_LOGS)
_VLLM_WAITING = Series("vllm:num_requests_waiting", _VLLM_ENGINE, fix=_VLLM_LOGS)
_VLLM_RUNNING = Series("vllm:num_requests_running", _VLLM_ENGINE, fix=_VLLM_LOGS)
_VLLM_FINISHED = Series("vllm:request_success_total", (*_VLLM_ENGINE, "finished_reason"), fix=_VLLM_LOGS)
_VLLM_HTTP = Series(
    "http_requests_total",
    ("handler", "method", "status"),
    lazy=True,
    fix="vLLM's OpenAI server counts HTTP answers from its first request on",
)
VLLM_INFERENCE_HANDLERS = (
    "/v1/chat/completions|/v1/completions|/v1/embeddings|/v1/responses|/v1/audio/.*|/pooling|/classify|/score"
    "|/v1/score|/rerank|/v1/rerank|/v2/rerank|/invocations"
)
"""The OpenAI server's inference routes: `/v1/models`, the LoRA routes, `handler="none"` (an unknown path) say
nothing of the engine's health."""
_VLLM_INFERENCE = f',handler=~"{VLLM_INFERENCE_HANDLERS}"'

VLLM: dict[SignalName, Reading] = {
    "ttft": Reading(mean_of_histogram("vllm:time_to_first_token_seconds"), (_VLLM_TTFT,)),
    "ttftP95": Reading(p95_of_histogram("vllm:time_to_first_token_seconds"), (_VLLM_TTFT,)),
    # 0.9.0/0.9.1 export only gpu_cache_usage_perc; 0.9.2 to 0.10 both (equal values); 0.11 hides the old name,
    # 0.12 removes it. `or` prefers the new one.
    "kvCacheUsage": Reading(
        f"{gauge('max', 'vllm:kv_cache_usage_perc')} or {gauge('max', 'vllm:gpu_cache_usage_perc')}",
        (
            # 0.9.2 to 0.11 with several API servers (multiprocess mode) label the KV gauge with `pid`
            Series("vllm:kv_cache_usage_perc", (*_VLLM_ENGINE, "pid"), fix=_VLLM_LOGS),
            Series("vllm:gpu_cache_usage_perc", (*_VLLM_ENGINE, "pid"), fix=_VLLM_LOGS),
        ),
        any_of=True,
    ),
    "queueLength": Reading(gauge("sum", "vllm:num_requests_waiting"), (_VLLM_WAITING,)),
    "runningRequests": Reading(gauge("sum", "vllm:num_requests_running"), (_VLLM_RUNNING,)),
    "requestRate": Reading(rate("vllm:request_success_total"), (_VLLM_FINISHED,)),
    # Two views of failure, the worse one counts: HTTP 5xx answers of the inference routes (a request refused or
    # crashed before the engine finished it appears only there), and requests the engine finished with reason
    # "error" (a stream that fails after its 200 header appears only there; 0.9 has no such reason). 4xx answers
    # are the client's mistakes.
    "errorRate": Reading(
        worst_of(
            ratio(
                rate("http_requests_total", f'{_VLLM_INFERENCE},status="5xx"'),
                rate("http_requests_total", _VLLM_INFERENCE),
            ),
            ratio(
                rate("vllm:request_success_total", ',finished_reason="error"'),
                rate("vllm:request_success_total"),
            ),
        ),
        (_VLLM_FINISHED, _VLLM_HTTP),
        any_of=True,
    ),
    # vllm:engine_sleep_state{sleep_state="awake"|"weights_offloaded"|"discard_all"}, 1 on the engine's state
    # (since late 2025, with or without --enable-sleep-mode); absent before and with --disable-log-stats.
    "sleeping": Reading(
        'max by ($podLabel) (1 - vllm:engine_sleep_state{$selector,sleep_state="awake"})',
        (Series("vllm:engine_sleep_state", (*_VLLM_ENGINE, "sleep_state"), needed=False),),
    ),
}

# -------------------------------------------------------------------------------------------------- SGLang
# python/sglang/srt/observability/metrics_collector.py (v0.5.23): scheduler gauges per (tp_rank, pp_rank,
# moe_ep_rank[, dp_rank]) with priority="" as the total beside per-priority series under priority scheduling; TP
# ranks of one DP group repeat the same requests (--enable-metrics-for-all-schedulers); the tokenizer's families
# count each request once; http_request_metrics.py counts HTTP answers per route template and status.
_SGL_SCHED = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank", "dp_rank", "priority")
_SGL_TOKENIZER = ("model_name", "engine_type", "is_streaming", "priority")
_SGL_METRICS = "SGLang exports it with --enable-metrics"
# the tokenizer's children carry per-request labels (is_streaming, priority): made with the first request
_SGL_TTFT = Series("sglang:time_to_first_token_seconds_count", _SGL_TOKENIZER, lazy=True, fix=_SGL_METRICS)
_SGL_HTTP = Series(
    "sglang:http_responses_total",
    ("endpoint", "status_code", "method"),
    lazy=True,
    fix="SGLang counts HTTP answers with --enable-metrics since late 2025 (an older SGLang: override errorRate)",
)
SGLANG_INFERENCE_ENDPOINTS = (
    "/generate|/v1/chat/completions|/v1/completions|/v1/responses|/v1/embeddings|/encode|/classify"
)
"""SGLang's inference routes (its `endpoint` label is the route template)."""
_SGL_INFERENCE = f',endpoint=~"{SGLANG_INFERENCE_ENDPOINTS}"'
_SGL_LORA = ',endpoint="/load_lora_adapter"'


def _per_dp_group(name: str) -> str:
    """A scheduler gauge counted once per data-parallel group: the total (priority="", which also matches a
    series without the label) of one TP rank (they repeat each other), summed over DP groups."""
    return f'sum by ($podLabel) (max by ($podLabel, dp_rank) ({name}{{$selector,priority=""}}))'


SGLANG: dict[SignalName, Reading] = {
    "ttft": Reading(mean_of_histogram("sglang:time_to_first_token_seconds"), (_SGL_TTFT,)),
    "ttftP95": Reading(p95_of_histogram("sglang:time_to_first_token_seconds"), (_SGL_TTFT,)),
    "kvCacheUsage": Reading(
        gauge("max", "sglang:token_usage"), (Series("sglang:token_usage", _SGL_SCHED, fix=_SGL_METRICS),)
    ),
    "queueLength": Reading(
        _per_dp_group("sglang:num_queue_reqs"), (Series("sglang:num_queue_reqs", _SGL_SCHED, fix=_SGL_METRICS),)
    ),
    "runningRequests": Reading(
        _per_dp_group("sglang:num_running_reqs"),
        (Series("sglang:num_running_reqs", _SGL_SCHED, fix=_SGL_METRICS),),
    ),
    "requestRate": Reading(
        rate("sglang:num_requests_total"),
        (Series("sglang:num_requests_total", _SGL_TOKENIZER, lazy=True, fix=_SGL_METRICS),),
    ),
    # 5xx answers of the inference routes; 4xx (the client's) and aborts (HTTP 200 streams) are not failures.
    "errorRate": Reading(
        ratio(
            rate("sglang:http_responses_total", f'{_SGL_INFERENCE},status_code=~"5.."'),
            rate("sglang:http_responses_total", _SGL_INFERENCE),
        ),
        (_SGL_HTTP,),
    ),
    # A failed adapter load is answered 400, server-side failures included (http_server.py): every answer
    # but a 200 is a failed load.
    "loraFailureRate": Reading(
        ratio(
            rate("sglang:http_responses_total", f'{_SGL_LORA},status_code!="200"'),
            rate("sglang:http_responses_total", _SGL_LORA),
        ),
        (_SGL_HTTP,),
    ),
}

# ------------------------------------------------------------------------------------------------- TRT-LLM
# tensorrt_llm/metrics/collector.py: 1.1/1.2 export five unprefixed families (labels model_name, engine_type);
# 2026 builds (1.3) the trtllm_ names, the KV/queue gauges (with a pid label: multiprocess exposition) and
# trtllm_request_error_total{http_code}. Text exposition at /prometheus/metrics, only with return_perf_metrics.
_TRT_SERVE = (
    "trtllm-serve serves Prometheus text at /prometheus/metrics (/metrics answers JSON) only with "
    "return_perf_metrics: true in the --extra_llm_api_options file"
)
_TRT_GAUGES = (
    "trtllm-serve exports it from 1.3 (the trtllm_ names) with return_perf_metrics: true; 1.1 and 1.2 have "
    "no KV, queue or error metric"
)
_TRT_ID = ("model_name", "engine_type")
# labelled children made on first use (tensorrt_llm/metrics/collector.py)
_TRT_TTFT = (
    Series("trtllm_time_to_first_token_seconds_count", _TRT_ID, lazy=True, fix=_TRT_SERVE),
    Series("time_to_first_token_seconds_count", _TRT_ID, lazy=True, fix=_TRT_SERVE),
)
_TRT_FINISHED = (
    Series("trtllm_request_success_total", (*_TRT_ID, "finished_reason"), lazy=True, fix=_TRT_SERVE),
    Series("request_success_total", (*_TRT_ID, "finished_reason"), lazy=True, fix=_TRT_SERVE),
)
_TRT_OLD = (
    "time_to_first_token_seconds_count",
    "trtllm-serve 1.1/1.2 (unprefixed names) has no such metric: 1.3 and later export it",
)
_TRT_ERRORS = Series("trtllm_request_error_total", (*_TRT_ID, "http_code"), needed=False)


def _generations(build: Callable[[str], str], name: str) -> str:
    """A query over the 2026 name (`trtllm_` prefix) or, for 1.1/1.2, the unprefixed one."""
    return f"({build('trtllm_' + name)}) or ({build(name)})"


def _trt_gauge(name: str) -> Reading:
    # one server process per pod: max drops a stale pid's series left in the multiprocess directory
    return Reading(
        gauge("max", f"trtllm_{name}"),
        (Series(f"trtllm_{name}", (*_TRT_ID, "pid"), fix=_TRT_GAUGES),),
        unavailable_when=_TRT_OLD,
    )


TRTLLM: dict[SignalName, Reading] = {
    "ttft": Reading(_generations(mean_of_histogram, "time_to_first_token_seconds"), _TRT_TTFT, any_of=True),
    "ttftP95": Reading(_generations(p95_of_histogram, "time_to_first_token_seconds"), _TRT_TTFT, any_of=True),
    "kvCacheUsage": _trt_gauge("kv_cache_utilization"),
    "queueLength": _trt_gauge("num_requests_waiting"),
    "runningRequests": _trt_gauge("num_requests_running"),
    "requestRate": Reading(_generations(rate, "request_success_total"), _TRT_FINISHED, any_of=True),
    # 5xx answers only: trtllm_request_error_total also counts the 400s of requests that failed validation.
    "errorRate": Reading(
        ratio(
            rate("trtllm_request_error_total", ',http_code=~"5.."'),
            all_requests(rate("trtllm_request_success_total"), rate("trtllm_request_error_total")),
        ),
        (
            Series("trtllm_request_success_total", (*_TRT_ID, "finished_reason"), lazy=True, fix=_TRT_GAUGES),
            _TRT_ERRORS,
        ),
        unavailable_when=_TRT_OLD,
    ),
}

# -------------------------------------------------------------------------------------------------- Triton
# triton-inference-server/core src/metric_model_reporter.cc: every nv_inference_* series per (model, version[,
# gpu_uuid]); an ensemble counts a request once per composing model (postprocessing once per streamed token), a
# failed ensemble request twice as OTHER. The TensorRT-LLM backend's nv_trt_llm_* gauges live on its own model.
_TRITON_ID = ("model", "version", "gpu_uuid")
_SERVED = ',model="$servedModel"'
_BACKEND = ',model="$backendModel"'
_TRITON_TTFT = Series(
    "nv_inference_first_response_histogram_ms_count",
    _TRITON_ID,
    _SERVED,
    fix="Triton exports it with --metrics-config histogram_latencies=true",
)
_TRITON_BACKEND_GAUGES = (
    "the TensorRT-LLM backend exports it on its own model (metrics.triton.backendModel, default tensorrt_llm)"
)
_TRITON_SERVED_FIX = (
    "Triton exports it per model: metrics.triton.servedModel must name the model clients call (ensemble by default)"
)


def _trt_llm_gauge(label: str, value: str) -> Reading:
    name = "nv_trt_llm_request_metrics" if label == "request_type" else "nv_trt_llm_kv_cache_block_metrics"
    aggregation = "max" if label == "kv_cache_block_type" else "sum"
    matchers = f'{_BACKEND},{label}="{value}"'
    return Reading(
        gauge(aggregation, name, matchers),
        (Series(name, (*_TRITON_ID, label), matchers, fix=_TRITON_BACKEND_GAUGES),),
    )


_TRITON_SERVER_FAILURES = ',reason=~"BACKEND|REJECTED|OTHER"'
"""Failures of the server's own: a backend error, a queue timeout or overload, anything else. CANCELED is the
client's."""

TRITON: dict[SignalName, Reading] = {
    "ttft": Reading(mean_of_histogram("nv_inference_first_response_histogram_ms", _SERVED, " / 1000"), (_TRITON_TTFT,)),
    "ttftP95": Reading(
        p95_of_histogram("nv_inference_first_response_histogram_ms", _SERVED, " / 1000"), (_TRITON_TTFT,)
    ),
    "kvCacheUsage": _trt_llm_gauge("kv_cache_block_type", "fraction"),
    # waiting = active - scheduled (model_instance_state.cc); scheduled requests are the running batch
    "queueLength": _trt_llm_gauge("request_type", "waiting"),
    "runningRequests": _trt_llm_gauge("request_type", "scheduled"),
    "requestRate": Reading(
        rate("nv_inference_request_success", _SERVED),
        (Series("nv_inference_request_success", _TRITON_ID, _SERVED, fix=_TRITON_SERVED_FIX),),
    ),
    # The LLM step's own failures over the requests that reached it: the served ensemble's failures mix client
    # cancels with faults and count each twice, and its composing models count a request once each.
    "errorRate": Reading(
        ratio(
            rate("nv_inference_request_failure", _BACKEND + _TRITON_SERVER_FAILURES),
            all_requests(
                rate("nv_inference_request_success", _BACKEND), rate("nv_inference_request_failure", _BACKEND)
            ),
        ),
        (
            Series("nv_inference_request_success", _TRITON_ID, _BACKEND, fix=_TRITON_BACKEND_GAUGES),
            Series("nv_inference_request_failure", (*_TRITON_ID, "reason"), _BACKEND, needed=False),
        ),
    ),
}

# ----------------------------------------------------------------------------------------------------- TGI
# router/src (v3.3.7), rendered by metrics-exporter-prometheus 0.15 (counters without _total). err values:
# validation (422), template (422), overloaded (429), dropped (client gone) are not the server's failures;
# generation (424) and incomplete (500) are.
# The metrics crate registers a series when it is first recorded: nothing exists before the first request.
_TGI_V3 = "TGI's v2/v3 backends export it once they have served a request"
_TGI_OTHER_BACKEND = (
    "tgi_request_count",
    "TGI's llama.cpp and TensorRT-LLM backends export no queue or batch gauge",
)
_TGI_SUCCESS = Series("tgi_request_success", lazy=True, fix="TGI counts requests from its first one on")
TGI: dict[SignalName, Reading] = {
    "queueLength": Reading(
        gauge("sum", "tgi_queue_size"),
        (Series("tgi_queue_size", lazy=True, fix=_TGI_V3),),
        unavailable_when=_TGI_OTHER_BACKEND,
    ),
    "runningRequests": Reading(
        gauge("sum", "tgi_batch_current_size"),
        (Series("tgi_batch_current_size", lazy=True, fix=_TGI_V3),),
        unavailable_when=_TGI_OTHER_BACKEND,
    ),
    "requestRate": Reading(rate("tgi_request_success"), (_TGI_SUCCESS,)),
    "errorRate": Reading(
        ratio(
            rate("tgi_request_failure", ',err=~"generation|incomplete"'),
            all_requests(rate("tgi_request_success"), rate("tgi_request_failure")),
        ),
        (_TGI_SUCCESS, Series("tgi_request_failure", ("err",), needed=False)),
    ),
}

# ------------------------------------------------------------------------------------------------ sidecar
# Not the engine's: the pod's Istio sidecar counts every request it answers in istio_requests_total (istio/proxy
# source/extensions/filters/http/istio_stats/istio_stats.cc; the labels as testdata/metric/
# server_request_total.yaml.tmpl has them), reporter="destination" on the inbound side, merged into the pod's
# own scrape by the agent (metrics merging), so it carries the pod label the engine's series do. Envoy writes a
# request it answers itself with its response flags (source/common/stream_info/utility.cc, comma-separated):
# UO for the inbound circuit breaker's overflow (the inbound limit), RL for the local rate limit (a tenant's
# bucket). A series appears with its first request of that label set, so a pod whose sidecar answered requests
# and refused none has measurably refused 0; a pod without the metric (no sidecar, metrics merging off) reads
# nothing.
_INBOUND = ',reporter="destination"'
ISTIO_REQUESTS = Series(
    "istio_requests_total",
    (
        "reporter",
        "source_workload",
        "source_workload_namespace",
        "source_principal",
        "source_app",
        "source_version",
        "source_cluster",
        "source_canonical_service",
        "source_canonical_revision",
        "destination_workload",
        "destination_workload_namespace",
        "destination_principal",
        "destination_app",
        "destination_version",
        "destination_service",
        "destination_service_name",
        "destination_service_namespace",
        "destination_cluster",
        "destination_canonical_service",
        "destination_canonical_revision",
        "request_protocol",
        "response_code",
        "grpc_response_status",
        "response_flags",
        "connection_security_policy",
    ),
    _INBOUND,
    needed=False,
    lazy=True,
)
SIDECAR_REFUSED_FLAGS = "(.*,)?(UO|RL)(,.*)?"
"""Envoy's short response flags of a request the sidecar refused: inbound overflow or local rate limit."""
_REFUSED = _INBOUND + ',response_flags=~"' + SIDECAR_REFUSED_FLAGS + '"'
SIDECAR: dict[SignalName, Reading] = {
    "refusedRate": Reading(
        f"({rate('istio_requests_total', _REFUSED)}) or (0 * ({rate('istio_requests_total', _INBOUND)}))",
        (ISTIO_REQUESTS,),
    ),
}
"""What the pod's sidecar reads, the same whatever the engine (asked only under `admission.mode: Enforce`)."""

READINGS: dict[Engine, dict[SignalName, Reading]] = {
    "vllm": VLLM | SIDECAR,
    "sglang": SGLANG | SIDECAR,
    "trtllm": TRTLLM | SIDECAR,
    "triton": TRITON | SIDECAR,
    "tgi": TGI | SIDECAR,
}
"""Each engine's preset: per signal its query and the raw series it reads. `custom` has none (but the sidecar's
query: `sluice.core.presets.PRESETS`)."""

_NO_TTFT = "TGI exports no time-to-first-token metric (tgi_request_queue_duration leaves out the prefill)"
NOT_PROVIDED: dict[Engine, dict[SignalName, str]] = {
    "vllm": {
        "loraFailureRate": "vLLM exports no adapter-load metric, and its HTTP metrics leave out "
        "/v1/load_lora_adapter (the instrumentator excludes every handler matching /load)",
    },
    "sglang": {"sleeping": "not provided by sglang"},
    "trtllm": {
        "loraFailureRate": "trtllm-serve exports no adapter-load metric",
        "sleeping": "not provided by trtllm",
    },
    "triton": {
        "loraFailureRate": "Triton exports no adapter-load metric",
        "sleeping": "not provided by triton",
    },
    "tgi": {
        "ttft": _NO_TTFT,
        "ttftP95": _NO_TTFT,
        "kvCacheUsage": "TGI exports no KV-cache usage (its capacity, tgi_batch_max_total_tokens, is never exported)",
        "loraFailureRate": "TGI exports no adapter-load metric",
        "sleeping": "not provided by tgi",
    },
}
"""Why an engine cannot provide a signal (the preflight says so; an override can supply it)."""

ENGINE_SETUP: dict[Engine, str] = {
    "vllm": "vLLM: do not start with --disable-log-stats; Prometheus scrapes /metrics on the API port",
    "sglang": "SGLang: start with --enable-metrics; Prometheus scrapes /metrics on the API port",
    "trtllm": _TRT_SERVE,
    "triton": "Triton: start with --metrics-config histogram_latencies=true for TTFT; Prometheus scrapes /metrics "
    "on the metrics port (8002)",
    "tgi": "TGI: Prometheus scrapes /metrics on the router's port",
}
"""What each engine needs to export what its preset reads (the preflight's fix when no series says more)."""

FRESHNESS_SERIES: dict[Engine, tuple[Series, ...]] = {
    "vllm": (_VLLM_RUNNING,),
    "sglang": (Series("sglang:num_running_reqs", _SGL_SCHED),),
    # 1.1/1.2 have no gauge: the TTFT histogram's count is scraped every time too
    "trtllm": (Series("trtllm_num_requests_running", (*_TRT_ID, "pid")), _TRT_TTFT[1]),
    "triton": (
        Series("nv_trt_llm_request_metrics", (*_TRITON_ID, "request_type"), _BACKEND),
        Series("nv_inference_request_success", _TRITON_ID, _SERVED),
    ),
    # the llama.cpp backend has no queue gauge; its counters appear with the first request
    "tgi": (Series("tgi_queue_size"), Series("tgi_request_count")),
}
"""One gauge (per name generation) every live server exports on every scrape: `timestamp()` of it is the time of
the pod's newest sample, the evidence that signals are fresh (rates and quantiles carry the query's time)."""
