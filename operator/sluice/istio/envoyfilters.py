"""The EnvoyFilters: the split as an HTTP_ROUTE patch where the VirtualService belongs to someone else, and the
least-request or bounded-load tuning as a CLUSTER patch, rendered only when asked for (an EnvoyFilter change
pushes to every proxy of its namespace). One copy in each namespace whose proxies it must reach. And, under
`admission.mode: Enforce`, each hardware class's inbound limit on its pods' sidecars. Pure."""

from __future__ import annotations

from collections.abc import Mapping

from sluice.api.jsontypes import JsonObject, JsonValue
from sluice.api.v1alpha1 import InferencePoolSpec
from sluice.core.reconcile import Plan
from sluice.istio.kinds import ENVOY_FILTER
from sluice.istio.objects import PoolRef, destination_host, destination_port, dns_part, istio_object, service_host
from sluice.istio.rendered import Rendered
from sluice.istio.routes import mirror, route_targets


def cluster_name(port: int, subset: str | None, host: str) -> str:
    """Istio's outbound cluster name."""
    return f"outbound|{port}|{subset or ''}|{host}"


def _contexts(spec: InferencePoolSpec) -> list[str]:
    gateways = spec.routing.gateways
    contexts = ["SIDECAR_OUTBOUND"] if "mesh" in gateways else []
    if any(gateway != "mesh" for gateway in gateways):
        contexts.append("GATEWAY")
    return contexts


def mirror_fraction(percent: float) -> JsonObject:
    """Envoy's FractionalPercent for a mirror percentage, in millionths as istiod writes mirrorPercentage."""
    return {"numerator": round(percent * 10_000), "denominator": "MILLION"}


def route_patch_value(spec: InferencePoolSpec, plan: Plan, host: str) -> JsonObject:
    """The Envoy RouteAction fragment merged into the route: one cluster, or weighted clusters for a split."""
    port = destination_port(spec)
    targets = route_targets(spec, plan)
    action: JsonObject
    if len(targets) == 1:
        action = {"cluster": cluster_name(port, targets[0][0], host)}
    else:
        clusters: list[JsonValue] = [
            {"name": cluster_name(port, subset, host), "weight": weight} for subset, weight in targets
        ]
        action = {"weighted_clusters": {"clusters": clusters}}
    mirrored = mirror(plan)
    if mirrored is not None:
        subset, percent = mirrored
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
    match: JsonObject,
    value: JsonObject,
) -> list[Rendered]:
    """The EnvoyFilter, one copy in each namespace whose proxies it must reach (an EnvoyFilter applies to its own
    namespace's proxies, or to every proxy from the root namespace), with one MERGE patch per proxy context
    (sidecars, and gateways when the pool names any)."""
    patches: list[JsonValue] = [
        {"applyTo": apply_to, "match": {"context": context, **match}, "patch": {"operation": "MERGE", "value": value}}
        for context in _contexts(spec)
    ]
    return [
        istio_object(ENVOY_FILTER, pool, {"configPatches": patches}, suffix, namespace)
        for namespace in plan.mesh.envoy_filter_namespaces
    ]


def render_route_envoy_filters(pool: PoolRef, spec: InferencePoolSpec, plan: Plan) -> list[Rendered]:
    vhost = f"{service_host(pool, spec)}:{spec.service_port or spec.target_port}"
    match: JsonObject = {"routeConfiguration": {"vhost": {"name": vhost, "route": {"name": spec.routing.route_name}}}}
    value = route_patch_value(spec, plan, destination_host(pool, spec))
    return _envoy_filters(pool, spec, plan, "-routes", "HTTP_ROUTE", match, value)


def cluster_patch_value(spec: InferencePoolSpec) -> JsonObject:
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


def render_cluster_envoy_filters(pool: PoolRef, spec: InferencePoolSpec, plan: Plan) -> list[Rendered]:
    match: JsonObject = {"cluster": {"service": destination_host(pool, spec), "portNumber": destination_port(spec)}}
    return _envoy_filters(pool, spec, plan, "-lb", "CLUSTER", match, cluster_patch_value(spec))


INBOUND_ROUTE = "default"
"""The one route of a sidecar's inbound HTTP route configuration (istio/istio pilot/pkg/networking/core/route/
route.go `BuildDefaultHTTPInboundRoute`, `DefaultRouteName`), in the configuration named after the inbound
cluster, `inbound|<port>||` (httproute.go `buildSidecarInboundHTTPRouteConfig`)."""
UNBOUNDED = 4_294_967_295
"""What istiod sets every inbound circuit-breaker threshold to (cluster_traffic_policy.go
`getDefaultCircuitBreakerThresholds`, math.MaxUint32): the limit sluice adds bounds requests alone."""


def inbound_patches(spec: InferencePoolSpec, limit: int) -> list[JsonValue]:
    """The two patches that put `limit` on the requests a pod's sidecar lets through to its engine at once.

    istiod gives every inbound cluster one DEFAULT-priority circuit-breaker threshold (all unbounded), and Istio
    1.30's MERGE appends to a repeated field (pkg/proto/merge), while Envoy reads the first threshold of a priority
    (source/common/upstream/upstream_impl.cc, `ResourceManagers::load`, `std::find_if`): a DEFAULT threshold
    merged in would never be read. So the limit is a HIGH-priority threshold, the only one of its priority, and
    the inbound route sends its requests at HIGH priority; tests/test_envoy_inbound_limit.py holds real Envoy to
    it. (Istio 1.31's MERGE_AND_REPLACE_LIST could replace the list instead; 1.30 refuses that operation.)"""
    port = spec.target_port
    threshold: JsonObject = {
        "priority": "HIGH",
        "max_requests": limit,
        "max_connections": UNBOUNDED,
        "max_pending_requests": UNBOUNDED,
        "max_retries": UNBOUNDED,
        "track_remaining": True,
    }
    return [
        {
            "applyTo": "CLUSTER",
            "match": {"context": "SIDECAR_INBOUND", "cluster": {"portNumber": port}},
            "patch": {"operation": "MERGE", "value": {"circuit_breakers": {"thresholds": [threshold]}}},
        },
        {
            "applyTo": "HTTP_ROUTE",
            "match": {
                "context": "SIDECAR_INBOUND",
                "routeConfiguration": {"portNumber": port, "vhost": {"route": {"name": INBOUND_ROUTE}}},
            },
            "patch": {"operation": "MERGE", "value": {"route": {"priority": "HIGH"}}},
        },
    ]


def class_suffix(hardware_class: str) -> str:
    """`-inbound-<class>` as a DNS name part (a class is a label value: upper case and '_' allowed)."""
    return dns_part("-inbound-", hardware_class, 40, 33)


def render_inbound_envoy_filters(pool: PoolRef, spec: InferencePoolSpec, limits: Mapping[str, int]) -> list[Rendered]:
    """One EnvoyFilter per hardware class with a limit, in the pool's namespace, selecting the class's pods (the
    pool's labels and the class label)."""
    objects = []
    for hardware_class, limit in sorted(limits.items()):
        selector: JsonObject = {**spec.selector.match_labels, spec.capacity.class_label: hardware_class}
        body: JsonObject = {"workloadSelector": {"labels": selector}, "configPatches": inbound_patches(spec, limit)}
        objects.append(istio_object(ENVOY_FILTER, pool, body, class_suffix(hardware_class)))
    return objects
