"""JSON as it crosses the wire, typed exactly.

Kubernetes objects read from the API and Istio objects sluice renders are JSON. `JsonValue` says so exactly (a
recursive alias mypy checks), so a reader narrows before it uses a value: `members` and `text` do it for the
common shapes, returning an empty mapping or the default when the value has another shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeAlias

JsonValue: TypeAlias = "bool | int | float | str | list[JsonValue] | dict[str, JsonValue] | None"
JsonObject: TypeAlias = "dict[str, JsonValue]"

_EMPTY: Mapping[str, object] = {}


def members(value: object, *path: str) -> Mapping[str, object]:
    """The mapping at `path` under `value` (an empty one where a step is missing or not a mapping)."""
    current = value
    for key in path:
        if not isinstance(current, Mapping):
            return _EMPTY
        current = current.get(key)
    return current if isinstance(current, Mapping) else _EMPTY


def text(value: object, *path: str, default: str = "") -> str:
    """The string at `path` under `value` (`default` where a step is missing or the value is not a string)."""
    found = members(value, *path[:-1]).get(path[-1]) if path else value
    return found if isinstance(found, str) else default
