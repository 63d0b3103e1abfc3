"""The API emulator's Leases behave as kube-apiserver's: every change bumps the resourceVersion, stale writes 409."""

from __future__ import annotations

import copy

import pytest

from sluice.emulator.apistore import ApiError, Store


@pytest.fixture
def store() -> Store:
    s = Store()
    namespaces = s.types[("", "namespaces")]
    s.create(namespaces, "v1", None, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "llm"}}, "t")
    return s


LEASE = {
    "apiVersion": "coordination.k8s.io/v1",
    "kind": "Lease",
    "metadata": {"name": "shard-0", "namespace": "llm"},
    "spec": {"holderIdentity": "a", "leaseDurationSeconds": 10, "renewTime": "2026-12-01T10:00:00.000000Z"},
}


def test_a_renewal_bumps_the_resource_version_and_a_stale_one_conflicts(store: Store) -> None:
    leases = store.find_type("coordination.k8s.io", "leases")
    created = store.create(leases, "v1", "llm", copy.deepcopy(LEASE), "t")
    first = created["metadata"]["resourceVersion"]
    renewal = copy.deepcopy(LEASE)
    renewal["metadata"]["resourceVersion"] = first
    renewal["spec"]["renewTime"] = "2026-12-01T10:00:03.000000Z"
    renewed = store.replace(leases, "v1", "llm", "shard-0", copy.deepcopy(renewal), manager="t")
    assert renewed["metadata"]["resourceVersion"] != first
    assert store.get(leases, "llm", "shard-0")["metadata"]["resourceVersion"] == renewed["metadata"]["resourceVersion"]
    with pytest.raises(ApiError) as stale:
        store.replace(leases, "v1", "llm", "shard-0", copy.deepcopy(renewal), manager="t")
    assert stale.value.code == 409
