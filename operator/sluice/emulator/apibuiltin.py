"""Unknown fields in built-in kinds, found as kube-apiserver's strict decoder finds them, for `fieldValidation`.

Local-stack tool, called by `apistore.Store` for the built-in kinds it serves (Deployments, Secrets, RBAC, ...).
A real API server decodes a built-in object into its Go struct: a field the struct does not have is dropped, and
reported by `fieldValidation` (Strict: 400 `strict decoding error: unknown field "spec.template.spec.contaners"`;
Warn: a warning). The structs are read from the upstream OpenAPI definitions of Kubernetes 1.32 (shipped by PyPI
`kubernetes-validate`, the same ones `apiopenapi` serves): properties name the fields, `additionalProperties` the
maps, and a definition with neither (RawExtension, JSON) takes anything. Types and values of built-in kinds are
not checked.
"""

from __future__ import annotations

from typing import Any

from sluice.emulator.apiopenapi import builtin_definition_for, upstream_definitions

# CRDs carry JSON Schemas whose keywords ($ref, x-kubernetes-*) the converted definitions do not describe exactly.
UNCHECKED = {("apiextensions.k8s.io", "CustomResourceDefinition")}


def _resolve(schema: dict[str, Any], definitions: dict[str, Any]) -> dict[str, Any]:
    for _ in range(20):
        ref = schema.get("$ref")
        if not isinstance(ref, str):
            return schema
        schema = definitions.get(ref.rsplit("/", 1)[-1], {})
    return schema


def _prune(schema: dict[str, Any], value: Any, path: str, definitions: dict[str, Any], found: list[str]) -> Any:
    schema = _resolve(schema, definitions)
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if not props and not isinstance(extra, dict):
            return value  # RawExtension, JSON: anything goes
        kept: dict[str, Any] = {}
        for key, child in value.items():
            child_path = f"{path}.{key}" if path else key
            if props and key in props:
                kept[key] = _prune(props[key], child, child_path, definitions, found)
            elif isinstance(extra, dict):
                kept[key] = _prune(extra, child, child_path, definitions, found)
            else:
                found.append(child_path)
        return kept
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_prune(schema["items"], item, f"{path}[{i}]", definitions, found) for i, item in enumerate(value)]
    return value


def prune_unknown_fields(group: str, version: str, kind: str, obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The object without the fields its Go struct lacks, and their paths; unchanged for kinds not described."""
    if (group, kind) in UNCHECKED:
        return obj, []
    name = builtin_definition_for(group, version, kind)
    if name is None:
        return obj, []
    definitions = upstream_definitions()
    found: list[str] = []
    pruned = _prune(definitions[name], obj, "", definitions, found)
    return pruned, found
