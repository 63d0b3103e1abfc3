"""The routing-quality simulation: fleet_sim servers, Envoy-like data-plane strategies, sluice in the loop.

Deterministic for a scenario's seed. Each server is a `fleet_sim.core.instance.Instance` (a server model written by
someone else: continuous batching slots, paged KV blocks, preemption) advanced by one discrete-event loop. Requests
are in flight ("active", as Envoy counts them) from arrival to their modelled physical end.

Strategies, modelled on Envoy's algorithms:
- `round-robin`: Envoy ROUND_ROBIN with equal weights (a rotation);
- `least-request`: Envoy LEAST_REQUEST with equal weights: power of two choices on active requests (Istio's default);
- `static-capacity`: LEAST_REQUEST with unequal, static weights K per hardware class (what a user would set by hand):
  Envoy's EDF schedule over effective weights `w / (active + 1)^bias`;
- `sluice`: the same data plane with weights from the real sluice core (`plan_pass`) recomputed every reconcile
  interval from simulated Prometheus samples (scrape interval, rate/quantile window), applied after a propagation
  delay; the revision split, zeroing and canary all come from the core;
- `seed-adaptive`: seed 000's per-request scorer `K / ((C+1)(α T/T_base + 1 − α))` with perfect local knowledge;
- `oracle`: per request, the server with the lowest TTFT it would actually get (a look-ahead on a copy of every
  server's model): a practical lower bound, not a deployable policy.
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
import itertools
import math
import random
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import fleet_sim
from fleet_sim.core.instance import Instance
from fleet_sim.core.request import Request
from fleet_sim.gpu_profiles.manual import ManualProfile
from fleet_sim.workload.synthetic import CdfWorkload

from sluice.api.v1alpha1 import InferencePoolSpec, InferencePoolStatus
from sluice.bench.scenario import Scenario
from sluice.core.observed import Observed, ObservedPod, PodSignals, SignalSnapshot
from sluice.core.reconcile import plan_pass
from sluice.devstack.profiles import PROFILES

STRATEGIES = ("round-robin", "least-request", "static-capacity", "sluice", "seed-adaptive", "oracle")
CAPACITY = {"h100": 16.0, "a100": 10.0, "a10g": 3.0, "rtx4090": 4.0, "cpu": 1.0}
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
CDF_FILES = {"lmsys": "lmsys_cdf.json", "azure": "azure_cdf.json", "agent_heavy": "agent_heavy_cdf.json"}
INCIDENT_WINDOW = 60.0


@dataclass
class Server:
    name: str
    hardware: str
    revision: str
    profile: ManualProfile
    instance: Instance
    capacity: float
    error_rate: float = 0.0
    active: int = 0
    ttft_obs: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=50_000))
    outcomes: deque[tuple[float, bool]] = field(default_factory=lambda: deque(maxlen=50_000))
    gauges: dict[str, float] = field(default_factory=dict)
    recent_ttft: deque[float] = field(default_factory=lambda: deque(maxlen=20))


@dataclass
class Outcome:
    req_id: int
    server: str
    arrival: float
    ttft: float | None
    e2e: float | None
    ok: bool
    output_tokens: int


@dataclass
class RunResult:
    strategy: str
    outcomes: list[Outcome]
    weights: list[tuple[float, dict[str, int]]]
    slowest_class: str
    warm_up: int
    incident_at: float | None


class Edf:
    """Envoy's earliest-deadline-first schedule over effective weights, re-weighting a host each time it is picked."""

    def __init__(self, hosts: list[str], weight: Any) -> None:
        self.weight = weight
        self.counter = itertools.count()
        self.heap = [(1.0 / weight(h), next(self.counter), h) for h in hosts]
        heapq.heapify(self.heap)

    def pick(self) -> str:
        deadline, _, host = heapq.heappop(self.heap)
        heapq.heappush(self.heap, (deadline + 1.0 / self.weight(host), next(self.counter), host))
        return host


def _arrivals(scenario: Scenario, rng: random.Random) -> list[tuple[float, int, int]]:
    work = scenario.workload
    if work.lengths == "fixed":
        lengths = [(work.prompt_tokens, work.output_tokens)] * work.requests
    else:
        source = Path(str(fleet_sim.__file__)).parent / "data" / CDF_FILES[work.lengths]
        gen = CdfWorkload(source, seed=scenario.seed)
        lengths = []
        for i in range(work.requests):
            req = gen.sample_request(i, 0.0)
            lengths.append((req.l_in, req.l_out))
    out: list[tuple[float, int, int]] = []
    t = 0.0
    if work.arrival == "poisson":
        for l_in, l_out in lengths:
            t += rng.expovariate(work.rate)
            out.append((t, l_in, l_out))
        return out
    # Bursty: a non-homogeneous Poisson process by thinning, with the same mean rate.
    quiet = work.period - work.burst_seconds
    base = work.rate * work.period / (quiet + work.burst_factor * work.burst_seconds)
    peak = base * work.burst_factor
    for l_in, l_out in lengths:
        while True:
            t += rng.expovariate(peak)
            in_burst = (t % work.period) < work.burst_seconds
            if in_burst or rng.random() < base / peak:
                break
        out.append((t, l_in, l_out))
    return out


def pool_spec(scenario: Scenario) -> InferencePoolSpec:
    s = scenario.sluice
    base: dict[str, Any] = {
        "selector": {"matchLabels": {"app": "bench"}},
        "targetPort": 8000,
        "service": "bench",
        "interval": f"{max(1.0, s.interval):g}s",
        "capacity": {"classes": CAPACITY},
        "metrics": {"window": f"{s.window:g}s", "staleAfter": f"{max(15.0, 3 * s.interval):g}s"},
    }
    return InferencePoolSpec.model_validate(_merge(base, s.pool))


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class Simulation:
    def __init__(self, scenario: Scenario, strategy: str) -> None:
        self.scenario = scenario
        self.strategy = strategy
        self.rng = random.Random(f"{scenario.seed}-{strategy}")
        self.pick_rng = random.Random(f"{scenario.seed}-{strategy}-pick")
        self.servers: dict[str, Server] = {}
        for spec in scenario.servers:
            server = Server(
                name=spec.name,
                hardware=spec.hardware,
                revision=spec.revision,
                profile=PROFILES[spec.hardware],
                instance=Instance(0, spec.name, PROFILES[spec.hardware], max_ctx=8192),
                capacity=CAPACITY[spec.hardware],
                error_rate=spec.error_rate,
            )
            server.instance.on_ttft = self._on_ttft(server)
            self.servers[spec.name] = server
        self.ends: list[tuple[float, int, str, Request]] = []
        self.admitted: list[tuple[str, Request]] = []
        self.pending_obs: list[tuple[float, int, str, float]] = []
        self.counter = itertools.count()
        self.outcomes: dict[int, Outcome] = {}
        self.rotation = itertools.cycle(sorted(self.servers))
        self.weights: dict[str, int] = {}
        self.split: dict[str, int] = {}
        self.schedulers: dict[str, Edf] = {}
        self.timeline: list[tuple[float, dict[str, int]]] = []
        self.status: InferencePoolStatus | None = None
        self.spec = pool_spec(scenario)

    # ---------------------------------------------------------------------------------- the model

    def _on_ttft(self, server: Server) -> Any:
        # fleet_sim calls this at admission, before it sets physical_end_time: collect, process after advance_to.
        def record(req: Request) -> None:
            self.admitted.append((server.name, req))

        return record

    def _collect(self) -> None:
        for name, req in self.admitted:
            ttft = req.first_token_time - req.arrival_time
            self.outcomes[req.req_id].ttft = ttft
            heapq.heappush(self.pending_obs, (req.first_token_time, next(self.counter), name, ttft))
            heapq.heappush(self.ends, (req.physical_end_time, next(self.counter), name, req))
        self.admitted.clear()

    def _advance(self, t: float) -> None:
        for server in self.servers.values():
            server.instance.advance_to(t)
        self._collect()
        while self.pending_obs and self.pending_obs[0][0] <= t:
            at, _, name, ttft = heapq.heappop(self.pending_obs)
            server = self.servers[name]
            server.ttft_obs.append((at, ttft))
            server.recent_ttft.append(ttft)
        while self.ends and self.ends[0][0] <= t:
            at, _, name, req = heapq.heappop(self.ends)
            server = self.servers[name]
            server.active -= 1
            server.outcomes.append((at, True))
            outcome = self.outcomes[req.req_id]
            outcome.e2e = at - req.arrival_time
            outcome.ok = True

    def _drain(self) -> None:
        """Run every server until all admitted and queued requests have finished."""
        for _ in range(1_000_000):
            candidates = [s.instance.next_event_time() for s in self.servers.values()]
            candidates += [self.ends[0][0]] if self.ends else []
            candidates += [self.pending_obs[0][0]] if self.pending_obs else []
            nxt = min(candidates, default=math.inf)
            if nxt == math.inf:
                return
            self._advance(nxt)
            if (
                all(not s.instance.queue_depth for s in self.servers.values())
                and not self.ends
                and not self.pending_obs
            ):
                return

    def _scrape(self, t: float) -> None:
        for server in self.servers.values():
            inst = server.instance
            used = getattr(inst, "_used_kv_blocks", 0)
            total = getattr(inst, "_total_kv_blocks", 0) or server.profile.total_kv_blks
            server.gauges = {
                "at": t,
                "queue": float(inst.queue_depth),
                "running": float(server.active),
                "kv": min(1.0, used / total),
            }

    def _signals(self, server: Server, t: float) -> PodSignals:
        window = self.scenario.sluice.window
        at = server.gauges.get("at", t)
        ttfts = [v for when, v in server.ttft_obs if at - window < when <= at]
        outcomes = [ok for when, ok in server.outcomes if at - window < when <= at]
        ok = sum(1 for o in outcomes if o)
        p95 = sorted(ttfts)[max(0, math.ceil(0.95 * len(ttfts)) - 1)] if ttfts else None
        return PodSignals(
            ttft_seconds=statistics.fmean(ttfts) if ttfts else None,
            ttft_p95_seconds=p95,
            kv_cache_usage=server.gauges.get("kv"),
            queue_length=server.gauges.get("queue"),
            running_requests=server.gauges.get("running"),
            request_rate=ok / window if outcomes else None,
            error_rate=(len(outcomes) - ok) / len(outcomes) if outcomes else None,
        )

    def _reconcile(self, t: float) -> dict[str, Any]:
        pods = [
            ObservedPod(
                name=s.name,
                ip=f"10.0.0.{i + 1}",
                ready=True,
                labels={"app": "bench", "sluice.dev/hardware-class": s.hardware, "sluice.dev/revision": s.revision},
            )
            for i, s in enumerate(self.servers.values())
        ]
        at = EPOCH + timedelta(seconds=t)
        scraped = EPOCH + timedelta(seconds=next(iter(self.servers.values())).gauges.get("at", t))
        snapshot = SignalSnapshot(
            collected_at=scraped, pods={s.name: self._signals(s, t) for s in self.servers.values()}
        )
        plan = plan_pass(self.spec, 1, Observed(pods=pods, signals=snapshot), self.status, at)
        self.status = plan.status
        weights = {e.pod: e.weight for e in plan.endpoints}
        return {"weights": weights, "split": dict(plan.revision_weights)}

    def _apply(self, t: float, published: dict[str, Any]) -> None:
        self.weights = published["weights"]
        self.split = published["split"]
        self.schedulers = {}
        self.timeline.append((t, {name: self.weights.get(name, 0) for name in self.servers}))

    # ---------------------------------------------------------------------------------- strategies

    def _p2c(self, names: list[str]) -> str:
        if len(names) == 1:
            return names[0]
        a, b = self.pick_rng.sample(names, 2)
        ca, cb = self.servers[a].active, self.servers[b].active
        if ca == cb:
            return self.pick_rng.choice((a, b))
        return a if ca < cb else b

    def _weighted_lr(self, key: str, weights: dict[str, float], bias: float = 1.0) -> str:
        names = sorted(weights)
        if len({weights[n] for n in names}) == 1:
            return self._p2c(names)  # Envoy: equal weights -> power of two choices
        scheduler = self.schedulers.get(key)
        if scheduler is None:
            scheduler = Edf(names, lambda h: weights[h] / (self.servers[h].active + 1) ** bias)
            self.schedulers[key] = scheduler
        return scheduler.pick()

    def _oracle(self, t: float, l_in: int, l_out: int) -> str:
        best, best_cost = "", math.inf
        for name, server in self.servers.items():
            # A deep copy: the look-ahead must not touch the real model's requests (preemption flags, states).
            callback, server.instance.on_ttft = server.instance.on_ttft, None
            try:
                trial = copy.deepcopy(server.instance)
            finally:
                server.instance.on_ttft = callback
            probe = Request(req_id=-1, arrival_time=t, l_in=l_in, l_out=l_out)
            if not trial.accept(probe):
                continue
            trial.advance_to(t)
            guard = 0
            while probe.first_token_time is None and guard < 100_000:
                nxt = trial.next_event_time()
                if nxt == math.inf:
                    break
                trial.advance_to(nxt)
                guard += 1
            if probe.first_token_time is None:
                continue
            cost = (probe.first_token_time - t) + server.error_rate * 60.0
            if cost < best_cost:
                best, best_cost = name, cost
        return best or self._p2c(sorted(self.servers))

    def _pick(self, t: float, l_in: int, l_out: int) -> str:
        names = sorted(self.servers)
        if self.strategy == "round-robin":
            return next(self.rotation)
        if self.strategy == "least-request":
            return self._p2c(names)
        if self.strategy == "static-capacity":
            return self._weighted_lr("static", {n: self.servers[n].capacity for n in names})
        if self.strategy == "seed-adaptive":
            alpha, base = 0.7, 0.1

            def score(name: str) -> float:
                s = self.servers[name]
                ttft = statistics.fmean(s.recent_ttft) if s.recent_ttft else base
                return s.capacity / ((s.active + 1) * (alpha * max(ttft, 0.01) / base + 1 - alpha))

            top = max(score(n) for n in names)
            return self.pick_rng.choice([n for n in names if score(n) == top])
        if self.strategy == "oracle":
            return self._oracle(t, l_in, l_out)
        # sluice: revision split from the VirtualService, then weighted least-request over the ServiceEntry.
        if not self.weights:
            return self._p2c(names)  # before the first plan lands: Kubernetes endpoints, all weight 1
        pool = self.weights
        key = "all"
        if self.split:
            revisions = sorted(r for r, w in self.split.items() if w > 0)
            revision = self.pick_rng.choices(revisions, weights=[self.split[r] for r in revisions])[0]
            pool = {n: w for n, w in self.weights.items() if self.servers[n].revision == revision} or self.weights
            key = revision
        least = self.spec.routing.least_request
        bias = least.active_request_bias if least is not None else 1.0  # Envoy's default without sluice's EnvoyFilter
        return self._weighted_lr(key, {n: float(w) for n, w in pool.items()}, bias)

    # ---------------------------------------------------------------------------------- the run

    def run(self) -> RunResult:
        scenario = self.scenario
        arrivals = _arrivals(scenario, self.rng)
        horizon = arrivals[-1][0] if arrivals else 0.0
        events: list[tuple[float, int, str, Any]] = []
        for i, (t, l_in, l_out) in enumerate(arrivals):
            events.append((t, 3, "arrive", (i, l_in, l_out)))
        sl = scenario.sluice
        if self.strategy == "sluice":
            t = 0.0
            while t <= horizon:
                events.append((t, 0, "scrape", None))
                t += sl.scrape_interval
            t = sl.interval
            while t <= horizon:
                events.append((t, 1, "reconcile", None))
                t += sl.interval
        for event in scenario.events:
            events.append((event.at, 2, "fault", event))
        heapq.heapify(events)
        error_rng = random.Random(f"{scenario.seed}-errors")
        while events:
            t, _, kind, payload = heapq.heappop(events)
            self._advance(t)
            if kind == "scrape":
                self._scrape(t)
            elif kind == "reconcile":
                heapq.heappush(events, (t + sl.propagation_delay, 2, "apply", self._reconcile(t)))
            elif kind == "apply":
                self._apply(t, payload)
            elif kind == "fault":
                server = self.servers[payload.server]
                if payload.slowdown is not None:
                    f = payload.slowdown
                    server.instance.gpu = dataclasses.replace(
                        server.profile, W=server.profile.W * f, H=server.profile.H * f
                    )
                if payload.error_rate is not None:
                    server.error_rate = payload.error_rate
            elif kind == "arrive":
                req_id, l_in, l_out = payload
                name = self._pick(t, l_in, l_out)
                server = self.servers[name]
                outcome = Outcome(req_id, name, t, None, None, False, l_out)
                self.outcomes[req_id] = outcome
                if error_rng.random() < server.error_rate:
                    server.outcomes.append((t, False))
                    continue
                req = Request(req_id=req_id, arrival_time=t, l_in=l_in, l_out=l_out)
                server.active += 1
                if not server.instance.accept(req):
                    server.active -= 1
                    continue
                server.instance.advance_to(t)
                self._collect()
        self._drain()
        slowest = min(self.servers.values(), key=lambda s: s.capacity).hardware
        warm = int(len(arrivals) * scenario.workload.warm_up)
        incident = min((e.at for e in scenario.events), default=None)
        return RunResult(self.strategy, list(self.outcomes.values()), self.timeline, slowest, warm, incident)


def summarise(result: RunResult, servers: Mapping[str, str]) -> dict[str, Any]:
    """Figures of one run: TTFT mean/P50/P90/P99, E2E P99, output tokens/s, completed, failed, slowest-class share."""
    measured = [o for o in result.outcomes if o.req_id >= result.warm_up]
    ok = [o for o in measured if o.ok and o.ttft is not None]
    ttfts = sorted(o.ttft for o in ok if o.ttft is not None)
    e2es = sorted(o.e2e for o in ok if o.e2e is not None)

    def q(values: list[float], p: float) -> float | None:
        return values[min(len(values) - 1, int(p * len(values)))] * 1000 if values else None

    span = (max(o.arrival + (o.e2e or 0) for o in ok) - min(o.arrival for o in measured)) if ok else 1.0
    slow = [o for o in measured if servers.get(o.server) == result.slowest_class]
    figures: dict[str, Any] = {
        "ttft_mean_ms": statistics.fmean(ttfts) * 1000 if ttfts else None,
        "ttft_p50_ms": q(ttfts, 0.50),
        "ttft_p90_ms": q(ttfts, 0.90),
        "ttft_p99_ms": q(ttfts, 0.99),
        "e2e_p99_ms": q(e2es, 0.99),
        "output_tokens_per_s": sum(o.output_tokens for o in ok) / span if span > 0 else 0.0,
        "completed": len(ok),
        "failed": len(measured) - len(ok),
        "error_rate": (len(measured) - len(ok)) / len(measured) if measured else 0.0,
        "slowest_class_share": len(slow) / len(measured) if measured else 0.0,
    }
    if result.incident_at is not None:
        during = [o for o in measured if result.incident_at <= o.arrival < result.incident_at + INCIDENT_WINDOW]
        during_ok = sorted(o.ttft for o in during if o.ok and o.ttft is not None)
        figures["incident_ttft_p99_ms"] = q(during_ok, 0.99)
        figures["incident_error_rate"] = (len(during) - len(during_ok)) / len(during) if during else 0.0
    return figures
