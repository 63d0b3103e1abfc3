"""A pool whose spec becomes invalid: the operator marks it and touches no Istio object.

The API server normally refuses such a spec (see test_operator). It still happens when the installed CRD is
older or looser than the operator (a partial upgrade, a hand-edited CRD): this stack registers a CRD whose spec
schema accepts anything, so the operator's own validation is what stands between the spec and the mesh.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from sluice.devstack.stack import SLUICE_CRD, Stack, free_port
from tests.e2e.conftest import (
    BASE_PODS,
    Background,
    condition,
    module_stack,
    pool_manifest,
    wait_for_passes,
    wait_until,
)

pytestmark = pytest.mark.slow
METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def loose_stack(tmp_path_factory: pytest.TempPathFactory, background: Background) -> Iterator[Stack]:
    workdir = Path(tmp_path_factory.mktemp("loose"))
    crd = yaml.safe_load(SLUICE_CRD.read_text())
    version = crd["spec"]["versions"][0]
    version["schema"]["openAPIV3Schema"]["properties"]["spec"] = {
        "type": "object",
        "description": "Anything (an older, looser CRD).",
        "x-kubernetes-preserve-unknown-fields": True,
    }
    loose = workdir / "loose-crd.yaml"
    loose.write_text(yaml.safe_dump(crd))
    args = ["--metrics-port", str(METRICS_PORT), "--metrics-address", "127.0.0.1"]
    yield from module_stack(
        workdir, background, BASE_PODS[:2], lambda stack: stack.start_operator(args), sluice_crd=loose
    )


def versions(stack: Stack) -> dict[str, str]:
    out = {}
    for plural in ("serviceentries", "destinationrules", "virtualservices"):
        obj = stack.istio(plural, "sluice-llama")
        assert obj is not None, plural
        out[plural] = obj["metadata"]["resourceVersion"]
    return out


def settled(stack: Stack, rounds: int = 10) -> dict[str, str]:
    """The Istio objects' versions once two passes in a row wrote none of them: weights still moving with the
    first signals (written by a pass of the valid spec) must not be taken for a write of the invalid one."""
    last = versions(stack)
    for _ in range(rounds):
        wait_for_passes(METRICS_PORT, "llm/llama", 2, 30)
        now = versions(stack)
        if now == last:
            return now
        last = now
    raise AssertionError(f"the Istio objects were still written after {rounds} rounds of two passes")


def test_spec_turning_invalid_sets_a_condition_and_writes_nothing(loose_stack: Stack) -> None:
    stack = loose_stack
    stack.kubectl("apply", "-f", "-", stdin=pool_manifest(stack))
    wait_until(lambda: condition(stack.pool("llama"), "IstioSynced")["status"] == "True", 40, "objects in sync")
    before = settled(stack)
    stack.patch_pool("llama", {"spec": {"canary": {"steps": [50, 10, 100]}, "scoring": {"alpha": 3}}})
    invalid = wait_until(
        lambda: condition(stack.pool("llama"), "SpecValid")["status"] == "False" and stack.pool("llama"),
        20,
        "SpecValid=False",
    )
    message = condition(invalid, "SpecValid")["message"]
    assert "spec.canary.steps" in message
    assert "steps must be strictly increasing" in message
    assert "spec.scoring.alpha" in message
    wait_for_passes(METRICS_PORT, "llm/llama", 3, 30)
    assert versions(stack) == before
    assert len(stack.events("InvalidSpec")) == 1  # reported once, not every pass
    stack.patch_pool("llama", {"spec": {"canary": {"steps": [10, 50, 100]}, "scoring": {"alpha": 0.7}}})
    wait_until(lambda: condition(stack.pool("llama"), "SpecValid")["status"] == "True", 20, "SpecValid=True again")
