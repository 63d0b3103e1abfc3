"""The preflight of a pool's signals, and the values no engine can report. Pure.

From the preflight's raw answers (`CheckAnswers`: per raw series the preset reads, the most series per pod that
share one identity and the newest sample's time; the samples per rate window) and this pass's values, `screen`
decides per pod and signal whether the value may be used, and renders `status.signalChecks` and the
`SignalsReady` condition:
- several raw series per pod where the preset expects one (the pod scraped twice, or a label the preset does not
  expect, such as a total beside per-priority series) make the value a sum of duplicates: it is not used;
- a value outside its range (a KV ratio above 1, a negative rate) is not used either;
- a series the preset reads that has no sample for a ready pod, or only old ones, is named with the engine flag
  or scrape setting that produces it.
A value not used is missing, never a number: the pod's row lists it in `missingSignals`. Called by
`sluice.core.reconcile` and by `kubectl sluice doctor`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from sluice.api.base import ConditionStatus
from sluice.api.status import SignalCheckState
from sluice.api.v1alpha1 import InferencePoolSpec, SignalCheck, SignalChecks
from sluice.core.engines import ENGINE_SETUP, NOT_PROVIDED, READINGS
from sluice.core.observed import (
    ALL_SIGNALS,
    SIGNAL_FIELD,
    CheckAnswers,
    PodSignals,
    SeriesAnswer,
    SignalName,
    SignalSnapshot,
)
from sluice.core.presets import OPTIONAL_SIGNALS, overridden
from sluice.core.promql import Reading

NAMED = 20
"""A check names at most this many pods."""
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
}
"""What each signal can be; anything else is a preset or override reading the wrong thing."""
MIN_SAMPLES = 4.0
"""Samples per rate window below which rates are unsteady: Prometheus' own advice is a range of at least four
scrape intervals (with fewer than two, `rate` reads nothing)."""
SEVERITY: tuple[SignalCheckState, ...] = ("Duplicated", "OutOfRange", "Missing", "Stale", "Failed")
"""What can be wrong with a signal, worst first: the condition's reason is the worst one found."""
REASONS = {
    "Duplicated": "DuplicateSeries",
    "OutOfRange": "ValuesOutOfRange",
    "Missing": "SeriesMissing",
    "Stale": "SeriesStale",
    "Failed": "CheckFailed",
}
CONDITION_REASONS = (
    "DuplicateSeries",
    "ValuesOutOfRange",
    "PodsNotScraped",
    "SeriesMissing",
    "SeriesStale",
    "WindowTooShort",
    "CheckFailed",
)
# True with reason WindowShort: 2 or 3 samples per window (rates read, but unsteady)
"""SignalsReady's reasons when it is not True, worst first (CheckFailed: Unknown, the others False)."""
DUPLICATE_FIX = (
    "scrape each pod once (one PodMonitor, ServiceMonitor or annotation job), or pin one job with "
    "metrics.extraLabels (e.g. {job: ...}), or override the query"
)
STALE_FIX = "check that Prometheus still scrapes these pods (its targets page) and that the engine's exporter answers"


@dataclass(frozen=True)
class Screened:
    """This pass's snapshot without the values that may not be used, and what the preflight found."""

    snapshot: SignalSnapshot
    refused: dict[str, dict[SignalName, str]] = field(default_factory=dict)
    """Pod -> signal -> why its value was not used."""
    checks: SignalChecks | None = None
    """None for an engine without a preset (custom)."""
    ready: tuple[ConditionStatus, str, str] = ("Unknown", "NotChecked", "")
    """The SignalsReady condition: status, reason, message."""


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


def _by_name(checks: CheckAnswers | None) -> dict[str, SeriesAnswer]:
    return {answer.name: answer for answer in checks.series} if checks is not None else {}


def refusals(
    spec: InferencePoolSpec, snapshot: SignalSnapshot, pods: Iterable[str]
) -> dict[str, dict[SignalName, str]]:
    """Pod -> signal -> why this pass's value may not be used (duplicate raw series, or out of range)."""
    answers = _by_name(snapshot.checks)
    readings = READINGS.get(spec.engine, {})
    refused: dict[str, dict[SignalName, str]] = {}
    for pod in pods:
        mine: dict[SignalName, str] = {}
        for signal, reading in readings.items():
            why = None if overridden(spec, signal) else duplicate(reading, answers, pod)
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


def _named(pods: list[str]) -> str:
    more = f" and {len(pods) - NAMED} more" if len(pods) > NAMED else ""
    return ", ".join(sorted(pods)[:NAMED]) + more


def _joined(names: list[str], any_of: bool) -> str:
    return " or ".join(names) if any_of else ", ".join(names)


def has_traffic(values: PodSignals | None) -> bool:
    """Whether this pass shows the pod serving (requests running, waiting or finished): a series the engine makes
    with its first request is then expected."""
    if values is None:
        return False
    return any((value or 0.0) > 0 for value in (values.running_requests, values.queue_length, values.request_rate))


def check_signal(
    spec: InferencePoolSpec,
    signal: SignalName,
    reading: Reading,
    answers: dict[str, SeriesAnswer],
    pods: list[str],
    snapshot: SignalSnapshot,
    refused: dict[str, dict[SignalName, str]],
    asked_at: datetime,
) -> SignalCheck:
    """One signal over the pool's ready pods: the worst state any pod is in, the pods in it and the fix. Ages are
    the samples' at the time the check was asked."""
    names = [series.key for series in reading.series]
    keys = [*names, *([reading.unavailable_when[0]] if reading.unavailable_when else [])]
    failures = [answers[k].failed or "" for k in keys if k in answers and answers[k].failed]
    if failures or any(k not in answers for k in keys):
        why = failures[0] if failures else "not asked"
        return SignalCheck(signal=signal, state="Failed", series=names, message=f"the check query failed: {why}")
    needed = [series for series in reading.series if series.needed]
    found: dict[SignalCheckState, list[str]] = {state: [] for state in (*SEVERITY, "NotProvided")}
    fixes: list[str] = []
    ok, oldest = 0, 0.0
    for pod in pods:
        if signal in refused.get(pod, {}):
            found["Duplicated" if duplicate(reading, answers, pod) else "OutOfRange"].append(pod)
            continue
        busy = has_traffic(snapshot.pods.get(pod))
        present = [s for s in needed if pod in answers[s.key].newest]
        # an optional signal's absence is no finding (no adapter loaded, an engine without sleep mode)
        expected = [] if signal in OPTIONAL_SIGNALS else [s for s in needed if not s.lazy or busy]
        lacking = [s for s in expected if pod not in answers[s.key].newest]
        if expected and (not present if reading.any_of else lacking):
            older = reading.unavailable_when
            if older is not None and pod in answers[older[0]].newest:
                found["NotProvided"].append(pod)
            else:
                found["Missing"].append(pod)
                fixes += [s.fix for s in lacking if s.fix and s.fix not in fixes]
            continue
        ages = [asked_at.timestamp() - answers[s.key].newest[pod] for s in present]
        if ages:
            age = min(ages) if reading.any_of else max(ages)
            oldest = max(oldest, age)
            if age > spec.metrics.stale_after:
                found["Stale"].append(pod)
                continue
        ok += 1
    state: SignalCheckState = next((s for s in (*SEVERITY, "NotProvided") if found[s]), "Ok")
    affected = found.get(state, [])
    fix: str | None
    if state in {"Duplicated", "OutOfRange"}:
        message = f"not used for {_named(affected)}: {refused[sorted(affected)[0]][signal]}"
        fix = DUPLICATE_FIX if state == "Duplicated" else "check the preset or the query override for this signal"
    elif state == "Missing":
        first = sorted(affected)[0]
        lacking_names = [s.key for s in needed if first not in answers[s.key].newest]
        message = f"no {_joined(lacking_names, reading.any_of)} for {_named(affected)}"
        fix = "; ".join(fixes) or ENGINE_SETUP.get(spec.engine) or None
    elif state == "Stale":
        message = f"newest sample older than staleAfter ({spec.metrics.stale_after:g}s) for {_named(affected)}"
        fix = STALE_FIX
    elif state == "NotProvided":
        assert reading.unavailable_when is not None
        message = f"{reading.unavailable_when[1]} ({_named(affected)})"
        fix = None
    elif pods:
        message = f"{_joined(names, reading.any_of)}: one per pod, fresh, for all {len(pods)} ready pods"
        lazy = [p for p in pods if not has_traffic(snapshot.pods.get(p))]
        if lazy and any(s.lazy for s in needed):
            message += f" that have any ({_named(lazy)}: no request yet, the engine makes them with the first)"
        fix = None
    else:
        message, fix = "no scraped ready pod to check", None
    return SignalCheck(
        signal=signal,
        state=state,
        series=names,
        pods_ok=ok,
        pods_affected=len(affected),
        pods=sorted(affected)[:NAMED],
        oldest_sample_seconds=round(oldest) if oldest else None,
        message=message,
        fix=fix,
    )


def _override_check(signal: SignalName, pods: list[str], refused: dict[str, dict[SignalName, str]]) -> SignalCheck:
    """A signal a query override reads: its series are the user's, but its values are still checked."""
    ranged = sorted(pod for pod in pods if signal in refused.get(pod, {}))
    if ranged:
        return SignalCheck(
            signal=signal,
            state="OutOfRange",
            pods_ok=len(pods) - len(ranged),
            pods_affected=len(ranged),
            pods=ranged[:NAMED],
            message=f"not used for {_named(ranged)}: {refused[ranged[0]][signal]}",
            fix="check the query override for this signal",
        )
    return SignalCheck(
        signal=signal, state="Ok", pods_ok=len(pods), message="query override: its series are not checked"
    )


def scraped(checks: CheckAnswers, pods: list[str]) -> tuple[list[str], list[str]]:
    """The pods with a series of the preset's, and those without any (not scraped, or not named by the labels)."""
    seen = {pod for answer in checks.series for pod in answer.newest}  # (`up` counts a target that is down)
    return [p for p in pods if p in seen], [p for p in pods if p not in seen]


def screen(spec: InferencePoolSpec, snapshot: SignalSnapshot, ready_pods: list[str], now: datetime) -> Screened:
    """The snapshot without values that may not be used; the preflight's status block and condition."""
    refused = refusals(spec, snapshot, snapshot.pods.keys() | set(ready_pods))
    cleaned = without(snapshot, refused)
    readings = READINGS.get(spec.engine)
    if readings is None:
        return Screened(cleaned, refused, None, ("Unknown", "NoPreset", "engine custom: no preset series to check"))
    checks = snapshot.checks
    if checks is None:
        return Screened(cleaned, refused, None, ("Unknown", "NotChecked", "the preflight has not run yet"))
    answers = _by_name(checks)
    complete = checks.failed is None and not any(answer.failed for answer in checks.series)
    present, unscraped = scraped(checks, ready_pods) if complete else (ready_pods, [])
    # a pod Prometheus has scraped once so far (it just started, or the check came between two of its first
    # scrapes' series) is judged at the next check
    samples = sorted(checks.samples_per_window[p] for p in present if p in checks.samples_per_window)
    median = statistics.median(samples) if samples else None
    young = median is not None and median >= 2  # else every pod has fewer: the window is too short, not the pods new
    new = [p for p in present if checks.samples_per_window.get(p, 2.0) < 2] if complete and young else []
    present = [p for p in present if p not in new]
    entries: list[SignalCheck] = []
    for signal in ALL_SIGNALS:
        reading = readings.get(signal)
        if overridden(spec, signal):
            entries.append(_override_check(signal, ready_pods, refused))
        elif reading is None:
            why = NOT_PROVIDED.get(spec.engine, {}).get(signal, f"not provided by {spec.engine}")
            entries.append(SignalCheck(signal=signal, state="NotProvided", message=why))
        else:
            entries.append(check_signal(spec, signal, reading, answers, present, snapshot, refused, checks.asked_at))
    # (reason, line), worst first
    found: list[tuple[str, str]] = [
        (REASONS[check.state], f"{check.signal}: {check.message}")
        for state in SEVERITY
        for check in entries
        if check.state == state
    ]
    if unscraped:
        found.append(
            (
                "PodsNotScraped",
                f"no series at all for {_named(unscraped)}: Prometheus does not scrape them (yet), or "
                f"metrics.podLabel ({spec.metrics.pod_label}) / namespaceLabel ({spec.metrics.namespace_label}) "
                "do not name them",
            )
        )
    window = (
        f"metrics.window ({spec.metrics.window:g}s) holds {median:g} samples per series (median over the pods)"
        if median is not None
        else ""
    )
    if median is not None and median < 2:
        found.append(("WindowTooShort", f"{window}: rates need two — widen metrics.window or scrape more often"))
    notes = []
    if median is not None and 2 <= median < MIN_SAMPLES:
        notes.append(
            f"{window}: rates are unsteady below {MIN_SAMPLES:g} (one missed scrape leaves one sample) — a window "
            f"of at least {MIN_SAMPLES:g} scrape intervals is advised"
        )
    if checks.failed:
        found.append(("CheckFailed", f"samples per window: {checks.failed}"))
    if new:
        notes.append(f"{_named(new)}: scraped fewer than twice within metrics.window, judged at the next check")
    found.sort(key=lambda pair: CONDITION_REASONS.index(pair[0]))
    status: ConditionStatus
    if not found:
        status, reason = "True", "WindowShort" if median is not None and median < MIN_SAMPLES else "AllPresent"
        lines = [f"every series the {spec.engine} preset reads is fresh and one per pod ({len(present)} ready pods)"]
    else:
        reason = found[0][0]
        status = "Unknown" if reason == "CheckFailed" else "False"
        lines = [line for _, line in found]
    lines += notes
    message = "; ".join(lines)
    block = SignalChecks(
        checked_at=checks.asked_at,
        engine=spec.engine,
        samples_per_window=median,
        message=message,
        pods_without_series=len(unscraped),
        unscraped=sorted(unscraped)[:NAMED],
        signals=entries,
    )
    return Screened(cleaned, refused, block, (status, reason, message))
