"""The Kubernetes requests sent again, on the operator's /metrics page (`sluice.runtime.kubemetrics`)."""

from __future__ import annotations

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from prometheus_client import CollectorRegistry, generate_latest

from sluice.io.kube import KubeCluster
from sluice.io.ports import ClusterError
from sluice.runtime.kubemetrics import KubeRetries
from tests.test_kube_cluster import DESIRED, FakeCustom, SteppedTime, rendered, throttled


def test_retries_their_waits_and_the_failures_given_up_are_counted_per_client_and_reason():
    time = SteppedTime()
    adapter = KubeCluster(k8s.ApiClient(), retrying=time.retrying())
    fake = FakeCustom(time)
    adapter.custom = fake  # type: ignore[assignment]
    registry = CollectorRegistry()
    registry.register(KubeRetries({"passes": adapter.retrying.counts}))
    assert registry.get_sample_value("sluice_kube_retries_total", {"client": "passes", "reason": "throttled"}) is None

    fake.failures = [throttled("2"), ApiException(status=503, reason="Unavailable")]
    adapter.apply(rendered(DESIRED), None, adopt=False)
    labels = {"client": "passes", "reason": "throttled"}
    assert registry.get_sample_value("sluice_kube_retries_total", labels) == 1
    assert registry.get_sample_value("sluice_kube_retry_wait_seconds_total", labels) == 2.0
    server = {"client": "passes", "reason": "server_error"}
    assert registry.get_sample_value("sluice_kube_retries_total", server) == 1

    adapter.retrying.budget = 1.0  # a Retry-After of 2 s would end past it: given up, the write fails
    fake.failures = [throttled("2")]
    adapter.resync()
    with pytest.raises(ClusterError, match="429"):
        adapter.apply(rendered(DESIRED), None, adopt=False)
    assert registry.get_sample_value("sluice_kube_retries_given_up_total", labels) == 1
    assert b"sluice_kube_retries_total" in generate_latest(registry)
