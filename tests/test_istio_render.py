"""Istio rendering: every object sluice emits validates against Istio 1.30.3's CRDs (schema and CEL rules)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from sluice.core.reconcile import Plan
from sluice.devstack.stack import SHARED_ISTIO
from sluice.emulator.apivalidation import SchemaRegistry
from sluice.istio.envoyfilters import cluster_name
from sluice.istio.objects import PoolRef, subset_name
from sluice.istio.render import render
from sluice.istio.rendered import Rendered
from tests.helpers import pod, run, sig, spec

POOL = PoolRef("llama", "llm", "0d6c6f1c-7c49-4d7e-9a0e-1f3a1e1b2c3d")
PODS = [pod("v1-a", "a100", "v1"), pod("v1-b", "rtx4090", "v1"), pod("v2-a", "a100", "v2")]
SIGNALS = {"v1-a": sig(ttft=0.04), "v1-b": sig(ttft=0.08), "v2-a": sig(ttft=0.04, rps=2)}
CANARY = {"stableRevision": "v1", "candidateRevision": "v2"}


@pytest.fixture(scope="module")
def istio() -> SchemaRegistry:
    if not SHARED_ISTIO.exists():
        pytest.fail(f"Istio CRDs not found at {SHARED_ISTIO}")
    return SchemaRegistry().load(SHARED_ISTIO)


def by_kind(objects: list[Rendered]) -> dict[str, dict[str, Any]]:
    return {f"{o.kind}/{o.name}": o.body for o in objects}


def plan_for(**wire: Any) -> tuple[Any, Plan]:
    s = spec(**wire)
    return s, run(s, PODS, SIGNALS, 0)


MODES = [
    {"weightsVia": via, "endpointWeights": endpoints}
    for via, endpoints in itertools.product(["VirtualService", "EnvoyFilter"], [True, False])
]
EXTRAS: list[dict[str, Any]] = [
    {},
    {"routing": {"leastRequest": {"choiceCount": 3, "activeRequestBias": 1.5}}},
    {"routing": {"sessionAffinity": {"header": "x-session-id", "hashBalanceFactor": 150}}},
    {"routing": {"gateways": ["mesh", "istio-system/public"]}},
    {"routing": {"retries": {"attempts": 3, "perTryTimeout": "30s", "backoff": "25ms"}}},
    {"canary": CANARY},
    {"canary": CANARY, "protection": {"outlierDetection": {"enabled": False}}},
    {"canary": {**CANARY, "shadow": {"mirrorPercent": 12.5}}},
    {"canary": {**CANARY, "shadow": {}}, "routing": {"retries": {"attempts": 2}}},
]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"{m['weightsVia']}-endpoints{m['endpointWeights']}")
@pytest.mark.parametrize("extra", EXTRAS, ids=range(len(EXTRAS)))
def test_every_rendered_object_validates_against_istio_crds(istio, mode, extra):
    routing = {**mode, **extra.get("routing", {})}
    if "retries" in routing and routing["weightsVia"] != "VirtualService":
        pytest.skip("retries live on sluice's VirtualService only (refused by the API otherwise)")
    wire = {**extra, "routing": routing}
    s, plan = plan_for(**wire)
    objects = render(POOL, s, plan)
    assert objects
    for obj in objects:
        istio.validate(obj.body)
        assert obj.body["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "sluice"
        assert obj.body["metadata"]["ownerReferences"][0]["uid"] == POOL.uid


def test_service_entry_carries_per_pod_weights_and_drops_zeroed_pods(istio):
    s = spec(canary=CANARY)
    bad = {**SIGNALS, "v1-b": sig(errors=0.5)}
    plan = run(s, PODS, bad, 0)
    entry = by_kind(render(POOL, s, plan))["ServiceEntry/sluice-llama"]
    spec_ = entry["spec"]
    assert spec_["resolution"] == "STATIC"
    assert spec_["location"] == "MESH_INTERNAL"
    addresses = {e["address"]: e for e in spec_["endpoints"]}
    assert PODS[1].ip not in addresses
    assert all(e["weight"] >= 1 for e in spec_["endpoints"])
    assert addresses[PODS[0].ip]["labels"]["sluice.dev/revision"] == "v1"
    # the pods carry no sidecar label: `disabled`, as Istio's registry gives such a pod (absent would be `istio`)
    assert addresses[PODS[0].ip]["labels"]["security.istio.io/tlsMode"] == "disabled"


def test_destination_rule_has_a_subset_per_revision_least_request_and_no_locality(istio):
    s, plan = plan_for(canary=CANARY)
    rule = by_kind(render(POOL, s, plan))["DestinationRule/sluice-llama"]["spec"]
    assert rule["host"] == "llama.llm.sluice.internal"
    assert rule["trafficPolicy"]["loadBalancer"] == {"simple": "LEAST_REQUEST", "localityLbSetting": {"enabled": False}}
    assert [x["name"] for x in rule["subsets"]] == ["rev-v1", "rev-v2"]
    assert rule["trafficPolicy"]["outlierDetection"]["consecutive5xxErrors"] == 5


def test_virtual_service_splits_by_the_canary_step(istio):
    s, plan = plan_for(canary=CANARY)
    vs = by_kind(render(POOL, s, plan))["VirtualService/sluice-llama"]["spec"]
    assert vs["hosts"] == ["llama.llm.svc.cluster.local"]
    routes = {r["destination"]["subset"]: r["weight"] for r in vs["http"][0]["route"]}
    assert routes == {"rev-v1": 95, "rev-v2": 5}


def test_envoy_filter_route_patch_uses_istio_cluster_names(istio):
    s, plan = plan_for(canary=CANARY, routing={"weightsVia": "EnvoyFilter", "endpointWeights": False}, servicePort=80)
    objects = by_kind(render(POOL, s, plan))
    assert "VirtualService/sluice-llama" not in objects
    patch = objects["EnvoyFilter/sluice-llama-routes"]["spec"]["configPatches"][0]
    assert patch["applyTo"] == "HTTP_ROUTE"
    assert patch["match"]["routeConfiguration"]["vhost"]["name"] == "llama.llm.svc.cluster.local:80"
    clusters = patch["patch"]["value"]["route"]["weighted_clusters"]["clusters"]
    assert clusters == [
        {"name": "outbound|80|rev-v1|llama.llm.svc.cluster.local", "weight": 95},
        {"name": "outbound|80|rev-v2|llama.llm.svc.cluster.local", "weight": 5},
    ]


def test_no_virtual_service_needed_without_endpoint_weights_or_canary(istio):
    s, plan = plan_for(routing={"endpointWeights": False})
    kinds = {o.kind for o in render(POOL, s, plan)}
    assert kinds == {"DestinationRule"}


def test_cluster_envoy_filter_only_when_tuning_is_asked_for(istio):
    s, plan = plan_for()
    assert not any(o.kind == "EnvoyFilter" for o in render(POOL, s, plan))
    s, plan = plan_for(routing={"leastRequest": {"activeRequestBias": 2.0}})
    lb = by_kind(render(POOL, s, plan))["EnvoyFilter/sluice-llama-lb"]["spec"]["configPatches"][0]
    assert lb["applyTo"] == "CLUSTER"
    assert lb["patch"]["value"]["least_request_lb_config"]["active_request_bias"]["default_value"] == 2.0


def test_session_affinity_uses_consistent_hash_on_the_header(istio):
    s, plan = plan_for(routing={"sessionAffinity": {"header": "x-session-id"}})
    rule = by_kind(render(POOL, s, plan))["DestinationRule/sluice-llama"]["spec"]
    assert rule["trafficPolicy"]["loadBalancer"]["consistentHash"] == {"httpHeaderName": "x-session-id"}


def test_objects_without_pool_uid_have_no_owner_reference():
    s, plan = plan_for()
    for obj in render(PoolRef("llama", "llm"), s, plan):
        assert "ownerReferences" not in obj.body["metadata"]


def test_subset_names_are_dns_labels_and_distinct():
    names = {subset_name(r) for r in ["v1", "V1", "release/2024.1", "a" * 80, "a" * 81]}
    assert len(names) == 5
    for name in names:
        assert len(name) <= 63
        assert name == name.lower()


def test_cluster_name_format():
    assert cluster_name(8000, None, "h") == "outbound|8000||h"
    assert cluster_name(80, "rev-v1", "h") == "outbound|80|rev-v1|h"


def test_retries_render_as_istio_http_retry_before_any_response_byte(istio):
    s, plan = plan_for(routing={"retries": {"attempts": 3, "perTryTimeout": "30s"}})
    vs = by_kind(render(POOL, s, plan))["VirtualService/sluice-llama"]
    istio.validate(vs)
    assert vs["spec"]["http"][0]["retries"] == {
        "attempts": 3,
        "retryOn": "connect-failure,refused-stream,reset,gateway-error",
        "retryRemoteLocalities": True,
        "retryIgnorePreviousHosts": True,
        "perTryTimeout": "30s",
    }
    s, plan = plan_for()
    assert "retries" not in by_kind(render(POOL, s, plan))["VirtualService/sluice-llama"]["spec"]["http"][0]


def test_server_errors_are_retried_through_istios_numeric_retry_on(istio):
    """Istio reads numbers in retryOn as status codes (pilot/pkg/networking/core/route/retry/retry.go
    parseRetryOn: Envoy's retriable_status_codes, with retriable-status-codes added)."""
    retries = {"attempts": 2, "retryOn": ["reset", "5xx"], "statusCodes": [503, 500, 500]}
    s, plan = plan_for(routing={"retries": retries})
    vs = by_kind(render(POOL, s, plan))["VirtualService/sluice-llama"]
    istio.validate(vs)
    assert vs["spec"]["http"][0]["retries"]["retryOn"] == "reset,5xx,500,503"


def test_shadow_renders_an_istio_mirror_to_the_candidate_subset_while_users_stay_on_stable(istio):
    s, plan = plan_for(canary={**CANARY, "shadow": {"mirrorPercent": 12.5}})
    assert plan.status.canary is not None
    assert plan.status.canary.phase == "Shadow"
    vs = by_kind(render(POOL, s, plan))["VirtualService/sluice-llama"]
    istio.validate(vs)
    http = vs["spec"]["http"][0]
    host = "llama.llm.sluice.internal"
    assert http["route"] == [
        {"destination": {"host": host, "port": {"number": 8000}, "subset": "rev-v1"}, "weight": 100}
    ]
    assert http["mirrors"] == [
        {"destination": {"host": host, "port": {"number": 8000}, "subset": "rev-v2"}, "percentage": {"value": 12.5}}
    ]
    assert "mirror" not in http
    assert "mirrorPercentage" not in http


def test_the_istio_schema_check_refuses_a_malformed_mirror(istio):
    """The mirror is really checked: a destination without a host is refused by Istio's schema."""
    s, plan = plan_for(canary={**CANARY, "shadow": {}})
    vs = by_kind(render(POOL, s, plan))["VirtualService/sluice-llama"]
    del vs["spec"]["http"][0]["mirrors"][0]["destination"]["host"]
    with pytest.raises(Exception, match="host"):
        istio.validate(vs)


def test_no_mirror_is_rendered_without_a_shadow_or_without_candidate_pods(istio):
    s, plan = plan_for(canary=CANARY)
    assert "mirrors" not in by_kind(render(POOL, s, plan))["VirtualService/sluice-llama"]["spec"]["http"][0]
    s = spec(canary={**CANARY, "shadow": {}})
    plan = run(s, PODS[:2], SIGNALS, 0)  # no v2 pod
    assert plan.status.canary is not None
    assert plan.status.canary.mirror_percent is None
    assert "mirrors" not in by_kind(render(POOL, s, plan))["VirtualService/sluice-llama"]["spec"]["http"][0]
