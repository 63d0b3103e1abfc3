"""The ports the reconcile loop talks through: the cluster and the signal source. Types only.

`sluice.runtime.reconciler.Reconciler(cluster, signals)` is the one reconcile loop; what is behind the ports
decides where it runs: the Kubernetes API and Prometheus for the operator (`sluice.io.kube`, `sluice.io.prometheus`),
memory for tests and the simulation (`sluice.io.memory`), an EDS file for the real-Envoy benchmark. Adapters
translate their own errors into `ClusterError`, so the loop knows no client library.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal, Protocol

from sluice.api.v1alpha1 import InferencePoolSpec, InferencePoolStatus
from sluice.core.events import Event
from sluice.core.observed import ObservedMesh, ObservedPod, SignalSnapshot
from sluice.istio.rendered import Rendered

WriteAction = Literal["created", "updated", "unchanged", "refused", "pruned", "restored"]


@dataclass(frozen=True)
class WriteResult:
    kind: str
    name: str
    action: WriteAction
    message: str = ""


@dataclass(frozen=True)
class PromAuth:
    """Credentials for Prometheus, resolved from the pool's Secrets."""

    bearer_token: str | None = None
    ca_pem: str | None = None
    insecure_skip_verify: bool = False


@dataclass(frozen=True)
class ObjectKey:
    kind: str
    name: str
    namespace: str | None = None
    """None: the pool's namespace; set for an EnvoyFilter written for clients in another namespace."""


class ClusterError(Exception):
    """The cluster refused or failed a call: the HTTP status (0 when none came back) and a short reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status} {reason}")
        self.status = status
        self.reason = reason


class Cluster(Protocol):
    def pods(self, namespace: str, match_labels: dict[str, str]) -> list[ObservedPod]:
        """The pods matching the selector, as the core sees them."""

    def secret_key(self, namespace: str, name: str, key: str) -> str:
        """One key of a Secret; LookupError when the Secret or the key is missing."""

    def apply(self, desired: Rendered, pool_uid: str | None, adopt: bool) -> WriteResult:
        """Write `desired` if it differs and sluice may (ours, or adopted when `adopt`); refuse a foreign one."""

    def mesh(self, namespace: str, spec: InferencePoolSpec) -> ObservedMesh | None:
        """The pool's Service, its namespace's labels and the Sidecars of its clients (None: not observed here);
        a failed read is `ObservedMesh(failed=...)`, never raised."""

    def owned(self, namespace: str, pool: str, elsewhere: frozenset[str] = frozenset()) -> list[ObjectKey]:
        """Every Istio object labelled for this pool and managed by sluice (ours and adopted), in its namespace
        and the EnvoyFilters it wrote in the namespaces `elsewhere`."""

    def release(self, namespace: str, key: ObjectKey) -> WriteResult:
        """Stop owning an object (in `key.namespace`, else `namespace`): delete ours, give an adopted one its
        original back."""

    def write_status(self, namespace: str, name: str, status: InferencePoolStatus) -> None:
        """Write the pool's status subresource as `status` says it (serialized here, at the edge)."""

    def emit(self, namespace: str, name: str, uid: str | None, event: Event) -> None: ...


class SignalSource(Protocol):
    def read_signals(
        self, spec: InferencePoolSpec, namespace: str, pod_names: list[str], auth: PromAuth, now: datetime
    ) -> SignalSnapshot:
        """One round of the pool's queries; failures are kept per signal, never raised."""
