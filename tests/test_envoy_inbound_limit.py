"""The admission limit sluice renders (`admission.mode: Enforce`) bounds a pod's requests on real Envoy.

The sidecar is built as istiod builds its inbound side, and sluice's patches applied as Istio's MERGE and
INSERT_BEFORE apply them (`sluice.bench.sidecar`, which cites istio/istio 1.30 for each part). An EnvoyFilter MERGE
appends repeated fields (pkg/proto/merge/merge.go; Istio 1.31 adds MERGE_AND_REPLACE_LIST, envoyfilter/util.go),
and Envoy takes the first threshold of a priority (source/common/upstream/upstream_impl.cc,
`ResourceManagers::load`). These tests send the sidecar more requests at once than the limit, against a pod that
holds each request long enough for all of them to be in flight together.
"""

from __future__ import annotations

import hashlib
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.api.v1alpha1 import EndpointStatus, InferencePoolStatus, TenantsSpec
from sluice.bench.sidecar import (
    TARGET_PORT,
    dynamic_sidecar_config,
    inbound_listener,
    istio_inbound,
    patched,
    sidecar_config,
    with_http_filters,
    write_dynamic,
)
from sluice.core.inbound import NO_CLASS, NO_SIDECAR, NOT_MEASURED
from sluice.core.mesh import TLS_MODE_LABEL
from sluice.core.observed import ObservedPod, PodSignals
from sluice.devstack.stack import SHARED_ISTIO, free_port
from sluice.emulator.apivalidation import SchemaRegistry
from sluice.istio.envoyfilters import (
    inbound_patches,
    render_inbound_envoy_filters,
    tenant_buckets,
    tenant_patch,
    token_bucket,
)
from sluice.istio.objects import PoolRef
from sluice.istio.render import render
from tests.helpers import T0, pod, run, sig, spec
from tests.test_envoy_patches import ENVOYS
from tests.test_envoy_refusals import envoy, pod_server

HOLD = 1.5
"""Seconds the pod holds each request: every request of a burst is in flight while the first ones are."""
BURST = 6
LIMIT = 2
POOL = PoolRef("llama", "llm", "0d6c6f1c-7c49-4d7e-9a0e-1f3a1e1b2c3d")


@contextmanager
def slow_pod() -> Iterator[int]:
    with pod_server(HOLD) as port:
        yield port


def burst(port: int) -> Counter[tuple[int, bool]]:
    """(status, x-envoy-overloaded) of BURST requests sent at once."""

    def one(_: int) -> tuple[int, bool]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as answer:
                answer.read()  # the whole answer: closing early is a downstream disconnect (flag DC) in the log
                return answer.status, bool(answer.headers.get("x-envoy-overloaded"))
        except urllib.error.HTTPError as refused:
            return refused.code, bool(refused.headers.get("x-envoy-overloaded"))

    with ThreadPoolExecutor(BURST) as pool:
        return Counter(pool.map(one, range(BURST)))


def scene(binary: Path, workdir: Path, patches: list[Any]) -> Counter[tuple[int, bool]]:
    with slow_pod() as app:
        listen = free_port()
        route_config, cluster = patched(*istio_inbound(app), patches)
        config = sidecar_config(listen, route_config, cluster, with_http_filters(patches), workdir / "access.log")
        with envoy(binary, config, workdir, "sidecar"):
            return burst(listen)


def logged(workdir: Path) -> Counter[str]:
    """The sidecar's access log (written out when it stopped): "<status> <response flags>" per answer."""
    return Counter((workdir / "access.log").read_text().splitlines())


@pytest.fixture(params=sorted(ENVOYS))
def binary(request: pytest.FixtureRequest) -> Path:
    path: Path = ENVOYS[request.param]  # both installed by `make test` (`make envoy-istio`)
    return path


def test_sluices_inbound_patches_bound_the_requests_a_pod_runs_at_once(binary: Path, tmp_path: Path) -> None:
    seen = scene(binary, tmp_path, inbound_patches(spec(), LIMIT))
    # LIMIT in flight; the rest refused at once, marked overloaded (the callers' retries send them elsewhere).
    assert seen == Counter({(200, False): LIMIT, (503, True): BURST - LIMIT})
    # and flagged UO, what Istio's istio_requests_total carries and sluice's refusedRate counts
    assert logged(tmp_path) == Counter({"200 -": LIMIT, "503 UO": BURST - LIMIT})


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


TENANTS = TenantsSpec.model_validate(
    {
        "header": "x-tenant-id",
        "shares": [{"value": "team-a", "percent": 20}, {"value": "team-b", "percent": 40}],
        "othersPercent": 40,
    }
)
RATE = 10.0
"""The pod's admitted rate, requests/s: team-a's bucket refills at 2/s, team-b's and the others' at 4/s."""
BUCKETS = tenant_buckets(TENANTS, RATE)
A, OTHERS = BUCKETS["team-a"].max_tokens, BUCKETS[None].max_tokens
REFILL = 2
"""Tokens that may refill while one tenant's requests go, one after another on loopback (well under a second)."""


def tenant_requests(port: int, tenant: str | None, count: int) -> Counter[tuple[int, str | None]]:
    """(status, retry-after) of `count` requests sent one after another, as fast as they go."""
    headers = {"x-tenant-id": tenant} if tenant is not None else {}
    seen: Counter[tuple[int, str | None]] = Counter()
    for _ in range(count):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                answer.read()
                seen[(answer.status, answer.headers.get("retry-after"))] += 1
        except urllib.error.HTTPError as refused:
            seen[(refused.code, refused.headers.get("retry-after"))] += 1
    return seen


def tenant_scene(binary: Path, workdir: Path, patch: dict[str, Any]) -> tuple[Counter[tuple[int, str | None]], ...]:
    """team-a sends twice its bucket, then team-b 6, then a bucketful without the header, then 6 from an unlisted
    tenant (the same bucket as no header)."""
    with pod_server() as app:
        listen = free_port()
        route_config, cluster = istio_inbound(app)
        config = sidecar_config(listen, route_config, cluster, with_http_filters([patch]), workdir / "access.log")
        with envoy(binary, config, workdir, "sc"):
            return (
                tenant_requests(listen, "team-a", 2 * A),
                tenant_requests(listen, "team-b", 6),
                tenant_requests(listen, None, OTHERS),
                tenant_requests(listen, "team-z", 6),
            )


def test_a_noisy_tenant_is_held_to_its_share_and_the_others_keep_theirs(binary: Path, tmp_path: Path) -> None:
    noisy, quiet, anonymous, unlisted = tenant_scene(binary, tmp_path, tenant_patch(spec(), TENANTS, RATE))
    served = noisy[(200, None)]
    # its bucket, and what refilled while the rest went; the rest refused at once, with Retry-After
    assert A <= served <= A + REFILL, noisy
    assert noisy[(429, "1")] == 2 * A - served, noisy
    # team-b's own bucket, and the others' (no header), were not spent by team-a
    assert quiet == Counter({(200, None): 6})
    assert anonymous == Counter({(200, None): OTHERS})
    # an unlisted value is in the others' bucket, which the anonymous requests emptied
    assert unlisted[(200, None)] <= REFILL, unlisted
    assert sum(unlisted.values()) == 6
    # every 429 flagged RL, what Istio's istio_requests_total carries and sluice's refusedRate counts
    refused = noisy[(429, "1")] + unlisted[(429, "1")]
    flags = logged(tmp_path)
    assert flags["429 RL"] == refused
    assert sum(flags.values()) == sum(sum(seen.values()) for seen in (noisy, quiet, anonymous, unlisted))


def test_envoys_default_would_spend_the_others_bucket_on_every_tenant(binary: Path, tmp_path: Path) -> None:
    # always_consume_default_token_bucket left at Envoy's default (true): team-a's and team-b's requests also spend
    # the bucket the requests without a tenant share, which is why sluice sets it false.
    patch = tenant_patch(spec(), TENANTS, RATE)
    patch["patch"]["value"]["typed_config"]["always_consume_default_token_bucket"] = True
    _, _, anonymous, _ = tenant_scene(binary, tmp_path, patch)
    assert anonymous[(429, "1")] >= A + 6 - REFILL, anonymous


def test_tenant_shares_render_beside_the_limit_and_validate() -> None:
    istio = SchemaRegistry().load(SHARED_ISTIO)
    tenants = {"header": "x-tenant-id", "shares": [{"value": "team-a", "percent": 30}], "othersPercent": 70}
    s = spec(admission={"mode": "Enforce", "batchShare": 0.75, "tenants": tenants})
    pods = [_with_sidecar(pod("a1")), _with_sidecar(pod("a2")), _with_sidecar(pod("r1", hw="rtx4090"))]
    # a1 and a2 have read their rate at a full limit (remembered in the previous status); r1 none yet
    previous = InferencePoolStatus(
        endpoints=[
            EndpointStatus(pod=name, weight=500, state="Routable", rate_at_limit=c, since=T0)
            for name, c in (("a1", 12.0), ("a2", 14.0))
        ]
    )
    signals = {"a1": _saturated(40), "a2": _saturated(48), "r1": _saturated(20)}
    plan = run(s, pods, signals, 100, previous)
    filters = {o.name: o.body for o in render(POOL, s, plan) if o.name.startswith("sluice-llama-inbound-")}
    for body in filters.values():
        istio.validate(body)
    patches = filters["sluice-llama-inbound-a100"]["spec"]["configPatches"]
    assert [p["applyTo"] for p in patches] == ["CLUSTER", "HTTP_ROUTE", "HTTP_FILTER"]
    # r1's class has a limit but no measured capacity: its sidecar gets the limit alone
    assert [p["applyTo"] for p in filters["sluice-llama-inbound-rtx4090"]["spec"]["configPatches"]] == [
        "CLUSTER",
        "HTTP_ROUTE",
    ]
    rows = {r.pod: r.rate_limit for r in plan.status.endpoints}
    assert rows["r1"] is None
    assert rows["a1"] == rows["a2"]
    rate = rows["a1"]
    assert rate is not None
    assert rate == 13.0  # the class median of what the two read (no new reading: they showed no limit before)
    config = patches[2]["patch"]["value"]["typed_config"]
    (descriptor,) = config["descriptors"]
    assert descriptor["entries"] == [{"key": "sluice-tenant", "value": "team-a"}]
    # the bucket refills at 30 % of the rate, the others' at 70 %
    assert _refill(descriptor["token_bucket"]) == pytest.approx(0.3 * rate, rel=0.01)
    assert _refill(config["token_bucket"]) == pytest.approx(0.7 * rate, rel=0.01)
    condition = next(c for c in plan.status.conditions if c.type == "TenantSharesEnforced")
    assert (condition.status, condition.reason) == ("False", "PartlyEnforced"), condition.message
    assert "admitted without tenant shares: r1" in condition.message


def _refill(bucket: dict[str, Any]) -> float:
    return float(bucket["tokens_per_fill"]) / float(bucket["fill_interval"].rstrip("s"))


@pytest.mark.parametrize("per_second", [0.01, 0.3, 1.0, 7.7, 19.9, 20.0, 33.0, 250.0, 4000.0])
def test_a_token_bucket_refills_at_the_rate_asked_within_envoys_limits(per_second: float) -> None:
    bucket = token_bucket(per_second).json()
    assert float(str(bucket["fill_interval"]).rstrip("s")) >= 0.05  # Envoy refuses a faster timer
    assert isinstance(bucket["tokens_per_fill"], int)
    assert isinstance(bucket["max_tokens"], int)
    assert bucket["tokens_per_fill"] >= 1
    assert bucket["max_tokens"] >= bucket["tokens_per_fill"]
    assert _refill(bucket) == pytest.approx(per_second, rel=0.02)


def test_a_class_with_a_rate_and_no_limit_gets_the_tenant_buckets_alone() -> None:
    s = spec(
        admission={
            "mode": "Enforce",
            "tenants": {"header": "x-t", "shares": [{"value": "a", "percent": 60}], "othersPercent": 40},
        }
    )
    (body,) = [o.body for o in render_inbound_envoy_filters(POOL, s, {}, {"a100": 12.0})]
    SchemaRegistry().load(SHARED_ISTIO).validate(body)
    (patch,) = body["spec"]["configPatches"]
    assert patch["applyTo"] == "HTTP_FILTER"
    assert body["spec"]["workloadSelector"] == {"labels": {"app": "llama", "sluice.dev/hardware-class": "a100"}}
    # without tenants, a rate renders nothing
    assert render_inbound_envoy_filters(POOL, spec(admission={"mode": "Enforce"}), {}, {"a100": 12.0}) == []


def _admin_stat(admin: int, name: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/stats?filter=^{name}$", timeout=2) as answer:
        line = answer.read().decode().strip()
    return int(line.rpartition(": ")[2]) if line else 0


def test_a_changed_limit_starts_the_new_cluster_counting_from_zero(binary: Path, tmp_path: Path) -> None:
    """Envoy builds a new cluster for a changed CDS resource, with its own circuit-breaker counts: requests still
    in flight on the old one are not counted against the new limit. So a limit rewritten while a pod is full lets
    up to a whole new limit through on top (upstream: source/common/upstream/cluster_manager_impl.cc,
    `addOrUpdateCluster` replaces the cluster; its ResourceManager belongs to the cluster's info). Why a limit
    must not move with every reading (`sluice.core.inbound.HYSTERESIS`)."""
    admin = free_port()
    (tmp_path / "envoy.yaml").write_text(yaml.safe_dump(dynamic_sidecar_config(tmp_path, admin)))
    with pod_server(4.0) as app:
        listen = free_port()

        def configure(limit: int, version: str) -> None:
            patches = inbound_patches(spec(), limit)
            route_config, cluster = patched(*istio_inbound(app), patches)
            listener = inbound_listener(listen, route_config, with_http_filters(patches))
            write_dynamic(tmp_path, listener, cluster, version)

        configure(LIMIT, "1")
        with (
            envoy(binary, dynamic_sidecar_config(tmp_path, admin), tmp_path, "sidecar"),
            ThreadPoolExecutor(8) as pool,
        ):
            first = [pool.submit(_get, listen) for _ in range(LIMIT)]  # the pod full: LIMIT in flight
            time.sleep(1.0)
            updates = _admin_stat(admin, "cluster_manager.cds.update_success")
            configure(LIMIT + 1, "2")  # one more allowed
            deadline = time.monotonic() + 5
            while _admin_stat(admin, "cluster_manager.cds.update_success") <= updates:
                assert time.monotonic() < deadline, "the new cluster was not taken"
                time.sleep(0.05)
            later = Counter(pool.map(lambda _: _get(listen), range(LIMIT + 3)))
            assert [f.result() for f in first] == [200] * LIMIT
    # Counted together, one of the later five would be served (LIMIT in flight + 1 = the new limit) and four
    # refused. The new cluster counts from zero: it enforces its limit, but on the later requests alone — LIMIT + 1
    # served beside the LIMIT still in flight, 2 * LIMIT + 1 at once against a limit of LIMIT + 1.
    assert later == Counter({200: LIMIT + 1, 503: 2})


def _get(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as answer:
            answer.read()
            return int(answer.status)
    except urllib.error.HTTPError as refused:
        return int(refused.code)
