"""The data planes a request meets in the simulation: Envoy's load balancers and models of the peer routers.

Called by `sluice.bench.sim`. Envoy's algorithms as its source has them
(`source/common/upstream/load_balancer_impl.cc`), one instance per client sidecar, each with its own active-request
counts:
- ROUND_ROBIN, equal weights: a rotation per sidecar, starting at a random host;
- LEAST_REQUEST: `sluice.sim.leastrequest` (the local stack's load generator routes by it too);
- RING_HASH on a session header, weighted, with or without bounded load (`EnvoyRingHash`): what a DestinationRule's
  `consistentHash.httpHeaderName` renders, and sluice's `routing.sessionAffinity`.

The peer routers are modelled from their documentation and the facts measured in `benchmarking.md`: one central
router process each, not per-client sidecars.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
from collections.abc import Mapping

import xxhash


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


class CacheAwareRouter:
    """The vLLM router's `cache_aware` policy (vllm-project/router `src/policies/cache_aware.rs` @2f2db0d9a6d0,
    `src/tree.rs` @1dbe5075a346; the command line's defaults, `src/main.rs` @03e9af5c1982, which the PyPI
    vllm-router 0.1.17's `--help` shows too): one router, its own in-flight count per worker as the load. The
    SGLang router 0.3.2's `cache_aware` runs this algorithm and matched this model on the real data plane; the vLLM
    router 0.1.17 binary did not follow prefixes on `/v1/completions` (docs/benchmarks.md, "Prefix reuse").

    - imbalanced, when max load - min load > `balance_abs` and max load > min load x `balance_rel`: the least
      loaded worker;
    - else the prompt is matched against one tree of every prompt routed so far, each node knowing the workers it
      went to: past `cache_threshold` of the prompt matched, the worker that last took the deepest matched node;
      below it, the least loaded;
    - the whole prompt is then inserted in the tree for the chosen worker, at routing time.

    The router's tree holds characters; this one holds the prompts' blocks of 16 tokens (`sluice.sim.engine`'s
    hashes), so a match is counted in whole blocks and the match rate is in tokens, not characters. Eviction (per
    worker, least recently used leaves past `max_tree_size` characters, every 120 s) is kept as a budget of
    2^26 / 4 tokens a worker: a few minutes of the benchmark's traces never reach it.
    """

    def __init__(
        self,
        hosts: list[str],
        cache_threshold: float = 0.3,
        balance_abs: int = 64,
        balance_rel: float = 1.5,
        budget_tokens: int = (1 << 26) // 4,
        block_size: int = 16,
    ) -> None:
        self.hosts = sorted(hosts)
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.budget = budget_tokens
        self.block_size = block_size
        self.in_flight: dict[str, int] = dict.fromkeys(self.hosts, 0)
        self.tree: dict[int, dict[str, int]] = {}
        """Block hash -> {worker: the epoch it last went there}, in order of insertion (the last is the latest)."""
        self.owned: dict[str, int] = dict.fromkeys(self.hosts, 0)
        self.epoch = 0
        self.decisions: dict[str, int] = {"imbalanced": 0, "cache": 0, "least_load": 0}

    def _least_loaded(self) -> str:
        return min(self.hosts, key=lambda h: self.in_flight[h])  # the first minimum in worker order

    def pick(self, hashes: list[int], prompt: int) -> str:
        loads = self.in_flight.values()
        high, low = max(loads), min(loads)
        if high - low > self.balance_abs and high > low * self.balance_rel:
            chosen = self._least_loaded()
            self.decisions["imbalanced"] += 1
        else:
            deepest: dict[str, int] | None = None
            matched = 0
            for block in hashes:
                node = self.tree.get(block)
                if not node:
                    break
                deepest, matched = node, matched + 1
            rate = matched * self.block_size / prompt if prompt else 0.0
            if deepest is not None and rate > self.cache_threshold:
                chosen = next(reversed(deepest))
                self.decisions["cache"] += 1
            else:
                chosen = self._least_loaded()
                self.decisions["least_load"] += 1
        self._insert(hashes, chosen)
        return chosen

    def _insert(self, hashes: list[int], host: str) -> None:
        self.epoch += 1
        for block in hashes:
            node = self.tree.setdefault(block, {})
            if host not in node:
                self.owned[host] += self.block_size
            node.pop(host, None)
            node[host] = self.epoch
        if self.owned[host] > self.budget:
            self._evict(host)

    def _evict(self, host: str) -> None:
        """Drop `host`'s least recently routed blocks until it is within its budget."""
        mine = sorted((node[host], block) for block, node in self.tree.items() if host in node)
        for _, block in mine:
            if self.owned[host] <= self.budget:
                break
            node = self.tree[block]
            del node[host]
            self.owned[host] -= self.block_size
            if not node:
                del self.tree[block]


class EnvoyRingHash:
    """One Envoy's RING_HASH cluster keyed by a request header, as Envoy's source builds and walks it.

    `source/extensions/load_balancing_policies/ring_hash/ring_hash_lb.cc` (envoyproxy/envoy @0d2acde2e8d7): weights
    normalised to sum 1; the ring's scale is min(ceil(min_w x 1024) / min_w, 8M) (`minimum_ring_size` 1024, Istio's
    default); host i (in host order) gets ceil(T_i) - ceil(T_{i-1}) points, T_i the running sum of scale x weight,
    point k hashed xxHash64("<host>_<k>"); a key goes to the first point at or after its hash, wrapping. The key:
    xxHash64 of the header's value (`source/common/http/hash_policy.cc`). A weight change rebuilds the ring
    (`refresh()`).

    With `hash_balance_factor` (`common/thread_aware_lb_impl.cc` @0336fd611e57, `BoundedLoadHashingLoadBalancer`):
    this Envoy's active requests A to the cluster and host h's a_h; total slots ceil((A + 1) x factor / 100), h's slots
    max(ceil(total x w_h), 1); h is taken while a_h / slots <= 1. Past it, hosts are tried in an order shuffled by
    the key's hash (Envoy: Fisher-Yates with std::mt19937 seeded by the hash; here Python's Mersenne Twister seeded
    by it: an order fixed per key as Envoy's is, not the same order), the first within bounds taken, else the least
    overloaded.
    """

    MIN_RING = 1024
    MAX_RING = 8 * 1024 * 1024

    def __init__(self, active: Mapping[str, int], balance_factor: int | None = None) -> None:
        self.active = active
        """This Envoy's active requests per host (shared with the caller, who keeps it)."""
        self.balance_factor = balance_factor
        self.weights: dict[str, float] = {}
        self.points: list[int] = []
        self.owners: list[str] = []
        self.rebuilds = 0

    def update(self, weights: Mapping[str, float]) -> None:
        hosts = {h: w for h, w in weights.items() if w > 0} or dict(weights)
        total = sum(hosts.values())
        normalised = {h: w / total for h, w in sorted(hosts.items())}
        if normalised == self.weights:
            return
        self.weights = normalised
        self.rebuilds += 1
        least = min(normalised.values())
        scale = min(math.ceil(least * self.MIN_RING) / least, float(self.MAX_RING))
        ring: list[tuple[int, str]] = []
        running, previous = 0.0, 0
        for host, weight in normalised.items():
            running += scale * weight
            count = math.ceil(running) - previous
            previous = math.ceil(running)
            ring += [(xxhash.xxh64_intdigest(f"{host}_{k}".encode()), host) for k in range(count)]
        ring.sort()
        self.points = [p for p, _ in ring]
        self.owners = [h for _, h in ring]

    @staticmethod
    def key_hash(value: str) -> int:
        return xxhash.xxh64_intdigest(value.encode())

    def ring_host(self, key: int) -> str:
        index = bisect.bisect_left(self.points, key)
        return self.owners[index if index < len(self.points) else 0]

    def pick(self, value: str) -> str:
        key = self.key_hash(value)
        chosen = self.ring_host(key)
        factor = self.balance_factor
        if not factor:
            return chosen
        active = self.active
        overall = sum(active.values())  # the cluster's upstream_rq_active in this Envoy
        total_slots = -(-((overall + 1) * factor) // 100)

        def overload(host: str) -> float:
            return active[host] / max(math.ceil(total_slots * self.weights[host]), 1)

        if overload(chosen) <= 1.0:
            return chosen
        order = list(self.weights)
        random.Random(key).shuffle(order)
        least, least_load = chosen, overload(chosen)
        for host in order:
            if host == chosen:
                continue
            load = overload(host)
            if load <= 1.0:
                return host
            if load < least_load:
                least, least_load = host, load
        return least


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
