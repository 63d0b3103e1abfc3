"""Header routes on the local stack, driven with the real kubectl: testers reach the candidate while users do not.

The load generator follows the VirtualService's routes as Envoy does — the header route first (exact, prefix, or
an RE2 regex over the whole value), then the weighted one — and 30 % of its requests carry the tester header. The
candidate is held in shadow (0 % of users), so every tester request on a candidate pod, and every other request
on a stable pod, is a count, not an inference.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.core.abtest import ALPHABETS
from sluice.devstack.kubelet import PodSpec
from sluice.devstack.stack import Stack
from sluice.devstack.traffic import Traffic
from tests.e2e.conftest import Background, operator_stack, pool_manifest, wait_until
from tests.e2e.test_plugin import kubectl_sluice

pytestmark = pytest.mark.slow
PODS = [PodSpec("llama-a100-0", "a100", "v1", "127.0.27.1"), PodSpec("llama-a100-1", "a100", "v1", "127.0.27.2")]
CANDIDATE = PodSpec("llama-v2-a100-0", "a100", "v2", "127.0.27.3")
MATCH = [{"headers": {"x-sluice-tester": {"exact": "yes"}}}]


def manifest(stack: Stack) -> str:
    pool = yaml.safe_load(pool_manifest(stack))
    pool["spec"]["canary"].update(
        candidateRevision="v2",
        match=MATCH,
        # held in shadow for the whole test: users stay on v1, a 1 % mirror is the only user traffic copied to v2
        shadow={"mirrorPercent": 1, "duration": "10m"},
    )
    return yaml.safe_dump(pool)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, background: Background) -> Iterator[Stack]:
    def apply_pool(stack: Stack) -> None:
        stack.kubectl("apply", "-f", "-", stdin=pool_manifest(stack))

    yield from operator_stack(Path(tmp_path_factory.mktemp("match")), background, PODS, setup=apply_pool)


@pytest.fixture(scope="module")
def traffic(stack: Stack, background: Background) -> Iterator[Traffic]:
    load = Traffic(stack, "llama", rate=8.0, tester_share=0.3, user_header="x-user-id", users=120)
    background.start(load.run(stack.remaining()))
    yield load
    background.call(load.stop.set)


@pytest.fixture(scope="module")
def with_candidate(stack: Stack) -> Stack:
    """The stack once v1 is routable and v2's pod runs beside it: each test may start from there, run alone or
    after the others."""
    wait_until(lambda: stack.pool("llama").get("status", {}).get("routable") == "2/2", 60, "v1 routable")
    stack.add_pod(CANDIDATE)
    return stack


def http_routes(stack: Stack) -> list[dict[str, Any]]:
    out = stack.kubectl("get", "virtualservice", "sluice-llama", "-n", stack.namespace, "-o", "json", check=False)
    routes: list[dict[str, Any]] = json.loads(out.stdout)["spec"]["http"] if out.returncode == 0 else []
    return routes


def test_testers_reach_the_candidate_at_zero_percent_and_users_stay_on_the_stable_revision(
    with_candidate: Stack, traffic: Traffic
) -> None:
    stack = with_candidate
    stack.kubectl("apply", "-f", "-", stdin=manifest(stack))
    wait_until(
        lambda: [r["name"] for r in http_routes(stack)] == ["sluice-match", "sluice-weights"],
        60,
        "the header route ahead of the weighted one",
        show=lambda: http_routes(stack),
    )
    since = time.monotonic()
    time.sleep(12)
    recent = [s for s in traffic.finished() if s.at > since + 1]  # routes refreshed by the load generator
    testers = [s for s in recent if s.tester]
    users = [s for s in recent if not s.tester]
    print(f"\nheader routes: {len(testers)} tester requests, {len(users)} user requests")
    assert len(testers) >= 10
    assert len(users) >= 20
    assert {s.revision for s in testers} == {"v2"}
    assert {s.revision for s in users} == {"v1"}
    canary = stack.pool("llama")["status"]["canary"]
    assert canary["phase"] == "Shadow"
    assert canary["weight"] == 0
    assert canary["headerRoutes"] is True
    status = kubectl_sluice(stack, "status", "llama", "-n", stack.namespace)
    assert "header routes to v2" in status.stdout, status.stdout


def test_an_invalid_regex_is_refused_by_the_operator_with_its_field_and_routing_is_kept(stack: Stack) -> None:
    """RE2, as Envoy compiles it, cannot be checked by CEL: the API server stores the pool, the operator refuses it
    (SpecValid=False naming the field) and writes nothing, so the header route stays as it was."""
    before = http_routes(stack)
    pool = yaml.safe_load(manifest(stack))
    pool["spec"]["canary"]["match"] = [{"headers": {"x-sluice-tester": {"regex": "(?=yes)y"}}}]
    stack.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(pool))

    def refused() -> dict[str, Any] | None:
        conditions = stack.pool("llama").get("status", {}).get("conditions", [])
        found = next((c for c in conditions if c["type"] == "SpecValid"), None)
        return found if found is not None and found["status"] == "False" else None

    condition = wait_until(refused, 30, "SpecValid=False")
    assert "spec.canary.match[0].headers.x-sluice-tester.regex" in condition["message"]
    assert "not an RE2 expression Envoy compiles" in condition["message"]
    assert http_routes(stack) == before


def test_an_ab_test_keeps_every_user_on_one_revision_and_puts_the_asked_share_of_users_on_the_candidate(
    with_candidate: Stack, traffic: Traffic
) -> None:
    """Half the hex buckets (keys ending 00-7f) on v2 for the experiment: each of 120 users (16-hex-digit keys) has
    all its requests on one revision, and it is the revision its key's last two digits assign."""
    stack = with_candidate
    pool = yaml.safe_load(manifest(stack))
    canary = pool["spec"]["canary"]
    del canary["match"], canary["shadow"]
    canary["abTest"] = {"key": {"header": "x-user-id"}, "percent": 50, "duration": "10m"}
    stack.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(pool))
    wait_until(
        lambda: [r["name"] for r in http_routes(stack)] == ["sluice-ab", "sluice-weights"],
        60,
        "the A/B route ahead of the weighted one",
        show=lambda: http_routes(stack),
    )
    since = time.monotonic()
    time.sleep(15)
    recent = [s for s in traffic.finished() if s.at > since + 1 and not s.tester and s.user is not None]
    by_user: dict[str, set[str]] = {}
    for sample in recent:
        by_user.setdefault(sample.user or "", set()).add(sample.revision)
    hex_digits = ALPHABETS["hex"]
    expected = {
        user: "v2" if hex_digits.index(user[-2]) * 16 + hex_digits.index(user[-1]) < 128 else "v1" for user in by_user
    }
    print(f"\nA/B: {len(recent)} requests of {len(by_user)} users, {sum(v == 'v2' for v in expected.values())} on v2")
    assert len(by_user) >= 40
    assert all(len(revisions) == 1 for revisions in by_user.values()), by_user
    assert {user: next(iter(revisions)) for user, revisions in by_user.items()} == expected
    assert {"v1", "v2"} <= set(expected.values())
    status = stack.pool("llama")["status"]["canary"]
    assert status["abShare"] == 50
    assert status["phase"] == "Progressing"
