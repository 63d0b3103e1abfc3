"""The values a pass may not use: a signal summed over duplicated raw series (the pod scraped twice, or a label
the preset does not expect), or a value outside its range (a KV ratio above 1, a negative rate). A value not used
is missing, never a number. Pure; `sluice.core.signalcheck` reports what was refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from sluice.api.v1alpha1 import InferencePoolSpec
from sluice.core.engines import READINGS
from sluice.core.observed import ALL_SIGNALS, SIGNAL_FIELD, CheckAnswers, SeriesAnswer, SignalName, SignalSnapshot
from sluice.core.presets import asked, overridden
from sluice.core.promql import Reading

EPSILON = 1e-6
"""Rounding room at a range's ends (a ratio of two rates read a moment apart)."""
RANGES: dict[SignalName, tuple[float, float]] = {
    "ttft": (0.0, math.inf),
    "ttftP95": (0.0, math.inf),
    "kvCacheUsage": (0.0, 1.0),
    "queueLength": (0.0, math.inf),
    "runningRequests": (0.0, math.inf),
    "requestRate": (0.0, math.inf),
    "errorRate": (0.0, 1.0),
    "loraFailureRate": (0.0, 1.0),
    "sleeping": (0.0, 1.0),
    "refusedRate": (0.0, math.inf),
}
"""What each signal can be; anything else is a preset or override reading the wrong thing."""


def out_of_range(signal: SignalName, value: float) -> str | None:
    low, high = RANGES[signal]
    if low - EPSILON <= value <= high + EPSILON:
        return None
    bound = f"{low:g} to {high:g}" if math.isfinite(high) else f"at least {low:g}"
    return f"read {value:g}, outside {bound}"


def duplicate(reading: Reading, answers: dict[str, SeriesAnswer], pod: str) -> str | None:
    """Why the reading's value for `pod` sums duplicates, naming the series and labels; None if it does not."""
    for series in reading.series:
        answer = answers.get(series.key)
        count = answer.per_identity.get(pod) if answer is not None else None
        if count is not None and count > 1:
            ids = ", ".join(series.identity) or "no engine label"
            return (
                f"{series.key} has {count:g} raw series per ({ids}): the pod is scraped twice, or a label "
                "the preset does not expect splits it"
            )
    return None


def series_answers(checks: CheckAnswers | None) -> dict[str, SeriesAnswer]:
    return {answer.name: answer for answer in checks.series} if checks is not None else {}


def refusals(
    spec: InferencePoolSpec, snapshot: SignalSnapshot, pods: Iterable[str]
) -> dict[str, dict[SignalName, str]]:
    """Pod -> signal -> why this pass's value may not be used (duplicate raw series, or out of range)."""
    answers = series_answers(snapshot.checks)
    readings = READINGS.get(spec.engine, {})
    refused: dict[str, dict[SignalName, str]] = {}
    for pod in pods:
        mine: dict[SignalName, str] = {}
        for signal, reading in readings.items():
            why = None if overridden(spec, signal) or not asked(spec, signal) else duplicate(reading, answers, pod)
            if why is not None:
                mine[signal] = why
        values = snapshot.pods.get(pod)
        for signal in ALL_SIGNALS if values is not None else ():
            value = getattr(values, SIGNAL_FIELD[signal])
            why = None if value is None or signal in mine else out_of_range(signal, value)
            if why is not None:
                mine[signal] = f"{why} ({_source(spec, signal)})"
        if mine:
            refused[pod] = mine
    return refused


def _source(spec: InferencePoolSpec, signal: SignalName) -> str:
    """Where a signal's value comes from, for a refusal's reason."""
    reading = READINGS.get(spec.engine, {}).get(signal)
    if overridden(spec, signal) or reading is None:
        return "from the query override metrics.queries." + signal
    return "from " + " or ".join(series.key for series in reading.series)


def without(snapshot: SignalSnapshot, refused: dict[str, dict[SignalName, str]]) -> SignalSnapshot:
    """The snapshot with the refused values missing."""
    if not refused:
        return snapshot
    pods = dict(snapshot.pods)
    for pod, signals in refused.items():
        if pod in pods:
            pods[pod] = pods[pod].model_copy(update={SIGNAL_FIELD[s]: None for s in signals})
    return snapshot.model_copy(update={"pods": pods})
