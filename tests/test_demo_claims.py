"""The demo's first claim, on the states a pool of 2x A100, RTX 4090 and CPU really goes through.

The weights that hold, and the cold A100's, are ones the operator wrote in demo runs: at low load the A100s carry
nearly every request and the 4090 and the CPU both hold the minimum weight (a slower pod joins the plan only once the
faster ones' latency level reaches its idle TTFT); a cold A100 whose first requests were slow can hold it too for
a few passes. The other states that fail are the violations the claim is there to catch.
"""

from __future__ import annotations

from typing import Any

import pytest

from sluice.devstack.demo import capacity_order


def pool(a100_0: int, a100_1: int, rtx4090: int, cpu: int, metrics: str = "True") -> dict[str, Any]:
    weights = {"llama-a100-0": a100_0, "llama-a100-1": a100_1, "llama-4090-0": rtx4090, "llama-cpu-0": cpu}
    return {
        "status": {
            "endpoints": [{"pod": name, "weight": weight} for name, weight in weights.items()],
            "conditions": [{"type": "MetricsAvailable", "status": metrics}],
        }
    }


@pytest.mark.parametrize(
    ("weights", "holds"),
    [
        ((1000, 1000, 1, 1), True),  # the A100s carry the load; the 4090 and the CPU at the minimum weight
        ((1000, 820, 279, 1), True),  # the 4090 planned, the CPU not
        ((1000, 1000, 74, 54), True),
        ((1000, 1000, 1, 54), False),  # the CPU above the 4090
        ((1000, 1, 1, 1), False),  # a cold A100 not (yet) above the others
        ((1000, 1000, 400, 0), False),  # the CPU not routed
        ((1000, 1000, 1000, 1000), False),  # round robin's equal weights
        ((1, 1, 1, 1), False),
    ],
)
def test_the_first_claim_follows_the_plan(weights: tuple[int, int, int, int], holds: bool) -> None:
    assert (capacity_order(pool(*weights)) is not None) is holds


def test_the_first_claim_needs_fresh_signals() -> None:
    assert capacity_order(pool(1000, 1000, 400, 100, metrics="False")) is None
    assert capacity_order(pool(1000, 1000, 400, 100)) is not None
