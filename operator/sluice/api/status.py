"""The InferencePool status: what sluice observed and decided, written by the operator and read back.

The status is the controller's whole memory (incident times, ramps, canary steps), so it must parse leniently:
a status written by another version of sluice never stops the pool.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Literal

from pydantic import ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from sluice.api.base import ApiModel, CanaryPhase, CanaryStage, CheckResult, ConditionStatus, EndpointState


class StatusModel(ApiModel):
    """Status is written by sluice and read back; unknown fields from newer versions are ignored, not fatal."""

    model_config = ConfigDict(frozen=True, extra="ignore", alias_generator=to_camel, populate_by_name=True)


class Condition(StatusModel):
    """A metav1.Condition."""

    type: str = Field(description="Condition type, e.g. Ready, MetricsAvailable.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase machine-readable reason.")
    message: str = Field(default="", description="Human-readable explanation.")
    last_transition_time: datetime = Field(description="When status last changed.")
    observed_generation: int | None = Field(default=None, description="Spec generation this was computed for.")


class EndpointSignals(StatusModel):
    """Per-pod signals as read from Prometheus. A missing signal is null, never 0; NaN and infinities are refused."""

    model_config = ConfigDict(
        frozen=True, extra="ignore", alias_generator=to_camel, populate_by_name=True, allow_inf_nan=False
    )

    ttft_seconds: float | None = Field(default=None, description="Mean TTFT over the window, seconds.")
    ttft_p95_seconds: float | None = Field(default=None, description="TTFT 95th percentile, seconds.")
    kv_cache_usage: float | None = Field(default=None, description="KV-cache usage, 0 to 1.")
    queue_length: float | None = Field(default=None, description="Requests waiting.")
    running_requests: float | None = Field(default=None, description="Requests running.")
    request_rate: float | None = Field(default=None, description="Finished requests per second.")
    error_rate: float | None = Field(default=None, description="Failed share of requests, 0 to 1.")
    lora_failure_rate: float | None = Field(default=None, description="Failed share of LoRA loads, 0 to 1.")
    sleeping: float | None = Field(default=None, description="1 while the engine is asleep, 0 while awake.")
    refused_rate: float | None = Field(
        default=None,
        description="admission.mode Enforce: requests per second the pod's sidecar refused (its inbound limit's "
        "503s and the tenants' 429s: Istio's istio_requests_total with response flag UO or RL).",
    )


class EndpointStatus(StatusModel):
    """One pod: its signals, score, published weight, state and the reason for it."""

    pod: str = Field(description="Pod name.")
    ip: str | None = Field(default=None, description="Pod IP.")
    revision: str | None = Field(default=None, description="Value of the canary revision label.")
    hardware_class: str | None = Field(default=None, description="Value of the capacity class label.")
    capacity: float = Field(default=1.0, description="Capacity coefficient K used.")
    signals: EndpointSignals = Field(default_factory=EndpointSignals, description="Signals used this pass.")
    signals_sampled_at: datetime | None = Field(
        default=None,
        description="When the samples behind signals were scraped (engines with a freshness query): the next pass "
        "judges the errors that entered the rate window since (fast-zeroing of a fresh incident).",
    )
    score: float = Field(
        default=0.0,
        description="Smoothed score: cube, capacity / latency penalty x health; headroom, the capacity planned "
        "with (requests/s; while no pod of its revision shows load the weight follows the latency score the reason "
        "gives instead).",
    )
    weight: int = Field(default=0, description="Published endpoint weight; 0 means removed from routing.")
    state: EndpointState = Field(description="Routable, Zeroed or Recovering.")
    reason: str = Field(default="", description="Why the pod has this weight, in words.")
    since: datetime | None = Field(default=None, description="When the pod entered its state.")
    ttft_estimate_seconds: float | None = Field(
        default=None, description="Last known TTFT, used while data is missing."
    )
    idle_ttft_seconds: float | None = Field(
        default=None,
        description="scoring.policy headroom: the pod's learned idle TTFT (lowest seen, drifting up slowly), "
        "against which TTFT inflation reads its load.",
    )
    idle_ttft_samples: int | None = Field(
        default=None,
        ge=0,
        description="scoring.policy headroom: completions the idle TTFT rests on (its largest window, up to 30); "
        "below 30 it is provisional: a larger window's reading replaces it (upwards only from a window that showed "
        "no load), and TTFT inflation over it is not read as load.",
    )
    learned_capacity: float | None = Field(
        default=None,
        description="scoring.policy headroom: the capacity (requests/s) measured from the pod's own load, or "
        "probed up to while it carried most of what it was believed to take with no load shown (the reason says "
        "which), and remembered; absent while only a prior is known.",
    )
    saturated_batch: float | None = Field(
        default=None,
        description="admission: the requests the pod's engine holds at once when its KV cache is full (running "
        "requests / KV-cache usage, read while the cache is at least a quarter full, moved 0.3 of the way by each "
        "scrape and held between them); absent until one is read.",
    )
    inbound_limit: int | None = Field(
        default=None,
        description="admission: the requests the pod's sidecar lets through at once: admission.batchShare of its "
        "hardware class's median batch (of its own batch where it has no class label), moved only past 10 %; "
        "absent without a batch. Report: not enforced. Enforce: what its sidecar is given; absent for a pod the "
        "AdmissionEnforced condition names (no sidecar, no class label).",
    )
    limit_since: datetime | None = Field(
        default=None,
        description="admission: when the pod's inboundLimit was set; it moves no sooner than five of the pod's "
        "times in system after (running and waiting requests over the rate it finishes them), at least a minute "
        "and at most ten: a changed limit is a new Envoy cluster whose count starts from zero, letting a whole "
        "limit through on top of the requests in flight; absent without a limit.",
    )
    admission_share: float | None = Field(
        default=None,
        description="admission.ttftTarget: the share of its batch the pod's limit is, steered by its TTFT p95 "
        "(its class's limit takes the median of its pods' shares); absent without a target.",
    )
    rate_at_limit: float | None = Field(
        default=None,
        description="admission.tenants: the requests/s the pod serves with its inbound limit full: its served rate "
        "x its limit / its running requests (Little's law), read while it runs at least a fifth of its limit, moved "
        "0.3 of the way by each scrape and held between them; absent until one is read.",
    )
    rate_limit: float | None = Field(
        default=None,
        description="admission.tenants: the requests/s the pod's sidecar admits, split among the tenants by their "
        "percents: its hardware class's median rateAtLimit (its own where it has no class label), moved only past "
        "10 %; absent until read. Report: not enforced.",
    )
    consecutive_failures: int = Field(default=0, description="Passes in a row below every health band.")
    restarts: int = Field(default=0, description="Container restarts last seen.")
    last_incident_at: datetime | None = Field(default=None, description="Last zeroing incident.")
    incident: str | None = Field(default=None, description="Kind of the last incident, e.g. OOMKilled, ErrorRate.")
    incident_message: str | None = Field(default=None, description="The last incident, in words.")
    verdict: str | None = Field(
        default=None,
        description="What the pass concluded from the pod's evidence: scored, ramping, frozen (no fresh samples, "
        "last weight kept), awaiting (no samples yet), quiet (zeroed after an incident) or excluded (not routable).",
    )
    floor_held: bool = Field(
        default=False,
        description="sluice would zero this pod (or has no evidence for it) but protection.minRoutablePercent "
        "keeps it routable at minWeight.",
    )
    capacity_held: bool = Field(
        default=False,
        description="sluice would zero this pod after its incident (or keep it at its recovery ramp), but the other "
        "pods of its revision cannot take its share within scoring.targetUtilization: it keeps the share they "
        "cannot take (protection.zeroWhenOthersFull); the reason gives the figures.",
    )
    held_since: datetime | None = Field(
        default=None,
        description="When the pod's current hold (capacityHeld) began; it has been held on every pass since. A "
        "hold that began before the pod's last incident continues it: the pod has been read since.",
    )
    missing_signals: list[str] = Field(
        default_factory=list,
        description="Signals the engine provides that had no series for this pod this pass (never read as 0).",
    )
    class_known: bool = Field(
        default=True,
        description="False when capacity.classes is set and the pod's hardware class is missing from it "
        "(capacity.default is used).",
    )


class OperationRecord(StatusModel):
    """The last rollout operation (`sluice.dev/operation`) and what came of it."""

    id: str = Field(description="The operation's id: it is applied once.")
    op: str = Field(description="promote, abort, retry, pause, resume or skip-step.")
    by: str | None = Field(default=None, description="Who asked, as the client stated it.")
    at: datetime = Field(description="When sluice acted on it.")
    result: Literal["Applied", "Refused"] = Field(description="Applied, or Refused (the message says why).")
    forced: bool = Field(default=False, description="Analysis was skipped at the user's request.")
    message: str = Field(default="", description="What happened, in words.")


class CanaryStatus(StatusModel):
    phase: CanaryPhase = Field(description="Idle, Waiting, Shadow, Progressing, Paused, Promoted or RolledBack.")
    stage: CanaryStage = Field(
        default="Live",
        description="Shadow while the candidate gets mirrored traffic only (spec.canary.shadow), then Live (the "
        "steps). Paused, Waiting and RolledBack keep the stage they happened in.",
    )
    mirror_percent: float | None = Field(
        default=None,
        description="Share of requests mirrored to the candidate as rendered by this pass; null when it renders "
        "none. A pass with no routable pod in the whole pool writes nothing (the mesh is left as it is), so the route "
        "last written, with its mirror if it had one, stays in place until a pod is routable again.",
    )
    stable_revision: str | None = Field(default=None, description="Revision taking the remaining traffic.")
    candidate_revision: str | None = Field(default=None, description="Revision being rolled out.")
    step_index: int | None = Field(default=None, description="Index into spec.canary.steps.")
    weight: int = Field(default=0, description="Candidate traffic percentage now published (the real split).")
    step_weight: int | None = Field(
        default=None, description="Candidate percentage the current step asks for; differs from weight when forced."
    )
    capacity_held: str | None = Field(
        default=None,
        description="Why the published weight is below the step's (spec.canary.comparableLoad): the share the "
        "candidate's capacity carries at the stable revision's utilisation, or what it can carry of the pool.",
    )
    split_forced: str | None = Field(
        default=None, description="Why the published split differs from the step (no healthy pod on one side)."
    )
    failed_checks: int = Field(default=0, description="Failed checks at this rollout.")
    step_started_at: datetime | None = Field(default=None, description="When the current step began.")
    last_check_at: datetime | None = Field(default=None, description="When the last check ran.")
    last_check: CheckResult | None = Field(default=None, description="Pass, Fail or Inconclusive.")
    last_check_reason: str = Field(default="", description="Why the last check came out as it did.")
    message: str = Field(default="", description="What the rollout is doing, in words.")
    paused_by: str | None = Field(
        default=None, description="Set while a pause operation holds the rollout (spec.canary.paused also holds it)."
    )
    last_operation: OperationRecord | None = Field(default=None, description="The last rollout operation.")
    shadow_verdict: str | None = Field(
        default=None, description="How this rollout's shadow phase ended (passed, skipped, removed from the spec)."
    )
    header_routes: bool = Field(
        default=False,
        description="spec.canary.match's routes are rendered to the candidate (while the rollout is in flight and "
        "the candidate has a routable pod). Requests they carry are not counted apart: Istio's standard metrics "
        "(istio_requests_total) carry no route name and the engines' metrics no header, so the candidate's figures "
        "mix testers and its share of users; minRequests counts at most the share.",
    )
    ab_share: float | None = Field(
        default=None,
        description="A/B test: percent of keys the rendered bucket route sends to the candidate (exact for keys "
        "whose last two characters are uniform over keyAlphabet); absent while no such route is rendered.",
    )
    served_users: bool = Field(
        default=False,
        description="Sticky for the rollout: user requests have been routed to the candidate (a live step, or a "
        "split forced to it because the stable revision had no healthy pod). A shadow rollback says that no user "
        "request reached the candidate only while this is false.",
    )


class WeightBucket(StatusModel):
    """Pods whose published weight falls in [low, high]."""

    low: int = Field(description="Lowest weight of the bucket (inclusive).")
    high: int = Field(description="Highest weight of the bucket (inclusive).")
    pods: int = Field(description="Pods in the bucket.")


class EndpointSummary(StatusModel):
    """Counts over every pod of the pool, whether or not it has a row in `endpoints`."""

    pods: int = Field(default=0, description="Pods in the pool.")
    listed: int = Field(default=0, description="Pods with a row in endpoints.")
    aggregated: int = Field(
        default=0, description="Plainly Routable pods without a row (counted here; their memory is in podMemory)."
    )
    unlisted: int = Field(
        default=0,
        description="Pods that are not plainly Routable but have no row, because endpoints is capped "
        "(counted here; their memory is in podMemory).",
    )
    by_state: dict[str, int] = Field(default_factory=dict, description="Pods per state.")
    by_verdict: dict[str, int] = Field(default_factory=dict, description="Pods per verdict.")
    by_class: dict[str, int] = Field(default_factory=dict, description="Pods per hardware class ('-': no label).")
    by_revision: dict[str, int] = Field(default_factory=dict, description="Pods per revision ('-': no label).")
    weights: list[WeightBucket] = Field(
        default_factory=list, description="Histogram of published weights over the routable pods."
    )


SignalCheckState = Literal["Ok", "Missing", "Stale", "Duplicated", "OutOfRange", "NotProvided", "Failed"]


class SignalCheck(StatusModel):
    """One signal, checked against what Prometheus holds for the pool's pods (`kubectl sluice doctor`)."""

    signal: str = Field(description="The signal, e.g. kvCacheUsage.")
    state: SignalCheckState = Field(
        description="Ok; Missing (a series the preset reads has no sample for some pods); Stale (its newest sample "
        "is older than metrics.staleAfter); Duplicated (several raw series per pod where one is expected: the value "
        "is not used); OutOfRange (a value no engine can report, e.g. a KV ratio above 1: not used); NotProvided "
        "(the engine has no such metric and no query override supplies it); Failed (the check's query failed)."
    )
    series: list[str] = Field(default_factory=list, description="The metric names the preset reads for it.")
    pods_ok: int = Field(default=0, description="Pods for which the signal is fine.")
    pods_affected: int = Field(default=0, description="Pods in this state (when it is not Ok).")
    pods: list[str] = Field(default_factory=list, description="Some of the affected pods (at most 20).")
    oldest_sample_seconds: int | None = Field(
        default=None, description="Age of the oldest per-pod newest sample among its series, at the check."
    )
    message: str = Field(default="", description="What was found, naming series and labels.")
    fix: str | None = Field(default=None, description="The engine flag or scrape setting that produces the series.")


class SignalChecks(StatusModel):
    """The preflight: per signal, whether the series the engine preset reads exist for the pool's pods, how old
    they are, whether one raw series per pod answers where one is expected, and whether the scrape interval fits
    metrics.window. Checked about once a minute; values out of range are checked at every pass."""

    checked_at: datetime | None = Field(default=None, description="When Prometheus was asked.")
    engine: str = Field(default="", description="The engine preset checked.")
    samples_per_window: float | None = Field(
        default=None,
        description="Median over the pods of the samples one series has within metrics.window: rates need at "
        "least 2; 4 or more keep them steady (window >= 4 scrape intervals).",
    )
    message: str = Field(default="", description="The outcome in words (the SignalsReady condition's message).")
    pods_without_series: int = Field(
        default=0,
        description="Ready pods with no series at all of the preset's: Prometheus does not scrape them (yet), or "
        "metrics.podLabel / namespaceLabel do not name them. The signals' checks are over the other pods.",
    )
    unscraped: list[str] = Field(default_factory=list, description="Some of those pods (at most 20).")
    signals: list[SignalCheck] = Field(default_factory=list, description="One entry per signal.")


DataplaneMode = Literal["sidecar", "ambient", "ambient-waypoint", "unknown"]


class MeshStatus(StatusModel):
    """Which proxies the pool's Istio objects reach, as read from its Service, namespace and client Sidecars."""

    dataplane: DataplaneMode = Field(
        default="unknown",
        description="sidecar: the pool's namespace is not ambient; ambient: ztunnel only (sluice's routing reaches "
        "sidecar and gateway clients, not ambient ones); ambient-waypoint: the Service uses a waypoint, which gets "
        "the VirtualService and the ServiceEntry; unknown: the mesh side was not read.",
    )
    waypoint: str | None = Field(default=None, description="The waypoint the Service uses (istio.io/use-waypoint).")
    service_port: str | None = Field(
        default=None, description="The Service port clients call, as '<name or number>/<Istio protocol>'."
    )
    protocol: str | None = Field(default=None, description="The ServiceEntry port's protocol sluice renders.")
    export_to: list[str] = Field(
        default_factory=list, description="exportTo on every object sluice writes: which namespaces see them."
    )
    envoy_filter_namespaces: list[str] = Field(
        default_factory=list,
        description="Where the pool's EnvoyFilters are written (they reach the proxies of these namespaces; the "
        "root namespace reaches every proxy); empty when none is rendered. A pass that writes nothing (no routable "
        "pod, or the mesh refused) keeps the namespaces of the last pass that did.",
    )
    findings: list[str] = Field(
        default_factory=list, description="What in the mesh keeps some clients from sluice's routing, in words."
    )


class AdmissionStatus(StatusModel):
    """admission.mode Enforce: what the sidecars sluice configures (pods with a sidecar and a class label) refused
    and what their engines served, over metrics.window."""

    refused_rate: float | None = Field(
        default=None,
        description="Requests/s those sidecars refused (their inbound limits' 503s and the tenants' 429s: Istio's "
        "istio_requests_total, reporter destination, response flag UO or RL); absent while one of them has no "
        "count (named in uncounted).",
    )
    served_rate: float | None = Field(
        default=None,
        description="Requests/s the engines behind those sidecars finished (their requestRate); absent while one "
        "is unread.",
    )
    refused_share: float | None = Field(
        default=None, description="refusedRate / (refusedRate + servedRate), 0 to 1; absent without both."
    )
    uncounted: list[str] = Field(
        default_factory=list,
        description="Configured sidecars whose refusals were not read while their engines show traffic (no "
        "istio_requests_total for the pod: metrics merging off or not scraped; its value refused as duplicated, "
        "e.g. scraped both merged and from envoy-stats; or the query failed); at most 20 named. A pod that has "
        "answered nothing yet has no series and counts as refusing none.",
    )


class InferencePoolStatus(StatusModel):
    observed_generation: int | None = Field(default=None, description="Spec generation last reconciled.")
    conditions: list[Condition] = Field(default_factory=list, description="metav1.Condition list.")
    routable: str = Field(default="0/0", description="Routable pods / ready pods, for kubectl get.")
    revision_weights: dict[str, int] = Field(default_factory=dict, description="Published traffic % per revision.")
    canary: CanaryStatus | None = Field(default=None, description="Rollout progress.")
    endpoints: list[EndpointStatus] = Field(
        default_factory=list,
        description="One row per pod for pools of up to 64 pods. Larger pools: a row for every pod that is not "
        "plainly Routable (any other state or verdict, floor-held, failing bands, missing signals, unknown class; "
        "at most 256 rows) plus a sample of the lowest and highest weights; the other pods are counted in "
        "endpointSummary. `kubectl sluice plan` and the operator's metrics show every pod.",
    )
    endpoint_summary: EndpointSummary | None = Field(
        default=None, description="Counts over every pod; set when endpoints does not list every pod."
    )
    mesh: MeshStatus | None = Field(
        default=None, description="Which proxies the pool's routing reaches (the MeshReach condition's findings)."
    )
    admission: AdmissionStatus | None = Field(
        default=None,
        description="admission.mode Enforce: the pool's refused and served rates (the Shedding condition judges by "
        "them).",
    )
    signal_checks: SignalChecks | None = Field(
        default=None,
        description="The preflight of the pool's signals (`kubectl sluice doctor POOL` prints it); the SignalsReady "
        "condition sums it up.",
    )
    pod_memory: str | None = Field(
        default=None,
        description="What the next pass needs of the pods without a row (weight, score, state, since, TTFT "
        "estimate, restarts, incident), zlib-compressed JSON in base64; internal, read back by sluice only.",
    )
    last_reconcile_time: datetime | None = Field(
        default=None,
        description="When the pass this status shows ran. A pass whose decisions (weights, states, the split, "
        "conditions) change the status writes it; one whose observations alone moved (signals, scores, reasons) "
        "waits until the stored status is the operator's --status-refresh old (30 s by default), an unchanged one "
        "60 s (or the refresh, if longer). The operator's sluice_last_pass_timestamp_seconds has every pass.",
    )


def read_status(raw: Mapping[str, object] | None) -> tuple[InferencePoolStatus | None, list[str]]:
    """Parse a stored status, dropping (and reporting) the parts this version cannot read."""
    if not raw:
        return None, []
    try:
        return InferencePoolStatus.model_validate(raw), []
    except ValidationError:
        pass
    problems: list[str] = []
    kept: dict[str, object] = {}
    for key, value in raw.items():
        if key in ("conditions", "endpoints"):
            model = Condition if key == "conditions" else EndpointStatus
            items = []
            for item in value if isinstance(value, list) else []:
                try:
                    items.append(model.model_validate(item))
                except ValidationError as failure:
                    problems.append(f"{key}: dropped an unreadable entry ({_first_error(failure)})")
            kept[key] = items
            continue
        try:
            InferencePoolStatus.model_validate({key: value})
            kept[key] = value
        except ValidationError as failure:
            problems.append(f"{key}: dropped ({_first_error(failure)})")
    return InferencePoolStatus.model_validate(kept), problems


def _first_error(failure: ValidationError) -> str:
    error = failure.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    return f"{where}: {error['msg']}" if where else error["msg"]
