"""Header routes to the candidate (`spec.canary.match`): rendered as Istio routes, judged without the testers.

The VirtualService's header match is Istio's HTTPMatchRequest (`headers: {name: {exact|prefix|regex}}`), which
istiod translates into an Envoy RouteMatch with HeaderMatchers (pilot/pkg/networking/core/route/route.go,
translateHeaderMatch: exact -> string_match.exact, prefix -> string_match.prefix, regex ->
string_match.safe_regex.regex); routes are tried in order, so the header route comes first. The route
configuration istiod would build from sluice's VirtualService is checked by real Envoys (1.38.3 and 1.40), and the
operator's RE2 check agrees with Envoy's on what compiles.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import re2  # type: ignore[import-untyped]
import yaml
from pydantic import ValidationError

from sluice.api.errors import format_validation_error
from sluice.api.v1alpha1 import InferencePool, InferencePoolSpec, re2_error
from sluice.core.abtest import ALPHABETS, buckets, key_match
from sluice.core.canarycheck import RevisionStats, check
from sluice.core.observed import ObservedMesh, ObservedService, ServicePort
from sluice.core.reconcile import Plan, plan_pass
from sluice.devstack.stack import SHARED_ISTIO, free_port
from sluice.emulator.apivalidation import SchemaRegistry
from sluice.istio.envoyfilters import cluster_name
from sluice.istio.objects import PoolRef, destination_host, destination_port
from sluice.istio.render import render
from tests.helpers import at, observed, pod, sig
from tests.helpers import spec as pool_spec
from tests.test_envoy_patches import BOOTSTRAP, ENVOYS, envoy_validate, istio_cluster


def spec(**wire: Any) -> InferencePoolSpec:
    """The pool, its canary's steps published as written: these rollouts have one candidate pod against two stable
    ones, which canary.comparableLoad would hold past a third (tested in tests/test_canary_load.py)."""
    if "canary" in wire:
        wire = {**wire, "canary": {"comparableLoad": False, **wire["canary"]}}
    return pool_spec(**wire)


POOL = PoolRef("llama", "llm", "0d6c6f1c-7c49-4d7e-9a0e-1f3a1e1b2c3d")
PODS = [pod("v1-a", "a100", "v1"), pod("v1-b", "a100", "v1"), pod("v2-a", "a100", "v2")]
SIGNALS = {"v1-a": sig(ttft=0.04, rps=5), "v1-b": sig(ttft=0.04, rps=5), "v2-a": sig(ttft=0.04, rps=5)}
MATCH = [
    {"headers": {"x-sluice-tester": {"exact": "yes"}}},
    {"headers": {"cookie": {"regex": "^(.*?;\\s*)?canary=always(;.*)?$"}, "x-team": {"prefix": "ml-"}}},
]
MESH = ObservedMesh(service=ObservedService(name="llama", ports=[ServicePort(port=8000, name="http")]))


@pytest.fixture(scope="module")
def istio() -> SchemaRegistry:
    return SchemaRegistry().load(SHARED_ISTIO)


def planned(canary: dict[str, Any], seconds: float = 0, previous: Any = None, pods: Any = None) -> tuple[Any, Plan]:
    s = spec(canary={"stableRevision": "v1", "candidateRevision": "v2", **canary})
    when = at(seconds)
    seen = observed(pods or PODS, SIGNALS, when).model_copy(update={"mesh": MESH})
    return s, plan_pass(s, 1, seen, previous, when, pool=POOL.id)


def virtual_service(s: Any, plan: Plan, istio: SchemaRegistry) -> dict[str, Any]:
    objects = render(POOL, s, plan)
    for obj in objects:
        istio.validate(obj.body)
    found = [o.body for o in objects if o.kind == "VirtualService"]
    assert len(found) == 1
    return found[0]


def test_matching_requests_go_to_the_candidate_ahead_of_the_split(istio):
    s, plan = planned({"match": MATCH})
    assert plan.status.canary is not None
    assert plan.status.canary.header_routes
    http = virtual_service(s, plan, istio)["spec"]["http"]
    assert [route["name"] for route in http] == ["sluice-match", "sluice-weights"]
    steered = http[0]
    assert steered["match"] == [
        {"headers": {"x-sluice-tester": {"exact": "yes"}}},
        {"headers": {"cookie": {"regex": MATCH[1]["headers"]["cookie"]["regex"]}, "x-team": {"prefix": "ml-"}}},
    ]
    assert [r["destination"]["subset"] for r in steered["route"]] == ["rev-v2"]
    assert {r["destination"]["subset"]: r["weight"] for r in http[1]["route"]} == {"rev-v1": 95, "rev-v2": 5}


def test_the_shadow_phase_has_the_header_route_and_the_mirror(istio):
    s, plan = planned({"match": MATCH, "shadow": {"mirrorPercent": 50}})
    assert plan.status.canary is not None
    assert plan.status.canary.phase == "Shadow"
    http = virtual_service(s, plan, istio)["spec"]["http"]
    assert http[0]["route"][0]["destination"]["subset"] == "rev-v2"
    assert "mirrors" not in http[0]  # testers' requests are not copied again
    assert [r["destination"]["subset"] for r in http[1]["route"]] == ["rev-v1"]
    assert http[1]["mirrors"][0]["destination"]["subset"] == "rev-v2"


def test_no_header_route_without_routable_candidate_pods_or_after_the_rollout(istio):
    s, plan = planned({"match": MATCH}, pods=PODS[:2])
    assert plan.status.canary is not None
    assert plan.status.canary.phase == "Waiting"
    assert not plan.status.canary.header_routes
    assert all(route["name"] != "sluice-match" for route in virtual_service(s, plan, istio)["spec"]["http"])
    s, plan = planned({"match": MATCH, "steps": [100], "stepInterval": "1s", "analysis": {"minRequests": 0}})
    promoted = plan_pass(s, 1, observed(PODS, SIGNALS, at(40)).model_copy(update={"mesh": MESH}), plan.status, at(40))
    assert promoted.status.canary is not None
    assert promoted.status.canary.phase == "Promoted"
    assert promoted.steer is None


def test_testers_requests_alone_never_pass_a_check_but_their_failures_count():
    """The candidate's count mixes testers and its share of users (no metric tells them apart): a Pass needs the
    share the split sends (estimated from the stable revision's requests) to reach minRequests; a failure is a
    failure whoever sent the request."""
    analysis = spec(canary={"candidateRevision": "v2"}).canary.analysis  # type: ignore[union-attr]
    busy_testers = RevisionStats(routable_pods=1, healthy_pods=1, requests=300, error_rate=0.0, ttft_p95=0.1)
    stable = RevisionStats(routable_pods=2, healthy_pods=2, requests=190, error_rate=0.0, ttft_p95=0.1)
    share = stable.requests * 5 / 95  # type: ignore[operator]
    capped = check(analysis, busy_testers, stable, True, requests_cap=share)
    assert capped.result == "Inconclusive"
    assert "10 requests in the window counted (header-routed ones excluded" in capped.reason
    assert check(analysis, busy_testers, stable, True).result == "Pass"  # without header routes: every request
    failing = RevisionStats(routable_pods=1, healthy_pods=1, requests=300, error_rate=0.5, ttft_p95=0.1)
    assert check(analysis, failing, stable, True, requests_cap=share).result == "Fail"


def _run(s: Any, signals: dict[str, Any], until: int, every: int = 5) -> Any:
    status = None
    for seconds in range(0, until, every):
        seen = observed(PODS, signals, at(seconds)).model_copy(update={"mesh": MESH})
        status = plan_pass(s, 1, seen, status, at(seconds), pool=POOL.id).status
    return status


def test_a_rollout_with_header_routes_and_the_default_min_requests_reaches_its_last_step_and_promotes():
    """At the last step (100 %) the stable revision serves nobody to estimate the share from: no cap there."""
    s = spec(
        canary={
            "stableRevision": "v1",
            "candidateRevision": "v2",
            "match": MATCH,
            "steps": [50, 100],
            "stepInterval": "10s",
            "analysis": {"interval": "5s"},
        }
    )
    status = _run(s, SIGNALS, 120)
    assert status.canary.phase == "Promoted", status.canary.message


def test_an_ab_test_with_header_routes_and_the_default_min_requests_promotes():
    s = spec(
        canary={
            "stableRevision": "v1",
            "candidateRevision": "v2",
            "match": MATCH,
            "abTest": {**AB, "duration": "30s"},
            "analysis": {"interval": "5s"},
        }
    )
    status = _run(s, SIGNALS, 90)
    assert status.canary.phase == "Promoted", status.canary.message


def test_a_failing_candidate_with_header_routes_is_rolled_back_even_with_an_idle_stable_revision():
    """An idle stable revision leaves no share to count a pass with; the candidate's failures still count."""
    failing = {"v1-a": sig(ttft=0.04, rps=0), "v1-b": sig(ttft=0.04, rps=0), "v2-a": sig(ttft=0.04, rps=5, errors=0.5)}
    s = spec(
        canary={
            "stableRevision": "v1",
            "candidateRevision": "v2",
            "match": MATCH,
            "maxFailedChecks": 2,
            "analysis": {"interval": "5s"},
        }
    )
    status = _run(s, failing, 40)
    assert status.canary.phase == "RolledBack", status.canary.message


# ---------------------------------------------------------------------------------------------- RE2, as Envoy


# a{100} (an RE2 program of 104) is over a bare Envoy's default size limit of 100 but within the 32768 Istio's
# bootstrap sets, which is what the mesh's proxies run with (and what the Envoy below is given).
BAD_REGEXES = ["(?=x)yes", "(a)\\1", "(?<=a)b", "[z-a]", "x{2,1}", "(unclosed", "a{1001}"]
GOOD_REGEXES = ["^yes$", "canary=(always|[0-9a-f]{8})", "(?i)tester", "\\bml-\\w+", "a{100}"]


@pytest.mark.parametrize("pattern", BAD_REGEXES)
def test_a_regex_envoy_cannot_compile_is_refused_with_its_field(pattern):
    document = {
        "apiVersion": "inference.sluice.dev/v1alpha1",
        "kind": "InferencePool",
        "metadata": {"name": "p", "namespace": "llm"},
        "spec": {
            "selector": {"matchLabels": {"app": "llama"}},
            "targetPort": 8000,
            "service": "llama",
            "canary": {"candidateRevision": "v2", "match": [{"headers": {"x-tester": {"regex": pattern}}}]},
        },
    }
    with pytest.raises(ValidationError) as refused:
        InferencePool.model_validate(document)
    text = format_validation_error("InferencePool", "p", refused.value)
    assert "spec.canary.match[0].headers.x-tester.regex: Invalid value" in text
    assert "not an RE2 expression Envoy compiles" in text


def _envoy_routes(s: Any, vs: dict[str, Any], subsets: list[str]) -> dict[str, Any]:
    """The route configuration istiod builds from the VirtualService's http routes, on the bootstrap's vhost."""
    host, port = destination_host(POOL, s), destination_port(s)
    vhost_host, vhost_port = f"llama.{POOL.namespace}.svc.cluster.local", s.target_port
    config = yaml.safe_load(BOOTSTRAP.read_text().replace("HOST", vhost_host).replace("PORT", str(vhost_port)))
    names = {cluster_name(port, subset, host) for subset in subsets} | {cluster_name(vhost_port, None, vhost_host)}
    config["static_resources"]["clusters"] = [istio_cluster(name) for name in sorted(names)]
    routes = []
    for http in vs["spec"]["http"]:
        destinations = [
            (cluster_name(port, r["destination"].get("subset"), host), r.get("weight", 100)) for r in http["route"]
        ]
        if len(destinations) == 1:
            action: dict[str, Any] = {"cluster": destinations[0][0], "timeout": "0s"}
        else:
            clusters = [{"name": name, "weight": weight} for name, weight in destinations]
            action = {"weighted_clusters": {"clusters": clusters}, "timeout": "0s"}
        for match in http.get("match") or [{}]:
            headers = []
            for name, condition in (match.get("headers") or {}).items():
                kind, value = next(iter(condition.items()))
                string_match = {"safe_regex": {"regex": value}} if kind == "regex" else {kind: value}
                headers.append({"name": name, "string_match": string_match})
            route_match: dict[str, Any] = {"prefix": "/"}
            if headers:
                route_match["headers"] = headers
            routes.append({"name": http["name"], "match": route_match, "route": action})
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["route_config"]["virtual_hosts"][0]["routes"] = routes
    # Istio's bootstrap raises the RE2 program-size limit (istio pkg/bootstrap/config.go): the mesh's proxies' rule
    config["layered_runtime"] = {
        "layers": [{"name": "istio", "static_layer": {"re2.max_program_size.error_level": 32768}}]
    }
    return config


@pytest.mark.parametrize("envoy", sorted(ENVOYS))
def test_real_envoy_accepts_the_header_routes_istiod_builds_from_the_virtual_service(envoy, istio, tmp_path):
    s, plan = planned({"match": MATCH})
    config = _envoy_routes(s, virtual_service(s, plan, istio), ["rev-v1", "rev-v2"])
    result = envoy_validate(config, tmp_path, ENVOYS[envoy])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("envoy", sorted(ENVOYS))
def test_the_operators_re2_check_agrees_with_envoys(envoy, istio, tmp_path):
    """Each pattern put on the header route as it is (the models' check bypassed): Envoy refuses exactly the ones
    `re2_error` refuses — so the check can fail, and it fails where Envoy would."""
    s, plan = planned({"match": [{"headers": {"x-tester": {"exact": "yes"}}}]})
    vs = virtual_service(s, plan, istio)
    for pattern in BAD_REGEXES + GOOD_REGEXES:
        vs["spec"]["http"][0]["match"] = [{"headers": {"x-tester": {"regex": pattern}}}]
        result = envoy_validate(_envoy_routes(s, vs, ["rev-v1", "rev-v2"]), tmp_path, ENVOYS[envoy])
        assert (result.returncode == 0) == (re2_error(pattern) is None), (pattern, result.stderr[-400:])


# ---------------------------------------------------------------------------------------------- A/B tests


AB = {"key": {"header": "x-user-id"}, "percent": 20, "duration": "60s"}


@pytest.mark.parametrize("alphabet", ["hex", "alphanumeric", "digits"])
def test_bucket_regexes_take_the_share_asked_within_half_a_bucket_and_envoy_compiles_every_one(alphabet):
    """Every two-character suffix enumerated: the regex's candidate buckets are counted, not taken from the code."""
    chars = ALPHABETS[alphabet]  # type: ignore[index]
    suffixes = [a + b for a in chars for b in chars]
    for percent in (0.5, 1, 5, 12.5, 20, 33, 50, 66.7, 90, 99):
        split = buckets(alphabet, percent)  # type: ignore[arg-type]
        assert re2_error(f".*{split.tail}") is None, (alphabet, percent, split.tail)
        taken = sum(1 for suffix in suffixes if re2.fullmatch(f".*{split.tail}", "user-" + suffix))
        assert taken == split.buckets
        assert split.share == pytest.approx(100 * taken / len(suffixes))
        bucket = 100 / len(suffixes)
        assert abs(split.share - percent) <= bucket / 2 or (percent < bucket and taken == 1), (percent, split.share)


def test_a_cookie_key_is_matched_inside_the_cookie_header_and_only_under_its_own_name():
    spec_ = spec(canary={"candidateRevision": "v2", "abTest": {**AB, "key": {"cookie": "sid"}, "percent": 50}})
    assert spec_.canary is not None
    assert spec_.canary.ab_test is not None
    pattern = key_match(spec_.canary.ab_test)["cookie"]["regex"]
    inside = [f"sid=abc{c}0" for c in "01234567"]  # the first half of hex buckets: 0x00-0x7f
    outside = [f"sid=abc{c}0" for c in "89abcdef"]
    for value in inside:
        assert re2.fullmatch(pattern, value)
        assert re2.fullmatch(pattern, f"theme=dark; {value}; lang=en")
    for value in outside:
        assert not re2.fullmatch(pattern, f"theme=dark; {value}")
    assert not re2.fullmatch(pattern, "xsid=abc00")  # another cookie whose name ends the same
    assert not re2.fullmatch(pattern, "theme=dark")  # no key: the stable revision


def test_an_ab_test_renders_the_key_route_and_keeps_the_weighted_route_on_stable(istio, tmp_path):
    s, plan = planned({"abTest": AB})
    assert plan.status.canary is not None
    assert plan.status.canary.phase == "Progressing"
    assert plan.status.canary.ab_share == pytest.approx(100 * 51 / 256, abs=1e-4)  # 51 of 256 buckets
    vs = virtual_service(s, plan, istio)
    http = vs["spec"]["http"]
    assert [route["name"] for route in http] == ["sluice-ab", "sluice-weights"]
    assert http[0]["match"] == [{"headers": {"x-user-id": {"regex": ".*" + buckets("hex", 20).tail}}}]
    assert http[0]["route"][0]["destination"]["subset"] == "rev-v2"
    assert [(r["destination"]["subset"], r["weight"]) for r in http[1]["route"]] == [("rev-v1", 100)]
    for envoy in sorted(ENVOYS):
        result = envoy_validate(_envoy_routes(s, vs, ["rev-v1", "rev-v2"]), tmp_path, ENVOYS[envoy])
        assert result.returncode == 0, result.stderr[-400:]


def test_an_ab_test_promotes_after_its_duration_on_a_passing_check_and_rolls_back_on_failures():
    s, plan = planned({"abTest": AB, "analysis": {"minRequests": 0, "interval": "5s"}})
    status = plan.status
    for seconds in range(5, 70, 5):
        seen = observed(PODS, SIGNALS, at(seconds)).model_copy(update={"mesh": MESH})
        status = plan_pass(s, 1, seen, status, at(seconds), pool=POOL.id).status
        assert status.canary is not None
        if status.canary.phase == "Promoted":
            break
    assert status.canary is not None
    assert status.canary.phase == "Promoted"
    assert seconds >= 60
    bad = {**SIGNALS, "v2-a": sig(ttft=0.04, rps=5, errors=0.5)}
    s, plan = planned({"abTest": AB, "analysis": {"minRequests": 0, "interval": "1s"}, "maxFailedChecks": 2})
    status = plan.status
    for seconds in range(1, 10):
        seen = observed(PODS, bad, at(seconds)).model_copy(update={"mesh": MESH})
        result = plan_pass(s, 1, seen, status, at(seconds), pool=POOL.id)
        status = result.status
    assert status.canary is not None
    assert status.canary.phase == "RolledBack"
    assert result.steer is None
    assert status.canary.ab_share is None


def _serve(envoy: Path, config: dict[str, Any], tmp_path: Path) -> Iterator[int]:
    """A real Envoy serving `config` on a free loopback port for the test's length (stopped by its PID)."""
    port = free_port()
    listener = config["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = port
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    process = subprocess.Popen(
        [str(envoy), "-c", str(path), "--use-dynamic-base-id", "--log-level", "error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
            time.sleep(0.1)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.mark.parametrize("envoy", sorted(ENVOYS))
def test_real_envoy_sends_each_key_to_the_revision_its_last_two_characters_assign(envoy, istio, tmp_path):
    """sluice's A/B route (a cookie key, with a header route ahead of it) run by Envoy: each route answers with its
    subset's name, and 200 keys' answers are compared with the assignment computed from their last two hex digits
    (bucket = 16·d1 + d2; the first 51 of 256 are the candidate's at 20 %), not from the regex."""
    s, plan = planned({"match": MATCH, "abTest": {**AB, "key": {"cookie": "sid"}}})
    vs = virtual_service(s, plan, istio)
    assert [r["name"] for r in vs["spec"]["http"]] == ["sluice-match", "sluice-ab", "sluice-weights"]
    config = _envoy_routes(s, vs, ["rev-v1", "rev-v2"])
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:
        action = route.pop("route")
        target = (
            action.get("cluster") or max(action["weighted_clusters"]["clusters"], key=lambda c: c["weight"])["name"]
        )
        route["direct_response"] = {"status": 200, "body": {"inline_string": f"{route['name']} {target.split('|')[2]}"}}
    keys = [hashlib.sha256(f"k{i}".encode()).hexdigest()[:12] for i in range(200)]
    answers: dict[str, str] = {}
    for port in _serve(ENVOYS[envoy], config, tmp_path):
        for key in keys:
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                headers={"Host": "llama.llm.svc.cluster.local", "Cookie": f"theme=dark; sid={key}; lang=en"},
            )
            with urllib.request.urlopen(request, timeout=5) as answer:
                answers[key] = answer.read().decode()
        tester = urllib.request.Request(
            f"http://127.0.0.1:{port}/", headers={"Host": "llama.llm.svc.cluster.local", "x-sluice-tester": "yes"}
        )
        with urllib.request.urlopen(tester, timeout=5) as answer:
            assert answer.read().decode() == "sluice-match rev-v2"
    hexd = "0123456789abcdef"
    expected = {
        key: "sluice-ab rev-v2" if hexd.index(key[-2]) * 16 + hexd.index(key[-1]) < 51 else "sluice-weights rev-v1"
        for key in keys
    }
    assert answers == expected
    assert 20 <= sum(1 for a in answers.values() if a.endswith("rev-v2")) <= 60  # ~20 % of 200


def test_a_testers_only_first_step_holds_users_on_stable_until_a_person_skips_it():
    """Argo Rollouts' setHeaderRoute as a step: at 0 % the header route carries the testers; checks can fail the
    step but never pass it, so it holds until `skip-step`, which needs no passing check there (but not after a
    failed one)."""
    from sluice.api.operation import Operation  # noqa: PLC0415

    canary = {
        "stableRevision": "v1",
        "candidateRevision": "v2",
        "match": MATCH,
        "steps": [0, 50, 100],
        "stepInterval": "10s",
        "analysis": {"interval": "5s"},
    }
    s = spec(canary=canary)
    status = _run(s, SIGNALS, 60)
    assert status.canary.phase == "Progressing"
    assert status.canary.step_weight == 0
    assert status.canary.header_routes
    assert "testers only" in status.canary.message
    assert status.canary.last_check == "Inconclusive"  # healthy testers, still no pass
    skip = Operation(op="skip-step", id="op-1", by="tester")
    seen = observed(PODS, SIGNALS, at(60)).model_copy(update={"mesh": MESH})
    moved = plan_pass(s, 1, seen, status, at(60), skip, pool=POOL.id)
    assert moved.status.canary is not None
    assert moved.status.canary.step_weight == 50
    assert moved.revision_weights == {"v1": 50, "v2": 50}
    failing = {**SIGNALS, "v2-a": sig(ttft=0.04, rps=5, errors=0.5)}
    failed = _run(spec(canary={**canary, "maxFailedChecks": 2}), failing, 30)
    assert failed.canary.phase == "RolledBack"  # the testers' failures count
