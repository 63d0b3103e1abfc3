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
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from sluice.core.podload import finite

Shown = TypeVar("Shown", int, float)

KV_EVIDENCE = 0.25
"""A reading counts while the KV cache is at least this full: below it, a few requests' partly allocated blocks
make the ratio noisy. Provenance: hand-set, not swept."""
BATCH_GAIN = 0.3
"""How far one reading moves the learned batch (the first reading is taken as it is): the ratio moves with the
prompt mix and with where each running request is in its decode. Provenance: hand-set, not swept."""
RATE_EVIDENCE = 0.2
"""A pod's rate at its limit is read while it runs at least this share of its limit: Little's law scales what it
serves to a full limit, and from a small batch that overshoots (a request's decode steps are shorter in a small
batch), which the readings at a full limit bring back down. Provenance: 0.5 first; in the simulated noisy-tenant
scenario a first reading taken low (14 req/s on A100s serving 25.6, their rate still averaging the idle start)
then held the pods below half their limit, and never rose; at 0.2 it rose to 31 and settled at 25 within 3 min."""
HYSTERESIS = 0.1
"""A limit moves only when the new one differs by more than this share of the one shown: the batch moves a little
with every reading, and a limit that changes every pass would be an object rewritten every pass once enforced.
Provenance: hand-set, not swept."""
LIMIT_HOLD_SECONDS = 60.0
"""A limit shown stays at least this long before it moves (the first one is set at once). Envoy builds a new
cluster for every changed CDS resource, and the new cluster's circuit breaker counts from zero: the requests still
in flight on the old one are not counted, so each change lets up to a whole new limit through on top of them
(real Envoy 1.38 and 1.40: `tests/test_envoy_inbound_limit.py`). On the real data plane a small limit moved by a
request at a time (10 % of 5 is half a request) changed 35 times in 446 s, and its pod ran 36 requests at once
under limits of 4-10 (docs/benchmarks.md, "Admission on the real data plane"); held a minute, 9. Provenance:
hand-set, one change a minute at most: the floor of `limit_hold`."""
HOLD_TURNOVERS = 5.0
"""A limit is held at least this many times the pod's time in system (`limit_hold`): after a change the old
cluster's requests run on uncounted until they finish, about one time in system, so a limit held k of those is
stacked at most 1/k of the time. A minute alone was too short where requests last minutes (agent-heavy at 150 %:
two A100s ran 249 at once under limits of 31-61 each). Provenance: hand-set, then run (docs/benchmarks.md)."""
LIMIT_HOLD_MAX_SECONDS = 600.0
"""The longest hold: a limit wrong for the load is corrected within ten minutes whatever the requests' length."""


def limit_hold(running: float | None, waiting: float | None, served: float | None) -> float:
    """Seconds a pod's limit is held once shown: `HOLD_TURNOVERS` x its time in system (by Little's law, the
    requests in its engine, running and waiting, over the rate it finishes them), between `LIMIT_HOLD_SECONDS` and
    `LIMIT_HOLD_MAX_SECONDS`. Nothing in flight: the floor. Requests in flight and none finished over the window:
    the ceiling (they last longer than the window). No reading of the running count or the rate: the floor — no
    time is invented for a pod that shows none."""
    running, waiting, served = finite(running), finite(waiting), finite(served)
    if running is None or served is None:
        return LIMIT_HOLD_SECONDS
    in_flight = running + max(waiting or 0.0, 0.0)
    if in_flight <= 0:
        return LIMIT_HOLD_SECONDS
    if served <= 0:
        return LIMIT_HOLD_MAX_SECONDS
    return min(LIMIT_HOLD_MAX_SECONDS, max(LIMIT_HOLD_SECONDS, HOLD_TURNOVERS * in_flight / served))


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


SHARE_DOWN = 0.93
"""`admission.ttftTarget`: a pod's share of its batch after a fresh sample whose TTFT p95 is above the target.
Provenance: hand-set (the p95 lags by up to the signals' window, so a step is small and taken per sample)."""
SHARE_UP = 1.03
"""... and after one below `SHARE_SLACK` x the target while its limit binds. Provenance: hand-set, slower up than
down."""
SHARE_SLACK = 0.8
"""The p95 must be this far below the target for the share to rise: between the two the share holds."""
SHARE_RANGE = (0.1, 1.0)
"""Where the share stays: past a full batch a limit no longer binds (the engine queues instead)."""


def steer_share(
    previous: float,
    ttft_p95: float | None,
    binding: bool,
    target: float,
    floor: float = 0.0,
    steps: tuple[float, float] | None = None,
) -> float:
    """The pod's share of its batch after a fresh sample (`admission.ttftTarget`): down while its TTFT p95 is above
    the target, up while its limit binds and the p95 is below `SHARE_SLACK` of it, held otherwise and by a missing
    or non-finite p95 (no evidence, no move); never below `floor` (batchShare) nor outside `SHARE_RANGE` (whose top
    a batchShare above it raises: a target only ever adds room)."""
    down, up = steps or (SHARE_DOWN, SHARE_UP)
    p95 = finite(ttft_p95)
    if p95 is None:
        return previous
    if p95 > target:
        moved = previous * down
    elif binding and p95 < SHARE_SLACK * target:
        moved = previous * up
    else:
        return previous
    low, high = SHARE_RANGE
    return round(min(max(high, floor), max(low, floor, moved)), 4)


def binds(limit: int | None, running: float | None, refused: float | None) -> bool:
    """Whether a pod's limit bound at its last sample: its sidecar refused requests over the window, or its engine
    ran as many requests as the limit."""
    if limit is None:
        return False
    running, refused = finite(running), finite(refused)
    return (refused is not None and refused > 0) or (running is not None and running >= limit)


def inbound_limit(
    batch: float | None, share: float, shown: int | None, least: int = 1, held: bool = False
) -> int | None:
    """The pod's limit: `share` of its learned batch (at least `least`, `admission.minLimit`), or the one shown
    while the new one is within `HYSTERESIS` of it or while it is `held` (shown for less than
    its `limit_hold`); None without a batch."""
    if batch is None:
        return None
    if held and shown is not None:
        return shown
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
    return _class_medians((p.hardware_class, p.batch) for p in pods)


def _class_medians(values: Iterable[tuple[str | None, float | None]]) -> dict[str, float]:
    by_class: dict[str, list[float]] = {}
    for hardware_class, value in values:
        if hardware_class and (value := finite(value)) is not None:
            by_class.setdefault(hardware_class, []).append(value)
    return {name: statistics.median(found) for name, found in by_class.items()}


def _class_shown(
    members: Mapping[str, str | None], classes: Iterable[str], shown: Mapping[str, Shown | None]
) -> dict[str, Shown | None]:
    """Each class's value as the previous status showed it: the one most of its pods showed (the larger on a tie),
    so a pod joining a class takes the class's and the hysteresis is the class's. `members`: pod -> class."""
    out: dict[str, Shown | None] = {}
    for name in classes:
        counts = Counter(value for pod, c in members.items() if c == name and (value := shown.get(pod)) is not None)
        out[name] = max(counts, key=lambda value: (counts[value], value)) if counts else None
    return out


def pod_limits(
    pods: Sequence[PodBatch],
    share: float,
    shown: Mapping[str, int | None],
    least: int = 1,
    shares: Mapping[str, float | None] | None = None,
    held: Collection[str] = (),
) -> dict[str, int | None]:
    """Every pod's limit: `share` of its class's batch (`class_batches`), one limit for the whole class, or of its
    own batch where it has no class. `shown` holds the limits the previous status showed: a class's hysteresis is
    taken from the limit most of its pods showed (the larger on a tie), so a pod joining it takes the class's.
    `shares`: each pod's own share (`steer_share`), in place of `share`; a class takes its pods' median. `held`:
    the pods whose limit was shown for less than their `limit_hold`; a class is held while one of its pods that
    shows the class's limit is."""
    shares = shares or {}
    by_class = class_batches(pods)
    class_share = _class_medians((p.hardware_class, shares.get(p.pod)) for p in pods)
    class_shown = _class_shown({p.pod: p.hardware_class for p in pods}, by_class, shown)
    class_held = {
        p.hardware_class
        for p in pods
        if p.pod in held and p.hardware_class in class_shown and shown.get(p.pod) == class_shown[p.hardware_class]
    }
    class_limits = {
        name: inbound_limit(batch, class_share.get(name, share), class_shown[name], least, name in class_held)
        for name, batch in by_class.items()
    }
    out: dict[str, int | None] = {}
    for p in pods:
        if p.hardware_class and p.hardware_class in class_limits:
            out[p.pod] = class_limits[p.hardware_class]
        else:
            own = finite(shares.get(p.pod))
            out[p.pod] = inbound_limit(p.batch, share if own is None else own, shown.get(p.pod), least, p.pod in held)
    return out


def learn_rate_at_limit(
    previous: float | None, rate: float | None, running: float | None, limit: int | None
) -> float | None:
    """The requests/s the pod serves with its limit full, after this pass's reading: by Little's law its served
    `rate` x `limit` / `running` (a request's time in the engine is running / rate), read while it runs at least
    `RATE_EVIDENCE` of its limit and moved `BATCH_GAIN` of the way (the first reading taken as it is); held
    otherwise, and by a missing or non-finite reading."""
    previous = finite(previous)
    rate, running = finite(rate), finite(running)
    if limit is None or rate is None or running is None or rate <= 0 or running < max(1.0, RATE_EVIDENCE * limit):
        return previous
    reading = rate * limit / running
    if previous is None:
        return reading
    return previous + BATCH_GAIN * (reading - previous)


def rate_limit(measured: float | None, shown: float | None) -> float | None:
    """A pod's admitted rate (requests/s, `admission.tenants`): what it serves with its limit full, or the rate
    shown while that is within `HYSTERESIS` of it (every change is an EnvoyFilter rewritten, and Envoy's buckets
    start again full); None without a reading."""
    measured = finite(measured)
    if measured is None or round(measured, 3) <= 0:
        return None  # below a thousandth of a request a second: no bucket can hold it
    if shown is not None and abs(measured - shown) <= HYSTERESIS * shown:
        return shown
    return round(measured, 3)


@dataclass(frozen=True)
class PodCapacity:
    pod: str
    hardware_class: str | None
    capacity: float | None
    """Requests/s the pod serves with its limit full (`learn_rate_at_limit`); None: not read yet."""


def pod_rates(pods: Sequence[PodCapacity], shown: Mapping[str, float | None]) -> dict[str, float | None]:
    """Every pod's admitted rate: its class's median rate at the limit (one rate per class, as `pod_limits`), or
    its own where it has no class; the hysteresis is the class's (`_class_shown`). Each pod's own rate, not the
    pool's spread as the plan's weights spread requests: tried, and worse where the plan sends a pod more than its
    limit lets through (docs/benchmarks.md, "Tenant shares")."""
    by_class = _class_medians((p.hardware_class, p.capacity) for p in pods)
    class_shown = _class_shown({p.pod: p.hardware_class for p in pods}, by_class, shown)
    class_rates = {name: rate_limit(value, class_shown[name]) for name, value in by_class.items()}
    return {
        p.pod: class_rates[p.hardware_class]
        if p.hardware_class and p.hardware_class in class_rates
        else rate_limit(p.capacity, shown.get(p.pod))
        for p in pods
    }


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
    rate: float | None = None
    """The admitted rate its status row shows (`pod_rates`; only with `admission.tenants`)."""
    refused: float | None = None
    """Requests/s its sidecar refused over the signals' window (Istio's count, the `refusedRate` signal; None:
    not read)."""
    served: float | None = None
    """Requests/s its engine finished over the same window (`requestRate`; None: not read)."""


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
    rates: dict[str, float] = field(default_factory=dict)
    """Hardware class -> the rate its pods' sidecars admit, shared by the tenants (`admission.tenants`)."""
    unshared: tuple[str, ...] = ()
    """Pods with a sidecar and a class but no rate (none read at their limit, nor at their class's): the tenants'
    shares are not enforced on them."""
    refused: dict[str, float] = field(default_factory=dict)
    """Pod -> requests/s its sidecar refused, for the pods whose sidecar sluice configures (a sidecar and a class)
    and whose count was read."""
    served: dict[str, float] = field(default_factory=dict)
    """Pod -> requests/s its engine finished, for the same pods, where read."""
    uncounted: tuple[str, ...] = ()
    """Pods whose sidecar sluice configures with no refusal count read while their engines show traffic (or no
    traffic reading): no Istio series for them (metrics merging off, not scraped), the value refused as
    duplicated, or the query failed. The pool's refusals are unknown while there is one."""

    @property
    def refused_rate(self) -> float | None:
        """Requests/s the pool's sidecars refused; None while a configured sidecar's count is unread."""
        return None if self.uncounted else sum(self.refused.values())

    @property
    def served_rate(self) -> float | None:
        """Requests/s the engines behind those sidecars finished; None while one is unread."""
        configured = set(self.refused) | set(self.uncounted)
        return sum(self.served.values()) if configured <= set(self.served) else None


def enforced_limits(pods: Sequence[PodAdmission], tenants: bool = False) -> Enforcement:
    """One limit per hardware class (the one its pods show: they share it), for classes with at least one pod that
    has a sidecar; every other pod named with the reason it runs without a limit. A class whose pods show different
    limits takes the smallest (cannot happen from `pod_limits`; a lower limit is the safer of two readings). With
    `tenants`, one admitted rate per class the same way, and the pods without one named."""
    limits: dict[str, int] = {}
    rates: dict[str, float] = {}
    unlimited: dict[str, list[str]] = {}
    unshared: list[str] = []
    at_limit: list[str] = []
    refused: dict[str, float] = {}
    served: dict[str, float] = {}
    uncounted: list[str] = []
    read = 0
    for p in sorted(pods, key=lambda p: p.pod):
        if not p.sidecar:
            unlimited.setdefault(NO_SIDECAR, []).append(p.pod)
            continue
        if not p.hardware_class:
            unlimited.setdefault(NO_CLASS, []).append(p.pod)
            continue
        count, finished = finite(p.refused), finite(p.served)
        if count is not None:
            refused[p.pod] = count
        elif finished == 0:
            # Istio makes the pod's series with the first request its sidecar answers: a pod that finished
            # nothing and has none answered nothing, refusals included (one that refused without finishing has the
            # refusals' series, and reads them)
            refused[p.pod] = 0.0
        else:
            uncounted.append(p.pod)
        if finished is not None:
            served[p.pod] = finished
        if p.rate is not None:
            rates[p.hardware_class] = min(rates.get(p.hardware_class, p.rate), p.rate)
        elif tenants:
            unshared.append(p.pod)
        if p.limit is None:
            unlimited.setdefault(NOT_MEASURED, []).append(p.pod)
            continue
        limits[p.hardware_class] = min(limits.get(p.hardware_class, p.limit), p.limit)
        running = finite(p.running)
        if running is not None:
            read += 1
            if running >= p.limit:
                at_limit.append(p.pod)
    return Enforcement(
        limits,
        {why: tuple(names) for why, names in unlimited.items()},
        tuple(at_limit),
        read,
        rates,
        tuple(unshared),
        refused,
        served,
        tuple(uncounted),
    )
