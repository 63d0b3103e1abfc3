"""The admission limit sluice renders (`admission.mode: Enforce`) bounds a pod's requests on real Envoy.

What istiod builds for a sidecar's inbound HTTP port, as far as the limit is concerned (istio/istio, 1.30):
- the inbound cluster `inbound|<port>||` with one circuit-breaker threshold, DEFAULT priority, every field at
  math.MaxUint32 and `track_remaining` (pilot/pkg/networking/core/cluster_traffic_policy.go
  `getDefaultCircuitBreakerThresholds`, applied to every inbound cluster by `applyConnectionPool`);
- a route configuration named after that cluster, one virtual host `inbound|http|<port>`, one route named
  `default` to the cluster with no timeout (httproute.go `buildSidecarInboundHTTPRouteConfig`,
  route/route.go `BuildDefaultHTTPInboundRoute`).
An EnvoyFilter MERGE is a protobuf merge that appends repeated fields (pkg/proto/merge/merge.go; Istio 1.31 adds
MERGE_AND_REPLACE_LIST, envoyfilter/util.go), and Envoy takes the first threshold of a priority
(source/common/upstream/upstream_impl.cc, `ResourceManagers::load`). These tests build that sidecar, apply the
patches the way Istio's MERGE does (`proto_merge`), and send it more requests at once than the limit, against a
pod that holds each request long enough for all of them to be in flight together.
"""

from __future__ import annotations

import hashlib
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from sluice.core.inbound import NO_CLASS, NO_SIDECAR, NOT_MEASURED
from sluice.core.mesh import TLS_MODE_LABEL
from sluice.core.observed import ObservedPod, PodSignals
from sluice.devstack.stack import SHARED_ISTIO, free_port
from sluice.emulator.apivalidation import SchemaRegistry
from sluice.istio.envoyfilters import UNBOUNDED, inbound_patches
from sluice.istio.objects import PoolRef
from sluice.istio.render import render
from tests.helpers import pod, run, sig, spec
from tests.test_envoy_patches import ENVOYS, proto_merge
from tests.test_envoy_refusals import HCM, ROUTER, envoy, pod_server

HOLD = 1.5
"""Seconds the pod holds each request: every request of a burst is in flight while the first ones are."""
BURST = 6
LIMIT = 2
TARGET_PORT = 8000
POOL = PoolRef("llama", "llm", "0d6c6f1c-7c49-4d7e-9a0e-1f3a1e1b2c3d")


@contextmanager
def slow_pod() -> Iterator[int]:
    with pod_server(HOLD) as port:
        yield port


CLUSTER = f"inbound|{TARGET_PORT}||"


def istio_inbound(listen: int, app: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The inbound route configuration and cluster of a sidecar, shaped as istiod builds them (module docstring);
    STATIC to the loopback app instead of ORIGINAL_DST, so no iptables are needed."""
    route_config = {
        "name": CLUSTER,
        "virtual_hosts": [
            {
                "name": f"inbound|http|{TARGET_PORT}",
                "domains": ["*"],
                "routes": [
                    {
                        "name": "default",
                        "match": {"prefix": "/"},
                        "decorator": {"operation": f"llama.llm.svc.cluster.local:{TARGET_PORT}/*"},
                        "route": {
                            "cluster": CLUSTER,
                            "timeout": "0s",
                            "max_stream_duration": {"max_stream_duration": "0s", "grpc_timeout_header_max": "0s"},
                        },
                    }
                ],
            }
        ],
        "validate_clusters": False,
    }
    cluster = {
        "name": CLUSTER,
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
        "load_assignment": {
            "cluster_name": CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": app}}}}
                    ]
                }
            ],
        },
    }
    return route_config, cluster


def patched(route_config: dict[str, Any], cluster: dict[str, Any], patches: list[Any]) -> tuple[Any, Any]:
    """Istio's MERGE of each SIDECAR_INBOUND patch whose match reaches this port (envoyfilter/cluster_patch.go
    `clusterMatch`: portNumber against the inbound cluster name's port; rc_patch.go: the route configuration's
    port from its name, the route by name)."""
    for patch in patches:
        assert patch["match"]["context"] == "SIDECAR_INBOUND"
        assert patch["patch"]["operation"] == "MERGE"
        value = patch["patch"]["value"]
        if patch["applyTo"] == "CLUSTER":
            assert patch["match"]["cluster"] == {"portNumber": TARGET_PORT}
            cluster = proto_merge(cluster, value)
        elif patch["applyTo"] == "HTTP_ROUTE":
            match = patch["match"]["routeConfiguration"]
            assert match["portNumber"] == TARGET_PORT
            for vhost in route_config["virtual_hosts"]:
                vhost["routes"] = [
                    proto_merge(r, value) if r["name"] == match["vhost"]["route"]["name"] else r
                    for r in vhost["routes"]
                ]
        else:
            raise AssertionError(f"unexpected patch {patch['applyTo']}")
    return route_config, cluster


def sidecar_config(listen: int, route_config: dict[str, Any], cluster: dict[str, Any]) -> dict[str, Any]:
    manager = {
        "@type": HCM,
        "stat_prefix": "inbound",
        "route_config": route_config,
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER}}],
    }
    return {
        "node": {"id": "sidecar", "cluster": "sidecar"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": free_port()}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "virtualInbound",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                    "filter_chains": [
                        {
                            "filters": [
                                {"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}
                            ]
                        }
                    ],
                }
            ],
            "clusters": [cluster],
        },
    }


def burst(port: int) -> Counter[tuple[int, bool]]:
    """(status, x-envoy-overloaded) of BURST requests sent at once."""

    def one(_: int) -> tuple[int, bool]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as answer:
                return answer.status, bool(answer.headers.get("x-envoy-overloaded"))
        except urllib.error.HTTPError as refused:
            return refused.code, bool(refused.headers.get("x-envoy-overloaded"))

    with ThreadPoolExecutor(BURST) as pool:
        return Counter(pool.map(one, range(BURST)))


def scene(binary: Path, workdir: Path, patches: list[Any]) -> Counter[tuple[int, bool]]:
    with slow_pod() as app:
        listen = free_port()
        route_config, cluster = patched(*istio_inbound(listen, app), patches)
        with envoy(binary, sidecar_config(listen, route_config, cluster), workdir, "sidecar"):
            return burst(listen)


@pytest.fixture(params=sorted(ENVOYS))
def binary(request: pytest.FixtureRequest) -> Path:
    path: Path = ENVOYS[request.param]  # both installed by `make test` (`make envoy-istio`)
    return path


def test_sluices_inbound_patches_bound_the_requests_a_pod_runs_at_once(binary: Path, tmp_path: Path) -> None:
    seen = scene(binary, tmp_path, inbound_patches(spec(), LIMIT))
    # LIMIT in flight; the rest refused at once, marked overloaded (the callers' retries send them elsewhere).
    assert seen == Counter({(200, False): LIMIT, (503, True): BURST - LIMIT})


def test_a_default_priority_threshold_merged_in_is_never_read(binary: Path, tmp_path: Path) -> None:
    # The patch one would write first: Istio appends it after its own unbounded DEFAULT threshold, and Envoy reads
    # that one. Nothing is refused — which is why sluice's limit is the only HIGH threshold, and the route HIGH.
    naive = [
        {
            "applyTo": "CLUSTER",
            "match": {"context": "SIDECAR_INBOUND", "cluster": {"portNumber": TARGET_PORT}},
            "patch": {"operation": "MERGE", "value": {"circuit_breakers": {"thresholds": [{"max_requests": LIMIT}]}}},
        }
    ]
    assert scene(binary, tmp_path, naive) == Counter({(200, False): BURST})


def _saturated(batch: float) -> PodSignals:
    """Signals whose batch reading is `batch`: half of it running in half the KV cache."""
    return sig(kv=0.5).model_copy(update={"running_requests": batch / 2})


def _unlabelled(p: ObservedPod) -> ObservedPod:
    return p.model_copy(update={"labels": {k: v for k, v in p.labels.items() if k != "sluice.dev/hardware-class"}})


def _with_sidecar(p: ObservedPod, sidecar: bool = True) -> ObservedPod:
    return p.model_copy(update={"labels": {**p.labels, TLS_MODE_LABEL: "istio"}}) if sidecar else p


def test_enforce_renders_one_valid_envoy_filter_per_class_and_names_the_pods_left_without_a_limit() -> None:
    istio = SchemaRegistry().load(SHARED_ISTIO)
    s = spec(admission={"mode": "Enforce", "batchShare": 0.75})
    pods = [
        _with_sidecar(pod("a1")),
        _with_sidecar(pod("a2")),
        _with_sidecar(pod("l1", hw="L40S_pcie")),
        _with_sidecar(pod("r1", hw="rtx4090")),  # not read yet, nor any pod of its class
        _with_sidecar(_unlabelled(pod("x"))),  # no class label
        _with_sidecar(pod("a3"), sidecar=False),  # its class has a limit, but no sidecar to hold it
        _with_sidecar(pod("e", hw="")),  # a class label with an empty value: no class to select it by
    ]
    signals = {
        "a1": _saturated(40),
        "a2": _saturated(48),
        "l1": _saturated(20),
        "r1": sig(kv=0.1),  # too little of its cache used to read
        "x": _saturated(16),
        "a3": _saturated(44),
        "e": _saturated(20),
    }
    plan = run(s, pods, signals, 100)
    filters = {o.name: o.body for o in render(POOL, s, plan) if o.name.startswith("sluice-llama-inbound-")}
    assert sorted(filters) == ["sluice-llama-inbound-a100", f"sluice-llama-inbound-l40s-pcie-{_digest('L40S_pcie')}"]
    for body in filters.values():
        istio.validate(body)
    a100 = filters["sluice-llama-inbound-a100"]["spec"]
    assert a100["workloadSelector"] == {"labels": {"app": "llama", "sluice.dev/hardware-class": "a100"}}
    cluster_patch = a100["configPatches"][0]["patch"]["value"]
    # 0.75 x the median of 40, 48 and 44 (a3 has no sidecar, but its batch is its class's evidence)
    assert cluster_patch["circuit_breakers"]["thresholds"][0]["max_requests"] == 33
    rows = {r.pod: r.inbound_limit for r in plan.status.endpoints}
    # the status shows what the sidecars were given, and no limit where none was rendered
    assert rows == {"a1": 33, "a2": 33, "l1": 15, "r1": None, "x": None, "a3": None, "e": None}
    condition = next(c for c in plan.status.conditions if c.type == "AdmissionEnforced")
    assert (condition.status, condition.reason) == ("False", "PartlyEnforced")
    for why, who in ((NOT_MEASURED, "r1"), (NO_CLASS, "e, x"), (NO_SIDECAR, "a3")):
        assert f"{why}: {who}" in condition.message


def test_a_pass_that_publishes_nothing_says_the_limits_were_not_rendered() -> None:
    s = spec(admission={"mode": "Enforce", "batchShare": 0.75})
    unready = _with_sidecar(pod("a1")).model_copy(update={"ready": False})
    plan = run(s, [unready], {"a1": _saturated(40)}, 100)
    assert not plan.publish
    condition = next(c for c in plan.status.conditions if c.type == "AdmissionEnforced")
    assert (condition.status, condition.reason) == ("False", "NotRendered")
    assert not [e for e in plan.events if e.reason == "AdmissionLimits"]


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:6]


def test_report_and_off_render_no_limit() -> None:
    for mode in ("Off", "Report"):
        s = spec(admission={"mode": mode, "batchShare": 0.75})
        plan = run(s, [_with_sidecar(pod("a1"))], {"a1": _saturated(40)}, 100)
        assert not [o for o in render(POOL, s, plan) if "-inbound-" in o.name]
        assert not [c for c in plan.status.conditions if c.type == "AdmissionEnforced"]
