"""The Helm chart, rendered by the real Helm library (helm-python-sdk), checked against Kubernetes' own schemas."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

import sluice

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "sluice"
K8S_VERSION = "1.33.0"
# Kinds from other operators' CRDs: not in Kubernetes' schemas (the Prometheus operator's).
EXTERNAL_KINDS = {"ServiceMonitor", "PrometheusRule", "KopfPeering", "ClusterKopfPeering"}

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaced": {"watchNamespaces": ["llm", "ml"], "logLevel": "debug", "jsonLogs": True},
    "monitoring": {
        "metrics": {"port": 9200, "serviceMonitor": {"enabled": True, "labels": {"release": "kps"}}},
        "prometheusRule": {"enabled": True},
        "networkPolicy": {"enabled": True},
        "grafanaDashboard": {"enabled": True},
    },
    "ha-namespaced": {"ha": {"enabled": True}, "replicas": 2, "watchNamespaces": ["llm"]},
    "ha-cluster": {"ha": {"enabled": True, "peeringLifetime": 30}, "replicas": 3},
    "sharded": {"shards": 4, "replicas": 3},
    "bring-your-own": {
        "crds": {"install": False},
        "serviceAccount": {"create": False, "name": "platform-sa"},
        "podDisruptionBudget": {"enabled": False},
        "image": {"repository": "registry.example/sluice", "tag": "0.1.0-rc1"},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
        "extraEnv": [{"name": "TZ", "value": "UTC"}],
    },
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    chart = helm_python.Chart.load(str(CHART))
    try:
        files = chart.render(values, name="sluice", namespace="sluice-system", is_install=True)
    finally:
        chart.close()
    return [doc for text in files.values() for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_chart_lints_without_errors() -> None:
    result = helm_python.lint(str(CHART))
    assert result["errors"] == []
    assert all(m["severity"] < 3 for m in result["messages"]), result["messages"]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_rendered_manifest_is_valid_kubernetes(name: str) -> None:
    docs = render(VALUE_SETS[name])
    assert by_kind(docs, "Deployment")
    for doc in docs:
        if doc["kind"] in EXTERNAL_KINDS:
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize(
    "values",
    [
        {"replicas": 2},
        {"ha": {"enabled": True, "peeringLifetime": 1}},
        {"logLevel": "verbose"},
        {"watchNamespaces": ["Bad_NS"]},
        {"metrics": {"port": 8080}},
        {"unknownKey": True},
        {"image": {"pullPolicy": "Sometimes"}},
        {"shards": 4, "replicas": 2, "ha": {"enabled": True}},
        {"shards": 0},
    ],
    ids=[
        "two-replicas-without-ha",
        "short-lifetime",
        "log-level",
        "namespace-name",
        "port-clash",
        "unknown-key",
        "pull-policy",
        "shards-with-peering",
        "zero-shards",
    ],
)
def test_values_schema_rejects_bad_values(values: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmError):
        render(values)


def test_chart_crd_equals_the_contract_and_is_kept_on_uninstall() -> None:
    crd = by_kind(render({}), "CustomResourceDefinition")[0]
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    contract = yaml.safe_load((ROOT / "crds" / "inference.sluice.dev_inferencepools.yaml").read_text())
    crd["metadata"].pop("annotations")
    assert crd == contract
    assert not by_kind(render({"crds": {"install": False}}), "CustomResourceDefinition")


def test_app_version_and_image_tag_follow_the_package_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == sluice.__version__
    deployment = by_kind(render({}), "Deployment")[0]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"].endswith(f":{sluice.__version__}")


def test_the_operator_runs_with_secure_defaults() -> None:
    pod = by_kind(render({}), "Deployment")[0]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = pod["containers"][0]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["limits"]
    assert container["resources"]["requests"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_namespaced_mode_grants_roles_only_in_the_watched_namespaces() -> None:
    docs = render({"watchNamespaces": ["llm", "ml"]})
    assert {r["metadata"]["namespace"] for r in by_kind(docs, "Role")} == {"llm", "ml"}
    cluster_roles = by_kind(docs, "ClusterRole")
    assert [r["metadata"]["name"] for r in cluster_roles] == ["sluice-sluice-discovery"]
    resources = {res for rule in cluster_roles[0]["rules"] for res in rule["resources"]}
    assert resources == {"customresourcedefinitions", "namespaces"}
    args = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=llm" in args
    assert "--namespace=ml" in args


def rules_of(docs: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) granted by every Role and ClusterRole."""
    granted = set()
    for doc in docs:
        if doc["kind"] in ("Role", "ClusterRole"):
            for rule in doc["rules"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        for verb in rule["verbs"]:
                            granted.add((group, resource, verb))
    return granted


def test_no_rule_grants_wildcards_or_writes_to_workloads() -> None:
    granted = rules_of(render({}))
    assert not any("*" in part for rule in granted for part in rule)
    assert not any(
        resource in ("deployments", "pods", "secrets") and verb not in ("get", "list", "watch")
        for _, resource, verb in granted
    )


def test_ha_runs_replicas_with_peering_and_grants_only_peering_on_top() -> None:
    docs = render({"ha": {"enabled": True}, "replicas": 2, "watchNamespaces": ["llm"]})
    deployment = by_kind(docs, "Deployment")[0]
    assert deployment["spec"]["replicas"] == 2
    assert "--peering=sluice" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [p["metadata"]["namespace"] for p in by_kind(docs, "KopfPeering")] == ["llm"]
    crds = {c["metadata"]["name"] for c in by_kind(docs, "CustomResourceDefinition")}
    assert "kopfpeerings.kopf.dev" in crds
    extra = rules_of(docs) - rules_of(render({"watchNamespaces": ["llm"]}))
    assert extra == {("kopf.dev", "kopfpeerings", verb) for verb in ("get", "list", "watch", "patch")}


def test_the_dashboard_only_queries_metrics_the_operator_exports() -> None:
    import re  # noqa: PLC0415

    from sluice.runtime.metrics import OperatorMetrics  # noqa: PLC0415

    config = by_kind(render({"grafanaDashboard": {"enabled": True}}), "ConfigMap")[0]
    dashboard = json.loads(config["data"]["sluice.json"])
    exported = {m.name for m in OperatorMetrics().registry.collect()}
    exported |= {f"{name}_total" for name in exported} | {f"{name}_bucket" for name in exported}
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\b(sluice_[a-z_]+)", target["expr"])
    }
    assert queried
    assert queried <= exported, queried - exported
    # a series selected by pool must have the label (an operator-wide histogram selected by pool shows nothing)
    metrics = OperatorMetrics()
    labels = {m._name: set(m._labelnames) for m in vars(metrics).values() if hasattr(m, "_labelnames")}
    by_pool = {
        re.sub(r"_(bucket|total|count|sum)$", "", name)
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\b(sluice_[a-z_]+)\{pool=", target["expr"])
    }
    assert by_pool
    assert all("pool" in labels[name] for name in by_pool), {name: labels[name] for name in by_pool}


def test_sharded_replicas_run_with_shards_and_may_only_use_leases_in_their_namespace() -> None:
    docs = render({"shards": 4, "replicas": 3})
    deployment = by_kind(docs, "Deployment")[0]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--shards=4" in args
    assert "--lease-namespace=sluice-system" in args
    assert not any(a.startswith("--peering") for a in args)
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    leases = [d for d in by_kind(docs, "Role") if any("leases" in r["resources"] for r in d["rules"])]
    assert [d["metadata"]["namespace"] for d in leases] == ["sluice-system"]
    assert rules_of(docs) - rules_of(render({})) == {
        ("coordination.k8s.io", "leases", verb) for verb in ("list", "create", "update", "delete")
    }
    assert not any(r[1] == "leases" for r in rules_of(render({})))


def test_sharded_lease_calls_get_a_priority_level_of_their_own() -> None:
    """With shards, a FlowSchema puts exactly the operator's Lease calls (its service account, the verbs it uses,
    the release namespace) in `leader-election`; none without shards or when turned off."""
    docs = render({"shards": 4, "replicas": 3})
    (schema,) = by_kind(docs, "FlowSchema")
    spec = schema["spec"]
    assert spec["priorityLevelConfiguration"] == {"name": "leader-election"}
    assert spec["matchingPrecedence"] == 200
    (rule,) = spec["rules"]
    (account,) = by_kind(docs, "ServiceAccount")
    assert rule["subjects"] == [
        {
            "kind": "ServiceAccount",
            "serviceAccount": {"name": account["metadata"]["name"], "namespace": "sluice-system"},
        }
    ]
    (resources,) = rule["resourceRules"]
    assert resources["namespaces"] == ["sluice-system"]
    granted = {r[2] for r in rules_of(docs) if r[1] == "leases"}
    assert set(resources["verbs"]) == granted, "the schema covers the Lease verbs the operator is granted, no more"
    assert not by_kind(render({}), "FlowSchema")
    assert not by_kind(
        render(
            {
                "shards": 4,
                "replicas": 3,
                "leasePriority": {"enabled": False, "priorityLevel": "x", "matchingPrecedence": 200},
            }
        ),
        "FlowSchema",
    )


def test_the_dashboards_refusals_select_what_the_operator_reads() -> None:
    """The panel beside sluice's own refused rate reads Istio's counter with the same flags the preset does."""
    from sluice.core.engines import SIDECAR_REFUSED_FLAGS  # noqa: PLC0415

    config = by_kind(render({"grafanaDashboard": {"enabled": True}}), "ConfigMap")[0]
    dashboard = json.loads(config["data"]["sluice.json"])
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    istio = [expr for expr in exprs if "istio_requests_total" in expr]
    assert istio
    assert 'sluice_pool_refused_rate{pool=~"$pool"}' in exprs
    assert all(f'response_flags=~"{SIDECAR_REFUSED_FLAGS}"' in e and 'reporter="destination"' in e for e in istio)
