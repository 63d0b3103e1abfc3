"""The pod cache fed by the pod watch: a selector finds exactly the pods a label-selector list would."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes import client as k8s

from sluice.io.kube import ClusterError, KubeCluster
from sluice.runtime.podcache import PodCache


def pod(name: str, labels: dict[str, str], ready: bool = True, ip: str = "10.0.0.1") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": labels},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_a_selector_matches_every_label_in_its_namespace_only():
    cache = PodCache()
    cache.put("llm", pod("a-1", {"app": "a", "tier": "gpu"}))
    cache.put("llm", pod("a-2", {"app": "a", "tier": "cpu"}))
    cache.put("llm", pod("b-1", {"app": "b", "tier": "gpu"}))
    cache.put("other", pod("a-9", {"app": "a", "tier": "gpu"}))
    assert [p.name for p in cache.select("llm", {"app": "a"})] == ["a-1", "a-2"]
    assert [p.name for p in cache.select("llm", {"app": "a", "tier": "gpu"})] == ["a-1"]
    assert [p.name for p in cache.select("llm", {"app": "c"})] == []
    assert [p.name for p in cache.select("llm", {})] == ["a-1", "a-2", "b-1"]


def test_an_event_replaces_the_pod_and_its_labels_and_a_deletion_removes_it():
    cache = PodCache()
    cache.put("llm", pod("a-1", {"app": "a"}))
    cache.put("llm", pod("a-1", {"app": "b"}, ready=False))
    assert cache.select("llm", {"app": "a"}) == []
    (moved,) = cache.select("llm", {"app": "b"})
    assert not moved.ready
    cache.drop("llm", "a-1")
    assert cache.select("llm", {"app": "b"}) == []
    assert len(cache) == 0
    cache.drop("llm", "a-1")  # a second DELETED is harmless


class CountingCore:
    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items
        self.lists: list[dict[str, Any]] = []
        self.during_list: Any = None

    def list_namespaced_pod(self, namespace: str, **kwargs: Any) -> Any:
        self.lists.append({"namespace": namespace, **kwargs})
        if self.during_list is not None:
            self.during_list()
        return SimpleNamespace(data=json.dumps({"items": self.items}).encode())


def test_the_first_pass_in_a_namespace_lists_it_once_then_the_watch_keeps_the_cache():
    cluster = KubeCluster(k8s.ApiClient())
    core = CountingCore([pod("a-1", {"app": "a"}), pod("b-1", {"app": "b"})])
    cluster.core = core  # type: ignore[assignment]
    cluster.pod_cache = cache = PodCache()
    assert [p.name for p in cluster.pods("llm", {"app": "a"})] == ["a-1"]
    assert [p.name for p in cluster.pods("llm", {"app": "b"})] == ["b-1"]
    assert len(core.lists) == 1
    assert "label_selector" not in core.lists[0]  # the whole namespace, once
    cache.put("llm", pod("a-2", {"app": "a"}))  # the watch
    cache.drop("llm", "a-1")
    assert [p.name for p in cluster.pods("llm", {"app": "a"})] == ["a-2"]
    assert len(core.lists) == 1
    cluster.pods("other", {"app": "a"})
    assert len(core.lists) == 2  # another namespace is seeded on its own


def test_what_the_watch_said_during_the_seeding_list_wins_over_the_list():
    cluster = KubeCluster(k8s.ApiClient())
    core = CountingCore([pod("a-1", {"app": "a"}), pod("a-2", {"app": "a"}, ready=True)])
    cluster.core = core  # type: ignore[assignment]
    cluster.pod_cache = cache = PodCache()

    def watch_meanwhile() -> None:
        cache.drop("llm", "a-1")  # deleted while the list was in flight
        cache.put("llm", pod("a-2", {"app": "a"}, ready=False))  # and a-2 turned unready

    core.during_list = watch_meanwhile
    (left,) = cluster.pods("llm", {"app": "a"})
    assert left.name == "a-2"
    assert not left.ready


def test_without_a_cache_every_call_lists_by_selector():
    cluster = KubeCluster(k8s.ApiClient())
    core = CountingCore([pod("a-1", {"app": "a"})])
    cluster.core = core  # type: ignore[assignment]
    cluster.pods("llm", {"app": "a"})
    cluster.pods("llm", {"app": "a"})
    assert [c["label_selector"] for c in core.lists] == ["app=a", "app=a"]


def test_passes_starting_together_in_a_namespace_list_it_once():
    cluster = KubeCluster(k8s.ApiClient())
    core = CountingCore([pod("a-1", {"app": "a"})])
    core.during_list = lambda: time.sleep(0.2)  # a slow list: the other passes arrive meanwhile
    cluster.core = core  # type: ignore[assignment]
    cluster.pod_cache = PodCache()
    with ThreadPoolExecutor(max_workers=8) as workers:
        found = list(workers.map(lambda _: cluster.pods("llm", {"app": "a"}), range(8)))
    assert len(core.lists) == 1
    assert all([p.name for p in pods] == ["a-1"] for pods in found)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_pod_deleted_while_the_watch_was_down_is_dropped_at_the_periodic_reseed():
    clock = Clock()
    cluster = KubeCluster(k8s.ApiClient())
    core = CountingCore([pod("a-1", {"app": "a"}), pod("a-2", {"app": "a"})])
    cluster.core = core  # type: ignore[assignment]
    cluster.pod_cache = cache = PodCache(reseed_seconds=300, clock=clock)
    assert [p.name for p in cluster.pods("llm", {"app": "a"})] == ["a-1", "a-2"]
    core.items = [pod("a-2", {"app": "a"})]  # a-1 went while the watch was down: no DELETED event came
    clock.now += 299
    assert [p.name for p in cluster.pods("llm", {"app": "a"})] == ["a-1", "a-2"]
    assert len(core.lists) == 1
    core.during_list = lambda: cache.put("llm", pod("a-3", {"app": "a"}))  # the watch, while the reseed lists
    clock.now += 1
    assert [p.name for p in cluster.pods("llm", {"app": "a"})] == ["a-2", "a-3"]
    assert len(core.lists) == 2
    assert "label_selector" not in core.lists[1]
    assert [p.name for p in cluster.pods("llm", {"app": "a"})] == ["a-2", "a-3"]
    assert len(core.lists) == 2  # the next reseed is 300 s after this one


def test_a_relisting_by_the_watch_brings_the_reseed_forward():
    clock = Clock()
    cluster = KubeCluster(k8s.ApiClient())
    core = CountingCore([pod("a-1", {"app": "a"}), pod("a-2", {"app": "a"})])
    cluster.core = core  # type: ignore[assignment]
    cluster.pod_cache = cache = PodCache(reseed_seconds=300, relist_gap=30, clock=clock)
    cluster.pods("llm", {"app": "a"})
    core.items = [pod("a-2", {"app": "a"})]
    clock.now += 40
    cache.put("llm", pod("a-2", {"app": "a"}), listing=True)  # kopf listed again after a watch error
    assert [p.name for p in cluster.pods("llm", {"app": "a"})] == ["a-2"]
    assert len(core.lists) == 2
    clock.now += 1
    cache.put("llm", pod("a-2", {"app": "a"}), listing=True)  # the rest of the same relisting, after the reseed
    clock.now += 9
    cluster.pods("llm", {"app": "a"})
    assert len(core.lists) == 2  # not again within 30 s of the last seed
    clock.now += 20
    cluster.pods("llm", {"app": "a"})
    assert len(core.lists) == 3


def test_a_reseed_under_way_does_not_hold_the_other_passes():
    clock = Clock()
    cluster = KubeCluster(k8s.ApiClient())
    core = CountingCore([pod("a-1", {"app": "a"})])
    cluster.core = core  # type: ignore[assignment]
    cluster.pod_cache = PodCache(reseed_seconds=300, clock=clock)
    cluster.pods("llm", {"app": "a"})
    clock.now += 300
    listing, release = threading.Event(), threading.Event()

    def held_list() -> None:  # the reseed's list stays on the wire until the other passes have answered
        listing.set()
        assert release.wait(timeout=30)

    core.during_list = held_list
    with ThreadPoolExecutor(max_workers=4) as workers:
        reseeding = workers.submit(cluster.pods, "llm", {"app": "a"})
        assert listing.wait(timeout=30)
        others = [workers.submit(cluster.pods, "llm", {"app": "a"}) for _ in range(3)]
        answered = [[p.name for p in f.result(timeout=30)] for f in others]  # would time out behind the list
        release.set()
        reseeding.result(timeout=30)
    assert answered == [["a-1"]] * 3
    assert len(core.lists) == 2


def test_a_seed_drops_the_pods_neither_listed_nor_touched_by_the_watch_since_it_began():
    cache = PodCache()
    cache.begin_seed("llm")
    cache.finish_seed("llm", [pod("a-1", {"app": "a"}), pod("a-2", {"app": "a"})])
    cache.begin_seed("llm")
    cache.put("llm", pod("a-3", {"app": "a"}))  # created after the list was read
    cache.finish_seed("llm", [pod("a-2", {"app": "a"})])
    assert [p.name for p in cache.select("llm", {})] == ["a-2", "a-3"]


def unavailable() -> None:
    """A pod list the API server refuses (busy)."""
    raise k8s.ApiException(status=503, reason="Service Unavailable")


def test_a_reseed_that_fails_leaves_the_cache_answering_and_is_tried_again_after_the_relist_gap():
    """A failed reseed list (the API server busy) must not fail the pass — the watch keeps the cache current; the
    reseed only drops pods deleted while the watch was down — nor stop the namespace's later reseeds."""
    clock = Clock()
    cluster = KubeCluster(k8s.ApiClient())
    core = CountingCore([pod("a-1", {"app": "a"}), pod("a-2", {"app": "a"})])
    cluster.core = core  # type: ignore[assignment]
    cluster.pod_cache = PodCache(reseed_seconds=300, relist_gap=30, clock=clock)
    cluster.pods("llm", {"app": "a"})
    clock.now += 300

    core.during_list = unavailable
    assert [p.name for p in cluster.pods("llm", {"app": "a"})] == ["a-1", "a-2"]
    assert len(core.lists) == 2
    core.during_list = None
    core.items = [pod("a-2", {"app": "a"})]  # a-1 went while the watch was down
    clock.now += 29
    assert [p.name for p in cluster.pods("llm", {"app": "a"})] == ["a-1", "a-2"]
    assert len(core.lists) == 2  # not at every pass: a busy API server is not asked again at once
    clock.now += 1
    assert [p.name for p in cluster.pods("llm", {"app": "a"})] == ["a-2"]
    assert len(core.lists) == 3
    clock.now += 299
    cluster.pods("llm", {"app": "a"})
    assert len(core.lists) == 3  # the next reseed 300 s after the one that succeeded


def test_a_first_seed_that_fails_fails_the_pass_and_the_next_pass_lists_again():
    cluster = KubeCluster(k8s.ApiClient())
    core = CountingCore([pod("a-1", {"app": "a"})])
    cluster.core = core  # type: ignore[assignment]
    cluster.pod_cache = cache = PodCache()

    core.during_list = unavailable
    with pytest.raises(ClusterError):
        cluster.pods("llm", {"app": "a"})
    assert not cache.seeded("llm")
    core.during_list = None
    assert [p.name for p in cluster.pods("llm", {"app": "a"})] == ["a-1"]
    assert len(core.lists) == 2
