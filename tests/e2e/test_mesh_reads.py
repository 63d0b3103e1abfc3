"""The mesh side read and written through the real Kubernetes client against the API emulator.

`KubeCluster.mesh` reads the pool's Service, its namespace's labels and every Sidecar as kube-apiserver serves them
(objects made with the real kubectl); a pass writes the EnvoyFilters into each client namespace (validated by
Istio 1.30.3's CRD schema and CEL in the emulator), and the pool's deletion handler removes the copies outside the
pool's namespace, which no ownerReference can reach.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from sluice.api.snapshot import parse_snapshot
from sluice.core.observed import ObservedPod
from sluice.devstack.stack import Stack
from sluice.io.kube import KubeCluster
from sluice.io.kubereads import load_api_client
from sluice.runtime import handlers
from sluice.runtime.config import OperatorConfig
from sluice.runtime.reconciler import Reconciler
from tests.helpers import at
from tests.test_reconciler import FakeProm

pytestmark = pytest.mark.slow

OBJECTS = """
apiVersion: v1
kind: Namespace
metadata: {name: team-a}
---
apiVersion: v1
kind: Namespace
metadata: {name: edge}
---
apiVersion: v1
kind: Service
metadata:
  name: llama
  namespace: llm
  annotations: {networking.istio.io/exportTo: "., team-a, edge"}
spec:
  selector: {app: llama}
  ports: [{name: web, appProtocol: kubernetes.io/h2c, port: 8000, targetPort: 8000}]
---
apiVersion: networking.istio.io/v1
kind: Sidecar
metadata: {name: default, namespace: team-a}
spec:
  egress: [{hosts: ["./*", "istio-system/*"]}]
---
apiVersion: inference.sluice.dev/v1alpha1
kind: InferencePool
metadata: {name: llama, namespace: llm}
spec:
  selector: {matchLabels: {app: llama}}
  targetPort: 8000
  service: llama
  routing:
    leastRequest: {}
    clientNamespaces: [team-a, edge]
    gateways: [mesh, edge/public]
"""
LABELS = {"app": "llama", "sluice.dev/hardware-class": "a100"}
PODS = [
    ObservedPod(name="a", ip="10.0.0.1", labels={**LABELS, "security.istio.io/tlsMode": "istio"}),
    ObservedPod(name="b", ip="10.0.0.2", labels=LABELS),
]


class KnownPods(KubeCluster):
    """The real adapter, with the pool's pods given (the emulator runs no kubelet to make them Ready)."""

    def pods(self, namespace: str, match_labels: dict[str, str]) -> list[ObservedPod]:
        return list(PODS)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(Path(tmp_path_factory.mktemp("mesh")), deadline_seconds=300)
    stack.workdir.mkdir(parents=True, exist_ok=True)
    try:
        stack.start_apiserver()
        stack.kubectl("apply", "-f", "-", stdin=OBJECTS)
        yield stack
    finally:
        stack.close()


def envoy_filters(stack: Stack) -> dict[str, dict[str, Any]]:
    found = yaml.safe_load(stack.kubectl("get", "envoyfilters", "-A", "-o", "yaml").stdout)
    return {f"{o['metadata']['namespace']}/{o['metadata']['name']}": o for o in found["items"]}


def test_a_pass_reads_the_mesh_side_writes_each_client_namespace_and_deletion_cleans_up(api: Stack) -> None:
    cluster = KnownPods(load_api_client(str(api.kubeconfig)))
    body = yaml.safe_load(api.kubectl("get", "slp", "llama", "-n", "llm", "-o", "yaml").stdout)
    snapshot = parse_snapshot(body)
    assert snapshot.spec is not None
    mesh = cluster.mesh("llm", snapshot.spec)
    assert mesh is not None
    assert mesh.failed is None, mesh
    assert mesh.service is not None
    assert mesh.service.ports[0].app_protocol == "kubernetes.io/h2c"
    assert [(s.namespace, s.name) for s in mesh.sidecars] == [("team-a", "default")]

    report = Reconciler(cluster, FakeProm()).run(snapshot, at(0))
    assert report.status is not None
    reach = next(c for c in report.status.conditions if c.type == "MeshReach")
    assert (reach.status, reach.reason) == ("False", "HiddenBySidecar"), reach
    assert "Sidecar team-a/default hides" in reach.message
    assert [w.action for w in report.writes if w.action not in ("created", "unchanged")] == []

    entry = yaml.safe_load(api.kubectl("get", "serviceentries", "sluice-llama", "-n", "llm", "-o", "yaml").stdout)
    assert entry["spec"]["ports"][0]["protocol"] == "HTTP2"  # the Service's appProtocol, as Istio reads it
    assert entry["spec"]["exportTo"] == [".", "edge", "team-a"]
    modes = {e["address"]: e["labels"]["security.istio.io/tlsMode"] for e in entry["spec"]["endpoints"]}
    assert modes == {"10.0.0.1": "istio", "10.0.0.2": "disabled"}
    filters = envoy_filters(api)
    assert set(filters) == {"llm/sluice-llama-lb", "team-a/sluice-llama.llm-lb", "edge/sluice-llama.llm-lb"}
    assert "ownerReferences" not in filters["team-a/sluice-llama.llm-lb"]["metadata"]

    status = yaml.safe_load(api.kubectl("get", "slp", "llama", "-n", "llm", "-o", "yaml").stdout)["status"]
    assert status["mesh"]["envoyFilterNamespaces"] == ["edge", "llm", "team-a"]
    runtime = handlers.Runtime(config=OperatorConfig())
    runtime.cluster = cluster
    deleted = handlers.pool_deleted(
        name="llama", namespace="llm", memo=SimpleNamespace(runtime=runtime), uid=body["metadata"]["uid"], status=status
    )
    asyncio.run(deleted)
    assert envoy_filters(api) == {}
