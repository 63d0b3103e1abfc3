"""The InferencePool field reference (docs/api-reference.md), generated from the CRD schema. Pure."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping

from sluice.api.crd import build_crd
from sluice.api.jsontypes import members, text


def _listed(value: object) -> list[object]:
    return list(value) if isinstance(value, list) else []


def _kind(schema: Mapping[str, object]) -> str:
    kind = text(schema, "type")
    item_type = members(schema, "items").get("type")
    if kind == "array" and item_type:
        kind = f"[]{item_type}"
    extra = schema.get("additionalProperties")
    if kind == "object" and isinstance(extra, Mapping):
        kind = f"map[string]{extra.get('type', 'object')}"
    return kind


def _notes(schema: Mapping[str, object]) -> str:
    limits = []
    for key, label in (
        ("minimum", ">="),
        ("maximum", "<="),
        ("minItems", "items >="),
        ("maxItems", "items <="),
        ("maxProperties", "entries <="),
        ("maxLength", "length <="),
    ):
        if key in schema:
            strict = schema.get({"minimum": "exclusiveMinimum", "maximum": "exclusiveMaximum"}.get(key, ""), False)
            limits.append(f"{label.replace('=', '') if strict else label} {schema[key]}")
    if "enum" in schema:
        limits.append(" \\| ".join(str(v) for v in _listed(schema["enum"])))
    rules = [text(rule, "message") for rule in _listed(schema.get("x-kubernetes-validations"))]
    return "; ".join([*limits, *rules])


def _rows(schema: Mapping[str, object], path: str, required: bool) -> Iterator[tuple[str, str, str, str, str]]:
    kind = _kind(schema)
    default = json.dumps(schema["default"]) if "default" in schema else ""
    description = text(schema, "description").replace("|", "\\|").replace("\n", " ")
    yield path, kind + (" (required)" if required else ""), default.replace("|", "\\|"), description, _notes(schema)
    for name, child in members(schema, "properties").items():
        yield from _rows(members(child), f"{path}.{name}", name in _listed(schema.get("required")))
    items = members(schema, "items")
    if "properties" in items:
        for name, child in members(items, "properties").items():
            yield from _rows(members(child), f"{path}[].{name}", name in _listed(items.get("required")))


def render_reference() -> str:
    versions = _listed(members(build_crd(), "spec").get("versions"))
    root = members(versions[0], "schema", "openAPIV3Schema", "properties")
    lines = [
        "# InferencePool field reference (`inference.sluice.dev/v1alpha1`)",
        "",
        "Generated from the API models by `make crds`; do not edit by hand. Durations are Go-style strings",
        "(`500ms`, `30s`, `1m30s`). Rules in the last column are enforced by the API server (CEL) and by sluice.",
        "",
    ]
    for section in ("spec", "status"):
        lines += [
            f"## {section}",
            "",
            "| field | type | default | description | limits and rules |",
            "|---|---|---|---|---|",
        ]
        for path, kind, default, description, notes in _rows(members(root, section), section, False):
            if path == section:
                continue
            lines.append(f"| `{path}` | {kind} | {f'`{default}`' if default else ''} | {description} | {notes} |")
        lines.append("")
    return "\n".join(lines)
