"""Concurrent writers meet the API emulator as they meet kube-apiserver: stale versions, apply conflicts, old watches.

Real clients only: kubectl (client- and server-side apply, patch, replace) and the official `kubernetes` client
(patches with and without a resourceVersion, as kopf sends them; watches with bookmarks and from an expired
version). One emulator with a 5-event watch history and 1 s bookmarks is shared by the module.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import watch

from sluice.devstack.stack import Stack
from sluice.emulator.apiserver import LIST_CHUNK

pytestmark = pytest.mark.slow

GROUP, VERSION, PLURAL = "inference.sluice.dev", "v1alpha1", "inferencepools"


def pool_yaml(name: str, interval: str = "5s") -> str:
    return (
        "apiVersion: inference.sluice.dev/v1alpha1\nkind: InferencePool\n"
        f"metadata: {{name: {name}, namespace: llm}}\n"
        "spec:\n  selector: {matchLabels: {app: llama}}\n  targetPort: 8000\n  service: llama\n"
        f"  interval: {interval}\n"
    )


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(Path(tmp_path_factory.mktemp("writers")), deadline_seconds=300)
    stack.workdir.mkdir(parents=True, exist_ok=True)
    stack.apiserver_args = ["--watch-history", "5", "--bookmark-interval", "1"]
    try:
        stack.start_apiserver()
        yield stack
    finally:
        stack.close()


def custom(api: Stack) -> k8s.CustomObjectsApi:
    assert api.custom is not None
    return api.custom


def get(api: Stack, name: str) -> dict[str, Any]:
    pool: dict[str, Any] = custom(api).get_namespaced_custom_object(GROUP, VERSION, "llm", PLURAL, name)
    return pool


def managers(api: Stack, name: str) -> dict[str, set[str]]:
    """manager/operation → the spec fields it owns."""
    return {
        f"{entry['manager']}/{entry['operation']}": {
            key.removeprefix("f:") for key in entry["fieldsV1"].get("f:spec", {})
        }
        for entry in get(api, name)["metadata"]["managedFields"]
    }


CONFLICT = 'Operation cannot be fulfilled on inferencepools.inference.sluice.dev "{name}": the object has been ' + (
    "modified; please apply your changes to the latest version and try again"
)


# ---------------------------------------------------------------------------------------------- resourceVersion


def test_kubectl_replace_with_a_stale_resource_version_is_a_409_conflict(api: Stack) -> None:
    api.kubectl("apply", "-f", "-", stdin=pool_yaml("stale"))
    stale = api.kubectl("get", "inferencepool", "stale", "-n", "llm", "-o", "json").stdout
    api.kubectl("patch", "inferencepool", "stale", "-n", "llm", "--type", "merge", "-p", '{"spec":{"interval":"6s"}}')
    edited = json.loads(stale)
    edited["spec"]["interval"] = "8s"
    result = api.kubectl("replace", "-f", "-", stdin=json.dumps(edited), check=False)
    assert result.returncode != 0
    assert f'Error from server (Conflict): error when replacing "STDIN": {CONFLICT.format(name="stale")}' in (
        result.stderr
    )
    assert get(api, "stale")["spec"]["interval"] == "6s"
    audit = [json.loads(line) for line in (api.workdir / "audit.jsonl").read_text().splitlines()]
    refused = [e for e in audit if e.get("stage") == "ResponseComplete" and e["name"] == "stale" and e["code"] == "409"]
    assert [e["message"] for e in refused] == [CONFLICT.format(name="stale")], "the audit says why it was refused"


def test_patches_as_kopf_sends_them_and_a_stale_precondition(api: Stack) -> None:
    api.kubectl("apply", "-f", "-", stdin=pool_yaml("kopfish"))
    current = get(api, "kopfish")["metadata"]["resourceVersion"]
    objects = custom(api)
    # kopf: a merge patch without a resourceVersion always applies
    objects.patch_namespaced_custom_object(
        GROUP, VERSION, "llm", PLURAL, "kopfish", {"metadata": {"labels": {"a": "1"}}}
    )
    # kopf: a JSON patch guarded by a `test` of the resourceVersion it read fails with 422 once that is stale
    guarded = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": current},
        {"op": "add", "path": "/metadata/finalizers", "value": ["kopf.zalando.org/KopfFinalizerMarker"]},
    ]
    with pytest.raises(k8s.ApiException) as failed_test:
        objects.patch_namespaced_custom_object(
            GROUP, VERSION, "llm", PLURAL, "kopfish", guarded, _content_type="application/json-patch+json"
        )
    assert failed_test.value.status == 422
    # a merge patch naming a stale resourceVersion is a precondition, and fails with 409
    with pytest.raises(k8s.ApiException) as conflict:
        objects.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            "llm",
            PLURAL,
            "kopfish",
            {"metadata": {"resourceVersion": current}, "spec": {"interval": "9s"}},
        )
    assert conflict.value.status == 409
    assert json.loads(conflict.value.body)["message"] == CONFLICT.format(name="kopfish")
    assert get(api, "kopfish")["spec"]["interval"] == "5s"


# ---------------------------------------------------------------------------------------------- server-side apply


def test_server_side_apply_conflicts_with_another_managers_field_unless_forced(api: Stack) -> None:
    api.kubectl("apply", "--server-side", "--field-manager=alice", "-f", "-", stdin=pool_yaml("shared", "7s"))
    refused = api.kubectl(
        "apply", "--server-side", "--field-manager=bob", "-f", "-", stdin=pool_yaml("shared", "9s"), check=False
    )
    assert refused.returncode != 0
    assert 'error: Apply failed with 1 conflict: conflict with "alice": .spec.interval' in refused.stderr
    assert get(api, "shared")["spec"]["interval"] == "7s"
    api.kubectl("apply", "--server-side", "--field-manager=carol", "-f", "-", stdin=pool_yaml("shared", "7s"))
    assert "interval" in managers(api, "shared")["carol/Apply"]  # the same value: shared, no conflict
    api.kubectl(
        "apply", "--server-side", "--field-manager=bob", "--force-conflicts", "-f", "-", stdin=pool_yaml("shared", "9s")
    )
    owners = managers(api, "shared")
    assert get(api, "shared")["spec"]["interval"] == "9s"
    assert "interval" in owners["bob/Apply"]
    assert "interval" not in owners.get("alice/Apply", set())
    assert "interval" not in owners.get("carol/Apply", set())


def test_a_field_an_update_changed_belongs_to_its_manager_and_conflicts_with_apply(api: Stack) -> None:
    api.kubectl("apply", "--server-side", "--field-manager=alice", "-f", "-", stdin=pool_yaml("edited"))
    api.kubectl(
        "patch", "inferencepool", "edited", "-n", "llm", "--type", "merge", "-p", '{"spec":{"service":"other"}}'
    )
    refused = api.kubectl(
        "apply", "--server-side", "--field-manager=alice", "-f", "-", stdin=pool_yaml("edited"), check=False
    )
    assert (
        'Apply failed with 1 conflict: conflict with "kubectl-patch" using inference.sluice.dev/v1alpha1: .spec.service'
    ) in refused.stderr


def test_kubectl_moves_a_client_side_applied_object_to_server_side_apply_without_conflict(api: Stack) -> None:
    api.kubectl("apply", "-f", "-", stdin=pool_yaml("moved"))
    assert "interval" in managers(api, "moved")["kubectl-client-side-apply/Update"]
    api.kubectl("apply", "--server-side", "-f", "-", stdin=pool_yaml("moved", "7s"))
    owners = managers(api, "moved")
    assert get(api, "moved")["spec"]["interval"] == "7s"
    assert "interval" in owners["kubectl/Apply"]
    assert "kubectl-client-side-apply/Update" not in owners  # kubectl handed its fields over


# ---------------------------------------------------------------------------------------------- watches


def test_a_watch_from_a_version_older_than_the_history_is_410_gone(api: Stack) -> None:
    api.kubectl("apply", "-f", "-", stdin=pool_yaml("churn"))
    first = get(api, "churn")["metadata"]["resourceVersion"]
    for seconds in range(6, 14):  # more writes than the 5 events kept
        custom(api).patch_namespaced_custom_object(
            GROUP, VERSION, "llm", PLURAL, "churn", {"spec": {"interval": f"{seconds}s"}}
        )
    stream = watch.Watch().stream(
        custom(api).list_namespaced_custom_object,
        GROUP,
        VERSION,
        "llm",
        PLURAL,
        resource_version=first,
        timeout_seconds=5,
    )
    with pytest.raises(k8s.ApiException) as gone:
        next(iter(stream))
    assert gone.value.status == 410
    assert f"too old resource version: {first}" in str(gone.value)


def test_watch_bookmarks_come_only_when_allowed(api: Stack) -> None:
    api.kubectl("apply", "-f", "-", stdin=pool_yaml("quiet"))
    since = get(api, "quiet")["metadata"]["resourceVersion"]

    def event_types(allow: bool) -> list[str]:
        start = time.monotonic()
        seen = [
            event["type"]
            for event in watch.Watch().stream(
                custom(api).list_namespaced_custom_object,
                GROUP,
                VERSION,
                "llm",
                PLURAL,
                resource_version=since,
                allow_watch_bookmarks=allow,
                timeout_seconds=3,
            )
        ]
        assert time.monotonic() - start < 10
        return seen

    assert "BOOKMARK" in event_types(allow=True)
    assert "BOOKMARK" not in event_types(allow=False)


def test_an_open_watch_of_a_quiet_resource_outlives_a_history_full_of_other_resources(api: Stack) -> None:
    """A watch in progress has seen every event up to now: other resources' writes never make it 410 Gone.

    kube-apiserver keeps a watch cache per resource; a watch of Pods that sees no Pod change while Leases and
    InferencePools churn stays open and gets the next Pod event. (Before: the watch's position moved only on
    its own resource's events, so once the shared history rolled past it the stream broke off.)
    """
    core = k8s.CoreV1Api(custom(api).api_client)
    api.kubectl("apply", "-f", "-", stdin=pool_yaml("noisy"))
    since = get(api, "noisy")["metadata"]["resourceVersion"]
    seen: list[tuple[str, str]] = []
    errors: list[BaseException] = []

    def follow() -> None:
        try:
            for event in watch.Watch().stream(
                core.list_namespaced_config_map, "llm", resource_version=since, timeout_seconds=8
            ):
                seen.append((event["type"], event["object"].metadata.name))
                if event["object"].metadata.name == "after-the-churn":
                    return
        except BaseException as error:  # reported below
            errors.append(error)

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    time.sleep(1.0)  # the watch is open and waiting
    for seconds in range(6, 20):  # many more writes to another resource than the 5 events kept
        custom(api).patch_namespaced_custom_object(
            GROUP, VERSION, "llm", PLURAL, "noisy", {"spec": {"interval": f"{seconds}s"}}
        )
        time.sleep(0.05)  # the watcher wakes between writes, as it does under load
    core.create_namespaced_config_map("llm", {"metadata": {"name": "after-the-churn"}})
    follower.join(timeout=15)
    assert not errors, errors
    assert ("ADDED", "after-the-churn") in seen


def test_a_long_list_is_streamed_in_chunks_and_reads_whole_in_kubectl_and_the_client(api: Stack) -> None:
    """Over `LIST_CHUNK` items a list is sent in chunks (the emulator's loop serves other requests between two);
    kubectl and the official client read it as one list, every item once, in the store's order."""
    assert api.core is not None
    api.kubectl("create", "namespace", "bulk")
    count = LIST_CHUNK * 2 + 17
    for i in range(count):
        api.core.create_namespaced_config_map("bulk", {"metadata": {"name": f"cm-{i:04d}"}, "data": {"i": str(i)}})
    answer = api.core.list_namespaced_config_map("bulk", _preload_content=False)
    assert answer.headers.get("Transfer-Encoding") == "chunked"
    body = json.loads(answer.data)
    assert body["kind"] == "ConfigMapList"
    assert body["metadata"]["resourceVersion"].isdigit()
    names = [item["metadata"]["name"] for item in body["items"]]
    assert names == [f"cm-{i:04d}" for i in range(count)]
    assert all(item["apiVersion"] == "v1" for item in body["items"])
    listed = json.loads(api.kubectl("get", "configmaps", "-n", "bulk", "-o", "json").stdout)
    assert [item["metadata"]["name"] for item in listed["items"]] == names
    typed = api.core.list_namespaced_config_map("bulk")
    assert [item.metadata.name for item in typed.items] == names
    small = api.core.list_namespaced_config_map("bulk", label_selector="none=none", _preload_content=False)
    assert small.headers.get("Content-Length") is not None, "a short list keeps its Content-Length"
