"""API-server-style messages for models that failed to parse. Pure."""

from __future__ import annotations

import json

from pydantic import ValidationError


def format_validation_error(kind: str, name: str, error: ValidationError) -> str:
    """API-server style: `InferencePool "x" is invalid: spec.canary.steps: Invalid value: ...`."""
    details = []
    for item in error.errors():
        path = _path(item["loc"]) or "(root)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "missing":
            details.append(f"{path}: Required value")
        elif item["type"] == "extra_forbidden":
            details.append(f'unknown field "{path}"')
        elif item["type"] == "api_rule":
            # a CEL rule: kube-apiserver shows the type of the rule's schema node, never the value
            # (apiextensions-apiserver pkg/apiserver/schema/cel/validation.go: field.Invalid(fldPath, sts.Type, ...))
            details.append(f"{path}: Invalid value: {_json_type(item.get('input'))}: {message}")
        else:
            details.append(f"{path}: Invalid value: {_describe(item.get('input'))}: {message}")
    return f'{kind} "{name}" is invalid: ' + "; ".join(details)


def _path(loc: tuple[int | str, ...]) -> str:
    """A field path as kube-apiserver writes it: names joined by dots, list indexes in brackets (`gateways[0]`)."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _json_type(value: object) -> str:
    """The OpenAPI type of a JSON value, quoted as the API server quotes it."""
    if isinstance(value, bool):
        return '"boolean"'
    if isinstance(value, int):
        return '"integer"'
    if isinstance(value, float):
        return '"number"'
    if isinstance(value, str):
        return '"string"'
    return _describe(value)


def _describe(value: object) -> str:
    """How an API server shows a rejected value: scalars as JSON, containers by their type."""
    if isinstance(value, list):
        return '"array"'
    if isinstance(value, dict):
        return '"object"'
    return json.dumps(value)
