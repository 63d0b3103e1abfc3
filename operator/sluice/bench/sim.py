"""The routing simulation: one arrival trace, a fleet of iteration-level engines, one strategy in front of them.

Called by `sluice.bench.report` (and `sluice.bench.capacity` for single servers). Deterministic for (scenario,
trace, strategy). Every server is a `sluice.sim.engine.Engine` (vLLM's scheduler, a roofline step time); a request
is "active" for the client that sent it from dispatch to its last token, as Envoy counts it. The trace comes from
`sluice.bench.trace` and is the same for every strategy.

Strategies:
- `round-robin`: Envoy ROUND_ROBIN in every client sidecar;
- `least-request`: Envoy LEAST_REQUEST, equal weights (Istio's default), per sidecar;
- `static-capacity`: LEAST_REQUEST with the user's static class weights K (A100=10, 4090=4, CPU=1...);
- `sluice`: LEAST_REQUEST with the weights sluice publishes (`sluice.bench.control.SluiceControl`, fed by simulated
  Prometheus), the VirtualService revision split during a canary;
- `sluice-cube`: the same loop with `scoring.policy: cube`, the weights before the headroom policy, on the same
  trace;
- `best-static`: the offline best static split of this load (water-filling on each server's measured TTFT-vs-load
  curve, `sluice.bench.capacity`), replayed as an exact split: the reference for any weight-based router;
- `seed-adaptive`: seed 000's per-request scorer K / ((C+1)(α T/T_base + 1 − α)) in one central router with perfect
  knowledge (global active counts, the last 20 TTFTs of each server);
- `power-of-two`: vLLM router's policy (load polled every second plus its own in-flight counts), one router;
- `consistent-hash`: vLLM router's session-keyed hash ring, one router;
- `ring-hash`: Envoy RING_HASH on the session header in every client sidecar, equal weights (a DestinationRule's
  `consistentHash.httpHeaderName` alone), and `ring-hash-bounded` with Envoy's bounded load (`hash_balance_factor`
  150);
- `cache-aware`: vLLM router's `cache_aware` (a prefix tree of the prompts routed, load-balance thresholds), one
  router;
- `sluice-affinity`: sluice with `routing.sessionAffinity` (the scenario's, else the session header with
  `hashBalanceFactor` 150): Envoy RING_HASH over the weights sluice publishes, with bounded load;
- `blind-canary` (only where a scenario asks for it): the canary baseline without analysis, the pool's canary steps
  on a timer (VirtualService split, least-request in each subset), whatever the candidate does.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import statistics
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from sluice.bench.control import BALANCE_FACTOR, CAPACITY_CLASSES, Published, ScrapedServer, SluiceControl, pool_spec
from sluice.bench.dataplane import (
    CacheAwareRouter,
    ConsistentHashRouter,
    EnvoyRingHash,
    EnvoyRoundRobin,
    OutlierDetector,
    PowerOfTwoRouter,
    WeightedRandom,
)
from sluice.bench.scenario import Scenario, ServerSpec
from sluice.bench.trace import Arrival
from sluice.istio.envoyfilters import tenant_buckets
from sluice.sim.engine import OWN_CONTENT, Engine, EngineConfig, Sequence, block_hashes
from sluice.sim.leastrequest import EnvoyLeastRequest
from sluice.sim.profiles import server_profile

STRATEGIES = (
    "round-robin",
    "least-request",
    "static-capacity",
    "sluice",
    "sluice-cube",
    "best-static",
    "seed-adaptive",
    "power-of-two",
    "consistent-hash",
)
EXTRA_STRATEGIES = ("blind-canary", "ring-hash", "ring-hash-bounded", "sluice-affinity", "cache-aware")
"""Run only where a scenario lists them (canaries; sessions)."""
ENVOY_PICKS = (
    "round-robin",
    "least-request",
    "static-capacity",
    "sluice",
    "sluice-cube",
    "blind-canary",
    "ring-hash",
    "ring-hash-bounded",
    "sluice-affinity",
)
"""Strategies where the client's Envoy picks the host: its outlier detection and retry host predicate apply."""
HOST_SELECTIONS = 5
"""Istio's `host_selection_retry_max_attempts` with `retryIgnorePreviousHosts`: picks until one not tried."""
RETRY_BACK_OFF = 0.025
"""Envoy's default retry back-off base interval (seconds): retry k waits U(0, base x 2^k)."""
DRAIN_SECONDS = 600.0  # after the last arrival; a request without a first token by then counts as infinitely late


@dataclass
class SimServer:
    spec: ServerSpec
    engine: Engine
    scraped: ScrapedServer
    error_rate: float
    recent_ttft: deque[float] = field(default_factory=lambda: deque(maxlen=20))
    peak_kv: float = 0.0
    peak_waiting: int = 0


@dataclass
class Outcome:
    arrival: Arrival
    server: str
    ttft: float | None = None
    e2e: float | None = None
    ok: bool = False
    failed: bool = False
    refused: bool = False
    """Failed because every pod tried refused it (`inbound_max_requests`, or a tenant's bucket)."""
    rate_limited: bool = False
    """Refused at least once by a tenant's bucket (a 429, `admission.tenants`)."""
    attempts: int = 1
    cached_tokens: int | None = None
    """Prompt tokens its server found in its prefix cache (None without one: nothing looked up)."""


@dataclass
class RunResult:
    strategy: str
    outcomes: list[Outcome]
    weights: list[tuple[float, dict[str, int]]]
    servers: dict[str, str]
    """Server name -> hardware class."""
    peaks: dict[str, dict[str, float]]
    measured_from: float
    measured_until: float
    incident_at: float | None


@dataclass
class TokenBucket:
    """Envoy's local rate limit bucket: full at first, refilled continuously (local_ratelimit_impl.cc)."""

    per_second: float
    size: float
    tokens: float
    at: float = 0.0

    def take(self, now: float) -> bool:
        self.tokens = min(self.size, self.tokens + (now - self.at) * self.per_second)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


def build_servers(scenario: Scenario) -> dict[str, SimServer]:
    engine = scenario.engine
    config = EngineConfig(engine.max_num_batched_tokens, engine.max_num_seqs, prefix_caching=engine.prefix_caching)
    return {
        s.name: SimServer(
            spec=s,
            engine=Engine(server_profile(s.hardware, scenario.model), config),
            scraped=ScrapedServer(s.name, s.hardware, s.revision),
            error_rate=s.error_rate,
        )
        for s in scenario.servers
    }


class Simulation:
    """One run: `Simulation(scenario, strategy, trace, split=...).run()`."""

    def __init__(
        self, scenario: Scenario, strategy: str, trace: list[Arrival], split: dict[str, float] | None = None
    ) -> None:
        if strategy not in STRATEGIES + EXTRA_STRATEGIES:
            known = ", ".join(STRATEGIES + EXTRA_STRATEGIES)
            raise ValueError(f"unknown strategy {strategy!r}; known: {known}")
        self.scenario = scenario
        self.strategy = strategy
        self.trace = trace
        self.servers = build_servers(scenario)
        self.names = sorted(self.servers)
        self.rng = random.Random(f"{scenario.seed}-{strategy}-picks")
        plane = scenario.dataplane
        self.sidecar_active: list[dict[str, int]] = [dict.fromkeys(self.names, 0) for _ in range(plane.sidecars)]
        self.control = (
            SluiceControl(scenario, cube=strategy == "sluice-cube", affinity=strategy == "sluice-affinity")
            if strategy.startswith("sluice")
            else None
        )
        bias = self.control.active_request_bias if self.control else 1.0
        self.balancers: list[dict[str, EnvoyLeastRequest]] = [{} for _ in range(plane.sidecars)]
        self.bias = bias
        self.round_robins = [EnvoyRoundRobin(self.names, self.rng) for _ in range(plane.sidecars)]
        self.split: dict[str, int] = {}
        self.static_weights = {n: CAPACITY_CLASSES[self.servers[n].spec.hardware] for n in self.names}
        self.best_split = WeightedRandom(split, self.rng) if split else None
        self.power_of_two = PowerOfTwoRouter(self.names, self.rng)
        self.hash_ring = ConsistentHashRouter(self.names)
        self.cache_aware = CacheAwareRouter(self.names)
        factor = None
        if strategy == "ring-hash-bounded":
            factor = BALANCE_FACTOR
        elif self.control is not None and self.control.spec.routing.session_affinity is not None:
            factor = self.control.spec.routing.session_affinity.hash_balance_factor
        self.ring_factor = factor
        self.rings: list[dict[str, EnvoyRingHash]] = [{} for _ in range(plane.sidecars)]
        self.global_active = dict.fromkeys(self.names, 0)
        self.limit_counts: dict[str, tuple[int | None, int, int]] = dict.fromkeys(self.names, (None, 0, 0))
        """Each sidecar's inbound circuit breaker: (its limit, which cluster it is, the requests it counts). A
        changed limit is a new Envoy cluster whose count starts at zero: the requests still in flight on the old
        one are not counted (real Envoy: tests/test_envoy_inbound_limit.py)."""
        self.counted: dict[int, tuple[str, int]] = {}
        """Request -> (server, the cluster that counted it)."""
        self.flights: dict[int, tuple[Outcome, int]] = {}
        self.retrying: dict[int, Outcome] = {}
        self.outcomes: list[Outcome] = []
        self.timeline: list[tuple[float, dict[str, int]]] = []
        self.published: Published | None = None
        pool = pool_spec(scenario)
        self.pool = pool
        self.buckets: dict[tuple[str, str | None], tuple[float, TokenBucket]] = {}
        self.named = {s.value for s in pool.admission.tenants.shares} if pool.admission.tenants else set()
        self.canary = pool.canary
        outlier = pool.protection.outlier_detection
        self.outliers = (
            [
                OutlierDetector(
                    self.names,
                    outlier.consecutive_5xx_errors,
                    outlier.interval,
                    outlier.base_ejection_time,
                    outlier.max_ejection_percent,
                )
                for _ in range(plane.sidecars)
            ]
            if plane.outlier_detection and outlier.enabled and strategy in ENVOY_PICKS
            else None
        )
        self.now = 0.0
        self.queue: list[tuple[float, int, int, str, Any]] = []
        self.order = itertools.count()

    # ---------------------------------------------------------------------------------- the data plane

    def _healthy(self, sidecar: int, weights: dict[str, float]) -> dict[str, float]:
        """The hosts the sidecar's outlier detection has not ejected (all of them if it ejected every one)."""
        if self.outliers is None:
            return weights
        ejected = self.outliers[sidecar].ejected(self.now)
        return {h: w for h, w in weights.items() if h not in ejected} or weights

    def _least_request(self, sidecar: int, key: str, weights: dict[str, float]) -> str:
        weights = self._healthy(sidecar, weights)
        balancer = self.balancers[sidecar].get(key)
        if balancer is None:
            balancer = EnvoyLeastRequest(
                self.sidecar_active[sidecar], self.rng, self.scenario.dataplane.choice_count, self.bias
            )
            self.balancers[sidecar][key] = balancer
        balancer.update(weights)
        return balancer.pick()

    def _ring_hash(self, sidecar: int, key: str, weights: dict[str, float], session: int) -> str:
        weights = self._healthy(sidecar, weights)
        ring = self.rings[sidecar].get(key)
        if ring is None:
            ring = EnvoyRingHash(self.sidecar_active[sidecar], self.ring_factor)
            self.rings[sidecar][key] = ring
        ring.update(weights)
        return ring.pick(str(session))

    def _seed_adaptive(self) -> str:
        alpha, base = 0.7, 0.1

        def score(name: str) -> float:
            s = self.servers[name]
            ttft = statistics.fmean(s.recent_ttft) if s.recent_ttft else base
            load = self.global_active[name] + 1
            return CAPACITY_CLASSES[s.spec.hardware] / (load * (alpha * max(ttft, 0.01) / base + 1 - alpha))

        scores = {n: score(n) for n in self.names}
        top = max(scores.values())
        return self.rng.choice([n for n in self.names if scores[n] == top])

    def _sluice(self, sidecar: int, session: int) -> str:
        def route(key: str, weights: dict[str, float]) -> str:
            if self.strategy == "sluice-affinity":
                return self._ring_hash(sidecar, key, weights, session)
            return self._least_request(sidecar, key, weights)

        if self.published is None:
            return route("all", dict.fromkeys(self.names, 1.0))  # Kubernetes endpoints
        weights = self.published.weights
        if not self.split:
            return route("all", {n: float(w) for n, w in weights.items()})
        revisions = sorted(r for r, w in self.split.items() if w > 0)
        revision = self.rng.choices(revisions, weights=[self.split[r] for r in revisions])[0]
        subset = {n: float(w) for n, w in weights.items() if self.servers[n].spec.revision == revision}
        return route(revision, subset or {n: float(w) for n, w in weights.items()})

    def _blind_canary(self, sidecar: int, t: float) -> str:
        canary = self.canary
        steps = canary.steps if canary is not None else []
        if canary is None or not steps or canary.candidate_revision is None:
            return self._least_request(sidecar, "all", dict.fromkeys(self.names, 1.0))
        share = steps[min(len(steps) - 1, int(t // canary.step_interval))]
        revision = canary.candidate_revision if self.rng.random() * 100 < share else canary.stable_revision
        subset = [n for n in self.names if self.servers[n].spec.revision == revision] or self.names
        return self._least_request(sidecar, str(revision), dict.fromkeys(subset, 1.0))

    def _pick(self, arrival: Arrival) -> str:
        sidecar = arrival.client % len(self.sidecar_active)
        match self.strategy:
            case "round-robin":
                healthy = self._healthy(sidecar, dict.fromkeys(self.names, 1.0))
                pick = self.round_robins[sidecar].pick()
                for _ in self.names:
                    if pick in healthy:
                        break
                    pick = self.round_robins[sidecar].pick()
                return pick
            case "least-request":
                return self._least_request(sidecar, "all", dict.fromkeys(self.names, 1.0))
            case "static-capacity":
                return self._least_request(sidecar, "all", self.static_weights)
            case "best-static":
                assert self.best_split is not None, "best-static needs the offline split"
                return self.best_split.pick()
            case "seed-adaptive":
                return self._seed_adaptive()
            case "power-of-two":
                return self.power_of_two.pick()
            case "consistent-hash":
                return self.hash_ring.pick(arrival.session)
            case "cache-aware":
                segments = arrival.segments or ((OWN_CONTENT + arrival.index, arrival.prompt),)
                size = self.cache_aware.block_size
                return self.cache_aware.pick(block_hashes(segments, size)[: arrival.prompt // size], arrival.prompt)
            case "ring-hash" | "ring-hash-bounded":
                return self._ring_hash(sidecar, "all", dict.fromkeys(self.names, 1.0), arrival.session)
            case "blind-canary":
                return self._blind_canary(sidecar, arrival.at)
            case _:
                return self._sluice(sidecar, arrival.session)

    def _track(self, server: str, sidecar: int, delta: int) -> None:
        self.sidecar_active[sidecar][server] += delta
        self.global_active[server] += delta
        self.power_of_two.in_flight[server] += delta
        self.cache_aware.in_flight[server] += delta

    # ---------------------------------------------------------------------------------- the servers

    def _advance(self, t: float) -> None:
        for name, server in self.servers.items():
            for event in server.engine.advance_to(t):
                self._on_event(name, server, event.sequence, event.kind, event.at)

    def _on_event(self, name: str, server: SimServer, sequence: Sequence, kind: str, at: float) -> None:
        outcome, sidecar = self.flights[sequence.req_id]
        if kind == "first_token":
            if self.outliers is not None:
                self.outliers[sidecar].result(name, at, False)  # the response's headers: not a 5xx
            outcome.ttft = at - outcome.arrival.at
            outcome.cached_tokens = sequence.cached_tokens
            server.scraped.observe_ttft(at, outcome.ttft)
            server.recent_ttft.append(outcome.ttft)
            return
        outcome.e2e = at - outcome.arrival.at
        outcome.ok = True
        server.scraped.observe_outcome(at, True)
        self._track(name, sidecar, -1)
        del self.flights[sequence.req_id]
        self._uncount(sequence.req_id)

    def _arrive(self, arrival: Arrival, attempt: int = 0, tried: frozenset[str] = frozenset()) -> None:
        name = self._pick(arrival)
        if self.strategy in ENVOY_PICKS:
            for _ in range(HOST_SELECTIONS - 1):
                if name not in tried:
                    break
                name = self._pick(arrival)
        server = self.servers[name]
        sidecar = arrival.client % len(self.sidecar_active)
        if attempt == 0:
            outcome = Outcome(arrival, name)
            self.outcomes.append(outcome)
        else:
            outcome = self.retrying.pop(arrival.index)
            outcome.server, outcome.attempts = name, attempt + 1
        plane = self.scenario.dataplane
        if not self._within_share(name, arrival.tenant):
            outcome.rate_limited = True
            self._refuse(arrival, outcome, name, sidecar, attempt, tried, status=429)
            return
        reported = self.published.limits.get(name) if plane.reported_limits and self.published else None
        limit = reported or server.spec.inbound_max_requests or plane.inbound_max_requests
        shown, cluster, counted = self.limit_counts[name]
        if limit != shown:  # a new cluster, counting from zero
            shown, cluster, counted = limit, cluster + 1, 0
            self.limit_counts[name] = (shown, cluster, counted)
        if limit is not None and counted >= limit:
            self._refuse(arrival, outcome, name, sidecar, attempt, tried)
            return
        draw = arrival.draw if attempt == 0 else self._draw(arrival, attempt)
        if draw < server.error_rate:
            # an HTTP 500 (injected) at once: active for ~0 s; Envoy counts it and may retry it elsewhere
            server.scraped.observe_outcome(self.now, False)
            outcome.failed = self._server_error(arrival, outcome, name, sidecar, (attempt, plane.retries), tried)
            return
        if not server.engine.fits(arrival.prompt, arrival.output):
            outcome.failed = True  # an HTTP 400 (too long): not a 5xx, never retried
            server.scraped.observe_outcome(self.now, False)
            if self.outliers is not None:
                self.outliers[sidecar].result(name, self.now, False)
            return
        self._track(name, sidecar, +1)
        self.flights[arrival.index] = (outcome, sidecar)
        self.limit_counts[name] = (shown, cluster, counted + 1)
        self.counted[arrival.index] = (name, cluster)
        server.engine.submit(arrival.index, self.now, arrival.prompt, arrival.output, arrival.segments)
        server.peak_kv = max(server.peak_kv, server.engine.kv_usage)
        server.peak_waiting = max(server.peak_waiting, server.engine.num_waiting)

    def _uncount(self, index: int) -> None:
        """A request done: its sidecar's circuit breaker counts it no more, if the cluster that counted it is still
        the sidecar's."""
        name, cluster = self.counted.pop(index)
        shown, current, counted = self.limit_counts[name]
        if cluster == current:
            self.limit_counts[name] = (shown, current, counted - 1)

    def _within_share(self, name: str, tenant: str | None) -> bool:
        """The pod's sidecar's tenant bucket has a token (or it has none): the buckets sluice renders for the rate
        it reports (`tenant_buckets`, as `tenant_patch` renders them), checked ahead of the inbound limit as the
        HTTP filter runs ahead of the router. A bucket whose rate moved is a new one, full (a new filter
        configuration)."""
        tenants = self.pool.admission.tenants
        if tenants is None or not self.scenario.dataplane.reported_limits or self.published is None:
            return True
        rate = self.published.rates.get(name)
        if rate is None:
            return True
        key = tenant if tenant in self.named else None
        held = self.buckets.get((name, key))
        if held is None or held[0] != rate:
            bucket = tenant_buckets(tenants, rate)[key]
            held = (rate, TokenBucket(bucket.per_second, bucket.max_tokens, bucket.max_tokens, self.now))
            self.buckets[(name, key)] = held
        return held[1].take(self.now)

    def _refuse(
        self,
        arrival: Arrival,
        outcome: Outcome,
        name: str,
        sidecar: int,
        attempt: int,
        tried: frozenset[str],
        status: int = 503,
    ) -> None:
        """The pod's sidecar refuses at once: at its inbound limit a 503, retried on another pod `refusal_retries`
        times (Istio's default policy); past a tenant's bucket a 429, retried only if the pool's
        `routing.retries.statusCodes` names it (its `attempts` times). A 429 is not a 5xx to the caller's outlier
        detection: it resets the consecutive count (Envoy's outlier_detection_impl.cc `putHttpResponseCode` counts
        5xx only)."""
        self.servers[name].scraped.observe_refusal(self.now)
        retries = self.scenario.dataplane.refusal_retries
        if status == 429:
            policy = self.pool.routing.retries
            retries = policy.attempts if policy is not None and 429 in policy.status_codes else 0
        if self._server_error(arrival, outcome, name, sidecar, (attempt, retries), tried, server_error=status >= 500):
            outcome.failed = outcome.refused = True

    def _server_error(
        self,
        arrival: Arrival,
        outcome: Outcome,
        name: str,
        sidecar: int,
        budget: tuple[int, int],
        tried: frozenset[str],
        server_error: bool = True,
    ) -> bool:
        """A 5xx (`server_error`, else a 429) answered by `name`: told to the caller's outlier detection and
        retried after Envoy's jittered back-off on a pod not tried before while `budget` (attempt, retries allowed)
        lasts. True: given up."""
        attempt, retries = budget
        if self.outliers is not None:
            self.outliers[sidecar].result(name, self.now, server_error)
        if attempt >= retries:
            return True
        back_off = self._draw(arrival, attempt, "back-off") * RETRY_BACK_OFF * 2**attempt
        self.retrying[arrival.index] = outcome
        heapq.heappush(
            self.queue, (self.now + back_off, 3, next(self.order), "retry", (arrival, attempt + 1, tried | {name}))
        )
        return False

    def _draw(self, arrival: Arrival, attempt: int, what: str = "fails") -> float:
        """A uniform draw owned by this request's attempt: the same for every strategy."""
        return random.Random(f"{self.scenario.seed}-{arrival.index}-{attempt}-{what}").random()

    def _publish(self, t: float, published: Published | None) -> None:
        if published is None:
            return
        self.published = published
        self.split = published.split
        self.timeline.append((t, {n: published.weights.get(n, 0) for n in self.names}))

    # ---------------------------------------------------------------------------------- the run

    def _events(self) -> list[tuple[float, int, int, str, Any]]:
        scenario = self.scenario
        horizon = scenario.workload.duration
        order = itertools.count()
        events: list[tuple[float, int, int, str, Any]] = [(a.at, 3, next(order), "arrive", a) for a in self.trace]
        events += [(e.at, 2, next(order), "fault", e) for e in scenario.events]
        if self.control is not None:
            sl = scenario.sluice
            events += [(t, 0, next(order), "scrape", None) for t in _ticks(0.0, sl.scrape_interval, horizon)]
            events += [(t, 1, next(order), "reconcile", None) for t in _ticks(sl.interval, sl.interval, horizon)]
        if self.strategy == "power-of-two":
            poll = scenario.dataplane.load_poll_interval
            events += [(t, 0, next(order), "poll", None) for t in _ticks(0.0, poll, horizon)]
        heapq.heapify(events)
        return events

    def run(self) -> RunResult:
        events = self.queue = self._events()
        order = self.order = itertools.count(len(events))
        window = self.scenario.sluice.window
        while events:
            t, _, _, kind, payload = heapq.heappop(events)
            self._advance(t)
            self.now = t
            if kind == "arrive":
                self._arrive(payload)
            elif kind == "retry":
                self._arrive(*payload)
            elif kind == "scrape":
                for s in self.servers.values():
                    e = s.engine
                    s.scraped.scrape(t, e.num_running, e.num_waiting, e.kv_usage, horizon=2 * window)
            elif kind == "reconcile":
                assert self.control is not None
                published = self.control.step(t, self.control.observed([s.scraped for s in self.servers.values()]))
                delay = self.scenario.dataplane.propagation_delay
                heapq.heappush(events, (t + delay, 2, next(order), "apply", published))
            elif kind == "apply":
                self._publish(t, payload)
            elif kind == "poll":
                self.power_of_two.poll(
                    {n: s.engine.num_running + s.engine.num_waiting for n, s in self.servers.items()}
                )
            elif kind == "fault":
                server = self.servers[payload.server]
                if payload.slowdown is not None:
                    server.engine.slowdown = payload.slowdown
                if payload.error_rate is not None:
                    server.error_rate = payload.error_rate
        self._drain()
        work = self.scenario.workload
        return RunResult(
            strategy=self.strategy,
            outcomes=self.outcomes,
            weights=self.timeline,
            servers={n: s.spec.hardware for n, s in self.servers.items()},
            peaks={
                n: {
                    "kv": s.peak_kv,
                    "waiting": float(s.peak_waiting),
                    "preemptions": float(s.engine.preemptions_total),
                }
                for n, s in self.servers.items()
            },
            measured_from=work.warm_up,
            measured_until=work.duration,
            incident_at=min((e.at for e in self.scenario.events), default=None),
        )

    def _drain(self) -> None:
        deadline = self.scenario.workload.duration + DRAIN_SECONDS
        while True:
            nxt = min(s.engine.next_event_time() for s in self.servers.values())
            if nxt == math.inf or nxt > deadline:
                return
            self._advance(nxt)


def _ticks(start: float, every: float, until: float) -> list[float]:
    return [start + i * every for i in range(int((until - start) / every) + 1)]


def nearest_rank(values: list[float], p: float) -> float | None:
    """The p-quantile of sorted `values` by nearest rank (None if empty): how every figure here is read."""
    return values[min(len(values) - 1, int(p * len(values)))] if values else None


def summarise(result: RunResult) -> dict[str, Any]:
    """The figures of one run over the measured window (arrivals after the warm-up, before the end).

    A request that never got its first token within the drain counts as infinitely late (it is in the P99), a failed
    one is in the error rate, not in the TTFT figures.
    """
    measured = [o for o in result.outcomes if result.measured_from <= o.arrival.at <= result.measured_until]
    served = [o for o in measured if not o.failed]
    ttfts = sorted(o.ttft if o.ttft is not None else math.inf for o in served)
    finite = [t for t in ttfts if math.isfinite(t)]
    ok = [o for o in served if o.ok and o.e2e is not None]
    tpots = [((o.e2e or 0.0) - (o.ttft or 0.0)) / (o.arrival.output - 1) for o in ok if o.arrival.output > 1 and o.ttft]
    span = result.measured_until - result.measured_from
    looked_up = [
        (o.cached_tokens, o.arrival.prompt) for o in served if o.ttft is not None and o.cached_tokens is not None
    ]
    per_class = Counter(result.servers[o.server] for o in measured)

    def ms(value: float | None) -> float | None:
        return None if value is None else value * 1000

    published = [(t, w) for t, w in result.weights if result.measured_from <= t <= result.measured_until]
    changes = sum(1 for (_, a), (_, b) in itertools.pairwise(published) if a != b)
    figures: dict[str, Any] = {
        "requests": len(measured),
        "completed": len(ok),
        "weight_changes_per_min": changes / (span / 60.0) if result.weights and span > 0 else None,
        "ttft_mean_ms": ms(statistics.fmean(finite)) if finite else None,
        "ttft_p50_ms": ms(nearest_rank(ttfts, 0.50)),
        "ttft_p90_ms": ms(nearest_rank(ttfts, 0.90)),
        "ttft_p99_ms": ms(nearest_rank(ttfts, 0.99)),
        "tpot_mean_ms": ms(statistics.fmean(tpots)) if tpots else None,
        "e2e_p99_ms": ms(nearest_rank(sorted(o.e2e for o in ok if o.e2e is not None), 0.99)),
        "output_tokens_per_s": sum(o.arrival.output for o in ok) / span if span > 0 else 0.0,
        "error_rate": (len(measured) - len(ok)) / len(measured) if measured else 0.0,
        "retried": sum(1 for o in measured if o.attempts > 1) / len(measured) if measured else 0.0,
        "refused": sum(1 for o in measured if o.refused) / len(measured) if measured else 0.0,
        "served_per_s": len(ok) / span if span > 0 else 0.0,
        "unfinished": sum(1 for t in ttfts if not math.isfinite(t)),
        "share": {c: n / len(measured) for c, n in sorted(per_class.items())} if measured else {},
        "peak_kv": max((p["kv"] for p in result.peaks.values()), default=0.0),
        "preemptions": sum(p["preemptions"] for p in result.peaks.values()),
        # the share of looked-up prompt tokens found cached; None where no server has a cache (not 0)
        "prefix_hit_rate": (
            sum(hit for hit, _ in looked_up) / max(1, sum(prompt for _, prompt in looked_up)) if looked_up else None
        ),
    }
    if result.incident_at is not None:
        during = [o for o in measured if result.incident_at <= o.arrival.at < result.incident_at + 60.0]
        lates = sorted(o.ttft if o.ttft is not None else math.inf for o in during if not o.failed)
        figures["incident_ttft_p99_ms"] = ms(nearest_rank(lates, 0.99))
        figures["incident_error_rate"] = sum(1 for o in during if o.failed) / len(during) if during else 0.0
    return figures
