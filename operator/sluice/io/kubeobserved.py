"""Kubernetes objects read into what the core observes: a Pod, the pool's Service, a Sidecar. Pure.

The objects are JSON as the API server (or a watch event) gives them; each field is narrowed as it is read
(`sluice.api.jsontypes`), so a missing or odd field reads as absent.
"""

from __future__ import annotations

from collections.abc import Mapping

from sluice.api.jsontypes import members, text
from sluice.core.observed import ObservedPod, ObservedService, ObservedSidecar, ServicePort


def _entries(value: Mapping[str, object], key: str) -> list[Mapping[str, object]]:
    """The objects of the list at `key` (none when it is missing or not a list)."""
    found = value.get(key)
    return [entry for entry in found if isinstance(entry, Mapping)] if isinstance(found, list) else []


def strings(value: object, *path: str) -> dict[str, str]:
    """Labels or annotations: the string values of the mapping at `path` (an object's `metadata`, `labels`)."""
    return {key: item for key, item in members(value, *path).items() if isinstance(item, str)}


def _optional(value: Mapping[str, object], key: str) -> str | None:
    found = value.get(key)
    return found if isinstance(found, str) else None


def _texts(value: Mapping[str, object], key: str) -> list[str]:
    found = value.get(key)
    return [item for item in found if isinstance(item, str)] if isinstance(found, list) else []


def _integer(value: object) -> int:
    return value if isinstance(value, int) else int(str(value))


def observed_service(service: Mapping[str, object]) -> ObservedService:
    meta, spec = members(service, "metadata"), members(service, "spec")
    ports = []
    for port in _entries(spec, "ports"):
        target = port.get("targetPort")
        ports.append(
            ServicePort(
                port=_integer(port.get("port")),
                name=_optional(port, "name"),
                app_protocol=_optional(port, "appProtocol"),
                protocol=text(port, "protocol") or "TCP",
                target_port=target if isinstance(target, int | str) else None,
            )
        )
    return ObservedService(
        name=text(meta, "name"),
        ports=ports,
        labels=strings(meta, "labels"),
        annotations=strings(meta, "annotations"),
    )


def observed_sidecar(sidecar: Mapping[str, object]) -> ObservedSidecar:
    meta, spec = members(sidecar, "metadata"), members(sidecar, "spec")
    egress = _entries(spec, "egress")
    return ObservedSidecar(
        namespace=text(meta, "namespace"),
        name=text(meta, "name"),
        selects_workloads=bool(members(spec, "workloadSelector").get("labels")),
        egress_hosts=None if not egress else [_texts(listener, "hosts") for listener in egress],
    )


def observed_pod(pod: Mapping[str, object]) -> ObservedPod:
    """What the core needs from a Pod object. Pure."""
    meta, status = members(pod, "metadata"), members(pod, "status")
    conditions = {c.get("type"): c.get("status") for c in _entries(status, "conditions")}
    containers = _entries(status, "containerStatuses")
    restarts = sum(_integer(c.get("restartCount", 0)) for c in containers)
    reason = None
    restarted = [c for c in containers if _integer(c.get("restartCount", 0)) > 0]
    if restarted:
        latest = max(restarted, key=lambda c: text(c, "lastState", "terminated", "finishedAt"))
        reason = _optional(members(latest, "lastState", "terminated"), "reason")
    return ObservedPod(
        name=text(meta, "name"),
        ip=text(status, "podIP") or None,
        labels=strings(meta, "labels"),
        ready=conditions.get("Ready") == "True",
        deleting=bool(meta.get("deletionTimestamp")),
        restarts=restarts,
        last_termination_reason=reason,
        service_account=text(pod, "spec", "serviceAccountName") or None,
    )
