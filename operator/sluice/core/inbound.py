"""Per-pod inbound limits from evidence: what each engine runs at once when it is saturated. Pure.

vLLM runs as many requests as its KV cache and `max_num_seqs` allow; the rest wait in its queue. So whenever
requests wait, the running count is the batch the engine holds at its capacity (its capacity x its time in system,
read directly). A pod's limit — the requests its sidecar would let through to the engine at once, refusing the
rest with a 503 the caller's Envoy retries on another pod (docs/design.md, "Where a refusal can be made") — is a
share of that batch. A pod never seen with requests waiting has no batch and no limit: nothing shows what it can
hold. Called by `sluice.core.rows` (status only: `admission.mode: Report`).
"""

from __future__ import annotations

import math

from sluice.core.podload import QUEUE_EVIDENCE, finite

BATCH_GAIN = 0.3
"""How far one reading taken while requests wait moves the learned batch (the first reading is taken as it is).
The running count is one scrape sample and moves with the prompt mix (a long-prompt window holds fewer requests in
the same KV cache). Provenance: hand-set, not swept."""
HYSTERESIS = 0.1
"""A limit moves only when the new one differs by more than this share of the one shown: the batch moves a little
with every reading, and a limit that changes every pass would be an object rewritten every pass once enforced.
Provenance: hand-set, not swept."""


def learn_batch(previous: float | None, running: float | None, queue: float | None) -> float | None:
    """The batch after this pass's reading: moved towards the running count while at least `QUEUE_EVIDENCE`
    requests wait (the engine could take no more); held otherwise, and by a missing or non-finite reading."""
    previous = finite(previous)
    running, queue = finite(running), finite(queue)
    if running is None or queue is None or queue < QUEUE_EVIDENCE or running < 1:
        return previous
    if previous is None:
        return running
    return previous + BATCH_GAIN * (running - previous)


def inbound_limit(batch: float | None, share: float, shown: int | None) -> int | None:
    """The pod's limit: `share` of its learned batch (at least 1), or the one shown while the new one is within
    `HYSTERESIS` of it; None without a batch."""
    if batch is None:
        return None
    limit = max(1, math.floor(share * batch))
    if shown is not None and abs(limit - shown) <= HYSTERESIS * shown:
        return shown
    return limit
