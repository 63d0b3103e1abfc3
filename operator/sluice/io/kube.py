"""The Kubernetes side of the `Cluster` port, with the official `kubernetes` client.

Writes are server-side apply with field manager `sluice`, and only when the content differs from the live
object. Ownership (`sluice.istio.ownership`) decides what may be written: sluice's own objects, adopted ones
(`spec.routing.adoptExisting`: no ownerReference, the original kept in an annotation and put back with a replace
when released), never anybody else's. Releasing an object sluice created deletes it. A request that failed is sent
again as `sluice.io.kubereads.send` decides (429 after its Retry-After, 5xx and no answer after a back-off, within
the call's budget or the Lease's validity); what still fails becomes a `ClusterError`. Called by the reconciler
in a worker thread (the client is blocking). The reads it makes, and the client's edge (with `load_api_client`),
are `sluice.io.kubereads`'; the objects it reads become the core's types in `sluice.io.kubeobserved`.
"""

from __future__ import annotations

import base64
import copy
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar, cast

from kubernetes import client as k8s

from sluice.api.jsontypes import JsonObject, text
from sluice.api.v1alpha1 import GROUP, KIND, PLURAL, VERSION, InferencePoolSpec, InferencePoolStatus
from sluice.core.events import Event
from sluice.core.observed import ObservedMesh, ObservedPod
from sluice.io.kubeobserved import observed_pod, strings
from sluice.io.kubereads import (
    Retrying,
    call,
    call_within,
    get_istio_object,
    list_sidecars,
    listed,
    owned_keys,
    read_namespace_labels,
    read_secret_data,
    read_service,
)
from sluice.io.kubereads import discard as _discard
from sluice.io.ports import ClusterError, ObjectKey, WriteResult
from sluice.istio.kinds import ISTIO_KINDS
from sluice.istio.ownership import as_adopted, decide, drifted, kept_original, original_of, ownership, release
from sluice.istio.rendered import Rendered

log = logging.getLogger(__name__)
FIELD_MANAGER = "sluice"
APPLY = "application/apply-patch+yaml"
T = TypeVar("T")
WriteFence = Callable[[], AbstractContextManager[float]]
"""A pass's write fence as `sluice.runtime.fence.FencedCluster` hands it to `KubeCluster.fenced`: entered right
before each write request (each send, a retried one too), it refuses (`ClusterError`) or gives the seconds the
request may take (its `_request_timeout`, and no retry waits past them); it is left when the request has
returned."""


MESH_SECONDS = 600.0
"""How long a read of the mesh side (Service, namespace labels, Sidecars) is used without a GET: the operator's
watches of Services, Namespaces and Sidecars (`mesh_observed`) drop a read as soon as its object changes; this
bounds what a missed event could cost (a steady pass reads nothing)."""
SECRET_SECONDS = 30.0
"""How long a Secret's keys (the pools' Prometheus bearer tokens and CA bundles) are used without a GET: a pass
read them at every pass (a GET per pool per interval); the operator does not watch Secrets (no such right is
asked), so a rotated token is picked up within this long."""


@dataclass(frozen=True)
class Verified:
    """An Istio object as this process last read or wrote it: what it wanted, and whose the object was."""

    desired: Rendered
    adopt: bool
    original: str | None
    """The adopted object's original (None: the object is sluice's own)."""
    read_at: float
    """When the object was last read (monotonic); writes without a read do not extend it."""

    def body(self, desired: Rendered) -> JsonObject:
        """What this process writes for `desired`: as it is for sluice's own object, with the original kept for an
        adopted one."""
        return desired.body if self.original is None else as_adopted(desired.body, self.original)


class PodSource(Protocol):
    """Pods kept current by a watch (`sluice.runtime.podcache`), seeded by one list per namespace."""

    def seeded(self, namespace: str) -> bool: ...

    def due(self, namespace: str) -> bool: ...

    def begin_seed(self, namespace: str) -> None: ...

    def abandon_seed(self, namespace: str) -> None: ...

    def finish_seed(self, namespace: str, pods: list[JsonObject]) -> None: ...

    def select(self, namespace: str, match_labels: dict[str, str]) -> list[ObservedPod]: ...


USER_AGENT = f"sluice-operator/{os.environ.get('HOSTNAME', 'local')}-{os.getpid()}"


class KubeCluster:
    """The operator's adapter: the `Cluster` port over the Kubernetes API."""

    fence: WriteFence | None = None
    """Checked right before each write request (`fenced`); None: unfenced."""

    def __init__(
        self,
        api_client: k8s.ApiClient,
        resync_seconds: float = 60.0,
        user_agent: str = USER_AGENT,
        retrying: Retrying | None = None,
    ) -> None:
        self.retrying = retrying or Retrying()
        """When a failed request is sent again; its counts are the operator's `sluice_kube_retries_total`."""
        api_client.user_agent = user_agent  # lets audit logs (and the RBAC test) tell the operator's calls apart
        self.api_client = api_client
        # An object this process applied (or found equal) is not read again while the pass still wants the same
        # thing, for up to `resync_seconds`: a steady pass makes no GET. Edits or deletions by others are
        # corrected at the next resync.
        # A changed object read within `resync_seconds` is written without a GET too: ownership was decided when
        # it was last read (ours, or adopted with its original), and server-side apply needs no resourceVersion.
        self.resync_seconds = resync_seconds
        self._verified: dict[tuple[str, str, str], Verified] = {}
        self.pod_cache: PodSource | None = None
        self._seeding: dict[str, threading.Lock] = {}
        """Pods from the operator's own pod watch; `pods` lists each namespace once to seed it (every call, if None)."""
        self.core = k8s.CoreV1Api(api_client)
        self.custom = k8s.CustomObjectsApi(api_client)
        self.namespaces: frozenset[str] | None = None
        """The namespaces the operator may read (a namespace-scoped install); None: the whole cluster. Lists of
        Sidecars and of EnvoyFilter copies go only where they are allowed: no call is made to be refused."""
        self.mesh_seconds = MESH_SECONDS
        self._mesh_reads: dict[tuple[str, ...], tuple[float, Any]] = {}
        """(what, namespace, name) -> (monotonic time read, answer): the mesh side, read again after mesh_seconds."""

    def close(self) -> None:
        self.api_client.close()

    def resync(self) -> None:
        """Forget which objects were seen in the wanted state: the next pass reads them again."""
        self._verified.clear()

    def fenced(self, fence: WriteFence) -> KubeCluster:
        """This adapter with every write request behind `fence`: its caches, clients and locks are shared."""
        view = copy.copy(self)
        view.fence = fence
        return view

    def observed(self, obj: Mapping[str, object], deleted: bool = False) -> None:
        """A watch event of an Istio object. One this process verified is read again by the next pass that wants
        it when the event shows it deleted or no longer holding what was written (`drifted`) — someone else's edit;
        sluice's own writes match, and an event of an older write of its own costs one GET. With the watch, an edit is
        corrected at the next pass instead of at the next resync."""
        key = (text(obj, "metadata", "namespace"), text(obj, "kind"), text(obj, "metadata", "name"))
        seen = self._verified.get(key)
        if seen is None:
            return
        if deleted or drifted(obj, seen.body(seen.desired)):
            self._verified.pop(key, None)

    # ---- reads

    def pods(self, namespace: str, match_labels: dict[str, str]) -> list[ObservedPod]:
        cache = self.pod_cache
        if cache is not None:
            lock = self._seeding.setdefault(namespace, threading.Lock())
            if not cache.seeded(namespace):  # the watch keeps it current from then on
                with lock:  # one list; the other passes wait
                    if not cache.seeded(namespace):
                        self._seed(cache, namespace)
            elif cache.due(namespace) and lock.acquire(blocking=False):  # a reseed: the others read the cache
                try:
                    if cache.due(namespace):
                        self._seed(cache, namespace)
                except ClusterError as failure:  # the watch keeps the cache current: answer from it, retry later
                    log.warning("listing %s's pods again failed (%s): the pod watch's view is used", namespace, failure)
                finally:
                    lock.release()
            return cache.select(namespace, match_labels)
        selector = ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))
        answer = call(
            lambda: self.core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False),
            self.retrying,
        )
        return [observed_pod(item) for item in listed(answer)]

    def _seed(self, cache: PodSource, namespace: str) -> None:
        cache.begin_seed(namespace)
        try:
            # the costliest request sluice makes: a 5xx is sent again at the next pass, a 429 after its Retry-After
            once = replace(self.retrying, policy=replace(self.retrying.policy, backs_off=False))
            answer = call(lambda: self.core.list_namespaced_pod(namespace, _preload_content=False), once)
            items = listed(answer)
        except Exception:
            cache.abandon_seed(namespace)
            raise
        cache.finish_seed(namespace, items)

    def mesh(self, namespace: str, spec: InferencePoolSpec) -> ObservedMesh | None:
        """The pool's Service, its namespace's labels, and every Sidecar the operator may list (cluster-wide, else
        the pool's and its client namespaces'), each read at most every `mesh_seconds`. A Sidecar kind that is not
        installed lists nothing."""
        try:
            service = self._read(
                ("service", namespace, spec.service),
                lambda: read_service(self.core, namespace, spec.service, self.retrying),
            )
            labels = self._read(
                ("namespace", namespace), lambda: read_namespace_labels(self.core, namespace, self.retrying)
            )
            clients = tuple(sorted(spec.routing.client_namespaces or ()))
            sidecars = self._read(
                ("sidecars", namespace, *clients),
                lambda: list_sidecars(self.custom, namespace, spec, self.namespaces, self.retrying),
            )
        except ClusterError as failure:
            return ObservedMesh(failed=f"{failure.status} {failure.reason}")
        return ObservedMesh(service=service, namespace_labels=labels, sidecars=sidecars)

    def mesh_observed(self, kind: str, namespace: str, name: str) -> None:
        """A watch event of a Service, Namespace or Sidecar: the reads it makes stale are read again next pass."""
        if kind == "Service":
            self._mesh_reads.pop(("service", namespace, name), None)
        elif kind == "Namespace":
            self._mesh_reads.pop(("namespace", name), None)
        elif kind == "Sidecar":
            for key in [key for key in self._mesh_reads if key[0] == "sidecars"]:
                self._mesh_reads.pop(key, None)

    def _read(self, key: tuple[str, ...], read: Callable[[], T], seconds: float | None = None) -> T:
        kept = self._mesh_reads.get(key)
        if kept is not None and time.monotonic() - kept[0] < (self.mesh_seconds if seconds is None else seconds):
            return cast(T, kept[1])
        answer = read()
        self._mesh_reads[key] = (time.monotonic(), answer)
        return answer

    def secret_key(self, namespace: str, name: str, key: str) -> str:
        """One key of a Secret, read at most every `SECRET_SECONDS` (a failed read is not kept)."""
        data = self._read(
            ("secret", namespace, name),
            lambda: read_secret_data(self.core, namespace, name, self.retrying),
            SECRET_SECONDS,
        )
        if key not in data:
            raise LookupError(f"Secret {namespace}/{name} has no key {key!r}")
        return base64.b64decode(data[key]).decode()

    def owned(self, namespace: str, pool: str, elsewhere: frozenset[str] = frozenset()) -> list[ObjectKey]:
        return owned_keys(self.custom, namespace, pool, elsewhere, self.namespaces, self.retrying)

    # ---- writes

    def apply(self, desired: Rendered, pool_uid: str | None, adopt: bool) -> WriteResult:
        kind, name, namespace = desired.kind, desired.name, desired.namespace
        key = (namespace, kind, name)
        seen = self._verified.pop(key, None)
        if seen is not None and seen.adopt == adopt and time.monotonic() - seen.read_at < self.resync_seconds:
            if seen.desired == desired:
                self._verified[key] = seen
                return WriteResult(kind, name, "unchanged")  # what this process verified recently: no GET
            self._patch(kind, namespace, name, seen.body(desired))  # read recently: ours (or adopted), so no GET
            self._verified[key] = Verified(copy.deepcopy(desired), adopt, seen.original, seen.read_at)
            return WriteResult(kind, name, "updated")
        live = get_istio_object(self.custom, kind, namespace, name, self.retrying)
        read_at = time.monotonic()
        decision = decide(live, desired.body, pool_uid, adopt)
        if decision.action == "refuse":
            return WriteResult(kind, name, "refused", f"{kind} {namespace}/{name} exists and is not managed by sluice")
        owner, original = ownership(live, pool_uid), None
        if live is not None and owner == "adopted":
            original = kept_original(live)
        elif live is not None and owner == "foreign":
            original = original_of(live)  # adopted by this write
        if decision.action == "unchanged" or decision.body is None:
            self._verified[key] = Verified(copy.deepcopy(desired), adopt, original, read_at)
            return WriteResult(kind, name, "unchanged")
        if decision.action == "restore":
            self._replace(decision.body)
            return WriteResult(kind, name, "restored", f"{kind} {namespace}/{name} given back to its owner")
        self._patch(kind, namespace, name, decision.body)
        self._verified[key] = Verified(copy.deepcopy(desired), adopt, original, read_at)  # once the write succeeded
        return WriteResult(kind, name, "created" if live is None else "updated")

    def _patch(self, kind: str, namespace: str, name: str, body: JsonObject) -> None:
        k = ISTIO_KINDS[kind]
        self._server_side_apply(
            self.custom.patch_namespaced_custom_object, k.group, k.version, k.plural, namespace, name, body
        )

    def _server_side_apply(
        self,
        patch: Callable[..., object],
        group: str,
        version: str,
        plural: str,
        namespace: str,
        name: str,
        body: JsonObject,
    ) -> None:
        """`patch` (an object's or its status subresource's) as a forced server-side apply by `sluice`, within
        the write fence, its answer read and dropped undecoded (`_discard`)."""
        answer = call_within(
            self.fence,
            lambda seconds: patch(
                group,
                version,
                namespace,
                plural,
                name,
                body,
                field_manager=FIELD_MANAGER,
                force=True,
                _content_type=APPLY,
                _request_timeout=seconds,
                _preload_content=False,
            ),
            self.retrying,
        )
        _discard(answer)

    def release(self, namespace: str, key: ObjectKey) -> WriteResult:
        namespace = key.namespace or namespace
        self._verified.pop((namespace, key.kind, key.name), None)
        live = get_istio_object(self.custom, key.kind, namespace, key.name, self.retrying)
        if live is None:
            return WriteResult(key.kind, key.name, "unchanged")
        decision = release(live)
        if decision.action == "restore" and decision.body is not None:
            self._replace(decision.body)
            return WriteResult(key.kind, key.name, "restored")
        k = ISTIO_KINDS[key.kind]
        call_within(
            self.fence,
            lambda seconds: self.custom.delete_namespaced_custom_object(
                k.group, k.version, namespace, k.plural, key.name, _request_timeout=seconds
            ),
            self.retrying,
        )
        return WriteResult(key.kind, key.name, "pruned")

    def _replace(self, body: JsonObject) -> None:
        k = ISTIO_KINDS[text(body, "kind")]
        meta = strings(body, "metadata")  # its name and namespace among them
        call_within(
            self.fence,
            lambda seconds: self.custom.replace_namespaced_custom_object(
                k.group, k.version, meta["namespace"], k.plural, meta["name"], body, _request_timeout=seconds
            ),
            self.retrying,
        )

    def write_status(self, namespace: str, name: str, status: InferencePoolStatus) -> None:
        body: JsonObject = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "metadata": {"name": name, "namespace": namespace},
            "status": status.wire(),
        }
        self._server_side_apply(
            self.custom.patch_namespaced_custom_object_status, GROUP, VERSION, PLURAL, namespace, name, body
        )

    def emit(self, namespace: str, name: str, uid: str | None, event: Event) -> None:
        now = datetime.now(UTC)
        body = k8s.CoreV1Event(
            metadata=k8s.V1ObjectMeta(name=f"{name}.{uuid.uuid4().hex[:12]}", namespace=namespace),
            involved_object=k8s.V1ObjectReference(
                api_version=f"{GROUP}/{VERSION}", kind=KIND, name=name, namespace=namespace, uid=uid
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
        call_within(
            self.fence,
            lambda seconds: self.core.create_namespaced_event(namespace, body, _request_timeout=seconds),
            self.retrying,
        )
