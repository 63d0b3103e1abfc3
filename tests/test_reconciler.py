"""The runtime's pass with fake ports: what reaches the cluster when the pass fails, or the status is unreadable.

The fakes stand where the Kubernetes and Prometheus clients stand; the pass itself is the real one.
"""

from __future__ import annotations

from typing import Any

import pytest

from sluice.core.observed import PodSignals, SignalSnapshot
from sluice.io.kube import WriteResult
from sluice.runtime.reconciler import Reconciler
from tests.helpers import T0, at


def pod_object(name: str, ip: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"app": "llama", "sluice.dev/hardware-class": "a100"}},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


class FakeKube:
    def __init__(self, fail_pods: bool = False) -> None:
        self.fail_pods = fail_pods
        self.statuses: list[dict[str, Any]] = []
        self.events: list[Any] = []
        self.synced: list[dict[str, Any]] = []

    def list_pods(self, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        if self.fail_pods:
            raise RuntimeError("watch cache exploded")
        return [pod_object("a", "10.0.0.1"), pod_object("b", "10.0.0.2")]

    def sync_object(self, desired: dict[str, Any], uid: str | None, adopt: bool) -> WriteResult:
        self.synced.append(desired)
        return WriteResult(desired["kind"], desired["metadata"]["name"], "created")

    def write_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.statuses.append(status)

    def emit_event(self, namespace: str, name: str, uid: str | None, event: Any) -> None:
        self.events.append(event)


class FakeProm:
    def read_signals(self, spec: Any, namespace: str, pods: list[str], auth: Any, now: Any) -> SignalSnapshot:
        signals = PodSignals(ttft_seconds=0.05, kv_cache_usage=0.2, queue_length=0, running_requests=1)
        return SignalSnapshot(collected_at=now, pods=dict.fromkeys(pods, signals))


def body(status: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "apiVersion": "inference.sluice.dev/v1alpha1",
        "kind": "InferencePool",
        "metadata": {"name": "llama", "namespace": "llm", "uid": "u1", "generation": 1},
        "spec": {"selector": {"matchLabels": {"app": "llama"}}, "targetPort": 8000, "service": "llama"},
    }
    if status is not None:
        out["status"] = status
    return out


def conditions_of(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_a_pass_that_raises_says_so_in_the_status_and_an_event():
    kube = FakeKube()
    reconciler = Reconciler(kube, FakeProm())  # type: ignore[arg-type]
    healthy = reconciler.run(body(), T0)
    assert conditions_of(healthy.status)["Ready"] == ("True", "WeightsPublished")
    kube.fail_pods = True
    with pytest.raises(RuntimeError):
        reconciler.run(body(healthy.status), at(5))
    written = kube.statuses[-1]
    assert conditions_of(written)["Ready"] == ("False", "ReconcileFailed")
    assert "watch cache exploded" in next(c for c in written["conditions"] if c["type"] == "Ready")["message"]
    assert [e.reason for e in kube.events][-1] == "ReconcileFailed"


def test_a_status_written_by_another_version_does_not_stop_the_pool():
    kube = FakeKube()
    reconciler = Reconciler(kube, FakeProm())  # type: ignore[arg-type]
    first = reconciler.run(body(), T0).status
    newer = {**first, "endpoints": [{**first["endpoints"][0], "state": "Draining"}, first["endpoints"][1]]}
    report = Reconciler(kube, FakeProm()).run(body(newer), at(5))  # type: ignore[arg-type]
    assert report.result == "ok"
    assert conditions_of(report.status)["SpecValid"] == ("True", "Valid")
    assert conditions_of(report.status)["Ready"] == ("True", "WeightsPublished")
    warned = [e for e in report.events if e.reason == "StatusPartlyUnreadable"]
    assert len(warned) == 1
    assert "endpoints: dropped an unreadable entry" in warned[0].message


def test_istio_synced_is_built_by_the_same_condition_builder_and_keeps_its_transition_time():
    kube = FakeKube()
    reconciler = Reconciler(kube, FakeProm())  # type: ignore[arg-type]
    first = reconciler.run(body(), T0).status
    second = reconciler.run(body(first), at(5)).status
    synced = [next(c for c in s["conditions"] if c["type"] == "IstioSynced") for s in (first, second)]
    assert synced[0]["status"] == "True"
    assert synced[0]["lastTransitionTime"] == synced[1]["lastTransitionTime"]
    assert [c["type"] for c in second["conditions"]] == [
        "Ready",
        "SpecValid",
        "MetricsAvailable",
        "Degraded",
        "IstioSynced",
    ]
