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

import statistics
from dataclasses import dataclass, field
from datetime import datetime

from sluice.api.base import ConditionStatus
from sluice.api.status import SignalCheckState
from sluice.api.v1alpha1 import InferencePoolSpec, SignalCheck, SignalChecks
from sluice.core.engines import ENGINE_SETUP, NOT_PROVIDED, READINGS
from sluice.core.observed import (
    ALL_SIGNALS,
    CheckAnswers,
    PodSignals,
    SeriesAnswer,
    SignalName,
    SignalSnapshot,
)
from sluice.core.presets import OPTIONAL_SIGNALS, asked, overridden
from sluice.core.promql import Reading
from sluice.core.refusals import duplicate, refusals, series_answers, without

NAMED = 20
"""A check names at most this many pods."""
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
) -> SignalCheck:
    """One signal over the pool's ready pods: the worst state any pod is in, the pods in it and the fix. Ages are
    the samples' when Prometheus evaluated the check (`SeriesAnswer.newest`)."""
    names = [series.key for series in reading.series]
    failure = _query_failure(reading, answers)
    if failure is not None:
        return SignalCheck(signal=signal, state="Failed", series=names, message=f"the check query failed: {failure}")
    needed = [series for series in reading.series if series.needed]
    tally = _tally(spec, signal, reading, answers, pods, snapshot, refused)
    state: SignalCheckState = next((s for s in (*SEVERITY, "NotProvided") if tally.found[s]), "Ok")
    affected = tally.found.get(state, [])
    fix: str | None
    if state in {"Duplicated", "OutOfRange"}:
        message = f"not used for {_named(affected)}: {refused[sorted(affected)[0]][signal]}"
        fix = DUPLICATE_FIX if state == "Duplicated" else "check the preset or the query override for this signal"
    elif state == "Missing":
        first = sorted(affected)[0]
        lacking_names = [s.key for s in needed if first not in answers[s.key].newest]
        message = f"no {_joined(lacking_names, reading.any_of)} for {_named(affected)}"
        fix = "; ".join(tally.fixes) or ENGINE_SETUP.get(spec.engine) or None
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
        pods_ok=tally.ok,
        pods_affected=len(affected),
        pods=sorted(affected)[:NAMED],
        oldest_sample_seconds=round(tally.oldest) if tally.oldest else None,
        message=message,
        fix=fix,
    )


def _query_failure(reading: Reading, answers: dict[str, SeriesAnswer]) -> str | None:
    """Why the check queries of the reading's series failed (or were not asked); None when all were answered."""
    names = [series.key for series in reading.series]
    keys = [*names, *([reading.unavailable_when[0]] if reading.unavailable_when else [])]
    failures = [answers[k].failed or "" for k in keys if k in answers and answers[k].failed]
    if failures or any(k not in answers for k in keys):
        return failures[0] if failures else "not asked"
    return None


@dataclass
class _Tally:
    """A signal's ready pods by the state they are in, with what makes the engine export what is missing."""

    found: dict[SignalCheckState, list[str]]
    fixes: list[str] = field(default_factory=list)
    ok: int = 0
    oldest: float = 0.0
    """Age of the oldest newest sample of a pod, in seconds."""


def _tally(
    spec: InferencePoolSpec,
    signal: SignalName,
    reading: Reading,
    answers: dict[str, SeriesAnswer],
    pods: list[str],
    snapshot: SignalSnapshot,
    refused: dict[str, dict[SignalName, str]],
) -> _Tally:
    """Each pod's state for the signal: refused (duplicated or out of range), missing, not provided, stale or ok."""
    needed = [series for series in reading.series if series.needed]
    tally = _Tally({state: [] for state in (*SEVERITY, "NotProvided")})
    for pod in pods:
        if signal in refused.get(pod, {}):
            tally.found["Duplicated" if duplicate(reading, answers, pod) else "OutOfRange"].append(pod)
            continue
        busy = has_traffic(snapshot.pods.get(pod))
        present = [s for s in needed if pod in answers[s.key].newest]
        # an optional signal's absence is no finding (no adapter loaded, an engine without sleep mode)
        expected = [] if signal in OPTIONAL_SIGNALS else [s for s in needed if not s.lazy or busy]
        lacking = [s for s in expected if pod not in answers[s.key].newest]
        if expected and (not present if reading.any_of else lacking):
            older = reading.unavailable_when
            if older is not None and pod in answers[older[0]].newest:
                tally.found["NotProvided"].append(pod)
            else:
                tally.found["Missing"].append(pod)
                tally.fixes += [s.fix for s in lacking if s.fix and s.fix not in tally.fixes]
            continue
        ages = [-answers[s.key].newest[pod] for s in present]  # on Prometheus' clock
        if ages:
            age = min(ages) if reading.any_of else max(ages)
            tally.oldest = max(tally.oldest, age)
            if age > spec.metrics.stale_after:
                tally.found["Stale"].append(pod)
                continue
        tally.ok += 1
    return tally


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
    judged = _judged(checks, ready_pods)
    answers = series_answers(checks)
    entries: list[SignalCheck] = []
    for signal in ALL_SIGNALS:
        reading = readings.get(signal)
        if not asked(spec, signal):
            continue
        if overridden(spec, signal):
            entries.append(_override_check(signal, ready_pods, refused))
        elif reading is None:
            why = NOT_PROVIDED.get(spec.engine, {}).get(signal, f"not provided by {spec.engine}")
            entries.append(SignalCheck(signal=signal, state="NotProvided", message=why))
        else:
            entries.append(check_signal(spec, signal, reading, answers, judged.present, snapshot, refused))
    status, reason, message = _verdict(spec, checks, judged, entries)
    block = SignalChecks(
        checked_at=checks.asked_at,
        engine=spec.engine,
        samples_per_window=judged.median,
        message=message,
        pods_without_series=len(judged.unscraped),
        unscraped=sorted(judged.unscraped)[:NAMED],
        signals=entries,
    )
    return Screened(cleaned, refused, block, (status, reason, message))


@dataclass(frozen=True)
class _Judged:
    """Which ready pods the preflight judges: those with series, less those scraped once so far."""

    present: list[str]
    unscraped: list[str]
    """Ready pods with no series at all."""
    new: list[str]
    """Pods scraped fewer than twice within the window: judged at the next check."""
    median: float | None
    """Samples per rate window, the median over the pods."""


def _judged(checks: CheckAnswers, ready_pods: list[str]) -> _Judged:
    complete = checks.failed is None and not any(answer.failed for answer in checks.series)
    present, unscraped = scraped(checks, ready_pods) if complete else (ready_pods, [])
    # a pod Prometheus has scraped once so far (it just started, or the check came between two of its first
    # scrapes' series) is judged at the next check
    samples = sorted(checks.samples_per_window[p] for p in present if p in checks.samples_per_window)
    median = statistics.median(samples) if samples else None
    young = median is not None and median >= 2  # else every pod has fewer: the window is too short, not the pods new
    new = [p for p in present if checks.samples_per_window.get(p, 2.0) < 2] if complete and young else []
    return _Judged([p for p in present if p not in new], unscraped, new, median)


def _verdict(
    spec: InferencePoolSpec, checks: CheckAnswers, judged: _Judged, entries: list[SignalCheck]
) -> tuple[ConditionStatus, str, str]:
    """SignalsReady: (status, reason, message), the worst finding first, the notes after the findings."""
    found, notes = _findings(spec, checks, judged, entries)
    median = judged.median
    status: ConditionStatus
    if not found:
        status, reason = "True", "WindowShort" if median is not None and median < MIN_SAMPLES else "AllPresent"
        lines = [
            f"every series the {spec.engine} preset reads is fresh and one per pod ({len(judged.present)} ready pods)"
        ]
    else:
        reason = found[0][0]
        status = "Unknown" if reason == "CheckFailed" else "False"
        lines = [line for _, line in found]
    lines += notes
    return status, reason, "; ".join(lines)


def _findings(
    spec: InferencePoolSpec, checks: CheckAnswers, judged: _Judged, entries: list[SignalCheck]
) -> tuple[list[tuple[str, str]], list[str]]:
    """(reason, line) of what is wrong, worst first; and notes that make nothing wrong."""
    found: list[tuple[str, str]] = [
        (REASONS[check.state], f"{check.signal}: {check.message}")
        for state in SEVERITY
        for check in entries
        if check.state == state
    ]
    if judged.unscraped:
        found.append(
            (
                "PodsNotScraped",
                f"no series at all for {_named(judged.unscraped)}: Prometheus does not scrape them (yet), or "
                f"metrics.podLabel ({spec.metrics.pod_label}) / namespaceLabel ({spec.metrics.namespace_label}) "
                "do not name them",
            )
        )
    median = judged.median
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
    if judged.new:
        notes.append(f"{_named(judged.new)}: scraped fewer than twice within metrics.window, judged at the next check")
    found.sort(key=lambda pair: CONDITION_REASONS.index(pair[0]))
    return found, notes
