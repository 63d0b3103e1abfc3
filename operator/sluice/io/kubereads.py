"""Calls on the official Kubernetes client and the reads the adapter makes with them.

The client's edge: a request that failed is sent again as `sluice.core.apiretry.next_try` decides (a 429 after its
Retry-After, a 5xx or no answer after a back-off with jitter, never past the caller's deadline: `send`, with the
adapter's `Retrying`), and what still fails becomes a `ClusterError` (`call`); an answer asked for undecoded
(`_preload_content=False`) is decoded and narrowed to JSON here, once (`json_answer`, `listed`). The reads: the
mesh side (the pool's Service, its namespace's labels, the Sidecars), a Secret's keys, one Istio object, and the
Istio objects labelled for a pool (`owned_keys`). Each takes the client's API object at the call, so an adapter
whose API objects are replaced (the tests' fakes) reads through them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, cast

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from urllib3.connection import HTTPConnection

from sluice.api.jsontypes import JsonObject, text
from sluice.api.v1alpha1 import InferencePoolSpec
from sluice.core.apiretry import Failure, GiveUp, Reason, RetryPolicy, next_try, reason_of
from sluice.core.observed import ObservedService, ObservedSidecar
from sluice.io.kubeobserved import observed_service, observed_sidecar, strings
from sluice.io.ports import ClusterError, ObjectKey
from sluice.istio.kinds import ISTIO_KINDS
from sluice.istio.ownership import MANAGED_BY, POOL_LABEL, POOL_NAMESPACE_LABEL

log = logging.getLogger(__name__)
T = TypeVar("T")
SIDECARS = ("networking.istio.io", "v1", "sidecars")


class RawAnswer(Protocol):
    """An answer asked for with `_preload_content=False`: urllib3's response, its body read on demand."""

    data: bytes

    def release_conn(self) -> None: ...


BUDGET = 30.0
"""Seconds an unfenced call may spend waiting and sending again (a fenced one: no longer than its Lease's
validity); a pool's daemon awaits its pass, so this bounds how late a throttled pass makes the next."""
Window = Callable[[], AbstractContextManager[float]]
"""Entered around each send of a fenced write (`sluice.runtime.fence.PassFence.writing`): refuses
(`ClusterError`), or gives the seconds the send may take (what is left of the Lease's validity)."""


def load_api_client(
    kubeconfig: str | None = None, connections: int | None = None, retries: int | None = None, abortive: bool = False
) -> k8s.ApiClient:
    """In-cluster configuration when running in a pod, else the kubeconfig ($KUBECONFIG or ~/.kube/config);
    `connections`: keep at least that many open (the client's default is 5 per CPU); `retries`: how often urllib3
    itself sends a request again (None: its default, `Retry(3)`, which also sleeps out a 429's or 503's Retry-After
    for GET, PUT and DELETE, up to six hours, and sends a PUT or DELETE again after a read timeout, which for a
    fenced write ends with the Lease's validity). The operator passes 0: `send` decides, within the deadlines.

    `abortive`: connections are closed with a reset (`SO_LINGER` 0), as the operator's are. urllib3 closes a
    connection whose request timed out; a normal close leaves the request's unacknowledged bytes to the kernel,
    which retransmits them until they get through, so behind a network partition a write given up on when its
    shard's Lease ran out reached the API server after the partition healed, and was applied while another replica
    held the shard (the chaos matrix's replica-partition case; tests/test_late_writes.py). A reset drops them."""
    configuration = k8s.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except k8s_config.ConfigException:
        k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)  # type: ignore[no-untyped-call]
    if connections is not None:
        configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize or 0, connections)
    if retries is not None:
        configuration.retries = retries
    if abortive:
        configuration.socket_options = [*HTTPConnection.default_socket_options, ABORT_ON_CLOSE]
    return k8s.ApiClient(configuration)


ABORT_ON_CLOSE = (socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
"""`SO_LINGER` on with a zero timeout: `close` resets the connection and drops what was not yet acknowledged."""


def operator_api_client(kubeconfig: str | None = None, connections: int | None = None) -> k8s.ApiClient:
    """A client of the operator's: urllib3 sends nothing again by itself (`Retrying` decides, within the
    deadlines), and a connection is aborted when closed, so a write given up on is not delivered later."""
    return load_api_client(kubeconfig, connections, retries=0, abortive=True)


class RetryCounts:
    """Sends after the first and the seconds waited before them, per reason, and the retryable failures given up
    on; added to by the pass threads and the lease thread, read by the operator's metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.retries: dict[Reason, int] = {}
        self.waited: dict[Reason, float] = {}
        self.gave_up: dict[Reason, int] = {}

    def retried(self, reason: Reason, seconds: float) -> None:
        with self._lock:
            self.retries[reason] = self.retries.get(reason, 0) + 1
            self.waited[reason] = self.waited.get(reason, 0.0) + seconds

    def given_up(self, reason: Reason) -> None:
        with self._lock:
            self.gave_up[reason] = self.gave_up.get(reason, 0) + 1

    def totals(self) -> tuple[dict[Reason, int], dict[Reason, float], dict[Reason, int]]:
        """Copies of (retries, waited, gave_up), taken together."""
        with self._lock:
            return dict(self.retries), dict(self.waited), dict(self.gave_up)


@dataclass
class Retrying:
    """How an adapter's requests are sent again: the decision's policy, the budget of an unfenced call, and the
    clock, sleep and random draw (a test steps the clock and seeds the draw)."""

    policy: RetryPolicy = field(default_factory=RetryPolicy)
    budget: float = BUDGET
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    draw: Callable[[], float] = random.random
    counts: RetryCounts = field(default_factory=RetryCounts)


DEFAULT = Retrying()


@dataclass
class Tally:
    """What the requests of one thread's pass met at the API server (`tallied`): the failures that could be sent
    again (a 429, a 5xx, no answer) per reason, whether they were or not, and the seconds spent in `send`
    (answers and back-offs)."""

    met: dict[Reason, int] = field(default_factory=dict)
    seconds: float = 0.0
    slowest: float = 0.0
    """The longest a single send waited for its answer (or its failure)."""


_tallies = threading.local()


@contextlib.contextmanager
def tallied() -> Iterator[Tally]:
    """Count what the current thread's requests meet while inside (a pass runs on one thread)."""
    tally, outer = Tally(), getattr(_tallies, "current", None)
    _tallies.current = tally
    try:
        yield tally
    finally:
        _tallies.current = outer


def _tally() -> Tally | None:
    found: Tally | None = getattr(_tallies, "current", None)
    return found


def retry_after(headers: Mapping[str, str] | None) -> float | None:
    """A `Retry-After` in whole seconds, as client-go's `retryAfterSeconds` reads it (an HTTP date: None)."""
    for key, value in (headers or {}).items():
        if key.lower() == "retry-after":
            found = str(value).strip()
            return float(found) if re.fullmatch(r"[0-9]+", found) else None
    return None


@contextlib.contextmanager
def _within(window: Window | None) -> Iterator[float | None]:
    if window is None:
        yield None
        return
    with window() as seconds:
        yield seconds


def _unanswered(failure: urllib3.exceptions.HTTPError) -> ApiException:
    error = ApiException(status=0, reason=f"no answer: {type(failure).__name__}: {failure}")
    error.__cause__ = failure
    return error


def send(
    fn: Callable[[float | None], T],
    retrying: Retrying = DEFAULT,
    window: Window | None = None,
    after: ApiException | None = None,
) -> T:
    """`fn(timeout)` sent, and sent again after a failure while `next_try` says so; what is not retried is raised
    as an `ApiException` (status 0: no answer). With `window` (a fenced write) each send enters it: refused once
    the shard is not held in the pass's term, the send's timeout is what is left of the validity, and no wait
    ends past it. `after`: the failure an earlier send met (decided on first: its Retry-After is waited out)."""
    clock = retrying.clock
    began = clock()
    try:
        return _send(fn, retrying, window, after, began)
    finally:
        tally = _tally()
        if tally is not None:
            tally.seconds += clock() - began


def _send(
    fn: Callable[[float | None], T], retrying: Retrying, window: Window | None, after: ApiException | None, began: float
) -> T:
    clock = retrying.clock
    deadline = began + retrying.budget
    retries, error, limit = 0, after, deadline
    if after is not None and window is not None:
        with window() as seconds:
            limit = min(deadline, clock() + seconds)
    while True:
        if error is not None:
            _wait_or_raise(error, retries, limit - clock(), retrying)
            retries += 1
        limit = deadline
        sent = clock()
        try:
            with _within(window) as seconds:
                if seconds is not None:
                    limit = min(deadline, clock() + seconds)
                return fn(seconds)
        except ApiException as failure:
            error = failure
        except urllib3.exceptions.HTTPError as failure:  # a timeout, a refused or reset connection
            error = _unanswered(failure)
        finally:
            tally = _tally()
            if tally is not None:
                tally.slowest = max(tally.slowest, clock() - sent)


def _wait_or_raise(error: ApiException, retries: int, left: float, retrying: Retrying) -> None:
    """Wait before sending again as `next_try` says, or raise `error`."""
    lost = Failure(int(error.status or 0), retry_after(error.headers))
    decision = next_try(lost, retries, left, retrying.draw(), retrying.policy)
    reason = reason_of(lost)
    tally = _tally()
    if tally is not None and reason is not None:
        tally.met[reason] = tally.met.get(reason, 0) + 1
    if isinstance(decision, GiveUp):
        if reason is not None:
            retrying.counts.given_up(reason)
            log.info("not sent again (%s): %s %s", decision.why, error.status, error.reason)
        raise error
    retrying.counts.retried(decision.reason, decision.seconds)
    retrying.sleep(decision.seconds)


def call(fn: Callable[[], T], retrying: Retrying = DEFAULT) -> T:
    """`fn` sent as `send` does; what still fails is a `ClusterError`."""
    try:
        return send(lambda _: fn(), retrying)
    except ApiException as failure:
        raise ClusterError(int(failure.status or 0), str(failure.reason or "error")) from failure


def call_within(window: Window | None, fn: Callable[[float | None], T], retrying: Retrying = DEFAULT) -> T:
    """A write within `window` (None: unfenced), its timeout handed to `fn`; what still fails is a
    `ClusterError`."""
    try:
        return send(fn, retrying, window)
    except ApiException as failure:
        raise ClusterError(int(failure.status or 0), str(failure.reason or "error")) from failure


def _raw(answer: object) -> RawAnswer:
    # Asked for with `_preload_content=False`, the client returns urllib3's response, whatever model its
    # annotation names
    return cast(RawAnswer, answer)


def json_answer(answer: object) -> JsonObject:
    # json.loads is untyped: the API server answers with a JSON object (an object, or a list of them in `items`)
    return cast(JsonObject, json.loads(_raw(answer).data))


def listed(answer: object) -> list[JsonObject]:
    """The objects of a list answer."""
    items = json_answer(answer).get("items")
    return [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []


def discard(answer: object) -> None:
    """Read a write's answer and give its connection back, without decoding it: the written object (with its
    managedFields) would be parsed only to be dropped."""
    _raw(answer).data  # noqa: B018 - reading the body is the point
    _raw(answer).release_conn()


def read_service(
    core: k8s.CoreV1Api, namespace: str, name: str, retrying: Retrying = DEFAULT
) -> ObservedService | None:
    try:
        answer = send(lambda _: core.read_namespaced_service(name, namespace, _preload_content=False), retrying)
    except ApiException as failure:
        if failure.status == 404:
            return None
        raise ClusterError(int(failure.status or 0), f"Service {namespace}/{name}: {failure.reason}") from failure
    return observed_service(json_answer(answer))


def read_namespace_labels(core: k8s.CoreV1Api, namespace: str, retrying: Retrying = DEFAULT) -> dict[str, str]:
    answer = call(lambda: core.read_namespace(namespace, _preload_content=False), retrying)
    return strings(json_answer(answer), "metadata", "labels")


def list_sidecars(
    custom: k8s.CustomObjectsApi,
    namespace: str,
    spec: InferencePoolSpec,
    namespaces: frozenset[str] | None,
    retrying: Retrying = DEFAULT,
) -> list[ObservedSidecar]:
    """Every Sidecar the operator may list: cluster-wide, else (`namespaces`, a namespace-scoped install) in the
    pool's, the root and the client namespaces it may read. A Sidecar kind that is not installed lists nothing."""
    if namespaces is None:
        try:
            answer = send(lambda _: custom.list_cluster_custom_object(*SIDECARS, _preload_content=False), retrying)
        except ApiException as failure:
            if failure.status == 404:
                return []  # Istio's Sidecar kind is not installed
            raise ClusterError(int(failure.status or 0), f"Sidecars: {failure.reason}") from failure
        return [observed_sidecar(item) for item in listed(answer)]
    wanted = {namespace, spec.routing.root_namespace, *(spec.routing.client_namespaces or ())} - {".", "*"}
    items: list[JsonObject] = []
    for where in sorted(wanted & namespaces):
        try:
            answer = send(
                lambda _, where=where: custom.list_namespaced_custom_object(  # type: ignore[misc]
                    SIDECARS[0], SIDECARS[1], where, SIDECARS[2], _preload_content=False
                ),
                retrying,
            )
        except ApiException as failure:
            if failure.status == 404:
                return []
            raise ClusterError(int(failure.status or 0), f"Sidecars: {failure.reason}") from failure
        items += listed(answer)
    return [observed_sidecar(item) for item in items]


def read_secret_data(core: k8s.CoreV1Api, namespace: str, name: str, retrying: Retrying = DEFAULT) -> dict[str, str]:
    try:
        secret = send(lambda _: core.read_namespaced_secret(name, namespace), retrying)
    except ApiException as failure:
        raise LookupError(f"Secret {namespace}/{name}: {failure.reason}") from failure
    data = secret.data or {}  # base64 text, as the API sends it
    return {key: value if isinstance(value, str) else value.decode() for key, value in data.items()}


def get_istio_object(
    custom: k8s.CustomObjectsApi, kind: str, namespace: str, name: str, retrying: Retrying = DEFAULT
) -> JsonObject | None:
    k = ISTIO_KINDS[kind]
    try:
        answer = send(
            lambda _: custom.get_namespaced_custom_object(
                k.group, k.version, namespace, k.plural, name, _preload_content=False
            ),
            retrying,
        )
    except ApiException as failure:
        if failure.status == 404:
            return None
        raise ClusterError(int(failure.status or 0), str(failure.reason or "error")) from failure
    return json_answer(answer)


def owned_keys(
    custom: k8s.CustomObjectsApi,
    namespace: str,
    pool: str,
    elsewhere: frozenset[str],
    namespaces: frozenset[str] | None,
    retrying: Retrying = DEFAULT,
) -> list[ObjectKey]:
    """The Istio objects labelled for the pool and managed by sluice in its namespace, and its EnvoyFilter copies
    elsewhere (`Cluster.owned`)."""
    selector = ",".join(f"{k}={v}" for k, v in {**MANAGED_BY, POOL_LABEL: pool}.items())
    keys = []
    for k in ISTIO_KINDS.values():
        answer = call(
            lambda k=k: custom.list_namespaced_custom_object(  # type: ignore[misc]
                k.group, k.version, namespace, k.plural, label_selector=selector, _preload_content=False
            ),
            retrying,
        )
        keys += [ObjectKey(k.kind, text(item, "metadata", "name")) for item in listed(answer)]
    return keys + _envoy_filters_elsewhere(custom, namespace, selector, elsewhere, namespaces, retrying)


def _envoy_filters_elsewhere(
    custom: k8s.CustomObjectsApi,
    namespace: str,
    selector: str,
    elsewhere: frozenset[str],
    namespaces: frozenset[str] | None,
    retrying: Retrying,
) -> list[ObjectKey]:
    """The pool's EnvoyFilter copies outside its namespace: listed cluster-wide by their labels (wherever an
    earlier pass put them), or, in a namespace-scoped install, in the namespaces of `elsewhere` it may read."""
    filters = ISTIO_KINDS["EnvoyFilter"]
    labelled = f"{selector},{POOL_NAMESPACE_LABEL}={namespace}"
    if namespaces is None:
        answer = call(
            lambda: custom.list_cluster_custom_object(
                filters.group, filters.version, filters.plural, label_selector=labelled, _preload_content=False
            ),
            retrying,
        )
        items = listed(answer)
    else:
        unreadable = sorted(elsewhere - namespaces - {namespace})
        if unreadable:
            log.warning("pool %s: EnvoyFilters in %s are outside the watched namespaces", namespace, unreadable)
        items = []
        for where in sorted((elsewhere & namespaces) - {namespace}):
            answer = call(
                lambda where=where: custom.list_namespaced_custom_object(  # type: ignore[misc]
                    filters.group,
                    filters.version,
                    where,
                    filters.plural,
                    label_selector=labelled,
                    _preload_content=False,
                ),
                retrying,
            )
            items += listed(answer)
    return [
        ObjectKey(filters.kind, text(item, "metadata", "name"), text(item, "metadata", "namespace"))
        for item in items
        if text(item, "metadata", "namespace") != namespace
    ]
