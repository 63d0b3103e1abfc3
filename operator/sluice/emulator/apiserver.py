"""A Kubernetes API emulator for the local stack, built on kmock, runnable as its own process with a kubeconfig.

kmock provides the HTTP server, request parsing, API discovery (`/api`, `/apis`, group/version resource lists)
and Status error rendering; `apistore.Store` provides the object semantics (see its docstring). This module joins
them: serves HTTPS (`apitls`), authenticates and authorizes every request (`apirbac`), routes object requests (get,
list, watch, create, update, patch, server-side apply, delete, the status subresource, TokenRequest) to the
store with `dryRun` and `fieldValidation`, decodes protobuf bodies (`apiprotobuf`), refuses bodies over 3 MiB,
serves the OpenAPI documents (`apiopenapi`), streams watches as JSON lines with bookmarks, answers `kubectl get`
with server-side Tables, keeps discovery in step with CRDs created at run time, and records an audit trail of
every request (user, decision, verb, resource, namespace, subresource, client), and of every allowed write
again once answered, with its response code.

    python -m sluice.emulator.apiserver --kubeconfig out/kubeconfig [--port 0] [--crd FILE ...] [--audit-log FILE]

It prints `ready <url>` once serving and runs until SIGTERM or SIGINT. It listens on 127.0.0.1 only. The
kubeconfig's token is the admin's; `kubectl create token SA` gives a service account's.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import copy
import json
import queue
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import aiohttp.test_utils
import aiohttp.web
import attrs
import kmock
import yaml
from kmock._internal import parsing as kmock_parsing
from multidict import CIMultiDict

from sluice.emulator import apifaultserve, apiopenapi, apiprotobuf, apirbac, apitls
from sluice.emulator.apifaultplan import CloseWatch, ExpireWatch, FaultRule, PlanError, ServerError, Throttle, load_plan
from sluice.emulator.apifaults import (
    FaultInjector,
    FaultRequest,
    WatchCut,
    error_answer,
    throttle_answer,
)
from sluice.emulator.apiselect import as_table, field_selector_matches, label_selector_matches
from sluice.emulator.apistore import ApiError, ResourceType, Store

VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]
ADMIN_TOKEN = "local-stack"
RBAC_GROUP = "rbac.authorization.k8s.io"
# kube-apiserver's MaxRequestBodyBytes: twice etcd's 1.5 MiB, because JSON is larger than the stored protobuf.
MAX_REQUEST_BODY_BYTES = 3 * 1024 * 1024
LIST_CHUNK = 200
"""Items encoded per turn of the event loop in a list: 48,000 pods encoded in one go held every other request
(Lease renewals among them) for seconds; longer lists are streamed in chunks of this many."""

_kmock_parse_path = kmock_parsing.parse_path


def _parse_path(path: str) -> Any:
    """kmock 0.8 reads `/api/v1/namespaces[/NAME[/status]]` (the Namespace resource) as a namespace prefix."""
    parts = path.strip("/").split("/")
    if (
        len(parts) >= 3
        and parts[:3] == ["api", "v1", "namespaces"]
        and (len(parts) <= 4 or (len(parts) == 5 and parts[4] in ("status", "finalize")))
    ):
        name = parts[3] if len(parts) > 3 else None
        sub = parts[4] if len(parts) > 4 else None
        return kmock_parsing.ParsedPath("", "v1", "namespaces", None, name, sub)
    return _kmock_parse_path(path)


kmock_parsing.parse_path = _parse_path


class _Request(aiohttp.web.BaseRequest):
    """A request whose text never fails: kmock decodes every body, and protobuf bodies are not UTF-8."""

    async def text(self) -> str:
        body = await self.read()
        return body.decode(self.charset or "utf-8", errors="replace")


class _HttpServer(aiohttp.test_utils.RawTestServer):
    """kmock's HTTP server, reading bodies past aiohttp's 1 MiB default so the API's own limit decides."""

    async def _make_runner(self, debug: bool = True, **kwargs: Any) -> aiohttp.web.ServerRunner:
        loop = asyncio.get_running_loop()

        def make_request(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> aiohttp.web.BaseRequest:
            return _Request(message, payload, protocol, writer, task, loop, client_max_size=4 * MAX_REQUEST_BODY_BYTES)

        server = aiohttp.web.Server(self._handler, loop=loop, debug=debug, request_factory=make_request, **kwargs)
        return aiohttp.web.ServerRunner(server, debug=debug, **kwargs)


def _created_name(response: Any) -> str:
    """The name of the object a create answered with (a POST names it in the body, not the path)."""
    body = getattr(response, "body", None)
    if response.status != 201 or not isinstance(body, bytes):
        return ""
    with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
        return str(json.loads(body)["metadata"]["name"])
    return ""


class AuditFile:
    """Appends audit entries to a JSON-lines file from its own thread, so no request handler waits on the disk."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._drain, name="audit-log", daemon=True)
        self._thread.start()

    def write(self, entry: dict[str, str]) -> None:
        self._queue.put(json.dumps(entry) + "\n")

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _drain(self) -> None:
        with self.path.open("a") as log:
            while (line := self._queue.get()) is not None:
                log.write(line)
                if self._queue.empty():
                    log.flush()  # readers (the RBAC test) see every entry as soon as the burst is over


BUILTIN_GROUP_PRIORITY = {
    "apiregistration.k8s.io": 18000,
    "apps": 17800,
    "events.k8s.io": 17750,
    "authentication.k8s.io": 17700,
    "authorization.k8s.io": 17600,
    "autoscaling": 17500,
    "batch": 17400,
    "certificates.k8s.io": 17300,
    "networking.k8s.io": 17200,
    "policy": 17100,
    "rbac.authorization.k8s.io": 17000,
    "storage.k8s.io": 16800,
    "admissionregistration.k8s.io": 16700,
    "apiextensions.k8s.io": 16700,
    "scheduling.k8s.io": 16600,
    "coordination.k8s.io": 16500,
    "node.k8s.io": 16300,
    "discovery.k8s.io": 16200,
    "flowcontrol.apiserver.k8s.io": 16100,
}
"""Group priorities of kube-aggregator (pkg/controlplane/apiserver/aggregator.go apiVersionPriorities, 1.32)."""


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesScaffold, apifaultserve.FaultServing):
    store: Store = attrs.field(factory=Store)
    audit: list[dict[str, str]] = attrs.field(factory=list)
    audit_path: Path | None = None
    audit_file: AuditFile | None = attrs.field(default=None, init=False)
    changed: asyncio.Event = attrs.field(factory=asyncio.Event)
    """Set by the next write, then replaced: a watcher takes it before it reads the history, and waits on it."""
    openapi_cache: dict[str, Any] = attrs.field(factory=dict)
    authenticator: apirbac.Authenticator = attrs.field(factory=apirbac.Authenticator)
    rbac: apirbac.Rbac = attrs.field(init=False)
    # kube-apiserver sends a watch bookmark about once a minute to clients that allow them.
    bookmark_interval: float = 60.0
    faults: FaultInjector = attrs.field(factory=FaultInjector)
    """The fault plan (`--faults`, `PUT /_faults`); with no rules, nothing is decided and nothing changes."""
    fault_sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    """How a latency fault waits (tests record the delays instead)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.sync_discovery()
        # The kubeconfig's token is the cluster admin's: system:masters, which RBAC never restricts.
        self.authenticator.add(
            ADMIN_TOKEN, apirbac.User("sluice-local-admin", (apirbac.ADMIN_GROUP, apirbac.AUTHENTICATED))
        )
        self.rbac = apirbac.Rbac(lambda plural: self.store.select(self.store.find_type(RBAC_GROUP, plural), None))

    def sync_discovery(self) -> None:
        self.openapi_cache.clear()
        for rtype in self.store.types.values():
            for version in rtype.versions:
                key = f"{rtype.group}/{version}/{rtype.plural}" if rtype.group else f"v1/{rtype.plural}"
                self.resources[key] = kmock.ResourceInfo(
                    kind=rtype.kind,
                    singular=rtype.singular or rtype.kind.lower(),
                    namespaced=rtype.namespaced,
                    verbs=set(VERBS),
                    shortnames=set(rtype.short_names),
                    categories=set(rtype.categories),
                    subresources={"status"} if rtype.has_status else set(),
                )

    def load_crds(self, path: Path) -> None:
        for document in yaml.safe_load_all(path.read_text()):
            if document and document.get("kind") == "CustomResourceDefinition":
                rtype = self.store.find_type("apiextensions.k8s.io", "customresourcedefinitions")
                self.store.create(rtype, "v1", None, document)
        self.sync_discovery()

    # ------------------------------------------------------------------------------------------ discovery

    async def _serve_server_version(self, request: Any) -> dict[str, Any]:
        # Every field version.Info has: typed clients (the Python client's VersionInfo) require them all.
        return {
            "major": "1",
            "minor": "32",
            "gitVersion": "v1.32.0-sluice-local",
            "gitCommit": "0000000000000000000000000000000000000000",
            "gitTreeState": "clean",
            "buildDate": "2026-01-01T00:00:00Z",
            "goVersion": "go1.23.0",
            "compiler": "gc",
            "platform": "linux/amd64",
        }

    async def _serve_apis(self, request: Any) -> Any:
        """APIGroupList in kube-apiserver's order: built-in groups by their priority (kube-aggregator's
        apiVersionPriorities), then every CRD group (GroupPriorityMinimum 1000 each) by name — the order
        kubectl's RESTMapper takes the first match in, so of two groups serving one plural the first by name wins
        (`inferencepool` is GIE's inference.networking.k8s.io beside inference.sluice.dev)."""
        answer = cast(dict[str, Any], await super()._serve_apis(request))
        groups: list[dict[str, Any]] = answer["groups"]
        answer["groups"] = sorted(groups, key=lambda g: (-BUILTIN_GROUP_PRIORITY.get(g["name"], 1000), g["name"]))
        return answer

    async def _serve_version(self, request: Any) -> dict[str, Any]:
        """APIResourceList as a real server writes it: subresources carry no short names or categories."""
        group, version = request.resource.group or "", request.resource.version
        types = [t for t in self.store.types.values() if t.group == group and version in t.versions]
        if not types:
            raise kmock.KubernetesResourceNotFoundError()
        resources: list[dict[str, Any]] = []
        for rtype in types:
            resources.append(
                {
                    "name": rtype.plural,
                    "singularName": rtype.singular or rtype.kind.lower(),
                    "namespaced": rtype.namespaced,
                    "kind": rtype.kind,
                    "verbs": VERBS,
                    "shortNames": rtype.short_names,
                    "categories": rtype.categories,
                }
            )
            if rtype.has_status:
                resources.append(
                    {
                        "name": f"{rtype.plural}/status",
                        "singularName": "",
                        "namespaced": rtype.namespaced,
                        "kind": rtype.kind,
                        "verbs": ["get", "patch", "update"],
                    }
                )
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": resources,
        }

    # ------------------------------------------------------------------------------------------ OpenAPI

    def _served_types(self) -> tuple[list[apiopenapi.ServedType], list[dict[str, Any]]]:
        served = [
            apiopenapi.ServedType(t.group, version, t.plural, t.kind, t.namespaced, t.has_status)
            for t in self.store.types.values()
            for version in t.versions
        ]
        crd_type = self.store.find_type("apiextensions.k8s.io", "customresourcedefinitions")
        return served, list(self.store.bucket(crd_type).values())

    def _openapi_document(self, path: str) -> dict[str, Any] | None:
        """The document at /openapi/…, built once per set of served types (CRD changes clear the cache)."""
        if path not in self.openapi_cache:
            served, crds = self._served_types()
            if path == "v2":
                self.openapi_cache[path] = apiopenapi.openapi_v2(served, crds)
            elif path == "v3":
                self.openapi_cache[path] = apiopenapi.openapi_v3_root(served, crds)
            elif path.startswith("v3/"):
                self.openapi_cache[path] = apiopenapi.openapi_v3_group_version(served, crds, path[3:])
            else:
                self.openapi_cache[path] = None
        document: dict[str, Any] | None = self.openapi_cache[path]
        return document

    def _serve_openapi(self, request: Any) -> aiohttp.web.StreamResponse:
        path = request.url.path.removeprefix("/openapi/").strip("/")
        accept = request.headers.get("Accept", "")
        if "protobuf" in accept and "json" not in accept and "*/*" not in accept:
            # kube-apiserver serves protobuf too; clients that ask for it retry with JSON on 406.
            failure = ApiError(406, "NotAcceptable", "only application/json is served")
            return aiohttp.web.json_response(failure.status(), status=406)
        document = self._openapi_document(path)
        if document is None:
            failure = ApiError(404, "NotFound", "the server could not find the requested resource")
            return aiohttp.web.json_response(failure.status(), status=404)
        return aiohttp.web.json_response(document)

    # ------------------------------------------------------------------------------------------ routing

    async def _handle(self, request: Any) -> aiohttp.web.StreamResponse:
        requester = self.authenticator.authenticate(request.headers.get("Authorization"))
        if requester is None:
            return aiohttp.web.json_response(ApiError(401, "Unauthorized", "Unauthorized").status(), status=401)
        acting = apirbac.impersonated(request._raw_request.headers, self.rbac, requester)
        if isinstance(acting, str):
            return aiohttp.web.json_response(ApiError(403, "Forbidden", acting).status(), status=403)
        user = acting
        if request.url.path.rstrip("/") == apifaultserve.FAULTS_PATH:
            return self._serve_admin(request, user)
        resource = request.resource
        is_resource = not (
            request.url.path.startswith("/openapi/")
            or resource is None
            or resource.plural is None
            or resource.version is None
            or request.method is None
        )
        if not is_resource:
            if not apirbac.path_allowed(user, request.url.path):
                verb = str(request.method or "get").split(".")[-1].lower()
                denied = ApiError(403, "Forbidden", apirbac.forbidden_path_message(user, verb, request.url.path))
                return aiohttp.web.json_response(denied.status(), status=403)
            if request.url.path.startswith("/openapi/"):
                return self._serve_openapi(request)
            if request.url.path == "/version/":  # the official Python client asks with the slash
                return aiohttp.web.json_response(await self._serve_server_version(request))
            return await super()._handle(request)  # discovery, /version, unknown paths
        raw = request._raw_request
        self._trim_request_history()
        if len(request.body) > MAX_REQUEST_BODY_BYTES:
            too_large = ApiError(
                413, "RequestEntityTooLarge", f"Request entity too large: limit is {MAX_REQUEST_BODY_BYTES}"
            )
            return aiohttp.web.json_response(too_large.status(), status=413)
        try:
            rtype = self.store.find_type(resource.group or "", resource.plural)
        except ApiError as unknown:
            return self._unknown_type(request, user, unknown)
        try:
            if resource.version not in rtype.versions:
                raise ApiError(404, "NotFound", f"the server could not find the requested resource ({resource})")
            asked, decision = await self._decide_fault(request, rtype, user)
            if asked is not None and decision.rule is not None and isinstance(decision.rule.effect, Throttle):
                # API Priority and Fairness rejects before authorization (the filter wraps WithAuthorization).
                return self._serve_fault(asked, request, decision.rule, throttle_answer(decision.rule.effect))
            allowed = False
            try:
                self._authorize(request, rtype, user)
                allowed = True
            finally:
                self._audit(request, rtype, user, allowed)
            if self._creates_by_apply(request, rtype):
                self._authorize_create_on_apply(request, rtype, user)
            if asked is not None and decision.rule is not None and isinstance(decision.rule.effect, ServerError):
                return self._serve_fault(asked, request, decision.rule, error_answer(decision.rule.effect))
            watch_fault = (decision.rule, asked) if asked is not None and decision.rule is not None else None
            response = await self._serve(request, rtype, raw, user, watch_fault)
        except ApiError as failure:
            self._audit_outcome(request, rtype, user, failure.code, message=failure.message)
            return aiohttp.web.json_response(failure.status(), status=failure.code)
        self._audit_outcome(request, rtype, user, response.status, _created_name(response))
        return response

    def _audit_outcome(
        self, request: Any, rtype: ResourceType, user: apirbac.User, code: int, created: str = "", message: str = ""
    ) -> None:
        """A second entry for a write that was allowed, once it is answered: its response code (stage
        ResponseComplete, as kube-apiserver's audit has it), in the order the writes took effect."""
        verb = self._verb(request)
        if verb not in ("create", "update", "patch", "delete") or self.audit_path is None:
            return
        entry = {
            "stage": "ResponseComplete",
            "user": user.name,
            "decision": "allow",
            "verb": verb,
            "group": rtype.group,
            "resource": rtype.plural,
            "subresource": request.subresource or "",
            "namespace": request.namespace or "",
            "name": request.name or created,
            "userAgent": request.headers.get("User-Agent", ""),
            "code": str(code),
        }
        if message:  # kube-apiserver's responseStatus.message: why a write was refused
            entry["message"] = message
        if code == 403:
            return  # refused before it was served: the RequestReceived entry already says so
        self._write_audit(entry)

    def _write_audit(self, entry: dict[str, str]) -> None:
        """Append an entry to the audit log file, when there is one (opened at the first entry)."""
        if self.audit_path is None:
            return
        if self.audit_file is None:
            self.audit_file = AuditFile(self.audit_path)
        self.audit_file.write(entry)

    def _creates_by_apply(self, request: Any, rtype: ResourceType) -> bool:
        is_apply = request.headers.get("Content-Type", "").startswith("application/apply-patch")
        return (
            self._verb(request) == "patch"
            and is_apply
            and not request.subresource
            and self._current(rtype, request.namespace if rtype.namespaced else None, request.name) is None
        )

    def _authorize_create_on_apply(self, request: Any, rtype: ResourceType, user: apirbac.User) -> None:
        """A server-side apply that creates needs `create` too (the patch handler's withAuthorization)."""
        attributes = apirbac.Request(
            "create", rtype.group, rtype.plural, "", (request.namespace or "") if rtype.namespaced else "", request.name
        )
        allowed, reason = self.rbac.authorize(user, attributes)
        self._audit(request, rtype, user, allowed, verb="create")
        if not allowed:
            group_resource = f"{rtype.plural}.{rtype.group}" if rtype.group else rtype.plural
            raise ApiError(
                403,
                "Forbidden",
                f'{group_resource} "{request.name}" is forbidden: {reason}',
                {"name": request.name, "group": rtype.group, "kind": rtype.plural},
            )

    def _unknown_type(self, request: Any, user: apirbac.User, unknown: ApiError) -> aiohttp.web.Response:
        """A resource the server does not serve (a client's stale discovery, say): authorization comes first, as
        kube-apiserver's handler chain runs WithAuthorization before the API handlers (k8s.io/apiserver v0.32
        pkg/server/config.go, DefaultBuildHandlerChain), so a user without the right gets 403 and one with it 404."""
        attributes = apirbac.Request(
            self._verb(request),
            request.resource.group or "",
            request.resource.plural or "",
            request.subresource or "",
            request.namespace or "",
            request.name or "",
        )
        allowed, reason = self.rbac.authorize(user, attributes)
        if not allowed:
            details = {"name": attributes.name, "group": attributes.group, "kind": attributes.resource}
            denied = ApiError(403, "Forbidden", apirbac.forbidden_message(user, attributes, reason), details)
            return aiohttp.web.json_response(denied.status(), status=403)
        return aiohttp.web.json_response(unknown.status(), status=unknown.code)

    def _authorize(self, request: Any, rtype: ResourceType, user: apirbac.User) -> None:
        # A Namespace's own requests are judged in that namespace, so a RoleBinding there can grant them.
        namespace = request.namespace if rtype.namespaced else ""
        if rtype.key == ("", "namespaces") and request.name:
            namespace = request.name
        attributes = apirbac.Request(
            self._verb(request),
            rtype.group,
            rtype.plural,
            request.subresource or "",
            namespace or "",
            request.name or "",
        )
        allowed, reason = self.rbac.authorize(user, attributes)
        if not allowed:
            raise ApiError(
                403,
                "Forbidden",
                apirbac.forbidden_message(user, attributes, reason),
                {"name": attributes.name, "group": rtype.group, "kind": rtype.plural},
            )

    def _trim_request_history(self) -> None:
        # kmock keeps every request for assertions; a long-running server keeps only the recent ones.
        if len(self._requests) > 2000:
            del self._requests[:1000]

    def _verb(self, request: Any) -> str:
        method = str(request.method).lower()
        if method.endswith("get"):
            if request.params.get("watch") in ("true", "1"):
                return "watch"
            return "get" if request.name else "list"
        return {"post": "create", "put": "update", "patch": "patch", "delete": "delete"}.get(
            method.split(".")[-1], method
        )

    def _audit(
        self, request: Any, rtype: ResourceType, user: apirbac.User, allowed: bool, verb: str | None = None
    ) -> None:
        entry = {
            "user": user.name,
            "decision": "allow" if allowed else "forbid",
            "verb": verb or self._verb(request),
            "group": rtype.group,
            "resource": rtype.plural,
            "subresource": request.subresource or "",
            "namespace": request.namespace or "",
            "name": request.name or "",
            "userAgent": request.headers.get("User-Agent", ""),
        }
        self.audit.append(entry)
        if len(self.audit) > 100_000:
            del self.audit[:50_000]
        self._write_audit(entry)

    async def _serve(
        self,
        request: Any,
        rtype: ResourceType,
        raw: Any,
        user: apirbac.User,
        fault: tuple[FaultRule, FaultRequest] | None = None,
    ) -> aiohttp.web.StreamResponse:
        verb = self._verb(request)
        version = request.resource.version
        namespace = request.namespace if rtype.namespaced else None
        params = request.params
        wants_table = "as=Table" in request.headers.get("Accept", "")
        store = self.store
        if verb == "watch":
            return await self._watch(request, rtype, namespace, raw, user, fault)
        if rtype.key == ("", "serviceaccounts") and request.subresource == "token" and verb == "create":
            return self._token_request(request)
        if rtype.key in apirbac.SELF_REVIEWS and verb == "create":
            return self._self_review(request, rtype, user)
        if verb == "list":
            items = store.select(rtype, namespace, params.get("labelSelector"), params.get("fieldSelector"))
            if wants_table:
                return aiohttp.web.json_response(as_table(rtype, items, str(store.revision)))
            head = {
                "apiVersion": rtype.api_version(version),
                "kind": f"{rtype.kind}List",
                "metadata": {"resourceVersion": str(store.revision)},
            }
            if len(items) > LIST_CHUNK:
                return await self._stream_list(raw, head, items, rtype, version)
            return aiohttp.web.json_response({**head, "items": [self._versioned(obj, rtype, version) for obj in items]})
        if verb == "get":
            obj = store.get(rtype, namespace, request.name)
            if wants_table:
                return aiohttp.web.json_response(as_table(rtype, [obj], str(store.revision)))
            return aiohttp.web.json_response(self._versioned(obj, rtype, version))
        dry_run = self._dry_run(params, self._delete_options(request) if verb == "delete" else {})
        store.field_validation = self._field_validation(params)
        store.warnings = []
        if not dry_run:
            obj, code = self._write(verb, request, rtype, version, namespace)
            await self._notify(rtype)
            return self._answer(obj, code)
        before = self._current(rtype, namespace, request.name)
        with store.dry_run():
            obj, code = self._write(verb, request, rtype, version, namespace)
        obj = copy.deepcopy(obj)
        # Nothing was stored, so nothing got a new resourceVersion.
        if before is None:
            obj["metadata"].pop("resourceVersion", None)
        else:
            obj["metadata"]["resourceVersion"] = before["metadata"]["resourceVersion"]
        return self._answer(obj, code)

    def _answer(self, obj: dict[str, Any], code: int) -> aiohttp.web.Response:
        """The written object, with one `Warning: 299` header per warning (kubectl prints them as `Warning: …`)."""
        headers = CIMultiDict(("Warning", f"299 - {json.dumps(text)}") for text in self.store.warnings)
        return aiohttp.web.json_response(obj, status=code, headers=headers)

    @staticmethod
    def _field_validation(params: Any) -> str:
        """The `fieldValidation` directive; kube-apiserver's default, when a client sends none, is Warn."""
        directive = params.get("fieldValidation") or "Warn"
        if directive not in ("Strict", "Warn", "Ignore"):
            raise ApiError(
                400, "BadRequest", f"fieldValidation must be one of Ignore, Warn or Strict, got {directive!r}"
            )
        return str(directive)

    @staticmethod
    def _delete_options(request: Any) -> dict[str, Any]:
        """kubectl and client-go send DELETE's options (dryRun, preconditions, propagation) as a body."""
        if not request.body:
            return {}
        if request.headers.get("Content-Type", "").startswith(apiprotobuf.CONTENT_TYPE):
            try:
                return apiprotobuf.decode(request.body)
            except apiprotobuf.ProtobufError as failure:
                raise ApiError(415, "UnsupportedMediaType", str(failure)) from None
        try:
            options = json.loads(request.body)
        except json.JSONDecodeError:
            raise ApiError(400, "BadRequest", "the DeleteOptions body is not valid JSON") from None
        return options if isinstance(options, dict) else {}

    def _self_review(self, request: Any, rtype: ResourceType, user: apirbac.User) -> aiohttp.web.Response:
        """`kubectl auth whoami` (SelfSubjectReview) and `kubectl auth can-i` (SelfSubjectAccessReview)."""
        review = self._json_body(request)
        answer: dict[str, Any] = {"kind": rtype.kind, "apiVersion": rtype.api_version("v1"), "metadata": {}}
        if rtype.plural == "selfsubjectreviews":
            answer["status"] = {"userInfo": {"username": user.name, "groups": list(user.groups)}}
            return aiohttp.web.json_response(answer, status=201)
        spec = review.get("spec") or {}
        answer["spec"] = spec
        attributes = spec.get("resourceAttributes")
        if attributes is None:
            path = (spec.get("nonResourceAttributes") or {}).get("path", "")
            answer["status"] = {"allowed": apirbac.path_allowed(user, path)}
            return aiohttp.web.json_response(answer, status=201)
        check = apirbac.Request(
            attributes.get("verb", ""),
            attributes.get("group", ""),
            attributes.get("resource", ""),
            attributes.get("subresource", ""),
            attributes.get("namespace", ""),
            attributes.get("name", ""),
        )
        allowed, reason = self.rbac.authorize(user, check)
        answer["status"] = {"allowed": allowed, **({"reason": reason} if reason else {})}
        return aiohttp.web.json_response(answer, status=201)

    def _token_request(self, request: Any) -> aiohttp.web.Response:
        """The TokenRequest API (`kubectl create token SA`): a bearer token authenticating as the service account."""
        account = self.store.get(self.store.find_type("", "serviceaccounts"), request.namespace, request.name)
        token = self.authenticator.mint(apirbac.service_account_user(request.namespace, request.name))
        spec = self._json_body(request).get("spec") or {}
        expiry = datetime.now(UTC) + timedelta(seconds=int(spec.get("expirationSeconds") or 3600))
        answer = {
            "kind": "TokenRequest",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"name": request.name, "namespace": request.namespace, "uid": account["metadata"]["uid"]},
            "spec": {"audiences": spec.get("audiences") or ["https://kubernetes.default.svc"], **spec},
            "status": {"token": token, "expirationTimestamp": expiry.strftime("%Y-%m-%dT%H:%M:%SZ")},
        }
        return aiohttp.web.json_response(answer, status=201)

    @staticmethod
    def _dry_run(params: Any, delete_options: dict[str, Any]) -> bool:
        values = params.getall("dryRun", []) if hasattr(params, "getall") else [params.get("dryRun")]
        values = [value for value in [*values, *(delete_options.get("dryRun") or [])] if value]
        if any(value != "All" for value in values):
            raise ApiError(400, "BadRequest", f'Invalid value: "{values[0]}": supported values: "All"')
        return bool(values)

    def _current(self, rtype: ResourceType, namespace: str | None, name: str | None) -> dict[str, Any] | None:
        if not name:
            return None
        try:
            return self.store.get(rtype, namespace, name)
        except ApiError:
            return None

    def _write(
        self, verb: str, request: Any, rtype: ResourceType, version: str, namespace: str | None
    ) -> tuple[dict[str, Any], int]:
        """One write, answered with the object and the HTTP code; the caller decides whether it is kept."""
        store, params = self.store, request.params
        manager = params.get("fieldManager", "")
        content_type = request.headers.get("Content-Type", "application/merge-patch+json")
        if not manager and not content_type.startswith("application/apply-patch"):
            # kube-apiserver names an update's manager after the client's User-Agent product (up to the "/").
            manager = request.headers.get("User-Agent", "").split("/", 1)[0][:128]
        if verb == "create":
            body = self._json_body(request)
            return store.create(rtype, version, namespace, body, manager), 201
        if verb == "update":
            body = self._json_body(request)
            return store.replace(
                rtype, version, namespace, request.name, body, request.subresource, manager=manager
            ), 200
        if verb == "patch":
            force = params.get("force") in ("true", "1")
            obj = store.patch(
                rtype, version, namespace, request.name, content_type, request.body, request.subresource, manager, force
            )
            return obj, 200
        if verb == "delete":
            preconditions = self._delete_options(request).get("preconditions") or {}
            return store.delete(rtype, namespace, request.name, preconditions), 200
        raise ApiError(405, "MethodNotAllowed", f"{verb} is not supported")

    @staticmethod
    def _json_body(request: Any) -> dict[str, Any]:
        if request.headers.get("Content-Type", "").startswith(apiprotobuf.CONTENT_TYPE):
            try:
                return apiprotobuf.decode(request.body)
            except apiprotobuf.ProtobufError as failure:
                raise ApiError(415, "UnsupportedMediaType", str(failure)) from None
        try:
            body = json.loads(request.body or b"{}")
        except json.JSONDecodeError as failure:
            raise ApiError(400, "BadRequest", f"invalid JSON body: {failure}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body must be a JSON object")
        return body

    async def _stream_list(
        self, raw: Any, head: dict[str, Any], items: list[dict[str, Any]], rtype: ResourceType, version: str
    ) -> aiohttp.web.StreamResponse:
        """A long list sent in chunks of `LIST_CHUNK` items, the event loop free between two (kube-apiserver
        streams lists too). The items are the store's objects as selected: a write replaces an object, never
        changes it in place, so the list stays the snapshot of its resourceVersion while it is sent."""
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)
        opening = json.dumps(head)
        await response.write(f'{opening[:-1]}, "items": ['.encode())
        for start in range(0, len(items), LIST_CHUNK):
            chunk = ", ".join(
                json.dumps(self._versioned(obj, rtype, version)) for obj in items[start : start + LIST_CHUNK]
            )
            await response.write(((", " if start else "") + chunk).encode())
            await asyncio.sleep(0)  # the other requests' turn
        await response.write(b"]}")
        await response.write_eof()
        return response

    @staticmethod
    def _versioned(obj: dict[str, Any], rtype: ResourceType, version: str) -> dict[str, Any]:
        return {**obj, "apiVersion": rtype.api_version(version)}

    async def _notify(self, rtype: ResourceType) -> None:
        """Wake the watchers. Never waits: with a lock here (an asyncio.Condition), every write queued behind
        every watcher's re-acquisition, one per turn of the loop, and at 3,000 pools writes were answered minutes
        late (Lease renewals among them)."""
        if rtype.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self.sync_discovery()
        self._wake_watches()

    def _wake_watches(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    async def _watch(
        self,
        request: Any,
        rtype: ResourceType,
        namespace: str | None,
        raw: Any,
        user: apirbac.User,
        fault: tuple[FaultRule, FaultRequest] | None = None,
    ) -> aiohttp.web.StreamResponse:
        params = request.params
        plan = self.faults.generation
        labels, fields = params.get("labelSelector"), params.get("fieldSelector")
        version = request.resource.version
        timeout = float(params.get("timeoutSeconds", "1800"))
        since = params.get("resourceVersion", "")
        if since not in ("", "0") and not since.isdigit():
            raise ApiError(400, "BadRequest", f'invalid resource version "{since}"')
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)

        def visible(obj: dict[str, Any]) -> bool:
            meta = obj["metadata"]
            if namespace is not None and meta.get("namespace") != namespace:
                return False
            if request.name and meta.get("name") != request.name:
                return False
            return label_selector_matches(labels, meta.get("labels", {})) and field_selector_matches(fields, obj)

        cut = WatchCut(fault[0].effect if fault is not None and isinstance(fault[0].effect, CloseWatch) else None)

        async def send(kind: str, obj: dict[str, Any]) -> None:
            line = json.dumps({"type": kind, "object": self._versioned(obj, rtype, version)}) + "\n"
            await response.write(line.encode())
            if cut.sent(kind):
                raise apifaultserve.ClosedByFault

        bookmarks = params.get("allowWatchBookmarks") in ("true", "1")

        async def bookmark(annotations: dict[str, str] | None = None) -> None:
            # A bookmark carries only the kind and the resourceVersion the watcher has now seen everything up to.
            meta: dict[str, Any] = {"resourceVersion": str(self.store.revision)}
            if annotations:
                meta["annotations"] = annotations
            await send("BOOKMARK", {"kind": rtype.kind, "metadata": meta})

        loop = asyncio.get_running_loop()
        deadline, cut_early = cut.deadline(loop.time(), loop.time() + timeout)
        try:
            if fault is not None and isinstance(fault[0].effect, ExpireWatch):
                return await self._expire_watch(response, int(since), *fault)
            if cut.at_once():
                raise apifaultserve.ClosedByFault
            if since in ("", "0") or params.get("sendInitialEvents") in ("true", "1"):
                last = self.store.revision
                for sent, obj in enumerate(self.store.select(rtype, namespace, labels, fields)):
                    if visible(obj):
                        await send("ADDED", obj)
                    if sent % LIST_CHUNK == LIST_CHUNK - 1:
                        await asyncio.sleep(0)  # as a long list: the other requests' turn
                if bookmarks and params.get("sendInitialEvents") in ("true", "1"):
                    await bookmark({"k8s.io/initial-events-end": "true"})
            else:
                last = int(since)
                try:
                    self.store.events_since(rtype, last)
                except ApiError as expired:
                    await response.write((json.dumps({"type": "ERROR", "object": expired.status()}) + "\n").encode())
                    return response
            next_bookmark = loop.time() + self.bookmark_interval
            while loop.time() < deadline:
                # The watch has seen everything up to the revision it read the history at, other resources'
                # events included: its position moves with the store's, so a quiet resource's watch never falls
                # behind a history that other resources' writes fill.
                changed = self.changed  # taken before the history is read: a write after the read sets it
                seen_up_to = self.store.revision
                try:
                    events = self.store.events_since(rtype, last)
                except ApiError as expired:  # more writes while this watcher was sending than the history keeps
                    await response.write((json.dumps({"type": "ERROR", "object": expired.status()}) + "\n").encode())
                    break
                for event in events:
                    if visible(event.obj):
                        await send(event.type, event.obj)
                last = max(last, seen_up_to)
                if fault is None and plan != self.faults.generation:  # a plan installed since: asked for this watch
                    plan = self.faults.generation
                    fault, cut, deadline, cut_early = self._reask_watch(request, rtype, user, last, deadline)
                    if fault is not None and isinstance(fault[0].effect, ExpireWatch):
                        return await self._expire_watch(response, last, *fault)
                    if cut.at_once():
                        raise apifaultserve.ClosedByFault
                if bookmarks and loop.time() >= next_bookmark:
                    await bookmark()
                    next_bookmark = loop.time() + self.bookmark_interval
                wait = min(5.0, deadline - loop.time(), next_bookmark - loop.time() if bookmarks else 5.0)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), timeout=max(0.0, wait))
            if fault is not None and cut_early:
                self._watch_closed(*fault, f"closed after {cut.effect.after_seconds if cut.effect else 0}s")
        except apifaultserve.ClosedByFault:
            if fault is not None:
                self._watch_closed(*fault, f"closed after {cut.events} events")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response


def write_kubeconfig(path: Path, url: str, ca_pem: bytes, namespace: str = "default", token: str = ADMIN_TOKEN) -> None:
    """A kubeconfig for this server; the default token is the admin's, a minted one is a service account's."""
    cluster = {"server": url, "certificate-authority-data": base64.b64encode(ca_pem).decode()}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "sluice-local", "cluster": cluster}],
        "users": [{"name": "sluice-local", "user": {"token": token}}],
        "contexts": [
            {
                "name": "sluice-local",
                "context": {"cluster": "sluice-local", "user": "sluice-local", "namespace": namespace},
            }
        ],
        "current-context": "sluice-local",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))


async def serve(args: argparse.Namespace) -> None:
    server = ApiServer(
        audit_path=Path(args.audit_log) if args.audit_log else None,
        store=Store(history=args.watch_history),
        bookmark_interval=args.bookmark_interval,
    )
    if args.faults:
        server.faults.install(load_plan(Path(args.faults).read_text(), args.faults))
    for crd in args.crd:
        server.load_crds(Path(crd))
    for namespace in args.namespace:
        ns_type = server.store.find_type("", "namespaces")
        server.store.create(ns_type, "v1", None, {"metadata": {"name": namespace}})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    kubeconfig = Path(args.kubeconfig)
    cert, key = apitls.serving_certificate(kubeconfig.parent / f"{kubeconfig.name}.tls")
    context = apitls.server_context(cert, key)

    class HttpsServer(_HttpServer):
        async def start_server(self, loop: asyncio.AbstractEventLoop | None = None, **kwargs: Any) -> None:
            await super().start_server(loop=loop, ssl=context, **kwargs)

    async with server, kmock.Server(server, host="127.0.0.1", port=args.port, server_cls=HttpsServer) as http:
        url = f"https://127.0.0.1:{http.port}"
        write_kubeconfig(kubeconfig, url, cert.read_bytes())
        print(f"ready {url}", flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="sluice.emulator.apiserver", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--kubeconfig", required=True, help="write a kubeconfig for this server here")
    parser.add_argument("--crd", action="append", default=[], help="CRD file(s) to register at start (repeatable)")
    parser.add_argument("--namespace", action="append", default=["default"], help="namespaces to create at start")
    parser.add_argument("--audit-log", help="append one JSON line per request here")
    parser.add_argument(
        "--watch-history", type=int, default=20000, help="events kept for watches from a resourceVersion (older: 410)"
    )
    parser.add_argument("--bookmark-interval", type=float, default=60.0, help="seconds between watch bookmarks")
    parser.add_argument("--faults", help="a fault plan (YAML or JSON) to serve from the start; see PUT /_faults")
    args = parser.parse_args(argv)
    if args.faults:
        try:
            load_plan(Path(args.faults).read_text(), args.faults)
        except (OSError, PlanError) as failure:
            parser.error(str(failure))
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
