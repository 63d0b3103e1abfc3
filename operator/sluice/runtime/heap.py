"""The operator's heap and Python's garbage collector: long-lived state out of every full collection.

At 1000 pools the operator keeps about a million tracked objects alive for good (kopf's per-object memories, the
pod cache, the last statuses). A full collection walks all of them (0.6-0.8 s each there), and CPython starts one
whenever a quarter as many objects again have survived since the last, which steady passes reach in seconds.
`HeapKeeper` runs one full collection and then freezes what survived (`gc.freeze()`: the permanent generation,
which automatic collections skip), shortly after start-up and again every `every` seconds after unfreezing, so
automatic full collections walk only what is younger than the last freeze. Garbage in reference cycles among
frozen objects waits for the next round (at most `every` seconds); objects without cycles are freed by their
reference counts as always. Its time shows in `sluice_gc_pause_seconds_total` like any collection's.

It also raises the youngest generation's threshold from CPython's 700 allocations to `GEN0_THRESHOLD`: decoding
one namespace-wide Prometheus answer over 16,000 pods allocates ~48,000 containers, so with the default the
young generation is collected about seventy times inside every decode (48,000 / 700), its survivors walked again
each time (docs/scale.md has the measurements).
"""

from __future__ import annotations

import gc
import logging
import threading

log = logging.getLogger("sluice")

GEN0_THRESHOLD = 100_000
"""Allocations between two collections of the youngest generation while the keeper runs (CPython: 700). Chosen
above one 16,000-pod answer's ~48,000 containers; 25,000 still spent ~1.2 s per 60 decodes in young collections
in the experiment that chose it (against 0.02 s at 100,000), against a million long-lived objects."""


def compact() -> int:
    """One round: unfreeze, collect everything, freeze the survivors. Returns how many objects are frozen."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class HeapKeeper:
    """`compact()` after `first` seconds and then every `every` seconds, on a daemon thread, until `stop()`."""

    def __init__(self, first: float = 60.0, every: float = 300.0, gen0_threshold: int = GEN0_THRESHOLD) -> None:
        self.first = first
        self.every = every
        self.gen0_threshold = gen0_threshold
        self.rounds = 0
        self._thresholds: tuple[int, int, int] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sluice-heap", daemon=True)

    def start(self) -> None:
        self._thresholds = gc.get_threshold()
        _, middle, oldest = self._thresholds
        gc.set_threshold(max(self.gen0_threshold, self._thresholds[0]), middle, oldest)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        gc.unfreeze()
        if self._thresholds is not None:
            gc.set_threshold(*self._thresholds)
            self._thresholds = None

    def _run(self) -> None:
        wait = self.first
        while not self._stop.wait(wait):
            frozen = compact()
            self.rounds += 1
            log.debug("heap compacted: %d objects frozen", frozen)
            wait = self.every
