"""Object-metadata validation of the Kubernetes API emulator: names, generateName, label and annotation syntax.

Local-stack tool, called by `apistore.Store` on every create and update. The rules and the wording are
apimachinery's (`k8s.io/apimachinery/pkg/util/validation` and `.../api/validation/objectmeta.go`), so an invalid
name fails here with the message a real API server gives, e.g.
`metadata.name: Invalid value: "Bad_Name": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric
characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for
validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')`.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from typing import Any

DNS1123_LABEL_FMT = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
    "and must start and end with an alphanumeric character"
)
DNS1123_SUBDOMAIN_FMT = DNS1123_LABEL_FMT + "(\\." + DNS1123_LABEL_FMT + ")*"
DNS1123_SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
    "and must start and end with an alphanumeric character"
)
DNS1035_LABEL_FMT = "[a-z]([-a-z0-9]*[a-z0-9])?"
DNS1035_LABEL_MSG = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', "
    "start with an alphabetic character, and end with an alphanumeric character"
)
QUALIFIED_NAME_FMT = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
QUALIFIED_NAME_MSG = (
    "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character"
)
LABEL_VALUE_FMT = "(" + QUALIFIED_NAME_FMT + ")?"
LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
    "and must start and end with an alphanumeric character"
)
TOTAL_ANNOTATION_SIZE_LIMIT = 256 * 1024
# apiserver's names.SimpleNameGenerator: 5 characters from an alphabet without vowels or look-alikes.
GENERATED_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
MAX_GENERATED_NAME_LENGTH = 63 - 5


def _full(fmt: str) -> re.Pattern[str]:
    return re.compile(f"^{fmt}$")


_DNS1123_LABEL = _full(DNS1123_LABEL_FMT)
_DNS1123_SUBDOMAIN = _full(DNS1123_SUBDOMAIN_FMT)
_DNS1035_LABEL = _full(DNS1035_LABEL_FMT)
_QUALIFIED_NAME = _full(QUALIFIED_NAME_FMT)
_LABEL_VALUE = _full(LABEL_VALUE_FMT)


def regex_error(message: str, fmt: str, *examples: str) -> str:
    """apimachinery's RegexError, byte for byte (its examples are joined as `'a',  or 'b', `)."""
    if not examples:
        return f"{message} (regex used for validation is '{fmt}')"
    text = message + " (e.g. "
    for index, example in enumerate(examples):
        if index:
            text += " or "
        text += f"'{example}', "
    return text + f"regex used for validation is '{fmt}')"


def max_len_error(length: int) -> str:
    return f"must be no more than {length} characters"


def dns1123_label(value: str) -> list[str]:
    errors = [max_len_error(63)] if len(value) > 63 else []
    if not _DNS1123_LABEL.match(value):
        if _DNS1123_SUBDOMAIN.match(value):
            errors.append("must not contain dots")
        else:
            errors.append(regex_error(DNS1123_LABEL_MSG, DNS1123_LABEL_FMT, "my-name", "123-abc"))
    return errors


def dns1123_subdomain(value: str) -> list[str]:
    errors = [max_len_error(253)] if len(value) > 253 else []
    if not _DNS1123_SUBDOMAIN.match(value):
        errors.append(regex_error(DNS1123_SUBDOMAIN_MSG, DNS1123_SUBDOMAIN_FMT, "example.com"))
    return errors


def dns1035_label(value: str) -> list[str]:
    errors = [max_len_error(63)] if len(value) > 63 else []
    if not _DNS1035_LABEL.match(value):
        errors.append(regex_error(DNS1035_LABEL_MSG, DNS1035_LABEL_FMT, "my-name", "abc-123"))
    return errors


def qualified_name(value: str) -> list[str]:
    parts = value.split("/")
    errors: list[str] = []
    if len(parts) > 2:
        return [
            "a qualified name "
            + regex_error(QUALIFIED_NAME_MSG, QUALIFIED_NAME_FMT, "MyName", "my.name", "123-abc")
            + " with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"
        ]
    name = parts[-1]
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            errors.append("prefix part must be non-empty")
        else:
            errors += [f"prefix part {message}" for message in dns1123_subdomain(prefix)]
    if not name:
        errors.append("name part must be non-empty")
    elif len(name) > 63:
        errors.append("name part " + max_len_error(63))
    if not _QUALIFIED_NAME.match(name):
        errors.append(
            "name part " + regex_error(QUALIFIED_NAME_MSG, QUALIFIED_NAME_FMT, "MyName", "my.name", "123-abc")
        )
    return errors


def label_value(value: str) -> list[str]:
    errors = [max_len_error(63)] if len(value) > 63 else []
    if not _LABEL_VALUE.match(value):
        errors.append(regex_error(LABEL_VALUE_MSG, LABEL_VALUE_FMT, "MyValue", "my_value", "12345"))
    return errors


def go_quote(value: Any) -> str:
    """A value as Go's field errors print it: strings %q-quoted, the rest as JSON."""
    return json.dumps(value, ensure_ascii=False)


NameRule = Callable[[str], list[str]]

# Which rule names each kind: most objects are DNS-1123 subdomains; namespaces and a few others are labels.
NAME_RULES: dict[tuple[str, str], NameRule] = {
    ("", "namespaces"): dns1123_label,
    ("", "services"): dns1035_label,
}


def generated_name(prefix: str) -> str:
    base = prefix[:MAX_GENERATED_NAME_LENGTH]
    return base + "".join(secrets.choice(GENERATED_SUFFIX_ALPHABET) for _ in range(5))


def metadata_errors(key: tuple[str, str], meta: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(field, reason, message) for every metadata problem, in apimachinery's order and words."""
    rule = NAME_RULES.get(key, dns1123_subdomain)
    errors: list[tuple[str, str, str]] = []
    generate = meta.get("generateName")
    if generate:
        # A prefix may end in '-': apimachinery masks a trailing dash before checking it.
        masked = generate[:-1] + "a" if generate.endswith("-") else generate
        errors += [
            ("metadata.generateName", "FieldValueInvalid", f"Invalid value: {go_quote(generate)}: {message}")
            for message in rule(masked)
        ]
    name = meta.get("name", "")
    errors += [
        ("metadata.name", "FieldValueInvalid", f"Invalid value: {go_quote(name)}: {message}") for message in rule(name)
    ]
    labels = meta.get("labels") or {}
    for label_key, value in labels.items():
        errors += [
            ("metadata.labels", "FieldValueInvalid", f"Invalid value: {go_quote(label_key)}: {message}")
            for message in qualified_name(label_key)
        ]
        errors += [
            ("metadata.labels", "FieldValueInvalid", f"Invalid value: {go_quote(value)}: {message}")
            for message in label_value(str(value))
        ]
    annotations = meta.get("annotations") or {}
    for annotation_key in annotations:
        errors += [
            ("metadata.annotations", "FieldValueInvalid", f"Invalid value: {go_quote(annotation_key)}: {message}")
            for message in qualified_name(annotation_key.lower())
        ]
    size = sum(len(k) + len(str(v)) for k, v in annotations.items())
    if size > TOTAL_ANNOTATION_SIZE_LIMIT:
        errors.append(
            (
                "metadata.annotations",
                "FieldValueTooLong",
                f"Too long: must have at most {TOTAL_ANNOTATION_SIZE_LIMIT} bytes",
            )
        )
    return errors
