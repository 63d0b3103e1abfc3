"""The InferencePool API, `inference.sluice.dev/v1alpha1`: the whole object, and one import point for its parts.

The spec lives in `sluice.api.spec` (its parts in `sluice.api.signals`, `sluice.api.weighting`,
`sluice.api.rollout` and `sluice.api.routing`), the status in `sluice.api.status`, the shared conventions in
`sluice.api.base`; this module assembles the stored object and re-exports every name, so callers import from
one place.
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import ConfigDict, Field
from pydantic.alias_generators import to_camel

from sluice.api.base import (
    API_VERSION,
    CLIENT_NAMESPACE,
    DNS_1123_LABEL,
    DNS_LABEL,
    DNS_SUBDOMAIN,
    GROUP,
    KIND,
    LABEL_KEY,
    LABEL_KEY_MESSAGE,
    LABEL_KEY_PREFIX_MAX_LENGTH,
    LABEL_VALUE,
    LABEL_VALUE_MAX_LENGTH,
    MAX_LABELS,
    MAX_QUERY_LENGTH,
    PLURAL,
    PROM_LABEL_NAME,
    QUERY_PLACEHOLDERS,
    VERSION,
    ApiModel,
    CanaryPhase,
    CanaryStage,
    CheckResult,
    ConditionStatus,
    EndpointState,
    Engine,
    WeightsVia,
    is_label_key,
    is_label_value,
    label_keys_rule,
)
from sluice.api.rollout import (
    COOKIE_NAME,
    HEADER_NAME,
    AbTestSpec,
    AnalysisSpec,
    CanaryRoute,
    CanarySpec,
    Gate,
    KeyAlphabet,
    ShadowSpec,
    StickyKey,
    StringMatch,
    re2_error,
)
from sluice.api.routing import (
    MAX_NAMESPACES,
    LeastRequestSpec,
    RetryOn,
    RetrySpec,
    RoutingSpec,
    SessionAffinitySpec,
)
from sluice.api.rules import Rule, cel_string, check_rules, emit_rules, positive_duration
from sluice.api.signals import MetricsAuth, MetricsSpec, QueryOverrides, SecretKeyRef, TritonMetrics
from sluice.api.spec import InferencePoolSpec, LabelSelector, LabelValue
from sluice.api.status import (
    AdmissionStatus,
    CanaryStatus,
    Condition,
    EndpointSignals,
    EndpointStatus,
    EndpointSummary,
    InferencePoolStatus,
    MeshStatus,
    OperationRecord,
    SignalCheck,
    SignalChecks,
    StatusModel,
    WeightBucket,
    read_status,
)
from sluice.api.weighting import (
    AdmissionMode,
    AdmissionSpec,
    CapacitySpec,
    HealthBand,
    OutlierDetectionSpec,
    ProtectionSpec,
    RecoverySpec,
    ScoringPolicy,
    ScoringSpec,
    TenantShare,
    TenantsSpec,
)

# The pool name is the value of the sluice.dev/pool label on every object sluice writes (a label value: 63 characters).
POOL_NAME_MAX_LENGTH = 63


class ObjectMeta(ApiModel):
    """The part of metadata sluice reads."""

    model_config = ConfigDict(frozen=True, extra="ignore", alias_generator=to_camel, populate_by_name=True)

    name: str = Field(
        description="Pool name: a DNS-1123 label of at most 63 characters, since it becomes the value of the "
        "sluice.dev/pool label and part of every Istio object name."
    )
    namespace: str = Field(default="default", description="Pool namespace.")
    uid: str | None = Field(default=None, description="Object UID, for ownerReferences.")
    generation: int | None = Field(default=None, description="Spec generation.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations (rollout operations).")


class InferencePool(ApiModel):
    """A whole InferencePool object as stored in Kubernetes."""

    model_config = ConfigDict(frozen=True, extra="ignore", alias_generator=to_camel, populate_by_name=True)
    crd_ignored_fields: ClassVar[frozenset[str]] = frozenset({"metadata", "api_version", "kind"})
    # Root rules: the API server lets them read metadata.name (the CRD cannot constrain metadata otherwise).
    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel=f"self.metadata.name.matches({cel_string(DNS_1123_LABEL)})",
            message="a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must "
            "start and end with an alphanumeric character (e.g. 'my-name', or '123-abc')",
            check=lambda pool: re.fullmatch(DNS_1123_LABEL, pool.metadata.name) is not None,
            field_path=".metadata.name",
        ),
        Rule(
            cel=f"size(self.metadata.name) <= {POOL_NAME_MAX_LENGTH}",
            message=f"must be no more than {POOL_NAME_MAX_LENGTH} characters",
            check=lambda pool: len(pool.metadata.name) <= POOL_NAME_MAX_LENGTH,
            field_path=".metadata.name",
        ),
    )

    api_version: Literal["inference.sluice.dev/v1alpha1"] = Field(
        default=API_VERSION, description="inference.sluice.dev/v1alpha1"
    )
    kind: Literal["InferencePool"] = Field(default="InferencePool", description="InferencePool")
    metadata: ObjectMeta = Field(description="Standard object metadata.")
    spec: InferencePoolSpec = Field(description="Desired behaviour of the pool.")
    status: InferencePoolStatus | None = Field(default=None, description="Observed state, written by sluice.")


__all__ = [
    "API_VERSION",
    "CLIENT_NAMESPACE",
    "COOKIE_NAME",
    "DNS_1123_LABEL",
    "DNS_LABEL",
    "DNS_SUBDOMAIN",
    "GROUP",
    "HEADER_NAME",
    "KIND",
    "LABEL_KEY",
    "LABEL_KEY_MESSAGE",
    "LABEL_KEY_PREFIX_MAX_LENGTH",
    "LABEL_VALUE",
    "LABEL_VALUE_MAX_LENGTH",
    "MAX_LABELS",
    "MAX_NAMESPACES",
    "MAX_QUERY_LENGTH",
    "PLURAL",
    "POOL_NAME_MAX_LENGTH",
    "PROM_LABEL_NAME",
    "QUERY_PLACEHOLDERS",
    "VERSION",
    "AbTestSpec",
    "AdmissionMode",
    "AdmissionSpec",
    "AdmissionStatus",
    "AnalysisSpec",
    "ApiModel",
    "CanaryPhase",
    "CanaryRoute",
    "CanarySpec",
    "CanaryStage",
    "CanaryStatus",
    "CapacitySpec",
    "CheckResult",
    "Condition",
    "ConditionStatus",
    "EndpointSignals",
    "EndpointState",
    "EndpointStatus",
    "EndpointSummary",
    "Engine",
    "Gate",
    "HealthBand",
    "InferencePool",
    "InferencePoolSpec",
    "InferencePoolStatus",
    "KeyAlphabet",
    "LabelSelector",
    "LabelValue",
    "LeastRequestSpec",
    "MeshStatus",
    "MetricsAuth",
    "MetricsSpec",
    "ObjectMeta",
    "OperationRecord",
    "OutlierDetectionSpec",
    "ProtectionSpec",
    "QueryOverrides",
    "RecoverySpec",
    "RetryOn",
    "RetrySpec",
    "RoutingSpec",
    "Rule",
    "ScoringPolicy",
    "ScoringSpec",
    "SecretKeyRef",
    "SessionAffinitySpec",
    "ShadowSpec",
    "SignalCheck",
    "SignalChecks",
    "StatusModel",
    "StickyKey",
    "StringMatch",
    "TenantShare",
    "TenantsSpec",
    "TritonMetrics",
    "WeightBucket",
    "WeightsVia",
    "cel_string",
    "check_rules",
    "emit_rules",
    "is_label_key",
    "is_label_value",
    "label_keys_rule",
    "positive_duration",
    "re2_error",
    "read_status",
]
