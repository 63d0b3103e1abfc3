"""Water-filling: a demand shared over pods so that every loaded pod runs at one latency level, the lowest. Pure.

The model: a pod of capacity μ_i and idle TTFT s_i serves x_i requests/s at T_i(x) = s_i / (1 − x_i/μ_i) (M/M/1),
so at level L it carries x_i = μ_i (1 − s_i/L), none past a cap of its capacity (`water_fill`, `water_level`,
`carried_at`). The headroom plan shares the pool's demand with it (`sluice.core.headroom`), and the weighing of a
zeroing models the others' room with it (`sluice.core.absorb`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def water_fill(
    demand: float, capacity: Sequence[float], idle: Sequence[float], target_utilisation: float
) -> list[float]:
    """Rates x_i adding up to `demand` that give every loaded pod the same latency level L, the lowest possible.

    With T_i(x) = s_i / (1 − x/μ_i), a pod at level L takes x_i = μ_i (1 − s_i/L): the fastest pods (lowest idle
    TTFT) take traffic first and each slower one joins once the level reaches its idle TTFT — water-filling; no
    pod is planned past `target_utilisation` of its capacity while another has room. A pod of zero capacity gets
    nothing; past that utilisation on every pod, shares follow capacity. Minimising the highest latency rather
    than the mean keeps slow pods further from their knee, which is what a P99 sees.
    """
    total = sum(c for c in capacity if c > 0)
    if demand <= 0 or total <= 0:
        return [0.0] * len(capacity)
    if demand >= target_utilisation * total:
        return [demand * c / total if c > 0 else 0.0 for c in capacity]

    def fill(level: float) -> list[float]:
        return [
            min(target_utilisation * c, c * (1.0 - s / level)) if c > 0 and level > s else 0.0
            for c, s in zip(capacity, idle, strict=True)
        ]

    return fill(water_level(demand, capacity, idle, target_utilisation))


def water_level(demand: float, capacity: Sequence[float], idle: Sequence[float], cap: float) -> float:
    """The level L at which `water_fill`'s rates add up to `demand` (< cap × the total capacity), solved exactly;
    idle TTFTs > 0 (what `sluice.core.headroom.plan` passes).

    The total Σ x_i(L) is continuous and rises with L; between two breakpoints (a pod joining at L = s_i, or
    reaching its cap at L = s_i / (1 − cap)) it is a − b/L + held, where a and b sum μ_i and μ_i s_i over the pods
    loaded below their cap and held sums cap × μ_i over the capped ones. Walk the breakpoints in order to the
    segment where the total reaches `demand`, and solve there: L = b / (a + held − demand), kept within the
    segment (the running sums keep rounding residue once pods leave them: on a stretch where every loaded pod is
    capped, a demand within a rounding error of the plateau would otherwise divide residue by residue).
    """
    breakpoints: list[tuple[float, int, float, float]] = []
    for c, s in zip(capacity, idle, strict=True):
        if c > 0:
            breakpoints.append((s, 0, c, s))  # joins
            if cap < 1.0:
                breakpoints.append((s / (1.0 - cap), 1, c, s))  # reaches its cap
    breakpoints.sort()
    a = b = held = low = 0.0
    for level, kind, c, s in breakpoints:
        if level > 0 and a > 0 and a - b / level + held >= demand:
            high = level
            break
        if kind == 0:
            a, b = a + c, b + c * s
        else:
            a, b, held = a - c, b - c * s, held + cap * c
        low = max(low, level)
    else:
        if cap < 1.0:  # every pod at its cap short of `demand`: only rounding gets here (the caller checked)
            return math.inf
        high = math.inf
    span = a + held - demand
    return min(high, max(low, b / span)) if span > 0 else high


def carried_at(level: float, capacity: Sequence[float], idle: Sequence[float], cap: float) -> float:
    """The demand pods of these capacities and idle TTFTs carry at latency level `level` (`water_fill`'s model,
    none past `cap` of its capacity): the inverse of `water_level`."""
    return sum(min(cap * c, c * (1.0 - s / level)) for c, s in zip(capacity, idle, strict=True) if c > 0 and level > s)
