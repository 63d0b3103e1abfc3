"""Shared building blocks of the InferencePool API: the wire conventions, label and name patterns and rules.

Imported by the spec and status models (`sluice.api.spec` and its parts, `sluice.api.status`); nothing here knows
a field.
"""

from __future__ import annotations

import re
import typing
from typing import ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.alias_generators import to_camel

from sluice.api.rules import Rule, cel_string, check_rules, emit_rules

if typing.TYPE_CHECKING:  # types only: the names stay out of this module's (re-exported) namespace
    from sluice.api.jsontypes import JsonObject

GROUP = "inference.sluice.dev"
VERSION = "v1alpha1"
API_VERSION: Literal["inference.sluice.dev/v1alpha1"] = "inference.sluice.dev/v1alpha1"
KIND = "InferencePool"
PLURAL = "inferencepools"

Engine = Literal["vllm", "sglang", "trtllm", "triton", "tgi", "custom"]
WeightsVia = Literal["VirtualService", "EnvoyFilter"]
EndpointState = Literal["Routable", "Zeroed", "Recovering"]
CanaryPhase = Literal["Idle", "Waiting", "Shadow", "Progressing", "Paused", "Promoted", "RolledBack"]
CanaryStage = Literal["Shadow", "Live"]
CheckResult = Literal["Pass", "Fail", "Inconclusive"]
ConditionStatus = Literal["True", "False", "Unknown"]

DNS_LABEL = r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"
DNS_1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
CLIENT_NAMESPACE = r"^([*.]|[a-z0-9]([-a-z0-9]*[a-z0-9])?)$"
"""An exportTo entry sluice writes: '.', '*' or a namespace name (Istio's '~' hides, and is refused on most kinds)."""
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
LABEL_KEY = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
QUERY_PLACEHOLDERS = frozenset({"selector", "namespace", "pods", "window", "podLabel"})
PROM_LABEL_NAME = r"^[a-zA-Z_][a-zA-Z0-9_]*$"
LABEL_VALUE_MAX_LENGTH = 63

# Bounds on what CEL rules iterate: without them the API server estimates a rule's cost for a request-sized map
# or string and refuses the CRD ("estimated rule cost exceeds budget").
MAX_LABELS = 64
MAX_QUERY_LENGTH = 8192
# The DNS-subdomain prefix of a label key (before '/') may be 253 characters; LABEL_KEY bounds the name part.
LABEL_KEY_PREFIX_MAX_LENGTH = 253

LABEL_KEY_MESSAGE = (
    "label keys must be an optional DNS subdomain prefix of at most 253 characters and '/', then a name of at most "
    "63 alphanumeric characters, '-', '_' or '.', starting and ending with an alphanumeric character "
    "(e.g. 'app' or 'example.com/my-name')"
)


def is_label_key(key: str) -> bool:
    return re.fullmatch(LABEL_KEY, key) is not None and key.find("/") <= LABEL_KEY_PREFIX_MAX_LENGTH


def is_label_value(value: str) -> bool:
    return len(value) <= LABEL_VALUE_MAX_LENGTH and re.fullmatch(LABEL_VALUE, value) is not None


def label_keys_rule(field: str, message: str = LABEL_KEY_MESSAGE) -> Rule:
    """Every key of the map `field` is a Kubernetes label key."""
    return Rule(
        cel=f"self.all(k, k.matches({cel_string(LABEL_KEY)}) && k.indexOf('/') <= {LABEL_KEY_PREFIX_MAX_LENGTH})",
        message=message,
        check=lambda labels: all(is_label_key(key) for key in labels),
        on=field,
    )


class ApiModel(BaseModel):
    """Base: frozen, camelCase on the wire, unknown fields rejected (like `kubectl apply --validate=strict`).

    A model's cross-field and field-level rules are listed once in `rules` (see `sluice.api.rules`): checked here
    after the fields parse, and emitted into the JSON schema (hence the CRD) as CEL.
    """

    model_config = ConfigDict(
        frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True, json_schema_extra=emit_rules
    )
    rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> Self:
        check_rules(self)
        return self

    def wire(self) -> JsonObject:
        """The JSON-ready camelCase dict, without unset optional fields."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
