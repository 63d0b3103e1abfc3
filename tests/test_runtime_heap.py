"""The garbage collector's time as a metric, and the heap keeper that freezes long-lived state."""

from __future__ import annotations

import gc
import time
import weakref

from prometheus_client import CollectorRegistry, generate_latest

from sluice.runtime.heap import HeapKeeper, compact
from sluice.runtime.metrics import GcPauses


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_gc_pauses_count_the_collections_that_ran_and_are_exported() -> None:
    pauses = GcPauses()
    pauses.install()
    try:
        gc.collect()
        gc.collect(0)
    finally:
        pauses.uninstall()
    assert pauses.collections[2] >= 1
    assert pauses.collections[0] >= 1
    assert pauses.seconds[2] > 0
    counted = pauses.collections[2]
    gc.collect()  # uninstalled: no longer counted
    assert pauses.collections[2] == counted
    registry = CollectorRegistry()
    registry.register(pauses)
    page = generate_latest(registry).decode()
    assert 'sluice_gc_pause_seconds_total{generation="2"}' in page
    assert f'sluice_gc_collections_total{{generation="2"}} {float(counted)}' in page


def test_compact_collects_cyclic_garbage_before_freezing_the_survivors() -> None:
    try:
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # a cycle: only the collector frees it
        dead = weakref.ref(a)
        kept = _Node()
        del a, b
        frozen = compact()
        assert dead() is None  # collected, not frozen alive
        assert frozen == gc.get_freeze_count() > 0
        assert kept is not None
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_the_keeper_compacts_on_its_schedule_and_unfreezes_when_stopped() -> None:
    before = gc.get_threshold()
    keeper = HeapKeeper(first=0.05, every=0.05, gen0_threshold=50_000)
    keeper.start()
    try:
        assert gc.get_threshold() == (50_000, before[1], before[2])
        deadline = time.monotonic() + 5
        while keeper.rounds < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        keeper.stop()
    assert keeper.rounds >= 2
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == before
