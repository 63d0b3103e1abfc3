"""A pod's evidence for the headroom policy (`PodLoad`) and what it reads as. Pure.

The signals of one pass, sanitised once (`sanitised`: a NaN or infinite value is missing, a KV-cache usage outside
0 to 1 too), are read two ways: the pod's utilisation ρ (`utilisation`: TTFT inflation over its own idle TTFT,
M/M/1, and the waiting queue, M/D/1, the larger kept; the KV-cache usage is a lower bound on it, `KV_ROOM`) and its
idle TTFT (`learn_idle`, a slow low-quantile tracker). What they say of its capacity is `sluice.core.capacity`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

# Provenance: as for the constants of `sluice.core.capacity` (the simulated benchmark only, each says how it was
# set); none is validated on data outside the simulation.

QUEUE_EVIDENCE = 3.0
"""Waiting requests from which the queue is read as utilisation when the pod also has a TTFT reading (without
one, any queue counts). The queue is one scrape sample: an A100 at ρ ≈ 0.6 shows 2 waiting now and then, which
M/D/1 reads as ρ = 0.83, and the max of the two readings kept its learned capacity near 7 of its 9.9 req/s (the
rest spilled to slower pods). Provenance: swept 0 / 2 / 3 / 4 / 6 and TTFT-only (never the queue) on seed-000
and mixed-fleet, 5 seeds (docs/design.md, "What was tried and dropped"); 3 kept: 0 and 2 overfilled the slow
pods below the knee, TTFT-only and 6 reacted late past it."""
KV_ROOM = 0.5
"""KV-cache usage below which a pod's cache shows room for probing. vLLM's KV cache holds the running batch's
context (prompt and generated tokens of every running request), and the batch is rate x time in system (Little's
law) with a time in system that does not fall as the load rises (decode steps lengthen with the batch): usage
grows at least in proportion to the rate and reaches at most 1 at saturation, so a usage u is at most the pod's
utilisation. Hence u >= KV_ROOM proves the pod at least that loaded, and no probing goes on past it; and
rate / u is an upper bound on the capacity (`sluice.core.capacity.estimate`). The converse does not hold: a
compute-bound pod (long prompts) saturates with its cache far from full, so low usage is never read as capacity,
only as leave to probe. Provenance: swept 0.3 / 0.5 with PROBE_ROOM 2 % on seed-000, mixed-fleet and
underdeclared (5 seeds, P99 medians in docs/design.md, "The KV-cache bound"): 0.3 no better at 20-70 %, worse at
90 %; 0.5 kept."""
IDLE_SAMPLES = 30
"""Completions in one window from which a TTFT reading may settle the idle TTFT. Below, the idle TTFT is
provisional: a reading over a larger window replaces it, up or down, and TTFT inflation over it is no reading of
the pod's load (the queue still is). A p95 over a handful of completions is one unlucky or lucky request: an RTX
4090 given 10 requests in its first window read 219 ms, its windows of 40 then 361-378 ms for minutes, and the low
tracker (which rises 0.2 % a pass) read those as 40 % load and learned 1.6 req/s of its 3.6. As the capacity's
`SAMPLES`. Provenance: hand-set, not swept."""
MAX_UTILISATION = 0.98
"""Cap on a reading of ρ, so a saturated pod reads as very loaded, never infinitely. Provenance: hand-set."""
IDLE_DRIFT = 0.002
"""Per pass, the learned idle TTFT may rise by this share towards what is observed (a slowed node's new normal).
Provenance: hand-set, never swept (by arithmetic, a sustained 2x slowdown becomes the new idle in ~350 passes)."""
IDLE_DESCENT = 0.1
"""Per pass, the learned idle TTFT moves this share of the way down to a lower reading (one short-prompt window
cannot set it). Provenance: hand-set, never swept."""


def finite(value: float | None) -> float | None:
    """A signal as evidence: a NaN or infinite value is missing, never a number."""
    return value if value is not None and math.isfinite(value) else None


@dataclass(frozen=True)
class PodLoad:
    """One pod's evidence this pass, and what the status remembers of it."""

    name: str
    prior: float
    """The declared class coefficient K."""
    rate: float | None
    """Completed requests per second over the window."""
    ttft: float | None
    """TTFT p95 over the window (seconds): its inflation over the idle TTFT reads the load."""
    queue: float | None
    running: float | None
    health: float = 1.0
    """The health band's share (errors), applied to the capacity."""
    previous_capacity: float | None = None
    previous_idle: float | None = None
    previous_idle_samples: int | None = None
    """Completions the remembered idle TTFT rests on (its largest window, up to IDLE_SAMPLES); None: remembered
    before this was kept, taken as settled."""
    fresh: bool = True
    """False: no fresh evidence (frozen): the previous capacity is held."""
    kv: float | None = None
    """KV-cache usage, 0 to 1 (one scrape sample): a lower bound on the pod's utilisation (`KV_ROOM`)."""
    hardware_class: str | None = None
    """The pod's hardware class label: pods of one class are one capacity unless they differ beyond the noise
    (`sluice.core.classpool`); None is a class of its own."""


def _fraction(value: float | None) -> float | None:
    """A KV-cache usage as evidence: within 0 to 1, or missing."""
    return value if value is not None and 0.0 <= value <= 1.0 else None


def sanitised(p: PodLoad) -> PodLoad:
    """The pod's signals and memory as evidence (`finite`, `_fraction`): the same object when they already are."""
    rate, ttft, queue, running = finite(p.rate), finite(p.ttft), finite(p.queue), finite(p.running)
    kv, capacity, idle = _fraction(finite(p.kv)), finite(p.previous_capacity), finite(p.previous_idle)
    evidence = (rate, ttft, queue, running, kv, capacity, idle)
    given = (p.rate, p.ttft, p.queue, p.running, p.kv, p.previous_capacity, p.previous_idle)
    if all(a is b for a, b in zip(evidence, given, strict=True)):
        return p  # already evidence (`_load` reads signals through `finite`): no copy
    return replace(
        p, rate=rate, ttft=ttft, queue=queue, running=running, kv=kv, previous_capacity=capacity, previous_idle=idle
    )


def utilisation(ttft: float | None, idle: float | None, queue: float | None) -> float | None:
    """ρ from TTFT inflation (M/M/1) and from the waiting queue (M/D/1); the larger, or None without evidence.

    With a TTFT reading, the queue counts only from `QUEUE_EVIDENCE` waiting requests, also when there is no idle
    TTFT to read the TTFT against (`idle` None: not settled yet, `learn_idle`)."""
    readings = []
    if ttft is not None and idle is not None and ttft > 0:
        readings.append(max(0.0, 1.0 - idle / ttft))
    if queue is not None and queue > 0 and (queue >= QUEUE_EVIDENCE or ttft is None):
        readings.append(-queue + math.sqrt(queue * queue + 2.0 * queue))
    return min(MAX_UTILISATION, max(readings)) if readings else None


def settled(samples: int | None) -> bool:
    """Whether an idle TTFT resting on `samples` completions is settled (`IDLE_SAMPLES`; None: kept before the
    count was, taken as settled)."""
    return samples is None or samples >= IDLE_SAMPLES


def learn_idle(
    ttft: float | None,
    previous: float | None,
    samples: int | None = None,
    previous_samples: int | None = None,
    loaded: bool = False,
) -> tuple[float | None, int | None]:
    """The pod's idle TTFT and the completions it rests on. Settled (`IDLE_SAMPLES`), a slow low-quantile tracker:
    it moves IDLE_DESCENT of the way down to a lower reading and drifts up by IDLE_DRIFT per pass towards a higher
    one, so one short-prompt window cannot set it. Until then, a reading over at least as many completions as it
    rests on replaces it (`samples`: this reading's; None, unknown: as before the count was kept) — upwards only
    from a window that showed no load (`loaded`: a waiting queue or a KV cache past KV_ROOM): an L40S whose first
    large window came from a start-up queue took 788 ms as its idle TTFT, against its class's 150, and read no load
    at five times its idle TTFT after a slowdown."""
    if ttft is None or ttft <= 0:
        return previous, previous_samples
    if previous is None or (
        not settled(previous_samples)
        and samples is not None
        and previous_samples is not None
        and samples >= previous_samples
        and (ttft < previous or not loaded)
    ):
        return ttft, None if samples is None else min(samples, IDLE_SAMPLES)
    kept = (
        previous_samples
        if samples is None or previous_samples is None
        else max(previous_samples, min(samples, IDLE_SAMPLES))
    )
    if ttft < previous:
        return previous + IDLE_DESCENT * (ttft - previous), kept
    return min(ttft, previous * (1.0 + IDLE_DRIFT)), kept
