"""The API emulator answers the real kubectl as kube-apiserver does: OpenAPI, dry runs, field validation, names.

One emulator (no Prometheus, no pods) is shared by the module; each test uses its own object names.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s

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
        stack.start_apiserver(with_gie=True)  # a cluster that also runs the Gateway API Inference Extension
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


def test_with_gie_installed_the_bare_kind_is_gies_and_slp_or_the_full_name_is_sluices(api: Stack) -> None:
    """Groups of equal priority sort by name in discovery (k8s.io/apiserver aggregated/handler.go; every CRD group
    has GroupPriorityMinimum 1000), and kubectl's RESTMapper takes the first: inference.networking.k8s.io wins."""
    api.kubectl("apply", "-f", str(CANARY))
    try:
        bare = api.kubectl("explain", "inferencepool.spec").stdout
        assert "GROUP:      inference.networking.k8s.io" in bare
        assert "No resources found" in api.kubectl("get", "inferencepool", "-n", "llm").stderr
        assert "llama" in api.kubectl("get", "slp", "-n", "llm").stdout
        assert "llama" in api.kubectl("get", "inferencepools.inference.sluice.dev", "-n", "llm").stdout
        ours = api.kubectl("explain", "inferencepools.inference.sluice.dev.spec").stdout
        assert "GROUP:      inference.sluice.dev" in ours
    finally:
        api.kubectl("delete", "-f", str(CANARY))


def test_kubectl_explain_renders_a_custom_resource_field(api: Stack) -> None:
    out = api.kubectl("explain", "inferencepools.inference.sluice.dev.spec.canary").stdout
    assert "KIND:       InferencePool" in out
    assert "FIELD: canary <Object>" in out
    assert "candidateRevision\t<string>" in out
    assert "Revision to roll out." in out


def test_kubectl_explain_renders_built_in_kinds_and_object_metadata(api: Stack) -> None:
    assert "FIELD: containers <[]Container>" in api.kubectl("explain", "pods.spec.containers").stdout
    labels = api.kubectl("explain", "inferencepools.inference.sluice.dev.metadata.labels").stdout
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


# ---------------------------------------------------------------------------------------------- dry runs


def stored(api: Stack, name: str, jsonpath: str = "{.spec.canary.stableRevision}") -> str | None:
    result = api.kubectl("get", "slp", name, "-n", "llm", "-o", f"jsonpath={jsonpath}", check=False)
    return result.stdout if result.returncode == 0 else None


CANARY_SPEC = "  canary: {stableRevision: v1, candidateRevision: v2, steps: [10, 50, 100]}\n"


def test_kubectl_diff_and_server_dry_runs_of_a_new_object_create_nothing(api: Stack) -> None:
    manifest = pool_yaml("dry-new", CANARY_SPEC)
    diff = api.kubectl("diff", "-f", "-", stdin=manifest, check=False)
    assert diff.returncode == 1, diff.stderr  # 1: differences found
    assert "+  name: dry-new" in diff.stdout
    applied = api.kubectl("apply", "--dry-run=server", "-f", "-", stdin=manifest)
    assert "inferencepool.inference.sluice.dev/dry-new created (server dry run)" in applied.stdout
    server_side = api.kubectl("apply", "--server-side", "--dry-run=server", "-f", "-", stdin=manifest)
    assert "serverside-applied (server dry run)" in server_side.stdout
    created = api.kubectl("create", "--dry-run=server", "-f", "-", "-o", "json", stdin=manifest)
    answer = json.loads(created.stdout)
    assert answer["metadata"]["uid"]
    assert "resourceVersion" not in answer["metadata"]
    assert answer["spec"]["interval"] == "5s"  # defaults applied, as the real write would
    assert stored(api, "dry-new") is None


def test_server_dry_runs_of_every_write_to_an_existing_object_change_nothing(api: Stack) -> None:
    api.kubectl("apply", "-f", "-", stdin=pool_yaml("dry-old", CANARY_SPEC))
    version = stored(api, "dry-old", "{.metadata.resourceVersion}")
    changed = pool_yaml("dry-old", CANARY_SPEC.replace("stableRevision: v1", "stableRevision: v9"))
    diff = api.kubectl("diff", "-f", "-", stdin=changed, check=False)
    assert diff.returncode == 1
    assert "-    stableRevision: v1" in diff.stdout
    assert "+    stableRevision: v9" in diff.stdout
    writes = [
        ("apply", "--dry-run=server", "-f", "-"),
        ("apply", "--server-side", "--force-conflicts", "--dry-run=server", "-f", "-"),
        ("replace", "--dry-run=server", "-f", "-"),
    ]
    for args in writes:
        api.kubectl(*args, stdin=changed)
    patches = [
        ("merge", '{"spec":{"canary":{"stableRevision":"v9"}}}'),
        ("json", '[{"op":"replace","path":"/spec/canary/stableRevision","value":"v9"}]'),
    ]
    for kind, patch in patches:
        answer = api.kubectl(
            "patch",
            "slp",
            "dry-old",
            "-n",
            "llm",
            "--type",
            kind,
            "-p",
            patch,
            "--dry-run=server",
            "-o",
            "jsonpath={.spec.canary.stableRevision} {.metadata.resourceVersion}",
        ).stdout
        assert answer == f"v9 {version}"  # the object as it would be, under the version it still has
    deleted = api.kubectl("delete", "slp", "dry-old", "-n", "llm", "--dry-run=server")
    assert "deleted (server dry run)" in deleted.stdout
    assert stored(api, "dry-old", "{.spec.canary.stableRevision} {.metadata.resourceVersion}") == f"v1 {version}"


def test_strategic_merge_patch_is_refused_for_custom_resources_and_dry_run_for_built_in_kinds(api: Stack) -> None:
    api.kubectl("apply", "-f", "-", stdin=pool_yaml("strategic"))
    refused = api.kubectl(
        "patch",
        "slp",
        "strategic",
        "-n",
        "llm",
        "--type",
        "strategic",
        "-p",
        '{"spec":{"interval":"9s"}}',
        check=False,
    )
    assert refused.returncode != 0
    assert "the body of the request was in an unknown format" in refused.stderr
    config = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: settings, namespace: llm}\ndata: {mode: a}\n"
    api.kubectl("apply", "-f", "-", stdin=config)
    patched = api.kubectl(
        "patch",
        "configmap",
        "settings",
        "-n",
        "llm",
        "-p",
        '{"data":{"mode":"b"}}',
        "--dry-run=server",
        "-o",
        "jsonpath={.data.mode}",
    )
    assert patched.stdout == "b"
    assert api.kubectl("get", "configmap", "settings", "-n", "llm", "-o", "jsonpath={.data.mode}").stdout == "a"


# ---------------------------------------------------------------------------------------------- field validation

TYPO_SPEC = "  scoring: {alpah: 0.5}\n"


def test_kubectl_default_field_validation_is_strict_and_refuses_an_unknown_field(api: Stack) -> None:
    result = api.kubectl("apply", "-f", "-", stdin=pool_yaml("typo-strict", TYPO_SPEC), check=False)
    assert result.returncode != 0
    assert 'Error from server (BadRequest): error when creating "STDIN": strict decoding error: unknown field ' in (
        result.stderr
    )
    assert '"spec.scoring.alpah"' in result.stderr
    assert stored(api, "typo-strict") is None


def test_field_validation_warn_prunes_the_field_and_kubectl_prints_the_warning(api: Stack) -> None:
    result = api.kubectl("apply", "--validate=warn", "-f", "-", stdin=pool_yaml("typo-warn", TYPO_SPEC))
    assert 'Warning: unknown field "spec.scoring.alpah"' in result.stderr
    scoring = stored(api, "typo-warn", "{.spec.scoring}")
    assert scoring is not None
    assert "alpah" not in scoring


def test_field_validation_ignore_prunes_silently(api: Stack) -> None:
    result = api.kubectl("apply", "--validate=false", "-f", "-", stdin=pool_yaml("typo-ignore", TYPO_SPEC))
    assert "Warning" not in result.stderr
    scoring = stored(api, "typo-ignore", "{.spec.scoring}")
    assert scoring is not None
    assert "alpah" not in scoring


def test_built_in_kinds_are_decoded_strictly_too_by_their_upstream_definitions(api: Stack) -> None:
    deployment = (
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: typo, namespace: llm}\nspec:\n"
        "  selector: {matchLabels: {app: typo}}\n  template:\n    metadata: {labels: {app: typo}}\n"
        "    spec: {containers: [{name: main, image: busybox, imagePullPolicyy: Always}]}\n"
    )
    refused = api.kubectl("apply", "-f", "-", stdin=deployment, check=False)
    assert 'strict decoding error: unknown field "spec.template.spec.containers[0].imagePullPolicyy"' in refused.stderr
    warned = api.kubectl("apply", "--validate=warn", "-f", "-", stdin=deployment)
    assert 'Warning: unknown field "spec.template.spec.containers[0].imagePullPolicyy"' in warned.stderr
    containers = api.kubectl(
        "get", "deployment", "typo", "-n", "llm", "-o", "jsonpath={.spec.template.spec.containers[0]}"
    ).stdout
    assert json.loads(containers) == {"name": "main", "image": "busybox"}


def test_the_python_client_gets_the_server_default_warn_and_strict_when_it_asks(api: Stack) -> None:
    assert api.custom is not None
    body = yaml.safe_load(pool_yaml("typo-client", TYPO_SPEC))
    created = api.custom.create_namespaced_custom_object(
        "inference.sluice.dev", "v1alpha1", "llm", "inferencepools", body
    )
    assert "alpah" not in created["spec"]["scoring"]
    body["metadata"]["name"] = "typo-client-strict"
    with pytest.raises(k8s.ApiException) as refused:
        api.custom.create_namespaced_custom_object(
            "inference.sluice.dev", "v1alpha1", "llm", "inferencepools", body, field_validation="Strict"
        )
    assert refused.value.status == 400
    assert 'strict decoding error: unknown field "spec.scoring.alpah"' in json.loads(refused.value.body)["message"]


# ---------------------------------------------------------------------------------------------- names and labels

SUBDOMAIN_MESSAGE = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start "
    "and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)


def test_an_object_name_that_is_not_a_dns_subdomain_is_refused_in_apimachinery_words(api: Stack) -> None:
    result = api.kubectl("apply", "-f", "-", stdin=pool_yaml("Bad_Name"), check=False)
    assert result.returncode != 0
    assert f'metadata.name: Invalid value: "Bad_Name": {SUBDOMAIN_MESSAGE}' in result.stderr


def test_a_namespace_name_must_be_a_dns_label(api: Stack) -> None:
    manifest = "apiVersion: v1\nkind: Namespace\nmetadata: {name: team.a}\n"
    result = api.kubectl("apply", "-f", "-", stdin=manifest, check=False)
    assert 'The Namespace "team.a" is invalid: metadata.name: Invalid value: "team.a": must not contain dots' in (
        result.stderr
    )


def test_label_keys_and_values_and_annotation_keys_are_checked(api: Stack) -> None:
    api.kubectl("apply", "-f", "-", stdin=pool_yaml("labelled"))
    key = api.kubectl("label", "slp", "labelled", "-n", "llm", "a/b/c=1", check=False)
    assert 'metadata.labels: Invalid value: "a/b/c": a qualified name must consist of alphanumeric characters' in (
        key.stderr
    )
    # kubectl checks a value given to `kubectl label` itself (in the same words), so send it in a manifest
    with_value = pool_yaml("labelled").replace("namespace: llm}", "namespace: llm, labels: {tier: -front}}")
    value = api.kubectl("apply", "-f", "-", stdin=with_value, check=False)
    assert (
        'metadata.labels: Invalid value: "-front": a valid label must be an empty string or consist of '
        "alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character "
        "(e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is "
        "'(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
    ) in value.stderr
    annotation = api.kubectl("annotate", "slp", "labelled", "-n", "llm", "Team_X/owner=me", check=False)
    assert 'metadata.annotations: Invalid value: "Team_X/owner": prefix part a lowercase RFC 1123 subdomain' in (
        annotation.stderr
    )
    api.kubectl("label", "slp", "labelled", "-n", "llm", "example.com/tier=front_1")
    assert stored(api, "labelled", "{.metadata.labels.example\\.com/tier}") == "front_1"


def test_generate_name_gets_a_five_character_suffix_and_a_missing_namespace_is_not_found(api: Stack) -> None:
    manifest = "apiVersion: v1\nkind: ConfigMap\nmetadata: {generateName: settings-, namespace: llm}\n"
    name = api.kubectl("create", "-f", "-", "-o", "name", stdin=manifest).stdout.strip()
    assert name.startswith("configmap/settings-")
    assert len(name.removeprefix("configmap/settings-")) == 5
    missing = api.kubectl("apply", "-f", "-", stdin=pool_yaml("orphan").replace("llm", "nowhere"), check=False)
    assert 'namespaces "nowhere" not found' in missing.stderr


# ---------------------------------------------------------------------------------------------- CEL errors

BAD_STEPS = "  canary: {stableRevision: v1, candidateRevision: v2, steps: [50, 10, 100]}\n"


def refusal(api: Stack, name: str, extra_spec: str, port: str = "8000") -> str:
    manifest = pool_yaml(name, extra_spec).replace("targetPort: 8000", f"targetPort: {port}")
    result = api.kubectl("apply", "-f", "-", stdin=manifest, check=False)
    assert result.returncode != 0
    assert stored(api, name) is None
    return result.stderr


def test_a_rule_failing_on_a_string_names_the_schema_type_as_the_value(api: Stack) -> None:
    stderr = refusal(api, "fast", "  interval: 500ms\n")
    assert 'is invalid: spec.interval: Invalid value: "string": interval must be at least 1s' in stderr


def test_a_rule_that_cannot_evaluate_is_worded_as_cel_go_and_kube_apiserver_word_it(api: Stack) -> None:
    # A pattern error does not block CEL in kube-apiserver, so the rule runs and its conversion fails.
    stderr = refusal(api, "slow", "  interval: five seconds\n")
    assert 'spec.interval: Invalid value: "five seconds": spec.interval in body should match' in stderr
    assert (
        "* spec.interval: Invalid value: \"string\": type conversion error from 'string' to "
        "'google.protobuf.Duration' evaluating rule: interval must be at least 1s"
    ) in stderr
    assert "overflow" not in stderr
    assert "rule evaluation error" not in stderr


def test_a_blocking_schema_error_skips_every_rule_with_the_api_servers_notice(api: Stack) -> None:
    stderr = refusal(api, "typed", "  engine: tgx\n" + BAD_STEPS)
    assert '* spec.engine: Unsupported value: "tgx": supported values: "vllm"' in stderr
    assert (
        '* <nil>: Invalid value: "null": some validation rules were not checked because the object was invalid; '
        "correct the existing errors to complete validation"
    ) in stderr
    assert "strictly increasing" not in stderr  # the canary rule was not run
    stderr = refusal(api, "typed", BAD_STEPS, port="eighty")
    assert '* spec.targetPort: Invalid value: "string": spec.targetPort in body must be of type integer: "string"' in (
        stderr
    )


# ---------------------------------------------------------------------------------------------- size


def envoy_filter(name: str, blob_bytes: int) -> str:
    patch = {"applyTo": "HTTP_FILTER", "patch": {"operation": "MERGE", "value": {"blob": "x" * blob_bytes}}}
    return json.dumps(
        {
            "apiVersion": "networking.istio.io/v1alpha3",
            "kind": "EnvoyFilter",
            "metadata": {"name": name, "namespace": "llm"},
            "spec": {"configPatches": [patch]},
        }
    )


def test_an_object_over_etcds_request_limit_is_refused_with_etcds_error_but_a_dry_run_passes(api: Stack) -> None:
    big = envoy_filter("big", 1_600_000)  # over 1.5 MiB stored, under the 3 MiB body limit
    refused = api.kubectl("create", "-f", "-", stdin=big, check=False)
    assert refused.returncode != 0
    assert 'Error from server: error when creating "STDIN": etcdserver: request is too large' in refused.stderr
    dry = api.kubectl("create", "--dry-run=server", "-f", "-", stdin=big)
    assert "envoyfilter.networking.istio.io/big created (server dry run)" in dry.stdout


def test_a_request_body_over_3_mib_is_refused_with_413(api: Stack) -> None:
    refused = api.kubectl("create", "-f", "-", stdin=envoy_filter("huge", 3_200_000), check=False)
    assert "Error from server (RequestEntityTooLarge)" in refused.stderr
    assert "Request entity too large: limit is 3145728" in refused.stderr


def test_config_map_data_over_1_mib_is_invalid(api: Stack) -> None:
    config = json.dumps(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "big", "namespace": "llm"},
            "data": {"a": "y" * 1_100_000},
        }
    )
    refused = api.kubectl("create", "-f", "-", stdin=config, check=False)
    assert 'The ConfigMap "big" is invalid: []: Too long: must have at most 1048576 bytes' in refused.stderr


# ---------------------------------------------------------------------------------------------- protobuf bodies


def test_kubectl_create_sends_protobuf_for_built_in_kinds_and_the_emulator_reads_it(api: Stack) -> None:
    created = api.kubectl("create", "namespace", "team-proto", "-v=8")
    assert "Content-Type: application/vnd.kubernetes.protobuf" in created.stderr
    api.kubectl("create", "configmap", "proto-cm", "-n", "team-proto", "--from-literal=mode=fast")
    api.kubectl("create", "secret", "generic", "proto-secret", "-n", "team-proto", "--from-literal=token=s3cr3t")
    api.kubectl("label", "configmap", "proto-cm", "-n", "team-proto", "tier=front")
    config = json.loads(api.kubectl("get", "configmap", "proto-cm", "-n", "team-proto", "-o", "json").stdout)
    assert config["data"] == {"mode": "fast"}
    assert config["metadata"]["labels"] == {"tier": "front"}
    secret = json.loads(api.kubectl("get", "secret", "proto-secret", "-n", "team-proto", "-o", "json").stdout)
    assert secret["data"] == {"token": "czNjcjN0"}
    deleted = api.kubectl("delete", "namespace", "team-proto", "--dry-run=server")
    assert "(server dry run)" in deleted.stdout
