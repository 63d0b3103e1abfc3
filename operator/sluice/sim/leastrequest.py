"""Envoy's LEAST_REQUEST load balancer, as one client sidecar runs it over one cluster.

Shared by the benchmark's data plane (`sluice.bench.sim`, one balancer per sidecar and cluster) and the local
stack's load generator (`sluice.devstack.traffic`), so both route by the same code. Envoy's algorithm as its source
has it (`source/common/upstream/load_balancer_impl.cc`, `edf_scheduler.h`), with its own active-request counts:
- equal weights: `choice_count` draws *with replacement*; a later draw replaces the candidate only with strictly
  fewer active requests (ties keep the first);
- unequal weights: an EDF schedule over `weight / (active + 1)^bias`, a host's weight recomputed each time it is
  picked; the schedule is rebuilt (with a random number of pre-picks, so sidecars do not start in step) only when
  the published weights change.
"""

from __future__ import annotations

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
