"""API rules declared once: each carries the CEL the API server runs and the Python twin the models run.

A model lists its rules in a `rules` ClassVar. `check_rules` (called by the base model after field validation)
evaluates the Python predicates and reports each failure with the rule's message at the rule's field, the way
the API server reports the CEL rule; `emit_rules` writes the same rules into the model's JSON schema as
`x-kubernetes-validations`, which `sluice.api.crd` copies into the CRD. Neither side has its own copy of a
message, so the two cannot drift. Pure.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

if typing.TYPE_CHECKING:  # types only: the names stay out of this module's (re-exported) namespace
    from sluice.api.jsontypes import JsonObject, JsonValue


@dataclass(frozen=True)
class Rule:
    """One validation rule, in CEL for the API server and in Python for the models.

    `on` names a (Python) field: the CEL sits on that field's schema node with `self` bound to its value, and
    `check` receives the value; the rule is skipped while the field is unset, as the API server skips rules on
    absent fields. Without `on`, `self` and `check`'s argument are the whole object. `field_path` (CEL
    `fieldPath`, e.g. ".minWeight") is where a failure is reported, relative to the rule's node.
    """

    cel: str
    message: str
    check: Callable[[Any], bool]
    field_path: str = ""
    on: str | None = None

    def __post_init__(self) -> None:
        if self.field_path and not self.field_path.startswith("."):
            raise ValueError(f"fieldPath must start with '.': {self.field_path!r}")

    def entry(self) -> JsonObject:
        """The `x-kubernetes-validations` entry."""
        entry: JsonObject = {"rule": self.cel, "message": self.message}
        if self.field_path:
            entry["fieldPath"] = self.field_path
        return entry


def cel_string(text: str) -> str:
    """`text` as a CEL string literal (regular expressions carry backslashes, which CEL unescapes once)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def positive_duration(field: str) -> Rule:
    """A duration field that must be strictly positive (a zero period would spin or divide by zero)."""
    return Rule(
        cel="duration(self) > duration('0s')",
        message="must be greater than 0s",
        check=lambda seconds: seconds > 0,
        on=field,
    )


def _wire_name(model: type[BaseModel], field: str) -> str:
    info = model.model_fields[field]
    return info.alias or field


def _value_at(value: JsonValue, path: tuple[str, ...]) -> JsonValue:
    for part in path:
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def check_rules(model: BaseModel) -> None:
    """Raise a ValidationError listing every rule of `model` that fails, each at its rule's field."""
    cls = type(model)
    rules: tuple[Rule, ...] = getattr(cls, "rules", ())
    failures: list[InitErrorDetails] = []
    wire: JsonObject | None = None
    for rule in rules:
        subject = model if rule.on is None else getattr(model, rule.on)
        if subject is None or rule.check(subject):
            continue
        if wire is None:
            wire = model.model_dump(mode="json", by_alias=True)
        node = () if rule.on is None else (_wire_name(cls, rule.on),)
        location = (*node, *(part for part in rule.field_path.split(".") if part))
        failures.append(
            InitErrorDetails(
                type=PydanticCustomError("api_rule", rule.message),
                loc=location,
                # the value of the rule's node, not of its fieldPath: kube-apiserver shows the node's type
                input=_value_at(wire, node),
            )
        )
    if failures:
        raise ValidationError.from_exception_data(cls.__name__, failures)


def _field_node(schema: JsonObject, model: type[BaseModel], field: str) -> JsonObject:
    """The schema node of `field`: keyed by wire name in the CRD's (by_alias) schema, by Python name otherwise."""
    properties = schema["properties"]
    node = (properties.get(_wire_name(model, field)) or properties[field]) if isinstance(properties, dict) else None
    if not isinstance(node, dict):
        raise TypeError(f"{model.__name__}.{field}: a rule's field has no schema object")
    return node


def emit_rules(schema: JsonObject, model: type[BaseModel]) -> None:
    """pydantic `json_schema_extra` hook: the model's rules as `x-kubernetes-validations` on their nodes."""
    rules: tuple[Rule, ...] = getattr(model, "rules", ())
    for rule in rules:
        node = schema if rule.on is None else _field_node(schema, model, rule.on)
        validations = node.setdefault("x-kubernetes-validations", [])
        if isinstance(validations, list):  # always: only this hook writes the key
            validations.append(rule.entry())
