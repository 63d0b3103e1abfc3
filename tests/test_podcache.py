"""The pod cache fed by the pod watch: a selector finds exactly the pods a label-selector list would."""

from __future__ import annotations

import contextlib
from typing import Any

from kubernetes import client as k8s

from sluice.io.kube import KubeCluster
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
    def __init__(self) -> None:
        self.lists = 0

    def list_namespaced_pod(self, *_: Any, **__: Any) -> Any:
        self.lists += 1
        raise AssertionError("listed")


def test_the_cluster_lists_until_the_watch_has_synced_then_reads_the_cache():
    cluster = KubeCluster(k8s.ApiClient())
    core = CountingCore()
    cluster.core = core  # type: ignore[assignment]
    cache = PodCache()
    cache.put("llm", pod("a-1", {"app": "a"}))
    cluster.pod_cache = cache
    with contextlib.suppress(AssertionError):
        cluster.pods("llm", {"app": "a"})
    assert core.lists == 1  # not synced yet: the API is the truth
    cache.synced = True
    assert [p.name for p in cluster.pods("llm", {"app": "a"})] == ["a-1"]
    assert core.lists == 1
