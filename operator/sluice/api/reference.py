"""The InferencePool field reference (docs/api-reference.md), generated from the CRD schema. Pure."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from sluice.api.crd import build_crd


def _rows(schema: dict[str, Any], path: str, required: bool) -> Iterator[tuple[str, str, str, str, str]]:
    kind = schema["type"]
    if kind == "array" and schema.get("items", {}).get("type"):
        kind = f"[]{schema['items']['type']}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        kind = f"map[string]{schema['additionalProperties'].get('type', 'object')}"
    default = json.dumps(schema["default"]) if "default" in schema else ""
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
        limits.append(" \\| ".join(str(v) for v in schema["enum"]))
    rules = [rule["message"] for rule in schema.get("x-kubernetes-validations", [])]
    notes = "; ".join([*limits, *rules])
    description = schema.get("description", "").replace("|", "\\|").replace("\n", " ")
    yield path, kind + (" (required)" if required else ""), default.replace("|", "\\|"), description, notes
    for name, child in schema.get("properties", {}).items():
        yield from _rows(child, f"{path}.{name}", name in schema.get("required", []))
    items = schema.get("items")
    if isinstance(items, dict) and "properties" in items:
        for name, child in items["properties"].items():
            yield from _rows(child, f"{path}[].{name}", name in items.get("required", []))


def render_reference() -> str:
    root = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
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
        for path, kind, default, description, notes in _rows(root[section], section, False):
            if path == section:
                continue
            lines.append(f"| `{path}` | {kind} | {f'`{default}`' if default else ''} | {description} | {notes} |")
        lines.append("")
    return "\n".join(lines)
