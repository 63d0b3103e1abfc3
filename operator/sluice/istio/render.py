"""Istio rendering: a Plan becomes DestinationRule, VirtualService, ServiceEntry and EnvoyFilter objects. Pure.

Design (see docs/istio.md): per-pod weights exist only in EDS, and for Kubernetes pods Istio always sends weight 1,
so per-pod weights travel in a STATIC, MESH_INTERNAL ServiceEntry whose endpoints carry `weight` (an EDS-only,
incremental push). Istio turns weight 0 into 1, so a zeroed pod is *removed* from the endpoints. Clients keep
calling the Kubernetes Service: a VirtualService on the Service's host sends them to the ServiceEntry host, split
across one DestinationRule subset per revision. Where the VirtualService belongs to someone else, the split goes
into an EnvoyFilter HTTP_ROUTE patch instead. A shadow canary adds a request mirror to the candidate's subset on
that same route (VirtualService `mirrors[]`, or the route's `request_mirror_policies`), only while the plan has
one: the next render after the shadow ends has none. Envoy least-request tuning is an EnvoyFilter CLUSTER patch,
rendered only when asked for (an EnvoyFilter change pushes to every proxy of its namespace). Admission limits
(`admission.mode: Enforce`) are one EnvoyFilter per hardware class on its pods' sidecars.
"""

from __future__ import annotations

from sluice.api.durations import format_duration
from sluice.api.jsontypes import JsonObject, JsonValue
from sluice.api.v1alpha1 import InferencePoolSpec
from sluice.core.mesh import (
    ENDPOINT_PORT_NAME,
    TLS_MODE_LABEL,
    USE_WAYPOINT_LABEL,
    USE_WAYPOINT_NAMESPACE_LABEL,
    needs_route,
)
from sluice.core.reconcile import Plan
from sluice.istio.envoyfilters import (
    render_cluster_envoy_filters,
    render_inbound_envoy_filters,
    render_route_envoy_filters,
)
from sluice.istio.kinds import DESTINATION_RULE, SERVICE_ENTRY
from sluice.istio.objects import PoolRef, destination_host, endpoints_host, istio_object, subset_name
from sluice.istio.ownership import POOL_LABEL
from sluice.istio.rendered import Rendered
from sluice.istio.routes import render_virtual_service


def endpoint_tls_mode(tls_mode: str | None) -> str:
    """An endpoint's `security.istio.io/tlsMode`, as Istio's registry gives a pod: its own label, else
    `disabled` (pilot/pkg/serviceregistry/kube/conversion.go). Written even when `disabled`: for a ServiceEntry
    endpoint with a serviceAccount and no label, istiod assumes `istio` (serviceentry/conversion.go
    getTLSModeFromWorkloadEntry), mutual TLS to a pod with no sidecar to answer it. A waypoint ignores the label
    (it never sends legacy mutual TLS; it reaches ambient pods over HBONE)."""
    return tls_mode or "disabled"


def render_service_entry(pool: PoolRef, spec: InferencePoolSpec, plan: Plan) -> Rendered:
    revision_label = spec.canary.revision_label if spec.canary else None
    mesh = plan.mesh
    protocol = mesh.protocol if mesh.protocol is not None else "HTTP"
    port_name = ENDPOINT_PORT_NAME.get(protocol, "http")
    endpoints: list[JsonValue] = []
    for endpoint in sorted(plan.endpoints, key=lambda e: e.pod):
        labels: JsonObject = {TLS_MODE_LABEL: endpoint_tls_mode(endpoint.tls_mode), POOL_LABEL: pool.name}
        if revision_label and endpoint.revision is not None:
            labels[revision_label] = endpoint.revision
        entry: JsonObject = {
            "address": endpoint.ip,
            "ports": {port_name: spec.target_port},
            "labels": labels,
            "weight": endpoint.weight,
        }
        if endpoint.service_account:
            # The pod's identity: Istio puts it in the client's SAN check for mTLS to this host.
            entry["serviceAccount"] = endpoint.service_account
        endpoints.append(entry)
    port: JsonObject = {"number": spec.target_port, "name": port_name}
    if protocol:  # "": left to Istio's protocol detection, as the Service's own port is
        port["protocol"] = protocol
    waypoint: dict[str, str] = {}
    if mesh.waypoint is not None:  # bound to the Service's waypoint, which then routes to it
        waypoint[USE_WAYPOINT_LABEL] = mesh.waypoint
        if mesh.waypoint_namespace is not None:
            waypoint[USE_WAYPOINT_NAMESPACE_LABEL] = mesh.waypoint_namespace
    body: JsonObject = {
        "hosts": [endpoints_host(pool, spec)],
        "location": "MESH_INTERNAL",
        "resolution": "STATIC",
        "ports": [port],
        "endpoints": endpoints,
        "exportTo": [*mesh.export_to],
    }
    return istio_object(SERVICE_ENTRY, pool, body, labels=waypoint)


def _load_balancer(spec: InferencePoolSpec) -> JsonObject:
    affinity = spec.routing.session_affinity
    if affinity is not None:
        return {"consistentHash": {"httpHeaderName": affinity.header}, "localityLbSetting": {"enabled": False}}
    return {"simple": "LEAST_REQUEST", "localityLbSetting": {"enabled": False}}


def render_destination_rule(pool: PoolRef, spec: InferencePoolSpec, plan: Plan) -> Rendered:
    policy: JsonObject = {"loadBalancer": _load_balancer(spec)}
    outlier = spec.protection.outlier_detection
    if outlier.enabled:
        policy["outlierDetection"] = {
            "consecutive5xxErrors": outlier.consecutive_5xx_errors,
            "interval": format_duration(outlier.interval),
            "baseEjectionTime": format_duration(outlier.base_ejection_time),
            "maxEjectionPercent": outlier.max_ejection_percent,
        }
    body: JsonObject = {
        "host": destination_host(pool, spec),
        "trafficPolicy": policy,
        "exportTo": [*plan.mesh.export_to],
    }
    if spec.canary is not None and plan.revisions:
        body["subsets"] = [
            {"name": subset_name(revision), "labels": {spec.canary.revision_label: revision}}
            for revision in plan.revisions
        ]
    return istio_object(DESTINATION_RULE, pool, body)


def needs_virtual_service(spec: InferencePoolSpec, plan: Plan) -> bool:
    """A route is needed to reach the ServiceEntry host, or to split between revisions."""
    return needs_route(spec, bool(plan.revision_weights))


def render(pool: PoolRef, spec: InferencePoolSpec, plan: Plan) -> list[Rendered]:
    """Every Istio object the pool needs, in apply order (endpoints and subsets before the routes using them).

    Which EnvoyFilters, and in which namespaces, the mesh plan says (`sluice.core.mesh`: none behind a waypoint);
    a plan whose mesh side refused the routing renders nothing."""
    if plan.mesh.refusal is not None:
        return []
    objects: list[Rendered] = []
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
    if plan.admission is not None:
        objects += render_inbound_envoy_filters(pool, spec, plan.admission.limits, plan.admission.rates)
    return objects
