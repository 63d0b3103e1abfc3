"""Which proxies the pool's Istio objects reach, decided from its Service, its namespace and client Sidecars. Pure.

Each rule follows Istio 1.30's own reading of the same objects (the upstream files are named where the rule is):
- the Service port's protocol, from `appProtocol` or the port name's prefix (`protocol_of`);
- what sees sluice's objects: `exportTo` (`export_to`), and for EnvoyFilters, which carry no exportTo, the
  namespace they are written in (`envoy_filter_namespaces`): an EnvoyFilter reaches the proxies of its own
  namespace, and one in the root namespace reaches every proxy of the mesh;
- ambient: the namespace's `istio.io/dataplane-mode` and the Service's (else the namespace's) `istio.io/use-waypoint`:
  ztunnel applies none of VirtualService, DestinationRule or EnvoyFilter; a waypoint applies the VirtualService and
  the ServiceEntry bound to it, and no EnvoyFilter without `targetRefs`;
- a client namespace's `Sidecar` whose egress hosts do not include the pool's hosts hides them from its proxies
  (`sluice.core.sidecars`).
The outcome goes into `status.mesh` and the `MeshReach` condition, and `sluice.istio.render` renders from it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Literal

from sluice.api.v1alpha1 import CLIENT_NAMESPACE, InferencePoolSpec, MeshStatus
from sluice.core.observed import ObservedMesh, ObservedService, ServicePort
from sluice.core.sidecars import sidecar_findings
from sluice.core.status import Want

EXPORT_TO_ANNOTATION = "networking.istio.io/exportTo"
DATAPLANE_MODE_LABEL = "istio.io/dataplane-mode"
USE_WAYPOINT_LABEL = "istio.io/use-waypoint"
USE_WAYPOINT_NAMESPACE_LABEL = "istio.io/use-waypoint-namespace"
TLS_MODE_LABEL = "security.istio.io/tlsMode"

IstioProtocol = Literal[
    "HTTP", "HTTP2", "HTTP_PROXY", "GRPC", "GRPC-Web", "HTTPS", "TLS", "TCP", "UDP", "Mongo", "Redis", "MySQL", ""
]
"""Istio's protocol.Instance values (pkg/config/protocol/instance.go); "" is Unsupported: detected by sniffing."""
_BY_NAME: dict[str, IstioProtocol] = {
    "http": "HTTP",
    "http2": "HTTP2",
    "http_proxy": "HTTP_PROXY",
    "grpc": "GRPC",
    "grpc-web": "GRPC-Web",
    "https": "HTTPS",
    "tls": "TLS",
    "tcp": "TCP",
    "udp": "UDP",
    "mongo": "Mongo",
    "redis": "Redis",
    "mysql": "MySQL",
}
_HTTP: frozenset[str] = frozenset({"HTTP", "HTTP2", "HTTP_PROXY", "GRPC", "GRPC-Web"})
"""protocol.Instance.IsHTTP(): the ports whose traffic goes through HTTP routes (VirtualService `http`)."""
WELL_KNOWN_TCP_PORTS = frozenset({25, 53, 3306, 27017})
"""Ports Istio takes as TCP when the name says nothing (pkg/config/kube/conversion.go wellKnownPorts)."""

ENDPOINT_PORT_NAME: dict[str, str] = {
    "HTTP": "http",
    "HTTP2": "http2",
    "GRPC": "grpc",
    "GRPC-Web": "grpc-web",
    "": "auto",
}


@dataclass(frozen=True)
class PoolId:
    """The pool's name and namespace: its hosts derive from them."""

    name: str
    namespace: str


def service_host(pool: PoolId, spec: InferencePoolSpec) -> str:
    """The Kubernetes Service's host, as istiod names it: `<service>.<namespace>.svc.<clusterDomain>`."""
    return f"{spec.service}.{pool.namespace}.svc.{spec.routing.cluster_domain}"


def endpoints_host(pool: PoolId) -> str:
    """The ServiceEntry's host: internal to the mesh, reached only through sluice's routing."""
    return f"{pool.name}.{pool.namespace}.sluice.internal"


def protocol_of(port: ServicePort) -> IstioProtocol:
    """Istio's protocol for a Service port (pkg/config/kube/conversion.go ConvertProtocol): UDP by L4, then
    `appProtocol` (with Kubernetes' `kubernetes.io/h2c`, `/ws`, `/wss`) over the name; `grpc-web` before the prefix
    cut at the first '-'; an unknown name is sniffed (""), except on well-known TCP ports."""
    if port.protocol.upper() == "UDP":
        return "UDP"
    name = port.name or ""
    if port.app_protocol is not None:
        name = port.app_protocol
        standard: dict[str, IstioProtocol] = {
            "kubernetes.io/h2c": "HTTP2",
            "kubernetes.io/ws": "HTTP",
            "kubernetes.io/wss": "HTTPS",
        }
        if name in standard:
            return standard[name]
    lowered = name.lower()
    if lowered.startswith("grpc-web"):
        return "GRPC-Web"
    found = _BY_NAME.get(lowered.partition("-")[0], "")
    if found == "" and port.port in WELL_KNOWN_TCP_PORTS:
        return "TCP"
    return found


@dataclass(frozen=True)
class MeshPlan:
    """What the pass renders for the mesh, and why: the status' `mesh` and the `MeshReach` condition."""

    dataplane: Literal["sidecar", "ambient", "ambient-waypoint", "unknown"] = "unknown"
    waypoint: str | None = None
    waypoint_namespace: str | None = None
    protocol: IstioProtocol | None = "HTTP"
    """The ServiceEntry port's protocol: the Service port's, so clients speak to the pods as they would without
    sluice ("" leaves it to Istio's detection, as for the Service; None: no port found, nothing rendered)."""
    service_port: str | None = None
    export_to: tuple[str, ...] = ("*",)
    envoy_filter_namespaces: tuple[str, ...] = ()
    envoy_filter_kinds: tuple[str, ...] = ()
    """"routes" and/or "lb": the EnvoyFilters rendered (in each of `envoy_filter_namespaces`)."""
    findings: tuple[str, ...] = ()
    refusal: str | None = None
    """Why nothing is rendered for the pool (its routing would reach no client as written)."""
    reason: str = "NotObserved"
    reached: Literal["True", "False", "Unknown"] = "Unknown"

    def status(self) -> MeshStatus:
        return MeshStatus.model_validate(
            {
                "dataplane": self.dataplane,
                "waypoint": self.waypoint
                if self.waypoint_namespace is None
                else f"{self.waypoint_namespace}/{self.waypoint}",
                "service_port": self.service_port,
                "protocol": None if self.protocol is None else (self.protocol or "(detected)"),
                "export_to": list(self.export_to),
                "envoy_filter_namespaces": list(self.envoy_filter_namespaces),
                "findings": list(self.findings),
            }
        )

    def condition(self) -> Want:
        if self.refusal is not None:
            return Want("MeshReach", "False", self.reason, self.refusal)
        message = "; ".join(self.findings) if self.findings else self._summary()
        return Want("MeshReach", self.reached, self.reason, message[:1000])

    def _summary(self) -> str:
        seen = "every namespace" if "*" in self.export_to else "namespaces " + ", ".join(self.export_to)
        text = f"sluice's objects are exported to {seen}"
        if self.envoy_filter_namespaces:
            text += f"; its EnvoyFilters reach the proxies of {', '.join(self.envoy_filter_namespaces)}"
        return text


def wanted_envoy_filters(spec: InferencePoolSpec, split: bool) -> tuple[str, ...]:
    """The EnvoyFilters the spec asks for: the route patch (weightsVia EnvoyFilter, when a route is needed) and
    the cluster patch (least-request tuning, or bounded-load hashing)."""
    routing = spec.routing
    kinds = []
    if routing.weights_via == "EnvoyFilter" and needs_route(spec, split):
        kinds.append("routes")
    affinity = routing.session_affinity
    if routing.least_request is not None or (affinity is not None and affinity.hash_balance_factor is not None):
        kinds.append("lb")
    return tuple(kinds)


def needs_route(spec: InferencePoolSpec, split: bool) -> bool:
    """A route is needed to reach the ServiceEntry host, or to split between revisions."""
    return spec.routing.endpoint_weights or split


def export_to(
    spec: InferencePoolSpec, namespace: str, service: ObservedService | None
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """exportTo for every object sluice writes, and the Service annotation's entries it could not use.

    The pool's client namespaces, or as the Service is exported — never narrower than the Service's own: a hidden
    VirtualService lets clients bypass sluice, a hidden ServiceEntry leaves them routing to a cluster they do not
    have. Without the annotation the Service's export is the mesh's default (`defaultServiceExportTo`, '*' unless
    set), which sluice cannot read: '*'. Written as Istio's validation wants it (pkg/config/validation/
    validation.go): '*' alone, or '.' and other namespaces once each; an annotation entry that is none of '.',
    '*', '~' or a namespace name would make Istio refuse every object, so it is left out (and named)."""
    names = spec.routing.client_namespaces
    dropped: list[str] = []
    if names is None:
        raw = service.annotations.get(EXPORT_TO_ANNOTATION) if service is not None else None
        entries = [entry.strip() for entry in (raw or "*").split(",")]
        names = [entry for entry in entries if re.fullmatch(CLIENT_NAMESPACE, entry)]
        dropped = [entry for entry in entries if entry not in names and entry not in ("~", "")]
        names = names or ["."]  # hidden ('~') or nothing usable: the pool's own namespace
    if "*" in names:
        return ("*",), tuple(dropped)
    return (".", *sorted({name for name in names if name not in (".", namespace)})), tuple(dropped)


def envoy_filter_namespaces(spec: InferencePoolSpec, namespace: str) -> tuple[str, ...]:
    """Where the EnvoyFilters are written: each client namespace (the pool's always), or the root namespace."""
    names = spec.routing.client_namespaces
    if names is None:
        return (namespace,)
    if "*" in names:
        return (spec.routing.root_namespace,)
    return tuple(sorted({namespace, *(name for name in names if name != ".")}))


def _service_port(spec: InferencePoolSpec, service: ObservedService) -> ServicePort | None:
    wanted = spec.service_port or spec.target_port
    return next((port for port in service.ports if port.port == wanted), None)


def _waypoint(service: ObservedService, namespace_labels: dict[str, str]) -> tuple[str | None, str | None]:
    """The waypoint the Service uses: its own `istio.io/use-waypoint` label, else its namespace's ('none' opts
    out); the waypoint's namespace from `istio.io/use-waypoint-namespace` beside it."""
    for labels in (service.labels, namespace_labels):
        if USE_WAYPOINT_LABEL in labels:
            name = labels[USE_WAYPOINT_LABEL]
            if name in ("", "none"):
                return None, None
            return name, labels.get(USE_WAYPOINT_NAMESPACE_LABEL)
    return None, None


def assess(spec: InferencePoolSpec, pool: PoolId | None, mesh: ObservedMesh | None, split: bool) -> MeshPlan:
    """The mesh plan of one pass: what to render and which proxies it reaches, or why nothing is rendered.

    Without the pool's identity (a plan computed for its weights alone) or the mesh side, nothing is judged: the
    port is taken as HTTP and sidecar mode assumed, as sluice rendered before it read the mesh."""
    namespace = pool.namespace if pool is not None else ""
    kinds = wanted_envoy_filters(spec, split)
    filter_namespaces = envoy_filter_namespaces(spec, namespace) if kinds else ()
    if pool is None or mesh is None or mesh.failed is not None:
        return _not_judged(spec, namespace, mesh, kinds, filter_namespaces)
    service = mesh.service
    exported, dropped = export_to(spec, namespace, service)
    if service is None:
        return MeshPlan(
            dataplane="unknown",
            export_to=exported,
            envoy_filter_namespaces=filter_namespaces,
            envoy_filter_kinds=kinds,
            findings=(f"Service {namespace}/{spec.service} does not exist: clients have nothing to call",),
            reason="ServiceNotFound",
            reached="False",
        )
    port = _service_port(spec, service)
    if port is None:
        return _port_not_found(spec, namespace, service, exported)
    protocol = protocol_of(port)
    shown = f"{port.name or port.port}/{protocol or 'detected'}"
    if protocol not in _HTTP and protocol != "":
        return _port_not_http(port, protocol, shown, exported)
    hosts = [service_host(pool, spec)] + ([endpoints_host(pool)] if spec.routing.endpoint_weights else [])
    hidden = sidecar_findings(spec, namespace, mesh.sidecars, hosts)
    plan = MeshPlan(
        dataplane="sidecar",
        protocol=protocol,
        service_port=shown,
        export_to=exported,
        envoy_filter_namespaces=filter_namespaces,
        envoy_filter_kinds=kinds,
        findings=(*_dropped_export(dropped), *hidden),
        reason="HiddenBySidecar" if hidden else "Reached",
        reached="False" if hidden else "True",
    )
    if mesh.namespace_labels.get(DATAPLANE_MODE_LABEL) == "ambient":
        plan = _ambient(plan, spec, namespace, *_waypoint(service, mesh.namespace_labels))
    if plan.refusal is not None:
        return plan
    return replace(plan, findings=(*plan.findings, *_closing_notes(spec, namespace, plan, port)))


def _not_judged(
    spec: InferencePoolSpec,
    namespace: str,
    mesh: ObservedMesh | None,
    kinds: tuple[str, ...],
    filter_namespaces: tuple[str, ...],
) -> MeshPlan:
    """No pool identity or no mesh read: the port taken as HTTP, sidecar mode assumed."""
    exported, _ = export_to(spec, namespace, None)
    failed = mesh.failed if mesh is not None else None
    if failed is not None:
        why = f"reading the mesh failed: {failed}"
    else:
        why = "the pool's Service and namespace were not read"
    return MeshPlan(
        export_to=exported,
        envoy_filter_namespaces=filter_namespaces,
        envoy_filter_kinds=kinds,
        findings=(f"{why}: the port is taken as HTTP, sidecar mode assumed",),
        reason="ReadFailed" if failed is not None else "NotObserved",
    )


def _dropped_export(dropped: tuple[str, ...]) -> tuple[str, ...]:
    """The finding on the Service's exportTo entries sluice left out, if any."""
    if not dropped:
        return ()
    return (
        f"Service annotation {EXPORT_TO_ANNOTATION} entries {', '.join(repr(d) for d in dropped)} are no "
        "namespace name, '.', '*' or '~': left out of sluice's exportTo (Istio would refuse them)",
    )


def _port_not_found(
    spec: InferencePoolSpec, namespace: str, service: ObservedService, exported: tuple[str, ...]
) -> MeshPlan:
    wanted = spec.service_port or spec.target_port
    listed = ", ".join(str(p.port) for p in service.ports) or "none"
    return MeshPlan(
        protocol=None,
        export_to=exported,
        refusal=f"Service {namespace}/{spec.service} has no port {wanted} (its ports: {listed}): set "
        "spec.servicePort to the port clients call",
        reason="PortNotFound",
        reached="False",
    )


def _port_not_http(port: ServicePort, protocol: IstioProtocol, shown: str, exported: tuple[str, ...]) -> MeshPlan:
    return MeshPlan(
        service_port=shown,
        protocol=protocol,
        export_to=exported,
        refusal=f"Service port {port.name or port.port} ({port.port}) is {protocol} to Istio "
        f"({'appProtocol' if port.app_protocol else 'port name'}): sluice's splits and per-pod weights are HTTP "
        "routes, which Istio applies to HTTP ports only; name the port http-* (or grpc-*, http2-*) or set "
        "appProtocol: http",
        reason="PortNotHTTP",
        reached="False",
    )


def _ambient(
    plan: MeshPlan, spec: InferencePoolSpec, namespace: str, waypoint: str | None, waypoint_ns: str | None
) -> MeshPlan:
    """An ambient namespace: without a waypoint ztunnel applies none of sluice's objects; with one, the waypoint
    must see them, and applies no EnvoyFilter without targetRefs (a route patch is refused, the -lb one dropped)."""
    if waypoint is None:
        no_waypoint = (
            f"namespace {namespace} is ambient and Service {spec.service} uses no waypoint: ztunnel applies no "
            "VirtualService, DestinationRule or EnvoyFilter, so ambient clients are balanced by ztunnel, not by "
            f"sluice's weights (sidecar and gateway clients still follow them); label the Service "
            f"{USE_WAYPOINT_LABEL}=<waypoint>"
        )
        return replace(
            plan, dataplane="ambient", findings=(no_waypoint, *plan.findings), reason="NoWaypoint", reached="False"
        )
    exported = plan.export_to
    if waypoint_ns is not None and waypoint_ns != namespace and exported != ("*",) and waypoint_ns not in exported:
        exported = (*exported, waypoint_ns)  # the waypoint's proxies must see what it routes with
    if "routes" in plan.envoy_filter_kinds:
        return MeshPlan(
            dataplane="ambient-waypoint",
            waypoint=waypoint,
            waypoint_namespace=waypoint_ns,
            service_port=plan.service_port,
            protocol=plan.protocol,
            export_to=exported,
            refusal=f"Service {spec.service} uses waypoint {waypoint}, which applies no EnvoyFilter without "
            "targetRefs: routing.weightsVia EnvoyFilter cannot reach it; use weightsVia VirtualService",
            reason="EnvoyFilterOnWaypoint",
            reached="False",
        )
    findings = plan.findings
    if plan.envoy_filter_kinds:
        findings = (
            *findings,
            f"the -lb EnvoyFilter is not rendered: waypoint {waypoint} applies no EnvoyFilter without targetRefs",
        )
    return replace(
        plan,
        dataplane="ambient-waypoint",
        waypoint=waypoint,
        waypoint_namespace=waypoint_ns,
        export_to=exported,
        envoy_filter_namespaces=(),
        envoy_filter_kinds=(),
        findings=findings,
    )


def _closing_notes(spec: InferencePoolSpec, namespace: str, plan: MeshPlan, port: ServicePort) -> tuple[str, ...]:
    """What the plan still has to say: EnvoyFilters that reach only the pool's namespace, a sniffed port."""
    notes = []
    if plan.envoy_filter_kinds and spec.routing.client_namespaces is None and plan.export_to != (".",):
        notes.append(
            f"the EnvoyFilters reach proxies in {namespace} only (routing.clientNamespaces unset): clients in other "
            "namespaces get neither the least-request tuning nor the EnvoyFilter route weights"
        )
    if plan.protocol == "":
        notes.append(f"port {port.port} has no protocol in its name or appProtocol: Istio detects HTTP by sniffing")
    return tuple(notes)
