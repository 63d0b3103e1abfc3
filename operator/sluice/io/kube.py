"""Kubernetes I/O with the official `kubernetes` client: pods, Secrets, Istio objects, the pool's status, Events.

Writes are server-side apply with field manager `sluice`, and only when the content differs from the live
object. An object of the same name that sluice does not manage is left untouched (and reported) unless the pool
opts in with `spec.routing.adoptExisting`. The pure helpers (`observed_pod`, `ownership`, `differs`) decide;
`KubeIO` only talks to the API. Called by the reconciler in a worker thread (the client is blocking).
"""

from __future__ import annotations

import base64
import json
import os
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, cast

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from sluice.api.v1alpha1 import GROUP, KIND, PLURAL, VERSION
from sluice.core.events import Event
from sluice.core.observed import ObservedPod
from sluice.istio.render import MANAGED_BY

FIELD_MANAGER = "sluice"
APPLY = "application/apply-patch+yaml"
Ownership = Literal["absent", "ours", "foreign"]


def observed_pod(pod: dict[str, Any]) -> ObservedPod:
    """What the core needs from a Pod object. Pure."""
    meta, status = pod.get("metadata", {}), pod.get("status", {}) or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    containers = status.get("containerStatuses") or []
    restarts = sum(int(c.get("restartCount", 0)) for c in containers)
    reason = None
    restarted = [c for c in containers if int(c.get("restartCount", 0)) > 0]
    if restarted:
        latest = max(
            restarted,
            key=lambda c: ((c.get("lastState") or {}).get("terminated") or {}).get("finishedAt") or "",
        )
        reason = ((latest.get("lastState") or {}).get("terminated") or {}).get("reason")
    return ObservedPod(
        name=meta.get("name", ""),
        ip=status.get("podIP") or None,
        labels=meta.get("labels") or {},
        ready=conditions.get("Ready") == "True",
        deleting=bool(meta.get("deletionTimestamp")),
        restarts=restarts,
        last_termination_reason=reason,
    )


def ownership(live: dict[str, Any] | None, pool_uid: str | None) -> Ownership:
    """Whether sluice may write an existing object: it carries sluice's label or is owned by the pool. Pure."""
    if live is None:
        return "absent"
    meta = live.get("metadata", {})
    labels = meta.get("labels") or {}
    owned = any(ref.get("uid") == pool_uid for ref in meta.get("ownerReferences") or [] if pool_uid)
    managed = all(labels.get(k) == v for k, v in MANAGED_BY.items())
    return "ours" if managed or owned else "foreign"


def differs(live: dict[str, Any], desired: dict[str, Any]) -> bool:
    """True when applying `desired` would change the live object (spec, our labels, our owner reference). Pure."""
    if live.get("spec") != desired.get("spec"):
        return True
    live_meta, want_meta = live.get("metadata", {}), desired.get("metadata", {})
    live_labels = live_meta.get("labels") or {}
    if any(live_labels.get(k) != v for k, v in (want_meta.get("labels") or {}).items()):
        return True
    wanted_owners = {ref["uid"] for ref in want_meta.get("ownerReferences") or []}
    live_owners = {ref.get("uid") for ref in live_meta.get("ownerReferences") or []}
    return not wanted_owners <= live_owners


@dataclass(frozen=True)
class WriteResult:
    kind: str
    name: str
    action: Literal["created", "updated", "unchanged", "refused"]
    message: str = ""


def _plural(kind: str) -> str:
    return {
        "DestinationRule": "destinationrules",
        "VirtualService": "virtualservices",
        "ServiceEntry": "serviceentries",
        "EnvoyFilter": "envoyfilters",
    }[kind]


def load_api_client(kubeconfig: str | None = None) -> k8s.ApiClient:
    """In-cluster configuration when running in a pod, else the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
    try:
        k8s_config.load_incluster_config()
        return k8s.ApiClient()
    except k8s_config.ConfigException:
        configuration = k8s.Configuration()
        k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        return k8s.ApiClient(configuration)


USER_AGENT = f"sluice-operator/{os.environ.get('HOSTNAME', 'local')}-{os.getpid()}"


class KubeIO:
    def __init__(self, api_client: k8s.ApiClient) -> None:
        api_client.user_agent = USER_AGENT  # lets audit logs (and the RBAC test) tell the operator's calls apart
        self.api_client = api_client
        self.core = k8s.CoreV1Api(api_client)
        self.custom = k8s.CustomObjectsApi(api_client)

    def close(self) -> None:
        self.api_client.close()

    # ---- reads

    def list_pods(self, namespace: str, match_labels: dict[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))
        answer = self.core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False)
        return list(json.loads(cast(Any, answer).data).get("items", []))

    def read_secret_key(self, namespace: str, name: str, key: str) -> str:
        try:
            secret = self.core.read_namespaced_secret(name, namespace)
        except ApiException as failure:
            raise LookupError(f"Secret {namespace}/{name}: {failure.reason}") from failure
        data = secret.data or {}
        if key not in data:
            raise LookupError(f"Secret {namespace}/{name} has no key {key!r}")
        return base64.b64decode(data[key]).decode()

    def get_istio_object(self, kind: str, api_version: str, namespace: str, name: str) -> dict[str, Any] | None:
        group, version = api_version.split("/")
        try:
            answer = self.custom.get_namespaced_custom_object(
                group, version, namespace, _plural(kind), name, _preload_content=False
            )
        except ApiException as failure:
            if failure.status == 404:
                return None
            raise
        result: dict[str, Any] = json.loads(cast(Any, answer).data)
        return result

    # ---- writes

    def sync_object(self, desired: dict[str, Any], pool_uid: str | None, adopt: bool) -> WriteResult:
        """Server-side apply `desired` if it differs from the live object and sluice may write it."""
        meta = desired["metadata"]
        kind, name, namespace = desired["kind"], meta["name"], meta["namespace"]
        live = self.get_istio_object(kind, desired["apiVersion"], namespace, name)
        owner = ownership(live, pool_uid)
        if owner == "foreign" and not adopt:
            return WriteResult(kind, name, "refused", f"{kind} {namespace}/{name} exists and is not managed by sluice")
        if live is not None and owner == "ours" and not differs(live, desired):
            return WriteResult(kind, name, "unchanged")
        group, version = desired["apiVersion"].split("/")
        self.custom.patch_namespaced_custom_object(
            group,
            version,
            namespace,
            _plural(kind),
            name,
            desired,
            field_manager=FIELD_MANAGER,
            force=True,
            _content_type=APPLY,
        )
        return WriteResult(kind, name, "created" if live is None else "updated")

    def write_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "metadata": {"name": name, "namespace": namespace},
            "status": status,
        }
        self.custom.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            body,
            field_manager=FIELD_MANAGER,
            force=True,
            _content_type=APPLY,
        )

    def emit_event(self, namespace: str, pool_name: str, pool_uid: str | None, event: Event) -> None:
        now = datetime.now(UTC)
        body = k8s.CoreV1Event(
            metadata=k8s.V1ObjectMeta(name=f"{pool_name}.{uuid.uuid4().hex[:12]}", namespace=namespace),
            involved_object=k8s.V1ObjectReference(
                api_version=f"{GROUP}/{VERSION}", kind=KIND, name=pool_name, namespace=namespace, uid=pool_uid
            ),
            reason=event.reason,
            message=event.message[:1024],
            type=event.type,
            source=k8s.V1EventSource(component="sluice"),
            first_timestamp=now,
            last_timestamp=now,
            count=1,
            reporting_component="sluice",
            reporting_instance="sluice",
        )
        self.core.create_namespaced_event(namespace, body)
