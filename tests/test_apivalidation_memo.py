"""The API emulator evaluates each CEL rule once per distinct value: an unchanged value is not evaluated again,
a changed one always is, so what changed is still validated."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from sluice.devstack.stack import SHARED_ISTIO
from sluice.emulator import apivalidation
from sluice.emulator.apistore import parse_apply_body
from sluice.emulator.apivalidation import SchemaRegistry, ValidationFailed

ENTRY: dict[str, Any] = {
    "apiVersion": "networking.istio.io/v1",
    "kind": "ServiceEntry",
    "metadata": {"name": "sluice-llama", "namespace": "llm"},
    "spec": {
        "hosts": ["llama.llm.sluice.internal"],
        "ports": [{"number": 8000, "name": "http", "protocol": "HTTP"}],
        "resolution": "STATIC",
        "endpoints": [{"address": f"10.0.0.{i}", "weight": 5, "ports": {"http": 8000}} for i in range(1, 4)],
    },
}


@pytest.fixture(scope="module")
def istio() -> SchemaRegistry:
    if not SHARED_ISTIO.exists():
        pytest.fail(f"Istio CRDs not found at {SHARED_ISTIO}")
    return SchemaRegistry().load(SHARED_ISTIO)


def test_an_unchanged_object_is_not_evaluated_again(istio, monkeypatch):
    istio.check(copy.deepcopy(ENTRY))
    evaluated: list[str] = []
    program = apivalidation._program
    monkeypatch.setattr(apivalidation, "_program", lambda text: evaluated.append(text) or program(text))
    istio.check(copy.deepcopy(ENTRY))
    assert evaluated == []
    changed = copy.deepcopy(ENTRY)
    changed["spec"]["endpoints"][0]["weight"] = 7
    istio.check(changed)
    assert evaluated  # the changed endpoint and the spec around it are evaluated again
    assert len(evaluated) < 10  # the unchanged endpoints, ports and hosts are not


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s["endpoints"][1].update(address="unix://relative"), "UDS must be an absolute path"),
        (lambda s: s.update(resolution="NONE"), "NONE mode cannot set endpoints"),
        (lambda s: s["endpoints"][2]["ports"].update(http=70000), "port must be between 1-65535"),
    ],
)
def test_a_changed_invalid_object_is_still_rejected_after_its_valid_form_was_seen(istio, change, message):
    istio.check(copy.deepcopy(ENTRY))
    bad = copy.deepcopy(ENTRY)
    change(bad["spec"])
    with pytest.raises(ValidationFailed, match=message):
        istio.check(bad)
    istio.check(copy.deepcopy(ENTRY))  # and the valid one is still valid


def test_apply_bodies_parse_as_json_or_yaml_alike():
    assert parse_apply_body(b'{"a": {"b": [1, "x"]}}') == {"a": {"b": [1, "x"]}}
    assert parse_apply_body(b"a:\n  b: [1, x]\n") == {"a": {"b": [1, "x"]}}
    assert parse_apply_body(b"{a: 1}") == {"a": 1}  # a YAML flow mapping, not JSON
    assert parse_apply_body(b"") == {}
