"""What sluice renders for the meshes users run, read against Istio 1.30.3's source (tag 1.30.3, 56df41f6).

- tlsMode: pilot/pkg/serviceregistry/kube/conversion.go (a pod's own label, else `disabled`) and
  pilot/pkg/serviceregistry/serviceentry/conversion.go getTLSModeFromWorkloadEntry (a ServiceEntry endpoint with
  a serviceAccount and no label is taken as `istio`);
- Service port protocol: pkg/config/kube/conversion.go ConvertProtocol, pkg/config/protocol/instance.go Parse;
- exportTo: pkg/config/validation/validation.go (`*` alone; `~` only on ServiceEntry), the Service annotation
  `networking.istio.io/exportTo` split on commas (pilot/pkg/serviceregistry/kube/conversion.go);
- EnvoyFilter reach: pilot/pkg/model/push_context.go EnvoyFilters(proxy) — the root namespace's, then the proxy's
  own namespace's; waypoints ignore EnvoyFilters without targetRefs (pilot/pkg/model/policyattachment.go);
- ambient: `istio.io/dataplane-mode`, `istio.io/use-waypoint` on the Service then its Namespace
  (pilot/pkg/serviceregistry/ambient/waypoints.go); a ServiceEntry is bound to a waypoint by the same label;
- Sidecar egress hosts `namespace/dnsName` (pilot/pkg/model/sidecar.go).
Every rendered object is validated against Istio 1.30.3's CRDs.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from sluice.core.mesh import protocol_of
from sluice.core.observed import ObservedMesh, ObservedService, ObservedSidecar, ServicePort
from sluice.core.reconcile import Plan, plan_pass
from sluice.devstack.stack import SHARED_ISTIO
from sluice.emulator.apivalidation import SchemaRegistry
from sluice.istio.objects import PoolRef
from sluice.istio.render import render
from sluice.runtime import handlers
from sluice.runtime.config import OperatorConfig
from sluice.runtime.reconciler import Reconciler
from tests.helpers import at, observed, pod, sig, spec
from tests.test_reconciler import Loop

POOL = PoolRef("llama", "llm", "0d6c6f1c-7c49-4d7e-9a0e-1f3a1e1b2c3d")
SIDECAR = {"security.istio.io/tlsMode": "istio"}
SIGNALS = {"a": sig(ttft=0.04), "b": sig(ttft=0.05)}


def injected(name: str) -> Any:
    """A pod whose sidecar injector labelled it, as Istio's injector does."""
    plain = pod(name)
    return plain.model_copy(update={"labels": {**plain.labels, **SIDECAR}})


@pytest.fixture(scope="module")
def istio() -> SchemaRegistry:
    return SchemaRegistry().load(SHARED_ISTIO)


def service(*ports: ServicePort, labels: dict[str, str] | None = None, **annotations: str) -> ObservedService:
    return ObservedService(
        name="llama",
        ports=list(ports or [ServicePort(port=8000, name="http")]),
        labels=labels or {},
        annotations=annotations,
    )


def mesh(svc: ObservedService | None = None, ns: dict[str, str] | None = None, sidecars: Any = ()) -> ObservedMesh:
    return ObservedMesh(service=svc or service(), namespace_labels=ns or {}, sidecars=list(sidecars))


def planned(m: ObservedMesh | None, pods: list[Any] | None = None, **wire: Any) -> tuple[Any, Plan]:
    s = spec(**wire)
    chosen = pods or [injected("a"), pod("b")]
    when = at(0)
    seen = observed(chosen, SIGNALS, when).model_copy(update={"mesh": m})
    return s, plan_pass(s, 1, seen, None, when, pool=POOL.id)


def objects(m: ObservedMesh | None, istio: SchemaRegistry, **wire: Any) -> dict[str, dict[str, Any]]:
    s, plan = planned(m, **wire)
    rendered = render(POOL, s, plan)
    for obj in rendered:
        istio.validate(obj.body)
    return {f"{o.kind}/{o.namespace}/{o.name}": o.body for o in rendered}


def condition(plan: Plan) -> tuple[str, str, str]:
    found = next(c for c in plan.status.conditions if c.type == "MeshReach")
    return found.status, found.reason, found.message


# ---------------------------------------------------------------------------------------------- endpoints


def test_a_pod_without_a_sidecar_gets_tls_mode_disabled_and_one_with_a_sidecar_keeps_istio(istio):
    entry = objects(mesh(), istio)["ServiceEntry/llm/sluice-llama"]["spec"]
    modes = {e["address"]: e["labels"]["security.istio.io/tlsMode"] for e in entry["endpoints"]}
    a, b = pod("a"), pod("b")
    # b has no sidecar: `istio` would make every sidecar client speak mutual TLS to a pod with nobody to answer
    assert modes == {a.ip: "istio", b.ip: "disabled"}


def test_every_object_is_exported_as_the_service_is_or_everywhere(istio):
    everywhere = objects(mesh(), istio)
    assert {tuple(o["spec"]["exportTo"]) for o in everywhere.values()} == {("*",)}
    narrowed = objects(mesh(service(**{"networking.istio.io/exportTo": "., team-a ,~"})), istio)
    assert {tuple(o["spec"]["exportTo"]) for o in narrowed.values()} == {(".", "team-a")}


def test_client_namespaces_set_export_to_with_the_pool_namespace_once(istio):
    rendered = objects(mesh(), istio, routing={"clientNamespaces": ["team-b", "llm", "team-a"]})
    # '.' and the namespace's own name together are refused by Istio's validation: written once, as '.'
    assert {tuple(o["spec"]["exportTo"]) for o in rendered.values()} == {(".", "team-a", "team-b")}


@pytest.mark.parametrize(
    ("port", "istio_protocol"),
    [
        (ServicePort(port=8000, name="http"), "HTTP"),
        (ServicePort(port=8000, name="http-vllm"), "HTTP"),
        (ServicePort(port=8000, name="HTTP2-api"), "HTTP2"),  # Parse ignores case
        (ServicePort(port=8000, name="grpc-web-x"), "GRPC-Web"),  # before the cut at the first '-'
        (ServicePort(port=8000, name="tcp-vllm", app_protocol="http"), "HTTP"),  # appProtocol wins
        (ServicePort(port=8000, name="http", app_protocol="kubernetes.io/h2c"), "HTTP2"),
        (ServicePort(port=8000, name="http", app_protocol="custom"), ""),  # appProtocol replaces the name
        (ServicePort(port=8000, name="tcp"), "TCP"),
        (ServicePort(port=8000), ""),  # unnamed: detected by sniffing
        (ServicePort(port=3306), "TCP"),  # a well-known port
        (ServicePort(port=8000, name="http", protocol="UDP"), "UDP"),
    ],
)
def test_service_port_protocol_as_istio_reads_it(port, istio_protocol):
    assert protocol_of(port) == istio_protocol


@pytest.mark.parametrize(
    ("port", "protocol", "name"),
    [
        (ServicePort(port=8000, name="grpc"), "GRPC", "grpc"),
        (ServicePort(port=8000, name="http2"), "HTTP2", "http2"),
        (ServicePort(port=8000, name="web", app_protocol="kubernetes.io/h2c"), "HTTP2", "http2"),
        (ServicePort(port=8000), None, "auto"),
    ],
)
def test_the_service_entry_port_speaks_the_services_protocol(istio, port, protocol, name):
    entry = objects(mesh(service(port)), istio)["ServiceEntry/llm/sluice-llama"]["spec"]
    assert entry["ports"][0].get("protocol") == protocol  # absent: Istio detects it, as for the Service
    assert entry["ports"][0]["name"] == name
    assert all(set(e["ports"]) == {name} for e in entry["endpoints"])


def test_a_tcp_port_is_refused_with_the_port_named_and_nothing_rendered():
    s, plan = planned(mesh(service(ServicePort(port=8000, name="tcp-vllm"))))
    assert render(POOL, s, plan) == []
    assert not plan.publish
    status, reason, message = condition(plan)
    assert (status, reason) == ("False", "PortNotHTTP")
    assert "tcp-vllm (8000) is TCP" in message
    ready = next(c for c in plan.status.conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == ("False", "MeshRefused")


def test_a_service_without_the_port_is_refused_naming_its_ports():
    s, plan = planned(mesh(service(ServicePort(port=80, name="http"))))
    assert render(POOL, s, plan) == []
    assert condition(plan)[1] == "PortNotFound"
    assert "its ports: 80" in condition(plan)[2]


# ---------------------------------------------------------------------------------------------- EnvoyFilter reach


def test_envoy_filters_go_to_every_client_namespace_without_an_owner_reference_outside_the_pools(istio):
    rendered = objects(
        mesh(),
        istio,
        routing={"leastRequest": {}, "clientNamespaces": [".", "team-a", "edge"], "gateways": ["mesh", "edge/public"]},
    )
    filters = {key: o for key, o in rendered.items() if key.startswith("EnvoyFilter/")}
    # copies elsewhere are named after the pool's namespace too
    names = {
        "EnvoyFilter/llm/sluice-llama-lb",
        "EnvoyFilter/team-a/sluice-llama.llm-lb",
        "EnvoyFilter/edge/sluice-llama.llm-lb",
    }
    assert set(filters) == names
    assert "ownerReferences" in filters["EnvoyFilter/llm/sluice-llama-lb"]["metadata"]
    # Kubernetes' garbage collector treats a cross-namespace owner as absent: the pool's finalizer releases these
    assert "ownerReferences" not in filters["EnvoyFilter/team-a/sluice-llama.llm-lb"]["metadata"]
    edge = filters["EnvoyFilter/edge/sluice-llama.llm-lb"]
    assert edge["metadata"]["labels"]["sluice.dev/pool-namespace"] == "llm"
    contexts = [p["match"]["context"] for p in edge["spec"]["configPatches"]]
    assert contexts == ["SIDECAR_OUTBOUND", "GATEWAY"]


def test_every_namespace_puts_the_envoy_filters_in_the_root_namespace(istio):
    rendered = objects(mesh(), istio, routing={"weightsVia": "EnvoyFilter", "clientNamespaces": ["*"]})
    assert [k for k in rendered if k.startswith("EnvoyFilter/")] == ["EnvoyFilter/istio-system/sluice-llama.llm-routes"]


def test_without_client_namespaces_the_status_says_the_envoy_filters_reach_the_pools_namespace_only():
    _, plan = planned(mesh(), routing={"leastRequest": {}})
    assert plan.status.mesh is not None
    assert plan.status.mesh.envoy_filter_namespaces == ["llm"]
    status, _reason, message = condition(plan)
    assert status == "True"
    assert "reach proxies in llm only" in message


def test_envoy_filters_no_longer_rendered_for_a_namespace_are_pruned_there_and_on_deletion():
    loop = Loop(routing={"leastRequest": {}, "clientNamespaces": ["team-a", "team-b"]})
    loop.cluster.mesh_view = mesh()

    def filters() -> list[str]:
        return sorted(ns for ns, kind, _ in loop.cluster.objects if kind == "EnvoyFilter")

    loop.run(0)
    assert filters() == ["llm", "team-a", "team-b"]
    assert loop.status is not None
    assert loop.status["mesh"]["envoyFilterNamespaces"] == ["llm", "team-a", "team-b"]
    loop.run(5, routing={"leastRequest": {}, "clientNamespaces": ["team-a"]})
    assert filters() == ["llm", "team-a"]  # team-b's copy pruned: the previous status said where it was
    runtime = handlers.Runtime(config=OperatorConfig())
    runtime.cluster = loop.cluster  # type: ignore[assignment]
    deleted = handlers.pool_deleted(
        name="llama", namespace="llm", memo=SimpleNamespace(runtime=runtime), uid="u1", status=loop.status
    )
    asyncio.run(deleted)
    assert filters() == []  # the ones the garbage collector would have reached, and the ones it cannot


# ---------------------------------------------------------------------------------------------- ambient


def test_ambient_without_a_waypoint_says_ztunnel_ignores_the_routing(istio):
    _, plan = planned(mesh(ns={"istio.io/dataplane-mode": "ambient"}), pods=[pod("a"), pod("b")])
    status, reason, message = condition(plan)
    assert (status, reason) == ("False", "NoWaypoint")
    assert "ztunnel applies no VirtualService" in message
    assert plan.status.mesh is not None
    assert plan.status.mesh.dataplane == "ambient"


def test_ambient_with_a_waypoint_binds_the_service_entry_to_it_and_renders_no_envoy_filter(istio):
    labels = {"istio.io/use-waypoint": "llm-waypoint"}
    m = mesh(service(labels=labels), ns={"istio.io/dataplane-mode": "ambient"})
    rendered = objects(m, istio, routing={"leastRequest": {}})
    entry = rendered["ServiceEntry/llm/sluice-llama"]
    assert entry["metadata"]["labels"]["istio.io/use-waypoint"] == "llm-waypoint"
    assert not [k for k in rendered if k.startswith("EnvoyFilter/")]
    assert "VirtualService/llm/sluice-llama" in rendered
    _, plan = planned(m, routing={"leastRequest": {}})
    assert plan.status.mesh is not None
    assert plan.status.mesh.dataplane == "ambient-waypoint"
    assert any("applies no EnvoyFilter without targetRefs" in f for f in plan.status.mesh.findings)


def test_the_namespace_waypoint_applies_and_none_opts_the_service_out():
    ns = {"istio.io/dataplane-mode": "ambient", "istio.io/use-waypoint": "ns-wp"}
    _, plan = planned(mesh(ns=ns))
    assert plan.mesh.waypoint == "ns-wp"
    _, plan = planned(mesh(service(labels={"istio.io/use-waypoint": "none"}), ns=ns))
    assert plan.mesh.waypoint is None
    assert condition(plan)[1] == "NoWaypoint"


def test_envoy_filter_route_weights_are_refused_behind_a_waypoint():
    m = mesh(service(labels={"istio.io/use-waypoint": "wp"}), ns={"istio.io/dataplane-mode": "ambient"})
    s, plan = planned(m, routing={"weightsVia": "EnvoyFilter"})
    assert render(POOL, s, plan) == []
    assert condition(plan)[1] == "EnvoyFilterOnWaypoint"


# ---------------------------------------------------------------------------------------------- Sidecar egress


def test_a_listed_client_namespaces_sidecar_hiding_the_pool_hosts_is_named():
    hiding = ObservedSidecar(namespace="team-a", name="default", egress_hosts=[["./*", "istio-system/*"]])
    seeing = ObservedSidecar(namespace="team-b", name="default", egress_hosts=[["llm/*"]])
    partial = ObservedSidecar(namespace="team-c", name="default", egress_hosts=[["llm/llama.llm.svc.cluster.local"]])
    clients = {"routing": {"clientNamespaces": ["team-a", "team-b", "team-c"]}}
    _, plan = planned(mesh(sidecars=[hiding, seeing, partial]), **clients)
    status, reason, message = condition(plan)
    assert (status, reason) == ("False", "HiddenBySidecar")
    assert "Sidecar team-a/default hides llama.llm.svc.cluster.local, llama.llm.sluice.internal" in message
    assert "team-b" not in message
    # the Service visible and the ServiceEntry hidden: clients would route to a cluster they do not have
    assert "Sidecar team-c/default hides llama.llm.sluice.internal " in message


def test_without_client_namespaces_only_a_sidecar_showing_the_service_but_hiding_the_entry_is_named():
    """A namespace whose Sidecar hides the Service too is no client (a locked-down mesh is not a finding)."""
    not_a_client = ObservedSidecar(namespace="team-a", name="default", egress_hosts=[["./*"]])
    _, plan = planned(mesh(sidecars=[not_a_client]))
    assert condition(plan)[:2] == ("True", "Reached")
    broken = ObservedSidecar(namespace="team-c", name="default", egress_hosts=[["llm/llama.llm.svc.cluster.local"]])
    _, plan = planned(mesh(sidecars=[not_a_client, broken]))
    status, reason, message = condition(plan)
    assert (status, reason) == ("False", "HiddenBySidecar")
    assert "team-c/default hides llama.llm.sluice.internal " in message
    assert "team-a" not in message


def test_a_sidecar_outside_the_client_namespaces_is_not_judged():
    hiding = ObservedSidecar(namespace="team-z", name="default", egress_hosts=[["./*"]])
    _, plan = planned(mesh(sidecars=[hiding]), routing={"clientNamespaces": ["team-a"]})
    assert condition(plan)[:2] == ("True", "Reached")


def test_without_the_mesh_side_nothing_is_judged_and_the_port_is_taken_as_http(istio):
    _, plan = planned(None)
    assert condition(plan)[:2] == ("Unknown", "NotObserved")
    assert plan.mesh.protocol == "HTTP"


def test_a_choice_count_envoy_never_reads_with_endpoint_weights_is_said_in_spec_valid():
    """Envoy's least-request (source/extensions/load_balancing_policies/least_request, 1.38 to 1.40): unequal host
    weights build an EDF schedule and `choice_count` is read only by the unweighted N-choices pick."""
    _, plan = planned(mesh(), routing={"leastRequest": {"choiceCount": 4}})
    valid = next(c for c in plan.status.conditions if c.type == "SpecValid")
    assert (valid.status, valid.reason) == ("True", "SettingWithoutEffect")
    assert "choiceCount 4 has no effect" in valid.message
    _, plan = planned(mesh(), routing={"leastRequest": {"choiceCount": 4}, "endpointWeights": False})
    assert "choiceCount" not in next(c for c in plan.status.conditions if c.type == "SpecValid").message


def test_unusable_exportto_annotation_entries_are_left_out_and_named(istio):
    svc = service(**{"networking.istio.io/exportTo": "team-a, Team_B, a/b,"})
    rendered = objects(mesh(svc), istio)
    assert {tuple(o["spec"]["exportTo"]) for o in rendered.values()} == {(".", "team-a")}
    _, plan = planned(mesh(svc))
    assert plan.status.mesh is not None
    assert any("'Team_B', 'a/b'" in finding for finding in plan.status.mesh.findings)
    _, plan = planned(mesh(service(**{"networking.istio.io/exportTo": "~"})))  # hidden: the pool's own namespace
    assert plan.mesh.export_to == (".",)


def test_a_waypoint_in_another_namespace_is_exported_to():
    labels = {"istio.io/use-waypoint": "wp", "istio.io/use-waypoint-namespace": "gateways"}
    m = mesh(service(labels=labels, **{"networking.istio.io/exportTo": "."}), ns={"istio.io/dataplane-mode": "ambient"})
    _, plan = planned(m)
    assert plan.mesh.export_to == (".", "gateways")
    assert plan.status.mesh is not None
    assert plan.status.mesh.waypoint == "gateways/wp"


def test_a_service_without_the_port_reports_no_protocol():
    _, plan = planned(mesh(service(ServicePort(port=80, name="http"))))
    assert plan.status.mesh is not None
    assert plan.status.mesh.protocol is None


def test_gateways_with_dotted_names_are_accepted():
    s = spec(routing={"gateways": ["mesh", "istio-system/public.gw", "local.gw"]})
    assert s.routing.gateways == ["mesh", "istio-system/public.gw", "local.gw"]


# ---------------------------------------------------------------------------------------------- transitions


def _filters(loop: Loop) -> list[tuple[str, str]]:
    return sorted((ns, name) for ns, kind, name in loop.cluster.objects if kind == "EnvoyFilter")


def _delete(loop: Loop) -> None:
    runtime = handlers.Runtime(config=OperatorConfig())
    runtime.cluster = loop.cluster  # type: ignore[assignment]
    memo = SimpleNamespace(runtime=runtime)
    asyncio.run(handlers.pool_deleted(name="llama", namespace="llm", memo=memo, uid="u1", status=loop.status))


def test_copies_are_found_after_a_refused_pass_when_narrowed_and_when_the_pool_is_deleted():
    wide = {"leastRequest": {}, "clientNamespaces": ["team-a", "team-b"]}
    loop = Loop(routing=wide)
    loop.cluster.mesh_view = mesh()
    loop.run(0)
    assert [ns for ns, _ in _filters(loop)] == ["llm", "team-a", "team-b"]
    loop.cluster.mesh_view = mesh(service(ServicePort(port=8000, name="tcp")))
    loop.run(5)  # refused: nothing written, the copies stay where they are, and the status still says where
    assert loop.status is not None
    assert loop.status["mesh"]["envoyFilterNamespaces"] == ["llm", "team-a", "team-b"]
    loop.cluster.mesh_view = mesh()
    loop.run(10, routing={"leastRequest": {}, "clientNamespaces": ["team-a"]})
    assert [ns for ns, _ in _filters(loop)] == ["llm", "team-a"]
    loop.cluster.mesh_view = mesh(service(ServicePort(port=8000, name="tcp")))
    loop.run(15)
    _delete(loop)
    assert _filters(loop) == []


def test_copies_are_found_by_their_labels_even_where_no_status_says():
    loop = Loop(routing={"leastRequest": {}, "clientNamespaces": ["team-a", "team-b"]})
    loop.cluster.mesh_view = mesh()
    loop.run(0)
    # a restarted operator and a status lost (or written by another version): the labels still name the pool
    loop.reconciler = Reconciler(loop.cluster, loop.prom)
    loop.status = None
    loop.run(5, routing={"leastRequest": {}})
    assert _filters(loop) == [("llm", "sluice-llama-lb")]


def test_pools_of_one_name_in_two_namespaces_writing_into_a_third_stay_apart():
    s = spec(routing={"leastRequest": {}, "clientNamespaces": ["team-a"]})
    names = set()
    for namespace in ("llm", "other"):
        pool = PoolRef("llama", namespace, f"uid-{namespace}")
        when = at(0)
        seen = observed([injected("a")], SIGNALS, when).model_copy(update={"mesh": mesh()})
        plan = plan_pass(s, 1, seen, None, when, pool=pool.id)
        names |= {(o.namespace, o.name) for o in render(pool, s, plan) if o.kind == "EnvoyFilter"}
    assert ("team-a", "sluice-llama.llm-lb") in names
    assert ("team-a", "sluice-llama.other-lb") in names
