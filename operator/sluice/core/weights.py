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


def slew(previous: dict[str, int], wanted: dict[str, int], most: float, max_weight: int) -> dict[str, int]:
    """`wanted`, or as far toward it from `previous` as moves at most `most` of the traffic (the shares' total
    variation), in `wanted`'s units; none above `max_weight`, none below 1. Same keys in both."""
    before, after = sum(previous.values()), sum(wanted.values())
    if before <= 0 or after <= 0:
        return wanted
    moved = 0.5 * sum(abs(wanted[n] / after - previous[n] / before) for n in wanted)
    if moved <= most:
        return wanted
    step = most / moved
    shares = {n: previous[n] / before + step * (wanted[n] / after - previous[n] / before) for n in wanted}
    top = max(shares.values())
    unit = min(float(after), max_weight / top)
    return {n: max(1, round(unit * share)) for n, share in shares.items()}
