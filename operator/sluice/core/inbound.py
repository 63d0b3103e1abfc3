"""Per-pod inbound limits from evidence: the requests an engine's KV cache holds when it is full. Pure.

vLLM runs as many requests as its KV cache (and `max_num_seqs`) allow; the rest wait in its queue. The cache a
pod's running requests fill says how many of them a full cache holds: `running / kv_cache_usage`, readable at any
load once the cache is used enough to measure (`KV_EVIDENCE`). A pod's limit — the requests its sidecar lets
through to the engine at once, refusing the rest with a 503 the caller's Envoy retries on another pod
(docs/design.md, "Where a refusal can be made") — is a share of that batch.

Why not the running count while requests wait (what an engine holds when saturated, read directly; built first):
once a limit below the batch is enforced, the engine's queue no longer forms — the sidecar refuses first — so the
reading that would raise a low limit never comes, and a burst that queued for the prefill budget before the cache
was full reads low. Enforced in the simulation, such limits refused 10.0-39.7 % at 80 % load on a fleet of five
identical pods (docs/benchmarks.md). The cache's fill is read whether or not the limit binds.

Pods of one hardware class share one limit (`pod_limits`: their class's median batch): a sidecar's limit is
rendered per class, and a pod of a class with a batch has a limit from its first pass rather than from its own
first readings. A pod with neither a batch of its own nor a class with one has no limit: nothing shows what it
can hold (a capacity that is only a prior is not evidence). Called by `sluice.core.rows` and `sluice.core.reconcile`.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sluice.core.podload import finite

KV_EVIDENCE = 0.25
"""A reading counts while the KV cache is at least this full: below it, a few requests' partly allocated blocks
make the ratio noisy. Provenance: hand-set, not swept."""
BATCH_GAIN = 0.3
"""How far one reading moves the learned batch (the first reading is taken as it is): the ratio moves with the
prompt mix and with where each running request is in its decode. Provenance: hand-set, not swept."""
HYSTERESIS = 0.1
"""A limit moves only when the new one differs by more than this share of the one shown: the batch moves a little
with every reading, and a limit that changes every pass would be an object rewritten every pass once enforced.
Provenance: hand-set, not swept."""


def learn_batch(previous: float | None, running: float | None, kv_usage: float | None) -> float | None:
    """The batch after this pass's reading: moved towards `running / kv_usage` while the cache is at least
    `KV_EVIDENCE` full and something runs; held otherwise, and by a missing or non-finite reading."""
    previous = finite(previous)
    running, kv_usage = finite(running), finite(kv_usage)
    if running is None or kv_usage is None or kv_usage < KV_EVIDENCE or running < 1:
        return previous
    reading = running / min(kv_usage, 1.0)
    if previous is None:
        return reading
    return previous + BATCH_GAIN * (reading - previous)


def inbound_limit(batch: float | None, share: float, shown: int | None, least: int = 1) -> int | None:
    """The pod's limit: `share` of its learned batch (at least `least`, `admission.minLimit`), or the one shown
    while the new one is within `HYSTERESIS` of it; None without a batch."""
    if batch is None:
        return None
    limit = max(least, math.floor(share * batch))
    if shown is not None and abs(limit - shown) <= HYSTERESIS * shown:
        return shown
    return limit


@dataclass(frozen=True)
class PodBatch:
    pod: str
    hardware_class: str | None
    """None, or "" (a label with an empty value, which no EnvoyFilter selector should rely on): no class."""
    batch: float | None
    """The pod's own learned batch (`learn_batch`)."""


def class_batches(pods: Sequence[PodBatch]) -> dict[str, float]:
    """Each hardware class's batch: the median of its pods' learned batches (classes with none are absent)."""
    batches: dict[str, list[float]] = {}
    for p in pods:
        if p.hardware_class and p.batch is not None:
            batches.setdefault(p.hardware_class, []).append(p.batch)
    return {name: statistics.median(values) for name, values in batches.items()}


def pod_limits(
    pods: Sequence[PodBatch], share: float, shown: Mapping[str, int | None], least: int = 1
) -> dict[str, int | None]:
    """Every pod's limit: `share` of its class's batch (`class_batches`), one limit for the whole class, or of its
    own batch where it has no class. `shown` holds the limits the previous status showed: a class's hysteresis is
    taken from the limit most of its pods showed (the larger on a tie), so a pod joining it takes the class's."""
    by_class = class_batches(pods)
    class_shown: dict[str, int | None] = {}
    for name in by_class:
        counts = Counter(limit for p in pods if p.hardware_class == name and (limit := shown.get(p.pod)) is not None)
        class_shown[name] = max(counts, key=lambda limit: (counts[limit], limit)) if counts else None
    class_limits = {name: inbound_limit(batch, share, class_shown[name], least) for name, batch in by_class.items()}
    out: dict[str, int | None] = {}
    for p in pods:
        if p.hardware_class and p.hardware_class in class_limits:
            out[p.pod] = class_limits[p.hardware_class]
        else:
            out[p.pod] = inbound_limit(p.batch, share, shown.get(p.pod), least)
    return out


@dataclass(frozen=True)
class PodAdmission:
    """A pod as enforcement sees it (`enforced_limits`)."""

    pod: str
    hardware_class: str | None
    limit: int | None
    """The limit its status row shows (`pod_limits`)."""
    sidecar: bool
    """It runs an Istio sidecar (`security.istio.io/tlsMode: istio`, set by injection): a waypoint or no proxy
    at all has no inbound cluster for a limit to live on."""
    running: float | None = None
    """The requests its engine ran at its last scrape (None: no reading)."""


NOT_MEASURED = "no batch read yet (its KV cache never a quarter full), nor any pod of its class"
NO_CLASS = "no hardware-class label to select its sidecar by"
NO_SIDECAR = "no sidecar to enforce it"


@dataclass(frozen=True)
class Enforcement:
    limits: dict[str, int]
    """Hardware class -> the limit rendered on its pods' sidecars."""
    unlimited: dict[str, tuple[str, ...]]
    """Why -> the pods admitted without a limit (`NOT_MEASURED`, `NO_CLASS`, `NO_SIDECAR`)."""
    at_limit: tuple[str, ...] = ()
    """Pods with a limit whose engine ran at least that many requests at its last scrape: their sidecars were
    refusing what came past it (a sampled sign of shedding, not a count of refusals)."""
    read: int = 0
    """Pods with a limit and a running count to compare with it."""


def enforced_limits(pods: Sequence[PodAdmission]) -> Enforcement:
    """One limit per hardware class (the one its pods show: they share it), for classes with at least one pod that
    has a sidecar; every other pod named with the reason it runs without a limit. A class whose pods show different
    limits takes the smallest (cannot happen from `pod_limits`; a lower limit is the safer of two readings)."""
    limits: dict[str, int] = {}
    unlimited: dict[str, list[str]] = {}
    at_limit: list[str] = []
    read = 0
    for p in sorted(pods, key=lambda p: p.pod):
        if not p.sidecar:
            unlimited.setdefault(NO_SIDECAR, []).append(p.pod)
        elif not p.hardware_class:
            unlimited.setdefault(NO_CLASS, []).append(p.pod)
        elif p.limit is None:
            unlimited.setdefault(NOT_MEASURED, []).append(p.pod)
        else:
            limits[p.hardware_class] = min(limits.get(p.hardware_class, p.limit), p.limit)
            running = finite(p.running)
            if running is not None:
                read += 1
                if running >= p.limit:
                    at_limit.append(p.pod)
    return Enforcement(limits, {why: tuple(names) for why, names in unlimited.items()}, tuple(at_limit), read)
