"""The data planes a request meets in the simulation: Envoy's load balancers and models of the peer routers.

Called by `sluice.bench.sim`. Envoy's algorithms as its source has them
(`source/common/upstream/load_balancer_impl.cc`), one instance per client sidecar, each with its own active-request
counts:
- ROUND_ROBIN, equal weights: a rotation per sidecar, starting at a random host;
- LEAST_REQUEST: `sluice.sim.leastrequest` (the local stack's load generator routes by it too).

The peer routers are modelled from their documentation and the facts measured in `benchmarking.md`: one central
router process each, not per-client sidecars.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
from collections.abc import Mapping


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


class OutlierDetector:
    """One sidecar's consecutive-5xx outlier detection over one cluster, as Envoy runs what Istio renders.

    Envoy 1.38 `source/common/upstream/outlier_detection_impl.cc`: every 5xx response counts towards the host's
    consecutive 5xx, any other response resets it; reaching `consecutive_5xx` ejects the host unless that would
    take the ejected share past `max_ejection_percent` (100 (ejected + 1) / hosts ≤ max), and resets the count.
    The ejection time is base × backoff (backoff counted up at each ejection, capped at `max_ejection_time`, 300 s
    by default); a host comes back at the first interval sweep that finds its time served, with its counts reset,
    and each sweep that finds it in service for a full interval since counts its backoff down by one. Istio
    writes `enforcing_success_rate: 0` and no gateway-failure enforcement for a DestinationRule's
    `consecutive5xxErrors`, so only consecutive 5xx ejects; `minHealthPercent` 0 turns the panic threshold off.
    No jitter (Envoy's default `max_ejection_time_jitter` is 0).
    """

    def __init__(
        self,
        hosts: list[str],
        consecutive_5xx: int,
        interval: float,
        base_ejection_time: float,
        max_ejection_percent: int,
        max_ejection_time: float = 300.0,
    ) -> None:
        self.hosts = sorted(hosts)
        self.threshold = consecutive_5xx
        self.interval = interval
        self.base = base_ejection_time
        self.max_percent = max_ejection_percent
        self.max_time = max(max_ejection_time, base_ejection_time)
        self.count = dict.fromkeys(self.hosts, 0)
        self.backoff = dict.fromkeys(self.hosts, 0)
        self.ejected_at: dict[str, float] = {}
        self.unejected_at: dict[str, float] = {}
        self.next_sweep = interval
        self.ejections = 0

    def result(self, host: str, at: float, server_error: bool) -> None:
        """A response from `host` at `at`: a 5xx or not."""
        self.sweep(at)
        if not server_error:
            self.count[host] = 0
            return
        self.count[host] += 1
        if self.threshold > 0 and self.count[host] == self.threshold and host not in self.ejected_at:
            self.count[host] = 0
            if 100.0 * (len(self.ejected_at) + 1) / len(self.hosts) <= self.max_percent:
                self.ejected_at[host] = at
                self.ejections += 1
                if self.backoff[host] * self.base < self.max_time + self.base:
                    self.backoff[host] += 1

    def sweep(self, now: float) -> None:
        """Run the interval sweeps due by `now`."""
        while self.next_sweep <= now:
            tick = self.next_sweep
            for host, since in list(self.ejected_at.items()):
                if min(self.base * self.backoff[host], self.max_time) <= tick - since:
                    del self.ejected_at[host]
                    self.count[host] = 0
                    self.unejected_at[host] = tick
            for host, since in self.unejected_at.items():
                if host not in self.ejected_at and tick - since >= self.interval and self.backoff[host] > 0:
                    self.backoff[host] -= 1
            self.next_sweep += self.interval

    def ejected(self, now: float) -> frozenset[str]:
        self.sweep(now)
        return frozenset(self.ejected_at)
