"""Label and field selectors, and server-side printing (`as=Table`), for the Kubernetes API emulator.

Local-stack tool, used by `apistore.Store` (list and watch filtering) and `apiserver` (`kubectl get` asks for
Tables and gets the CRD's additionalPrinterColumns).
"""

from __future__ import annotations

import functools
import re
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sluice.emulator.apistore import ResourceType

JSON = Any


# ------------------------------------------------------------------------------------------------ selectors

_SET_EXPR = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if current.strip():
        parts.append(current)
    return parts


@functools.lru_cache(maxsize=1024)
def _label_terms(selector: str) -> tuple[tuple[str, str, frozenset[str]], ...]:
    """A label selector parsed once (a list of 3,000 objects matched it 3,000 times): (operator, key, values)."""
    terms: list[tuple[str, str, frozenset[str]]] = []
    for raw_term in _split_selector(selector):
        term = raw_term.strip()
        if match := _SET_EXPR.match(term):
            terms.append((match.group(2), match.group(1), frozenset(v.strip() for v in match.group(3).split(","))))
        elif "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            terms.append(("!=", key, frozenset({value})))
        elif "=" in term:
            key, value = (s.strip() for s in re.split(r"==?", term, maxsplit=1))
            terms.append(("=", key, frozenset({value})))
        elif term.startswith("!"):
            terms.append(("!", term[1:].strip(), frozenset()))
        else:
            terms.append(("exists", term, frozenset()))
    return tuple(terms)


def label_selector_matches(selector: str | None, labels: dict[str, str]) -> bool:
    if not selector:
        return True
    for op, key, values in _label_terms(selector):
        if op in {"in", "="}:
            if labels.get(key) not in values:
                return False
        elif op in {"notin", "!="}:
            if key in labels and labels[key] in values:
                return False
        elif op == "!":
            if key in labels:
                return False
        elif key not in labels:
            return False
    return True


def field_selector_matches(selector: str | None, obj: dict[str, Any]) -> bool:
    if not selector:
        return True
    for term in selector.split(","):
        negate = "!=" in term
        path, value = (s.strip() for s in re.split(r"!=|==?", term, maxsplit=1))
        node: Any = obj
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if (str(node) == value) == negate:
            return False
    return True


# ------------------------------------------------------------------------------------------------ printing


def jsonpath_value(obj: JSON, path: str) -> JSON:
    """The subset of JSONPath printer columns use: `.a.b`, `[0]`, `[?(@.k=="v")]`."""
    tokens = re.findall(r"\.([A-Za-z0-9_-]+)|\[(\d+)\]|\[\?\(@\.([A-Za-z0-9_.-]+)==\"([^\"]*)\"\)\]", path)
    nodes: list[JSON] = [obj]
    for name, index, filter_key, filter_value in tokens:
        nxt: list[JSON] = []
        for node in nodes:
            if name and isinstance(node, dict) and name in node:
                nxt.append(node[name])
            elif index and isinstance(node, list) and int(index) < len(node):
                nxt.append(node[int(index)])
            elif filter_key and isinstance(node, list):
                nxt += [item for item in node if isinstance(item, dict) and str(item.get(filter_key)) == filter_value]
        nodes = nxt
    return nodes[0] if nodes else None


def _age(timestamp: str | None) -> str:
    if not timestamp:
        return "<unknown>"
    seconds = int((datetime.now(UTC) - datetime.fromisoformat(timestamp.replace("Z", "+00:00"))).total_seconds())
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h"


def as_table(rtype: ResourceType, objects: list[dict[str, Any]], resource_version: str) -> dict[str, Any]:
    """A meta.k8s.io/v1 Table, as `kubectl get` asks for, using the CRD's printer columns."""
    columns = [{"name": "Name", "type": "string", "format": "name", "description": "Name", "priority": 0}]
    columns += [
        {
            "name": c["name"],
            "type": c.get("type", "string"),
            "format": "",
            "description": c.get("description", ""),
            "priority": c.get("priority", 0),
        }
        for c in rtype.printer_columns
    ] or [{"name": "Age", "type": "date", "format": "", "description": "Age", "priority": 0}]
    rows = []
    for obj in objects:
        cells: list[Any] = [obj["metadata"]["name"]]
        for column in rtype.printer_columns or [{"jsonPath": ".metadata.creationTimestamp", "type": "date"}]:
            value = jsonpath_value(obj, column["jsonPath"])
            if column.get("type") == "date":
                value = _age(value)
            cells.append("" if value is None else value)
        rows.append(
            {
                "cells": cells,
                "object": {
                    "kind": "PartialObjectMetadata",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": obj["metadata"],
                },
            }
        )
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": columns,
        "rows": rows,
    }
