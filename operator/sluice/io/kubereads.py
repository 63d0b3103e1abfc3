"""Calls on the official Kubernetes client and the reads the adapter makes with them.

The client's edge: a call's `ApiException` becomes a `ClusterError` (`call`), and an answer asked for undecoded
(`_preload_content=False`) is decoded and narrowed to JSON here, once (`json_answer`, `listed`). The reads: the
mesh side (the pool's Service, its namespace's labels, the Sidecars), a Secret's keys, one Istio object, and the
Istio objects labelled for a pool (`owned_keys`). Each takes the client's API object at the call, so an adapter
whose API objects are replaced (the tests' fakes) reads through them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Protocol, TypeVar, cast

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from sluice.api.jsontypes import JsonObject, text
from sluice.api.v1alpha1 import InferencePoolSpec
from sluice.core.observed import ObservedService, ObservedSidecar
from sluice.io.kubeobserved import observed_service, observed_sidecar, strings
from sluice.io.ports import ClusterError, ObjectKey
from sluice.istio.kinds import ISTIO_KINDS
from sluice.istio.ownership import MANAGED_BY, POOL_LABEL, POOL_NAMESPACE_LABEL

log = logging.getLogger(__name__)
T = TypeVar("T")
SIDECARS = ("networking.istio.io", "v1", "sidecars")


class RawAnswer(Protocol):
    """An answer asked for with `_preload_content=False`: urllib3's response, its body read on demand."""

    data: bytes

    def release_conn(self) -> None: ...


def call(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except ApiException as failure:
        raise ClusterError(int(failure.status or 0), str(failure.reason or "error")) from failure


def _raw(answer: object) -> RawAnswer:
    # Asked for with `_preload_content=False`, the client returns urllib3's response, whatever model its
    # annotation names
    return cast(RawAnswer, answer)


def json_answer(answer: object) -> JsonObject:
    # json.loads is untyped: the API server answers with a JSON object (an object, or a list of them in `items`)
    return cast(JsonObject, json.loads(_raw(answer).data))


def listed(answer: object) -> list[JsonObject]:
    """The objects of a list answer."""
    items = json_answer(answer).get("items")
    return [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []


def discard(answer: object) -> None:
    """Read a write's answer and give its connection back, without decoding it: the written object (with its
    managedFields) would be parsed only to be dropped."""
    _raw(answer).data  # noqa: B018 - reading the body is the point
    _raw(answer).release_conn()


def read_service(core: k8s.CoreV1Api, namespace: str, name: str) -> ObservedService | None:
    try:
        answer = core.read_namespaced_service(name, namespace, _preload_content=False)
    except ApiException as failure:
        if failure.status == 404:
            return None
        raise ClusterError(int(failure.status or 0), f"Service {namespace}/{name}: {failure.reason}") from failure
    return observed_service(json_answer(answer))


def read_namespace_labels(core: k8s.CoreV1Api, namespace: str) -> dict[str, str]:
    answer = call(lambda: core.read_namespace(namespace, _preload_content=False))
    return strings(json_answer(answer), "metadata", "labels")


def list_sidecars(
    custom: k8s.CustomObjectsApi, namespace: str, spec: InferencePoolSpec, namespaces: frozenset[str] | None
) -> list[ObservedSidecar]:
    """Every Sidecar the operator may list: cluster-wide, else (`namespaces`, a namespace-scoped install) in the
    pool's, the root and the client namespaces it may read. A Sidecar kind that is not installed lists nothing."""
    if namespaces is None:
        try:
            answer = custom.list_cluster_custom_object(*SIDECARS, _preload_content=False)
        except ApiException as failure:
            if failure.status == 404:
                return []  # Istio's Sidecar kind is not installed
            raise ClusterError(int(failure.status or 0), f"Sidecars: {failure.reason}") from failure
        return [observed_sidecar(item) for item in listed(answer)]
    wanted = {namespace, spec.routing.root_namespace, *(spec.routing.client_namespaces or ())} - {".", "*"}
    items: list[JsonObject] = []
    for where in sorted(wanted & namespaces):
        try:
            answer = custom.list_namespaced_custom_object(
                SIDECARS[0], SIDECARS[1], where, SIDECARS[2], _preload_content=False
            )
        except ApiException as failure:
            if failure.status == 404:
                return []
            raise ClusterError(int(failure.status or 0), f"Sidecars: {failure.reason}") from failure
        items += listed(answer)
    return [observed_sidecar(item) for item in items]


def read_secret_data(core: k8s.CoreV1Api, namespace: str, name: str) -> dict[str, str]:
    try:
        secret = core.read_namespaced_secret(name, namespace)
    except ApiException as failure:
        raise LookupError(f"Secret {namespace}/{name}: {failure.reason}") from failure
    data = secret.data or {}  # base64 text, as the API sends it
    return {key: value if isinstance(value, str) else value.decode() for key, value in data.items()}


def get_istio_object(custom: k8s.CustomObjectsApi, kind: str, namespace: str, name: str) -> JsonObject | None:
    k = ISTIO_KINDS[kind]
    try:
        answer = custom.get_namespaced_custom_object(
            k.group, k.version, namespace, k.plural, name, _preload_content=False
        )
    except ApiException as failure:
        if failure.status == 404:
            return None
        raise ClusterError(int(failure.status or 0), str(failure.reason or "error")) from failure
    return json_answer(answer)


def owned_keys(
    custom: k8s.CustomObjectsApi,
    namespace: str,
    pool: str,
    elsewhere: frozenset[str],
    namespaces: frozenset[str] | None,
) -> list[ObjectKey]:
    """The Istio objects labelled for the pool and managed by sluice in its namespace, and its EnvoyFilter copies
    elsewhere (`Cluster.owned`)."""
    selector = ",".join(f"{k}={v}" for k, v in {**MANAGED_BY, POOL_LABEL: pool}.items())
    keys = []
    for k in ISTIO_KINDS.values():
        answer = call(
            lambda k=k: custom.list_namespaced_custom_object(  # type: ignore[misc]
                k.group, k.version, namespace, k.plural, label_selector=selector, _preload_content=False
            )
        )
        keys += [ObjectKey(k.kind, text(item, "metadata", "name")) for item in listed(answer)]
    return keys + _envoy_filters_elsewhere(custom, namespace, selector, elsewhere, namespaces)


def _envoy_filters_elsewhere(
    custom: k8s.CustomObjectsApi,
    namespace: str,
    selector: str,
    elsewhere: frozenset[str],
    namespaces: frozenset[str] | None,
) -> list[ObjectKey]:
    """The pool's EnvoyFilter copies outside its namespace: listed cluster-wide by their labels (wherever an
    earlier pass put them), or, in a namespace-scoped install, in the namespaces of `elsewhere` it may read."""
    filters = ISTIO_KINDS["EnvoyFilter"]
    labelled = f"{selector},{POOL_NAMESPACE_LABEL}={namespace}"
    if namespaces is None:
        answer = call(
            lambda: custom.list_cluster_custom_object(
                filters.group, filters.version, filters.plural, label_selector=labelled, _preload_content=False
            )
        )
        items = listed(answer)
    else:
        unreadable = sorted(elsewhere - namespaces - {namespace})
        if unreadable:
            log.warning("pool %s: EnvoyFilters in %s are outside the watched namespaces", namespace, unreadable)
        items = []
        for where in sorted((elsewhere & namespaces) - {namespace}):
            answer = call(
                lambda where=where: custom.list_namespaced_custom_object(  # type: ignore[misc]
                    filters.group,
                    filters.version,
                    where,
                    filters.plural,
                    label_selector=labelled,
                    _preload_content=False,
                )
            )
            items += listed(answer)
    return [
        ObjectKey(filters.kind, text(item, "metadata", "name"), text(item, "metadata", "namespace"))
        for item in items
        if text(item, "metadata", "namespace") != namespace
    ]
