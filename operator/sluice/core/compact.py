"""The status as stored: a large pool's status fits in etcd. Pure.

A full row is ~430 bytes, so a 4,096-pod pool (the ServiceEntry endpoint limit) would store 1.8 MB, over etcd's
1.5 MiB request limit, and ship all of it to every watcher on every write. Pools of up to `FULL_ROWS_UP_TO` pods
keep a row per pod. Larger pools keep a row for every pod that is not plainly Routable (capped at `MAX_ROWS`,
the most serious first) and a sample of the lowest and highest weights; every pod is counted in
`endpointSummary`; the pods without a row keep their memory in `podMemory` (`sluice.api.memory`). The pass
itself always works on every row (`sluice.api.memory.remembered`), so compaction changes what is stored and
shown, never what is decided. Called by the runtime before it writes a status.
"""

from __future__ import annotations

from collections import Counter

from sluice.api.memory import encode, remembered
from sluice.api.v1alpha1 import EndpointStatus, EndpointSummary, InferencePoolStatus, WeightBucket

FULL_ROWS_UP_TO = 64
MAX_ROWS = 240
SAMPLE = 16
BUCKETS = 10
_STATE_RANK = {"Zeroed": 0, "Recovering": 1, "Routable": 2}


def plainly_routable(row: EndpointStatus) -> bool:
    """Routed on its own score with nothing to report: such a pod needs no row of its own."""
    return (
        row.state == "Routable"
        and row.verdict == "scored"
        and row.weight > 0
        and not row.floor_held
        and row.consecutive_failures == 0
        and not row.missing_signals
        and row.class_known
    )


def stored_form(status: InferencePoolStatus) -> InferencePoolStatus:
    """The status to write: unchanged for small pools; rows, summary and compact memory for large ones."""
    rows = sorted(remembered(status).values(), key=lambda r: r.pod)
    if len(rows) <= FULL_ROWS_UP_TO:
        return status.model_copy(update={"endpoints": rows, "endpoint_summary": None, "pod_memory": None})
    plain = [r for r in rows if plainly_routable(r)]
    other = sorted(
        (r for r in rows if not plainly_routable(r)),
        key=lambda r: (_STATE_RANK.get(r.state, 0), not r.floor_held, r.pod),
    )
    listed = other[:MAX_ROWS]
    by_weight = sorted(plain, key=lambda r: (r.weight, r.pod))
    half = SAMPLE // 2
    sample = by_weight if len(by_weight) <= SAMPLE else by_weight[:half] + by_weight[-half:]
    shown = {r.pod for r in listed} | {r.pod for r in sample}
    kept = sorted([*listed, *sample], key=lambda r: r.pod)
    memory = [r for r in rows if r.pod not in shown]
    summary = EndpointSummary(
        pods=len(rows),
        listed=len(kept),
        aggregated=len(plain) - len(sample),
        unlisted=len(other) - len(listed),
        by_state=dict(sorted(Counter(r.state for r in rows).items())),
        by_verdict=dict(sorted(Counter(r.verdict or "-" for r in rows).items())),
        by_class=dict(sorted(Counter(r.hardware_class or "-" for r in rows).items())),
        by_revision=dict(sorted(Counter(r.revision or "-" for r in rows).items())),
        weights=weight_histogram([r.weight for r in rows if r.weight > 0]),
    )
    return status.model_copy(update={"endpoints": kept, "endpoint_summary": summary, "pod_memory": encode(memory)})


def weight_histogram(weights: list[int]) -> list[WeightBucket]:
    """Up to `BUCKETS` equal-width buckets from the lowest to the highest weight; empty buckets left out."""
    if not weights:
        return []
    low, high = min(weights), max(weights)
    width = max(1, -(-(high - low + 1) // BUCKETS))
    counts = Counter((w - low) // width for w in weights)
    return [
        WeightBucket(low=low + i * width, high=min(high, low + (i + 1) * width - 1), pods=n)
        for i, n in sorted(counts.items())
    ]
