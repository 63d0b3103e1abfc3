"""The records of the shared Prometheus answers and the pure decisions about one query (no thread, no clock).

`QueryKey` names a shared query (URL, credentials, timeout, pod label, PromQL); an `Answer` is one asking of it
and says which readers it serves; `Wanted` keeps who read it and at what pace; `Backoff` a run of failures;
`Reading` is one pass's read, `Send` one query to ask. `due_at`, `backoff_wait` and `extension_gap` say when a
query is asked again. `sluice.io.promshare.SharedAnswers` keeps them per query.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

from sluice.io.ports import PromAuth

LONGEST_BACKOFF = 2.0
"""The longest wait before a failing shared query is asked again, in intervals (it doubles from one), and never
longer than `LONGEST_BACKOFF_SECONDS` unless one interval is: every other interval is a quarter of a healthy
query's pace (asked again at `REFRESH_AFTER`), and once Prometheus answers again the query is asked within two
intervals of its last failed try. Doubling up to 60 s kept a pool blind for 6 intervals after the chaos matrix's
20 s of Prometheus errors (prom-error, docs/chaos-report.md), against the target of two. The price: a Prometheus
that fails because it is overloaded (queries timing out) is asked again every other interval, not every minute."""
LONGEST_BACKOFF_SECONDS = 60.0

REFRESH_AFTER = 0.5
"""Share of the asking pool's interval after which a shared answer is asked again, ahead of the passes that will
read it: about two queries per (namespace, URL, signal) per interval and, while a query takes less than half an
interval, a pool's next pass (one interval on) reads an answer asked since its previous pass. A query with a
single reader is asked once per interval instead, just before that reader's next pass (`LEAD`)."""
LEAD = 0.2
"""A query read by one pool alone, once per interval, is asked again this share of the interval (or twice its
last answer's time, if longer) before that pool's next pass is due: one query per signal per interval, and the
pass reads an answer a fifth of an interval old instead of up to half of one."""
LONE_GAP = 0.9
"""A query has a single reader when one pool interval reads it, its last two reads at least this share of the
interval apart (a pool's passes are one interval apart; a second pool, or a wake-up, reads in between)."""
WANTED_FOR = 2.0
"""Intervals a query keeps being refreshed after the last pass that read it (a deleted pool's queries stop)."""
EXTEND_GAP = 0.5
"""Seconds at least between two queries asked to take in pods a scoped answer was not asked for (or twice the
query's last answer time, if longer): the pools a replica starts or takes over within that time wait for one
query, not one each, and a slow Prometheus is not asked faster than it answers."""
KEPT_FOR = 600.0
"""Seconds an answer (and a query's last sending time) is kept after it was asked (`SharedAnswers.forget_old`)."""


class QueryKey(NamedTuple):
    """One shared query: the pools that render the same PromQL for the same Prometheus, credentials, timeout and
    pod label read the same answer (never one fetched with another pool's credentials)."""

    url: str
    auth: PromAuth
    timeout: float
    pod_label: str
    query: str


Fetch = Callable[[frozenset[str] | None], dict[str, float]]
"""Asks one query: for the given pods (scoped), or namespace-wide (None); its answer split by pod."""


@dataclass
class Answer:
    """One query's answer, split by pod, shared by the pools that render the same query."""

    asked_at: datetime
    """The `now` of the pass that asked (the time its pools' signals are from)."""
    monotonic: float
    done: Future[dict[str, float]]
    """Pod -> value (`pod_values`)."""
    took: float = 0.0
    """Seconds from asking to the answer (set when it is done)."""
    covers: frozenset[str] | None = None
    """The pods it was asked for (scoped queries); None: every pod of the namespace."""

    def serves(self, pods: frozenset[str] | None) -> bool:
        """Whether it was asked for every pod in `pods` (None: a namespace-wide reader, served by anything)."""
        return pods is None or self.covers is None or pods <= self.covers


@dataclass
class Backoff:
    """A shared query's run of failures: when it may be asked again."""

    failures: int
    retry_at: float


@dataclass
class Wanted:
    """A query some pass read: how to ask it again, and when it was last read."""

    fetch: Fetch
    ttl: float
    """The shortest interval among the pools that read it recently (`readers`)."""
    readers: dict[float, float]
    """Interval -> when a pool with that interval last read it (monotonic): a deleted 1 s pool stops
    setting the pace once it has not read for `WANTED_FOR` of its interval."""
    read_now: datetime
    """The `now` of the last pass that read it; with `read_at`, what the refresher's asking time maps to."""
    read_at: float
    read_before: float | None = None
    """The read before the last one (monotonic): with `readers`, whether one pool alone reads it (`LONE_GAP`)."""
    scope: dict[frozenset[str], tuple[float, float]] | None = None
    """Scoped queries: each pod set a pass read it for -> (when, that pool's interval); the query asks for their
    union (with the pods of every pool the process runs, `PromIO(owned=...)`), a set kept while read within
    `WANTED_FOR` of its interval. None: namespace-wide."""
    namespace: str = ""

    def pods(self) -> frozenset[str] | None:
        """The pods to ask for now (None: namespace-wide)."""
        return None if self.scope is None else frozenset().union(*self.scope)

    def prune(self, at: float) -> None:
        """Forget the pod sets not read within `WANTED_FOR` of their interval (a pool gone, or a pod set that
        changed): a replica stops asking for the pods of pools it no longer runs."""
        if self.scope is not None:
            self.scope = {p: seen for p, seen in self.scope.items() if at - seen[0] <= WANTED_FOR * seen[1]}

    @property
    def lone(self) -> bool:
        return (
            len(self.readers) == 1
            and self.read_before is not None
            and self.read_at - self.read_before >= LONE_GAP * self.ttl
        )


@dataclass(frozen=True)
class Reading:
    """One query a pass reads: how to ask it, the reader's interval (`ttl`) and staleness, its pods."""

    key: QueryKey
    fetch: Fetch
    ttl: float
    stale_after: float
    pods: frozenset[str] | None = None
    """A scoped reading: the pool's pods (None: namespace-wide)."""
    namespace: str = ""


@dataclass(frozen=True)
class Send:
    """A query to ask now, for `pods` (None: namespace-wide), its answer going to `answer`."""

    key: QueryKey
    answer: Answer
    fetch: Fetch
    pods: frozenset[str] | None
    ttl: float


def backoff_wait(failures: int, ttl: float) -> float:
    """Seconds before a query that failed `failures` times in a row is asked again: one interval, doubling with
    each further failure up to `LONGEST_BACKOFF` intervals or `LONGEST_BACKOFF_SECONDS`, whichever is shorter
    (but never under one interval)."""
    return min(ttl * 2.0 ** (failures - 1), ttl * LONGEST_BACKOFF, max(ttl, LONGEST_BACKOFF_SECONDS))


def due_at(backoff: Backoff | None, answer: Answer | None, wanted: Wanted | None, at: float) -> float:
    """When a query is to be asked again: at its backoff's end, or `REFRESH_AFTER` of its interval after its
    answer was asked (`at`, without one) — for a query one pool alone reads, not before `LEAD` ahead of that
    pool's next pass."""
    if backoff is not None:
        return backoff.retry_at
    if answer is None or wanted is None:
        return at
    due = answer.monotonic + REFRESH_AFTER * wanted.ttl
    if wanted.lone:
        lead = max(LEAD * wanted.ttl, 2.0 * answer.took)
        due = max(due, wanted.read_at + wanted.ttl - lead)
    return due


def extension_gap(last: Answer | None) -> float:
    """Seconds at least between sending a scoped query and sending its extension (`EXTEND_GAP`)."""
    return max(EXTEND_GAP, 2.0 * last.took if last is not None else 0.0)


__all__ = [
    "EXTEND_GAP",
    "KEPT_FOR",
    "LEAD",
    "LONE_GAP",
    "LONGEST_BACKOFF",
    "LONGEST_BACKOFF_SECONDS",
    "REFRESH_AFTER",
    "WANTED_FOR",
    "Answer",
    "Backoff",
    "Fetch",
    "QueryKey",
    "Reading",
    "Send",
    "Wanted",
    "backoff_wait",
    "due_at",
    "extension_gap",
]
