"""Engine presets: the PromQL that reads each signal from vLLM, SGLang, TRT-LLM, Triton and TGI.

Pure string building. Every query is a *vector* query over the whole pool (`sum by (<pod label>)`), one per
signal per pool, never one per pod; the operator asks for the namespace-wide form (`namespace_wide`), which all
pools of a namespace share. Names substituted into PromQL are escaped, so a pod or namespace name cannot
change the query. Called by the Prometheus I/O module and by `sluice plan --show-queries`.

Template placeholders (presets and user overrides alike): `$selector` (namespace, pods and extra label matchers),
`$namespace`, `$pods` (an escaped regex alternation of the pool's pod names), `$window`, `$podLabel`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from string import Template

from sluice.api.durations import format_duration
from sluice.api.v1alpha1 import Engine, InferencePoolSpec, QueryOverrides
from sluice.core.observed import ALL_SIGNALS, SignalName

# Above this many pods the query selects by namespace only and the caller keeps the pool's pods: a regex of
# thousands of names makes a request line Prometheus may refuse.
POD_REGEX_LIMIT = 200


@dataclass(frozen=True)
class Series:
    """A raw metric a preset reads, as the preflight checks it (`sluice.core.signalcheck`)."""

    name: str
    """The metric name (a histogram's `_count`)."""
    identity: tuple[str, ...] = ()
    """The engine's own labels that tell its series of one pod apart (data-parallel rank, finish reason, ...): two
    raw series of one pod with the same values of these are one series scraped twice, or split by a label the
    preset does not expect, and the signal is not used for that pod."""
    matchers: str = ""
    """Label matchers the preset adds (`,model="..."`), with the preset's placeholders."""
    needed: bool = True
    """False for a series that appears only with its first event (a failure counter): never reported missing."""
    lazy: bool = False
    """The engine creates it with its first request (a labelled child made on use): missing only for a pod that
    shows traffic (requests running, waiting or finished)."""
    fix: str = ""
    """What makes the engine export it, for the preflight's message."""

    @property
    def key(self) -> str:
        """The series as the preflight names it: its name and the preset's matchers."""
        return f"{self.name}{{{self.matchers.lstrip(',')}}}" if self.matchers else self.name


@dataclass(frozen=True)
class Reading:
    """One signal of a preset: its query, and the raw series the query reads."""

    query: str
    series: tuple[Series, ...]
    any_of: bool = False
    """The needed series are alternatives (one name per engine generation): one of them is enough."""
    unavailable_when: tuple[str, str] | None = None
    """(a series key, why): a pod that has that series but not the reading's runs an engine version or backend
    that cannot give the signal: NotProvided for it, not Missing."""


def _ratio(numerator: str, denominator: str) -> str:
    """failed/total per pod. The denominator counts every request, failed ones included, and a failure would
    create the failure series; so a pod with traffic and no failure series has measurably failed 0 requests.
    A pod with no traffic reads nothing (0/0), never 0."""
    return f"(({numerator}) or (0 * ({denominator}))) / ({denominator})"


def _all_requests(succeeded: str, failed: str) -> str:
    """succeeded + failed per pod, also for a pod whose failure series does not exist yet (vector `+` would
    drop it, leaving the error rate of a pod with traffic and no failures missing)."""
    return f"({succeeded}) + (({failed}) or (0 * ({succeeded})))"


def _worst_of(*queries: str) -> str:
    """The highest of several per-pod ratios (each labelled by its source so `or` keeps them all)."""
    tagged = [f'label_replace({query}, "sluice_source", "{i}", "", "")' for i, query in enumerate(queries)]
    return "max by ($podLabel) (" + " or ".join(tagged) + ")"


def _mean_of_histogram(name: str, matchers: str = "", scale: str = "") -> str:
    return (
        f"sum by ($podLabel) (rate({name}_sum{{$selector{matchers}}}[$window])) / "
        f"sum by ($podLabel) (rate({name}_count{{$selector{matchers}}}[$window])){scale}"
    )


def _p95_of_histogram(name: str, matchers: str = "", scale: str = "") -> str:
    return (
        f"histogram_quantile(0.95, sum by ($podLabel, le) (rate({name}_bucket{{$selector{matchers}}}[$window]))){scale}"
    )


def _rate(name: str, extra: str = "") -> str:
    return f"sum by ($podLabel) (rate({name}{{$selector{extra}}}[$window]))"


def _gauge(aggregation: str, name: str, extra: str = "") -> str:
    return f"{aggregation} by ($podLabel) ({name}{{$selector{extra}}})"


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
    "ttft": Reading(_mean_of_histogram("vllm:time_to_first_token_seconds"), (_VLLM_TTFT,)),
    "ttftP95": Reading(_p95_of_histogram("vllm:time_to_first_token_seconds"), (_VLLM_TTFT,)),
    # 0.9.0/0.9.1 export only gpu_cache_usage_perc; 0.9.2 to 0.10 both (equal values); 0.11 hides the old name,
    # 0.12 removes it. `or` prefers the new one.
    "kvCacheUsage": Reading(
        f"{_gauge('max', 'vllm:kv_cache_usage_perc')} or {_gauge('max', 'vllm:gpu_cache_usage_perc')}",
        (
            # 0.9.2 to 0.11 with several API servers (multiprocess mode) label the KV gauge with `pid`
            Series("vllm:kv_cache_usage_perc", (*_VLLM_ENGINE, "pid"), fix=_VLLM_LOGS),
            Series("vllm:gpu_cache_usage_perc", (*_VLLM_ENGINE, "pid"), fix=_VLLM_LOGS),
        ),
        any_of=True,
    ),
    "queueLength": Reading(_gauge("sum", "vllm:num_requests_waiting"), (_VLLM_WAITING,)),
    "runningRequests": Reading(_gauge("sum", "vllm:num_requests_running"), (_VLLM_RUNNING,)),
    "requestRate": Reading(_rate("vllm:request_success_total"), (_VLLM_FINISHED,)),
    # Two views of failure, the worse one counts: HTTP 5xx answers of the inference routes (a request refused or
    # crashed before the engine finished it appears only there), and requests the engine finished with reason
    # "error" (a stream that fails after its 200 header appears only there; 0.9 has no such reason). 4xx answers
    # are the client's mistakes.
    "errorRate": Reading(
        _worst_of(
            _ratio(
                _rate("http_requests_total", f'{_VLLM_INFERENCE},status="5xx"'),
                _rate("http_requests_total", _VLLM_INFERENCE),
            ),
            _ratio(
                _rate("vllm:request_success_total", ',finished_reason="error"'),
                _rate("vllm:request_success_total"),
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
    "ttft": Reading(_mean_of_histogram("sglang:time_to_first_token_seconds"), (_SGL_TTFT,)),
    "ttftP95": Reading(_p95_of_histogram("sglang:time_to_first_token_seconds"), (_SGL_TTFT,)),
    "kvCacheUsage": Reading(
        _gauge("max", "sglang:token_usage"), (Series("sglang:token_usage", _SGL_SCHED, fix=_SGL_METRICS),)
    ),
    "queueLength": Reading(
        _per_dp_group("sglang:num_queue_reqs"), (Series("sglang:num_queue_reqs", _SGL_SCHED, fix=_SGL_METRICS),)
    ),
    "runningRequests": Reading(
        _per_dp_group("sglang:num_running_reqs"),
        (Series("sglang:num_running_reqs", _SGL_SCHED, fix=_SGL_METRICS),),
    ),
    "requestRate": Reading(
        _rate("sglang:num_requests_total"),
        (Series("sglang:num_requests_total", _SGL_TOKENIZER, lazy=True, fix=_SGL_METRICS),),
    ),
    # 5xx answers of the inference routes; 4xx (the client's) and aborts (HTTP 200 streams) are not failures.
    "errorRate": Reading(
        _ratio(
            _rate("sglang:http_responses_total", f'{_SGL_INFERENCE},status_code=~"5.."'),
            _rate("sglang:http_responses_total", _SGL_INFERENCE),
        ),
        (_SGL_HTTP,),
    ),
    # A failed adapter load is answered 400, server-side failures included (http_server.py): every answer
    # but a 200 is a failed load.
    "loraFailureRate": Reading(
        _ratio(
            _rate("sglang:http_responses_total", f'{_SGL_LORA},status_code!="200"'),
            _rate("sglang:http_responses_total", _SGL_LORA),
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
        _gauge("max", f"trtllm_{name}"),
        (Series(f"trtllm_{name}", (*_TRT_ID, "pid"), fix=_TRT_GAUGES),),
        unavailable_when=_TRT_OLD,
    )


TRTLLM: dict[SignalName, Reading] = {
    "ttft": Reading(_generations(_mean_of_histogram, "time_to_first_token_seconds"), _TRT_TTFT, any_of=True),
    "ttftP95": Reading(_generations(_p95_of_histogram, "time_to_first_token_seconds"), _TRT_TTFT, any_of=True),
    "kvCacheUsage": _trt_gauge("kv_cache_utilization"),
    "queueLength": _trt_gauge("num_requests_waiting"),
    "runningRequests": _trt_gauge("num_requests_running"),
    "requestRate": Reading(_generations(_rate, "request_success_total"), _TRT_FINISHED, any_of=True),
    # 5xx answers only: trtllm_request_error_total also counts the 400s of requests that failed validation.
    "errorRate": Reading(
        _ratio(
            _rate("trtllm_request_error_total", ',http_code=~"5.."'),
            _all_requests(_rate("trtllm_request_success_total"), _rate("trtllm_request_error_total")),
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
        _gauge(aggregation, name, matchers),
        (Series(name, (*_TRITON_ID, label), matchers, fix=_TRITON_BACKEND_GAUGES),),
    )


_TRITON_SERVER_FAILURES = ',reason=~"BACKEND|REJECTED|OTHER"'
"""Failures of the server's own: a backend error, a queue timeout or overload, anything else. CANCELED is the
client's."""

TRITON: dict[SignalName, Reading] = {
    "ttft": Reading(
        _mean_of_histogram("nv_inference_first_response_histogram_ms", _SERVED, " / 1000"), (_TRITON_TTFT,)
    ),
    "ttftP95": Reading(
        _p95_of_histogram("nv_inference_first_response_histogram_ms", _SERVED, " / 1000"), (_TRITON_TTFT,)
    ),
    "kvCacheUsage": _trt_llm_gauge("kv_cache_block_type", "fraction"),
    # waiting = active - scheduled (model_instance_state.cc); scheduled requests are the running batch
    "queueLength": _trt_llm_gauge("request_type", "waiting"),
    "runningRequests": _trt_llm_gauge("request_type", "scheduled"),
    "requestRate": Reading(
        _rate("nv_inference_request_success", _SERVED),
        (Series("nv_inference_request_success", _TRITON_ID, _SERVED, fix=_TRITON_SERVED_FIX),),
    ),
    # The LLM step's own failures over the requests that reached it: the served ensemble's failures mix client
    # cancels with faults and count each twice, and its composing models count a request once each.
    "errorRate": Reading(
        _ratio(
            _rate("nv_inference_request_failure", _BACKEND + _TRITON_SERVER_FAILURES),
            _all_requests(
                _rate("nv_inference_request_success", _BACKEND), _rate("nv_inference_request_failure", _BACKEND)
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
        _gauge("sum", "tgi_queue_size"),
        (Series("tgi_queue_size", lazy=True, fix=_TGI_V3),),
        unavailable_when=_TGI_OTHER_BACKEND,
    ),
    "runningRequests": Reading(
        _gauge("sum", "tgi_batch_current_size"),
        (Series("tgi_batch_current_size", lazy=True, fix=_TGI_V3),),
        unavailable_when=_TGI_OTHER_BACKEND,
    ),
    "requestRate": Reading(_rate("tgi_request_success"), (_TGI_SUCCESS,)),
    "errorRate": Reading(
        _ratio(
            _rate("tgi_request_failure", ',err=~"generation|incomplete"'),
            _all_requests(_rate("tgi_request_success"), _rate("tgi_request_failure")),
        ),
        (_TGI_SUCCESS, Series("tgi_request_failure", ("err",), needed=False)),
    ),
}

READINGS: dict[Engine, dict[SignalName, Reading]] = {
    "vllm": VLLM,
    "sglang": SGLANG,
    "trtllm": TRTLLM,
    "triton": TRITON,
    "tgi": TGI,
}
"""Each engine's preset: per signal its query and the raw series it reads. `custom` has none."""

PRESETS: dict[Engine, dict[SignalName, str]] = {
    engine: {signal: reading.query for signal, reading in readings.items()} for engine, readings in READINGS.items()
}
PRESETS["custom"] = {}

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

OPTIONAL_SIGNALS: frozenset[SignalName] = frozenset({"sleeping", "loraFailureRate"})
"""Signals whose absence says nothing wrong, never reported missing: an engine started without sleep mode is
awake, and a pod that loaded no adapter has no LoRA failure rate."""

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

FRESHNESS: dict[Engine, str] = {
    engine: " or ".join(f"max by ($podLabel) (timestamp({s.name}{{$selector{s.matchers}}}))" for s in series)
    for engine, series in FRESHNESS_SERIES.items()
}


def overridden(spec: InferencePoolSpec, signal: str) -> bool:
    """Whether a query override replaces the preset's query for `signal`."""
    return getattr(spec.metrics.queries, SIGNAL_FIELD_OVERRIDE[signal]) is not None


def supported_signals(spec: InferencePoolSpec) -> tuple[SignalName, ...]:
    """Signals the pool can have: the engine preset's, plus any per-signal override."""
    preset = PRESETS[spec.engine]
    return tuple(
        signal
        for signal in ALL_SIGNALS
        if signal in preset or getattr(spec.metrics.queries, SIGNAL_FIELD_OVERRIDE[signal]) is not None
    )


def names_pods(spec: InferencePoolSpec, signal: str) -> bool:
    """Whether the signal's query (an override, or the engine's preset; `sampleTime`: the freshness query) uses
    `$pods`, the pool's own pods: such a query is the pool's, never asked for other pods."""
    if signal == "sampleTime":
        template = FRESHNESS.get(spec.engine) or ""
    else:
        field = SIGNAL_FIELD_OVERRIDE.get(signal)
        preset = {str(name): text for name, text in PRESETS[spec.engine].items()}
        template = (getattr(spec.metrics.queries, field) if field else None) or preset.get(signal) or ""
    return "$pods" in template or "${pods}" in template


def escape_string(value: str) -> str:
    """A PromQL double-quoted string literal's content."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_regex(value: str) -> str:
    """RE2-escape, so the value matches itself literally inside `=~`."""
    return re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\1", value)


# QueryOverrides' field per signal: its wire alias is the signal's name.
SIGNAL_FIELD_OVERRIDE: dict[str, str] = {info.alias or name: name for name, info in QueryOverrides.model_fields.items()}


@dataclass(frozen=True)
class QueryPlan:
    """The queries of one pass, and which signals the pool cannot have."""

    queries: dict[SignalName, str]
    unsupported: tuple[SignalName, ...]
    filters_pods_client_side: bool
    freshness: str | None = None
    """`timestamp()` of a gauge per pod; None for engines without a preset (custom)."""


def build_queries(
    spec: InferencePoolSpec,
    namespace: str,
    pod_names: list[str],
    namespace_wide: bool = False,
    by_pod: bool | None = None,
) -> QueryPlan:
    """One PromQL query per supported signal for the whole pool, overrides first, names escaped.

    `namespace_wide`: select by namespace (and extra labels) only, whatever the pool's size, so every pool of a
    namespace with the same metrics settings renders the same query and one answer serves them all (the caller
    keeps each pool's pods). A user template that uses `$pods` stays the pool's own.
    `by_pod`: select the given pods by name whatever their number (True), or by namespace only (False); by
    default by name up to `POD_REGEX_LIMIT` pods unless `namespace_wide`. A replica that owns some of a
    namespace's pools asks for the pods of its own pools (`PromIO(scoped=True)`).
    """
    if by_pod is None:
        by_pod = len(pod_names) <= POD_REGEX_LIMIT and not namespace_wide
    values = _values(spec, namespace, pod_names, by_pod)
    preset = PRESETS[spec.engine]
    queries: dict[SignalName, str] = {}
    unsupported: list[SignalName] = []
    for signal in ALL_SIGNALS:
        template = getattr(spec.metrics.queries, SIGNAL_FIELD_OVERRIDE[signal]) or preset.get(signal)
        if template is None:
            unsupported.append(signal)
            continue
        queries[signal] = Template(template).substitute(values)
    freshness = FRESHNESS.get(spec.engine)
    return QueryPlan(
        queries=queries,
        unsupported=tuple(unsupported),
        filters_pods_client_side=not by_pod,
        freshness=Template(freshness).substitute(values) if freshness else None,
    )


def _values(spec: InferencePoolSpec, namespace: str, pod_names: list[str], by_pod: bool) -> dict[str, str]:
    """The placeholders' values, escaped."""
    metrics = spec.metrics
    pods_regex = "|".join(escape_regex(name) for name in sorted(pod_names)) or "$^"
    matchers = [f'{metrics.namespace_label}="{escape_string(namespace)}"']
    if by_pod:
        matchers.append(f'{metrics.pod_label}=~"{escape_string(pods_regex)}"')
    matchers += [f'{key}="{escape_string(value)}"' for key, value in sorted(metrics.extra_labels.items())]
    return {
        "selector": ",".join(matchers),
        "namespace": escape_string(namespace),
        "pods": escape_string(pods_regex),
        "window": format_duration(metrics.window),
        "podLabel": metrics.pod_label,
        "servedModel": escape_string(metrics.triton.served_model),
        "backendModel": escape_string(metrics.triton.backend_model),
    }


def check_every(spec: InferencePoolSpec) -> float:
    """Seconds between two preflights of a namespace's series (the values themselves are read every pass): six
    passes, between 15 s and a minute."""
    return min(60.0, max(15.0, 6 * spec.interval))


@dataclass(frozen=True)
class CheckPlan:
    """The preflight's queries for a pool (namespace-wide, shared by the namespace's pools like the signals')."""

    series: dict[str, tuple[str, str]]
    """Series key -> (most raw series per pod sharing one identity, Unix time of the pod's newest sample)."""
    samples: str | None
    """Samples of the freshness gauge per pod within metrics.window."""


def preset_series(spec: InferencePoolSpec) -> dict[str, Series]:
    """Every raw series the pool's preset reads for the signals no override replaces, by key."""
    found: dict[str, Series] = {}
    for signal, reading in READINGS.get(spec.engine, {}).items():
        if not overridden(spec, signal):
            for series in reading.series:
                found.setdefault(series.key, series)
            if reading.unavailable_when is not None:  # asked too, to tell an older version from a missing series
                found.setdefault(reading.unavailable_when[0], Series(reading.unavailable_when[0], needed=False))
    return found


def check_queries(spec: InferencePoolSpec, namespace: str) -> CheckPlan:
    """The preflight's PromQL for the pool's namespace: per raw series the preset reads, the most series per
    pod that share the identity the preset expects (`count by (pod, <identity>)`: 1 unless duplicated) and the
    time of the pod's newest sample; the samples per rate window of the freshness gauge."""
    values = _values(spec, namespace, [], by_pod=False)
    queries: dict[str, tuple[str, str]] = {}
    for key, series in preset_series(spec).items():
        selected = f"{series.name}{{$selector{series.matchers}}}"
        by = ", ".join(("$podLabel", *series.identity))
        identity = f"max by ($podLabel) (count by ({by}) ({selected}))"
        newest = f"max by ($podLabel) (timestamp({selected}))"
        queries[key] = (Template(identity).substitute(values), Template(newest).substitute(values))
    # Prometheus' own `up` has a sample per scrape of each target, whatever the engine exports; the freshness
    # gauge answers where `up` is not kept (a federated or remote-written copy)
    freshness = (Series("up"), *FRESHNESS_SERIES.get(spec.engine, ()))
    samples = " or ".join(
        f"min by ($podLabel) (count_over_time({s.name}{{$selector{s.matchers}}}[$window]))" for s in freshness
    )
    return CheckPlan(queries, Template(samples).substitute(values) if samples else None)
