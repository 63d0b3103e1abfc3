"""The Helm chart installed, run, upgraded and uninstalled on the local stack through the real Helm library.

`helm-python-sdk` is Helm 4's Go SDK: it talks to the API emulator as Helm talks to a cluster (discovery, the
CRD, server-side apply of every rendered object, its release Secrets). The operator then runs with exactly the
container arguments of the Deployment the chart rendered, authenticated as the chart's service account (a token
from the TokenRequest API), so the chart's RBAC is enforced on every call: a permission the chart forgot is a 403
in the audit log and a failed test. The tests run in file order on one stack, as an operator's admin would.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.devstack.kubelet import PodSpec
from sluice.devstack.stack import ROOT, Stack, free_port
from tests.e2e.conftest import BASE_PODS, Background, audit_trail, condition, module_stack, pool_manifest, wait_until

helm = pytest.importorskip("helm_python")
pytestmark = pytest.mark.slow

RELEASE, NAMESPACE = "sluice", "sluice-system"
METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, background: Background) -> Iterator[Stack]:
    yield from module_stack(Path(tmp_path_factory.mktemp("helm")), background, [], sluice_crd=None)


@pytest.fixture(scope="module")
def chart_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the chart, so the upgrade can change its CRD as a new chart version would."""
    target = Path(tmp_path_factory.mktemp("chart")) / "sluice"
    shutil.copytree(ROOT / "charts" / "sluice", target)
    return target


@pytest.fixture(scope="module")
def helm_config(stack: Stack) -> Any:
    return helm.Config(kubeconfig_path=str(stack.kubeconfig), namespace=NAMESPACE)


def values(**extra: Any) -> dict[str, Any]:
    return {"metrics": {"port": METRICS_PORT}, **extra}


def get(stack: Stack, *args: str) -> dict[str, Any] | None:
    result = stack.kubectl("get", *args, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def release_secrets(stack: Stack) -> dict[str, dict[str, str]]:
    found = get(stack, "secrets", "-n", NAMESPACE, "-l", "owner=helm")
    return {item["metadata"]["name"]: item["metadata"]["labels"] for item in (found or {}).get("items", [])}


def rendered_objects(manifest: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(manifest) if doc]


def start_operator_as_the_chart_deploys_it(stack: Stack) -> subprocess.Popen[bytes]:
    """`sluice` with the Deployment's container args, as its service account, on loopback ports."""
    deployment = get(stack, "deployment", f"{RELEASE}-sluice", "-n", NAMESPACE)
    assert deployment is not None
    pod = deployment["spec"]["template"]["spec"]
    args = list(pod["containers"][0]["args"])
    # A pod listens on every address; here everything stays on loopback (the only change to the arguments).
    args = [a.replace("--liveness=http://0.0.0.0:8080", f"--liveness=http://127.0.0.1:{free_port()}") for a in args]
    args.append("--metrics-address=127.0.0.1")
    token = stack.kubectl("create", "token", pod["serviceAccountName"], "-n", NAMESPACE).stdout.strip()
    config = yaml.safe_load(stack.kubeconfig.read_text())
    config["users"][0]["user"]["token"] = token
    kubeconfig = stack.workdir / "operator.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))
    stack.operator = stack.spawn([sys.executable, "-m", "sluice", *args], "operator.log", kubeconfig=kubeconfig)
    return stack.operator


def deployed(helm_config: Any) -> bool:
    return any(r["name"] == RELEASE for r in helm_config.list())


def ensure_installed(helm_config: Any, chart_dir: Path, **extra: Any) -> None:
    """The release as an earlier test of the module leaves it, installed with `extra` if it is not: each test
    also runs alone."""
    if not deployed(helm_config):
        chart = helm.Chart.load(str(chart_dir))
        helm_config.install(chart, RELEASE, values(**extra), namespace=NAMESPACE, create_namespace=True, timeout=60)


def ensure_uninstalled(stack: Stack, helm_config: Any) -> None:
    if deployed(helm_config):
        stack.stop_operator()
        helm_config.uninstall(RELEASE, timeout=60)


def ensure_pool(stack: Stack) -> None:
    """The llama pool and its stable pods, as the canary test leaves them (the CRD is the chart's)."""
    for pod in BASE_PODS[:2]:
        if pod.name not in stack.pods:
            stack.add_pod(pod)
    if get(stack, "slp", "llama", "-n", "llm") is None:
        stack.kubectl("apply", "-f", "-", stdin=pool_manifest(stack))


def start_operator_and_wait_for_a_pass(stack: Stack, what: str) -> None:
    """Start the operator as the chart deploys it and wait until it has stamped the llama pool's status."""
    before = (get(stack, "slp", "llama", "-n", "llm") or {}).get("status", {}).get("lastReconcileTime", "")
    start_operator_as_the_chart_deploys_it(stack)
    wait_until(
        lambda: (get(stack, "slp", "llama", "-n", "llm") or {})["status"]["lastReconcileTime"] > before,
        60,
        what,
    )


def forbidden_calls(stack: Stack) -> list[dict[str, str]]:
    user = f"system:serviceaccount:{NAMESPACE}:{RELEASE}-sluice"
    return [e for e in audit_trail(stack) if e.get("user") == user and e.get("decision") == "forbid"]


def test_helm_install_creates_every_rendered_object_and_its_release_secret(
    stack: Stack, helm_config: Any, chart_dir: Path
) -> None:
    release = helm_config.install(
        helm.Chart.load(str(chart_dir)), RELEASE, values(), namespace=NAMESPACE, create_namespace=True, timeout=60
    )
    assert release["status"] == "deployed"
    for obj in rendered_objects(release["manifest"]):
        namespace = ["-n", obj["metadata"]["namespace"]] if obj["metadata"].get("namespace") else []
        live = get(stack, obj["kind"].lower(), obj["metadata"]["name"], *namespace)
        assert live is not None, f"{obj['kind']} {obj['metadata']['name']} was not created"
        assert live["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        assert live["metadata"]["annotations"]["meta.helm.sh/release-name"] == RELEASE
    secrets = release_secrets(stack)
    assert secrets[f"sh.helm.release.v1.{RELEASE}.v1"]["status"] == "deployed"
    assert "inferencepools" in stack.kubectl("api-resources", "--api-group=inference.sluice.dev").stdout
    assert [r["name"] for r in helm_config.list()] == [RELEASE]


def test_the_operator_runs_a_canary_under_the_charts_rbac_with_the_deployments_args(
    stack: Stack, background: Background, helm_config: Any, chart_dir: Path
) -> None:
    ensure_installed(helm_config, chart_dir)
    for pod in [*BASE_PODS[:2], PodSpec("llama-v2-a100-0", "a100", "v2", "127.0.20.5")]:
        stack.add_pod(pod)
    start_operator_as_the_chart_deploys_it(stack)
    stack.kubectl(
        "apply",
        "-f",
        "-",
        stdin=pool_manifest(stack).replace("stableRevision: v1", "stableRevision: v1\n    candidateRevision: v2"),
    )
    pool = wait_until(
        lambda: (
            ((get(stack, "slp", "llama", "-n", "llm") or {}).get("status", {}).get("canary") or {}).get("weight", 0)
            >= 10
            and get(stack, "slp", "llama", "-n", "llm")
        ),
        60,
        "the canary's first step, by the operator running as the chart's service account",
    )
    assert condition(pool, "IstioSynced")["status"] == "True"
    assert stack.istio("serviceentries", "sluice-llama") is not None
    assert forbidden_calls(stack) == []
    account = f"--as=system:serviceaccount:{NAMESPACE}:{RELEASE}-sluice"
    can_i = stack.kubectl("auth", "can-i", "create", "serviceentries.networking.istio.io", "-n", "llm", account)
    assert can_i.stdout.strip() == "yes"


def test_helm_upgrade_applies_changed_values_and_an_updated_crd(
    stack: Stack, helm_config: Any, chart_dir: Path
) -> None:
    ensure_installed(helm_config, chart_dir)
    ensure_pool(stack)  # its printer columns are read on a pool
    crd_file = chart_dir / "files" / "inference.sluice.dev_inferencepools.yaml"
    crd = yaml.safe_load(crd_file.read_text())
    crd["spec"]["versions"][0]["additionalPrinterColumns"].append(
        {"name": "Engine", "type": "string", "jsonPath": ".spec.engine"}
    )
    crd_file.write_text(yaml.safe_dump(crd, sort_keys=False))
    release = helm_config.upgrade(
        helm.Chart.load(str(chart_dir)),
        RELEASE,
        values(logLevel="debug", podDisruptionBudget={"enabled": False}),
        namespace=NAMESPACE,
        timeout=60,
    )
    assert (release["revision"], release["status"]) == (2, "deployed")
    secrets = release_secrets(stack)
    assert secrets[f"sh.helm.release.v1.{RELEASE}.v1"]["status"] == "superseded"
    assert secrets[f"sh.helm.release.v1.{RELEASE}.v2"]["status"] == "deployed"
    deployment = get(stack, "deployment", f"{RELEASE}-sluice", "-n", NAMESPACE)
    assert deployment is not None
    assert "--log-level=debug" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert get(stack, "poddisruptionbudget", f"{RELEASE}-sluice", "-n", NAMESPACE) is None
    assert "ENGINE" in stack.kubectl("get", "inferencepools", "-n", "llm").stdout
    assert forbidden_calls(stack) == []


def test_helm_uninstall_removes_the_release_and_keeps_the_crd_and_the_pools(
    stack: Stack, helm_config: Any, chart_dir: Path
) -> None:
    ensure_installed(helm_config, chart_dir)
    ensure_pool(stack)
    stack.stop_operator()
    helm_config.uninstall(RELEASE, timeout=60)
    assert release_secrets(stack) == {}
    assert get(stack, "deployment", f"{RELEASE}-sluice", "-n", NAMESPACE) is None
    assert get(stack, "clusterrole", f"{RELEASE}-sluice") is None
    assert get(stack, "serviceaccount", f"{RELEASE}-sluice", "-n", NAMESPACE) is None
    assert get(stack, "crd", "inferencepools.inference.sluice.dev") is not None  # helm.sh/resource-policy: keep
    assert get(stack, "slp", "llama", "-n", "llm") is not None


def test_a_namespaced_install_runs_the_operator_with_roles_in_the_watched_namespace_only(
    stack: Stack, helm_config: Any, chart_dir: Path
) -> None:
    ensure_uninstalled(stack, helm_config)
    if get(stack, "namespace", NAMESPACE) is None:  # the first install created it
        stack.kubectl("create", "namespace", NAMESPACE)
    helm_config.install(
        helm.Chart.load(str(chart_dir)), RELEASE, values(watchNamespaces=["llm"]), namespace=NAMESPACE, timeout=60
    )
    assert get(stack, "clusterrole", f"{RELEASE}-sluice") is None
    assert get(stack, "role", f"{RELEASE}-sluice", "-n", "llm") is not None
    ensure_pool(stack)
    start_operator_and_wait_for_a_pass(stack, "a pass by the operator watching only llm")
    assert forbidden_calls(stack) == []
    account = f"--as=system:serviceaccount:{NAMESPACE}:{RELEASE}-sluice"
    elsewhere = stack.kubectl("auth", "can-i", "patch", "inferencepools", "-n", "default", account, check=False)
    assert elsewhere.stdout.strip() == "no"


def test_a_sharded_upgrade_runs_the_operator_on_its_shard_leases_in_the_release_namespace(
    stack: Stack, helm_config: Any, chart_dir: Path
) -> None:
    """`shards: 2` through Helm: the chart's FlowSchema is accepted, and the operator it deploys takes both shard
    Leases in the release namespace and runs the pool with the Lease verbs the chart grants and no others."""
    ensure_installed(helm_config, chart_dir, watchNamespaces=["llm"])
    ensure_pool(stack)
    stack.stop_operator()
    release = helm_config.upgrade(
        helm.Chart.load(str(chart_dir)),
        RELEASE,
        values(watchNamespaces=["llm"], shards=2),
        namespace=NAMESPACE,
        timeout=60,
    )
    assert release["status"] == "deployed"
    schema = get(stack, "flowschema", f"{RELEASE}-sluice-leases")
    assert schema is not None
    assert schema["spec"]["priorityLevelConfiguration"]["name"] == "leader-election"
    (subject,) = schema["spec"]["rules"][0]["subjects"]
    assert subject["serviceAccount"] == {"name": f"{RELEASE}-sluice", "namespace": NAMESPACE}
    start_operator_and_wait_for_a_pass(stack, "a pass by the sharded operator")
    leases = (get(stack, "leases", "-n", NAMESPACE) or {}).get("items", [])
    holders = {
        x["metadata"]["name"]: x["spec"].get("holderIdentity") for x in leases if "-shard-" in x["metadata"]["name"]
    }
    assert len(holders) == 2, holders
    assert all(holders.values()), holders
    assert forbidden_calls(stack) == []
    user = f"system:serviceaccount:{NAMESPACE}:{RELEASE}-sluice"
    lease_calls = {e["verb"] for e in audit_trail(stack) if e.get("user") == user and e["resource"] == "leases"}
    assert lease_calls <= {"list", "create", "update", "delete"}, lease_calls
    assert {"list", "create"} <= lease_calls
