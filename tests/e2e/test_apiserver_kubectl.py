"""The API emulator answers the real kubectl as kube-apiserver does: OpenAPI, dry runs, field validation, names.

One emulator (no Prometheus, no pods) is shared by the module; each test uses its own object names.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.devstack.stack import ROOT, Stack

pytestmark = pytest.mark.slow

CANARY = ROOT / "examples" / "pools" / "canary.yaml"


def pool_yaml(name: str, extra_spec: str = "") -> str:
    return (
        "apiVersion: inference.sluice.dev/v1alpha1\nkind: InferencePool\n"
        f"metadata: {{name: {name}, namespace: llm}}\n"
        "spec:\n  selector: {matchLabels: {app: llama}}\n  targetPort: 8000\n  service: llama\n" + extra_spec
    )


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(Path(tmp_path_factory.mktemp("api")), deadline_seconds=300)
    stack.workdir.mkdir(parents=True, exist_ok=True)
    try:
        stack.start_apiserver()
        yield stack
    finally:
        stack.close()


# ---------------------------------------------------------------------------------------------- OpenAPI


def test_kubectl_apply_validates_by_default_against_the_served_openapi(api: Stack) -> None:
    result = api.kubectl("apply", "-f", str(CANARY), "-v=6", check=False)
    assert result.returncode == 0, result.stderr
    assert "inferencepool.inference.sluice.dev/llama created" in result.stdout
    assert "/openapi/v3/apis/inference.sluice.dev/v1alpha1?hash=" in result.stderr
    assert "fieldValidation=Strict" in result.stderr  # kubectl saw the parameter in the OpenAPI and used it
    api.kubectl("delete", "-f", str(CANARY))


def test_kubectl_explain_renders_a_custom_resource_field(api: Stack) -> None:
    out = api.kubectl("explain", "inferencepool.spec.canary").stdout
    assert "KIND:       InferencePool" in out
    assert "FIELD: canary <Object>" in out
    assert "candidateRevision\t<string>" in out
    assert "Revision to roll out." in out


def test_kubectl_explain_renders_built_in_kinds_and_object_metadata(api: Stack) -> None:
    assert "FIELD: containers <[]Container>" in api.kubectl("explain", "pods.spec.containers").stdout
    labels = api.kubectl("explain", "inferencepool.metadata.labels").stdout
    assert "FIELD: labels <map[string]string>" in labels


def test_openapi_v2_is_served_as_json_and_v3_documents_carry_the_crd_schema(api: Stack) -> None:
    v2 = json.loads(api.kubectl("get", "--raw", "/openapi/v2").stdout)
    assert v2["swagger"] == "2.0"
    assert "dev.sluice.inference.v1alpha1.InferencePool" in v2["definitions"]
    v3 = json.loads(api.kubectl("get", "--raw", "/openapi/v3/apis/inference.sluice.dev/v1alpha1").stdout)
    pool = v3["components"]["schemas"]["dev.sluice.inference.v1alpha1.InferencePool"]
    assert pool["x-kubernetes-group-version-kind"] == [
        {"group": "inference.sluice.dev", "kind": "InferencePool", "version": "v1alpha1"}
    ]
    assert "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta" in v3["components"]["schemas"]
    core = json.loads(api.kubectl("get", "--raw", "/openapi/v3/api/v1").stdout)
    assert "io.k8s.api.core.v1.Pod" in core["components"]["schemas"]
