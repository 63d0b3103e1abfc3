"""Istio rendering: a Plan becomes DestinationRule, VirtualService, ServiceEntry and EnvoyFilter objects. Pure.

Design (see docs/istio.md): per-pod weights exist only in EDS, and for Kubernetes pods Istio always sends weight 1,
so per-pod weights travel in a STATIC, MESH_INTERNAL ServiceEntry whose endpoints carry `weight` (an EDS-only,
incremental push). Istio turns weight 0 into 1, so a zeroed pod is *removed* from the endpoints. Clients keep
calling the Kubernetes Service: a VirtualService on the Service's host sends them to the ServiceEntry host, split
across one DestinationRule subset per revision. Where the VirtualService belongs to someone else, the split goes
into an EnvoyFilter HTTP_ROUTE patch instead. A shadow canary adds a request mirror to the candidate's subset on
that same route (VirtualService `mirrors[]`, or the route's `request_mirror_policies`), only while the plan has
one: the next render after the shadow ends has none. Envoy least-request tuning is an EnvoyFilter CLUSTER patch,
rendered only when asked for (an EnvoyFilter change pushes to every proxy of its namespace).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from sluice.api.durations import format_duration
from sluice.api.v1alpha1 import API_VERSION, KIND, InferencePoolSpec
from sluice.core.abtest import key_match
from sluice.core.mesh import (
    ENDPOINT_PORT_NAME,
    TLS_MODE_LABEL,
    USE_WAYPOINT_LABEL,
    USE_WAYPOINT_NAMESPACE_LABEL,
    PoolId,
    needs_route,
)
from sluice.core.mesh import endpoints_host as _endpoints_host
from sluice.core.mesh import service_host as _service_host
from sluice.core.reconcile import Plan
from sluice.istio.kinds import DESTINATION_RULE, ENVOY_FILTER, SERVICE_ENTRY, VIRTUAL_SERVICE
from sluice.istio.ownership import MANAGED_BY, POOL_LABEL, POOL_NAMESPACE_LABEL

__all__ = ["MANAGED_BY", "POOL_LABEL", "PoolRef", "object_name", "render", "subset_name"]

ROUTE_NAME = "sluice-weights"


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


def subset_name(revision: str) -> str:
    """A DNS label for a revision's subset; a short hash keeps distinct revisions distinct after cleaning."""
    cleaned = re.sub(r"[^a-z0-9-]", "-", revision.lower()).strip("-") or "x"
    if cleaned == revision and len(cleaned) <= 59:
        return f"rev-{cleaned}"
    digest = hashlib.sha256(revision.encode()).hexdigest()[:6]
    return f"rev-{cleaned[:50].strip('-')}-{digest}"


def _metadata(pool: PoolRef, kind_suffix: str = "", namespace: str | None = None) -> dict[str, Any]:
    """Names, labels and the owner. An object in another namespace than the pool's (an EnvoyFilter for clients
    there) has no ownerReference — Kubernetes' garbage collector treats a cross-namespace owner as absent and
    would delete it — and is released by the pool's finalizer instead; its labels name the pool's namespace."""
    where = namespace or pool.namespace
    # A copy elsewhere is named after the pool's namespace too ('.' cannot occur in a pool name): pools of one
    # name in two namespaces both writing into a third stay two objects.
    name = (
        object_name(pool) + kind_suffix
        if where == pool.namespace
        else f"sluice-{pool.name}.{pool.namespace}{kind_suffix}"
    )
    meta: dict[str, Any] = {
        "name": name,
        "namespace": where,
        "labels": {**MANAGED_BY, POOL_LABEL: pool.name, POOL_NAMESPACE_LABEL: pool.namespace},
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
    return meta


def endpoint_tls_mode(tls_mode: str | None) -> str:
    """An endpoint's `security.istio.io/tlsMode`, as Istio's registry gives a pod: its own label, else
    `disabled` (pilot/pkg/serviceregistry/kube/conversion.go). Written even when `disabled`: for a ServiceEntry
    endpoint with a serviceAccount and no label, istiod assumes `istio` (serviceentry/conversion.go
    getTLSModeFromWorkloadEntry), mutual TLS to a pod with no sidecar to answer it. A waypoint ignores the label
    (it never sends legacy mutual TLS; it reaches ambient pods over HBONE)."""
    return tls_mode or "disabled"


def render_service_entry(pool: PoolRef, spec: InferencePoolSpec, plan: Plan) -> dict[str, Any]:
    revision_label = spec.canary.revision_label if spec.canary else None
    mesh = plan.mesh
    protocol = mesh.protocol if mesh.protocol is not None else "HTTP"
    port_name = ENDPOINT_PORT_NAME.get(protocol, "http")
    endpoints = []
    for endpoint in sorted(plan.endpoints, key=lambda e: e.pod):
        labels = {TLS_MODE_LABEL: endpoint_tls_mode(endpoint.tls_mode), POOL_LABEL: pool.name}
        if revision_label and endpoint.revision is not None:
            labels[revision_label] = endpoint.revision
        entry: dict[str, Any] = {
            "address": endpoint.ip,
            "ports": {port_name: spec.target_port},
            "labels": labels,
            "weight": endpoint.weight,
        }
        if endpoint.service_account:
            # The pod's identity: Istio puts it in the client's SAN check for mTLS to this host.
            entry["serviceAccount"] = endpoint.service_account
        endpoints.append(entry)
    port: dict[str, Any] = {"number": spec.target_port, "name": port_name}
    if protocol:  # "": left to Istio's protocol detection, as the Service's own port is
        port["protocol"] = protocol
    meta = _metadata(pool)
    if mesh.waypoint is not None:  # bound to the Service's waypoint, which then routes to it
        meta["labels"][USE_WAYPOINT_LABEL] = mesh.waypoint
        if mesh.waypoint_namespace is not None:
            meta["labels"][USE_WAYPOINT_NAMESPACE_LABEL] = mesh.waypoint_namespace
    return {
        "apiVersion": SERVICE_ENTRY.api_version,
        "kind": SERVICE_ENTRY.kind,
        "metadata": meta,
        "spec": {
            "hosts": [endpoints_host(pool, spec)],
            "location": "MESH_INTERNAL",
            "resolution": "STATIC",
            "ports": [port],
            "endpoints": endpoints,
            "exportTo": list(mesh.export_to),
        },
    }


def _load_balancer(spec: InferencePoolSpec) -> dict[str, Any]:
    affinity = spec.routing.session_affinity
    if affinity is not None:
        return {"consistentHash": {"httpHeaderName": affinity.header}, "localityLbSetting": {"enabled": False}}
    return {"simple": "LEAST_REQUEST", "localityLbSetting": {"enabled": False}}


def render_destination_rule(pool: PoolRef, spec: InferencePoolSpec, plan: Plan) -> dict[str, Any]:
    policy: dict[str, Any] = {"loadBalancer": _load_balancer(spec)}
    outlier = spec.protection.outlier_detection
    if outlier.enabled:
        policy["outlierDetection"] = {
            "consecutive5xxErrors": outlier.consecutive_5xx_errors,
            "interval": format_duration(outlier.interval),
            "baseEjectionTime": format_duration(outlier.base_ejection_time),
            "maxEjectionPercent": outlier.max_ejection_percent,
        }
    body: dict[str, Any] = {
        "host": destination_host(pool, spec),
        "trafficPolicy": policy,
        "exportTo": list(plan.mesh.export_to),
    }
    if spec.canary is not None and plan.revisions:
        body["subsets"] = [
            {"name": subset_name(revision), "labels": {spec.canary.revision_label: revision}}
            for revision in plan.revisions
        ]
    return {
        "apiVersion": DESTINATION_RULE.api_version,
        "kind": DESTINATION_RULE.kind,
        "metadata": _metadata(pool),
        "spec": body,
    }


def _route_targets(spec: InferencePoolSpec, plan: Plan) -> list[tuple[str | None, int]]:
    """(subset or None for the whole pool, weight) pairs, zero weights dropped."""
    if not plan.revision_weights:
        return [(None, 100)]
    return [(subset_name(rev), weight) for rev, weight in sorted(plan.revision_weights.items()) if weight > 0]


def render_virtual_service(pool: PoolRef, spec: InferencePoolSpec, plan: Plan) -> dict[str, Any]:
    host = destination_host(pool, spec)
    route = []
    for subset, weight in _route_targets(spec, plan):
        destination: dict[str, Any] = {"host": host, "port": {"number": destination_port(spec)}}
        if subset:
            destination["subset"] = subset
        route.append({"destination": destination, "weight": weight})
    http: dict[str, Any] = {"name": ROUTE_NAME, "route": route}
    mirror = _mirror(plan)
    if mirror is not None:
        subset, percent = mirror
        target = {"host": host, "port": {"number": destination_port(spec)}, "subset": subset}
        http["mirrors"] = [{"destination": target, "percentage": {"value": percent}}]
    retries = render_retries(spec)
    if retries is not None:
        http["retries"] = retries
    # Istio tries routes in order: testers' header match first, then the A/B test's keys, then the split
    candidates = (_steered_route(pool, spec, plan, retries), _ab_route(pool, spec, plan, retries))
    routes = [*(route for route in candidates if route is not None), http]
    return {
        "apiVersion": VIRTUAL_SERVICE.api_version,
        "kind": VIRTUAL_SERVICE.kind,
        "metadata": _metadata(pool),
        "spec": {
            "hosts": [service_host(pool, spec)],
            "gateways": list(spec.routing.gateways),
            "http": routes,
            "exportTo": list(plan.mesh.export_to),
        },
    }


MATCH_ROUTE_NAME = "sluice-match"
AB_ROUTE_NAME = "sluice-ab"


def _steered_route(
    pool: PoolRef, spec: InferencePoolSpec, plan: Plan, retries: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The header route: requests matching any of `spec.canary.match` go to the candidate's subset (Istio's
    HTTPMatchRequest: headers AND-ed within an entry, entries OR-ed)."""
    canary = spec.canary
    if canary is None or canary.match is None or plan.steer is None or plan.steer not in plan.revisions:
        return None
    matches = [
        {"headers": {name: cond.wire() for name, cond in sorted(entry.headers.items())}} for entry in canary.match
    ]
    return _candidate_route(pool, spec, plan.steer, MATCH_ROUTE_NAME, matches, retries)


def _ab_route(
    pool: PoolRef, spec: InferencePoolSpec, plan: Plan, retries: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The A/B test's route: keys in the candidate's buckets go to it, every request (`sluice.core.abtest`)."""
    canary = spec.canary
    if canary is None or canary.ab_test is None or plan.steer is None or plan.steer not in plan.revisions:
        return None
    return _candidate_route(pool, spec, plan.steer, AB_ROUTE_NAME, [{"headers": key_match(canary.ab_test)}], retries)


def _candidate_route(
    pool: PoolRef,
    spec: InferencePoolSpec,
    revision: str,
    name: str,
    matches: list[dict[str, Any]],
    retries: dict[str, Any] | None,
) -> dict[str, Any]:
    target = {"host": destination_host(pool, spec), "port": {"number": destination_port(spec)}}
    route: dict[str, Any] = {
        "name": name,
        "match": matches,
        "route": [{"destination": {**target, "subset": subset_name(revision)}}],
    }
    if retries is not None:
        route["retries"] = retries
    return route


def _mirror(plan: Plan) -> tuple[str, float] | None:
    """(candidate subset, percent) of the shadow canary's request mirror; None when none is to be rendered."""
    if plan.mirror is None or plan.mirror.revision not in plan.revisions:
        return None
    return subset_name(plan.mirror.revision), plan.mirror.percent


def mirror_fraction(percent: float) -> dict[str, Any]:
    """Envoy's FractionalPercent for a mirror percentage, in millionths as istiod writes mirrorPercentage."""
    return {"numerator": round(percent * 10_000), "denominator": "MILLION"}


def render_retries(spec: InferencePoolSpec) -> dict[str, Any] | None:
    """Istio HTTPRetry: only failures before the response starts, to another pod by default."""
    retries = spec.routing.retries
    if retries is None:
        return None
    out: dict[str, Any] = {
        "attempts": retries.attempts,
        # status codes as numbers: istiod moves them to retriable_status_codes and adds retriable-status-codes
        # (pilot/pkg/networking/core/route/retry/retry.go parseRetryOn)
        "retryOn": ",".join([*retries.retry_on, *(str(code) for code in sorted(set(retries.status_codes)))]),
        "retryRemoteLocalities": retries.retry_remote_localities,
        "retryIgnorePreviousHosts": retries.retry_ignore_previous_hosts,
    }
    if retries.per_try_timeout is not None:
        out["perTryTimeout"] = format_duration(retries.per_try_timeout)
    if retries.backoff is not None:
        out["backoff"] = format_duration(retries.backoff)
    return out


def cluster_name(port: int, subset: str | None, host: str) -> str:
    """Istio's outbound cluster name."""
    return f"outbound|{port}|{subset or ''}|{host}"


def _contexts(spec: InferencePoolSpec) -> list[str]:
    gateways = spec.routing.gateways
    contexts = ["SIDECAR_OUTBOUND"] if "mesh" in gateways else []
    if any(gateway != "mesh" for gateway in gateways):
        contexts.append("GATEWAY")
    return contexts


def route_patch_value(spec: InferencePoolSpec, plan: Plan, host: str) -> dict[str, Any]:
    """The Envoy RouteAction fragment merged into the route: one cluster, or weighted clusters for a split."""
    port = destination_port(spec)
    targets = _route_targets(spec, plan)
    action: dict[str, Any]
    if len(targets) == 1:
        action = {"cluster": cluster_name(port, targets[0][0], host)}
    else:
        action = {
            "weighted_clusters": {
                "clusters": [{"name": cluster_name(port, subset, host), "weight": weight} for subset, weight in targets]
            }
        }
    mirror = _mirror(plan)
    if mirror is not None:
        subset, percent = mirror
        action["request_mirror_policies"] = [
            {
                "cluster": cluster_name(port, subset, host),
                "runtime_fraction": {"default_value": mirror_fraction(percent)},
            }
        ]
    return {"route": action}


def _envoy_filters(
    pool: PoolRef,
    spec: InferencePoolSpec,
    plan: Plan,
    suffix: str,
    apply_to: str,
    match: dict[str, Any],
    value: dict[str, Any],
) -> list[dict[str, Any]]:
    """The EnvoyFilter, one copy in each namespace whose proxies it must reach (an EnvoyFilter applies to its own
    namespace's proxies, or to every proxy from the root namespace), with one MERGE patch per proxy context
    (sidecars, and gateways when the pool names any)."""
    patches = [
        {"applyTo": apply_to, "match": {"context": context, **match}, "patch": {"operation": "MERGE", "value": value}}
        for context in _contexts(spec)
    ]
    return [
        {
            "apiVersion": ENVOY_FILTER.api_version,
            "kind": ENVOY_FILTER.kind,
            "metadata": _metadata(pool, suffix, namespace),
            "spec": {"configPatches": patches},
        }
        for namespace in plan.mesh.envoy_filter_namespaces
    ]


def render_route_envoy_filters(pool: PoolRef, spec: InferencePoolSpec, plan: Plan) -> list[dict[str, Any]]:
    vhost = f"{service_host(pool, spec)}:{spec.service_port or spec.target_port}"
    match = {"routeConfiguration": {"vhost": {"name": vhost, "route": {"name": spec.routing.route_name}}}}
    value = route_patch_value(spec, plan, destination_host(pool, spec))
    return _envoy_filters(pool, spec, plan, "-routes", "HTTP_ROUTE", match, value)


def cluster_patch_value(spec: InferencePoolSpec) -> dict[str, Any]:
    """The Envoy Cluster fragment for least-request tuning, or bounded-load hashing with session affinity."""
    least = spec.routing.least_request
    affinity = spec.routing.session_affinity
    if least is not None:
        return {
            "lb_policy": "LEAST_REQUEST",
            "least_request_lb_config": {
                "choice_count": least.choice_count,
                "active_request_bias": {
                    "default_value": least.active_request_bias,
                    "runtime_key": "sluice.least_request.active_request_bias",
                },
            },
        }
    if affinity is not None and affinity.hash_balance_factor is not None:
        return {
            "common_lb_config": {"consistent_hashing_lb_config": {"hash_balance_factor": affinity.hash_balance_factor}}
        }
    return {}


def render_cluster_envoy_filters(pool: PoolRef, spec: InferencePoolSpec, plan: Plan) -> list[dict[str, Any]]:
    match = {"cluster": {"service": destination_host(pool, spec), "portNumber": destination_port(spec)}}
    return _envoy_filters(pool, spec, plan, "-lb", "CLUSTER", match, cluster_patch_value(spec))


def needs_virtual_service(spec: InferencePoolSpec, plan: Plan) -> bool:
    """A route is needed to reach the ServiceEntry host, or to split between revisions."""
    return needs_route(spec, bool(plan.revision_weights))


def render(pool: PoolRef, spec: InferencePoolSpec, plan: Plan) -> list[dict[str, Any]]:
    """Every Istio object the pool needs, in apply order (endpoints and subsets before the routes using them).

    Which EnvoyFilters, and in which namespaces, the mesh plan says (`sluice.core.mesh`: none behind a waypoint);
    a plan whose mesh side refused the routing renders nothing."""
    if plan.mesh.refusal is not None:
        return []
    objects: list[dict[str, Any]] = []
    if spec.routing.endpoint_weights:
        objects.append(render_service_entry(pool, spec, plan))
    objects.append(render_destination_rule(pool, spec, plan))
    kinds = plan.mesh.envoy_filter_kinds
    if needs_virtual_service(spec, plan) and spec.routing.weights_via == "VirtualService":
        objects.append(render_virtual_service(pool, spec, plan))
    if "routes" in kinds:
        objects += render_route_envoy_filters(pool, spec, plan)
    if "lb" in kinds:
        objects += render_cluster_envoy_filters(pool, spec, plan)
    return objects
