"""The ownership contract, decision by decision: write, leave alone, refuse, adopt, give back."""

from __future__ import annotations

import json

import pytest

from sluice.istio.ownership import ORIGINAL_ANNOTATION, decide, drifted, ownership, release

UID = "pool-uid"
DESIRED = {
    "apiVersion": "networking.istio.io/v1",
    "kind": "VirtualService",
    "metadata": {
        "name": "sluice-llama",
        "namespace": "llm",
        "labels": {"app.kubernetes.io/managed-by": "sluice", "sluice.dev/pool": "llama"},
        "ownerReferences": [{"uid": UID, "kind": "InferencePool", "name": "llama"}],
    },
    "spec": {"hosts": ["llama"], "http": [{"route": [{"destination": {"host": "x"}, "weight": 100}]}]},
}
USERS = {
    "apiVersion": "networking.istio.io/v1",
    "kind": "VirtualService",
    "metadata": {
        "name": "sluice-llama",
        "namespace": "llm",
        "resourceVersion": "7",
        "labels": {"team": "search"},
        "annotations": {"note": "hand-written"},
    },
    "spec": {"hosts": ["llama"]},
}


def test_absent_is_written_and_unchanged_ours_is_left_alone():
    assert decide(None, DESIRED, UID, adopt=False).action == "write"
    assert ownership(DESIRED, UID) == "ours"
    assert decide(DESIRED, DESIRED, UID, adopt=False).action == "unchanged"
    changed = {**DESIRED, "spec": {"hosts": ["other"]}}
    assert decide(changed, DESIRED, UID, adopt=False).action == "write"


def test_a_foreign_object_is_refused_unless_adoption_is_asked_for():
    assert ownership(USERS, UID) == "foreign"
    assert decide(USERS, DESIRED, UID, adopt=False).action == "refuse"


def test_adopting_keeps_the_original_and_drops_the_owner_reference():
    decision = decide(USERS, DESIRED, UID, adopt=True)
    assert decision.action == "write"
    body = decision.body
    assert body is not None
    assert "ownerReferences" not in body["metadata"]
    original = json.loads(body["metadata"]["annotations"][ORIGINAL_ANNOTATION])
    assert original == {
        "spec": USERS["spec"],
        "labels": USERS["metadata"]["labels"],
        "annotations": {"note": "hand-written"},
    }
    assert ownership(body, UID) == "adopted"
    assert decide(body, DESIRED, UID, adopt=True).action == "unchanged"  # the original is carried, not rewritten


@pytest.mark.parametrize("how", ["adoptExisting turned off", "released"])
def test_an_adopted_object_is_given_back_exactly(how):
    body = decide(USERS, DESIRED, UID, adopt=True).body
    assert body is not None
    live = {**body, "metadata": {**body["metadata"], "resourceVersion": "8"}}
    decision = decide(live, DESIRED, UID, adopt=False) if how == "adoptExisting turned off" else release(live)
    assert decision.action == "restore"
    back = decision.body
    assert back is not None
    assert back["spec"] == USERS["spec"]
    assert back["metadata"]["labels"] == USERS["metadata"]["labels"]
    assert back["metadata"]["annotations"] == USERS["metadata"]["annotations"]
    assert back["metadata"]["resourceVersion"] == "8"  # a replace of the live object, not a blind write


def test_releasing_what_sluice_created_deletes_it():
    assert release(DESIRED).action == "delete"


def test_an_adopted_object_without_labels_comes_back_without_labels():
    bare = {**USERS, "metadata": {"name": "sluice-llama", "namespace": "llm"}}
    body = decide(bare, DESIRED, UID, adopt=True).body
    assert body is not None
    back = release(body).body
    assert back is not None
    assert "labels" not in back["metadata"]
    assert "annotations" not in back["metadata"]


def test_drift_is_a_field_sluice_wrote_changed_or_gone_not_one_somebody_added() -> None:
    written = {
        "metadata": {"name": "x", "labels": {"app.kubernetes.io/managed-by": "sluice"}},
        "spec": {
            "host": "h",
            "trafficPolicy": {"loadBalancer": {"simple": "LEAST_REQUEST"}},
            "subsets": [{"name": "a"}],
        },
    }
    same = json.loads(json.dumps(written))
    assert not drifted(same, written)
    added = json.loads(json.dumps(written))
    added["spec"]["trafficPolicy"]["tls"] = {"mode": "ISTIO_MUTUAL"}  # another manager's field: apply keeps it
    added["metadata"]["labels"]["team"] = "x"
    assert not drifted(added, written)
    changed = json.loads(json.dumps(written))
    changed["spec"]["trafficPolicy"]["loadBalancer"]["simple"] = "RANDOM"
    assert drifted(changed, written)
    gone = json.loads(json.dumps(written))
    del gone["spec"]["trafficPolicy"]
    assert drifted(gone, written)
    listed = json.loads(json.dumps(written))
    listed["spec"]["subsets"].append({"name": "b"})  # lists are atomic: a longer one is not what was written
    assert drifted(listed, written)
    unlabelled = json.loads(json.dumps(written))
    unlabelled["metadata"]["labels"] = {}
    assert drifted(unlabelled, written)


def test_another_pools_object_of_the_same_name_is_refused_not_overwritten():
    """Two pools named alike in two namespaces, both managed by sluice: an object labelled for the other pool's
    namespace is not this pool's (before the label was compared, the second pool overwrote the first's)."""
    labels = {"app.kubernetes.io/managed-by": "sluice", "sluice.dev/pool": "llama"}
    mine = {
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": {"name": "x", "namespace": "team-a", "labels": {**labels, "sluice.dev/pool-namespace": "llm"}},
        "spec": {"configPatches": []},
    }
    theirs = json.loads(json.dumps(mine))
    theirs["metadata"]["labels"]["sluice.dev/pool-namespace"] = "other"
    assert decide(theirs, mine, None, adopt=False).action == "refuse"
    older = json.loads(json.dumps(mine))
    del older["metadata"]["labels"]["sluice.dev/pool-namespace"]  # written before the label existed: still ours
    assert decide(older, mine, None, adopt=False).action == "write"
