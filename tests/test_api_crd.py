"""The CRD is the contract: generated from the models, structural, described, and enforcing the same rules.

Bad pools are checked twice: by the CRD exactly as an API server would (schema + CEL, via the validator) and by
the pydantic models (what the operator and `sluice plan` use). Both must refuse, naming the field and the rule.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import typing
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from sluice.api import v1alpha1
from sluice.api.crd import build_crd
from sluice.api.errors import format_validation_error
from sluice.api.reference import render_reference
from sluice.api.rules import Rule
from sluice.api.v1alpha1 import InferencePool, InferencePoolSpec, QueryOverrides
from sluice.emulator.apivalidation import SchemaRegistry, ValidationFailed

ROOT = Path(__file__).resolve().parents[1]
CRD_FILE = ROOT / "crds" / "inference.sluice.dev_inferencepools.yaml"
EXAMPLE_POOLS = sorted((ROOT / "examples" / "pools").glob("*.yaml"))


@pytest.fixture(scope="module")
def registry() -> SchemaRegistry:
    return SchemaRegistry().load(CRD_FILE)


def base_pool(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "selector": {"matchLabels": {"app": "llama"}},
        "targetPort": 8000,
        "service": "llama",
    }
    body.update(spec)
    return {
        "apiVersion": "inference.sluice.dev/v1alpha1",
        "kind": "InferencePool",
        "metadata": {"name": "p", "namespace": "llm"},
        "spec": body,
    }


def test_crd_file_is_exactly_what_the_models_generate():
    assert yaml.safe_load(CRD_FILE.read_text()) == build_crd(), "run `make crds` after changing the models"


def test_crd_names_group_and_subresources():
    crd = build_crd()
    names = crd["spec"]["names"]
    assert crd["metadata"]["name"] == "inferencepools.inference.sluice.dev"
    assert names["shortNames"] == ["sluicepool", "slp"]
    assert names["categories"] == ["sluice"]
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"] for c in version["additionalPrinterColumns"]}
    assert {"Routable", "Canary", "Weight", "Age"} <= columns


def _walk(schema: dict[str, Any], path: str):
    yield path, schema
    for name, child in schema.get("properties", {}).items():
        yield from _walk(child, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural_and_every_field_is_described():
    root = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(root, ""):
        assert "type" in node, f"{path} has no type"
        assert "$ref" not in node, f"{path} is not structural"
        assert "anyOf" not in node, f"{path} is not structural"
        if node["type"] == "object" and "properties" in node:
            for name, child in node["properties"].items():
                assert child.get("description"), f"{path}.{name} has no description"


def test_every_spec_field_of_the_models_appears_in_the_crd():
    spec_schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for field_name, info in InferencePoolSpec.model_fields.items():
        assert info.alias in spec_schema["properties"], field_name


@pytest.mark.parametrize("path", EXAMPLE_POOLS, ids=lambda p: p.name)
def test_example_pools_are_accepted_by_the_crd_and_the_models(registry, path):
    document = yaml.safe_load(path.read_text())
    registry.validate(document)
    InferencePool.model_validate(document)


def test_api_server_defaults_equal_model_defaults(registry):
    """What `kubectl get -o yaml` shows after defaulting is what the operator computes with."""
    defaulted = registry.validate(base_pool(canary={"candidateRevision": "v2"}))
    from_models = InferencePoolSpec.model_validate(base_pool(canary={"candidateRevision": "v2"})["spec"])
    assert InferencePoolSpec.model_validate(defaulted["spec"]) == from_models
    assert defaulted["spec"]["canary"]["steps"] == [5, 25, 50, 100]
    assert defaulted["spec"]["protection"]["recovery"] == {
        "quietPeriod": "30s",
        "initialPercent": 1.0,
        "growthFactor": 1.5,
        "stepInterval": "10s",
        "capPercent": 50.0,
    }


TENANTS = {"header": "x-tenant-id", "shares": [{"value": "team-a", "percent": 50}], "othersPercent": 50}
BAD = [
    (
        "tenant shares not adding up",
        {"admission": {"tenants": {**TENANTS, "othersPercent": 40}}},
        "spec.admission.tenants.shares",
        "the shares' percents and othersPercent must add up to 100",
    ),
    (
        "tenant shares over 100",
        {"admission": {"tenants": {**TENANTS, "shares": [{"value": "a", "percent": 60}], "othersPercent": 50}}},
        "spec.admission.tenants.shares",
        "the shares' percents and othersPercent must add up to 100",
    ),
    (
        "a tenant named twice",
        {
            "admission": {
                "tenants": {
                    **TENANTS,
                    "shares": [{"value": "a", "percent": 25}, {"value": "a", "percent": 25}],
                }
            }
        },
        "spec.admission.tenants.shares",
        "each tenant is named once",
    ),
    (
        "a client error other than 429 to retry",
        {"routing": {"retries": {"statusCodes": [429, 451]}}},
        "spec.routing.retries.statusCodes",
        "status codes to retry are 429 or server errors (500-599)",
    ),
    (
        "steps not increasing",
        {"canary": {"steps": [5, 50, 40, 100]}},
        "spec.canary.steps",
        "steps must be strictly increasing",
    ),
    ("steps repeat", {"canary": {"steps": [5, 5, 100]}}, "spec.canary.steps", "steps must be strictly increasing"),
    ("last step not 100", {"canary": {"steps": [5, 50]}}, "spec.canary.steps", "the last step must be 100"),
    ("step out of range", {"canary": {"steps": [-5, 100]}}, "spec.canary.steps", "steps must be between 0 and 100"),
    (
        "testers-only step without header routes",
        {"canary": {"steps": [0, 100]}},
        "spec.canary.steps",
        "a first step of 0 % (testers only) needs header routes in canary.match",
    ),
    (
        "candidate equals stable",
        {"canary": {"stableRevision": "v1", "candidateRevision": "v1"}},
        "spec.canary.candidateRevision",
        "candidateRevision must differ from stableRevision",
    ),
    (
        "min above max weight",
        {"scoring": {"minWeight": 50, "maxWeight": 10}},
        "spec.scoring.minWeight",
        "minWeight must not exceed maxWeight",
    ),
    (
        "floor above baseline",
        {"scoring": {"ttftFloor": "1s"}},
        "spec.scoring.ttftFloor",
        "ttftFloor must not exceed ttftBaseline",
    ),
    (
        "recovery start above cap",
        {"protection": {"recovery": {"initialPercent": 60, "capPercent": 50}}},
        "spec.protection.recovery.initialPercent",
        "initialPercent must not exceed capPercent",
    ),
    (
        "duplicate bands",
        {
            "protection": {
                "bands": [{"maxErrorRate": 0.01, "weightPercent": 100}, {"maxErrorRate": 0.01, "weightPercent": 50}]
            }
        },
        "spec.protection.bands",
        "bands must have distinct maxErrorRate values",
    ),
    (
        "custom engine without queries",
        {"engine": "custom"},
        "spec.metrics.queries",
        "engine 'custom' needs at least one load query",
    ),
    (
        "selector pins the revision label",
        {"selector": {"matchLabels": {"app": "llama", "sluice.dev/revision": "v1"}}, "canary": {}},
        "spec.selector.matchLabels",
        "selector.matchLabels must not pin canary.revisionLabel",
    ),
    ("interval below 1s", {"interval": "500ms"}, "spec.interval", "interval must be at least 1s"),
    (
        "affinity and least-request together",
        {"routing": {"sessionAffinity": {"header": "x-session-id"}, "leastRequest": {}}},
        "spec.routing.sessionAffinity",
        "sessionAffinity (consistent hash) replaces least-request",
    ),
    (
        "retries with EnvoyFilter routes",
        {"routing": {"weightsVia": "EnvoyFilter", "retries": {}}},
        "spec.routing.retries",
        "retries are set on sluice's VirtualService route",
    ),
    (
        "a retry timeout of zero",
        {"routing": {"retries": {"perTryTimeout": "0s"}}},
        "spec.routing.retries.perTryTimeout",
        "must be greater than 0s",
    ),
    (
        "mirror share below one millionth, which Envoy would render as no mirror",
        {"canary": {"shadow": {"mirrorPercent": 0.00004}}},
        "spec.canary.shadow.mirrorPercent",
        "greater than or equal to 0.0001",
    ),
    (
        "capacity coefficient zero",
        {"capacity": {"classes": {"cpu": 0}}},
        "spec.capacity.classes",
        "capacity coefficients must be > 0",
    ),
    (
        "unknown query placeholder",
        {"metrics": {"queries": {"loraFailureRate": 'rate(x{pod=~"$pod"}[$window])'}}},
        "spec.metrics.queries.loraFailureRate",
        "unknown placeholder",
    ),
    (
        "braced placeholder",
        {"metrics": {"queries": {"queueLength": "sum by ($podLabel) (q{${selector}})"}}},
        "spec.metrics.queries.queueLength",
        "unknown placeholder",
    ),
    (
        "selector key with a space",
        {"selector": {"matchLabels": {"my app": "llama"}}},
        "spec.selector.matchLabels",
        "label keys must be an optional DNS subdomain prefix",
    ),
    (
        "selector key with two slashes",
        {"selector": {"matchLabels": {"example.com/team/app": "llama"}}},
        "spec.selector.matchLabels",
        "label keys must be an optional DNS subdomain prefix",
    ),
    (
        "selector key name longer than 63",
        {"selector": {"matchLabels": {"example.com/" + "a" * 64: "llama"}}},
        "spec.selector.matchLabels",
        "label keys must be an optional DNS subdomain prefix",
    ),
    (
        "selector key prefix longer than 253",
        {"selector": {"matchLabels": {"a" * 63 + ".b" * 96 + "/app": "llama"}}},
        "spec.selector.matchLabels",
        "label keys must be an optional DNS subdomain prefix",
    ),
    (
        "extra label not a Prometheus label name",
        {"metrics": {"extraLabels": {"k8s-job": "vllm"}}},
        "spec.metrics.extraLabels",
        "extraLabels keys must be Prometheus label names",
    ),
    (
        "hardware class not a label value",
        {"capacity": {"classes": {"a100 80gb": 10}}},
        "spec.capacity.classes",
        "hardware classes must be label values",
    ),
]

# Durations that divide, sleep or time out: zero would divide by zero, spin the loop or never wait.
POSITIVE_DURATIONS = [
    ("scoring", "ttftBaseline", {"scoring": {"ttftBaseline": "0s", "ttftFloor": "0s"}}),
    ("scoring", "ttftFloor", {"scoring": {"ttftFloor": "0s", "alpha": 1}}),
    ("scoring", "defaultTtft", {"scoring": {"defaultTtft": "0s"}}),
    ("scoring", "ttftTimeout", {"scoring": {"ttftTimeout": "0ms"}}),
    ("protection.recovery", "quietPeriod", {"protection": {"recovery": {"quietPeriod": "0s"}}}),
    ("protection.recovery", "stepInterval", {"protection": {"recovery": {"stepInterval": "0s"}}}),
    ("metrics", "window", {"metrics": {"window": "0s"}}),
    ("metrics", "timeout", {"metrics": {"timeout": "0s"}}),
    ("metrics", "staleAfter", {"metrics": {"staleAfter": "0m"}}),
    ("admission", "ttftTarget", {"admission": {"ttftTarget": "0s"}}),
    ("canary.analysis", "interval", {"canary": {"analysis": {"interval": "0s"}}}),
    ("protection.outlierDetection", "interval", {"protection": {"outlierDetection": {"interval": "0s"}}}),
    (
        "protection.outlierDetection",
        "baseEjectionTime",
        {"protection": {"outlierDetection": {"baseEjectionTime": "0s"}}},
    ),
]
AB_TEST = {"key": {"header": "x-user-id"}, "percent": 20, "duration": "1h"}
BAD += [
    (
        "A/B test with a shadow",
        {"canary": {"abTest": AB_TEST, "shadow": {}}},
        "spec.canary.abTest",
        "abTest and shadow are two kinds of rollout: choose one",
    ),
    (
        "A/B key with a header and a cookie",
        {"canary": {"abTest": {**AB_TEST, "key": {"header": "x-user-id", "cookie": "sid"}}}},
        "spec.canary.abTest.key.header",
        "set exactly one of header or cookie",
    ),
    (
        "A/B test with EnvoyFilter route weights",
        {"canary": {"abTest": AB_TEST}, "routing": {"weightsVia": "EnvoyFilter"}},
        "spec.canary.abTest",
        "canary.abTest is a route on sluice's VirtualService",
    ),
    (
        "A/B test of no length",
        {"canary": {"abTest": {**AB_TEST, "duration": "0s"}}},
        "spec.canary.abTest.duration",
        "must be greater than 0s",
    ),
    (
        "header condition with two kinds",
        {"canary": {"match": [{"headers": {"x-tester": {"exact": "yes", "prefix": "y"}}}]}},
        "spec.canary.match[0].headers.x-tester.exact",
        "set exactly one of exact, prefix or regex",
    ),
    (
        "header condition with none",
        {"canary": {"match": [{"headers": {"x-tester": {}}}]}},
        "spec.canary.match[0].headers.x-tester.exact",
        "set exactly one of exact, prefix or regex",
    ),
    (
        "upper-case header name",
        {"canary": {"match": [{"headers": {"X-Tester": {"exact": "yes"}}}]}},
        "spec.canary.match[0].headers",
        "header names are HTTP tokens in lower case",
    ),
    (
        "header routes with EnvoyFilter route weights",
        {"canary": {"match": [{"headers": {"x-tester": {"exact": "yes"}}}]}, "routing": {"weightsVia": "EnvoyFilter"}},
        "spec.canary.match",
        "canary.match is a route on sluice's VirtualService",
    ),
    (
        "every namespace listed with others",
        {"routing": {"clientNamespaces": ["*", "team-a"]}},
        "spec.routing.clientNamespaces",
        "'*' (every namespace) cannot be listed with other namespaces",
    ),
    (
        "gateway namespace not among the client namespaces",
        {"routing": {"clientNamespaces": ["team-a"], "gateways": ["mesh", "edge/public"]}},
        "spec.routing.clientNamespaces",
        "list the namespace of every '<namespace>/<name>' gateway in clientNamespaces (and the namespace its pods",
    ),
]
BAD += [
    (f"{section}.{name} zero", spec, f"spec.{section}.{name}", "must be greater than 0s")
    for section, name, spec in POSITIVE_DURATIONS
]


def _server_refuses(registry: SchemaRegistry, document: dict[str, Any], path: str, message: str) -> str:
    """The server's whole detail for the rule, as the models must word it too."""
    with pytest.raises(ValidationFailed) as by_server:
        registry.validate(document)
    matching = [error for error in by_server.value.errors if error.path == path and message in error.detail]
    assert matching, str(by_server.value)
    return str(matching[0])


def _models_refuse(document: dict[str, Any], path: str, message: str) -> list[str]:
    with pytest.raises(ValidationError) as by_models:
        InferencePool.model_validate(document)
    text = format_validation_error("InferencePool", document["metadata"]["name"], by_models.value)
    details = text.split(" is invalid: ", 1)[1].split("; ")
    assert any(detail.startswith(f"{path}: Invalid value: ") and message in detail for detail in details), text
    return details


@pytest.mark.parametrize(("case", "spec", "path", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_pool_is_rejected_by_crd_and_models_at_the_same_field_with_the_same_rule(
    registry, case, spec, path, message
):
    document = base_pool(**spec)
    server = _server_refuses(registry, document, path, message)
    models = _models_refuse(document, path, message)
    if any(rule.message == message for rule in _declared_rules(InferencePool)):
        # a rule's refusal word for word, the value shown included: the type of the rule's schema node, as
        # kube-apiserver shows it (the schema's own checks are pydantic's wording, matched on the message above)
        assert server in models


RFC_1123_LABEL = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-'"
BAD_NAMES = [
    ("upper case", "Llama", RFC_1123_LABEL),
    ("underscore", "llama_70b", RFC_1123_LABEL),
    ("dot", "llama.70b", RFC_1123_LABEL),
    ("leading dash", "-llama", RFC_1123_LABEL),
    ("trailing dash", "llama-", RFC_1123_LABEL),
    ("64 characters", "a" * 64, "must be no more than 63 characters"),
]


@pytest.mark.parametrize(("case", "name", "message"), BAD_NAMES, ids=[b[0] for b in BAD_NAMES])
def test_pool_name_the_cluster_cannot_use_as_a_label_is_rejected_by_crd_and_models(registry, case, name, message):
    document = base_pool()
    document["metadata"]["name"] = name
    _server_refuses(registry, document, "metadata.name", message)
    _models_refuse(document, "metadata.name", message)


@pytest.mark.parametrize("name", ["p", "7b-llama", "a" * 63, "llama-3-70b"])
def test_dns_1123_label_pool_names_are_accepted_by_crd_and_models(registry, name):
    document = base_pool()
    document["metadata"]["name"] = name
    registry.validate(copy.deepcopy(document))
    InferencePool.model_validate(document)


def test_label_keys_and_values_the_cluster_accepts_are_accepted_by_crd_and_models(registry):
    document = base_pool(
        selector={
            "matchLabels": {
                "app": "llama",
                "app.kubernetes.io/name": "Llama_3.1-70B",
                "example.com/" + "n" * 63: "v" * 63,
                "a" * 63 + ".b" * 95 + "/app": "",
            }
        },
        metrics={"extraLabels": {"job": "vllm", "_team": "ml", "Zone2": "eu"}},
        capacity={"classes": {"a100": 10, "RTX_4090.24g": 4, "c" * 63: 1}},
    )
    registry.validate(copy.deepcopy(document))
    InferencePool.model_validate(document)


def _declared_rules(model: type[BaseModel]) -> Iterator[Rule]:
    """Every Rule of `model` and of the models its fields hold, once per place a model appears in the tree (a
    model used by two fields, like AnalysisSpec in canary.analysis and canary.shadow.analysis, sits on two nodes)."""
    pending = [model]
    while pending:
        current = pending.pop()
        yield from getattr(current, "rules", ())
        for info in current.model_fields.values():
            held = {
                inner
                for candidate in [info.annotation, *typing.get_args(info.annotation)]
                for inner in [candidate, *typing.get_args(candidate)]
                if isinstance(inner, type) and issubclass(inner, BaseModel)
            }
            pending.extend(held)


def test_every_cel_rule_of_the_crd_has_exactly_one_python_twin_with_the_same_message():
    root = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    emitted = Counter(
        (entry["rule"], entry["message"], entry.get("fieldPath", ""))
        for _, node in _walk(root, "")
        for entry in node.get("x-kubernetes-validations", [])
    )
    declared = Counter((rule.cel, rule.message, rule.field_path) for rule in _declared_rules(InferencePool))
    assert emitted, "the CRD has no CEL rules"
    assert emitted == declared


def test_every_rule_is_exercised_by_a_bad_pool_case():
    """A new rule comes with a case above proving the CRD and the models refuse alike."""
    exercised = [message for *_, message in BAD] + [message for *_, message in BAD_NAMES]
    unexercised = [
        rule.message
        for rule in _declared_rules(InferencePool)
        if not any(message in rule.message for message in exercised)
    ]
    assert not unexercised


def test_every_query_override_checks_its_placeholders():
    assert {rule.on for rule in QueryOverrides.rules} == set(QueryOverrides.model_fields)


def test_every_cross_field_rule_reports_at_a_field():
    """A rule on an object names the field to fix (fieldPath), so the message points at one line of YAML."""
    object_rules = [rule for rule in _declared_rules(InferencePool) if rule.on is None]
    assert object_rules
    assert all(rule.field_path for rule in object_rules), [rule.message for rule in object_rules if not rule.field_path]


SCHEMA_BAD = [
    ("alpha above 1", {"scoring": {"alpha": 1.5}}, "spec.scoring.alpha", "less than or equal to 1"),
    ("port zero", {"targetPort": 0}, "spec.targetPort", "greater than or equal to 1"),
    (
        "admission limit below one",
        {"admission": {"minLimit": 0}},
        "spec.admission.minLimit",
        "greater than or equal to 1",
    ),
    ("admission share zero", {"admission": {"batchShare": 0}}, "spec.admission.batchShare", "greater than 0"),
    (
        "tenant header upper case",
        {"admission": {"tenants": {**TENANTS, "header": "X-Tenant"}}},
        "spec.admission.tenants.header",
        "should match",
    ),
    (
        "tenant header a pseudo-header",
        {"admission": {"tenants": {**TENANTS, "header": ":authority"}}},
        "spec.admission.tenants.header",
        "should match",
    ),
    (
        "tenant value empty",
        {"admission": {"tenants": {**TENANTS, "shares": [{"value": "", "percent": 50}]}}},
        "spec.admission.tenants.shares[0].value",
        "should match",
    ),
    (
        "others' share zero",
        {"admission": {"tenants": {**TENANTS, "shares": [{"value": "a", "percent": 99}], "othersPercent": 0}}},
        "spec.admission.tenants.othersPercent",
        "greater than or equal to 1",
    ),
    ("unknown engine", {"engine": "llamacpp"}, "spec.engine", "vllm"),
    ("bad duration", {"interval": "5 seconds"}, "spec.interval", ""),
    ("bad service name", {"service": "Llama_Svc"}, "spec.service", ""),
    ("unknown field", {"weigths": {}}, "spec.weigths", ""),
    ("negative window", {"metrics": {"window": "-1m"}}, "spec.metrics.window", ""),
    ("error rate above 1", {"protection": {"fastZeroErrorRate": 2}}, "spec.protection.fastZeroErrorRate", ""),
    ("bad weightsVia", {"routing": {"weightsVia": "Gateway"}}, "spec.routing.weightsVia", "VirtualService"),
    (
        "selector value with a space",
        {"selector": {"matchLabels": {"app": "llama 70b"}}},
        "spec.selector.matchLabels.app",
        "",
    ),
    (
        "selector value longer than 63",
        {"selector": {"matchLabels": {"app": "l" * 64}}},
        "spec.selector.matchLabels.app",
        "",
    ),
    ("revision longer than 63", {"canary": {"candidateRevision": "v" * 64}}, "spec.canary.candidateRevision", ""),
    (
        "more than 64 selector labels",
        {"selector": {"matchLabels": {f"l{i}": "x" for i in range(65)}}},
        "spec.selector.matchLabels",
        "at most 64",
    ),
    (
        "more than 64 extra labels",
        {"metrics": {"extraLabels": {f"l{i}": "x" for i in range(65)}}},
        "spec.metrics.extraLabels",
        "at most 64",
    ),
    (
        "more than 64 hardware classes",
        {"capacity": {"classes": {f"c{i}": 1 for i in range(65)}}},
        "spec.capacity.classes",
        "at most 64",
    ),
    ("query longer than 8192", {"metrics": {"queries": {"ttft": "q" * 8193}}}, "spec.metrics.queries.ttft", "8192"),
    # host names no proxy resolves: an empty label, upper case, a trailing dot
    (
        "cluster domain with an empty label",
        {"routing": {"clusterDomain": "cluster..local"}},
        "spec.routing.clusterDomain",
        "",
    ),
    ("cluster domain in upper case", {"routing": {"clusterDomain": "Cluster.Local"}}, "spec.routing.clusterDomain", ""),
    (
        "cluster domain ending in a dot",
        {"routing": {"clusterDomain": "cluster.local."}},
        "spec.routing.clusterDomain",
        "",
    ),
    # exportTo syntax: '~' hides (Istio refuses it on VirtualService), './x' is no namespace
    ("client namespace '~'", {"routing": {"clientNamespaces": ["~"]}}, "spec.routing.clientNamespaces[0]", ""),
    (
        "client namespace with a slash",
        {"routing": {"clientNamespaces": ["./x"]}},
        "spec.routing.clientNamespaces[0]",
        "",
    ),
    (
        "client namespace in upper case",
        {"routing": {"clientNamespaces": ["Team-A"]}},
        "spec.routing.clientNamespaces[0]",
        "",
    ),
    ("gateway with two slashes", {"routing": {"gateways": ["a/b/c"]}}, "spec.routing.gateways[0]", ""),
    ("a match with no header", {"canary": {"match": [{"headers": {}}]}}, "spec.canary.match[0].headers", ""),
    ("no match entry", {"canary": {"match": []}}, "spec.canary.match", ""),
]


@pytest.mark.parametrize(("case", "spec", "path", "hint"), SCHEMA_BAD, ids=[b[0] for b in SCHEMA_BAD])
def test_schema_violations_name_the_field_in_both(registry, case, spec, path, hint):
    document = base_pool(**spec)
    with pytest.raises(ValidationFailed) as by_server:
        registry.validate(document)
    assert path in str(by_server.value)
    assert hint in str(by_server.value)
    with pytest.raises(ValidationError) as by_models:
        InferencePool.model_validate(document)
    assert path in format_validation_error("InferencePool", "p", by_models.value)


def test_missing_required_fields_are_listed(registry):
    document = base_pool()
    del document["spec"]["service"]
    del document["spec"]["selector"]
    with pytest.raises(ValidationFailed) as failure:
        registry.validate(document)
    text = str(failure.value)
    assert "spec.service: Required value" in text
    assert "spec.selector: Required value" in text


def test_valid_full_featured_pool_passes_both(registry):
    document = base_pool(
        engine="trtllm",
        metrics={
            "extraLabels": {"job": "trtllm"},
            "queries": {"loraFailureRate": "sum by ($podLabel) (rate(lora_fail_total{$selector}[$window]))"},
            "auth": {"bearerTokenSecretRef": {"name": "prom", "key": "token"}},
        },
        canary={"candidateRevision": "v2", "steps": [1, 10, 100], "paused": True},
        routing={"sessionAffinity": {"header": "x-session-id", "hashBalanceFactor": 150}},
    )
    registry.validate(copy.deepcopy(document))
    InferencePool.model_validate(document)


def test_outlier_detection_spells_consecutive_5xx_errors_as_istio_does(registry):
    document = base_pool(protection={"outlierDetection": {"consecutive5xxErrors": 7}})
    registry.validate(copy.deepcopy(document))
    assert InferencePool.model_validate(document).spec.protection.outlier_detection.consecutive_5xx_errors == 7


@pytest.mark.parametrize("module_name", ["base", "spec", "rules", "status"])
def test_v1alpha1_reexports_every_public_name_of_the_api_modules(module_name):
    module = importlib.import_module(f"sluice.api.{module_name}")
    public = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not inspect.ismodule(value)
        and getattr(value, "__module__", module.__name__) == module.__name__
    }
    assert public - set(v1alpha1.__all__) == set()


def test_the_reference_shows_an_exclusive_bound_as_strict():
    rows = {line.split(" | ")[0]: line.split(" | ")[-1] for line in render_reference().splitlines()}
    assert rows["| `spec.protection.recovery.growthFactor`"].startswith("> 1; <= 10")  # gt=1, le=10


def test_field_reference_doc_is_generated_from_the_crd():
    committed = (ROOT / "docs" / "api-reference.md").read_text()
    assert committed == render_reference(), "run `make crds` after changing the models"


def test_the_crd_is_a_valid_kubernetes_object() -> None:
    """Against apiextensions.k8s.io/v1's own schema (e.g. exclusiveMinimum must be the boolean form)."""
    import kubernetes_validate  # noqa: PLC0415 - test-only dependency

    kubernetes_validate.validate(build_crd(), "1.33.0", strict=True)


def test_the_committed_crds_spell_every_node_out_without_yaml_anchors_or_aliases():
    """A dict reused in the schema must not become `&id001` / `*id001`: readers and diffs see each rule in place."""
    chart = ROOT / "charts" / "sluice" / "files" / CRD_FILE.name
    for path in (CRD_FILE, chart):
        events = list(yaml.parse(path.read_text()))
        assert not [e for e in events if isinstance(e, yaml.AliasEvent)], path
        assert not [e for e in events if getattr(e, "anchor", None)], path
