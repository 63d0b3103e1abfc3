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
from dataclasses import dataclass
from string import Template

from sluice.api.durations import format_duration
from sluice.api.v1alpha1 import Engine, InferencePoolSpec, QueryOverrides
from sluice.core.observed import ALL_SIGNALS, SignalName

# Above this many pods the query selects by namespace only and the caller keeps the pool's pods: a regex of
# thousands of names makes a request line Prometheus may refuse.
POD_REGEX_LIMIT = 200


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


def _mean_of_histogram(name: str, scale: str = "") -> str:
    return (
        f"sum by ($podLabel) (rate({name}_sum{{$selector}}[$window])) / "
        f"sum by ($podLabel) (rate({name}_count{{$selector}}[$window])){scale}"
    )


def _p95_of_histogram(name: str, scale: str = "") -> str:
    return f"histogram_quantile(0.95, sum by ($podLabel, le) (rate({name}_bucket{{$selector}}[$window]))){scale}"


def _rate(name: str, extra: str = "") -> str:
    return f"sum by ($podLabel) (rate({name}{{$selector{extra}}}[$window]))"


_MESH_ERRORS = _ratio(
    _rate("istio_requests_total", ',reporter="destination",response_code=~"5.."'),
    _rate("istio_requests_total", ',reporter="destination"'),
)

PRESETS: dict[Engine, dict[SignalName, str]] = {
    "vllm": {
        "ttft": _mean_of_histogram("vllm:time_to_first_token_seconds"),
        "ttftP95": _p95_of_histogram("vllm:time_to_first_token_seconds"),
        # vLLM renamed the gauge in 0.9 and stopped emitting the old name by default; accept either.
        "kvCacheUsage": "max by ($podLabel) (vllm:kv_cache_usage_perc{$selector}) "
        "or max by ($podLabel) (vllm:gpu_cache_usage_perc{$selector})",
        "queueLength": "sum by ($podLabel) (vllm:num_requests_waiting{$selector})",
        "runningRequests": "sum by ($podLabel) (vllm:num_requests_running{$selector})",
        "requestRate": _rate("vllm:request_success_total"),
        # Two views of failure, the worse one counts: HTTP 5xx answers of the OpenAI server (vLLM instruments it
        # with prometheus-fastapi-instrumentator, statuses grouped as "5xx"; a request refused or crashed before
        # the engine finished it appears only here), and requests the engine finished with reason "error" (a
        # stream that fails after its 200 header appears only there).
        "errorRate": _worst_of(
            _ratio(
                _rate("http_requests_total", ',handler=~"/v1/.+",status="5xx"'),
                _rate("http_requests_total", ',handler=~"/v1/.+"'),
            ),
            _ratio(
                _rate("vllm:request_success_total", ',finished_reason="error"'),
                _rate("vllm:request_success_total"),
            ),
        ),
    },
    "sglang": {
        "ttft": _mean_of_histogram("sglang:time_to_first_token_seconds"),
        "ttftP95": _p95_of_histogram("sglang:time_to_first_token_seconds"),
        "kvCacheUsage": "max by ($podLabel) (sglang:token_usage{$selector})",
        "queueLength": "sum by ($podLabel) (sglang:num_queue_reqs{$selector})",
        "runningRequests": "sum by ($podLabel) (sglang:num_running_reqs{$selector})",
        "requestRate": _rate("sglang:num_requests_total"),
        # SGLang counts aborts (client cancels included), not errors: use the mesh's 5xx count instead.
        "errorRate": _MESH_ERRORS,
    },
    "trtllm": {
        "ttft": _mean_of_histogram("trtllm_time_to_first_token_seconds"),
        "ttftP95": _p95_of_histogram("trtllm_time_to_first_token_seconds"),
        "kvCacheUsage": "max by ($podLabel) (trtllm_kv_cache_utilization{$selector})",
        "queueLength": "sum by ($podLabel) (trtllm_num_requests_waiting{$selector})",
        "runningRequests": "sum by ($podLabel) (trtllm_num_requests_running{$selector})",
        "requestRate": _rate("trtllm_request_success_total"),
        "errorRate": _ratio(
            _rate("trtllm_request_error_total"),
            _all_requests(_rate("trtllm_request_success_total"), _rate("trtllm_request_error_total")),
        ),
    },
    "triton": {
        # Only with `--metrics-config histogram_latencies=true`; otherwise the series is absent and the pool
        # reports TTFT as missing rather than reading it as 0.
        "ttft": _mean_of_histogram("nv_inference_first_response_histogram_ms", " / 1000"),
        "ttftP95": _p95_of_histogram("nv_inference_first_response_histogram_ms", " / 1000"),
        "kvCacheUsage": "max by ($podLabel) "
        '(nv_trt_llm_kv_cache_block_metrics{$selector,kv_cache_block_type="fraction"})',
        "queueLength": 'sum by ($podLabel) (nv_trt_llm_request_metrics{$selector,request_type="waiting"})',
        "runningRequests": 'sum by ($podLabel) (nv_trt_llm_request_metrics{$selector,request_type="active"})',
        "requestRate": _rate("nv_inference_request_success"),
        "errorRate": _ratio(
            _rate("nv_inference_request_failure"),
            _all_requests(_rate("nv_inference_request_success"), _rate("nv_inference_request_failure")),
        ),
    },
    "tgi": {
        # TGI exports no TTFT histogram and no KV-cache gauge.
        "queueLength": "sum by ($podLabel) (tgi_queue_size{$selector})",
        "runningRequests": "sum by ($podLabel) (tgi_batch_current_size{$selector})",
        "requestRate": _rate("tgi_request_success"),
        "errorRate": _ratio(
            _rate("tgi_request_failure"), _all_requests(_rate("tgi_request_success"), _rate("tgi_request_failure"))
        ),
    },
    "custom": {},
}


# One gauge per engine that every live server exports on every scrape: `timestamp()` of it is the time of the
# pod's newest sample, the evidence that signals are fresh (rates and quantiles carry the query's time instead).
FRESHNESS: dict[Engine, str] = {
    "vllm": "max by ($podLabel) (timestamp(vllm:num_requests_running{$selector}))",
    "sglang": "max by ($podLabel) (timestamp(sglang:num_running_reqs{$selector}))",
    "trtllm": "max by ($podLabel) (timestamp(trtllm_num_requests_running{$selector}))",
    "triton": "max by ($podLabel) (timestamp(nv_trt_llm_request_metrics{$selector}))",
    "tgi": "max by ($podLabel) (timestamp(tgi_queue_size{$selector}))",
}


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
    metrics = spec.metrics
    pods_regex = "|".join(escape_regex(name) for name in sorted(pod_names)) or "$^"
    matchers = [f'{metrics.namespace_label}="{escape_string(namespace)}"']
    if by_pod is None:
        by_pod = len(pod_names) <= POD_REGEX_LIMIT and not namespace_wide
    if by_pod:
        matchers.append(f'{metrics.pod_label}=~"{escape_string(pods_regex)}"')
    matchers += [f'{key}="{escape_string(value)}"' for key, value in sorted(metrics.extra_labels.items())]
    values = {
        "selector": ",".join(matchers),
        "namespace": escape_string(namespace),
        "pods": escape_string(pods_regex),
        "window": format_duration(metrics.window),
        "podLabel": metrics.pod_label,
    }
    preset = PRESETS[spec.engine]
    queries: dict[SignalName, str] = {}
    unsupported: list[SignalName] = []
    for signal in ALL_SIGNALS:
        template = getattr(metrics.queries, SIGNAL_FIELD_OVERRIDE[signal]) or preset.get(signal)
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
