"""Prometheus' query answers read into per-pod values and signals. Pure.

An instant-vector answer becomes pod -> value (`vector_values`: the body as Prometheus writes it, read with one
regular expression when it is aggregated by the pod label alone, else through `json.loads` and `pod_values`); a
NaN, an infinity or a series without the pod label is missing, never 0. `to_snapshot` / `values_snapshot` turn a
pool's answers into its `SignalSnapshot`. Used by `sluice.io.prometheus.PromIO` (and the tools that read
Prometheus directly).
"""

from __future__ import annotations

import functools
import json
import math
import re
from datetime import datetime, timedelta

from sluice.api.jsontypes import JsonValue, members
from sluice.core.observed import SIGNAL_FIELD, PodSignals, SignalName, SignalSnapshot


def parse_value(sample: JsonValue) -> float | None:
    """A Prometheus instant-vector sample value (`[time, "value"]`); NaN and infinities (0/0, empty histograms)
    are missing, not 0, as is a sample of another shape."""
    raw = sample[1] if isinstance(sample, list) and len(sample) > 1 else None
    if not isinstance(raw, str | int | float):
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def pod_values(series: list[JsonValue] | None, pod_label: str) -> dict[str, float]:
    """Pod -> value from a vector answer. Pure.

    A series without the pod label, or whose value is NaN or infinite, is left out (missing, never 0); where a
    pod has several series the last finite one counts. Kept as plain floats: an answer over 16,000 pods held as
    Prometheus' JSON (a dict, a dict and a list per series) is ~50,000 objects the garbage collector has to walk
    for as long as the answer is shared.
    """
    out: dict[str, float] = {}
    for item in series or []:
        if not isinstance(item, dict):
            raise ValueError("the answer is not an instant vector (a query override must return one)")
        pod = members(item, "metric").get(pod_label)
        value = parse_value(item.get("value"))
        if pod is not None and value is not None:
            out[str(pod)] = value
    return out


VECTOR_HEAD = '{"status":"success","data":{"resultType":"vector","result":['
"""How Prometheus' query API begins a successful instant-vector answer (its encoder writes the fields in this
order and nothing between them)."""


@functools.cache
def _series_pattern(pod_label: str) -> re.Pattern[str]:
    """One series of an answer aggregated by `pod_label` alone, as Prometheus writes it (no escapes)."""
    label = re.escape(json.dumps(pod_label))
    return re.compile(r'\{"metric":\{' + label + r':"([^"\\]*)"\},"value":\[[^,\]]*,"([^"\\]*)"\]\}')


def vector_values(body: bytes, pod_label: str) -> dict[str, float]:
    """Pod -> value from a query answer's JSON body: `pod_values` of its result. Pure.

    An answer aggregated by the pod label alone (every preset's) is read by `plain_vector_values`; anything else
    (more labels, another result type, an escape, warnings) goes through `json.loads` and `pod_values`. Both
    read the same values; a 16,000-pod answer costs ~10 ms instead of ~30 ms, the largest share of a 1000-pool
    operator's CPU.
    """
    text = body.decode("utf-8", errors="replace")  # as requests' `.json()` read it
    plain = plain_vector_values(text, pod_label)
    if plain is not None:
        return plain
    answer: JsonValue = json.loads(text)  # the body is JSON (json.loads is untyped)
    data = members(answer, "data")
    if "result" not in data:  # a 200 that is not a query answer (a proxy's page, say)
        raise ValueError(f"not a Prometheus query answer: {text[:120]!r}")
    result = data["result"]
    return pod_values(result if isinstance(result, list) else [], pod_label)


def plain_vector_values(text: str, pod_label: str) -> dict[str, float] | None:
    """`vector_values` of an answer as Prometheus writes one aggregated by the pod label alone, read with one
    regular expression; None unless it found every series of a whole answer and nothing in it is escaped. Pure."""
    if not (text.startswith(VECTOR_HEAD) and text.endswith("]}}")) or "\\" in text:
        return None
    found = _series_pattern(pod_label).findall(text)
    if len(found) != text.count('{"metric":'):
        return None
    out: dict[str, float] = {}
    for pod, sample in found:  # `parse_value` inlined: this loop runs for every pod of every answer
        try:
            value = float(sample)
        except ValueError:
            continue
        if value - value == 0.0:  # finite: NaN and infinities are missing, not 0
            out[pod] = value
    return out


def _times(offsets: dict[str, float], pods: set[str], asked_at: datetime) -> dict[str, datetime]:
    """Pod -> time of its newest sample on the operator's clock: the freshness answer's values are each sample's
    time less the query's evaluation (`sluice.core.presets.FRESHNESS`, Prometheus' clock), and Prometheus
    evaluated it when it was asked, `asked_at` (on the operator's clock, give or take the request's latency)."""
    return {pod: asked_at + timedelta(seconds=offset) for pod, offset in offsets.items() if pod in pods}


def to_snapshot(
    answers: dict[SignalName, list[JsonValue]],
    failed: dict[str, str],
    unsupported: tuple[SignalName, ...],
    pods: set[str],
    pod_label: str,
    collected_at: datetime,
    freshness: list[JsonValue] | None = None,
) -> SignalSnapshot:
    """Per-pod signals from the raw query answers, keeping only the pool's pods. Pure.

    `freshness` is the answer of the freshness query, or None when the engine has none (then sample age is
    unknown and the core judges freshness by `collected_at`).
    """
    return values_snapshot(
        {signal: pod_values(series, pod_label) for signal, series in answers.items()},
        failed,
        unsupported,
        pods,
        collected_at,
        None if freshness is None else pod_values(freshness, pod_label),
    )


def values_snapshot(
    answers: dict[SignalName, dict[str, float]],
    failed: dict[str, str],
    unsupported: tuple[SignalName, ...],
    pods: set[str],
    collected_at: datetime,
    freshness: dict[str, float] | None = None,
    freshness_asked_at: datetime | None = None,
) -> SignalSnapshot:
    """`to_snapshot` over answers already split by pod (`pod_values`); `freshness_asked_at`: when the freshness
    answer was asked (`collected_at` by default). Pure."""
    values: dict[str, dict[str, float]] = {}
    for signal, by_pod in answers.items():
        field = SIGNAL_FIELD[signal]
        for pod, value in by_pod.items():
            if pod in pods:
                values.setdefault(pod, {})[field] = value
    return SignalSnapshot(
        collected_at=collected_at,
        failed=failed,
        unsupported=list(unsupported),
        pods={pod: PodSignals.model_validate(fields) for pod, fields in values.items()},
        # No sample is newer than the oldest answer read (a fallback answer is older than the others).
        sampled_at={
            pod: min(stamp, collected_at)
            for pod, stamp in _times(freshness or {}, pods, freshness_asked_at or collected_at).items()
        },
        freshness_known=freshness is not None,
    )


__all__ = [
    "VECTOR_HEAD",
    "parse_value",
    "plain_vector_values",
    "pod_values",
    "to_snapshot",
    "values_snapshot",
    "vector_values",
]
