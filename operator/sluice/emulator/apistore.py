"""The object store behind the Kubernetes API emulator: what an API server does to objects, without HTTP.

Local-stack tool. Implements the semantics clients such as kopf, the official `kubernetes` client and kubectl rely
on: `resourceVersion` (one counter for the whole store), `uid`, `creationTimestamp`, `generation` bumped on spec
changes, optimistic concurrency (409 on a stale resourceVersion, in a PUT, a merge patch or a JSON patch), JSON
merge patch, JSON patch (a failed `test` is 422), strategic merge patch on built-in kinds (treated as a merge
patch; refused with 415 for custom resources, as kube-apiserver does), server-side apply with field ownership and
conflicts (`apiownership`), dry runs (`dry_run()`: the write runs, then the store is put back), delete
preconditions, the status subresource (status is ignored on create and on main-resource writes), finalizers and
`deletionTimestamp`, ownerReference garbage collection (background cascade), CRD registration, update and removal
by writing CustomResourceDefinitions, schema + CEL validation of custom resources (`apivalidation`) with 422 and
per-field causes and `fieldValidation` Strict/Warn/Ignore, metadata validation (`apinames`), size limits
(`apilimits`), label and field selectors (`apiselect`), and an event log for watches from a resourceVersion (410
Gone when older than the history kept).

Simplifications, stated: one storage version per group/plural (objects are served under every version of the
group); strategic merge patch does not merge lists by key and lists are atomic for field ownership; built-in kinds
are not validated against their schemas (only metadata and ConfigMap/Secret size); no admission webhooks.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import jsonpatch

from sluice.emulator.apibuiltin import prune_unknown_fields
from sluice.emulator.apilimits import data_size_errors, exceeds_etcd_limit
from sluice.emulator.apinames import generated_name, metadata_errors
from sluice.emulator.apiownership import (
    Manager,
    Ownership,
    conflict_message,
    deep_apply,
    last_applied_fields,
    owned_leaves,
    remove_path,
)
from sluice.emulator.apiselect import field_selector_matches, label_selector_matches
from sluice.emulator.apivalidation import SchemaRegistry, ValidationFailed

JSON = Any


# metav1.CauseType of each field error kind, as the Status details of a 422 name them.
_CAUSE_TYPES = {
    "Required value": "FieldValueRequired",
    "Unsupported value": "FieldValueNotSupported",
    "Too long": "FieldValueTooLong",
    "Too many": "FieldValueTooMany",
    "Forbidden": "FieldValueForbidden",
    "unknown field": "FieldValueUnknown",
}


class ApiError(Exception):
    """An error the API server answers with a Status object."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "code": self.code,
        }
        if self.reason:  # omitted, as metav1.Status omits an empty reason
            body["reason"] = self.reason
        if self.details:
            body["details"] = self.details
        return body


@dataclass
class ResourceType:
    group: str
    versions: list[str]
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    short_names: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    has_status: bool = False
    printer_columns: list[dict[str, Any]] = field(default_factory=list)
    validated: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.group, self.plural)

    def api_version(self, version: str) -> str:
        return f"{self.group}/{version}" if self.group else version

    @property
    def group_resource(self) -> str:
        """`inferencepools.inference.sluice.dev`, or just `configmaps` in the core group, as errors name resources."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def group_kind(self) -> str:
        """`InferencePool.inference.sluice.dev`, or `ConfigMap`: how `... is invalid` messages name kinds."""
        return f"{self.kind}.{self.group}" if self.group else self.kind


BUILTINS = [
    ResourceType("", ["v1"], "namespaces", "Namespace", False, "namespace", ["ns"], has_status=True),
    ResourceType("", ["v1"], "pods", "Pod", True, "pod", ["po"], ["all"], has_status=True),
    ResourceType("", ["v1"], "services", "Service", True, "service", ["svc"], ["all"], has_status=True),
    ResourceType("", ["v1"], "events", "Event", True, "event", ["ev"]),
    ResourceType("", ["v1"], "secrets", "Secret", True, "secret"),
    ResourceType("", ["v1"], "configmaps", "ConfigMap", True, "configmap", ["cm"]),
    ResourceType("", ["v1"], "serviceaccounts", "ServiceAccount", True, "serviceaccount", ["sa"]),
    ResourceType("events.k8s.io", ["v1"], "events", "Event", True, "event", ["ev"]),
    ResourceType("coordination.k8s.io", ["v1"], "leases", "Lease", True, "lease"),
    # reviews: answered, never stored (`kubectl auth can-i`, `kubectl auth whoami`)
    ResourceType(
        "authorization.k8s.io",
        ["v1"],
        "selfsubjectaccessreviews",
        "SelfSubjectAccessReview",
        False,
        "selfsubjectaccessreview",
    ),
    ResourceType(
        "authentication.k8s.io", ["v1"], "selfsubjectreviews", "SelfSubjectReview", False, "selfsubjectreview"
    ),
    # what the Helm chart renders, and RBAC, which the emulator enforces
    ResourceType("apps", ["v1"], "deployments", "Deployment", True, "deployment", ["deploy"], ["all"], has_status=True),
    ResourceType(
        "policy",
        ["v1"],
        "poddisruptionbudgets",
        "PodDisruptionBudget",
        True,
        "poddisruptionbudget",
        ["pdb"],
        has_status=True,
    ),
    ResourceType("networking.k8s.io", ["v1"], "networkpolicies", "NetworkPolicy", True, "networkpolicy", ["netpol"]),
    # API Priority and Fairness objects are stored and served; the emulator does not queue requests by them
    ResourceType(
        "flowcontrol.apiserver.k8s.io", ["v1"], "flowschemas", "FlowSchema", False, "flowschema", has_status=True
    ),
    ResourceType(
        "flowcontrol.apiserver.k8s.io",
        ["v1"],
        "prioritylevelconfigurations",
        "PriorityLevelConfiguration",
        False,
        "prioritylevelconfiguration",
        has_status=True,
    ),
    ResourceType("rbac.authorization.k8s.io", ["v1"], "roles", "Role", True, "role"),
    ResourceType("rbac.authorization.k8s.io", ["v1"], "rolebindings", "RoleBinding", True, "rolebinding"),
    ResourceType("rbac.authorization.k8s.io", ["v1"], "clusterroles", "ClusterRole", False, "clusterrole"),
    ResourceType(
        "rbac.authorization.k8s.io", ["v1"], "clusterrolebindings", "ClusterRoleBinding", False, "clusterrolebinding"
    ),
    ResourceType(
        "apiextensions.k8s.io",
        ["v1"],
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        "customresourcedefinition",
        ["crd", "crds"],
        has_status=True,
    ),
]


# Custom resources have no Go struct to merge by, so kube-apiserver refuses strategic merge patches for them.
CUSTOM_RESOURCE_PATCH_TYPES = [
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/apply-patch+yaml",
]


CRD_KEY = ("apiextensions.k8s.io", "customresourcedefinitions")


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ------------------------------------------------------------------------------------------------ patches


def parse_apply_body(body: bytes) -> Any:
    """An apply configuration: JSON (what clients send; YAML's subset, parsed by the C parser) or YAML (libyaml's
    loader when PyYAML has it; same documents, same errors, ~10x faster than the pure-Python one)."""
    import yaml  # noqa: PLC0415 - only this path needs it

    stripped = body.lstrip()
    if stripped[:1] == b"{":
        try:
            return json.loads(stripped) or {}
        except ValueError:
            pass  # not JSON after all (YAML flow mappings look alike): the YAML parser decides
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(body, Loader=loader) or {}


def merge_patch(target: JSON, patch: JSON) -> JSON:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _fold_string_data(rtype: ResourceType, obj: dict[str, Any]) -> None:
    """A Secret's write-only `stringData` is stored base64-encoded in `data`, as the API server does."""
    if rtype.key == ("", "secrets") and "stringData" in obj:
        data = obj.setdefault("data", {})
        for key, value in (obj.pop("stringData") or {}).items():
            data[key] = base64.b64encode(str(value).encode()).decode()


# ------------------------------------------------------------------------------------------------ the store


@dataclass
class WatchEvent:
    resource_version: int
    key: tuple[str, str]
    type: str
    obj: dict[str, Any]


class Store:
    """Every object, keyed by (group, plural) then (namespace, name); one resourceVersion counter."""

    def __init__(self, history: int = 20000) -> None:
        self.types: dict[tuple[str, str], ResourceType] = {rt.key: rt for rt in BUILTINS}
        self.objects: dict[tuple[str, str], dict[tuple[str, str], dict[str, Any]]] = {}
        self.log: deque[WatchEvent] = deque(maxlen=history)
        self.revision = 1000
        self.schemas = SchemaRegistry()
        # Per request, set by the HTTP layer: how unknown fields are judged, and the warnings to send back.
        self.field_validation = "Warn"
        self.warnings: list[str] = []
        self.dry = False  # inside dry_run(): nothing reaches storage, so storage limits do not apply
        self.ownership = Ownership()  # managedFields: who owns which fields of each object

    # ---- types

    def find_type(self, group: str, plural: str) -> ResourceType:
        try:
            return self.types[(group, plural)]
        except KeyError:
            raise ApiError(
                404, "NotFound", f"the server could not find the requested resource ({plural}.{group})"
            ) from None

    def register_crd(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        names = spec["names"]
        versions = [v["name"] for v in spec["versions"] if v.get("served", True)]
        storage = next((v for v in spec["versions"] if v.get("storage")), spec["versions"][0])
        self.types[(spec["group"], names["plural"])] = ResourceType(
            group=spec["group"],
            versions=versions,
            plural=names["plural"],
            kind=names["kind"],
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            singular=names.get("singular", names["kind"].lower()),
            short_names=list(names.get("shortNames", [])),
            categories=list(names.get("categories", [])),
            has_status="status" in storage.get("subresources", {}),
            printer_columns=list(storage.get("additionalPrinterColumns", [])),
            validated=True,
        )
        self.schemas.add_crd(crd)

    # ---- bookkeeping

    def _bump(self) -> int:
        self.revision += 1
        return self.revision

    @contextlib.contextmanager
    def dry_run(self) -> Iterator[None]:
        """`dryRun=All`: run the write through every check and default, then put the store back as it was."""
        saved = (
            copy.deepcopy(self.objects),
            copy.deepcopy(self.ownership.managers),
            list(self.log),
            self.revision,
            dict(self.types),
            self.schemas.snapshot(),
        )
        self.dry = True
        try:
            yield
        finally:
            self.dry = False
            objects, owned, log, revision, types, schemas = saved
            self.objects, self.ownership.managers, self.revision, self.types = objects, owned, revision, types
            self.log.clear()
            self.log.extend(log)
            self.schemas.restore(schemas)

    def _record(self, rtype: ResourceType, event_type: str, obj: dict[str, Any]) -> None:
        self.log.append(WatchEvent(int(obj["metadata"]["resourceVersion"]), rtype.key, event_type, copy.deepcopy(obj)))

    def bucket(self, rtype: ResourceType) -> dict[tuple[str, str], dict[str, Any]]:
        return self.objects.setdefault(rtype.key, {})

    def _validate(
        self, rtype: ResourceType, version: str, obj: dict[str, Any], old: dict[str, Any] | None
    ) -> dict[str, Any]:
        candidate = {**obj, "apiVersion": rtype.api_version(version), "kind": rtype.kind}
        if not rtype.validated:
            pruned, unknown = prune_unknown_fields(rtype.group, version, rtype.kind, candidate)
            self._judge_unknown_fields(unknown)
            return pruned
        try:
            checked, unknown = self.schemas.check(candidate, old)
        except ValidationFailed as failure:
            self._judge_unknown_fields(failure.unknown_fields)
            causes = [
                {
                    "reason": _CAUSE_TYPES.get(e.kind, "FieldValueInvalid"),
                    "message": f"{e.kind}: {e.detail}" if e.kind != "unknown field" else str(e),
                    "field": e.path,
                }
                for e in failure.errors
            ]
            raise ApiError(
                422,
                "Invalid",
                str(failure),
                {
                    "name": obj.get("metadata", {}).get("name", ""),
                    "group": rtype.group,
                    "kind": rtype.kind,
                    "causes": causes,
                },
            ) from None
        self._judge_unknown_fields(unknown)
        return checked

    def _check_metadata(self, rtype: ResourceType, meta: dict[str, Any], obj: dict[str, Any]) -> None:
        errors = metadata_errors(rtype.key, meta) + data_size_errors(rtype.key, obj)
        if errors:
            raise self._invalid(rtype, meta.get("name") or meta.get("generateName", ""), errors)

    def _check_storable(self, obj: dict[str, Any]) -> None:
        if not self.dry and exceeds_etcd_limit(obj):
            # kube-apiserver passes etcd's error on as it is: a 500 without a reason.
            raise ApiError(500, "", "etcdserver: request is too large")

    @staticmethod
    def _invalid(rtype: ResourceType, name: str, errors: list[tuple[str, str, str]]) -> ApiError:
        """422 Invalid as apimachinery words it: one error bare, several in brackets."""
        texts = [f"{field_path}: {message}" for field_path, _, message in errors]
        listed = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
        return ApiError(
            422,
            "Invalid",
            f'{rtype.group_kind} "{name}" is invalid: {listed}',
            {
                "name": name,
                "group": rtype.group,
                "kind": rtype.kind,
                "causes": [{"reason": reason, "message": message, "field": path} for path, reason, message in errors],
            },
        )

    def _judge_unknown_fields(self, paths: list[str]) -> None:
        """`fieldValidation`: Strict refuses unknown fields (400, before any other check), Warn warns, both prune."""
        found = [f'unknown field "{path}"' for path in paths]
        if not found or self.field_validation == "Ignore":
            return
        if self.field_validation == "Strict":
            raise ApiError(400, "BadRequest", "strict decoding error: " + ", ".join(found))
        self.warnings += found

    @staticmethod
    def _spec_part(obj: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}

    # ---- reads

    def get(self, rtype: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self.bucket(rtype).get((namespace or "", name))
        if obj is None:
            raise ApiError(
                404,
                "NotFound",
                f'{rtype.group_resource} "{name}" not found',
                {"name": name, "group": rtype.group, "kind": rtype.plural},
            )
        return obj

    def select(
        self, rtype: ResourceType, namespace: str | None, labels: str | None = None, fields: str | None = None
    ) -> list[dict[str, Any]]:
        return [
            obj
            for (ns, _), obj in sorted(self.bucket(rtype).items())
            if (namespace is None or ns == namespace)
            and label_selector_matches(labels, obj["metadata"].get("labels", {}))
            and field_selector_matches(fields, obj)
        ]

    def events_since(self, rtype: ResourceType, resource_version: int) -> list[WatchEvent]:
        if self.log and resource_version < self.log[0].resource_version - 1 and len(self.log) == self.log.maxlen:
            oldest = self.log[0].resource_version - 1
            raise ApiError(410, "Expired", f"too old resource version: {resource_version} ({oldest})")
        newer: list[WatchEvent] = []
        for event in reversed(self.log):  # the log is in resourceVersion order: read back to the watcher's
            if event.resource_version <= resource_version:
                break
            if event.key == rtype.key:
                newer.append(event)
        newer.reverse()
        return newer

    # ---- writes

    def create(
        self,
        rtype: ResourceType,
        version: str,
        namespace: str | None,
        body: dict[str, Any],
        manager: str = "",
        applied: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Store a new object; `applied` is the configuration when server-side apply creates it."""
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = generated_name(meta["generateName"])
        name = meta.get("name")
        if not name:
            required = ("metadata.name", "FieldValueRequired", "Required value: name or generateName is required")
            raise self._invalid(rtype, "", [required])
        if namespace and rtype.namespaced and meta.get("namespace") not in (None, "", namespace):
            raise ApiError(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the request",
            )
        ns = (namespace or meta.get("namespace") or "default") if rtype.namespaced else ""
        if rtype.namespaced and ("", ns) not in self.bucket(self.types[("", "namespaces")]):
            raise ApiError(404, "NotFound", f'namespaces "{ns}" not found', {"name": ns, "kind": "namespaces"})
        self._check_metadata(rtype, meta, obj)
        if (ns, name) in self.bucket(rtype):
            raise ApiError(
                409,
                "AlreadyExists",
                f'{rtype.group_resource} "{name}" already exists',
                {"name": name, "group": rtype.group, "kind": rtype.plural},
            )
        if rtype.has_status and rtype.validated:
            obj.pop("status", None)
        _fold_string_data(rtype, obj)
        obj = self._validate(rtype, version, obj, None)
        meta = obj["metadata"]
        if rtype.namespaced:
            meta["namespace"] = ns
        meta.update(
            uid=str(uuid.uuid4()), creationTimestamp=now_rfc3339(), generation=1, resourceVersion=str(self._bump())
        )
        object_key = (rtype.key, ns, name)
        if manager:
            operation = "Apply" if applied is not None else "Update"
            creator = Manager(manager, operation, rtype.api_version(version), time=now_rfc3339())
            self.ownership.record_create(
                object_key, creator, owned_leaves(applied if applied is not None else obj, None)
            )
        else:
            self.ownership.forget(object_key)
        meta["managedFields"] = self.ownership.render(object_key)
        obj["apiVersion"], obj["kind"] = rtype.api_version(version), rtype.kind
        self._check_storable(obj)
        self.bucket(rtype)[(ns, name)] = obj
        self._record(rtype, "ADDED", obj)
        if rtype.key == CRD_KEY:
            self.register_crd(obj)
        return obj

    def replace(
        self,
        rtype: ResourceType,
        version: str,
        namespace: str | None,
        name: str,
        new: dict[str, Any],
        subresource: str | None = None,
        check_version: bool = True,
        manager: str = "",
        operation: str = "Update",
    ) -> dict[str, Any]:
        """Write `new` as the object's next state: the common path of PUT, PATCH and apply.

        `manager` owns what an update changes; for an apply (`operation="Apply"`) the caller keeps the books.
        """
        old = self.get(rtype, namespace, name)
        wanted = new.get("metadata", {}).get("resourceVersion")
        if check_version and wanted and wanted != old["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {rtype.group_resource} "{name}": '
                "the object has been modified; please apply your changes to the latest version and try again",
                {"name": name, "group": rtype.group, "kind": rtype.plural},
            )
        candidate = copy.deepcopy(new)
        if rtype.has_status:
            if subresource == "status":
                candidate = {**copy.deepcopy(old), "status": candidate.get("status")}
                if candidate["status"] is None:
                    candidate.pop("status")
            else:
                candidate.pop("status", None)
                if "status" in old:
                    candidate["status"] = copy.deepcopy(old["status"])
        meta = candidate.setdefault("metadata", {})
        for key in ("uid", "creationTimestamp", "namespace", "name"):
            if key in old["metadata"]:
                meta[key] = old["metadata"][key]
        meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        meta["generation"] = old["metadata"].get("generation", 1)
        # A write without managedFields keeps them; one with different managedFields sets them.
        written_fields = meta.get("managedFields")
        meta["managedFields"] = copy.deepcopy(old["metadata"].get("managedFields", []))
        candidate["apiVersion"], candidate["kind"] = rtype.api_version(version), rtype.kind
        _fold_string_data(rtype, candidate)
        if subresource != "status":
            self._check_metadata(rtype, meta, candidate)
            candidate = self._validate(rtype, version, candidate, old)
            meta = candidate["metadata"]  # pruning built-in kinds returns a new object: write its metadata
        object_key = (rtype.key, old["metadata"].get("namespace", ""), name)
        owners_before = self.ownership.snapshot(object_key)
        if written_fields not in (None, old["metadata"].get("managedFields", [])):
            self.ownership.load(object_key, written_fields or [])
        elif operation == "Update" and manager:
            updater = Manager(manager, "Update", rtype.api_version(version), subresource or "", now_rfc3339())
            self.ownership.record_update(object_key, updater, old, candidate)
        meta["managedFields"] = self.ownership.render(object_key)
        if candidate == old:
            return old  # a no-op write changes nothing, not even the resourceVersion
        if self._spec_part(candidate) != self._spec_part(old):
            meta["generation"] = old["metadata"].get("generation", 1) + 1
        meta["resourceVersion"] = str(self._bump())
        finalizers = meta.get("finalizers") or []
        if meta.get("deletionTimestamp") and not finalizers:
            return self._remove(rtype, candidate)
        try:
            self._check_storable(candidate)
        except ApiError:
            self.ownership.restore(object_key, owners_before)
            raise
        self.bucket(rtype)[(old["metadata"].get("namespace", ""), name)] = candidate
        self._record(rtype, "MODIFIED", candidate)
        if rtype.key == CRD_KEY:
            self.register_crd(candidate)  # a changed CRD changes what is served: schema, printer columns, versions
        return candidate

    def patch(
        self,
        rtype: ResourceType,
        version: str,
        namespace: str | None,
        name: str,
        content_type: str,
        body: bytes,
        subresource: str | None,
        manager: str,
        force: bool,
    ) -> dict[str, Any]:
        kind = content_type.split(";", maxsplit=1)[0].strip()
        if kind == "application/apply-patch+yaml":
            return self.apply(rtype, version, namespace, name, body, subresource, manager, force)
        old = self.get(rtype, namespace, name)
        try:
            document = json.loads(body or b"{}")
        except json.JSONDecodeError as failure:
            raise ApiError(400, "BadRequest", f"invalid JSON in patch: {failure}") from None
        if kind == "application/json-patch+json":
            try:
                new = jsonpatch.apply_patch(old, document)
            except jsonpatch.JsonPatchTestFailed as failure:
                raise ApiError(
                    422, "Invalid", f"the server rejected our request due to an error in our request: {failure}"
                ) from None
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as failure:
                raise ApiError(422, "Invalid", f"invalid JSON patch: {failure}") from None
            # The patched object's resourceVersion is a precondition: a patch that sets a stale one conflicts.
            return self.replace(rtype, version, namespace, name, new, subresource, manager=manager)
        if kind == "application/strategic-merge-patch+json" and rtype.validated:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - accepted media types include: "
                f"{', '.join(CUSTOM_RESOURCE_PATCH_TYPES)}",
            )
        if kind in ("application/merge-patch+json", "application/strategic-merge-patch+json", "application/json"):
            new = merge_patch(old, document)
            return self.replace(rtype, version, namespace, name, new, subresource, manager=manager)
        raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {kind}")

    def apply(
        self,
        rtype: ResourceType,
        version: str,
        namespace: str | None,
        name: str,
        body: bytes,
        subresource: str | None,
        manager: str,
        force: bool,
    ) -> dict[str, Any]:
        """Server-side apply, with conflicts against the fields other managers own (see `apiownership`)."""
        if not manager:
            raise ApiError(
                422,
                "Invalid",
                'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: is required for apply patch',
            )
        applied = parse_apply_body(body)
        bucket = self.bucket(rtype)
        ns = (namespace or "") if rtype.namespaced else ""
        if (ns, name) not in bucket:
            if subresource:
                self.get(rtype, namespace, name)
            return self.create(rtype, version, namespace, applied, manager, applied=applied)
        old = bucket[(ns, name)]
        object_key = (rtype.key, ns, name)
        applier = Manager(manager, "Apply", rtype.api_version(version), subresource or "", now_rfc3339())
        conflicts = self.ownership.conflicts(object_key, applier, applied, old)
        if conflicts and manager == "kubectl":
            # fieldmanager's lastAppliedManager: kubectl's server-side apply takes over, without conflict, the
            # fields its client-side apply set (those in the last-applied annotation).
            allowed = last_applied_fields(old)
            conflicts = [c for c in conflicts if not any(c.path[: len(p)] == p for p in allowed)]
            force = force or not conflicts
        if conflicts and not force:
            causes = [
                {
                    "reason": "FieldManagerConflict",
                    "message": f"conflict with {c.manager.printed()}",
                    "field": c.field_path,
                }
                for c in conflicts
            ]
            raise ApiError(409, "Conflict", conflict_message(conflicts), {"causes": causes})
        saved = self.ownership.snapshot(object_key)
        try:
            dropped = self.ownership.record_apply(object_key, applier, owned_leaves(applied, subresource), force)
            new = copy.deepcopy(old)
            for path in dropped:
                remove_path(new, path)
            deep_apply(new, self._spec_or_status(applied, subresource))
            meta = applied.get("metadata") or {}
            for key in ("labels", "annotations"):
                if meta.get(key):
                    new["metadata"].setdefault(key, {}).update(meta[key])
            for key in ("ownerReferences", "finalizers"):
                if meta.get(key) is not None:
                    new["metadata"][key] = meta[key]
            new["metadata"].pop("managedFields", None)
            return self.replace(
                rtype, version, namespace, name, new, subresource, check_version=False, operation="Apply"
            )
        except ApiError:
            self.ownership.restore(object_key, saved)
            raise

    @staticmethod
    def _spec_or_status(applied: dict[str, Any], subresource: str | None) -> dict[str, Any]:
        if subresource == "status":
            return {"status": applied.get("status", {})}
        return {k: v for k, v in applied.items() if k not in ("metadata", "apiVersion", "kind", "status")}

    def delete(
        self, rtype: ResourceType, namespace: str | None, name: str, preconditions: dict[str, str] | None = None
    ) -> dict[str, Any]:
        obj = self.get(rtype, namespace, name)
        for field_name, meta_name in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
            wanted, actual = (preconditions or {}).get(field_name), obj["metadata"].get(field_name)
            if wanted and wanted != actual:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {rtype.group_resource} "{name}": '
                    f"Precondition failed: {meta_name} in precondition: {wanted}, {meta_name} in object meta: {actual}",
                    {"name": name, "group": rtype.group, "kind": rtype.plural},
                )
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                marked = copy.deepcopy(obj)
                marked["metadata"]["deletionTimestamp"] = now_rfc3339()
                marked["metadata"]["resourceVersion"] = str(self._bump())
                self.bucket(rtype)[(obj["metadata"].get("namespace", ""), name)] = marked
                self._record(rtype, "MODIFIED", marked)
                return marked
            return obj
        return self._remove(rtype, obj)

    def _remove(self, rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        self.bucket(rtype).pop((meta.get("namespace", ""), meta["name"]), None)
        gone = copy.deepcopy(obj)
        gone["metadata"]["resourceVersion"] = str(self._bump())
        self._record(rtype, "DELETED", gone)
        self.ownership.forget((rtype.key, meta.get("namespace", ""), meta["name"]))
        self._collect_garbage(meta["uid"])
        if rtype.key == CRD_KEY:
            self._unregister_crd(obj)
        return gone

    def _unregister_crd(self, crd: dict[str, Any]) -> None:
        """A deleted CRD takes its custom resources with it, and its API stops being served."""
        key = (crd["spec"]["group"], crd["spec"]["names"]["plural"])
        served = self.types.get(key)
        if served is not None:
            for obj in list(self.bucket(served).values()):
                self._remove(served, obj)
        self.types.pop(key, None)
        self.objects.pop(key, None)

    def _collect_garbage(self, owner_uid: str) -> None:
        """Background cascading deletion: objects whose ownerReferences name a deleted owner go too."""
        for key, bucket in list(self.objects.items()):
            rtype = self.types.get(key)
            if rtype is None:
                continue
            for obj in list(bucket.values()):
                owners = obj["metadata"].get("ownerReferences") or []
                if any(o.get("uid") == owner_uid for o in owners):
                    self.delete(rtype, obj["metadata"].get("namespace"), obj["metadata"]["name"])
