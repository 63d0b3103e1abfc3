"""Scoring: how a pod's capacity and signals become a score (higher is better). Pure.

Seed 000's per-request score is K_i / ((C_i + 1) * (alpha * T_i / T_base + (1 - alpha))). sluice splits it: the
published weight carries K_i, the latency penalty and health; Envoy's LEAST_REQUEST applies the (C_i + 1) term per
request with exact local active counts (`w_i / (active_i + 1)^bias`). On top of that, pluggable signal scorers
(KV-cache pressure, queueing) each return a value in [0, 1] (higher is better) and a coefficient c in [0, 1]
saying how much of the weight the signal may remove; the combiner multiplies (1 - c + c * s) over scorers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

from sluice.api.v1alpha1 import InferencePoolSpec, ProtectionSpec, ScoringSpec
from sluice.core.observed import PodSignals, SignalName

TtftSource = Literal["observed", "last-known", "default"]


@dataclass(frozen=True)
class SignalScorer:
    """One signal's contribution: `score` in [0, 1] (None when the signal it `reads` is missing), and its
    coefficient. `reads` declares the one signal the score depends on (a test holds each scorer to it)."""

    name: str
    reads: SignalName
    score: Callable[[ScoringSpec, PodSignals], float | None]
    coefficient: Callable[[ScoringSpec], float]


def kv_cache_score(scoring: ScoringSpec, signals: PodSignals) -> float | None:
    """1 below the threshold, falling linearly to 0 at a full cache ("effective usable VRAM", not free VRAM)."""
    usage = signals.kv_cache_usage
    if usage is None:
        return None
    if usage <= scoring.kv_cache_threshold:
        return 1.0
    return max(0.0, 1.0 - (usage - scoring.kv_cache_threshold) / (1.0 - scoring.kv_cache_threshold))


def queue_score(scoring: ScoringSpec, signals: PodSignals) -> float | None:
    """1 with an empty queue, 1/2 at `queueReference` waiting requests, towards 0 beyond."""
    waiting = signals.queue_length
    if waiting is None:
        return None
    return 1.0 / (1.0 + max(0.0, waiting) / scoring.queue_reference)


SCORERS: tuple[SignalScorer, ...] = (
    SignalScorer("kvCache", "kvCacheUsage", kv_cache_score, lambda s: s.kv_cache_coefficient),
    SignalScorer("queue", "queueLength", queue_score, lambda s: s.queue_coefficient),
)


class Score(NamedTuple):
    """A pod's score and everything that went into it, for the status table."""

    capacity: float
    ttft: float
    ttft_source: TtftSource
    latency_penalty: float
    signal_factor: float
    band_factor: float
    below_bands: bool
    value: float

    def explain(self) -> str:
        parts = [f"K={self.capacity:g}", f"ttft={self.ttft * 1000:.0f}ms({self.ttft_source})"]
        if self.signal_factor < 0.995:
            parts.append(f"load x{self.signal_factor:.2f}")
        if self.band_factor < 1.0:
            parts.append(f"errors x{self.band_factor:.2f}")
        return " ".join(parts)


def capacity_of(spec: InferencePoolSpec, labels: dict[str, str]) -> tuple[str | None, float, bool]:
    """The pod's hardware class, its capacity coefficient K, and whether the class is one `classes` lists.

    With `capacity.classes` empty every pod has the default K by design (known); with classes listed, a pod
    whose label is missing or not listed (say `A100` for `a100`) gets the default and is reported.
    """
    classes = spec.capacity.classes
    hardware_class = labels.get(spec.capacity.class_label)
    if hardware_class is None:
        return None, spec.capacity.default, not classes
    if hardware_class in classes:
        return hardware_class, classes[hardware_class], True
    return hardware_class, spec.capacity.default, not classes


def latency_penalty(scoring: ScoringSpec, ttft: float) -> float:
    """alpha * T / T_base + (1 - alpha), with T floored; alpha is raised to 1 while a pod is past ttftTimeout."""
    ttft = max(ttft, scoring.ttft_floor)
    alpha = 1.0 if scoring.ttft_timeout is not None and ttft > scoring.ttft_timeout else scoring.alpha
    return alpha * ttft / scoring.ttft_baseline + (1.0 - alpha)


def signal_factor(scoring: ScoringSpec, signals: PodSignals) -> float:
    """Product of (1 - c + c * s) over the scorers; a missing signal is neutral (and reported elsewhere)."""
    factor = 1.0
    for scorer in SCORERS:
        value = scorer.score(scoring, signals)
        if value is None:
            continue
        coefficient = scorer.coefficient(scoring)
        factor *= 1.0 - coefficient + coefficient * min(1.0, max(0.0, value))
    return factor


def band_factor(protection: ProtectionSpec, signals: PodSignals) -> tuple[float, bool]:
    """(share of the weight kept, whether the pod is outside every band). No error data means no evidence."""
    if signals.error_rate is None:
        return 1.0, False
    for band in protection.bands:  # sorted by maxErrorRate when parsed
        ttft_ok = (
            band.max_ttft_p95 is None
            or signals.ttft_p95_seconds is None
            or signals.ttft_p95_seconds <= band.max_ttft_p95
        )
        if signals.error_rate <= band.max_error_rate and ttft_ok:
            return band.weight_percent / 100.0, False
    return protection.below_bands_percent / 100.0, True


def choose_ttft(scoring: ScoringSpec, signals: PodSignals, last_known: float | None) -> tuple[float, TtftSource]:
    if signals.ttft_seconds is not None:
        return signals.ttft_seconds, "observed"
    if last_known is not None:
        return last_known, "last-known"
    return scoring.default_ttft, "default"


def score_pod(spec: InferencePoolSpec, capacity: float, signals: PodSignals, last_known_ttft: float | None) -> Score:
    """(K / latency_penalty) ^ sharpness x signal factor x health band.

    Only the capacity/latency term is sharpened, so a band still keeps exactly its weightPercent and a signal
    coefficient still bounds the share of the weight it may remove.
    """
    ttft, source = choose_ttft(spec.scoring, signals, last_known_ttft)
    penalty = latency_penalty(spec.scoring, ttft)
    factor = signal_factor(spec.scoring, signals)
    band, below = band_factor(spec.protection, signals)
    return Score(
        capacity=capacity,
        ttft=ttft,
        ttft_source=source,
        latency_penalty=penalty,
        signal_factor=factor,
        band_factor=band,
        below_bands=below,
        value=(capacity / penalty) ** spec.scoring.sharpness * factor * band,
    )


def smooth(scoring: ScoringSpec, previous: float | None, raw: float) -> float:
    """EWMA over passes, so one noisy scrape does not swing the weights."""
    if previous is None or previous <= 0:
        return raw
    return scoring.smoothing * previous + (1.0 - scoring.smoothing) * raw
