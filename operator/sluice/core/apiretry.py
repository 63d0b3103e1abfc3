"""Whether a failed Kubernetes request is sent again, and after how long. Pure: no clock, no randomness (the
random draw is an argument), no I/O.

Shaped on what the API server says and what client-go does with it:
- kube-apiserver under load answers 429 with `Retry-After` in whole seconds: API Priority and Fairness rejects a
  request before it runs, with a Retry-After of 1 s doubled under sustained drops up to 32 s
  (kubernetes/kubernetes `staging/src/k8s.io/apiserver/pkg/util/flowcontrol/dropped_requests_tracker.go`,
  `maxRetryAfter = 32`; `pkg/server/filters/priority-and-fairness.go`, `tooManyRequests`);
- client-go sends a request again on a 429 or any 5xx that carries `Retry-After`, after that many seconds, at most
  10 times (k8s.io/client-go `rest/request.go`: `maxRetries: 10`, `retryAfterSeconds`; `rest/with_retry.go`:
  `checkWait`, `IsNextRetry`; read at commit 32ce75a7, 2026-07-24), and a GET that lost its connection as if it
  had `Retry-After: 1`; the official Python client (kubernetes 37.0.2) does the same only for GET and HEAD, and
  only when `client_go_retries` is set (`kubernetes/client/rest.py`, `kubernetes/utils/retry.py`); its default
  leaves retries to urllib3 (2.8.0 `Retry(3)`: a 413/429/503 with Retry-After slept for as long as it says, up to
  six hours, for GET, PUT and DELETE; never for PATCH or POST).
sluice decides here instead, for every verb it sends (reads, server-side apply, Events, Leases), so that a wait is
bounded by the time the caller has left: a pass's budget, or for a fenced write the Lease's remaining validity (a
fenced write is never sent after it). A 429 waits its Retry-After (never less: the server asked for it), 5xx and
requests that got no answer back off exponentially with jitter (apimachinery's `wait.Backoff`: duration x factor
per step, capped, plus up to `jitter` x the delay), a 5xx's Retry-After taken when it is longer. Anything else
(400, 403, 404, 409, 422, ...) is not sent again: it would be answered the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Reason = Literal["throttled", "server_error", "no_answer"]
"""Why a request is sent again: a 429, a 5xx, or no answer at all (a timeout, a reset connection)."""


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 10
    """Sends after the first, as client-go's `rest.Request` (`maxRetries: 10`)."""
    max_retry_after: float = 32.0
    """The longest Retry-After waited for: API Priority and Fairness never asks for more (`maxRetryAfter`)."""
    backoff: float = 0.2
    """The first back-off (seconds) after a 5xx or no answer."""
    factor: float = 2.0
    cap: float = 1.0
    """The longest back-off before its jitter: client-go's pace for a request that got no answer (a GET that lost
    its connection is sent again as if answered `Retry-After: 1`, `rest/request.go`). A longer cap outlasts the
    fault it waits out: cut off from the API for 20 s at a 2 s interval, a pass waiting 5 s (7.5 s with jitter)
    resumed 7.1 s after the API answered again (3.5 intervals; docs/faults.md). At 1 s a replica's workers send no
    more than one request each per second or so while the API fails them, fewer than a healthy pass sends."""
    jitter: float = 0.5
    """Up to this fraction of the back-off added, from the draw (replicas failing together do not resend together)."""
    backs_off: bool = True
    """False: only a 429 with its Retry-After is sent again (the server said when), not a 5xx or a request without
    an answer: for the costly lists (a namespace's pods) that the next pass sends anyway."""

    def __post_init__(self) -> None:
        for name in ("max_retries", "max_retry_after", "backoff", "factor", "cap", "jitter"):
            if getattr(self, name) < 0:
                raise ValueError(f"RetryPolicy.{name} must not be negative")


@dataclass(frozen=True)
class Failure:
    """What a request got instead of an answer it could use."""

    status: int
    """The HTTP status; 0: no answer (a timeout, a refused or reset connection)."""
    retry_after: float | None = None
    """The answer's `Retry-After` in seconds (whole seconds, as client-go reads it); None: absent or unreadable."""


@dataclass(frozen=True)
class Wait:
    seconds: float
    reason: Reason


@dataclass(frozen=True)
class GiveUp:
    why: str


def reason_of(failure: Failure) -> Reason | None:
    """Why the request may be sent again; None: it may not (the answer would be the same)."""
    if failure.status == 429:
        return "throttled"
    if failure.status >= 500:
        return "server_error"
    if failure.status == 0:
        return "no_answer"
    return None


def backoff(policy: RetryPolicy, retry: int, draw: float) -> float:
    """The back-off before send number `retry` + 1 (`retry` >= 1), with `draw` in [0, 1) as its jitter."""
    base = min(policy.cap, policy.backoff * policy.factor ** (retry - 1))
    return base + draw * policy.jitter * base


TROUBLES = ("no_answer", "server_error", "throttled", "slow")
"""What a pass's requests to the API server can meet, worst first: no answer, a 5xx, a 429, or slow answers (one
past `SLOW_ANSWER`, or all of them together past the pool's interval)."""
Trouble = Literal["no_answer", "server_error", "throttled", "slow"]
HOLD_INTERVALS = 3.0
"""An episode of API trouble ends after this many intervals without any (`next_episode`): a fault that fails one
request in twenty is one episode, not a condition flipping at every other pass (each flip a status write, sent
to an API server already in trouble)."""


@dataclass(frozen=True)
class Episode:
    """API trouble a pool's passes met: since when, what kinds, and when last."""

    troubles: frozenset[Trouble]
    last: float
    """When the last pass that met any trouble ran (Unix seconds: the pass's time)."""


SLOW_ANSWER = 1.0
"""Seconds past which one answer is slow: Kubernetes' API call latency SLO for single-object calls (99th
percentile <= 1 s; kubernetes/community `sig-scalability/slos/api_call_latency.md`; a namespace's LIST is allowed
5 s there, but a pool's pods answering past 1 s is slow all the same)."""


def troubles(
    met: Mapping[Reason, int], waited_for_answers: float, slowest: float, interval: float
) -> frozenset[Trouble]:
    """What one pass met: the failures its requests met (sent again or not); `slow` when one answer took longer
    than `SLOW_ANSWER`, or waiting for the API server (answers and back-offs) longer than the pool's interval."""
    found: set[Trouble] = {reason for reason, n in met.items() if n > 0}
    if slowest > SLOW_ANSWER or waited_for_answers > interval:
        found.add("slow")
    return frozenset(found)


def next_episode(episode: Episode | None, met: frozenset[Trouble], at: float, interval: float) -> Episode | None:
    """The episode after a pass at `at` that met `met`: a new one, the same one grown, or none once
    `HOLD_INTERVALS` intervals passed without trouble."""
    if met:
        return Episode(met if episode is None else episode.troubles | met, at)
    if episode is not None and at - episode.last < HOLD_INTERVALS * interval:
        return episode
    return None


def next_try(failure: Failure, retries: int, left: float, draw: float, policy: RetryPolicy) -> Wait | GiveUp:
    """After a failed send: wait and send again, or give up. `retries`: sends after the first so far; `left`:
    seconds until the caller's deadline (a pass's budget, or the Lease's validity for a fenced write), which the
    next send must start before; `draw`: a uniform number in [0, 1) for the jitter."""
    reason = reason_of(failure)
    if reason is None:
        return GiveUp(f"{failure.status} is not retried")
    if not policy.backs_off and (reason != "throttled" or failure.retry_after is None):
        return GiveUp(f"{failure.status} is sent again at the next pass")
    if retries >= policy.max_retries:
        return GiveUp(f"{retries} retries")
    after = failure.retry_after
    if reason == "throttled" and after is not None:
        seconds = after
    else:
        seconds = backoff(policy, retries + 1, draw)
        if after is not None:
            seconds = max(seconds, after)
    if after is not None and after > policy.max_retry_after:
        return GiveUp(f"Retry-After {after:g} s is over {policy.max_retry_after:g} s")
    if seconds >= left:
        return GiveUp(f"a wait of {seconds:.2f} s would end past the deadline ({max(left, 0.0):.2f} s left)")
    return Wait(seconds, reason)
