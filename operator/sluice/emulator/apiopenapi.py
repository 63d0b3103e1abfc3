"""The OpenAPI documents of the Kubernetes API emulator: `/openapi/v2`, `/openapi/v3` and one v3 document per group.

Local-stack tool, called by `apiserver`. kubectl needs them: `kubectl apply`'s default validation first reads the v3
documents to learn whether the server supports `fieldValidation` on PATCH (then leaves validation to the server),
`kubectl explain` renders the v3 schema of a kind, and older clients read `/openapi/v2`.

The documents are built as kube-apiserver builds them: built-in kinds from the upstream Kubernetes definitions
(the copy shipped by PyPI `kubernetes-validate`, converted back from its JSON-Schema form), custom resources from
each served CRD version's `openAPIV3Schema` with `metadata` referring to `ObjectMeta`, the kind and its List named
by the reversed group (`dev.sluice.inference.v1alpha1.InferencePool`), and one path per operation carrying
`x-kubernetes-group-version-kind`, `x-kubernetes-action` and the query parameters the server honours.
"""

from __future__ import annotations

import copy
import hashlib
import json
from functools import cache
from importlib.resources import files
from typing import Any

KUBERNETES_SCHEMA_VERSION = "v1.32.0"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
LIST_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ListMeta"
STATUS = "io.k8s.apimachinery.pkg.apis.meta.v1.Status"

_WRITE_PARAMETERS = [
    ("dryRun", "When present, indicates that modifications should not be persisted. The only valid value is All."),
    ("fieldManager", "fieldManager is a name associated with the actor or entity that is making these changes."),
    ("fieldValidation", "Ignore, Warn or Strict: how the server treats unknown and duplicate fields."),
]
_PATCH_PARAMETERS = [
    *_WRITE_PARAMETERS,
    ("force", "Force is going to force Apply requests: it re-acquires conflicting fields owned by other people."),
]
_READ_PARAMETERS = [
    ("labelSelector", "A selector to restrict the list of returned objects by their labels."),
    ("fieldSelector", "A selector to restrict the list of returned objects by their fields."),
    ("resourceVersion", "Which version of the objects to list or watch from."),
    ("watch", "Watch for changes to the described resources."),
    ("allowWatchBookmarks", "Requests watch events with type BOOKMARK."),
    ("timeoutSeconds", "Timeout for the list/watch call."),
]


def _from_json_schema(node: Any, ref_prefix: str) -> Any:
    """Undo kubernetes-validate's JSON-Schema rewrite: `type: [T, "null"]` back to `T`, `$defs` refs back to OpenAPI."""
    if isinstance(node, list):
        return [_from_json_schema(item, ref_prefix) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "type" and isinstance(value, list):
            kinds = [kind for kind in value if kind != "null"]
            out["type"] = kinds[0] if kinds else "object"
        elif key == "$ref" and isinstance(value, str):
            out["$ref"] = ref_prefix + value.rsplit("/", 1)[-1]
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: _from_json_schema(child, ref_prefix) for name, child in value.items()}
        else:
            out[key] = _from_json_schema(value, ref_prefix)
    return out


@cache
def upstream_definitions() -> dict[str, Any]:
    schemas = files("kubernetes_validate") / "kubernetes-json-schema"
    folder = schemas / f"{KUBERNETES_SCHEMA_VERSION}-local"
    if not folder.is_dir():  # a kubernetes-validate release without 1.32: the oldest version it still ships
        local = sorted(
            (entry for entry in schemas.iterdir() if entry.name.endswith("-local")),
            key=lambda entry: tuple(int(part) for part in entry.name[1:].removesuffix("-local").split(".")),
        )
        folder = local[0]
    definitions: dict[str, Any] = json.loads((folder / "_definitions.json").read_text())["$defs"]
    # The upstream OpenAPI spells IntOrString as a string with a format; kubernetes-validate made it a oneOf.
    definitions["io.k8s.apimachinery.pkg.util.intstr.IntOrString"] = {
        "type": "string",
        "format": "int-or-string",
        "description": "IntOrString is a type that can hold an int32 or a string.",
    }
    for schema in definitions.values():
        props = schema.get("properties", {})
        for name in ("apiVersion", "kind"):
            if isinstance(props.get(name), dict):
                props[name].pop("enum", None)  # added by kubernetes-validate, not in the upstream document
    return definitions


@cache
def _converted_definitions(ref_prefix: str) -> dict[str, Any]:
    converted: dict[str, Any] = _from_json_schema(upstream_definitions(), ref_prefix)
    return converted


def builtin_definitions(ref_prefix: str) -> dict[str, Any]:
    """The upstream definitions with refs under `ref_prefix`; a fresh mapping over shared (read-only) schemas."""
    return dict(_converted_definitions(ref_prefix))


def definition_name(group: str, version: str, kind: str) -> str:
    """`inference.sluice.dev` → `dev.sluice.inference.v1alpha1.InferencePool`, as kube-apiserver names CRD kinds."""
    return ".".join([*reversed(group.split(".")), version, kind])


def builtin_definition_for(group: str, version: str, kind: str) -> str | None:
    for name, schema in upstream_definitions().items():
        for gvk in schema.get("x-kubernetes-group-version-kind", []):
            if (gvk.get("group", ""), gvk.get("version"), gvk.get("kind")) == (group, version, kind):
                return name
    return None


def _crd_schemas(crd: dict[str, Any], version: dict[str, Any], ref_prefix: str, v2: bool) -> dict[str, Any]:
    spec = crd["spec"]
    group, kind = spec["group"], spec["names"]["kind"]
    schema = copy.deepcopy((version.get("schema") or {}).get("openAPIV3Schema") or {"type": "object"})
    if v2:
        schema = _v2_compatible(schema)
    properties = schema.setdefault("properties", {})
    properties["apiVersion"] = {
        "type": "string",
        "description": "APIVersion defines the versioned schema of this representation of an object.",
    }
    properties["kind"] = {"type": "string", "description": "Kind is a string value representing the REST resource."}
    meta_description = "Standard object's metadata."
    properties["metadata"] = (
        {"$ref": ref_prefix + OBJECT_META, "description": meta_description}
        if v2
        else {"allOf": [{"$ref": ref_prefix + OBJECT_META}], "default": {}, "description": meta_description}
    )
    schema["x-kubernetes-group-version-kind"] = [{"group": group, "kind": kind, "version": version["name"]}]
    list_schema = {
        "type": "object",
        "required": ["items"],
        "description": f"{kind}List is a list of {kind}",
        "properties": {
            "apiVersion": properties["apiVersion"],
            "kind": properties["kind"],
            "items": {
                "type": "array",
                "description": f"List of {spec['names']['plural']}.",
                "items": {"$ref": ref_prefix + definition_name(group, version["name"], kind)},
            },
            "metadata": {"$ref": ref_prefix + LIST_META, "description": "Standard list metadata."},
        },
        "x-kubernetes-group-version-kind": [{"group": group, "kind": f"{kind}List", "version": version["name"]}],
    }
    return {
        definition_name(group, version["name"], kind): schema,
        definition_name(group, version["name"], f"{kind}List"): list_schema,
    }


def _v2_compatible(schema: Any) -> Any:
    """OpenAPI v2 has no nullable/oneOf/anyOf/not: kube-apiserver drops them when publishing CRDs in v2."""
    if isinstance(schema, list):
        return [_v2_compatible(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    dropped = {"nullable", "oneOf", "anyOf", "not", "x-kubernetes-validations"}
    return {key: _v2_compatible(value) for key, value in schema.items() if key not in dropped}


class ServedType:
    """What the documents need of one served resource type (kept free of the store's classes)."""

    def __init__(self, group: str, version: str, plural: str, kind: str, namespaced: bool, has_status: bool) -> None:
        self.group, self.version, self.plural, self.kind = group, version, plural, kind
        self.namespaced, self.has_status = namespaced, has_status

    @property
    def group_version_path(self) -> str:
        return f"apis/{self.group}/{self.version}" if self.group else f"api/{self.version}"


def _parameters(names: list[tuple[str, str]], v3: bool) -> list[dict[str, Any]]:
    if v3:
        return [
            {"name": name, "in": "query", "description": text, "schema": {"type": "string", "uniqueItems": True}}
            for name, text in names
        ]
    return [
        {"name": name, "in": "query", "description": text, "type": "string", "uniqueItems": True}
        for name, text in names
    ]


def _operation(
    served: ServedType, action: str, verb: str, ref: str, parameters: list[tuple[str, str]], v3: bool
) -> dict[str, Any]:
    response_schema = {"$ref": ref}
    operation: dict[str, Any] = {
        "operationId": f"{verb}{served.kind}",
        "description": f"{verb} {served.kind}",
        "parameters": _parameters(parameters, v3),
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": {"group": served.group, "version": served.version, "kind": served.kind},
    }
    if v3:
        operation["responses"] = {
            "200": {"description": "OK", "content": {"application/json": {"schema": response_schema}}}
        }
        if action in ("post", "put", "patch"):
            media = (
                ["application/apply-patch+yaml", "application/json-patch+json", "application/merge-patch+json"]
                if action == "patch"
                else ["application/json"]
            )
            operation["requestBody"] = {
                "required": True,
                "content": {kind: {"schema": {"$ref": ref}} for kind in media},
            }
    else:
        operation["responses"] = {"200": {"description": "OK", "schema": response_schema}}
        operation["consumes"] = ["*/*"]
        operation["produces"] = ["application/json"]
        if action in ("post", "put", "patch"):
            operation["parameters"].insert(0, {"name": "body", "in": "body", "required": True, "schema": {"$ref": ref}})
    return operation


def _paths(served: ServedType, kind_ref: str, list_ref: str, v3: bool) -> dict[str, Any]:
    prefix = f"/{served.group_version_path}"
    collection = (
        f"{prefix}/namespaces/{{namespace}}/{served.plural}" if served.namespaced else f"{prefix}/{served.plural}"
    )
    item = f"{collection}/{{name}}"
    paths: dict[str, Any] = {
        collection: {
            "get": _operation(served, "list", "list", list_ref, _READ_PARAMETERS, v3),
            "post": _operation(served, "post", "create", kind_ref, _WRITE_PARAMETERS, v3),
        },
        item: {
            "get": _operation(served, "get", "read", kind_ref, [], v3),
            "put": _operation(served, "put", "replace", kind_ref, _WRITE_PARAMETERS, v3),
            "patch": _operation(served, "patch", "patch", kind_ref, _PATCH_PARAMETERS, v3),
            "delete": _operation(served, "delete", "delete", kind_ref, _WRITE_PARAMETERS[:1], v3),
        },
    }
    if served.namespaced:
        paths[f"{prefix}/{served.plural}"] = {"get": _operation(served, "list", "list", list_ref, _READ_PARAMETERS, v3)}
    if served.has_status:
        paths[f"{item}/status"] = {
            "get": _operation(served, "get", "read", kind_ref, [], v3),
            "put": _operation(served, "put", "replace", kind_ref, _WRITE_PARAMETERS, v3),
            "patch": _operation(served, "patch", "patch", kind_ref, _PATCH_PARAMETERS, v3),
        }
    return paths


def _definitions_for(served: list[ServedType], crds: list[dict[str, Any]], ref_prefix: str, v2: bool) -> dict[str, Any]:
    """Every schema the served types need, CRD kinds overriding nothing built in."""
    definitions = builtin_definitions(ref_prefix)
    for crd in crds:
        for version in crd["spec"]["versions"]:
            if version.get("served", True):
                definitions.update(_crd_schemas(crd, version, ref_prefix, v2))
    return definitions


def _refs(node: Any, found: set[str], definitions: dict[str, Any], ref_prefix: str) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(ref_prefix):
            name = ref[len(ref_prefix) :]
            if name not in found and name in definitions:
                found.add(name)
                _refs(definitions[name], found, definitions, ref_prefix)
        for value in node.values():
            _refs(value, found, definitions, ref_prefix)
    elif isinstance(node, list):
        for value in node:
            _refs(value, found, definitions, ref_prefix)


def _kind_refs(served: ServedType, definitions: dict[str, Any], ref_prefix: str) -> tuple[str, str]:
    kind_name = builtin_definition_for(served.group, served.version, served.kind) or definition_name(
        served.group, served.version, served.kind
    )
    list_name = builtin_definition_for(served.group, served.version, f"{served.kind}List") or definition_name(
        served.group, served.version, f"{served.kind}List"
    )
    if kind_name not in definitions:
        definitions[kind_name] = {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
            "x-kubernetes-group-version-kind": [
                {"group": served.group, "version": served.version, "kind": served.kind}
            ],
        }
    return ref_prefix + kind_name, ref_prefix + list_name


_INFO = {"title": "Kubernetes", "version": "v1.32.0-sluice-local"}


def openapi_v3_group_version(served: list[ServedType], crds: list[dict[str, Any]], path: str) -> dict[str, Any] | None:
    """The v3 document for `apis/<group>/<version>` or `api/v1`; None if nothing is served there."""
    prefix = "#/components/schemas/"
    chosen = [s for s in served if s.group_version_path == path]
    if not chosen:
        return None
    definitions = _definitions_for(served, crds, prefix, v2=False)
    paths: dict[str, Any] = {}
    for item in chosen:
        kind_ref, list_ref = _kind_refs(item, definitions, prefix)
        paths.update(_paths(item, kind_ref, list_ref, v3=True))
    needed: set[str] = set()
    _refs(paths, needed, definitions, prefix)
    _refs({"$ref": prefix + STATUS}, needed, definitions, prefix)
    return {
        "openapi": "3.0.0",
        "info": _INFO,
        "paths": paths,
        "components": {"schemas": {name: definitions[name] for name in sorted(needed)}},
    }


def openapi_v3_root(served: list[ServedType], crds: list[dict[str, Any]]) -> dict[str, Any]:
    """The v3 discovery document: each group-version's document address, with a hash of its content for caching."""
    paths: dict[str, Any] = {}
    for path in sorted({s.group_version_path for s in served}):
        document = openapi_v3_group_version(served, crds, path)
        digest = hashlib.sha512(json.dumps(document, sort_keys=True).encode()).hexdigest().upper()
        paths[path] = {"serverRelativeURL": f"/openapi/v3/{path}?hash={digest}"}
    return {"paths": paths}


def openapi_v2(served: list[ServedType], crds: list[dict[str, Any]]) -> dict[str, Any]:
    prefix = "#/definitions/"
    definitions = _definitions_for(served, crds, prefix, v2=True)
    paths: dict[str, Any] = {}
    for item in served:
        kind_ref, list_ref = _kind_refs(item, definitions, prefix)
        paths.update(_paths(item, kind_ref, list_ref, v3=False))
    return {"swagger": "2.0", "info": _INFO, "paths": paths, "definitions": definitions}
