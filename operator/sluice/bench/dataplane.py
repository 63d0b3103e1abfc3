"""The data planes a request meets in the simulation: Envoy's load balancers and models of the peer routers.

Called by `sluice.bench.sim`. Envoy's algorithms as its source has them (`source/common/upstream/load_balancer_impl.cc`,
`edf_scheduler.h`), one instance per client sidecar, each with its own active-request counts:
- ROUND_ROBIN, equal weights: a rotation per sidecar, starting at a random host;
- LEAST_REQUEST, equal weights: `choice_count` draws *with replacement*; a later draw replaces the candidate only
  with strictly fewer active requests (ties keep the first);
- LEAST_REQUEST, unequal weights: an EDF schedule over `weight / (active + 1)^bias`, a host's weight recomputed
  each time it is picked; the schedule is rebuilt (with a random number of pre-picks, so sidecars do not start in
  step) only when the published weights change.

The peer routers are modelled from their documentation and the facts measured in `benchmarking.md`: one central
router process each, not per-client sidecars.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import itertools
import random
from collections.abc import Callable, Mapping


class EdfScheduler:
    """Envoy's EdfScheduler: pick the earliest deadline, re-add the host at `deadline + 1 / weight(host)`."""

    def __init__(self, hosts: list[str], weight: Callable[[str], float], pre_picks: int) -> None:
        self.weight = weight
        self.order = itertools.count()
        self.heap = [(1.0 / weight(h), next(self.order), h) for h in hosts]
        heapq.heapify(self.heap)
        for _ in range(pre_picks):
            self.pick()

    def pick(self) -> str:
        deadline, _, host = heapq.heappop(self.heap)
        heapq.heappush(self.heap, (deadline + 1.0 / self.weight(host), next(self.order), host))
        return host


class EnvoyLeastRequest:
    """One sidecar's LEAST_REQUEST load balancer over one cluster (weights as last delivered by EDS)."""

    def __init__(self, active: dict[str, int], rng: random.Random, choice_count: int, bias: float) -> None:
        self.active = active
        self.rng = rng
        self.choice_count = choice_count
        self.bias = bias
        self.weights: dict[str, float] = {}
        self.hosts: list[str] = []
        self.scheduler: EdfScheduler | None = None

    def update(self, weights: Mapping[str, float]) -> None:
        """An EDS update: rebuilds the schedule only if something changed, as Envoy does."""
        if dict(weights) == self.weights:
            return
        self.weights = dict(weights)
        self.hosts = sorted(self.weights)
        if len(set(self.weights.values())) <= 1:
            self.scheduler = None
            return
        self.scheduler = EdfScheduler(
            self.hosts,
            lambda h: self.weights[h] / (self.active.get(h, 0) + 1) ** self.bias,
            pre_picks=self.rng.randrange(len(self.hosts)),
        )

    def pick(self) -> str:
        if self.scheduler is not None:
            return self.scheduler.pick()
        candidate = self.hosts[self.rng.randrange(len(self.hosts))]
        for _ in range(self.choice_count - 1):
            sampled = self.hosts[self.rng.randrange(len(self.hosts))]
            if self.active.get(sampled, 0) < self.active.get(candidate, 0):
                candidate = sampled
        return candidate


class EnvoyRoundRobin:
    def __init__(self, hosts: list[str], rng: random.Random) -> None:
        self.hosts = sorted(hosts)
        self.index = rng.randrange(len(self.hosts))

    def pick(self) -> str:
        self.index = (self.index + 1) % len(self.hosts)
        return self.hosts[self.index]


class WeightedRandom:
    """A fixed split of the load (the offline best static split is replayed this way: exactly its shares)."""

    def __init__(self, shares: Mapping[str, float], rng: random.Random) -> None:
        self.hosts = sorted(h for h, s in shares.items() if s > 0)
        self.cumulative = list(itertools.accumulate(shares[h] for h in self.hosts))
        self.rng = rng

    def pick(self) -> str:
        x = self.rng.random() * self.cumulative[-1]
        return self.hosts[min(len(self.hosts) - 1, bisect.bisect_right(self.cumulative, x))]


class PowerOfTwoRouter:
    """vLLM router's `power_of_two`: two distinct random workers, the lower (polled load + own in-flight) wins.

    The load comes from `GET /get_load` polled every second (`{"load": N}`; here running + waiting at the poll).
    """

    def __init__(self, hosts: list[str], rng: random.Random) -> None:
        self.hosts = sorted(hosts)
        self.rng = rng
        self.polled: dict[str, float] = dict.fromkeys(self.hosts, 0.0)
        self.in_flight: dict[str, int] = dict.fromkeys(self.hosts, 0)

    def poll(self, loads: Mapping[str, float]) -> None:
        self.polled = dict(loads)

    def pick(self) -> str:
        if len(self.hosts) == 1:
            return self.hosts[0]
        a, b = self.rng.sample(self.hosts, 2)
        score = {h: self.polled.get(h, 0.0) + self.in_flight[h] for h in (a, b)}
        return b if score[b] < score[a] else a


class ConsistentHashRouter:
    """vLLM router's `consistent_hash` on the session id: a hash ring with virtual nodes per worker."""

    VIRTUAL_NODES = 160

    def __init__(self, hosts: list[str]) -> None:
        ring = [(self._hash(f"{h}#{i}"), h) for h in hosts for i in range(self.VIRTUAL_NODES)]
        ring.sort()
        self.points = [p for p, _ in ring]
        self.owners = [h for _, h in ring]

    @staticmethod
    def _hash(key: str) -> int:
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")

    def pick(self, session: int) -> str:
        index = bisect.bisect(self.points, self._hash(f"session-{session}")) % len(self.points)
        return self.owners[index]
