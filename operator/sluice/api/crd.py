"""Generate the InferencePool CustomResourceDefinition from the pydantic models.

The models are the single source of truth; `crds/` holds this function's output (`make crds`), and a test fails
when the two drift. The output is a *structural* schema as Kubernetes requires: every node typed, no `$ref`,
no `anyOf` with null, a description everywhere, defaults on nested objects so the API server fills them in.
The models' rules (`sluice.api.rules`) arrive as `x-kubernetes-validations` in the pydantic schema; the
object-level rules of `InferencePool` (on metadata.name) become the root rules.
"""

from __future__ import annotations

import yaml
from pydantic import BaseModel

from sluice.api.durations import DURATION_PATTERN, format_duration
from sluice.api.jsontypes import JsonObject, JsonValue
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


def _object(value: JsonValue, path: str) -> JsonObject:
    """`value` as a schema node (pydantic writes an object wherever a node goes)."""
    if not isinstance(value, dict):
        raise SchemaError(f"{path}: a schema node must be an object")
    return value


def _objects(value: JsonValue, path: str) -> list[JsonObject]:
    if not isinstance(value, list):
        raise SchemaError(f"{path}: a list of schema nodes must be a list")
    return [_object(item, path) for item in value]


def _names(value: JsonValue) -> list[str]:
    """A `required` list."""
    return [name for name in value if isinstance(name, str)] if isinstance(value, list) else []


def _kept(node: JsonObject) -> JsonObject:
    return {k: v for k, v in node.items() if k in _KEEP}


def _resolve(node: JsonObject, defs: JsonObject) -> JsonObject:
    ref = node.get("$ref")
    if not isinstance(ref, str):
        return node
    target = dict(_object(defs[ref.rsplit("/", 1)[-1]], ref))
    # Keys next to a $ref (description, default) refine the referenced schema.
    target.update({k: v for k, v in node.items() if k != "$ref"})
    return target


def _without_null_branch(node: JsonObject, defs: JsonObject, path: str) -> JsonObject:
    """`X | None` as X: an optional field is absent when off (a structural schema has no null type)."""
    if "anyOf" not in node:
        return node
    branches = [branch for branch in _objects(node["anyOf"], path) if branch.get("type") != "null"]
    if len(branches) != 1:
        raise SchemaError(f"{path}: only 'X or null' unions can be expressed")
    return {**_resolve(branches[0], defs), **{k: v for k, v in node.items() if k != "anyOf"}}


def _draft4_bounds(out: JsonObject) -> None:
    """Kubernetes' JSONSchemaProps has the draft-4 form only: a bound plus a boolean `exclusiveMinimum`."""
    for bound, flag in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        value = out.get(flag)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[bound], out[flag] = value, True


def _keywords(node: JsonObject, path: str) -> JsonObject:
    """The node's own keywords as Kubernetes takes them: bounds in draft-4 form, defaults without nulls,
    durations spelled as strings, numbers as floats, a `const` as a one-value enum."""
    out = _kept(node)
    if out.get("default", 0) is None:  # "absent means off": no default, and Kubernetes forbids null defaults
        del out["default"]
    _draft4_bounds(out)
    if "default" in out:
        out["default"] = _without_nulls(out["default"])
    default = out.get("default")
    if out.get("pattern") == DURATION_PATTERN and isinstance(default, int | float):
        out["default"] = format_duration(default)
    if "description" not in out:
        raise SchemaError(f"{path}: every field needs a description")
    if "const" in node:
        out["enum"] = [node["const"]]
        out.setdefault("type", "string")
    default = out.get("default")
    if out.get("type") == "number" and isinstance(default, int):
        out["default"] = float(default)
    return out


def _properties(node: JsonObject, defs: JsonObject, path: str) -> JsonObject:
    """An object's properties, each made structural, and those still required (a default makes one optional)."""
    required_names = _names(node.get("required"))
    props: dict[str, JsonObject] = {}
    for name, child_value in _object(node["properties"], path).items():
        child = _object(child_value, f"{path}.{name}")
        prop = _structural(child, defs, f"{path}.{name}")
        # A nested object that pydantic fills from a default factory (not required, not `X | None`) gets
        # `default: {}`, so the API server expands its defaults just as the models do.
        optional_off = "anyOf" in _resolve(child, defs)
        if (
            prop["type"] == "object"
            and "properties" in prop
            and name not in required_names
            and not optional_off
            and not prop.get("required")
            and "default" not in prop
        ):
            prop["default"] = {}
        props[name] = prop
    out: JsonObject = {"properties": dict(props)}
    required: list[JsonValue] = [name for name in required_names if "default" not in props[name]]
    if required:
        out["required"] = required
    return out


def _map_values(extra: JsonObject, defs: JsonObject, path: str) -> JsonObject:
    """The schema of a map's values (`additionalProperties`)."""
    value = _resolve(extra, defs)
    if value.get("type") == "object" and "properties" in value:
        value_schema = _structural({**value, "description": "entry"}, defs, f"{path}[*]")
        value_schema.pop("description", None)
        return value_schema
    return _kept(value)


def _array_items(node: JsonObject, defs: JsonObject, path: str) -> JsonObject:
    """The schema of a list's items."""
    items = _resolve(_object(node["items"], path), defs)
    if items.get("type") == "object":
        return _structural({**items, "description": items.get("description", "One entry.")}, defs, path + "[]")
    return _kept(items)


def _structural(node: JsonObject, defs: JsonObject, path: str) -> JsonObject:
    node = _without_null_branch(_resolve(node, defs), defs, path)
    out = _keywords(node, path)
    node_type = node.get("type")
    if node_type == "object" and "properties" in node:
        out.update(_properties(node, defs, path))
    elif node_type == "object":
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            out["additionalProperties"] = _map_values(extra, defs, path)
    elif node_type == "array":
        out["items"] = _array_items(node, defs, path)
    if "type" not in out:
        raise SchemaError(f"{path}: untyped node")
    return _ordered(out)


def _without_nulls(value: JsonValue) -> JsonValue:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


_ORDER = ("type", "description", "default")


def _ordered(schema: JsonObject) -> JsonObject:
    """type, description and default first, the rest alphabetical: stable, reviewable output."""
    head = [k for k in _ORDER if k in schema]
    return {k: schema[k] for k in [*head, *sorted(k for k in schema if k not in _ORDER)]}


def model_schema(model: type[BaseModel], description: str) -> JsonObject:
    # pydantic's JSON schema of the model (its "validation" form): JSON throughout.
    raw: JsonObject = model.model_json_schema(by_alias=True, mode="validation")
    defs = _object(raw.pop("$defs", {}), f"{model.__name__}.$defs")
    raw["description"] = description
    return _structural(raw, defs, model.__name__)


def _printer_columns() -> list[JsonValue]:
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


def _metadata_schema() -> JsonObject:
    """metadata as the root rules see it: name and generateName, both declared.

    The API server types the root rules' `self.metadata` from this schema only when both are declared strings;
    their maxLength (its own limit for names) then bounds the rules' cost estimate, and the rules' fieldPath
    `.metadata.name` names a declared field. Nothing else of metadata may be constrained by a CRD.
    """
    name: JsonObject = {"type": "string", "maxLength": 253}
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

    def ignore_aliases(self, data: object) -> bool:
        return True


def crd_yaml() -> str:
    """The CRD as committed in crds/ and the Helm chart (`sluice crd`, `make crds`)."""
    return yaml.dump(build_crd(), Dumper=_NoAliasDumper, sort_keys=False, width=100)


def build_crd() -> JsonObject:
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
