"""Generate the InferencePool CustomResourceDefinition from the pydantic models.

The models are the single source of truth; `crds/` holds this function's output (`make crds`), and a test fails
when the two drift. The output is a *structural* schema as Kubernetes requires: every node typed, no `$ref`,
no `anyOf` with null, a description everywhere, defaults on nested objects so the API server fills them in.
The models' rules (`sluice.api.rules`) arrive as `x-kubernetes-validations` in the pydantic schema; the
object-level rules of `InferencePool` (on metadata.name) become the root rules.
"""

from __future__ import annotations

from typing import Any

import yaml

from sluice.api.durations import DURATION_PATTERN, format_duration
from sluice.api.v1alpha1 import GROUP, KIND, PLURAL, VERSION, InferencePool, InferencePoolSpec, InferencePoolStatus

_KEEP = {
    "type",
    "description",
    "default",
    "enum",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "format",
    "x-kubernetes-validations",
}


class SchemaError(ValueError):
    """The models cannot be expressed as a structural schema (a bug in the models, caught by the tests)."""


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref is None:
        return node
    target = dict(defs[ref.rsplit("/", 1)[-1]])
    # Keys next to a $ref (description, default) refine the referenced schema.
    target.update({k: v for k, v in node.items() if k != "$ref"})
    return target


def _structural(node: dict[str, Any], defs: dict[str, Any], path: str) -> dict[str, Any]:
    node = _resolve(node, defs)
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        if len(branches) != 1:
            raise SchemaError(f"{path}: only 'X or null' unions can be expressed")
        merged = _resolve(branches[0], defs)
        merged = {**merged, **{k: v for k, v in node.items() if k != "anyOf"}}
        node = merged
    out: dict[str, Any] = {k: v for k, v in node.items() if k in _KEEP}
    if out.get("default", 0) is None:  # "absent means off": no default, and Kubernetes forbids null defaults
        del out["default"]
    # Kubernetes' JSONSchemaProps has the draft-4 form only: a bound plus a boolean `exclusiveMinimum`.
    for bound, flag in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if isinstance(out.get(flag), int | float) and not isinstance(out.get(flag), bool):
            out[bound], out[flag] = out[flag], True
    if "default" in out:
        out["default"] = _without_nulls(out["default"])
    if out.get("pattern") == DURATION_PATTERN and isinstance(out.get("default"), int | float):
        out["default"] = format_duration(out["default"])
    if "description" not in out:
        raise SchemaError(f"{path}: every field needs a description")
    if "const" in node:
        out["enum"] = [node["const"]]
        out.setdefault("type", "string")
    if out.get("type") == "number" and "default" in out and isinstance(out["default"], int):
        out["default"] = float(out["default"])
    node_type = node.get("type")
    if node_type == "object" and "properties" in node:
        props = {}
        for name, child in node["properties"].items():
            prop = _structural(child, defs, f"{path}.{name}")
            # A nested object that pydantic fills from a default factory (not required, not `X | None`) gets
            # `default: {}`, so the API server expands its defaults just as the models do.
            optional_off = "anyOf" in _resolve(child, defs)
            if (
                prop["type"] == "object"
                and "properties" in prop
                and name not in node.get("required", [])
                and not optional_off
                and not prop.get("required")
                and "default" not in prop
            ):
                prop["default"] = {}
            props[name] = prop
        out["properties"] = props
        required = [name for name in node.get("required", []) if "default" not in props[name]]
        if required:
            out["required"] = required
    elif node_type == "object":
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            value = _resolve(extra, defs)
            value_schema = {k: v for k, v in value.items() if k in _KEEP}
            if value.get("type") == "object" and "properties" in value:
                value_schema = _structural({**value, "description": "entry"}, defs, f"{path}[*]")
                value_schema.pop("description", None)
            out["additionalProperties"] = value_schema
    elif node_type == "array":
        items = _resolve(node["items"], defs)
        if items.get("type") == "object":
            out["items"] = _structural(
                {**items, "description": items.get("description", "One entry.")}, defs, path + "[]"
            )
        else:
            out["items"] = {k: v for k, v in items.items() if k in _KEEP}
    if "type" not in out:
        raise SchemaError(f"{path}: untyped node")
    return _ordered(out)


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


_ORDER = ("type", "description", "default")


def _ordered(schema: dict[str, Any]) -> dict[str, Any]:
    """type, description and default first, the rest alphabetical: stable, reviewable output."""
    head = [k for k in _ORDER if k in schema]
    return {k: schema[k] for k in [*head, *sorted(k for k in schema if k not in _ORDER)]}


def model_schema(model: type[Any], description: str) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    raw["description"] = description
    return _structural(raw, defs, model.__name__)


def _printer_columns() -> list[dict[str, Any]]:
    return [
        {
            "name": "Routable",
            "type": "string",
            "jsonPath": ".status.routable",
            "description": "Routable pods / ready pods",
        },
        {
            "name": "Ready",
            "type": "string",
            "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
            "description": "Weights are published",
        },
        {
            "name": "Metrics",
            "type": "string",
            "jsonPath": '.status.conditions[?(@.type=="MetricsAvailable")].status',
            "description": "Signals are fresh",
        },
        {
            "name": "Canary",
            "type": "string",
            "jsonPath": ".status.canary.phase",
            "description": "Rollout phase",
        },
        {
            "name": "Weight",
            "type": "integer",
            "jsonPath": ".status.canary.weight",
            "description": "Candidate traffic %",
        },
        {
            "name": "Mirror",
            "type": "number",
            "jsonPath": ".status.canary.mirrorPercent",
            "description": "Requests mirrored to the candidate (shadow), %",
            "priority": 1,
        },
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def _metadata_schema() -> dict[str, Any]:
    """metadata as the root rules see it: name and generateName, both declared.

    The API server types the root rules' `self.metadata` from this schema only when both are declared strings;
    their maxLength (its own limit for names) then bounds the rules' cost estimate, and the rules' fieldPath
    `.metadata.name` names a declared field. Nothing else of metadata may be constrained by a CRD.
    """
    name = {"type": "string", "maxLength": 253}
    return {
        "type": "object",
        "description": "Standard object metadata.",
        "properties": {
            "name": {**name, "description": "Pool name."},
            "generateName": {**name, "description": "Prefix of a generated pool name."},
        },
    }


class _NoAliasDumper(yaml.SafeDumper):
    """Every node spelled out: a dict the schema reuses (a shared rule list) must not become `&id001`/`*id001`."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def crd_yaml() -> str:
    """The CRD as committed in crds/ and the Helm chart (`sluice crd`, `make crds`)."""
    return yaml.dump(build_crd(), Dumper=_NoAliasDumper, sort_keys=False, width=100)


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition object (apiextensions.k8s.io/v1)."""
    spec_schema = model_schema(InferencePoolSpec, "Desired behaviour of the pool.")
    status_schema = model_schema(InferencePoolStatus, "Observed state, written by sluice.")
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "sluice", "app.kubernetes.io/part-of": "sluice"},
        },
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": "inferencepool",
                "shortNames": ["sluicepool", "slp"],
                "categories": ["sluice"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": _printer_columns(),
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A pool of model-server pods whose traffic weights sluice manages.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string", "description": "API version."},
                                "kind": {"type": "string", "description": "Kind."},
                                "metadata": _metadata_schema(),
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                            "x-kubernetes-validations": [rule.entry() for rule in InferencePool.rules],
                        }
                    },
                }
            ],
        },
    }
