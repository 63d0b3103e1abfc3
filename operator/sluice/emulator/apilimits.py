"""Size limits of the Kubernetes API emulator: what etcd and the built-in kinds' validation refuse for size.

Local-stack tool, called by `apistore.Store` before it stores an object. Two limits, as on a real cluster:
- etcd refuses a request over 1.5 MiB (`--max-request-bytes` 1572864); kube-apiserver passes its error on as a 500
  with no reason: `etcdserver: request is too large`. Dry runs never reach etcd, so they are not refused.
- ConfigMaps and Secrets hold at most 1 MiB of data (`core.MaxSecretSize`), refused with a 422 before storage.
(The 3 MiB limit on the request body itself is the HTTP layer's: `apiserver.MAX_REQUEST_BODY_BYTES`.)
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

ETCD_MAX_REQUEST_BYTES = 1572864
MAX_SECRET_SIZE = 1024 * 1024


def stored_size(obj: dict[str, Any]) -> int:
    """Bytes of the object as stored (custom resources are stored as compact JSON)."""
    return len(json.dumps(obj, separators=(",", ":")).encode())


def exceeds_etcd_limit(obj: dict[str, Any]) -> bool:
    return stored_size(obj) > ETCD_MAX_REQUEST_BYTES


def _decoded_length(value: str) -> int:
    try:
        return len(base64.b64decode(value, validate=True))
    except (binascii.Error, ValueError):
        return len(value)


def data_size_errors(key: tuple[str, str], obj: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(field, reason, message) when a ConfigMap's or Secret's data is over 1 MiB, worded as apimachinery."""
    too_long = f"Too long: must have at most {MAX_SECRET_SIZE} bytes"
    if key == ("", "configmaps"):
        total = sum(len(str(v).encode()) for v in (obj.get("data") or {}).values())
        total += sum(_decoded_length(str(v)) for v in (obj.get("binaryData") or {}).values())
        # ConfigMap validation reports the whole object, a field path that prints as "[]".
        return [("[]", "FieldValueTooLong", too_long)] if total > MAX_SECRET_SIZE else []
    if key == ("", "secrets"):
        total = sum(_decoded_length(str(v)) for v in (obj.get("data") or {}).values())
        return [("data", "FieldValueTooLong", too_long)] if total > MAX_SECRET_SIZE else []
    return []
