"""`spec.metrics`: where and how a pool's signals are read: Prometheus, its credentials, the per-signal PromQL
overrides (their placeholders checked) and the models the Triton preset reads.
"""

from __future__ import annotations

import re
from typing import Annotated, ClassVar

from pydantic import Field

from sluice.api.base import MAX_LABELS, MAX_QUERY_LENGTH, PROM_LABEL_NAME, QUERY_PLACEHOLDERS, ApiModel
from sluice.api.durations import Duration
from sluice.api.rules import Rule, cel_string, positive_duration


class SecretKeyRef(ApiModel):
    name: str = Field(min_length=1, description="Name of a Secret in the pool's namespace.")
    key: str = Field(min_length=1, description="Key inside the Secret.")


class MetricsAuth(ApiModel):
    bearer_token_secret_ref: SecretKeyRef | None = Field(
        default=None, description="Secret key holding a bearer token sent to Prometheus."
    )
    ca_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding a PEM CA bundle used to verify Prometheus' TLS certificate.",
    )
    insecure_skip_verify: bool = Field(
        default=False, description="Skip TLS verification of Prometheus. For test clusters only."
    )


_PLACEHOLDER_RE = "[$][A-Za-z_][A-Za-z0-9_]*"
_UNKNOWN_PLACEHOLDER = "unknown placeholder: use $selector, $namespace, $pods, $window or $podLabel"


def _known_placeholders(query: str) -> bool:
    names = {found[1:] for found in re.findall(_PLACEHOLDER_RE, query)}
    return "${" not in query and names <= QUERY_PLACEHOLDERS


def _placeholder_rule(field: str) -> Rule:
    known = ", ".join(f"'${name}'" for name in sorted(QUERY_PLACEHOLDERS))
    return Rule(
        cel=f"!self.contains('${{') && self.findAll('{_PLACEHOLDER_RE}').all(p, p in [{known}])",
        message=_UNKNOWN_PLACEHOLDER,
        check=_known_placeholders,
        on=field,
    )


Query = Annotated[str, Field(min_length=1, max_length=MAX_QUERY_LENGTH)]
"""A PromQL query with its placeholders (`$selector`, ...)."""


class QueryOverrides(ApiModel):
    """Per-signal PromQL that replaces the engine preset's query.

    A query must return an instant vector with one series per pod, carrying the pod label named by
    `spec.metrics.podLabel`. `$selector`, `$namespace`, `$pods`, `$window` and `$podLabel` are substituted (escaped).
    """

    rules: ClassVar[tuple[Rule, ...]] = tuple(
        _placeholder_rule(field)
        for field in (
            "ttft",
            "ttft_p95",
            "kv_cache_usage",
            "queue_length",
            "running_requests",
            "request_rate",
            "error_rate",
            "lora_failure_rate",
            "sleeping",
            "refused_rate",
        )
    )

    ttft: Query | None = Field(default=None, description="Mean time to first token over the window, seconds.")
    ttft_p95: Query | None = Field(default=None, description="95th percentile time to first token, seconds.")
    kv_cache_usage: Query | None = Field(default=None, description="KV-cache (effective VRAM) usage, 0 to 1.")
    queue_length: Query | None = Field(default=None, description="Requests waiting for a batch slot.")
    running_requests: Query | None = Field(default=None, description="Requests being processed.")
    request_rate: Query | None = Field(default=None, description="Finished requests per second.")
    error_rate: Query | None = Field(default=None, description="Share of requests that failed, 0 to 1.")
    lora_failure_rate: Query | None = Field(
        default=None,
        description="Share of LoRA adapter loads that failed, 0 to 1 (vLLM and SGLang: 5xx answers of their load "
        "endpoint).",
    )
    sleeping: Query | None = Field(
        default=None,
        description="1 while the engine is asleep (vLLM sleep mode), 0 while awake: a sleeping pod is not routed. "
        "Optional: a pod without it is taken as awake.",
    )
    refused_rate: Query | None = Field(
        default=None,
        description="Requests per second the pod's sidecar refused, read only under admission.mode Enforce (by "
        "default Istio's istio_requests_total with reporter destination and response flag UO or RL; extraLabels "
        "apply to it too, so name labels the scrape adds, such as job, not an engine's). Optional: a pod without "
        "it has its refusals unknown, never 0; its query failing freezes no weight (it feeds the status only).",
    )


class TritonMetrics(ApiModel):
    """Which Triton models the `triton` preset reads (Triton labels every series with `model` and `version`)."""

    served_model: str = Field(
        default="ensemble",
        min_length=1,
        max_length=253,
        description="The model clients call: its nv_inference_* series give TTFT, request and error rates. An "
        "ensemble's composing models count each request again, so only the served model's series are read.",
    )
    backend_model: str = Field(
        default="tensorrt_llm",
        min_length=1,
        max_length=253,
        description="The TensorRT-LLM backend model: its nv_trt_llm_* gauges give KV-cache usage, queue and running "
        "requests.",
    )


class MetricsSpec(ApiModel):
    rules: ClassVar[tuple[Rule, ...]] = (
        positive_duration("window"),
        positive_duration("timeout"),
        positive_duration("stale_after"),
        Rule(
            cel=f"self.all(k, k.matches({cel_string(PROM_LABEL_NAME)}))",
            message="extraLabels keys must be Prometheus label names: letters, digits and '_', "
            "not starting with a digit",
            check=lambda labels: all(re.fullmatch(PROM_LABEL_NAME, key) for key in labels),
            on="extra_labels",
        ),
    )

    prometheus_url: str = Field(
        default="http://prometheus.monitoring.svc:9090",
        pattern=r"^https?://",
        description="Base URL of the Prometheus HTTP API that scrapes the pool's pods.",
    )
    auth: MetricsAuth | None = Field(default=None, description="Credentials for Prometheus.")
    window: Duration = Field(default=60.0, description="Window for rates and quantiles, e.g. 1m.")
    timeout: Duration = Field(default=5.0, description="Timeout of one Prometheus query.")
    stale_after: Duration = Field(
        default=60.0,
        description="Signals older than this are stale: weights are frozen (fail-static) and the pool says so.",
    )
    pod_label: str = Field(default="pod", pattern=PROM_LABEL_NAME, description="Prometheus label holding the pod name.")
    namespace_label: str = Field(
        default="namespace", pattern=PROM_LABEL_NAME, description="Prometheus label holding the namespace."
    )
    extra_labels: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_LABELS,
        description="Extra equality label matchers added to every preset query, e.g. {job: vllm}.",
    )
    queries: QueryOverrides = Field(
        default_factory=QueryOverrides, description="Per-signal PromQL overrides of the engine preset."
    )
    triton: TritonMetrics = Field(
        default_factory=TritonMetrics, description="engine triton: the served and the backend model."
    )
