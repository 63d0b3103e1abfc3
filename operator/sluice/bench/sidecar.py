"""A pod's Istio sidecar, inbound side, as istiod builds it, with sluice's EnvoyFilter patches applied as Istio
applies them: for real Envoy in the tests and in the real data-plane benchmark (`sluice.bench.envoy`).

What istiod builds for a sidecar's inbound HTTP port, as far as sluice's admission patches reach (istio/istio 1.30):
- the inbound cluster `inbound|<port>||` with one circuit-breaker threshold, DEFAULT priority, every field at
  math.MaxUint32 and `track_remaining` (pilot/pkg/networking/core/cluster_traffic_policy.go
  `getDefaultCircuitBreakerThresholds`, applied to every inbound cluster by `applyConnectionPool`);
- a route configuration named after that cluster, one virtual host `inbound|http|<port>`, one route named
  `default` to the cluster with no timeout (httproute.go `buildSidecarInboundHTTPRouteConfig`,
  route/route.go `BuildDefaultHTTPInboundRoute`);
- the HTTP connection manager's filters ending with the router, into which an HTTP_FILTER patch inserts
  (envoyfilter/listener_patch.go `patchHTTPFilters`).
An EnvoyFilter MERGE is a protobuf merge (pkg/proto/merge/merge.go): maps merge, repeated fields append, and
setting one member of a oneof clears its siblings; `proto_merge` does that for the fields sluice's patches touch.
STATIC to the app on loopback instead of ORIGINAL_DST, so no iptables are needed. Not istiod itself: the match
and the merge are applied here by hand, and each is asserted to reach the port it names.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from sluice.devstack.stack import free_port
from sluice.istio.envoyfilters import UNBOUNDED

HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
FILE_LOG = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"
TARGET_PORT = 8000
PREVIOUS_HOSTS = "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
ISTIO_DEFAULT_RETRY_ON = "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes"
"""The retry policy istiod renders for a route whose VirtualService sets no `retries` (istio/istio
`pilot/pkg/networking/core/route/retry/retry.go`, `DefaultPolicy`, 1.30): 2 retries on these conditions,
retriable status code 503, the previous_hosts predicate with 5 host selections."""


def istio_default_retry_policy() -> dict[str, Any]:
    """`ISTIO_DEFAULT_RETRY_ON`'s whole route retry policy, as Envoy configuration."""
    return {
        "retry_on": ISTIO_DEFAULT_RETRY_ON,
        "num_retries": 2,
        "retriable_status_codes": [503],
        "retry_host_predicate": [
            {"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {"@type": PREVIOUS_HOSTS}}
        ],
        "host_selection_retry_max_attempts": 5,
    }


# oneof groups of the messages the patches reach (envoy.config.route.v3.RouteAction, envoy.config.cluster.v3.Cluster)
ONEOFS = [
    {"cluster", "cluster_header", "weighted_clusters", "cluster_specifier_plugin", "inline_cluster_specifier_plugin"},
    {
        "ring_hash_lb_config",
        "maglev_lb_config",
        "original_dst_lb_config",
        "least_request_lb_config",
        "round_robin_lb_config",
    },
]


def proto_merge(base: Any, patch: Any) -> Any:
    """Istio's MERGE of `patch` into `base`, as far as the fields sluice's patches touch."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            for group in ONEOFS:
                if key in group:
                    for sibling in group - {key}:
                        out.pop(sibling, None)
            out[key] = proto_merge(out[key], value) if key in out else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list):
        return base + copy.deepcopy(patch)
    return copy.deepcopy(patch)


def inbound_cluster_name(port: int = TARGET_PORT) -> str:
    return f"inbound|{port}||"


def istio_inbound(
    app: int, app_address: str = "127.0.0.1", port: int = TARGET_PORT
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The inbound route configuration and cluster of a sidecar for `port`, shaped as istiod builds them (module
    docstring), the cluster's one endpoint the app at `app_address:app`."""
    name = inbound_cluster_name(port)
    route_config = {
        "name": name,
        "virtual_hosts": [
            {
                "name": f"inbound|http|{port}",
                "domains": ["*"],
                "routes": [
                    {
                        "name": "default",
                        "match": {"prefix": "/"},
                        "decorator": {"operation": f"llama.llm.svc.cluster.local:{port}/*"},
                        "route": {
                            "cluster": name,
                            "timeout": "0s",
                            "max_stream_duration": {"max_stream_duration": "0s", "grpc_timeout_header_max": "0s"},
                        },
                    }
                ],
            }
        ],
        "validate_clusters": False,
    }
    endpoint = {"endpoint": {"address": {"socket_address": {"address": app_address, "port_value": app}}}}
    cluster = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "10s",
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": UNBOUNDED,
                    "max_pending_requests": UNBOUNDED,
                    "max_requests": UNBOUNDED,
                    "max_retries": UNBOUNDED,
                    "track_remaining": True,
                }
            ]
        },
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [endpoint]}]},
    }
    return route_config, cluster


def patched(
    route_config: dict[str, Any], cluster: dict[str, Any], patches: list[Any], port: int = TARGET_PORT
) -> tuple[Any, Any]:
    """Istio's MERGE of each SIDECAR_INBOUND CLUSTER or HTTP_ROUTE patch whose match reaches this port
    (envoyfilter/cluster_patch.go `clusterMatch`: portNumber against the inbound cluster name's port; rc_patch.go:
    the route configuration's port from its name, the route by name). HTTP_FILTER patches: `with_http_filters`."""
    for patch in patches:
        if patch["applyTo"] == "HTTP_FILTER":
            continue
        assert patch["match"]["context"] == "SIDECAR_INBOUND"
        assert patch["patch"]["operation"] == "MERGE"
        value = patch["patch"]["value"]
        if patch["applyTo"] == "CLUSTER":
            assert patch["match"]["cluster"] == {"portNumber": port}
            cluster = proto_merge(cluster, value)
        elif patch["applyTo"] == "HTTP_ROUTE":
            match = patch["match"]["routeConfiguration"]
            assert match["portNumber"] == port
            for vhost in route_config["virtual_hosts"]:
                vhost["routes"] = [
                    proto_merge(r, value) if r["name"] == match["vhost"]["route"]["name"] else r
                    for r in vhost["routes"]
                ]
        else:
            raise AssertionError(f"unexpected patch {patch['applyTo']}")
    return route_config, cluster


def with_http_filters(patches: list[Any], port: int = TARGET_PORT) -> list[dict[str, Any]]:
    """The inbound HTTP filter chain after Istio's INSERT_BEFORE of each HTTP_FILTER patch whose match reaches
    this port's chain on virtualInbound (envoyfilter/listener_patch.go `filterChainMatch`: the chain's destination
    port; `patchHTTPFilters`: inserted before the sub-filter named)."""
    filters: list[dict[str, Any]] = [{"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER}}]
    for patch in patches:
        if patch["applyTo"] != "HTTP_FILTER":
            continue
        assert patch["match"]["context"] == "SIDECAR_INBOUND"
        listener = patch["match"]["listener"]
        assert listener["portNumber"] == port
        chain = listener["filterChain"]["filter"]
        assert chain["name"] == "envoy.filters.network.http_connection_manager"
        assert patch["patch"]["operation"] == "INSERT_BEFORE"
        at = next(i for i, f in enumerate(filters) if f["name"] == chain["subFilter"]["name"])
        filters.insert(at, patch["patch"]["value"])
    return filters


def inbound_listener(
    listen: int,
    route_config: dict[str, Any],
    http_filters: list[Any] | None = None,
    access_log: Path | None = None,
    address: str = "127.0.0.1",
) -> dict[str, Any]:
    """virtualInbound's chain for the port: the HTTP connection manager with the route configuration and filters;
    with `access_log`, each answer's status and Envoy's response flags (what Istio's stats filter reads)."""
    manager: dict[str, Any] = {
        "@type": HCM,
        "stat_prefix": "inbound",
        "route_config": route_config,
        "http_filters": http_filters or with_http_filters([]),
    }
    if access_log is not None:
        line = {"text_format_source": {"inline_string": "%RESPONSE_CODE% %RESPONSE_FLAGS%\n"}}
        config = {"@type": FILE_LOG, "path": str(access_log), "log_format": line}
        manager["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": config}]
    return {
        "name": "virtualInbound",
        "address": {"socket_address": {"address": address, "port_value": listen}},
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
        ],
    }


def sidecar_config(
    listen: int,
    route_config: dict[str, Any],
    cluster: dict[str, Any],
    http_filters: list[Any] | None = None,
    access_log: Path | None = None,
) -> dict[str, Any]:
    """A sidecar's bootstrap with its inbound side static (the configuration never changes while it runs)."""
    return {
        "node": {"id": "sidecar", "cluster": "sidecar"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": free_port()}}},
        "static_resources": {
            "listeners": [inbound_listener(listen, route_config, http_filters, access_log)],
            "clusters": [cluster],
        },
    }


def dynamic_sidecar_config(workdir: Path, admin: int) -> dict[str, Any]:
    """A sidecar's bootstrap whose listener and cluster come from `lds.yaml` and `cds.yaml` in `workdir`, watched:
    rewritten (`write_dynamic`) when the EnvoyFilters that reach it change, as istiod pushes LDS and CDS."""

    def source(name: str) -> dict[str, Any]:
        watched = {"path": str(workdir / name), "watched_directory": {"path": str(workdir)}}
        return {"resource_api_version": "V3", "path_config_source": watched}

    return {
        "node": {"id": "sidecar", "cluster": "sidecar"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "dynamic_resources": {"lds_config": source("lds.yaml"), "cds_config": source("cds.yaml")},
    }


def write_dynamic(workdir: Path, listener: dict[str, Any], cluster: dict[str, Any], version: str) -> None:
    """Replace the watched LDS and CDS files atomically (written aside, then renamed in the watched directory):
    the cluster first, so the listener's route never names a cluster Envoy lacks."""
    for name, kind, resource in (
        ("cds.yaml", "type.googleapis.com/envoy.config.cluster.v3.Cluster", cluster),
        ("lds.yaml", "type.googleapis.com/envoy.config.listener.v3.Listener", listener),
    ):
        document = {"version_info": version, "resources": [{"@type": kind, **resource}]}
        aside = workdir / f".{name}.tmp"
        aside.write_text(yaml.safe_dump(document))
        aside.replace(workdir / name)
