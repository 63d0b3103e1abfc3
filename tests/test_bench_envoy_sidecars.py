"""The real data-plane benchmark's sidecars (`sluice-admission`): each EnvoyFilter sluice applies reaches the
sidecars of the class it selects, as istiod would push it, and nothing else."""

from __future__ import annotations

from pathlib import Path

import yaml

from sluice.bench.envoy import EdsFileCluster, Sidecar
from sluice.devstack.kubelet import PodSpec
from sluice.istio.envoyfilters import render_inbound_envoy_filters
from sluice.istio.objects import PoolRef
from tests.helpers import spec

POOL = PoolRef("bench", "bench", "bench-pool")


def _sidecars(tmp_path: Path) -> list[Sidecar]:
    out = []
    for name, hardware, ip in (("a100-0", "a100", "127.0.30.1"), ("cpu-0", "cpu", "127.0.30.3")):
        workdir = tmp_path / name
        workdir.mkdir()
        sidecar = Sidecar(PodSpec(name, hardware, "v1", ip), 18000, workdir)
        sidecar.configure([], 0.0)
        out.append(sidecar)
    return out


def _resource(path: Path) -> dict:
    (resource,) = yaml.safe_load(path.read_text())["resources"]
    return resource


def test_an_envoy_filter_reaches_the_sidecars_of_its_class_only(tmp_path: Path) -> None:
    s = spec(admission={"mode": "Enforce"})
    a100, cpu = _sidecars(tmp_path)
    cluster = EdsFileCluster(tmp_path, [a100, cpu], s.capacity.class_label)
    (envoy_filter,) = render_inbound_envoy_filters(POOL, s, {"a100": 12}, {})
    cluster.apply(envoy_filter, "bench-pool", False)
    thresholds = _resource(a100.workdir / "cds.yaml")["circuit_breakers"]["thresholds"]
    assert [t.get("priority", "DEFAULT") for t in thresholds] == ["DEFAULT", "HIGH"]
    assert thresholds[1]["max_requests"] == 12
    listener = _resource(a100.workdir / "lds.yaml")
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    route = manager["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["priority"] == "HIGH"
    assert listener["address"]["socket_address"] == {"address": "127.0.30.1", "port_value": 18000}
    assert [limit for _, limit in a100.limits] == [None, 12]
    assert [limit for _, limit in cpu.limits] == [None]  # not its class: untouched
    assert len(_resource(cpu.workdir / "cds.yaml")["circuit_breakers"]["thresholds"]) == 1


def test_a_sidecars_refusals_are_read_from_its_access_log(tmp_path: Path) -> None:
    (sidecar, _) = _sidecars(tmp_path)
    (sidecar.workdir / "access.log").write_text("200 -\n503 UO\n503 UO\n503 UF\n200 -\n")
    assert sidecar.refused() == 2
