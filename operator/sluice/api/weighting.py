"""`spec.capacity`, `spec.scoring` and `spec.protection`: how signals become weights (capacity per hardware
class, the scoring policy and its coefficients) and how a pod loses its weight (fast zeroing, health bands,
recovery, outlier detection, the floor).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from sluice.api.base import LABEL_KEY, LABEL_VALUE, LABEL_VALUE_MAX_LENGTH, MAX_LABELS, ApiModel, is_label_value
from sluice.api.durations import Duration
from sluice.api.rollout import HEADER_NAME
from sluice.api.rules import Rule, cel_string, positive_duration

ScoringPolicy = Literal["headroom", "cube"]


class CapacitySpec(ApiModel):
    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.all(k, self[k] > 0.0)",
            message="capacity coefficients must be > 0",
            check=lambda classes: all(k > 0 for k in classes.values()),
            on="classes",
        ),
        Rule(
            cel=f"self.all(k, size(k) <= {LABEL_VALUE_MAX_LENGTH} && k.matches({cel_string(LABEL_VALUE)}))",
            message="hardware classes must be label values: at most 63 alphanumeric characters, '-', '_' or '.', "
            "starting and ending with an alphanumeric character",
            check=lambda classes: all(is_label_value(name) for name in classes),
            on="classes",
        ),
    )

    class_label: str = Field(
        default="sluice.dev/hardware-class",
        pattern=LABEL_KEY,
        description="Pod label naming the pod's hardware class (e.g. a100, rtx4090, cpu).",
    )
    classes: dict[str, float] = Field(
        default_factory=dict,
        max_length=MAX_LABELS,
        description="Capacity coefficient K per hardware class, e.g. {a100: 10, rtx4090: 4, cpu: 1}.",
    )
    default: float = Field(default=1.0, gt=0, description="K for pods whose class is missing or not listed.")


class ScoringSpec(ApiModel):
    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.minWeight <= self.maxWeight",
            message="minWeight must not exceed maxWeight",
            check=lambda scoring: scoring.min_weight <= scoring.max_weight,
            field_path=".minWeight",
        ),
        Rule(
            cel="duration(self.ttftFloor) <= duration(self.ttftBaseline)",
            message="ttftFloor must not exceed ttftBaseline",
            check=lambda scoring: scoring.ttft_floor <= scoring.ttft_baseline,
            field_path=".ttftFloor",
        ),
        # The penalty divides by the baseline and by the (floored) TTFT: zero would divide by zero.
        positive_duration("ttft_baseline"),
        positive_duration("ttft_floor"),
        positive_duration("default_ttft"),
        positive_duration("ttft_timeout"),
    )

    alpha: float = Field(
        default=0.7,
        ge=0,
        le=1,
        description="Weight of latency in the penalty alpha*TTFT/baseline + (1-alpha). 0 ignores TTFT.",
    )
    ttft_baseline: Duration = Field(default=0.1, description="TTFT that counts as normal (T_base).")
    default_ttft: Duration = Field(default=0.1, description="TTFT assumed for a pod before it has any data.")
    ttft_floor: Duration = Field(
        default=0.01, description="Lower bound on TTFT, so an idle pod cannot score infinitely."
    )
    ttft_timeout: Duration | None = Field(
        default=None,
        description="A pod whose TTFT exceeds this is judged on latency alone (alpha raised to 1) until it recovers.",
    )
    kv_cache_coefficient: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="Share of a pod's weight KV-cache pressure can remove (0 disables).",
    )
    kv_cache_threshold: float = Field(
        default=0.7, ge=0, lt=1, description="KV-cache usage above which pressure starts counting."
    )
    queue_coefficient: float = Field(
        default=0.5, ge=0, le=1, description="Share of a pod's weight queueing can remove (0 disables)."
    )
    queue_reference: float = Field(
        default=8.0, gt=0, description="Waiting requests at which the queue signal halves its score."
    )
    smoothing: float = Field(
        default=0.3,
        ge=0,
        lt=1,
        description="Share of the previous score kept each pass (EWMA), damping oscillation.",
    )
    sharpness: float = Field(
        default=3.0,
        ge=1,
        le=4,
        description="cube: exponent applied to scores before they become weights. Envoy's weighted least-request "
        "shares traffic in proportion to weight/(active+1); above 1 it keeps slow pods nearly idle until faster ones "
        "fill up. 1 makes weights proportional to scores. Not used by the headroom policy.",
    )
    policy: ScoringPolicy = Field(
        default="headroom",
        description="How weights are set. headroom: each pod's capacity is learned from its rate, TTFT inflation "
        "and queue (capacity.classes is the prior), the pool's observed request rate is water-filled over the pods "
        "(fastest first, spilling over as they fill) and the shares become weights for Envoy's least-request. "
        "cube: (K / latency penalty)^sharpness x signal factors, ranking pods without modelling their headroom.",
    )
    target_utilization: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="headroom: the highest share of its learned capacity planned on a pod while the pool has "
        "headroom elsewhere (a margin for 15-30 s old signals); past it on every pod, shares follow capacity.",
    )
    client_sidecars: float = Field(
        default=8.0,
        ge=1,
        le=100000,
        description="headroom: roughly how many client sidecars send to the pool. Envoy divides a weight by "
        "(active + 1) per sidecar, and a sidecar's active count is the pod's in-flight requests over this; "
        "weights are raised by that factor so each pod gets its planned share. Set it to the number of client Envoy "
        "sidecars (calling pods plus gateways): the default 8 is the benchmark's count, not a property of the mesh. "
        "No effect with routing.sessionAffinity (consistent hash weighs proportionally).",
    )
    hysteresis_percent: float = Field(
        default=10.0,
        ge=0,
        le=100,
        description="Weight changes smaller than this percentage are not published.",
    )
    min_weight: int = Field(default=1, ge=1, le=100000, description="Smallest weight of a routable pod.")
    max_weight: int = Field(
        default=1000, ge=1, le=100000, description="Weight of the best pod; others scale below (resolution)."
    )


class HealthBand(ApiModel):
    """A pod whose error rate (and TTFT p95, if set) is within the limits keeps weightPercent of its weight."""

    max_error_rate: float = Field(ge=0, le=1, description="Highest error rate (0 to 1) inside this band.")
    max_ttft_p95: Duration | None = Field(default=None, description="Highest TTFT p95 inside this band, if any.")
    weight_percent: float = Field(gt=0, le=100, description="Share of its scored weight a pod in this band keeps.")


def _default_bands() -> list[HealthBand]:
    # On errors only by default: TTFT already shapes the score, and an absolute TTFT band would permanently
    # penalise slower hardware classes.
    return [
        HealthBand(max_error_rate=0.005, weight_percent=100),
        HealthBand(max_error_rate=0.02, weight_percent=75),
    ]


class RecoverySpec(ApiModel):
    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.initialPercent <= self.capPercent",
            message="initialPercent must not exceed capPercent",
            check=lambda recovery: recovery.initial_percent <= recovery.cap_percent,
            field_path=".initialPercent",
        ),
        positive_duration("quiet_period"),
        positive_duration("step_interval"),
    )

    quiet_period: Duration = Field(default=30.0, description="Time without incidents before a zeroed pod recovers.")
    initial_percent: float = Field(
        default=1.0,
        gt=0,
        le=100,
        description="First recovery weight, as a percentage of the pod's scored weight.",
    )
    growth_factor: float = Field(default=1.5, gt=1, le=10, description="Multiplier applied every stepInterval.")
    step_interval: Duration = Field(default=10.0, description="Time between recovery steps.")
    cap_percent: float = Field(
        default=50.0, gt=0, le=100, description="Recovery ends (normal scoring resumes) past this percentage."
    )


class OutlierDetectionSpec(ApiModel):
    rules: ClassVar[tuple[Rule, ...]] = (positive_duration("interval"), positive_duration("base_ejection_time"))

    enabled: bool = Field(default=True, description="Render Istio outlierDetection, Envoy's sub-second ejection.")
    # Spelled as in Istio's DestinationRule (the camelCase generator would write consecutive5XxErrors).
    consecutive_5xx_errors: int = Field(
        default=5, ge=0, alias="consecutive5xxErrors", description="5xx responses in a row that eject a host."
    )
    interval: Duration = Field(default=10.0, description="Ejection sweep interval.")
    base_ejection_time: Duration = Field(default=30.0, description="Minimum ejection time, multiplied per ejection.")
    max_ejection_percent: int = Field(default=50, ge=0, le=100, description="Most of the pool Envoy may eject.")


class ProtectionSpec(ApiModel):
    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="size(self.bands) < 2 || self.bands.all(a, self.bands.exists_one(b, b.maxErrorRate == a.maxErrorRate))",
            message="bands must have distinct maxErrorRate values",
            check=lambda protection: len({band.max_error_rate for band in protection.bands}) == len(protection.bands),
            field_path=".bands",
        ),
    )

    fast_zero_error_rate: float = Field(
        default=0.1, gt=0, le=1, description="Error rate (0 to 1) at which a pod is zeroed at once."
    )
    lora_failure_rate: float = Field(
        default=0.05,
        gt=0,
        le=1,
        description="LoRA adapter load-failure rate at which a pod is zeroed at once.",
    )
    zero_on_oom: bool = Field(default=True, description="Zero a pod whose container was OOMKilled.")
    zero_on_restart: bool = Field(
        default=True,
        description="Zero a pod whose container restarted for any reason (a CUDA OOM shows as Error).",
    )
    consecutive_failures: int = Field(
        default=3, ge=1, le=100, description="Passes in a row below every band after which a pod is zeroed."
    )
    bands: list[HealthBand] = Field(
        default=_default_bands(),
        max_length=10,
        description="Error/latency bands mapping to a share of the scored weight; the first band a pod fits applies.",
    )
    below_bands_percent: float = Field(
        default=20.0, gt=0, le=100, description="Share of its scored weight kept by a pod outside every band."
    )
    recovery: RecoverySpec = Field(default_factory=RecoverySpec, description="Gradual return of a zeroed pod.")
    zero_when_others_full: bool = Field(
        default=False,
        description="scoring.policy headroom: a pod zeroed for its error rate, LoRA load failures or consecutive "
        "failures stays routable while it still serves most requests and is no slower than the other pods of its "
        "revision, if they cannot take its share within scoring.targetUtilization of their learned capacity and "
        "absorbTtftPercent: it keeps what would take them past halfway from the target to saturation and at least a "
        "tenth of their weight (overflow for Envoy's least-request) (false, the default); true zeroes it whatever "
        "the others' load. OOM-killed, restarted and not-Ready pods leave at once either way.",
    )
    absorb_ttft_percent: float = Field(
        default=10.0,
        ge=0,
        le=1000,
        description="scoring.policy headroom: how far the other pods' modelled TTFT may rise (percent over what the "
        "whole revision would serve the same load at) for them to take the whole share of a pod zeroed for errors; "
        "past it (or past scoring.targetUtilization) that pod is not zeroed but held (see zeroWhenOthersFull). No "
        "effect with zeroWhenOthersFull.",
    )
    min_routable_percent: int = Field(
        default=50,
        ge=0,
        le=100,
        description="sluice never zeroes a pool below this share of its ready pods (and never all of them).",
    )
    outlier_detection: OutlierDetectionSpec = Field(
        default_factory=OutlierDetectionSpec,
        description="Istio outlierDetection rendered in the DestinationRule.",
    )

    @field_validator("bands")
    @classmethod
    def _bands_in_order(cls, bands: list[HealthBand]) -> list[HealthBand]:
        """The first band a pod fits applies, so bands are kept sorted by maxErrorRate."""
        return sorted(bands, key=lambda band: band.max_error_rate)


AdmissionMode = Literal["Off", "Report", "Enforce"]

TENANT_VALUE = r"^[!-~]([ -~]{0,126}[!-~])?$"
"""A header value a tenant is named by: visible ASCII, inner spaces allowed, none at either end (Envoy trims a
header value's surrounding whitespace), and never empty (an empty value is Envoy's wildcard descriptor entry)."""


class TenantShare(ApiModel):
    value: str = Field(pattern=TENANT_VALUE, description="The header's value that names the tenant (exact match).")
    percent: int = Field(ge=1, le=99, description="The tenant's share of each pod's admitted rate, in percent.")


class TenantsSpec(ApiModel):
    """Per-tenant shares of what each pod admits, by a request header (Envoy local rate limit descriptors)."""

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.shares.map(s, s.percent).sum() + self.othersPercent == 100",
            message="the shares' percents and othersPercent must add up to 100",
            check=lambda tenants: sum(s.percent for s in tenants.shares) + tenants.others_percent == 100,
            field_path=".shares",
        ),
        Rule(
            cel="self.all(a, self.exists_one(b, b.value == a.value))",
            message="each tenant is named once",
            check=lambda shares: len({s.value for s in shares}) == len(shares),
            on="shares",
        ),
    )

    header: str = Field(
        pattern=HEADER_NAME,
        description="The request header that names the tenant (or the priority class), in lower case, e.g. "
        "x-tenant-id. Requests without it, or with a value not listed, share othersPercent.",
    )
    shares: list[TenantShare] = Field(min_length=1, max_length=32, description="Each named tenant's share.")
    others_percent: int = Field(
        ge=1,
        le=99,
        description="The share of requests with another value or without the header. At least 1: Envoy's bucket "
        "for them cannot be empty.",
    )


class AdmissionSpec(ApiModel):
    """Per-pod inbound limits sized from what each engine runs at once when saturated."""

    rules: ClassVar[tuple[Rule, ...]] = (positive_duration("ttft_target"),)

    mode: AdmissionMode = Field(
        default="Off",
        description="Off: no limits. Report: each pod's limit is learned and shown in "
        "status.endpoints[].inboundLimit, and not enforced (no object is rendered for it). Enforce: also rendered, "
        "one EnvoyFilter per hardware class on its pods' sidecars (inbound cluster circuit breaker on targetPort): "
        "past the limit a pod's sidecar answers 503, which the callers' retries send to another pod. Pods of one "
        "class share its limit; a pod of a class with no batch read yet, without a class label or without a "
        "sidecar has none, named in the AdmissionEnforced condition.",
    )
    batch_share: float = Field(
        default=0.6,
        gt=0,
        le=2,
        description="A pod's limit as a share of its batch: the requests its engine holds at once when its KV cache "
        "is full (status.endpoints[].saturatedBatch). Pods of one hardware class share their class's median. 0.6 "
        'was chosen among 0.5, 0.6 and 0.75 on two simulated fleets (docs/benchmarks.md, "Learned from the KV '
        'cache"). A change of batchShare moves a limit shown only past 10 %, as any other.',
    )
    min_limit: int = Field(
        default=1,
        ge=1,
        le=65536,
        description="The smallest limit a pod is given, in requests at once: a floor under a batch read low (a "
        "pod's limit is never below it once it has one). At least 1: a limit of 0 would refuse every request.",
    )
    ttft_target: Duration | None = Field(
        default=None,
        description="The TTFT p95 the admitted requests should stay under: with it a class whose engines serve well "
        "within it is let past batchShare. Each pod's share of its batch starts at batchShare and moves at each new "
        "scrape sample by its engine's TTFT p95: up 3 % while its limit binds (its sidecar refused requests, or it "
        "ran as many as its limit) and the p95 is below 0.8 x the target, down 7 % while the p95 is above the "
        "target, never below batchShare nor above 1 (status.endpoints[].admissionShare); a class's limit takes its "
        "pods' median share. Without it the share is batchShare. Chosen in the simulation at half the P99 SLO "
        '(docs/benchmarks.md, "Steered by a TTFT target").',
    )
    tenants: TenantsSpec | None = Field(
        default=None,
        description="Shares of each pod's admitted rate by a request header: a pod's sidecar admits a tenant's "
        "requests at up to its percent of what the pod's hardware class serves with its inbound limit full "
        "(requests/s, status.endpoints[].rateLimit) and answers the rest 429 with Retry-After, at once. A share "
        "is a cap, not a reservation another tenant may borrow: a tenant alone is refused past its share. Counted "
        "in requests, not tokens, per sidecar (each pod admits its own share). Enforce renders it with the "
        "inbound limit (a local rate limit on the sidecar's inbound HTTP filter chain).",
    )
