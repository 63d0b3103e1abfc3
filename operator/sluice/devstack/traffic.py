"""The local stack's load generator: bounded load through the routes sluice published, as Envoy sends it.

Local-stack tool. `Traffic` routes each request the way the client's Envoy would with the objects sluice published
(`sluice.devstack.routes`): a header route or the revision split from the VirtualService, then weighted
least-request (`w / (active + 1)`) over the ServiceEntry endpoints; it measures TTFT from the SSE stream. It
follows the route's retry policy (another pod, on failures before the response starts) and its `mirrors`: a
sampled share of the requests is also sent, fire-and-forget, to a pod of the mirror's subset, and that answer is
read and discarded. It counts per pod the requests that served users and those that were mirror copies.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

import aiohttp

from sluice.devstack.routes import Endpoint, MirrorRoute, RetryPolicy, Split, headers_match, read_routes
from sluice.devstack.stack import Stack
from sluice.istio.kinds import SERVICE_ENTRY, VIRTUAL_SERVICE
from sluice.istio.objects import PoolRef, object_name

PROMPT_WORDS = 2048


async def stream_completion(
    http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
) -> tuple[float | None, bool]:
    """One streamed completion: (time to the first SSE chunk, whether it completed). Errors are (None, False)."""
    ttft, ok, _ = await attempt_completion(http, url, prompt, max_tokens)
    return ttft, ok


async def attempt_completion(
    http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
) -> tuple[float | None, bool, str | None]:
    """One attempt: (TTFT, completed, the Envoy retry condition it failed with before any response byte, if any).

    The conditions are Envoy's `retryOn` names: `connect-failure` (no connection), `reset` (dropped before the
    response headers), `gateway-error` (502/503/504), or the status code of another error answer ("500"). A
    failure after the response started has none: Envoy never retries once it has sent the client part of an answer.
    """
    started = time.monotonic()
    ttft: float | None = None
    headers_seen = False
    try:
        async with http.post(url, json={"prompt": prompt, "max_tokens": max_tokens, "stream": True}) as answer:
            headers_seen = True
            if answer.status != 200:
                return None, False, "gateway-error" if answer.status in (502, 503, 504) else str(answer.status)
            async for line in answer.content:
                if ttft is None and line.startswith(b"data:"):
                    ttft = time.monotonic() - started
    except aiohttp.ClientConnectorError:
        return None, False, "connect-failure"
    except (aiohttp.ClientError, TimeoutError):
        return ttft, False, None if headers_seen else "reset"
    return ttft, True, None


@dataclass
class Sample:
    at: float
    pod: str
    revision: str
    ttft: float | None
    ok: bool
    attempts: int = 1
    condition: str | None = None
    """How the last attempt failed before any response byte (an Envoy `retryOn` name, or the status code of another
    error answer, e.g. "500"); None: it did not, or it failed after the answer had started (never retried)."""
    first: str = ""
    """The pod its first attempt went to (`pod` is the last attempt's)."""
    tester: bool = False
    """The request carried the tester headers (`Traffic.tester_headers`)."""
    user: str | None = None
    """The user key it carried (`Traffic.user_header`), if any."""


def user_key(index: int) -> str:
    """User `index`'s key: 16 hex digits, as a random session or user id looks (the same for every request)."""
    return hashlib.sha256(f"user-{index}".encode()).hexdigest()[:16]


@dataclass
class Traffic:
    """Bounded load through the published routing: revision split, then weighted least-request, the route's
    retry policy (another pod, on failures before the response starts) and its request mirrors as Envoy applies
    them (a copy sent once per request, before any retry, whose answer nobody sees)."""

    stack: Stack
    pool: str
    rate: float = 6.0
    max_tokens: int = 32
    samples: deque[Sample] = field(default_factory=lambda: deque(maxlen=20000))
    active: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    routes: tuple[Split, dict[str, list[Endpoint]]] = field(default=({}, {}))
    retries: RetryPolicy = field(default_factory=RetryPolicy)
    mirrors: tuple[MirrorRoute, ...] = ()
    served: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Per pod: attempts of user requests sent to it (retries included) — the answers users got."""
    mirrored: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Per pod: mirror copies sent to it (answers discarded)."""
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    seed: int = 7
    tester_share: float = 0.0
    """Share of requests sent with `tester_headers` (testers steered by the canary's header routes)."""
    tester_headers: dict[str, str] = field(default_factory=lambda: {"x-sluice-tester": "yes"})
    user_header: str | None = None
    """Every request carries a user key in this header, drawn from `users` users (each the same key every time)."""
    users: int = 200
    matched: tuple[tuple[tuple[dict[str, dict[str, str]], ...], Split], ...] = ()
    """The header routes ahead of the weighted one, in order: (their match entries, their split)."""
    pushes: bool = True
    """Whether the routes are read again every 0.5 s, as istiod pushes a changed object to the proxies; False: the
    last routes read are kept, as Envoy keeps the last configuration pushed while istiod is down."""
    withheld: int = 0
    """Route reads skipped while `pushes` was False."""

    def refresh_routes(self) -> None:
        """Read the ServiceEntry (per-pod weights) and VirtualService (revision split) sluice wrote."""
        name = object_name(PoolRef(self.pool, self.stack.namespace))
        entry = self.stack.istio(SERVICE_ENTRY.plural, name)
        service = self.stack.istio(VIRTUAL_SERVICE.plural, name)
        if entry is None:
            return
        published = read_routes(entry, service, {state.spec.ip: pod for pod, state in self.stack.pods.items()})
        self.matched = published.matched
        self.retries = published.retries
        self.mirrors = published.mirrors
        self.routes = (published.split, published.by_revision)

    def pick_mirror(self, rng: random.Random, revision: str) -> tuple[str, str] | None:
        """A pod of the mirror's subset, by the same weighted least-request; None when the subset has none."""
        endpoints = self.routes[1].get(revision) if revision else None
        if not endpoints:
            return None  # Envoy: no healthy upstream in the mirror cluster, the copy is dropped
        effective = [w / (self.active[pod] + 1) for pod, _, w in endpoints]
        pod, ip, _ = rng.choices(endpoints, weights=effective)[0]
        return pod, ip

    def pick(
        self, rng: random.Random, avoid: frozenset[str] = frozenset(), headers: dict[str, str] | None = None
    ) -> tuple[str, str, str] | None:
        split, by_revision = self.routes
        for entries, route_split in self.matched:
            if any(headers_match(headers or {}, entry) for entry in entries):
                split = route_split
                break
        if avoid:  # a retry that ignores previous hosts
            by_revision = {r: [e for e in group if e[0] not in avoid] for r, group in by_revision.items()}
            by_revision = {r: group for r, group in by_revision.items() if group}
        if not by_revision:
            return None
        if split and "" not in split:
            revisions = [r for r in split if split[r] > 0 and by_revision.get(r)]
            if not revisions:
                return None
            revision = rng.choices(revisions, weights=[split[r] for r in revisions])[0]
            endpoints = by_revision[revision]
        else:
            revision, endpoints = "", [e for group in by_revision.values() for e in group]
        # Envoy LEAST_REQUEST with unequal weights: effective weight w / (active + 1).
        effective = [w / (self.active[pod] + 1) for pod, _, w in endpoints]
        pod, ip, _ = rng.choices(endpoints, weights=effective)[0]
        return pod, ip, revision or self.stack.pods[pod].spec.revision if pod in self.stack.pods else revision

    async def run(self, seconds: float) -> None:
        rng = random.Random(self.seed)
        prompt = "w " * (PROMPT_WORDS - 1)
        sent = 0
        end = time.monotonic() + min(seconds, self.stack.remaining())
        tasks: set[asyncio.Task[None]] = set()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            refresh = asyncio.create_task(self._refresh_loop())
            try:
                while time.monotonic() < end and not self.stop.is_set():
                    await asyncio.sleep(rng.expovariate(self.rate))
                    headers = dict(self.tester_headers) if rng.random() < self.tester_share else {}
                    if self.user_header is not None:
                        headers[self.user_header] = user_key(rng.randrange(self.users))
                    choice = self.pick(rng, headers=headers)
                    if choice is None or len(tasks) > 200:
                        continue
                    sent += 1
                    own = f"r{sent} {prompt}"  # a request's tokens are its own: no prefix cache hit between them
                    task = asyncio.create_task(self._one(http, own, *choice, headers=headers))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    for mirror in self.mirrors:
                        target = self.pick_mirror(rng, mirror.revision) if rng.random() * 100 < mirror.percent else None
                        if target is not None:
                            copy = asyncio.create_task(self._mirror(http, own, *target))
                            tasks.add(copy)
                            copy.add_done_callback(tasks.discard)
            finally:
                refresh.cancel()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, refresh, return_exceptions=True)

    async def _refresh_loop(self) -> None:
        while True:
            if self.pushes:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.refresh_routes)
            else:
                self.withheld += 1
            await asyncio.sleep(0.5)

    async def _mirror(self, http: aiohttp.ClientSession, prompt: str, pod: str, ip: str) -> None:
        """A mirror copy: sent, answered in full by the pod, and thrown away (never retried, never a sample)."""
        self.mirrored[pod] += 1
        self.active[pod] += 1
        try:
            await attempt_completion(http, f"http://{ip}:8000/v1/completions", prompt, self.max_tokens)
        finally:
            self.active[pod] -= 1

    async def _one(
        self,
        http: aiohttp.ClientSession,
        prompt: str,
        pod: str,
        ip: str,
        revision: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        headers = headers or {}
        policy, tried, attempts, first = self.retries, {pod}, 1, pod
        rng = random.Random(hash((pod, time.monotonic())))
        while True:
            self.served[pod] += 1
            self.active[pod] += 1
            try:
                url = f"http://{ip}:8000/v1/completions"
                ttft, ok, condition = await attempt_completion(http, url, prompt, self.max_tokens)
            finally:
                self.active[pod] -= 1
            if ok or not policy.retries(condition) or attempts > policy.attempts:
                break
            retry = self.pick(rng, frozenset(tried) if policy.ignore_previous_hosts else frozenset(), headers)
            if retry is None:
                break
            pod, ip, revision = retry
            tried.add(pod)
            attempts += 1
        tester = bool(self.tester_headers) and all(headers.get(k) == v for k, v in self.tester_headers.items())
        user = headers.get(self.user_header) if self.user_header else None
        self.samples.append(
            Sample(time.monotonic(), pod, revision, ttft, ok, attempts, condition, first, tester=tester, user=user)
        )

    def finished(self) -> list[Sample]:
        """The samples so far, copied in one step: the traffic's loop appends from its own thread, and iterating
        the deque while it does raises."""
        return list(self.samples)

    def failures(self, since: float, until: float | None = None, retriable: bool = False) -> tuple[int, int]:
        """(failed, all) requests finished in the window; `retriable`: only the failures before any response
        byte (those a retry policy can turn into a retry)."""
        recent = [s for s in self.finished() if s.at >= since and (until is None or s.at <= until)]
        return sum(1 for s in recent if not s.ok and (not retriable or s.condition is not None)), len(recent)

    def share(self, since: float, key: str = "pod") -> dict[str, float]:
        recent = [s for s in self.finished() if s.at >= since]
        counts: dict[str, int] = defaultdict(int)
        for sample in recent:
            counts[getattr(sample, key)] += 1
        total = sum(counts.values()) or 1
        return {k: v / total for k, v in sorted(counts.items())}
