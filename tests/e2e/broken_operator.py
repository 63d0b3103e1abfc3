"""The operator with one defect put in on purpose: `python -m tests.e2e.broken_operator DEFECT [sluice arguments]`.

For showing that each invariant checker of `sluice.devstack.invariants` fails when the operator breaks the rule it
checks (`tests/e2e/test_broken_operator.py`; (e), which needs sharded replicas, in
`tests/e2e/test_broken_operator_shards.py`): a green fault matrix then means something. Each defect patches the
Kubernetes adapter (`sluice.io.kube`) or the runtime (`sluice.runtime`) before the operator starts; nothing in the
operator knows of them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from sluice.api.jsontypes import JsonObject
from sluice.api.snapshot import PoolSnapshot
from sluice.core.observed import ObservedPod
from sluice.core.reconcile import Plan
from sluice.io import kube
from sluice.io.ports import Cluster, WriteResult
from sluice.istio.ownership import Decision
from sluice.istio.rendered import Rendered
from sluice.runtime import fence, reconciler, snapshots


def pods_never_forgotten() -> None:
    """(a) A pod cache that never drops a deleted pod: its endpoint stays in the ServiceEntry."""
    real = kube.KubeCluster.pods
    seen: dict[tuple[str, str], ObservedPod] = {}

    def pods(self: kube.KubeCluster, namespace: str, match_labels: dict[str, str]) -> list[ObservedPod]:
        for pod in real(self, namespace, match_labels):
            seen[(namespace, pod.name)] = pod
        return [pod for (where, _), pod in seen.items() if where == namespace]

    kube.KubeCluster.pods = pods  # type: ignore[method-assign]


def foreign_taken() -> None:
    """(b) An ownership check that reads a foreign object as absent: sluice writes over it."""
    real = kube.decide

    def decide(live: Mapping[str, object] | None, desired: JsonObject, pool_uid: str | None, adopt: bool) -> Decision:
        if live is not None and kube.ownership(live, pool_uid) == "foreign":
            live = None
        return real(live, desired, pool_uid, adopt)

    kube.decide = decide


def recreated_each_pass() -> None:
    """(c) Each write deletes the object first and creates it again."""
    real = kube.KubeCluster.apply

    def apply(self: kube.KubeCluster, desired: Rendered, pool_uid: str | None, adopt: bool) -> WriteResult:
        namespace, kind, name = desired.namespace, desired.kind, desired.name
        live = kube.get_istio_object(self.custom, kind, namespace, name, self.retrying)
        if live is not None and kube.ownership(live, pool_uid) == "ours":
            k = kube.ISTIO_KINDS[kind]
            self.custom.delete_namespaced_custom_object(k.group, k.version, namespace, k.plural, name)
            self._verified.pop((namespace, kind, name), None)
        return real(self, desired, pool_uid, adopt)

    kube.KubeCluster.apply = apply  # type: ignore[method-assign]


def canary_forgotten() -> None:
    """(d) The stored canary progress not read on the first pass after a start: the rollout begins again at its
    first step (a step repeated)."""
    real = snapshots.parse_snapshot
    started: set[str] = set()

    def parse_snapshot(body: Mapping[str, object]) -> PoolSnapshot:
        snapshot = real(body)
        if snapshot.key in started or snapshot.status is None or snapshot.status.canary is None:
            return snapshot
        started.add(snapshot.key)
        return replace(snapshot, status=snapshot.status.model_copy(update={"canary": None}))

    snapshots.parse_snapshot = parse_snapshot


def fence_removed() -> None:
    """(e) A pass's writes not fenced (`sluice.runtime.fence`): each goes whatever the term of the pool's shard or its
    Lease's validity, with no timeout, as an unsharded operator's writes go. The replica still stops passing a pool
    once its shard lapsed on its own clock; a write it sent before that but after the API server became unreachable
    waits, and lands once the network heals, while another replica holds the shard; the pass then goes on writing."""

    def around(self: fence.PassFence, cluster: Cluster) -> Cluster:
        return cluster

    fence.PassFence.around = around  # type: ignore[method-assign,assignment]


def reweighted_while_blind() -> None:
    """(f) A pass blind to its metrics (`MetricsAvailable=False`) re-weights anyway: every endpoint at the same
    weight, as a controller that falls back to an even split when it cannot see would."""
    real = reconciler.plan_pass

    def plan_pass(*args: Any, **kwargs: Any) -> Plan:
        plan = real(*args, **kwargs)
        if not any(c.type == "MetricsAvailable" and c.status == "False" for c in plan.status.conditions):
            return plan
        return replace(plan, endpoints=tuple(replace(e, weight=1) for e in plan.endpoints))

    reconciler.plan_pass = plan_pass


DEFECTS: dict[str, Callable[[], None]] = {
    "pods-never-forgotten": pods_never_forgotten,
    "foreign-taken": foreign_taken,
    "recreated-each-pass": recreated_each_pass,
    "canary-forgotten": canary_forgotten,
    "fence-removed": fence_removed,
    "reweighted-while-blind": reweighted_while_blind,
}


def main(argv: list[str]) -> int:
    from sluice.cli import main as cli  # noqa: PLC0415 (after the patch, as the operator would run)

    DEFECTS[argv[0]]()
    return cli(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
