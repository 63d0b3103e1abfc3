"""Validate objects against CustomResourceDefinitions the way a Kubernetes API server does.

Local-stack tool (not used by the operator at run time): the tests check sluice's CRD, its example pools and every
Istio object sluice renders with it, and the API emulator uses it to answer 422 like a real server.

What it does, in the API server's order: apply schema defaults (recursively, into defaulted values too); check the
structural schema (types, `nullable`, `x-kubernetes-int-or-string`, `x-kubernetes-preserve-unknown-fields`,
enums, bounds, lengths, patterns, item counts, `required`, `oneOf`/`anyOf`/`allOf`/`not`); reject unknown fields
(`validate`, strict) or prune and report them (`check`, for the server's `fieldValidation`); then evaluate every
`x-kubernetes-validations` CEL rule with `self` bound to the value at that node (root rules also see
`metadata.name` and `metadata.generateName`; a failure is reported at the rule's `fieldPath` when it has one).
Transition rules (`oldSelf`) run only when an old object is given. Kubernetes' CEL extension functions used
by real CRDs (strings `substring`, lists `isSorted`, ...) are registered.
Messages follow the API server: `spec.canary.steps: Invalid value: "array": steps must be strictly increasing`.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import yaml
from celpy import celtypes
from celpy.evaluation import CELEvalError

JSON = Any


@dataclass(frozen=True)
class FieldError:
    path: str
    kind: str  # "Required value", "Invalid value", "Unsupported value", "unknown field", "Too many", ...
    detail: str

    def __str__(self) -> str:
        if self.kind == "unknown field":
            return f'unknown field "{self.path}"'
        return f"{self.path}: {self.kind}: {self.detail}"


class ValidationFailed(Exception):
    """The object is invalid; `errors` lists every problem, as an API server's 422 Status would."""

    def __init__(self, kind: str, name: str, errors: list[FieldError]) -> None:
        self.errors = errors
        self.unknown_fields: list[str] = []
        details = ", ".join(str(error) for error in errors)
        # apimachinery's aggregate: one error bare, several in brackets
        super().__init__(f'{kind} "{name}" is invalid: ' + (details if len(errors) == 1 else f"[{details}]"))


# ------------------------------------------------------------------------------------------------ CEL


def _k8s_substring(value: celtypes.StringType, start: celtypes.IntType, end: Any = None) -> celtypes.StringType:
    text = str(value)
    stop = len(text) if end is None else int(end)
    if not 0 <= int(start) <= stop <= len(text):
        raise ValueError(f"substring({start}, {stop}) out of range for a string of length {len(text)}")
    return celtypes.StringType(text[int(start) : stop])


def _k8s_is_sorted(values: celtypes.ListType) -> celtypes.BoolType:
    items: list[Any] = list(values)
    return celtypes.BoolType(all(a <= b for a, b in itertools.pairwise(items)))


def _k8s_index_of(haystack: Any, needle: Any) -> celtypes.IntType:
    if isinstance(haystack, str):
        return celtypes.IntType(str(haystack).find(str(needle)))
    items = list(haystack)
    return celtypes.IntType(items.index(needle) if needle in items else -1)


def _k8s_find_all(value: celtypes.StringType, pattern: celtypes.StringType, limit: Any = None) -> celtypes.ListType:
    found = [celtypes.StringType(m.group(0)) for m in re.finditer(str(pattern), str(value))]
    return celtypes.ListType(found if limit is None or int(limit) < 0 else found[: int(limit)])


_GO_DURATION = re.compile(r"^[-+]?(([0-9]+(\.[0-9]*)?|\.[0-9]+)(ns|us|µs|ms|s|m|h))+$")


def _k8s_duration(value: Any) -> Any:
    """cel-go's duration(string): Go's time.ParseDuration grammar, and cel-go's error when it does not parse."""
    if isinstance(value, celtypes.DurationType):
        return value
    text = str(value)
    if text in ("0", "+0", "-0"):
        return celtypes.DurationType(0)
    if not _GO_DURATION.match(text):
        return CELEvalError("type conversion error from 'string' to 'google.protobuf.Duration'")
    return celtypes.DurationType(text)


CEL_EXTENSIONS: dict[str, Any] = {
    "duration": _k8s_duration,
    "findAll": _k8s_find_all,
    "substring": _k8s_substring,
    "isSorted": _k8s_is_sorted,
    "indexOf": _k8s_index_of,
    "lowerAscii": lambda s: celtypes.StringType(str(s).lower()),
    "upperAscii": lambda s: celtypes.StringType(str(s).upper()),
    "trim": lambda s: celtypes.StringType(str(s).strip()),
    "sum": lambda xs: sum(xs[1:], xs[0]) if len(xs) else celtypes.IntType(0),
    "min": min,
    "max": max,
}

_ENV = celpy.Environment()


@cache
def _program(rule: str) -> Any:
    return _ENV.program(_ENV.compile(rule), functions=CEL_EXTENSIONS)


def _to_cel(schema: dict[str, Any], value: JSON) -> Any:
    """Schema-aware conversion: `number` fields are doubles even when written as integers."""
    if value is None:
        return None
    kind = schema.get("type")
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if kind == "number" and isinstance(value, int | float):
        return celtypes.DoubleType(float(value))
    if isinstance(value, int):
        return celtypes.IntType(value)
    if isinstance(value, float):
        return celtypes.DoubleType(value)
    if isinstance(value, str):
        return celtypes.StringType(value)
    if isinstance(value, list):
        item_schema = schema.get("items", {})
        return celtypes.ListType([_to_cel(item_schema, item) for item in value])
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else {}
        return celtypes.MapType({celtypes.StringType(k): _to_cel(props.get(k, extra), v) for k, v in value.items()})
    raise TypeError(f"cannot convert {type(value).__name__} to CEL")


# ------------------------------------------------------------------------------------------------ schema walk

# Error types after which apiextensions' hasBlockingErr skips every CEL rule (TypeInvalid is flagged where found).
BLOCKING_KINDS = {"Required value", "Unsupported value", "Too long", "Too many"}
CEL_SKIPPED = (
    "some validation rules were not checked because the object was invalid; "
    "correct the existing errors to complete validation"
)


def _numeric(value: JSON) -> bool:
    """A JSON-Schema draft-2020 numeric bound (not the draft-4 boolean flag Kubernetes uses)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _type_ok(kind: str | None, value: JSON) -> bool:
    if kind is None:
        return True
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return True


def _json_type(value: JSON) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _describe(value: JSON) -> str:
    if isinstance(value, dict):
        return '"object"'
    if isinstance(value, list):
        return '"array"'
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class _Walker:
    def __init__(self, strict: bool, run_cel: bool, root_metadata: tuple[JSON, JSON] = (None, None)) -> None:
        self.root_metadata = root_metadata
        """(metadata, old metadata) that root rules see, as kube-apiserver shows them name and generateName."""
        self.errors: list[FieldError] = []
        self.unknown: list[str] = []  # field paths pruned when not strict, as the API server prunes them
        self.blocking = False  # an error after which kube-apiserver runs no CEL rule at all
        self.strict = strict
        self.run_cel = run_cel

    def error(self, path: str, kind: str, detail: str) -> None:
        self.errors.append(FieldError(path, kind, detail))
        if kind in BLOCKING_KINDS:
            self.blocking = True

    def run(self, schema: dict[str, Any], value: JSON, old: JSON) -> JSON:
        """The whole object: schema first; CEL only if no blocking error, as apiextensions' `hasBlockingErr`."""
        run_cel, self.run_cel = self.run_cel, False
        checked = self.walk(schema, value, "", old)
        if not run_cel:
            return checked
        if self.blocking:
            self.error("<nil>", "Invalid value", f'"null": {CEL_SKIPPED}')
            return checked
        schema_errors = self.errors
        self.run_cel, self.errors, self.unknown = True, [], []
        checked = self.walk(schema, value, "", old)
        # The API server lists the schema errors first, then the rules' errors.
        self.errors = schema_errors + [e for e in self.errors if e not in schema_errors]
        return checked

    def walk(self, schema: dict[str, Any], value: JSON, path: str, old: JSON = None) -> JSON:
        """Default, check and return the value at `path`."""
        if value is None:
            if schema.get("nullable"):
                return None
            self.error(path, "Invalid value", f'"null": {path} in body must be of type {schema.get("type", "any")}')
            return None
        if schema.get("x-kubernetes-int-or-string"):
            if not (isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))):
                self.error(path, "Invalid value", f"{_describe(value)}: must be an integer or a string")
                return value
        elif not _type_ok(schema.get("type"), value):
            actual = _json_type(value)
            self.error(
                path, "Invalid value", f'"{actual}": {path} in body must be of type {schema.get("type")}: "{actual}"'
            )
            self.blocking = True  # field.TypeInvalid
            return value
        self._value_checks(schema, value, path)
        if isinstance(value, dict):
            value = self._object(schema, value, path, old if isinstance(old, dict) else None)
        elif isinstance(value, list):
            items = schema.get("items")
            if isinstance(items, dict):
                value = [self.walk(items, item, f"{path}[{i}]") for i, item in enumerate(value)]
        for combinator in ("allOf", "anyOf", "oneOf", "not"):
            if combinator in schema:
                self._combinator(combinator, schema[combinator], value, path)
        if self.run_cel and "x-kubernetes-validations" in schema:
            self._cel(schema, value, path, old)
        return value

    def _value_checks(self, schema: dict[str, Any], value: JSON, path: str) -> None:
        if "enum" in schema and value not in schema["enum"]:
            allowed = ", ".join(_describe(v) for v in schema["enum"])
            self.error(path, "Unsupported value", f"{_describe(value)}: supported values: {allowed}")
        if isinstance(value, int | float) and not isinstance(value, bool):
            # kube-openapi pkg/validation/errors/schema.go `ExceedsMinimum` / `ExceedsMaximum`: "greater than" for
            # an exclusive bound, "greater than or equal to" for an inclusive one (and "less than" likewise).
            low_exclusive = schema.get("exclusiveMinimum") is True
            if "minimum" in schema and (value <= schema["minimum"] if low_exclusive else value < schema["minimum"]):
                bound = "greater than" if low_exclusive else "greater than or equal to"
                self.error(path, "Invalid value", f"{value}: {path} in body should be {bound} {schema['minimum']}")
            high_exclusive = schema.get("exclusiveMaximum") is True
            if "maximum" in schema and (value >= schema["maximum"] if high_exclusive else value > schema["maximum"]):
                bound = "less than" if high_exclusive else "less than or equal to"
                self.error(path, "Invalid value", f"{value}: {path} in body should be {bound} {schema['maximum']}")
            if _numeric(schema.get("exclusiveMinimum")) and value <= schema["exclusiveMinimum"]:
                self.error(
                    path,
                    "Invalid value",
                    f"{value}: {path} in body should be greater than {schema['exclusiveMinimum']}",
                )
            if _numeric(schema.get("exclusiveMaximum")) and value >= schema["exclusiveMaximum"]:
                self.error(
                    path, "Invalid value", f"{value}: {path} in body should be less than {schema['exclusiveMaximum']}"
                )
        if isinstance(value, str):
            if "minLength" in schema and len(value) < schema["minLength"]:
                self.error(
                    path,
                    "Invalid value",
                    f'"{value}": {path} in body should be at least {schema["minLength"]} chars long',
                )
            if "maxLength" in schema and len(value) > schema["maxLength"]:
                self.error(path, "Too long", f"may not be more than {schema['maxLength']} bytes")
            if "pattern" in schema and re.search(schema["pattern"], value) is None:
                self.error(path, "Invalid value", f"\"{value}\": {path} in body should match '{schema['pattern']}'")
        if isinstance(value, list):
            if "minItems" in schema and len(value) < schema["minItems"]:
                self.error(
                    path,
                    "Invalid value",
                    f"{len(value)}: {path} in body should have at least {schema['minItems']} items",
                )
            if "maxItems" in schema and len(value) > schema["maxItems"]:
                self.error(path, "Too many", f"{len(value)}: must have at most {schema['maxItems']} items")
        if isinstance(value, dict):
            if "minProperties" in schema and len(value) < schema["minProperties"]:
                self.error(
                    path,
                    "Invalid value",
                    f"{len(value)}: {path} in body should have at least {schema['minProperties']} properties",
                )
            if "maxProperties" in schema and len(value) > schema["maxProperties"]:
                self.error(path, "Too many", f"{len(value)}: must have at most {schema['maxProperties']} items")

    def _object(self, schema: dict[str, Any], value: dict[str, Any], path: str, old: dict[str, Any] | None) -> JSON:
        props: dict[str, Any] = schema.get("properties", {})
        result = dict(value)
        for name, child in props.items():
            if name not in result and "default" in child:
                result[name] = copy.deepcopy(child["default"])
        for name in schema.get("required", []):
            if name not in result:
                self.error(_join(path, name), "Required value", "")
        extra = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields", False)
        for name, child_value in list(result.items()):
            child_path = _join(path, name)
            if name in props:
                result[name] = self.walk(props[name], child_value, child_path, (old or {}).get(name))
            elif isinstance(extra, dict):
                result[name] = self.walk(extra, child_value, child_path, (old or {}).get(name))
            elif extra is True or preserve or not props:
                continue
            elif self.strict:
                self.error(child_path, "unknown field", "")
            else:
                self.unknown.append(child_path)
                del result[name]
        return result

    def _matches(self, schema: dict[str, Any], value: JSON, path: str) -> bool:
        probe = _Walker(strict=False, run_cel=False)
        probe.walk_nodefault(schema, value, path)
        return not probe.errors

    def walk_nodefault(self, schema: dict[str, Any], value: JSON, path: str) -> None:
        # Value-validation subschemas (inside oneOf/anyOf/...) carry no defaults or types in structural schemas.
        for name in schema.get("required", []):
            if not isinstance(value, dict) or name not in value:
                self.error(_join(path, name), "Required value", "")
        if isinstance(value, dict):
            for name, child in schema.get("properties", {}).items():
                if name in value:
                    self.walk_nodefault(child, value[name], _join(path, name))
        self._value_checks(schema, value, path)
        for combinator in ("allOf", "anyOf", "oneOf", "not"):
            if combinator in schema:
                self._combinator(combinator, schema[combinator], value, path)

    def _combinator(self, kind: str, subs: Any, value: JSON, path: str) -> None:
        if kind == "not":
            if self._matches(subs, value, path):
                self.error(path, "Invalid value", f"{_describe(value)}: must not validate the schema (not)")
            return
        hits = sum(1 for sub in subs if self._matches(sub, value, path))
        if kind == "allOf" and hits != len(subs):
            self.error(path, "Invalid value", f"{_describe(value)}: must validate all the schemas (allOf)")
        elif kind == "anyOf" and hits == 0:
            self.error(path, "Invalid value", f"{_describe(value)}: must validate at least one schema (anyOf)")
        elif kind == "oneOf" and hits != 1:
            self.error(path, "Invalid value", f"{_describe(value)}: must validate one and only one schema (oneOf)")

    def _cel(self, schema: dict[str, Any], value: JSON, path: str, old: JSON) -> None:
        for rule in schema["x-kubernetes-validations"]:
            text = rule["rule"]
            uses_old = re.search(r"\boldSelf\b", text) is not None
            if uses_old and old is None:
                continue  # transition rule: only on update
            if path == "" and isinstance(value, dict) and self.root_metadata[0] is not None:
                value = {**value, "metadata": self.root_metadata[0]}
                if isinstance(old, dict) and self.root_metadata[1] is not None:
                    old = {**old, "metadata": self.root_metadata[1]}
            target = _join(path, rule["fieldPath"].removeprefix(".")) if rule.get("fieldPath") else path
            # kube-apiserver reports the schema type as the bad value, not the value itself.
            bad_value = f'"{schema.get("type", "")}"'
            rule_text = (rule.get("message") or text).strip()
            outcome = _evaluate(schema, text, value, old, uses_old)
            if isinstance(outcome, CELEvalError):
                self.error(
                    target, "Invalid value", f"{bad_value}: {_cel_error_text(outcome)} evaluating rule: {rule_text}"
                )
            elif not bool(outcome):
                message = (rule.get("message") or "").strip() or f"failed rule: {text.strip()}"
                reason = rule.get("reason", "FieldValueInvalid")
                if reason == "FieldValueRequired":
                    self.error(target, "Required value", message)
                elif reason == "FieldValueForbidden":
                    self.error(target, "Forbidden", message)
                else:
                    self.error(target, "Invalid value", f"{bad_value}: {message}")


_OUTCOMES: dict[tuple[int, str, str, str], tuple[dict[str, Any], Any]] = {}
"""(schema node, rule, self, oldSelf as canonical JSON) -> (the node, the rule's outcome). A rule sees nothing but
its activation (built from the value by the node's schema), so an unchanged value under the same rule and node
has the same outcome; a changed one is a new key and is evaluated. The node is kept with the outcome, so its id
is not reused while the entry lives. Bounded: cleared when full (the hot keys come back at once)."""
_OUTCOMES_LIMIT = 200_000


def _evaluate(schema: dict[str, Any], text: str, value: JSON, old: JSON, uses_old: bool) -> Any:
    """A CEL rule's outcome (a value or the CELEvalError), evaluated once per distinct (node, rule, self, oldSelf)."""
    try:
        old_key = json.dumps(old, sort_keys=True) if uses_old else ""
        key = (id(schema), text, json.dumps(value, sort_keys=True), old_key)
    except (TypeError, ValueError):  # not JSON (cannot come from a request body): no memo
        key = None
    if key is not None:
        seen = _OUTCOMES.get(key)
        if seen is not None and seen[0] is schema:
            return seen[1]
    activation = {"self": _to_cel(schema, value)}
    if uses_old:
        activation["oldSelf"] = _to_cel(schema, old)
    try:
        outcome = _program(text).evaluate(activation)
    except CELEvalError as failure:
        outcome = failure
    if key is not None:
        if len(_OUTCOMES) >= _OUTCOMES_LIMIT:
            _OUTCOMES.clear()
        _OUTCOMES[key] = (schema, outcome)
    return outcome


def _cel_error_text(failure: CELEvalError) -> str:
    """cel-go's words for a runtime error; cel-python calls every ValueError an overflow."""
    text = str(failure.args[0]) if failure.args else "evaluation error"
    if text == "return error for overflow" and len(failure.args) > 2 and failure.args[2]:
        return str(failure.args[2][0])
    return text


# ------------------------------------------------------------------------------------------------ registry


@dataclass(frozen=True)
class CrdVersion:
    group: str
    version: str
    kind: str
    plural: str
    schema: dict[str, Any]
    has_status: bool


class SchemaRegistry:
    """The CRDs a (fake) API server serves, by apiVersion and kind."""

    def __init__(self) -> None:
        self._by_gvk: dict[tuple[str, str], CrdVersion] = {}

    def add_crd(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        for version in spec["versions"]:
            entry = CrdVersion(
                group=spec["group"],
                version=version["name"],
                kind=spec["names"]["kind"],
                plural=spec["names"]["plural"],
                schema=version["schema"]["openAPIV3Schema"],
                has_status="status" in version.get("subresources", {}),
            )
            self._by_gvk[(f"{entry.group}/{entry.version}", entry.kind)] = entry

    def snapshot(self) -> dict[tuple[str, str], CrdVersion]:
        return dict(self._by_gvk)

    def restore(self, snapshot: dict[tuple[str, str], CrdVersion]) -> None:
        self._by_gvk = dict(snapshot)

    def load(self, path: str | Path) -> SchemaRegistry:
        for document in yaml.safe_load_all(Path(path).read_text()):
            if document and document.get("kind") == "CustomResourceDefinition":
                self.add_crd(document)
        return self

    def get(self, api_version: str, kind: str) -> CrdVersion:
        try:
            return self._by_gvk[(api_version, kind)]
        except KeyError:
            raise KeyError(f"no CRD serves {kind} in {api_version}") from None

    def kinds(self) -> list[tuple[str, str]]:
        return sorted(self._by_gvk)

    def validate(self, obj: dict[str, Any], old: dict[str, Any] | None = None) -> dict[str, Any]:
        """The defaulted object, or ValidationFailed listing every error (schema and CEL)."""
        entry = self.get(obj.get("apiVersion", ""), obj.get("kind", ""))
        schema = entry.schema
        walker = _Walker(strict=True, run_cel=True, root_metadata=(_cel_metadata(obj), _cel_metadata(old or {})))
        body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
        old_body = (
            {k: v for k, v in (old or {}).items() if k not in ("apiVersion", "kind", "metadata")} if old else None
        )
        checked = walker.run({**schema, "properties": _without_meta(schema)}, body, old_body)
        if walker.errors:
            name = obj.get("metadata", {}).get("name", "")
            fixed = [FieldError(e.path, e.kind, e.detail) for e in walker.errors]
            raise ValidationFailed(f"{entry.kind}.{entry.group}", name, fixed)
        return {**obj, **checked}

    def check(self, obj: dict[str, Any], old: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
        """Like `validate`, but unknown fields are pruned and returned, for the server's `fieldValidation` to judge."""
        entry = self.get(obj.get("apiVersion", ""), obj.get("kind", ""))
        walker = _Walker(strict=False, run_cel=True, root_metadata=(_cel_metadata(obj), _cel_metadata(old or {})))
        body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
        old_body = {k: v for k, v in old.items() if k not in ("apiVersion", "kind", "metadata")} if old else None
        checked = walker.run({**entry.schema, "properties": _without_meta(entry.schema)}, body, old_body)
        if walker.errors:
            failure = ValidationFailed(
                f"{entry.kind}.{entry.group}", obj.get("metadata", {}).get("name", ""), walker.errors
            )
            failure.unknown_fields = walker.unknown
            raise failure
        return {**obj, **checked}, walker.unknown


def _cel_metadata(obj: dict[str, Any]) -> dict[str, Any]:
    metadata = obj.get("metadata") or {}
    return {k: metadata[k] for k in ("name", "generateName") if k in metadata}


def _without_meta(schema: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in schema.get("properties", {}).items() if k not in ("apiVersion", "kind", "metadata")}
