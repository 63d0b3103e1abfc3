"""Weights: scores become the integers Istio carries. Pure.

Endpoint weights are scaled so the best pod gets `maxWeight`, quantised to integers within [minWeight, maxWeight],
and held back by hysteresis so that small changes publish nothing (every publish is an xDS push). Istio turns an
endpoint weight of 0 into 1, so a weight of 0 here always means "remove the endpoint".
"""

from __future__ import annotations

from sluice.api.v1alpha1 import ScoringSpec


def scale(scores: dict[str, float], scoring: ScoringSpec) -> dict[str, int]:
    """Integer weights proportional to the scores, best = maxWeight, none below minWeight."""
    best = max(scores.values(), default=0.0)
    if best <= 0:
        return dict.fromkeys(scores, scoring.min_weight)
    return {
        name: min(scoring.max_weight, max(scoring.min_weight, round(scoring.max_weight * score / best)))
        for name, score in scores.items()
    }


def with_hysteresis(new: int, previous: int | None, percent: float) -> int:
    """Keep the previous weight unless the change exceeds `percent` of it (0 and fresh pods always publish)."""
    if previous is None or previous <= 0 or new <= 0:
        return new
    if abs(new - previous) * 100.0 <= previous * percent:
        return previous
    return new


def ramp(scored: int, percent: float, scoring: ScoringSpec) -> int:
    """A recovering pod's weight: `percent` of what it would get, never below minWeight."""
    return max(scoring.min_weight, round(scored * percent / 100.0))
