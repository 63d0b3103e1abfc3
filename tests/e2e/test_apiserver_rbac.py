"""The API emulator authenticates and enforces RBAC as kube-apiserver does, seen through the real kubectl.

One emulator (HTTPS, as client-go sends bearer tokens only over TLS) is shared by the module; service accounts get
their tokens from the TokenRequest API (`kubectl create token`), roles and bindings are made with `kubectl create`.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s

from sluice.devstack.stack import Stack

pytestmark = pytest.mark.slow

POOL = (
    "apiVersion: inference.sluice.dev/v1alpha1\nkind: InferencePool\nmetadata: {name: llama, namespace: llm}\n"
    "spec: {selector: {matchLabels: {app: llama}}, targetPort: 8000, service: llama}\n"
)
SA = "system:serviceaccount:llm:bot"


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(Path(tmp_path_factory.mktemp("rbac")), deadline_seconds=300)
    stack.workdir.mkdir(parents=True, exist_ok=True)
    try:
        stack.start_apiserver()
        stack.kubectl("apply", "-f", "-", stdin=POOL)
        stack.kubectl("create", "serviceaccount", "bot", "-n", "llm")
        yield stack
    finally:
        stack.close()


@pytest.fixture(scope="module")
def token(api: Stack) -> str:
    return api.kubectl("create", "token", "bot", "-n", "llm").stdout.strip()


def as_bot(api: Stack, token: str, *args: str) -> tuple[int, str]:
    result = api.kubectl(f"--token={token}", *args, check=False)
    return result.returncode, result.stdout + result.stderr


def ensure(api: Stack, kind: str, name: str, *create: str, namespace: str | None = None) -> None:
    """Create `kind`/`name` with `kubectl create <create>` unless it exists: a test that needs what an earlier one
    of the module created also runs alone."""
    where = ["-n", namespace] if namespace else []
    if api.kubectl("get", kind, name, *where, check=False).returncode != 0:
        api.kubectl("create", kind, name, *where, *create)


@pytest.fixture
def pool_reader(api: Stack) -> None:
    """The role and binding `test_a_role_binding_grants_exactly_its_rules_in_its_namespace` creates."""
    ensure(
        api,
        "role",
        "pool-reader",
        "--verb=get,list,watch",
        "--resource=inferencepools.inference.sluice.dev",
        namespace="llm",
    )
    ensure(api, "rolebinding", "bot-reads-pools", "--role=pool-reader", "--serviceaccount=llm:bot", namespace="llm")


@pytest.fixture
def secret_reader(api: Stack) -> None:
    """The cluster role and binding `test_a_cluster_role_binding_grants_everywhere_and_a_missing_role_is_named`
    creates."""
    ensure(api, "clusterrole", "secret-reader", "--verb=list", "--resource=secrets")
    ensure(api, "clusterrolebinding", "bot-secrets", "--clusterrole=secret-reader", "--serviceaccount=llm:bot")


def test_an_unknown_token_is_401_and_a_service_account_without_bindings_is_403(api: Stack, token: str) -> None:
    code, out = as_bot(api, "not-a-token", "get", "inferencepools", "-n", "llm")
    assert code != 0
    assert "error: You must be logged in to the server (Unauthorized)" in out
    code, out = as_bot(api, token, "get", "inferencepools", "-n", "llm")
    assert code != 0
    assert (
        f'Error from server (Forbidden): inferencepools.inference.sluice.dev is forbidden: User "{SA}" cannot list '
        'resource "inferencepools" in API group "inference.sluice.dev" in the namespace "llm"'
    ) in out


def test_a_role_binding_grants_exactly_its_rules_in_its_namespace(api: Stack, token: str) -> None:
    api.kubectl(
        "create",
        "role",
        "pool-reader",
        "-n",
        "llm",
        "--verb=get,list,watch",
        "--resource=inferencepools.inference.sluice.dev",
    )
    api.kubectl(
        "create", "rolebinding", "bot-reads-pools", "-n", "llm", "--role=pool-reader", "--serviceaccount=llm:bot"
    )
    code, out = as_bot(api, token, "get", "inferencepools", "-n", "llm", "-o", "name")
    assert code == 0, out
    assert "inferencepool.inference.sluice.dev/llama" in out
    code, out = as_bot(
        api,
        token,
        "patch",
        "inferencepool",
        "llama",
        "-n",
        "llm",
        "--type",
        "merge",
        "-p",
        '{"spec":{"interval":"9s"}}',
    )
    assert (
        f'inferencepools.inference.sluice.dev "llama" is forbidden: User "{SA}" cannot patch resource "inferencepools" '
        'in API group "inference.sluice.dev" in the namespace "llm"'
    ) in out
    code, out = as_bot(api, token, "get", "inferencepools", "-A")
    assert (
        f'User "{SA}" cannot list resource "inferencepools" in API group "inference.sluice.dev" at the cluster scope'
    ) in out
    code, out = as_bot(
        api,
        token,
        "patch",
        "inferencepool",
        "llama",
        "-n",
        "llm",
        "--subresource=status",
        "--type",
        "merge",
        "-p",
        '{"status":{}}',
    )
    assert 'cannot get resource "inferencepools/status" in API group "inference.sluice.dev"' in out  # read first


def test_kubectl_auth_can_i_and_whoami_answer_for_an_impersonated_service_account(
    api: Stack, token: str, pool_reader: None
) -> None:
    allowed = api.kubectl("auth", "can-i", "list", "inferencepools", "-n", "llm", f"--as={SA}", check=False)
    assert (allowed.returncode, allowed.stdout.strip()) == (0, "yes")  # the pool-reader binding above
    denied = api.kubectl("auth", "can-i", "patch", "inferencepools", "-n", "llm", f"--as={SA}", check=False)
    assert (denied.returncode, denied.stdout.strip()) == (1, "no")
    who = api.kubectl("auth", "whoami", f"--as={SA}").stdout
    assert SA in who
    assert "system:serviceaccounts:llm" in who
    _, out = as_bot(api, token, "get", "inferencepools", "-n", "llm", "--as=alice")
    assert (
        f'users "alice" is forbidden: User "{SA}" cannot impersonate resource "users" in API group "" at the cluster '
        "scope"
    ) in out


def test_a_cluster_role_binding_grants_everywhere_and_a_missing_role_is_named(api: Stack, token: str) -> None:
    api.kubectl("create", "clusterrolebinding", "bot-ghost", "--clusterrole=does-not-exist", "--serviceaccount=llm:bot")
    code, out = as_bot(api, token, "get", "secrets", "-n", "llm")
    assert 'RBAC: clusterrole.rbac.authorization.k8s.io "does-not-exist" not found' in out
    api.kubectl("create", "clusterrole", "secret-reader", "--verb=list", "--resource=secrets")
    api.kubectl(
        "create", "clusterrolebinding", "bot-secrets", "--clusterrole=secret-reader", "--serviceaccount=llm:bot"
    )
    code, out = as_bot(api, token, "get", "secrets", "-A")
    assert code == 0, out


def test_the_admin_token_bypasses_rbac_and_discovery_needs_authentication(
    api: Stack, token: str, secret_reader: None
) -> None:
    admin = api.kubectl("get", "clusterrolebindings", "-o", "name").stdout
    assert "clusterrolebinding.rbac.authorization.k8s.io/bot-secrets" in admin
    code, out = as_bot(api, token, "api-resources", "--api-group=inference.sluice.dev")
    assert code == 0, out
    assert "inferencepools" in out
    # the official client with no credentials is system:anonymous: /version is public, discovery is not
    cluster = yaml.safe_load(api.kubeconfig.read_text())["clusters"][0]["cluster"]
    ca = api.workdir / "ca.crt"
    ca.write_bytes(base64.b64decode(cluster["certificate-authority-data"]))
    configuration = k8s.Configuration(host=cluster["server"])
    configuration.ssl_ca_cert = str(ca)
    anonymous = k8s.ApiClient(configuration)
    assert k8s.VersionApi(anonymous).get_code().git_version == "v1.32.0-sluice-local"
    with pytest.raises(k8s.ApiException) as denied:
        k8s.ApisApi(anonymous).get_api_versions()
    assert denied.value.status == 403
    assert json.loads(denied.value.body)["message"] == 'forbidden: User "system:anonymous" cannot get path "/apis/"'
