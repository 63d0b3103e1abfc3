"""What one reconcile pass observed: the pool's pods (from the Kubernetes API) and their signals (from Prometheus).

Built by the I/O shell (or read from an OBSERVED file by `sluice plan`) and handed to the pure core. A signal that
was not observed is `None`; a query that failed is listed in `SignalSnapshot.failed`. Nothing here defaults a
missing value to 0.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal, get_args

from pydantic import Field

from sluice.api.v1alpha1 import ApiModel, EndpointSignals

SignalName = Literal[
    "ttft",
    "ttftP95",
    "kvCacheUsage",
    "queueLength",
    "runningRequests",
    "requestRate",
    "errorRate",
    "loraFailureRate",
    "sleeping",
    "refusedRate",
]
ALL_SIGNALS: tuple[SignalName, ...] = get_args(SignalName)
SIGNAL_FIELD: dict[SignalName, str] = {
    "ttft": "ttft_seconds",
    "ttftP95": "ttft_p95_seconds",
    "kvCacheUsage": "kv_cache_usage",
    "queueLength": "queue_length",
    "runningRequests": "running_requests",
    "requestRate": "request_rate",
    "errorRate": "error_rate",
    "loraFailureRate": "lora_failure_rate",
    "sleeping": "sleeping",
    "refusedRate": "refused_rate",
}

PodSignals = EndpointSignals


class ObservedPod(ApiModel):
    """A pod as the Kubernetes API reports it."""

    name: str = Field(description="Pod name.")
    ip: str | None = Field(default=None, description="Pod IP; a pod without one cannot be routed to.")
    labels: dict[str, str] = Field(default_factory=dict, description="Pod labels.")
    ready: bool = Field(default=True, description="The Ready condition.")
    deleting: bool = Field(default=False, description="deletionTimestamp is set.")
    restarts: int = Field(default=0, ge=0, description="Sum of container restart counts.")
    last_termination_reason: str | None = Field(
        default=None, description="lastState.terminated.reason of the most recently restarted container."
    )
    service_account: str | None = Field(
        default=None, description="spec.serviceAccountName: the pod's mesh identity (SPIFFE ID) for mTLS."
    )


class SeriesAnswer(ApiModel):
    """What Prometheus holds of one raw series the preset reads, for the pool's pods (the preflight)."""

    name: str = Field(description="The metric name, as the preset reads it.")
    per_identity: dict[str, float] = Field(
        default_factory=dict,
        description="Pod -> the most raw series sharing one identity (the engine labels the preset tells apart): 1 "
        "as expected; more when the pod is scraped twice or a label the preset does not expect splits it.",
    )
    newest: dict[str, float] = Field(
        default_factory=dict,
        description="Pod -> its newest sample's time less the query's evaluation time, on Prometheus' clock (<= 0).",
    )
    failed: str | None = Field(default=None, description="Why a check query failed.")


class CheckAnswers(ApiModel):
    """The preflight's raw answers: one per series the preset reads, and the samples per window."""

    asked_at: datetime = Field(description="When the check queries were asked.")
    series: list[SeriesAnswer] = Field(default_factory=list, description="One per raw series.")
    samples_per_window: dict[str, float] = Field(
        default_factory=dict,
        description="Pod -> scrapes within metrics.window (Prometheus' `up`, else the freshness gauge).",
    )
    failed: str | None = Field(default=None, description="Why the samples-per-window query failed.")


class SignalSnapshot(ApiModel):
    """The pool's signals from one round of Prometheus queries."""

    collected_at: datetime | None = Field(default=None, description="When the queries were answered.")
    failed: dict[str, str] = Field(default_factory=dict, description="Signal name -> why its query failed.")
    unsupported: list[str] = Field(
        default_factory=list, description="Signals the engine cannot provide (and no override supplies)."
    )
    pods: dict[str, PodSignals] = Field(default_factory=dict, description="Pod name -> its signals.")
    sampled_at: dict[str, datetime] = Field(
        default_factory=dict,
        description="Pod name -> timestamp of its newest scraped sample (Prometheus `timestamp()`), the evidence of "
        "freshness; a pod absent here while the engine has a freshness query has no fresh samples.",
    )
    freshness_known: bool = Field(
        default=False,
        description="Whether sampledAt was measured (the engine preset has a freshness query). Without it, "
        "freshness falls back to collectedAt, the time the queries were answered.",
    )
    answered_at: dict[str, datetime] = Field(
        default_factory=dict,
        description="Signal name -> when the answer read for it was asked (a shared or fallback answer is older "
        "than the pass).",
    )
    checks: CheckAnswers | None = Field(
        default=None, description="The preflight's answers (asked about once a minute); None: not asked."
    )
    repeated: bool = Field(
        default=False,
        description="The error-rate answer is the one the pool's previous pass read (asked at the same time: a "
        "shared or fallback answer while Prometheus is slow or failing). Still evidence, but not a new "
        "observation: it does not count again towards passes in a row below every band. Set by the operator.",
    )


class ServicePort(ApiModel):
    """One port of the Kubernetes Service, as its spec.ports entry has it."""

    port: int = Field(ge=1, le=65535, description="The port clients call.")
    name: str | None = Field(default=None, description="The port's name (Istio reads a protocol prefix from it).")
    app_protocol: str | None = Field(default=None, description="spec.ports[].appProtocol (wins over the name).")
    protocol: str = Field(default="TCP", description="The L4 protocol: TCP, UDP or SCTP.")
    target_port: int | str | None = Field(default=None, description="The pods' port, a number or a port name.")


class ObservedService(ApiModel):
    """The pool's Kubernetes Service: its ports and the labels and annotations Istio reads from it."""

    name: str = Field(description="The Service's name.")
    ports: list[ServicePort] = Field(default_factory=list, description="spec.ports.")
    labels: dict[str, str] = Field(default_factory=dict, description="metadata.labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="metadata.annotations.")


class ObservedSidecar(ApiModel):
    """An Istio `Sidecar` in a client namespace: its egress hosts decide what its proxies see."""

    namespace: str = Field(description="Its namespace.")
    name: str = Field(description="Its name.")
    selects_workloads: bool = Field(
        default=False, description="It has a workloadSelector (applies to some pods of its namespace only)."
    )
    egress_hosts: list[list[str]] | None = Field(
        default=None, description="The hosts of each egress listener; None: no egress section (everything seen)."
    )


class ObservedMesh(ApiModel):
    """What the mesh side of the cluster says about the pool: its Service, its namespace, client Sidecars."""

    service: ObservedService | None = Field(default=None, description="The Service; None when it does not exist.")
    namespace_labels: dict[str, str] = Field(default_factory=dict, description="The pool namespace's labels.")
    sidecars: list[ObservedSidecar] = Field(
        default_factory=list, description="Sidecar resources in the namespaces of the pool's clients."
    )
    failed: str | None = Field(default=None, description="Why the mesh side could not be read (then not judged).")


class Observed(ApiModel):
    """Input of one pass; also the format of `sluice plan --observed`."""

    pods: list[ObservedPod] = Field(default_factory=list, description="Pods matching the pool's selector.")
    signals: SignalSnapshot = Field(default_factory=SignalSnapshot, description="Signals per pod.")
    mesh: ObservedMesh | None = Field(
        default=None,
        description="The pool's Service, namespace and client Sidecars; None: not observed (the Service's port "
        "is taken as HTTP and exported everywhere, and status.mesh says it was not checked).",
    )
