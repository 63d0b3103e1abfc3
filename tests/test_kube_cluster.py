"""The Kubernetes adapter's call budget: a steady pass reads nothing it verified recently; a request that failed is
sent again as `sluice.core.apiretry` decides (on a stepped clock with a seeded draw), within the Lease's validity
when fenced; other failures are retried by the next pass."""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import ReadTimeoutError

from sluice.io.kube import KubeCluster
from sluice.io.kubereads import Retrying
from sluice.io.ports import ClusterError
from sluice.istio.rendered import Rendered

DESIRED = {
    "apiVersion": "networking.istio.io/v1",
    "kind": "ServiceEntry",
    "metadata": {"name": "sluice-llama", "namespace": "llm", "labels": {"app.kubernetes.io/managed-by": "sluice"}},
    "spec": {"hosts": ["llama.llm.sluice.internal"], "endpoints": [{"address": "10.0.0.1", "weight": 5}]},
}


def rendered(body: dict[str, Any]) -> Rendered:
    """`body` as the renderer hands it to the adapter."""
    return Rendered(body["kind"], body["metadata"]["name"], body["metadata"]["namespace"], body)


class SteppedTime:
    """The retries' clock: a wait steps it (no real sleep); every send is stamped with it."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def retrying(self, seed: int = 1) -> Retrying:
        return Retrying(clock=self.clock, sleep=self.sleep, draw=random.Random(seed).random)


def throttled(retry_after: str | None = "1") -> ApiException:
    """A 429 as API Priority and Fairness sends it (the client's exception carries the answer's headers)."""
    error = ApiException(status=429, reason="Too Many Requests")
    error.headers = {} if retry_after is None else {"Retry-After": retry_after}
    return error


class FakeCustom:
    def __init__(self, time: SteppedTime | None = None) -> None:
        self.live: dict[str, Any] | None = None
        self.gets = 0
        self.patches = 0
        self.fail_patch = False
        self.time = time or SteppedTime()
        self.failures: list[BaseException] = []
        """Raised by the next requests, one each, before they are answered."""
        self.sent: list[tuple[str, float, object]] = []
        """(verb, clock, request timeout) of every request."""

    def _send(self, verb: str, timeout: object = None) -> None:
        self.sent.append((verb, self.time.now, timeout))
        if self.failures:
            raise self.failures.pop(0)

    def get_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> Any:
        self.gets += 1
        self._send("get")
        if self.live is None:
            raise ApiException(status=404, reason="Not Found")
        return SimpleNamespace(data=json.dumps(self.live).encode())

    def patch_namespaced_custom_object(
        self, group: str, version: str, ns: str, plural: str, name: str, body: Any, **_: Any
    ) -> Any:
        self.patches += 1
        self._send("patch", _.get("_request_timeout"))
        if self.fail_patch:
            raise ApiException(status=500, reason="Internal Server Error")
        self.live = body
        return SimpleNamespace(data=json.dumps(body).encode(), release_conn=lambda: None)


@pytest.fixture
def cluster() -> tuple[KubeCluster, FakeCustom]:
    time = SteppedTime()
    adapter = KubeCluster(k8s.ApiClient(), resync_seconds=60, retrying=time.retrying())
    fake = FakeCustom(time)
    adapter.custom = fake  # type: ignore[assignment]
    return adapter, fake


def test_a_steady_pass_makes_no_get_once_the_object_is_verified(cluster):
    adapter, fake = cluster
    assert adapter.apply(rendered(DESIRED), None, adopt=False).action == "created"
    for _ in range(5):
        assert adapter.apply(rendered(DESIRED), None, adopt=False).action == "unchanged"
    assert (fake.gets, fake.patches) == (1, 1)


def test_a_changed_object_read_recently_is_written_without_a_get(cluster):
    adapter, fake = cluster
    adapter.apply(rendered(DESIRED), None, adopt=False)
    changed = json.loads(json.dumps(DESIRED))
    changed["spec"]["endpoints"][0]["weight"] = 9
    assert adapter.apply(rendered(changed), None, adopt=False).action == "updated"
    assert (fake.gets, fake.patches) == (1, 2)
    assert fake.live == changed
    assert adapter.apply(rendered(changed), None, adopt=False).action == "unchanged"
    assert (fake.gets, fake.patches) == (1, 2)


def test_a_changed_object_is_read_again_once_the_resync_interval_passed(cluster):
    adapter, fake = cluster
    adapter.apply(rendered(DESIRED), None, adopt=False)
    adapter.resync_seconds = 0.0
    changed = json.loads(json.dumps(DESIRED))
    changed["spec"]["endpoints"][0]["weight"] = 9
    fake.live = {**DESIRED, "metadata": {**DESIRED["metadata"], "labels": {}}}  # someone else's now
    assert adapter.apply(rendered(changed), None, adopt=False).action == "refused"
    assert fake.gets == 2


def test_an_adopted_object_keeps_its_original_on_a_write_without_a_get(cluster):
    adapter, fake = cluster
    theirs = {**DESIRED, "metadata": {"name": "sluice-llama", "namespace": "llm", "labels": {"team": "x"}}}
    fake.live = theirs
    assert adapter.apply(rendered(DESIRED), None, adopt=True).action == "updated"
    original = fake.live["metadata"]["annotations"]["sluice.dev/original"]
    changed = json.loads(json.dumps(DESIRED))
    changed["spec"]["endpoints"][0]["weight"] = 9
    assert adapter.apply(rendered(changed), None, adopt=True).action == "updated"
    assert (fake.gets, fake.patches) == (1, 2)
    assert fake.live["metadata"]["annotations"]["sluice.dev/original"] == original
    assert fake.live["spec"] == changed["spec"]


def test_an_object_is_read_again_after_the_resync_interval(cluster):
    adapter, fake = cluster
    adapter.resync_seconds = 0.0
    adapter.apply(rendered(DESIRED), None, adopt=False)
    fake.live = None  # someone deleted it
    assert adapter.apply(rendered(DESIRED), None, adopt=False).action == "created"
    assert fake.gets == 2


def test_a_watch_event_of_someone_elses_edit_makes_the_next_pass_read_and_correct_it(cluster):
    adapter, fake = cluster
    adapter.apply(rendered(DESIRED), None, adopt=False)
    adapter.observed(json.loads(json.dumps(DESIRED)))  # the event of sluice's own write
    assert adapter.apply(rendered(DESIRED), None, adopt=False).action == "unchanged"
    assert fake.gets == 1
    edited = json.loads(json.dumps(DESIRED))
    edited["spec"]["endpoints"][0]["weight"] = 1000  # kubectl edit, within the resync interval
    fake.live = edited
    adapter.observed(edited)
    assert adapter.apply(rendered(DESIRED), None, adopt=False).action == "updated"
    assert (fake.gets, fake.patches) == (2, 2)
    assert fake.live == DESIRED


def test_a_field_someone_else_added_is_not_drift_that_could_be_corrected(cluster):
    adapter, fake = cluster
    adapter.apply(rendered(DESIRED), None, adopt=False)
    added = json.loads(json.dumps(DESIRED))
    added["spec"]["exportTo"] = ["."]  # another manager's field: sluice's apply would leave it, so no re-read
    adapter.observed(added)
    assert adapter.apply(rendered(DESIRED), None, adopt=False).action == "unchanged"
    assert fake.gets == 1


def test_a_watch_event_of_a_deletion_or_of_another_object_is_handled(cluster):
    adapter, fake = cluster
    adapter.apply(rendered(DESIRED), None, adopt=False)
    other = {**DESIRED, "metadata": {**DESIRED["metadata"], "name": "someone-elses"}, "spec": {}}
    adapter.observed(other)  # not an object sluice verified: nothing to do
    adapter.observed({"kind": "ServiceEntry"})  # no metadata at all
    assert adapter.apply(rendered(DESIRED), None, adopt=False).action == "unchanged"
    fake.live = None
    adapter.observed(json.loads(json.dumps(DESIRED)), deleted=True)
    assert adapter.apply(rendered(DESIRED), None, adopt=False).action == "created"
    assert fake.gets == 2


def test_an_adopted_objects_own_write_event_keeps_it_verified(cluster):
    adapter, fake = cluster
    fake.live = {**DESIRED, "metadata": {"name": "sluice-llama", "namespace": "llm", "labels": {"team": "x"}}}
    adapter.apply(rendered(DESIRED), None, adopt=True)
    adapter.observed(json.loads(json.dumps(fake.live)))  # what the write left: the original in an annotation
    assert adapter.apply(rendered(DESIRED), None, adopt=True).action == "unchanged"
    assert fake.gets == 1


def test_a_failed_write_is_not_remembered_as_done(cluster):
    adapter, fake = cluster
    fake.fail_patch = True
    with pytest.raises(ClusterError):
        adapter.apply(rendered(DESIRED), None, adopt=False)
    fake.fail_patch = False
    assert adapter.apply(rendered(DESIRED), None, adopt=False).action == "created"


def test_a_secret_is_read_once_per_expiry_and_a_rotated_one_is_picked_up_after_it(monkeypatch):
    """The pools' Prometheus credentials: a GET per pool per pass before; now one per Secret every SECRET_SECONDS
    (a failed read is not kept, so a Secret created later is found at the next pass)."""
    import base64  # noqa: PLC0415

    from sluice.io import kube  # noqa: PLC0415

    clock = [1000.0]
    monkeypatch.setattr(kube.time, "monotonic", lambda: clock[0])
    reads: list[str] = []
    token = {"value": "first"}

    class FakeCore:
        def read_namespaced_secret(self, name: str, namespace: str) -> Any:
            reads.append(name)
            if name == "missing":
                raise ApiException(status=404, reason="Not Found")
            return SimpleNamespace(data={"token": base64.b64encode(token["value"].encode()).decode()})

    adapter = KubeCluster(k8s.ApiClient())
    adapter.core = FakeCore()  # type: ignore[assignment]
    assert adapter.secret_key("llm", "prom", "token") == "first"
    token["value"] = "rotated"
    clock[0] += kube.SECRET_SECONDS - 1
    assert adapter.secret_key("llm", "prom", "token") == "first"  # within the expiry: no GET
    with pytest.raises(LookupError, match="no key 'other'"):
        adapter.secret_key("llm", "prom", "other")
    assert reads == ["prom"]
    clock[0] += 1
    assert adapter.secret_key("llm", "prom", "token") == "rotated"
    assert reads == ["prom", "prom"]
    for _ in range(2):
        with pytest.raises(LookupError, match="Not Found"):
            adapter.secret_key("llm", "missing", "token")
    assert reads == ["prom", "prom", "missing", "missing"]


# ---- requests sent again


def test_a_read_answered_429_is_sent_again_after_its_retry_after(cluster):
    adapter, fake = cluster
    fake.failures = [throttled("1")]
    assert adapter.apply(rendered(DESIRED), None, adopt=False).action == "created"
    assert [(verb, at) for verb, at, _ in fake.sent] == [("get", 100.0), ("get", 101.0), ("patch", 101.0)]
    assert fake.time.slept == [1.0]
    counts = adapter.retrying.counts
    assert (counts.retries, counts.waited) == ({"throttled": 1}, {"throttled": 1.0})


def test_a_server_side_apply_answered_429_is_sent_again(cluster):
    adapter, fake = cluster
    adapter.apply(rendered(DESIRED), None, adopt=False)
    fake.sent.clear()
    fake.failures = [throttled("2"), throttled("1")]
    changed = {**DESIRED, "spec": {**DESIRED["spec"], "endpoints": []}}
    assert adapter.apply(rendered(changed), None, adopt=False).action == "updated"
    assert [(verb, at) for verb, at, _ in fake.sent] == [("patch", 100.0), ("patch", 102.0), ("patch", 103.0)]
    assert fake.live == changed


@pytest.mark.parametrize("status", [404, 409, 422])
def test_a_write_refused_for_what_it_is_is_not_sent_again(cluster, status):
    adapter, fake = cluster
    adapter.apply(rendered(DESIRED), None, adopt=False)
    fake.sent.clear()
    fake.failures = [ApiException(status=status, reason="refused")]
    changed = {**DESIRED, "spec": {**DESIRED["spec"], "endpoints": []}}
    with pytest.raises(ClusterError) as failed:
        adapter.apply(rendered(changed), None, adopt=False)
    assert failed.value.status == status
    assert [verb for verb, _, _ in fake.sent] == ["patch"]
    assert fake.time.slept == []


def test_a_500_is_sent_again_with_a_growing_back_off_until_the_limit_then_is_a_cluster_error(cluster):
    adapter, fake = cluster
    adapter.retrying.budget = 1000.0
    fake.failures = [ApiException(status=500, reason="Internal Server Error") for _ in range(11)]
    with pytest.raises(ClusterError) as failed:
        adapter.apply(rendered(DESIRED), None, adopt=False)
    assert failed.value.status == 500
    assert fake.gets == 11  # the first and 10 more, as client-go's maxRetries
    assert fake.time.slept[:4] == sorted(fake.time.slept[:4])
    assert adapter.retrying.counts.gave_up == {"server_error": 1}


def test_a_request_without_an_answer_is_a_cluster_error_with_status_0_once_the_budget_is_spent(cluster):
    adapter, fake = cluster
    fake.failures = [ReadTimeoutError(None, "/apis", "Read timed out.") for _ in range(20)]
    with pytest.raises(ClusterError) as failed:
        adapter.apply(rendered(DESIRED), None, adopt=False)
    assert failed.value.status == 0
    assert "ReadTimeoutError" in failed.value.reason
    assert 100.0 < fake.time.now < 100.0 + adapter.retrying.budget  # no wait ends past the budget
    assert adapter.retrying.counts.retries["no_answer"] == len(fake.time.slept) > 1


class Validity:
    """A Lease's write fence as `Tenures.writing` behaves: the seconds left of the validity, refused after it."""

    def __init__(self, time: SteppedTime, until: float) -> None:
        self.time, self.until, self.entered = time, until, 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[float]:
        self.entered += 1
        left = self.until - self.time.now
        if left <= 0:
            raise ClusterError(409, "write withheld")
        yield left


def test_a_fenced_write_is_sent_again_only_within_the_leases_validity(cluster):
    adapter, fake = cluster
    adapter.apply(rendered(DESIRED), None, adopt=False)
    fake.sent.clear()
    validity = Validity(fake.time, until=fake.time.now + 2.5)
    fenced = adapter.fenced(validity)
    fake.failures = [throttled("1"), throttled("1"), throttled("1")]
    changed = {**DESIRED, "spec": {**DESIRED["spec"], "endpoints": []}}
    with pytest.raises(ClusterError) as failed:
        fenced.apply(rendered(changed), None, adopt=False)
    assert failed.value.status == 429
    # sent at 100 and 101 and 102 (each within the fence, each with the validity left as its timeout); a third
    # Retry-After of 1 s would end at 103, past the validity (102.5): not sent
    assert [(verb, at, timeout) for verb, at, timeout in fake.sent] == [
        ("patch", 100.0, 2.5),
        ("patch", 101.0, 1.5),
        ("patch", 102.0, 0.5),
    ]
    assert validity.entered == 3
    assert all(at < validity.until for _, at, _ in fake.sent)
