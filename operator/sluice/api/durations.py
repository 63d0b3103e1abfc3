"""Go-style duration strings ("500ms", "30s", "1m30s") as they appear in Kubernetes and Istio specs.

The API models hold durations as float seconds; on the wire they are strings. Used by the API models and
by anything that prints a duration back to a user.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"


def parse_duration(value: object) -> float:
    """Parse "1m30s" into 90.0 seconds. Numbers are taken as seconds (YAML authors write `30` too)."""
    if isinstance(value, bool):
        raise ValueError("a duration must be a string such as '30s', not a boolean")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return float(value)
    if not isinstance(value, str) or not re.fullmatch(DURATION_PATTERN, value):
        raise ValueError(f"invalid duration {value!r}: expected a number with a unit, such as '500ms', '30s', '1m30s'")
    return sum(float(number) * _UNIT_SECONDS[unit] for number, unit in _PART.findall(value))


def format_duration(seconds: float) -> str:
    """The shortest exact Go-style spelling of a number of seconds: 90.0 -> "1m30s", 0.25 -> "250ms"."""
    millis = round(seconds * 1000)
    if millis % 1000:
        return f"{millis}ms"
    total = millis // 1000
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    text = (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "") + (f"{secs}s" if secs else "")
    return text or "0s"


Duration = Annotated[
    float,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "pattern": DURATION_PATTERN}),
]
"""A duration in seconds, written on the wire as a Go-style string."""
