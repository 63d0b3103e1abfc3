"""SpecDiffBase: kopf's essence of a pool, without deep-copying what the essence drops."""

from __future__ import annotations

import copy
from typing import Any

import kopf
import pytest

from sluice.api.operation import OPERATION_ANNOTATION
from sluice.runtime.diffbase import SpecDiffBase


class NoCopy:
    """Raises if deep-copied: stands for a large status kopf must not copy."""

    def __deepcopy__(self, memo: Any) -> Any:
        raise AssertionError("deep-copied")


def body(status: Any = None) -> dict[str, Any]:
    return {
        "apiVersion": "inference.sluice.dev/v1alpha1",
        "kind": "InferencePool",
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "uid": "u-1",
            "generation": 3,
            "resourceVersion": "77",
            "labels": {"app": "llm"},
            "annotations": {
                "sluice.dev/last-handled-configuration": '{"spec": {"interval": "5s"}}',
                "kubectl.kubernetes.io/last-applied-configuration": "{}",
                OPERATION_ANNOTATION: '{"op": "promote"}',
                "team": "serving",
            },
            "managedFields": [{"manager": "sluice", "fieldsV1": {"f:status": {}}}],
            "finalizers": ["sluice.dev/finalizer"],
        },
        "spec": {"interval": "5s", "selector": {"matchLabels": {"app": "llm"}}},
        "status": status if status is not None else {"endpoints": [{"pod": "a", "weight": 10}]},
    }


@pytest.mark.parametrize(
    "extra",
    [None, [("metadata", "annotations", OPERATION_ANNOTATION)], [("spec", "interval")], [("status", "endpoints")]],
)
def test_the_essence_is_kopfs_own(extra: Any) -> None:
    raw = body()
    ours = SpecDiffBase(prefix="sluice.dev").build(body=kopf.Body(copy.deepcopy(raw)), extra_fields=extra)
    theirs = kopf.AnnotationsDiffBaseStorage(prefix="sluice.dev").build(body=kopf.Body(raw), extra_fields=extra)
    assert ours == theirs
    assert "status" not in ours or extra == [("status", "endpoints")]


def owned_replicaset() -> dict[str, Any]:
    """A body whose kopf key is named after its owner (`...-ofDRS`): kopf reads ownerReferences to name it."""
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {
            "name": "rs",
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "d", "uid": "u"}],
            "annotations": {"sluice.dev/last-handled-configuration-ofDRS": "{}", "team": "serving"},
        },
        "spec": {"replicas": 2},
        "status": {"replicas": 2},
    }


@pytest.mark.parametrize(
    "raw",
    [owned_replicaset(), {"kind": "X", "spec": {"a": 1}}, {"metadata": {}, "spec": {}}, {"spec": {"a": 1}}],
)
@pytest.mark.parametrize("extra", [None, "spec.a", ["metadata", "labels"], {("metadata", "generation")}])
def test_the_essence_is_kopfs_own_for_other_bodies(raw: dict[str, Any], extra: Any) -> None:
    ours = SpecDiffBase(prefix="sluice.dev").build(body=kopf.Body(copy.deepcopy(raw)), extra_fields=extra)
    theirs = kopf.AnnotationsDiffBaseStorage(prefix="sluice.dev").build(body=kopf.Body(raw), extra_fields=extra)
    assert ours == theirs


def test_the_status_and_managed_fields_are_not_copied() -> None:
    raw = body(status={"endpoints": [NoCopy()]})
    raw["metadata"]["managedFields"] = [NoCopy()]
    essence = SpecDiffBase(prefix="sluice.dev").build(body=kopf.Body(raw))
    assert essence["spec"] == raw["spec"]
    with pytest.raises(AssertionError, match="deep-copied"):
        kopf.AnnotationsDiffBaseStorage(prefix="sluice.dev").build(body=kopf.Body(raw))


def test_an_extra_field_under_status_is_still_tracked() -> None:
    raw = body(status={"phase": "Ready"})
    essence = SpecDiffBase(prefix="sluice.dev").build(body=kopf.Body(raw), extra_fields=[("status", "phase")])
    assert essence["status"] == {"phase": "Ready"}
