"""What every Istio object of a pool shares: the pool it belongs to (`PoolRef`), names, hosts and ports, and the
metadata (labels, the owner) `istio_object` puts around a spec. Pure."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from sluice.api.jsontypes import JsonObject
from sluice.api.v1alpha1 import API_VERSION, KIND, InferencePoolSpec
from sluice.core.mesh import PoolId
from sluice.core.mesh import endpoints_host as _endpoints_host
from sluice.core.mesh import service_host as _service_host
from sluice.istio.kinds import IstioKind
from sluice.istio.ownership import MANAGED_BY, POOL_LABEL, POOL_NAMESPACE_LABEL
from sluice.istio.rendered import Rendered


@dataclass(frozen=True)
class PoolRef:
    """The pool the objects belong to: names derive from it, ownerReferences point at it."""

    name: str
    namespace: str
    uid: str | None = None

    @property
    def id(self) -> PoolId:
        return PoolId(self.name, self.namespace)


def object_name(pool: PoolRef) -> str:
    return f"sluice-{pool.name}"[:253]


def service_host(pool: PoolRef, spec: InferencePoolSpec) -> str:
    return _service_host(pool.id, spec)


def endpoints_host(pool: PoolRef, spec: InferencePoolSpec) -> str:
    """The ServiceEntry's host: internal to the mesh, reached only through sluice's routing."""
    return _endpoints_host(pool.id)


def destination_host(pool: PoolRef, spec: InferencePoolSpec) -> str:
    return endpoints_host(pool, spec) if spec.routing.endpoint_weights else service_host(pool, spec)


def destination_port(spec: InferencePoolSpec) -> int:
    if spec.routing.endpoint_weights:
        return spec.target_port
    return spec.service_port or spec.target_port


def dns_part(prefix: str, value: str, room: int, cut: int) -> str:
    """`prefix` and `value` as DNS label characters: `value` as it is when it is already one and fits in `room`;
    else cleaned, cut to `cut` characters and followed by a short hash, which keeps distinct values distinct."""
    cleaned = re.sub(r"[^a-z0-9-]", "-", value.lower()).strip("-") or "x"
    if cleaned == value and len(cleaned) <= room:
        return f"{prefix}{cleaned}"
    digest = hashlib.sha256(value.encode()).hexdigest()[:6]
    return f"{prefix}{cleaned[:cut].strip('-')}-{digest}"


def subset_name(revision: str) -> str:
    """A DNS label for a revision's subset."""
    return dns_part("rev-", revision, 59, 50)


def istio_object(
    kind: IstioKind,
    pool: PoolRef,
    spec: JsonObject,
    kind_suffix: str = "",
    namespace: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> Rendered:
    """The object: names, labels (the pool's, then `labels`) and the owner around `spec`. An object in another
    namespace than the pool's (an EnvoyFilter for clients there) has no ownerReference — Kubernetes' garbage
    collector treats a cross-namespace owner as absent and would delete it — and is released by the pool's
    finalizer instead; its labels name the pool's namespace."""
    where = namespace or pool.namespace
    # A copy elsewhere is named after the pool's namespace too ('.' cannot occur in a pool name): pools of one
    # name in two namespaces both writing into a third stay two objects.
    name = (
        object_name(pool) + kind_suffix
        if where == pool.namespace
        else f"sluice-{pool.name}.{pool.namespace}{kind_suffix}"
    )
    meta: JsonObject = {
        "name": name,
        "namespace": where,
        "labels": {**MANAGED_BY, POOL_LABEL: pool.name, POOL_NAMESPACE_LABEL: pool.namespace, **(labels or {})},
    }
    if pool.uid and where == pool.namespace:
        meta["ownerReferences"] = [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": pool.name,
                "uid": pool.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    body: JsonObject = {"apiVersion": kind.api_version, "kind": kind.kind, "metadata": meta, "spec": spec}
    return Rendered(kind.kind, name, where, body)
