"""Pods of one hardware class planned as the class while they differ only by noise. Pure.

Identical pods learn capacities, idle TTFTs and times in system that differ by their windows' request mixes alone
(`RATE_NOISE`): a pod within the noise of its class's median is planned with the class's values (`pool_by_class`,
`pooled_values`), one beyond it (throttled, mislabelled, slowed down) with its own. Called by `sluice.core.headroom`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.core.capacity import INFORMATIVE, LEARNED_SOURCES, Estimate
from sluice.core.podload import PodLoad

# Provenance: as for the constants of `sluice.core.capacity`; none is validated on data outside the simulation.

RATE_NOISE = 2.0
"""Relative noise of a learned capacity, times 1/sqrt(n) for n completions in the window: identical pods learn
capacities that differ by this much from their window's request mix alone. Measured on homogeneous-tuning (five
identical L40S, Azure lengths) and four identical H100s on the same lengths (an ad-hoc copy), seed 44 at 90 and
110 %: the median over the measured window's passes of the spread (coefficient of variation) of the learned
capacities across the pods was 1.25-2.2 times 1/sqrt(n). Provenance: set from that measurement, not swept."""
POOL_WITHIN = 2.0
"""A pod whose learned capacity is within this many noise units (`RATE_NOISE`) of its hardware class's median is
planned at the class's median; beyond twice this its own value stands (a throttled or mislabelled pod keeps what
it showed), linearly in between. Provenance: hand-set (2 and 4 noise units), not swept."""


@dataclass(frozen=True)
class Pooling:
    """How far one pod is planned as its hardware class rather than on its own evidence (`pool_by_class`)."""

    share: float
    """0 to 1: the share of each planned quantity taken from the class's median."""
    members: tuple[str, ...]
    """The class's pods with a fresh learned capacity (this one included)."""


def pool_by_class(pods: Sequence[PodLoad], estimates: dict[str, Estimate], window: float) -> dict[str, Pooling]:
    """Which fresh learned pods are planned as their hardware class, and how far (classes of two or more).

    Identical pods learn unequal capacities, idle TTFTs and times in system from their windows' request mixes
    (`RATE_NOISE`), and the plan then gives them unequal weights: at overload the pods weighted higher hold
    proportionally more of the queue (Envoy's least-request keeps active ∝ weight), and the pool's P99 is theirs.
    So a pod whose learned capacity is within `POOL_WITHIN` noise units of its class's median (over the class's
    fresh learned capacities) is planned with the class's medians; one beyond twice that keeps its own (a throttled
    or mislabelled pod is not hidden by its siblings), linearly in between. A noise unit is `RATE_NOISE` / sqrt(n),
    relative to the median, n the pod's completions in the window (none: no evidence of its own, the class's
    value); the distance is the larger of its learned capacity's and this pass's measurement's (rate / ρ), so a
    node that just slowed down is on its own from its first reading; a pod with only a prior takes its class's
    learned median. Frozen pods and pods without a class label are left as they are.
    """
    classes: dict[str, list[PodLoad]] = {}
    for p in pods:
        if p.fresh and p.hardware_class is not None and estimates[p.name].source in (*LEARNED_SOURCES, "prior"):
            classes.setdefault(p.hardware_class, []).append(p)
    out: dict[str, Pooling] = {}
    for members in classes.values():
        learned = [p for p in members if estimates[p.name].source != "prior"]
        if len(members) < 2 or not learned:
            continue
        median = statistics.median(estimates[p.name].capacity for p in learned)
        if median <= 0:
            continue
        names = tuple(p.name for p in learned)
        for p in members:
            if estimates[p.name].source == "prior":
                out[p.name] = Pooling(1.0, names)  # nothing learned of its own: its class's value
                continue
            completions = (p.rate or 0.0) * window
            noise = RATE_NOISE / math.sqrt(completions) if completions >= 1 else math.inf
            # What it learned, and what this pass measured (rate / ρ), the further from the class: a node that
            # just slowed down shows it in its reading before its learned capacity has moved.
            readings = [estimates[p.name].capacity]
            rho = estimates[p.name].utilisation
            if p.rate and rho is not None and rho >= INFORMATIVE:
                readings.append(p.rate / rho)
            units = max(abs(r / median - 1.0) for r in readings) / noise
            out[p.name] = Pooling(min(1.0, max(0.0, 2.0 - units / POOL_WITHIN)), names)
    return out


def pooled_values(pooling: dict[str, Pooling], values: dict[str, float]) -> dict[str, float]:
    """`values` with each pooled pod's moved its pooling share of the way to its class's median (over the class
    members that have a value); the others as they are."""
    out = dict(values)
    medians: dict[int, float | None] = {}
    """A class's median, once per class: `pool_by_class` gives every pod of a class the same members tuple (keyed
    by identity: hashing a 4,096-name tuple per pod would cost more than the median)."""
    for name, pool in pooling.items():
        if name not in values or pool.share <= 0:
            continue
        key = id(pool.members)
        if key not in medians:
            known = [values[m] for m in pool.members if m in values]
            medians[key] = statistics.median(known) if known else None
        median = medians[key]
        if median is not None:
            out[name] = values[name] + pool.share * (median - values[name])
    return out
