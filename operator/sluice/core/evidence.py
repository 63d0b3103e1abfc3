"""Evidence: whether this pass's signals may be acted on, for the pool and for each pod. Pure.

Freshness comes from the samples themselves: the engine presets read `timestamp()` of a gauge every engine
exports, so a Prometheus that still answers from old samples (stalled scraping, remote-read lag, the 5-minute
lookback) is seen as stale. Unusable evidence never becomes a number: the pass freezes weights instead.
Called by `sluice.core.reconcile`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sluice.api.v1alpha1 import InferencePoolSpec
from sluice.core.engines import SIDECAR
from sluice.core.observed import SIGNAL_FIELD, PodSignals, SignalName, SignalSnapshot
from sluice.core.presets import OPTIONAL_SIGNALS, supported_signals

# Gauges a live engine always exports: a pod with none of them has no samples at all.
_GAUGES = ("kv_cache_usage", "queue_length", "running_requests")


@dataclass(frozen=True)
class MetricsVerdict:
    """The pool-wide verdict on this pass's signals."""

    usable: bool
    reason: str
    message: str


def judge_metrics(spec: InferencePoolSpec, snapshot: SignalSnapshot, now: datetime) -> MetricsVerdict:
    """Fresh and complete signals, or why not. Unusable signals freeze weights (fail-static)."""
    if snapshot.collected_at is None:
        return MetricsVerdict(False, "NoSignals", "no signals have been read yet; weights frozen")
    routing = {name: why for name, why in snapshot.failed.items() if name not in SIDECAR}
    if routing:  # the sidecar's refusals feed the status only: their failure freezes nothing
        failures = "; ".join(f"{name}: {why}" for name, why in sorted(routing.items()))
        return MetricsVerdict(False, "QueryFailed", f"{failures}; weights frozen")
    limit = spec.metrics.stale_after
    read = (now - snapshot.collected_at).total_seconds()
    if read > limit:  # answers are shared per query: old signals can come with a new freshness answer
        return MetricsVerdict(
            False, "Stale", f"signals were read {read:.0f}s ago (staleAfter {limit:g}s); weights frozen"
        )
    if snapshot.freshness_known and snapshot.sampled_at:
        newest = max(snapshot.sampled_at.values())
        age = (now - newest).total_seconds()
        if age > limit:
            return MetricsVerdict(
                False,
                "Stale",
                f"newest sample is {age:.0f}s old (staleAfter {limit:g}s): scraping has stalled; weights frozen",
            )
    message = "signals fresh"
    if not snapshot.freshness_known:
        message += " (sample age unknown for this engine: judged by query time)"
    if snapshot.unsupported:
        message += f"; not provided by engine {spec.engine}: {', '.join(snapshot.unsupported)}"
    return MetricsVerdict(True, "Fresh", message)


def has_samples(signals: PodSignals) -> bool:
    """Whether Prometheus returned anything for the pod: a live engine always exports its gauges."""
    return any(getattr(signals, name) is not None for name in _GAUGES) or signals.ttft_seconds is not None


def pod_is_fresh(spec: InferencePoolSpec, snapshot: SignalSnapshot, pod: str, now: datetime) -> bool:
    """The pod's own newest sample is within staleAfter (where the engine lets us measure it)."""
    if not snapshot.freshness_known:
        return True
    sampled = snapshot.sampled_at.get(pod)
    return sampled is not None and (now - sampled).total_seconds() <= spec.metrics.stale_after


def missing_signals(spec: InferencePoolSpec, signals: PodSignals) -> tuple[SignalName, ...]:
    """Signals the engine provides that had no series for this pod (reported, never read as 0)."""
    return tuple(
        name
        for name in supported_signals(spec)
        if name not in OPTIONAL_SIGNALS and getattr(signals, SIGNAL_FIELD[name]) is None
    )
