"""Per-pod verdicts: what this pass may conclude about each pod, from its evidence alone. Pure.

Every pod of the pool gets exactly one frozen `PodVerdict`:
- `excluded`: not Ready, terminating or without an IP — it cannot be routed to at all;
- `quiet`: zeroed after an incident, inside the quiet period;
- `frozen`: no fresh evidence (metrics unusable, or no samples for this pod) and a weight published before —
  it keeps that weight, nothing is re-scored and nothing ramps;
- `awaiting`: no fresh evidence and nothing published before — nothing to score it from;
- `ramping`: recovering after the quiet period, on fresh evidence;
- `scored`: normal scoring on fresh evidence.
The pool then allocates weights from the verdicts (`sluice.core.allocation`). Called by `sluice.core.reconcile`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from sluice.api.v1alpha1 import EndpointStatus, InferencePoolSpec
from sluice.core.evidence import has_samples, missing_signals, pod_is_fresh
from sluice.core.observed import ObservedPod, PodSignals, SignalName, SignalSnapshot
from sluice.core.protection import Assessment, Phase, assess, recovery_phase
from sluice.core.scoring import Score, capacity_of, score_pod, smooth

VerdictKind = Literal["excluded", "quiet", "frozen", "awaiting", "ramping", "scored"]
NO_SIGNALS = PodSignals()


@dataclass(frozen=True)
class Memory:
    """What the status remembers of a pod's last incident (restart-safe recovery)."""

    last_incident_at: datetime | None = None
    incident: str | None = None
    message: str | None = None

    def describe(self) -> str:
        return self.message or self.incident or "incident"


@dataclass(frozen=True)
class PodVerdict:
    pod: ObservedPod
    previous: EndpointStatus | None
    kind: VerdictKind
    signals: PodSignals
    revision: str | None
    hardware_class: str | None
    capacity: float
    class_known: bool
    score: Score
    smoothed: float
    """The score the allocation uses: smoothed on fresh evidence, the previous one otherwise."""
    assessment: Assessment
    memory: Memory
    missing: tuple[SignalName, ...] = ()
    ramp_percent: float | None = None
    quiet_remaining: float = 0.0
    excluded_because: str = ""
    sampled_at: datetime | None = None
    """When the samples behind `signals` were scraped, where the engine tells (`SignalSnapshot.sampled_at`)."""
    evidence: bool = True
    """The pod's signals are usable and fresh this pass (whatever its kind: a quiet pod has them or not)."""

    @property
    def name(self) -> str:
        return self.pod.name

    @property
    def eligible(self) -> bool:
        return self.kind != "excluded"

    @property
    def new_incident(self) -> bool:
        return self.assessment.incident is not None


def not_routable_because(pod: ObservedPod) -> str:
    if pod.deleting:
        return "pod is terminating"
    if not pod.ready:
        return "pod is not Ready"
    if not pod.ip:
        return "pod has no IP yet"
    return ""


def asleep(signals: PodSignals) -> str:
    """Why a sleeping engine is not routable (vLLM sleep mode: its weights and KV cache are offloaded or
    discarded, so a request would wait for a wake-up no one has asked for); "" while it is awake or says nothing."""
    if signals.sleeping is not None and signals.sleeping >= 0.5:
        return "the engine is asleep (sleep mode): not routed until it is woken up"
    return ""


def selects(spec: InferencePoolSpec, pod: ObservedPod) -> bool:
    return all(pod.labels.get(key) == value for key, value in spec.selector.match_labels.items())


def judge_pod(
    spec: InferencePoolSpec,
    pod: ObservedPod,
    previous: EndpointStatus | None,
    snapshot: SignalSnapshot,
    metrics_usable: bool,
    now: datetime,
) -> PodVerdict:
    signals = snapshot.pods.get(pod.name) or NO_SIGNALS
    sampled = has_samples(signals) and pod_is_fresh(spec, snapshot, pod.name, now)
    evidence = metrics_usable and sampled
    sampled_at = snapshot.sampled_at.get(pod.name) if snapshot.freshness_known and evidence else None
    hardware_class, capacity, class_known = capacity_of(spec, pod.labels)
    score = score_pod(spec, capacity, signals, previous.ttft_estimate_seconds if previous else None)
    assessment = assess(
        spec.protection,
        spec.metrics.window,
        pod,
        previous,
        signals,
        evidence,
        score.below_bands,
        now,
        repeated=snapshot.repeated,
        sampled_at=sampled_at,
    )
    memory = _memory(previous, assessment, now)
    phase = recovery_phase(spec.protection.recovery, memory.last_incident_at, now)
    excluded = not_routable_because(pod) or (asleep(signals) if evidence else "")
    kind = _kind(excluded, phase, evidence, published=previous is not None and previous.weight > 0)
    if kind == "frozen" and previous is not None:
        smoothed = previous.score
    else:
        smoothed = smooth(spec.scoring, previous.score if previous else None, score.value)
    return PodVerdict(
        pod=pod,
        previous=previous,
        kind=kind,
        signals=signals,
        revision=pod.labels.get(spec.canary.revision_label) if spec.canary else None,
        hardware_class=hardware_class,
        capacity=capacity,
        class_known=class_known,
        score=score,
        smoothed=smoothed,
        assessment=assessment,
        memory=memory,
        missing=missing_signals(spec, signals) if has_samples(signals) else (),
        ramp_percent=phase.percent if phase.name == "ramp" else None,
        quiet_remaining=phase.remaining_quiet,
        excluded_because=excluded,
        sampled_at=sampled_at,
        evidence=evidence,
    )


def _kind(excluded: str, phase: Phase, evidence: bool, published: bool) -> VerdictKind:
    """The verdict's kind (the module's list), in order: not routable, quiet, without fresh evidence, ramping."""
    if excluded:
        return "excluded"
    if phase.name == "quiet":
        return "quiet"
    if not evidence:
        return "frozen" if published else "awaiting"
    return "ramping" if phase.name == "ramp" else "scored"


def _memory(previous: EndpointStatus | None, assessment: Assessment, now: datetime) -> Memory:
    if assessment.incident is not None:
        return Memory(now, assessment.incident.kind, assessment.incident.message)
    if previous is None:
        return Memory()
    return Memory(previous.last_incident_at, previous.incident, previous.incident_message)
