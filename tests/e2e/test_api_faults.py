"""What a client sees when the API emulator serves faults, with the real kubectl and the official Python client.

The emulator runs alone, its plan given at start (`--faults`) and replaced between tests through `/_faults`
(`kubectl replace --raw`). Each answer is shaped as kube-apiserver 1.32 sends it (sources cited in
`sluice.emulator.apifaults`): APF's plain-text 429 with Retry-After and the PF headers, the shutting-down 503
Status, a watch that ends, and the watch cache's ERROR event with the 410 Expired Status. kubectl's client-go retries a
429 or a 5xx that carries Retry-After (up to 10 times) and makes a TooManyRequests Status of a plain-text 429; under
the Python client, urllib3's default Retry retries a GET, PUT or DELETE answered 413/429/503 with Retry-After up to 3
times, never a POST or PATCH.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client as k8s
from kubernetes import watch

from sluice.devstack.stack import Stack

pytestmark = pytest.mark.slow

PYTHON_UA = "OpenAPI-Generator/"  # the official client's User-Agent prefix
START_PLAN = {
    "seed": 1,
    "rules": [
        {
            "name": "apf",
            "match": {"verbs": ["list"], "resources": ["configmaps"], "userAgents": [PYTHON_UA]},
            "effect": {"type": "throttle", "retryAfterSeconds": 2},
        }
    ],
}


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(Path(tmp_path_factory.mktemp("faults")), deadline_seconds=120)
    stack.workdir.mkdir(parents=True, exist_ok=True)
    plan = stack.workdir / "faults.json"
    plan.write_text(json.dumps(START_PLAN))
    stack.apiserver_args = ["--faults", str(plan)]
    try:
        stack.start_apiserver()
        stack.kubectl("create", "configmap", "seed", "-n", "default")
        yield stack
    finally:
        stack.close()


def install(api: Stack, *rules: dict[str, object]) -> None:
    """Replace the plan through the admin endpoint, as a harness would: `kubectl replace --raw /_faults`."""
    api.kubectl("replace", "--raw", "/_faults", "-f", "-", stdin=json.dumps({"seed": 1, "rules": list(rules)}))


def served(api: Stack) -> dict[str, int]:
    status = json.loads(api.kubectl("get", "--raw", "/_faults").stdout)
    return {rule["name"]: rule["served"] for rule in status["rules"]}


def core(api: Stack) -> k8s.CoreV1Api:
    assert api.core is not None
    return api.core


def test_the_python_client_sees_apfs_429_with_retry_after_and_the_priority_and_fairness_headers(api: Stack) -> None:
    with pytest.raises(k8s.ApiException) as throttled:
        core(api).list_namespaced_config_map("default")  # the plan given with --faults at start
    failure = throttled.value
    assert (failure.status, failure.reason) == (429, "Too Many Requests")
    assert failure.body == "Too many requests, please try again later.\n"
    assert failure.headers["Retry-After"] == "2"
    assert failure.headers["Content-Type"] == "text/plain; charset=utf-8"
    assert failure.headers["X-Kubernetes-PF-FlowSchema-UID"]
    assert failure.headers["X-Kubernetes-PF-PriorityLevel-UID"]
    assert "seed" in api.kubectl("get", "configmaps").stdout  # kubectl's own User-Agent is not matched
    # urllib3's default Retry under the client (total 3) retried the GET three times, after Retry-After each.
    assert served(api) == {"apf": 4}


def test_kubectl_waits_out_a_429_burst_as_client_go_does_and_then_gets_its_answer(api: Stack) -> None:
    install(
        api,
        {
            "name": "apf",
            "match": {"verbs": ["list"], "userAgents": ["kubectl/"]},
            "burst": 2,
            "limit": 2,
            "effect": {"type": "throttle", "retryAfterSeconds": 1},
        },
    )
    started = time.monotonic()
    result = api.kubectl("get", "configmaps", "-v=6")
    took = time.monotonic() - started
    assert "seed" in result.stdout
    assert result.stderr.count(" 429 Too Many Requests") == 2, result.stderr
    assert took >= 2.0  # it honoured Retry-After: 1 twice
    assert served(api) == {"apf": 2}


def test_kubectl_gives_up_after_ten_retries_with_the_too_many_requests_status_client_go_makes(api: Stack) -> None:
    install(
        api,
        {"name": "apf", "match": {"verbs": ["list"], "userAgents": ["kubectl/"]}, "effect": {"type": "throttle"}},
    )
    result = api.kubectl("get", "configmaps", check=False)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "Error from server (TooManyRequests): the server has received too many requests and has asked us to try "
        "again later (get configmaps)"
    )
    assert served(api) == {"apf": 11}  # the request and client-go's 10 retries, a second apart


def test_a_503_burst_fails_the_python_clients_writes_then_lets_them_through(api: Stack) -> None:
    install(
        api,
        {
            "name": "unavailable",
            "match": {"verbs": ["create"], "resources": ["configmaps"], "userAgents": [PYTHON_UA]},
            "burst": 3,
            "limit": 3,
            "effect": {"type": "error", "code": 503},
        },
    )
    failures = []
    for attempt in range(3):
        body = k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(name=f"burst-{attempt}"))
        with pytest.raises(k8s.ApiException) as refused:
            core(api).create_namespaced_config_map("default", body)
        failures.append(refused.value)
    assert [failure.status for failure in failures] == [503, 503, 503]
    for failure in failures:
        status = json.loads(failure.body)
        assert (status["reason"], status["message"]) == ("ServiceUnavailable", "apiserver is shutting down")
        assert failure.headers["Retry-After"] == "1"
    created = core(api).create_namespaced_config_map(
        "default", k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(name="burst-3"))
    )
    assert created.metadata.name == "burst-3"
    assert served(api) == {"unavailable": 3}


def test_kubectl_reports_a_500_it_cannot_retry_with_the_internal_error_status(api: Stack) -> None:
    install(
        api,
        {
            "name": "etcd",
            "match": {"verbs": ["get"], "userAgents": ["kubectl/"]},
            "limit": 1,
            "effect": {"type": "error", "code": 500, "message": "etcdserver: request timed out"},
        },
    )
    result = api.kubectl("get", "configmap", "seed", check=False)
    assert result.returncode == 1
    assert "Error from server (InternalError): Internal error occurred: etcdserver: request timed out" in result.stderr


def test_a_watch_closed_by_the_server_ends_the_python_clients_stream_and_kubectls_watch(api: Stack) -> None:
    install(
        api,
        {
            "name": "close-python",
            "match": {"userAgents": [PYTHON_UA]},
            "effect": {"type": "closeWatch", "afterEvents": 1},
        },
        {
            "name": "close-kubectl",
            "match": {"userAgents": ["kubectl/"]},
            "effect": {"type": "closeWatch", "afterSeconds": 2},
        },
    )
    stream = watch.Watch().stream(core(api).list_namespaced_config_map, "default", timeout_seconds=30)
    started = time.monotonic()
    events = [event["type"] for event in stream]
    assert len(events) == 1
    assert events == ["ADDED"]
    assert time.monotonic() - started < 30  # ended by the server, not by the timeout
    result = api.kubectl("get", "configmaps", "--watch", check=False)
    assert result.returncode == 0, result.stderr
    assert "seed" in result.stdout
    assert served(api) == {"close-python": 1, "close-kubectl": 1}


def test_a_watch_resumed_from_an_old_version_gets_410_expired(api: Stack) -> None:
    listed = core(api).list_namespaced_config_map("default")
    old = str(int(listed.metadata.resource_version) - 1)
    install(api, {"name": "expire", "effect": {"type": "expireWatch"}})
    with pytest.raises(k8s.ApiException) as expired:
        list(
            watch.Watch().stream(
                core(api).list_namespaced_config_map, "default", resource_version=old, timeout_seconds=5
            )
        )
    assert expired.value.status == 410
    assert expired.value.reason == f"Expired: too old resource version: {old} ({listed.metadata.resource_version})"
    raw = api.kubectl("get", "--raw", f"/api/v1/namespaces/default/configmaps?watch=true&resourceVersion={old}").stdout
    event = json.loads(raw)
    assert event["type"] == "ERROR"
    assert {key: event["object"][key] for key in ("kind", "status", "reason", "code")} == {
        "kind": "Status",
        "status": "Failure",
        "reason": "Expired",
        "code": 410,
    }
    assert served(api) == {"expire": 2}
