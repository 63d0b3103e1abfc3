"""Fault injection in the API emulator: which rule of the plan fires for a request, and the answer it serves.

Called by `apiserver` once per resource request (after authentication, before authorization, where kube-apiserver's
API Priority and Fairness filter sits). The decisions are pure functions of the plan, the rule's counters, a seeded
`random.Random` and an injected clock (`FaultInjector(clock=...)`), so the same requests in the same order get the
same faults. Rules are read in order: every firing `latency` rule adds its delay; the first firing rule with another
effect decides the answer and ends the reading. What was served is recorded by the server (`record`) and reported
by `status` (`GET /_faults`). The answers follow kube-apiserver 1.32 (k8s.io/apiserver v0.32.0,
k8s.io/apimachinery v0.32.0), cited where each is built.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from sluice.emulator.apifaultplan import (
    CloseWatch,
    Effect,
    ExpireWatch,
    FaultPlan,
    FaultRule,
    Latency,
    RequestMatch,
    ServerError,
    Throttle,
    plan_document,
)

Z99 = 2.3263478740408408
"""The standard normal's 99th percentile: a log-normal with median p50 has its p99 at p50 * exp(sigma * Z99)."""
RECORDS_KEPT = 1000


@dataclass(frozen=True)
class FaultRequest:
    """What a rule can match on, read from one request."""

    verb: str
    group: str
    resource: str
    namespace: str
    name: str
    user: str
    user_agent: str
    resource_version: str = ""


@dataclass(frozen=True)
class Counters:
    """A rule's memory: requests it matched, the rest of a burst in progress, faults it fired."""

    matched: int = 0
    burst_left: int = 0
    fired: int = 0


@dataclass(frozen=True)
class Decision:
    """For one request: the delay to add, and the rule (with its effect) that decides the answer, if any."""

    delays: tuple[tuple[str, float], ...] = ()
    """Each firing latency rule's name and the delay it drew."""
    rule: FaultRule | None = None

    @property
    def delay(self) -> float:
        return sum(seconds for _, seconds in self.delays)

    @property
    def effect(self) -> Effect | None:
        return self.rule.effect if self.rule is not None else None


@dataclass(frozen=True)
class Answer:
    """An HTTP answer as bytes: code, headers in order, body."""

    code: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


# ------------------------------------------------------------------------------------------------ pure decisions


def matches(match: RequestMatch, effect: Effect, request: FaultRequest) -> bool:
    """Whether a rule's match selects the request; watch effects select only watches (expiry: from a version)."""
    if isinstance(effect, CloseWatch | ExpireWatch) and request.verb != "watch":
        return False
    if isinstance(effect, ExpireWatch) and request.resource_version in ("", "0"):
        return False
    return (
        (not match.verbs or request.verb in match.verbs)
        and (not match.resources or request.resource in match.resources)
        and (not match.groups or request.group in match.groups)
        and (not match.namespaces or request.namespace in match.namespaces)
        and (not match.users or request.user in match.users)
        and (not match.user_agents or any(request.user_agent.startswith(p) for p in match.user_agents))
    )


def in_window(rule: FaultRule, elapsed: float) -> bool:
    """Whether `elapsed` seconds after the plan's installation fall in the rule's window [after, until)."""
    return elapsed >= rule.after and (rule.until is None or elapsed < rule.until)


def fires(rule: FaultRule, counters: Counters, draw: Callable[[], float]) -> tuple[bool, Counters]:
    """Whether a matched request gets the rule's fault, and the rule's counters after it. `draw` is only called
    when the chance decides (a probability below 1, outside a burst), so a plan without chances draws nothing."""
    matched = counters.matched + 1
    if rule.limit is not None and counters.fired >= rule.limit:
        return False, replace(counters, matched=matched, burst_left=0)
    if counters.burst_left > 0:
        return True, Counters(matched, counters.burst_left - 1, counters.fired + 1)
    if rule.every is not None:
        triggered = matched % rule.every == 0
    else:
        triggered = rule.probability >= 1 or draw() < rule.probability
    if not triggered:
        return False, replace(counters, matched=matched)
    return True, Counters(matched, rule.burst - 1, counters.fired + 1)


def delay_seconds(latency: Latency, gauss: Callable[[], float]) -> float:
    """A latency effect's delay: fixed, or log-normal with median p50 and 99th percentile p99 (`gauss` draws a
    standard normal)."""
    if latency.seconds is not None:
        return latency.seconds
    p50, p99 = latency.p50 or 0.0, latency.p99 or 0.0  # the model requires both without `seconds`
    sigma = math.log(p99 / p50) / Z99
    return p50 * math.exp(sigma * gauss())


def decide(
    plan: FaultPlan,
    counters: dict[str, Counters],
    request: FaultRequest,
    elapsed: float,
    rng: random.Random,
) -> tuple[Decision, dict[str, Counters]]:
    """The decision for one request and every rule's counters after it (the rules read in order)."""
    counters = dict(counters)
    delays: tuple[tuple[str, float], ...] = ()
    for rule in plan.rules:
        if not in_window(rule, elapsed) or not matches(rule.match, rule.effect, request):
            continue
        fired, counters[rule.name] = fires(rule, counters.get(rule.name, Counters()), rng.random)
        if not fired:
            continue
        if isinstance(rule.effect, Latency):
            delays += ((rule.name, delay_seconds(rule.effect, lambda: rng.gauss(0.0, 1.0))),)
            continue
        return Decision(delays, rule), counters
    return Decision(delays), counters


@dataclass
class WatchCut:
    """A closeWatch fault's progress on one stream: events counted (bookmarks are not), the deadline it sets."""

    effect: CloseWatch | None
    events: int = 0

    def at_once(self) -> bool:
        return self.effect is not None and self.effect.after_events == 0

    def sent(self, kind: str) -> bool:
        """Count an event sent; whether the stream must end now."""
        if self.effect is None or self.effect.after_events is None or kind == "BOOKMARK":
            return False
        self.events += 1
        return self.events >= self.effect.after_events

    def deadline(self, now: float, deadline: float) -> tuple[float, bool]:
        """The watch's deadline with the fault's, and whether the fault's comes first."""
        if self.effect is None or self.effect.after_seconds is None:
            return deadline, False
        cut = now + self.effect.after_seconds
        return min(cut, deadline), cut < deadline


# ------------------------------------------------------------------------------------------------ answers


def _status_body(status: dict[str, object]) -> bytes:
    """A metav1.Status encoded as kube-apiserver's JSON serializer writes it: the fields in the Go struct's order
    (kind, apiVersion, metadata, status, message, reason, details, code) and a final newline (json.Encoder)."""
    return (json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, **status}) + "\n").encode()


def _pf_headers(throttle: Throttle) -> tuple[tuple[str, str], ...]:
    # k8s.io/apiserver v0.32.0 pkg/server/filters/priority-and-fairness.go setResponseHeaders: the UIDs (not the
    # names) of the matched PriorityLevelConfiguration and FlowSchema; header names from k8s.io/api v0.32.0
    # flowcontrol/v1/types.go (ResponseHeaderMatchedPriorityLevelConfigurationUID, ...FlowSchemaUID).
    return (
        ("X-Kubernetes-PF-PriorityLevel-UID", throttle.priority_level_uid),
        ("X-Kubernetes-PF-FlowSchema-UID", throttle.flow_schema_uid),
    )


def throttle_answer(throttle: Throttle) -> Answer:
    """A 429. `priorityAndFairness`: a request APF rejects (k8s.io/apiserver v0.32.0
    pkg/server/filters/priority-and-fairness.go Handle, `if !served` → setResponseHeaders, then tooManyRequests:
    `Retry-After` and Go's http.Error — a text/plain body "Too many requests, please try again later.", not a
    Status; client-go makes the TooManyRequests Status with details.retryAfterSeconds from the header).
    `storageInitializing`: a read served while the watch cache initialises (pkg/storage/cacher/cacher.go Watch and
    GetList: errors.NewTooManyRequests("storage is (re)initializing", 1)), written by responsewriters.ErrorNegotiated
    (pkg/endpoints/handlers/responsewriters/writers.go), which sets Retry-After from details.retryAfterSeconds; the
    request passed APF, so it carries the PF headers too."""
    retry = str(throttle.retry_after_seconds)
    if throttle.shape == "priorityAndFairness":
        headers = (
            *_pf_headers(throttle),
            ("Retry-After", retry),
            ("Content-Type", "text/plain; charset=utf-8"),
            ("X-Content-Type-Options", "nosniff"),
        )
        return Answer(429, headers, b"Too many requests, please try again later.\n")
    status = {
        "status": "Failure",
        "message": "storage is (re)initializing",
        "reason": "TooManyRequests",
        "details": {"retryAfterSeconds": throttle.retry_after_seconds},
        "code": 429,
    }
    return Answer(
        429,
        (*_pf_headers(throttle), ("Retry-After", retry), ("Content-Type", "application/json")),
        _status_body(status),
    )


def error_answer(error: ServerError) -> Answer:
    """A 500: k8s.io/apimachinery v0.32.0 pkg/api/errors/errors.go NewInternalError (reason InternalError, message
    "Internal error occurred: <cause>", the cause again in details.causes); the default cause is a real one,
    k8s.io/apiserver v0.32.0 pkg/admission/plugin/resourcequota/controller.go ("resource quota evaluation timed
    out"). A 503: NewServiceUnavailable (reason ServiceUnavailable); by default as k8s.io/apiserver v0.32.0
    pkg/server/filters/waitgroup.go waitGroupWriteRetryAfterToResponse answers during shutdown: "apiserver is
    shutting down", `Retry-After: 1`, X-Content-Type-Options nosniff."""
    headers: tuple[tuple[str, str], ...] = ()
    if error.code == 500:
        cause = error.message or "resource quota evaluation timed out"
        status: dict[str, object] = {
            "status": "Failure",
            "message": f"Internal error occurred: {cause}",
            "reason": "InternalError",
            "details": {"causes": [{"message": cause}]},
            "code": 500,
        }
        retry = error.retry_after_seconds or 0
    else:
        status = {
            "status": "Failure",
            "message": error.message or "apiserver is shutting down",
            "reason": "ServiceUnavailable",
            "code": 503,
        }
        retry = 1 if error.retry_after_seconds is None else error.retry_after_seconds
    if retry:
        headers += (("Retry-After", str(retry)),)
    headers += (("Content-Type", "application/json"), ("X-Content-Type-Options", "nosniff"))
    return Answer(error.code, headers, _status_body(status))


def expired_message(resource_version: int, revision: int) -> str:
    """The watch cache's refusal of a watch from a version older than it holds (k8s.io/apiserver v0.32.0
    pkg/storage/cacher/watch_cache.go getAllEventsSinceLocked: "too old resource version: %d (%d)", the second the
    version just before its oldest event); the fault pretends the cache holds nothing before `revision`."""
    oldest = max(revision, resource_version + 1)
    return f"too old resource version: {resource_version} ({oldest})"


# ------------------------------------------------------------------------------------------------ the shell's state


@dataclass
class FaultInjector:
    """The installed plan with its counters, random generator and records. `clock` gives seconds (monotonic)."""

    plan: FaultPlan = field(default_factory=FaultPlan)
    clock: Callable[[], float] = time.monotonic
    counters: dict[str, Counters] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=dict)
    records: deque[dict[str, str | float]] = field(default_factory=lambda: deque(maxlen=RECORDS_KEPT))
    installed_at: float = 0.0
    generation: int = 0
    """Plans installed so far: an open watch asks a plan installed after it began (`ApiServer._watch`)."""
    rng: random.Random = field(default_factory=random.Random)
    watch_rng: random.Random = field(default_factory=random.Random)
    """The generator of the watch rules asked for open watches (`decide_open_watch`)."""

    def __post_init__(self) -> None:
        self.install(self.plan)

    def install(self, plan: FaultPlan) -> None:
        """Replace the plan: counters, records and the window's start begin again, the generator from its seed."""
        self.plan, self.counters, self.served = plan, {}, {}
        self.records.clear()
        self.rng = random.Random(plan.seed)
        self.watch_rng = random.Random(plan.seed)
        self.installed_at = self.clock()
        self.generation += 1

    @property
    def active(self) -> bool:
        return bool(self.plan.rules)

    def elapsed(self) -> float:
        return self.clock() - self.installed_at

    def decide(self, request: FaultRequest) -> Decision:
        decision, self.counters = decide(self.plan, self.counters, request, self.elapsed(), self.rng)
        return decision

    def decide_open_watch(self, request: FaultRequest) -> Decision:
        """The decision for a watch already open when the plan was installed: only its closeWatch and expireWatch
        rules are asked, so the other rules' counters (matched, every, burst, limit) and the generator their
        chances draw from are as if the watch had not been asked; the watch rules draw from their own."""
        rules = tuple(r for r in self.plan.rules if isinstance(r.effect, CloseWatch | ExpireWatch))
        if not rules:
            return Decision()
        watch_plan = self.plan.model_copy(update={"rules": rules})
        decision, self.counters = decide(watch_plan, self.counters, request, self.elapsed(), self.watch_rng)
        return decision

    def record(self, rule: str, effect: str, request: FaultRequest, detail: str) -> None:
        """A fault served: counted per rule, and kept (the last `RECORDS_KEPT`) with its request and time."""
        self.served[rule] = self.served.get(rule, 0) + 1
        self.records.append(
            {
                "at": round(self.elapsed(), 6),
                "rule": rule,
                "effect": effect,
                "detail": detail,
                "verb": request.verb,
                "group": request.group,
                "resource": request.resource,
                "namespace": request.namespace,
                "name": request.name,
                "user": request.user,
                "userAgent": request.user_agent,
            }
        )

    def status(self) -> dict[str, object]:
        """`GET /_faults`: the plan, each rule's matched and served counts, and the recent records."""
        return {
            "plan": json.loads(plan_document(self.plan)),
            "elapsedSeconds": round(self.elapsed(), 6),
            "rules": [
                {
                    "name": rule.name,
                    "effect": rule.effect.type,
                    "matched": self.counters.get(rule.name, Counters()).matched,
                    "served": self.served.get(rule.name, 0),
                }
                for rule in self.plan.rules
            ],
            "served": sum(self.served.values()),
            "records": list(self.records),
        }
