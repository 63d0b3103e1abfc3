"""The InferencePool API, `inference.sluice.dev/v1alpha1`: the whole object, and one import point for its parts.

The spec lives in `sluice.api.spec`, the status in `sluice.api.status`, the shared conventions in
`sluice.api.base`; this module assembles the stored object and re-exports every name, so callers import from
one place.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import ConfigDict, Field
from pydantic.alias_generators import to_camel

from sluice.api.base import (
    API_VERSION,
    DNS_LABEL,
    GROUP,
    KIND,
    LABEL_KEY,
    LABEL_VALUE,
    PLURAL,
    PROM_LABEL_NAME,
    QUERY_PLACEHOLDERS,
    VERSION,
    ApiModel,
    CanaryPhase,
    CheckResult,
    ConditionStatus,
    EndpointState,
    Engine,
    WeightsVia,
)
from sluice.api.rules import Rule, positive_duration
from sluice.api.spec import (
    AnalysisSpec,
    CanarySpec,
    CapacitySpec,
    HealthBand,
    InferencePoolSpec,
    LabelSelector,
    LeastRequestSpec,
    MetricsAuth,
    MetricsSpec,
    OutlierDetectionSpec,
    ProtectionSpec,
    QueryOverrides,
    RecoverySpec,
    RoutingSpec,
    ScoringSpec,
    SecretKeyRef,
    SessionAffinitySpec,
)
from sluice.api.status import (
    CanaryStatus,
    Condition,
    EndpointSignals,
    EndpointStatus,
    InferencePoolStatus,
    StatusModel,
)


class ObjectMeta(ApiModel):
    """The part of metadata sluice reads."""

    model_config = ConfigDict(frozen=True, extra="ignore", alias_generator=to_camel, populate_by_name=True)

    name: str = Field(description="Pool name.")
    namespace: str = Field(default="default", description="Pool namespace.")
    uid: str | None = Field(default=None, description="Object UID, for ownerReferences.")
    generation: int | None = Field(default=None, description="Spec generation.")


class InferencePool(ApiModel):
    """A whole InferencePool object as stored in Kubernetes."""

    model_config = ConfigDict(frozen=True, extra="ignore", alias_generator=to_camel, populate_by_name=True)
    crd_ignored_fields: ClassVar[frozenset[str]] = frozenset({"metadata", "api_version", "kind"})

    api_version: Literal["inference.sluice.dev/v1alpha1"] = Field(
        default=API_VERSION, description="inference.sluice.dev/v1alpha1"
    )
    kind: Literal["InferencePool"] = Field(default="InferencePool", description="InferencePool")
    metadata: ObjectMeta = Field(description="Standard object metadata.")
    spec: InferencePoolSpec = Field(description="Desired behaviour of the pool.")
    status: InferencePoolStatus | None = Field(default=None, description="Observed state, written by sluice.")


__all__ = [
    "API_VERSION",
    "DNS_LABEL",
    "GROUP",
    "KIND",
    "LABEL_KEY",
    "LABEL_VALUE",
    "PLURAL",
    "PROM_LABEL_NAME",
    "QUERY_PLACEHOLDERS",
    "VERSION",
    "AnalysisSpec",
    "ApiModel",
    "CanaryPhase",
    "CanarySpec",
    "CanaryStatus",
    "CapacitySpec",
    "CheckResult",
    "Condition",
    "ConditionStatus",
    "EndpointSignals",
    "EndpointState",
    "EndpointStatus",
    "Engine",
    "HealthBand",
    "InferencePool",
    "InferencePoolSpec",
    "InferencePoolStatus",
    "LabelSelector",
    "LeastRequestSpec",
    "MetricsAuth",
    "MetricsSpec",
    "ObjectMeta",
    "OutlierDetectionSpec",
    "ProtectionSpec",
    "QueryOverrides",
    "RecoverySpec",
    "RoutingSpec",
    "Rule",
    "ScoringSpec",
    "SecretKeyRef",
    "SessionAffinitySpec",
    "StatusModel",
    "WeightsVia",
    "positive_duration",
]
