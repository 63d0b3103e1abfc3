"""`status.podMemory`: the per-pod memory of the pods a large pool's status does not list, compactly. Pure.

The next pass needs, of every pod, what its previous row held: weight (hysteresis, frozen weights), smoothed
score, state and since, the TTFT estimate, restarts (restart detection), the failing-band streak, the floor mark
and the last incident (quiet period, ramp), the learned idle TTFT and learned capacity (the headroom policy), the
saturated batch and inbound limit (admission); revision and class feed the summary. For the pods without a row
that is one short array each, trailing defaults dropped, the whole list as zlib-compressed JSON in base64: pod
names of one Deployment share their prefix and compress well. Times are kept exactly (ISO strings), so an
incident or a ramp reads back the same instant. The format carries its version (`z1:`); anything else is refused
with a reason, never guessed.
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from datetime import datetime

from pydantic import TypeAdapter, ValidationError

from sluice.api.jsontypes import JsonObject, JsonValue
from sluice.api.status import EndpointStatus, InferencePoolStatus

PREFIX = "z1:"
STATES = ("Routable", "Zeroed", "Recovering")
VERDICTS = ("scored", "ramping", "frozen", "awaiting", "quiet", "excluded")
# Array positions after the pod name, each with the value that is dropped when it ends the array.
FIELDS: tuple[tuple[str, int | float | None], ...] = (
    ("weight", 0),
    ("score", 0.0),
    ("state", 0),
    ("since", None),
    ("ttft_estimate_seconds", None),
    ("restarts", 0),
    ("consecutive_failures", 0),
    ("verdict", 0),
    ("floor_held", 0),
    ("last_incident_at", None),
    ("incident", None),
    ("incident_message", None),
    ("class_known", 1),
    ("revision", None),
    ("hardware_class", None),
    ("idle_ttft_seconds", None),
    ("learned_capacity", None),
    ("idle_ttft_samples", None),
    ("saturated_batch", None),
    ("inbound_limit", None),
    ("rate_limit", None),
    ("rate_at_limit", None),
    ("admission_share", None),
    ("limit_since", None),
)
_ROWS: TypeAdapter[list[EndpointStatus]] = TypeAdapter(list[EndpointStatus])


class MemoryUnreadable(ValueError):
    """The stored memory is not in a format this version reads."""


def _time(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _pack(row: EndpointStatus) -> list[JsonValue]:
    values: list[JsonValue] = [
        row.weight,
        row.score,
        STATES.index(row.state),
        _time(row.since),
        row.ttft_estimate_seconds,
        row.restarts,
        row.consecutive_failures,
        VERDICTS.index(row.verdict) if row.verdict in VERDICTS else 0,
        int(row.floor_held),
        _time(row.last_incident_at),
        row.incident,
        row.incident_message,
        int(row.class_known),
        row.revision,
        row.hardware_class,
        row.idle_ttft_seconds,
        row.learned_capacity,
        row.idle_ttft_samples,
        row.saturated_batch,
        row.inbound_limit,
        row.rate_limit,
        row.rate_at_limit,
        row.admission_share,
        _time(row.limit_since),
    ]
    while values and values[-1] == FIELDS[len(values) - 1][1]:
        values.pop()
    return [row.pod, *values]


def encode(rows: list[EndpointStatus]) -> str | None:
    """The memory of `rows` as stored; None when there is nothing to remember."""
    if not rows:
        return None
    text = json.dumps([_pack(row) for row in rows], separators=(",", ":"), ensure_ascii=False)
    return PREFIX + base64.b64encode(zlib.compress(text.encode(), 9)).decode()


def decode(stored: str | None) -> list[EndpointStatus]:
    """Rows (memory fields only: no signals, no reason) for the pods the memory holds."""
    if not stored:
        return []
    if not stored.startswith(PREFIX):
        raise MemoryUnreadable(f"podMemory: unknown format {stored[:8]!r} (this version reads {PREFIX!r})")
    try:
        packed = json.loads(zlib.decompress(base64.b64decode(stored[len(PREFIX) :], validate=True)))
    except (binascii.Error, zlib.error, ValueError) as failure:
        raise MemoryUnreadable(f"podMemory: not readable ({failure})") from failure
    if not isinstance(packed, list):
        raise MemoryUnreadable("podMemory: not a list of pods")
    return _validated([_item(entry) for entry in packed])


def _named(names: tuple[str, ...], value: JsonValue, entry: list[JsonValue]) -> str:
    """A state or verdict stored as its position in `names`."""
    if not isinstance(value, int):
        raise MemoryUnreadable(f"podMemory: bad state or verdict in {str(entry)[:60]}")
    try:
        return names[value]
    except IndexError as failure:
        raise MemoryUnreadable(f"podMemory: bad state or verdict in {str(entry)[:60]}") from failure


def _item(entry: JsonValue) -> JsonObject:
    """One pod's array as the fields of its row, the dropped trailing defaults restored."""
    if not isinstance(entry, list) or not entry or len(entry) > len(FIELDS) + 1:
        raise MemoryUnreadable(f"podMemory: malformed entry {str(entry)[:60]}")
    values = entry[1:] + [default for _, default in FIELDS[len(entry) - 1 :]]
    item: JsonObject = {"pod": entry[0]}
    for (name, _), value in zip(FIELDS, values, strict=True):
        item[name] = value
    item["state"] = _named(STATES, item["state"], entry)
    item["verdict"] = _named(VERDICTS, item["verdict"], entry)
    item["floor_held"] = bool(item["floor_held"])
    item["class_known"] = bool(item["class_known"])
    return item


def _validated(items: list[JsonObject]) -> list[EndpointStatus]:
    try:
        return _ROWS.validate_python(items)
    except ValidationError as failure:
        raise MemoryUnreadable(f"podMemory: {failure.errors()[0]['msg']}") from failure


def remembered(status: InferencePoolStatus | None) -> dict[str, EndpointStatus]:
    """Every pod the status remembers, by name: its rows, and the pods held in podMemory.

    The memory was checked when the status was read (`sluice.api.snapshot`); a status built in this process
    always holds readable memory."""
    if status is None:
        return {}
    rows = {row.pod: row for row in decode(status.pod_memory)}
    rows.update((row.pod, row) for row in status.endpoints)
    return rows


def readable(status: InferencePoolStatus | None) -> tuple[InferencePoolStatus | None, list[str]]:
    """The status with podMemory dropped (and said why) when this version cannot read it."""
    if status is None or not status.pod_memory:
        return status, []
    try:
        decode(status.pod_memory)
    except MemoryUnreadable as failure:
        return status.model_copy(update={"pod_memory": None}), [f"{failure} (dropped: those pods start afresh)"]
    return status, []
