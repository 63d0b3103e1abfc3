"""The spec strategy other property tests draw from: every spec it yields is one both the CRD and the models accept.

A spec the CRD accepts but the models refuse (or that parses differently once the API server has filled in its
defaults) is a real disagreement between the two validators, which is what these properties look for.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import Phase, given, seed, settings

from sluice.api.v1alpha1 import InferencePool, InferencePoolSpec
from tests.strategies import accepted_pool_specs, crd_registry, pool_object


@settings(max_examples=50)
@given(accepted_pool_specs())
def test_the_models_accept_every_spec_the_crd_accepts(spec: dict[str, Any]) -> None:
    InferencePool.model_validate(pool_object(spec))


@settings(max_examples=50)
@given(accepted_pool_specs())
def test_api_server_defaulting_does_not_change_what_the_models_parse(spec: dict[str, Any]) -> None:
    defaulted = crd_registry().validate(pool_object(copy.deepcopy(spec)))
    assert InferencePoolSpec.model_validate(defaulted["spec"]) == InferencePoolSpec.model_validate(spec)


EDGES = {
    "alpha 0": lambda spec: spec.get("scoring", {}).get("alpha") == 0.0,
    "alpha 1": lambda spec: spec.get("scoring", {}).get("alpha") == 1.0,
    "minWeight equal to maxWeight": lambda spec: (
        "minWeight" in spec.get("scoring", {}) and spec["scoring"]["minWeight"] == spec["scoring"]["maxWeight"]
    ),
    "single-step canary": lambda spec: spec.get("canary", {}).get("steps") == [100],
    "1ms duration": lambda spec: spec.get("metrics", {}).get("timeout") == "1ms",
    "no bands": lambda spec: spec.get("protection", {}).get("bands") == [],
    "prefixed selector key": lambda spec: any("/" in key for key in spec["selector"]["matchLabels"]),
    "custom engine": lambda spec: spec["engine"] == "custom",
}


def test_the_strategy_reaches_the_edges_of_the_api() -> None:
    seen: set[str] = set()

    # A fixed seed and no shrinking. (The draws still depend on what ran before in the process, so enough of them
    # that every edge is reached whatever the order.)
    @seed(2026)
    @settings(max_examples=300, database=None, phases=[Phase.generate])
    @given(accepted_pool_specs())
    def record(spec: dict[str, Any]) -> None:
        seen.update(name for name, reached in EDGES.items() if reached(spec))

    record()
    assert seen == set(EDGES)
