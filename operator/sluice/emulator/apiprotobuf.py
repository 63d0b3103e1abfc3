"""Kubernetes protobuf bodies, decoded for the API emulator: what typed Go clients send for built-in kinds.

Local-stack tool, called by `apiserver` for request bodies of type `application/vnd.kubernetes.protobuf`.
client-go's typed clients write built-in objects as protobuf: Helm stores its releases as Secrets this way,
`kubectl create namespace|configmap|secret|token` and typed deletes send protobuf too. The body is the `k8s\\0`
magic and a `runtime.Unknown` envelope (apiVersion, kind, raw message); the raw message is decoded with the field
numbers of the upstream `generated.proto` files, for the kinds those clients send (the schemas below). Other kinds
are refused with 415, as a server that does not know a content type refuses it.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

MAGIC = b"k8s\x00"
CONTENT_TYPE = "application/vnd.kubernetes.protobuf"


class ProtobufError(ValueError):
    """The body is not a protobuf message this decoder knows."""


# ------------------------------------------------------------------------------------------------ wire format


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= len(data):
            raise ProtobufError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) pairs: varints as ints, length-delimited fields as bytes."""
    out: list[tuple[int, int | bytes]] = []
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            out.append((number, value))
        elif wire == 2:
            length, pos = _varint(data, pos)
            out.append((number, data[pos : pos + length]))
            pos += length
        elif wire == 1:
            out.append((number, int.from_bytes(data[pos : pos + 8], "little")))
            pos += 8
        elif wire == 5:
            out.append((number, int.from_bytes(data[pos : pos + 4], "little")))
            pos += 4
        else:
            raise ProtobufError(f"unsupported wire type {wire}")
    return out


# ------------------------------------------------------------------------------------------------ field decoders

Decoder = Callable[[int | bytes], Any]
Schema = dict[int, tuple[str, Decoder, bool]]  # number -> (JSON name, decoder, repeated)


def _string(value: int | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bytes_b64(value: int | bytes) -> str:
    return base64.b64encode(value if isinstance(value, bytes) else b"").decode()


def _int(value: int | bytes) -> int:
    number = value if isinstance(value, int) else 0
    return number - (1 << 64) if number >= 1 << 63 else number


def _bool(value: int | bytes) -> bool:
    return bool(value)


def _message(schema: Schema) -> Decoder:
    def decode(value: int | bytes) -> dict[str, Any]:
        return decode_message(value if isinstance(value, bytes) else b"", schema)

    return decode


def _map(value_decoder: Decoder) -> Decoder:
    def decode(value: int | bytes) -> tuple[str, Any]:
        entry = dict(fields(value if isinstance(value, bytes) else b""))
        return _string(entry.get(1, b"")), value_decoder(entry.get(2, b""))

    return decode


def _time(value: int | bytes) -> str:
    entry = dict(fields(value if isinstance(value, bytes) else b""))
    seconds = _int(entry.get(1, 0))
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def decode_message(data: bytes, schema: Schema) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for number, value in fields(data):
        if number not in schema:
            continue  # a field this decoder does not need
        name, decoder, repeated = schema[number]
        decoded = decoder(value)
        if repeated and isinstance(decoded, tuple):
            out.setdefault(name, {})[decoded[0]] = decoded[1]
        elif repeated:
            out.setdefault(name, []).append(decoded)
        else:
            out[name] = decoded
    return out


# ------------------------------------------------------------------------------------------------ schemas

OWNER_REFERENCE: Schema = {
    1: ("kind", _string, False),
    3: ("name", _string, False),
    4: ("uid", _string, False),
    5: ("apiVersion", _string, False),
    6: ("controller", _bool, False),
    7: ("blockOwnerDeletion", _bool, False),
}
OBJECT_META: Schema = {
    1: ("name", _string, False),
    2: ("generateName", _string, False),
    3: ("namespace", _string, False),
    5: ("uid", _string, False),
    6: ("resourceVersion", _string, False),
    7: ("generation", _int, False),
    8: ("creationTimestamp", _time, False),
    11: ("labels", _map(_string), True),
    12: ("annotations", _map(_string), True),
    13: ("ownerReferences", _message(OWNER_REFERENCE), True),
    14: ("finalizers", _string, True),
}
POLICY_RULE: Schema = {
    1: ("verbs", _string, True),
    2: ("apiGroups", _string, True),
    3: ("resources", _string, True),
    4: ("resourceNames", _string, True),
    5: ("nonResourceURLs", _string, True),
}
SUBJECT: Schema = {1: ("kind", _string, False), 2: ("apiGroup", _string, False), 3: ("name", _string, False)}
SUBJECT[4] = ("namespace", _string, False)
ROLE_REF: Schema = {1: ("apiGroup", _string, False), 2: ("kind", _string, False), 3: ("name", _string, False)}
RBAC = "rbac.authorization.k8s.io/v1"
ROLE: Schema = {1: ("metadata", _message(OBJECT_META), False), 2: ("rules", _message(POLICY_RULE), True)}
BINDING: Schema = {
    1: ("metadata", _message(OBJECT_META), False),
    2: ("subjects", _message(SUBJECT), True),
    3: ("roleRef", _message(ROLE_REF), False),
}
RESOURCE_ATTRIBUTES: Schema = {
    1: ("namespace", _string, False),
    2: ("verb", _string, False),
    3: ("group", _string, False),
    4: ("version", _string, False),
    5: ("resource", _string, False),
    6: ("subresource", _string, False),
    7: ("name", _string, False),
}
NON_RESOURCE_ATTRIBUTES: Schema = {1: ("path", _string, False), 2: ("verb", _string, False)}
ACCESS_REVIEW_SPEC: Schema = {
    1: ("resourceAttributes", _message(RESOURCE_ATTRIBUTES), False),
    2: ("nonResourceAttributes", _message(NON_RESOURCE_ATTRIBUTES), False),
}
KINDS: dict[tuple[str, str], Schema] = {
    ("authorization.k8s.io/v1", "SelfSubjectAccessReview"): {
        1: ("metadata", _message(OBJECT_META), False),
        2: ("spec", _message(ACCESS_REVIEW_SPEC), False),
    },
    ("authentication.k8s.io/v1", "SelfSubjectReview"): {1: ("metadata", _message(OBJECT_META), False)},
    (RBAC, "Role"): ROLE,
    (RBAC, "ClusterRole"): ROLE,
    (RBAC, "RoleBinding"): BINDING,
    (RBAC, "ClusterRoleBinding"): BINDING,
    ("v1", "Secret"): {
        1: ("metadata", _message(OBJECT_META), False),
        2: ("data", _map(_bytes_b64), True),
        3: ("type", _string, False),
        4: ("stringData", _map(_string), True),
        5: ("immutable", _bool, False),
    },
    ("v1", "ConfigMap"): {
        1: ("metadata", _message(OBJECT_META), False),
        2: ("data", _map(_string), True),
        3: ("binaryData", _map(_bytes_b64), True),
        4: ("immutable", _bool, False),
    },
    ("v1", "Namespace"): {
        1: ("metadata", _message(OBJECT_META), False),
        2: ("spec", _message({1: ("finalizers", _string, True)}), False),
    },
    ("v1", "ServiceAccount"): {
        1: ("metadata", _message(OBJECT_META), False),
        3: ("imagePullSecrets", _message({1: ("name", _string, False)}), True),
        4: ("automountServiceAccountToken", _bool, False),
    },
    ("authentication.k8s.io/v1", "TokenRequest"): {
        1: ("metadata", _message(OBJECT_META), False),
        2: ("spec", _message({1: ("audiences", _string, True), 4: ("expirationSeconds", _int, False)}), False),
    },
    ("v1", "DeleteOptions"): {
        1: ("gracePeriodSeconds", _int, False),
        2: ("preconditions", _message({1: ("uid", _string, False), 2: ("resourceVersion", _string, False)}), False),
        3: ("orphanDependents", _bool, False),
        4: ("propagationPolicy", _string, False),
        5: ("dryRun", _string, True),
    },
}


def decode(body: bytes) -> dict[str, Any]:
    """The object a protobuf request body carries, as the JSON form of it."""
    if not body.startswith(MAGIC):
        raise ProtobufError("not a Kubernetes protobuf body (no k8s\\0 magic)")
    envelope = dict(fields(body[len(MAGIC) :]))
    meta_field = envelope.get(1, b"")
    type_meta = dict(fields(meta_field if isinstance(meta_field, bytes) else b""))
    api_version, kind = _string(type_meta.get(1, b"")), _string(type_meta.get(2, b""))
    # DeleteOptions travel as meta.k8s.io/v1 or under the resource's group version; the fields are the same.
    schema = KINDS.get((api_version, kind)) or (KINDS[("v1", "DeleteOptions")] if kind == "DeleteOptions" else None)
    if schema is None:
        raise ProtobufError(f"protobuf bodies of {kind} ({api_version}) are not supported; send JSON")
    raw = envelope.get(2, b"")
    obj = decode_message(raw if isinstance(raw, bytes) else b"", schema)
    return {"apiVersion": api_version, "kind": kind, **obj}
