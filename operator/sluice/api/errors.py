"""API-server-style messages for models that failed to parse. Pure."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError


def format_validation_error(kind: str, name: str, error: ValidationError) -> str:
    """API-server style: `InferencePool "x" is invalid: spec.canary.steps: Invalid value: ...`."""
    details = []
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"]) or "(root)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "missing":
            details.append(f"{path}: Required value")
        elif item["type"] == "extra_forbidden":
            details.append(f'unknown field "{path}"')
        else:
            details.append(f"{path}: Invalid value: {_describe(item.get('input'))}: {message}")
    return f'{kind} "{name}" is invalid: ' + "; ".join(details)


def _describe(value: Any) -> str:
    """How an API server shows a rejected value: scalars as JSON, containers by their type."""
    if isinstance(value, list):
        return '"array"'
    if isinstance(value, dict):
        return '"object"'
    return json.dumps(value)
