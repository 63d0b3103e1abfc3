"""sluice's control loop as the simulation sees it: simulated Prometheus in, published weights out.

Called by `sluice.bench.sim`. `SluiceControl.step(now, observed)` is the one place the simulation runs sluice's
reconcile pass: the operator's own `Reconciler` over an in-memory cluster, its published weights read back from the
Istio objects it rendered. `ScrapedServer` plays Prometheus for one pod: gauges are sampled only at
scrapes; rates and quantiles cover the window that ends at the last scrape, so every signal is as old as a real one
would be (TTFT quantiles from exact observations, not histogram buckets: slightly better than real).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sluice.api.snapshot import PoolSnapshot
from sluice.api.v1alpha1 import InferencePoolSpec, InferencePoolStatus, ObjectMeta
from sluice.bench.scenario import Scenario
from sluice.core.observed import Observed, ObservedPod, PodSignals, SignalSnapshot
from sluice.io.memory import MemoryCluster
from sluice.io.ports import PromAuth
from sluice.istio.objects import subset_name
from sluice.runtime.reconciler import Reconciler

EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
# The hardware classes a user would declare (seed 000's K: A100=10, 4090=4, CPU=1; the others by the same guess).
# These are the user's guesses, not measurements: the benchmark measures how far they are from the servers.
CAPACITY_CLASSES = {"h100": 16.0, "a100": 10.0, "l40s": 6.0, "a10g": 3.0, "rtx4090": 4.0, "cpu": 1.0}


@dataclass
class ScrapedServer:
    """What Prometheus knows of one server: observations with their times, gauges as of the last scrape."""

    name: str
    hardware: str
    revision: str
    ttfts: deque[tuple[float, float]] = field(default_factory=deque)
    outcomes: deque[tuple[float, bool]] = field(default_factory=deque)
    refusals: deque[float] = field(default_factory=deque)
    """When the pod's sidecar refused a request (inbound limit or tenant bucket): Istio's `istio_requests_total`
    with response flag UO or RL, read as `refusedRate`."""
    answered: bool = False
    """Its sidecar answered a request: Istio's counter has series for the pod from then on (before, none)."""
    gauges: dict[str, float] = field(default_factory=dict)

    def observe_ttft(self, at: float, seconds: float) -> None:
        self.ttfts.append((at, seconds))

    def observe_outcome(self, at: float, ok: bool) -> None:
        self.outcomes.append((at, ok))
        self.answered = True

    def observe_refusal(self, at: float) -> None:
        self.refusals.append(at)
        self.answered = True

    def scrape(self, at: float, running: int, waiting: int, kv_usage: float, horizon: float) -> None:
        self.gauges = {"at": at, "running": float(running), "queue": float(waiting), "kv": kv_usage}
        while self.ttfts and self.ttfts[0][0] < at - horizon:
            self.ttfts.popleft()
        while self.outcomes and self.outcomes[0][0] < at - horizon:
            self.outcomes.popleft()
        while self.refusals and self.refusals[0] < at - horizon:
            self.refusals.popleft()

    def signals(self, window: float) -> PodSignals:
        if "at" not in self.gauges:
            return PodSignals()
        at = self.gauges["at"]
        ttfts = sorted(v for when, v in self.ttfts if at - window < when <= at)
        outcomes = [ok for when, ok in self.outcomes if at - window < when <= at]
        ok = sum(outcomes)
        return PodSignals(
            ttft_seconds=statistics.fmean(ttfts) if ttfts else None,
            ttft_p95_seconds=ttfts[max(0, math.ceil(0.95 * len(ttfts)) - 1)] if ttfts else None,
            kv_cache_usage=self.gauges["kv"],
            queue_length=self.gauges["queue"],
            running_requests=self.gauges["running"],
            request_rate=ok / window,
            error_rate=(len(outcomes) - ok) / len(outcomes) if outcomes else None,
            refused_rate=sum(1 for when in self.refusals if at - window < when <= at) / window
            if self.answered
            else None,
        )


SESSION_HEADER = "x-session-id"
"""The header the benchmark's clients carry their session in (the vLLM router's first `consistent_hash` key)."""
BALANCE_FACTOR = 150
"""Bounded load (`hash_balance_factor`) for the benchmark's bounded rings and sluice's session affinity where the
scenario's pool sets none (Envoy's documented example)."""


def pool_spec(scenario: Scenario, cube: bool = False, affinity: bool = False) -> InferencePoolSpec:
    """The InferencePool the benchmark runs sluice with: defaults plus the scenario's overrides.

    `cube`: the same pool with `scoring.policy: cube` (the policy before headroom), for side-by-side figures.
    `affinity`: with `routing.sessionAffinity` on the session header, bounded load 150, where the scenario's pool
    sets none.
    """
    s = scenario.sluice
    base: dict[str, Any] = {
        "selector": {"matchLabels": {"app": "bench"}},
        "targetPort": 8000,
        "service": "bench",
        "interval": f"{max(1.0, s.interval):g}s",
        "capacity": {"classes": CAPACITY_CLASSES},
        "metrics": {"window": f"{s.window:g}s", "staleAfter": f"{max(15.0, 3 * s.scrape_interval):g}s"},
    }
    merged = _merge(base, s.pool)
    if cube:
        merged = _merge(merged, {"scoring": {"policy": "cube"}})
    if affinity and "sessionAffinity" not in merged.get("routing", {}):
        affinity_spec = {"header": SESSION_HEADER, "hashBalanceFactor": BALANCE_FACTOR}
        merged = _merge(merged, {"routing": {"sessionAffinity": affinity_spec}})
    return InferencePoolSpec.model_validate(merged)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@dataclass(frozen=True)
class Published:
    """What one pass publishes: per-pod endpoint weights and, during a canary, the revision split (percent)."""

    weights: dict[str, int]
    split: dict[str, int]
    limits: dict[str, int] = field(default_factory=dict)
    """Per-pod inbound limits the pass reported (`admission.mode: Report`, status `inboundLimit`)."""
    rates: dict[str, float] = field(default_factory=dict)
    """Per-pod admitted rates the pass reported (`admission.tenants`, status `rateLimit`)."""


class SnapshotSource:
    """The `SignalSource` port over the simulated Prometheus: it answers with the snapshot of this step."""

    def __init__(self) -> None:
        self.snapshot = SignalSnapshot()

    def read_signals(
        self, spec: InferencePoolSpec, namespace: str, pod_names: list[str], auth: PromAuth, now: datetime
    ) -> SignalSnapshot:
        return self.snapshot


class SluiceControl:
    """sluice's one reconcile loop (`Reconciler`) over an in-memory cluster: one pass per `step`.

    What the simulated sidecars get is read back from the Istio objects the pass wrote — the ServiceEntry's endpoint
    weights and the VirtualService's split — exactly what a mesh would be handed.
    """

    def __init__(self, scenario: Scenario, cube: bool = False, affinity: bool = False) -> None:
        self.spec = pool_spec(scenario, cube, affinity)
        self.window = scenario.sluice.window
        self.cluster = MemoryCluster()
        self.source = SnapshotSource()
        self.reconciler = Reconciler(self.cluster, self.source)
        self.meta = ObjectMeta(name="bench", namespace="bench", uid="bench-pool", generation=1)
        self.status: InferencePoolStatus | None = None

    def observed(self, servers: list[ScrapedServer]) -> Observed:
        pods = [
            ObservedPod(
                name=s.name,
                ip=f"10.0.{i // 250}.{i % 250 + 1}",
                ready=True,
                labels={"app": "bench", "sluice.dev/hardware-class": s.hardware, "sluice.dev/revision": s.revision},
            )
            for i, s in enumerate(servers)
        ]
        scraped = max((s.gauges.get("at", 0.0) for s in servers), default=0.0)
        snapshot = SignalSnapshot(
            collected_at=EPOCH + timedelta(seconds=scraped),
            pods={s.name: s.signals(self.window) for s in servers},
            # vLLM's preset reads timestamp() of a gauge: the time of each pod's last scrape.
            sampled_at={s.name: EPOCH + timedelta(seconds=s.gauges["at"]) for s in servers if "at" in s.gauges},
            freshness_known=True,
        )
        return Observed(pods=pods, signals=snapshot)

    def step(self, now: float, observed: Observed) -> Published | None:
        """One reconcile pass at `now` (seconds); None while sluice has published nothing yet."""
        self.cluster.pod_list = list(observed.pods)
        self.source.snapshot = observed.signals
        snapshot = PoolSnapshot(meta=self.meta, spec=self.spec, spec_error=None, status=self.status)
        report = self.reconciler.run(snapshot, EPOCH + timedelta(seconds=now))
        self.status = report.status
        return self.published(observed)

    def published(self, observed: Observed) -> Published | None:
        """The weights and split in the Istio objects the loop wrote (what a mesh would be handed)."""
        entry = self.cluster.objects.get(("bench", "ServiceEntry", "sluice-bench"))
        if entry is None:
            return None
        pod_at = {p.ip: p.name for p in observed.pods}
        endpoints = entry["spec"]["endpoints"]
        weights = {pod_at[e["address"]]: int(e["weight"]) for e in endpoints if e["address"] in pod_at}
        service = self.cluster.objects.get(("bench", "VirtualService", "sluice-bench"))
        revision_of = {
            subset_name(p.labels["sluice.dev/revision"]): p.labels["sluice.dev/revision"] for p in observed.pods
        }
        split: dict[str, int] = {}
        for route in (service or {}).get("spec", {}).get("http", [{}])[0].get("route", []):
            subset = route["destination"].get("subset")
            if subset:
                split[revision_of.get(subset, subset)] = int(route.get("weight", 100))
        rows = self.status.endpoints if self.status is not None else []
        limits = {row.pod: row.inbound_limit for row in rows if row.inbound_limit is not None}
        rates = {row.pod: row.rate_limit for row in rows if row.rate_limit is not None}
        return Published(weights, split, limits, rates)

    @property
    def active_request_bias(self) -> float:
        least = self.spec.routing.least_request
        return least.active_request_bias if least is not None else 1.0  # Envoy's default without sluice's filter
