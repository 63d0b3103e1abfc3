"""The shared answers' policy: which answer a pass reads, when a query is asked again, when it is let go.

One answer per query (`QueryKey`: URL, credentials, timeout, pod label, PromQL) serves every pass that reads
it. `SharedAnswers` keeps them and decides: a query is asked once however many passes need it (single flight),
again ahead of the passes that will read it (`REFRESH_AFTER`, or `LEAD` before a lone reader's next pass), no
more once nobody read it for `WANTED_FOR` intervals; a failing query is asked again once per backoff (doubling
up to two intervals, `LONGEST_BACKOFF`; one interval while its connection is refused) while passes read the last good
answer within their `staleAfter`; a scoped query asks for the pods of every pool that read it and waits
`EXTEND_GAP` before taking in pods it was not asked for
(the records, the constants and the timing of one query are `sluice.io.promrecords`').
No thread, no clock, no I/O here: the adapter (`sluice.io.prometheus.PromIO`) holds the lock, passes the time
its clock reads (`at`, monotonic seconds; `now`, the pass's datetime), runs what `send` is handed and records
the answer (`answered`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Callable, Collection
from concurrent.futures import Future
from datetime import datetime, timedelta
from typing import NamedTuple

from sluice.io.promrecords import (
    KEPT_FOR,
    REFRESH_AFTER,
    WANTED_FOR,
    Answer,
    Backoff,
    QueryKey,
    Reading,
    Send,
    Wanted,
    backoff_wait,
    due_at,
    extension_gap,
)

log = logging.getLogger("sluice")


class _Due(NamedTuple):
    """When the refresher looks at a query next (or sends the extension waiting for it, `extension`)."""

    at: float
    order: int
    """Breaks ties in the heap, so entries never compare their keys."""
    key: QueryKey
    extension: bool


class SharedAnswers:
    """The answers per query and the decisions over them (not thread-safe: the adapter holds its lock for every
    call, and `send` and `wake` are called with it held).

    `send` asks a query (the adapter runs it and hands the answer to `answered`); `wake` wakes the refresher,
    called when a query comes due before the refresher's next wake-up; `owned` lists the pods of the pools the
    process runs in a namespace (scoped queries ask for them too).
    """

    def __init__(
        self,
        send: Callable[[Send], None],
        wake: Callable[[], None],
        owned: Callable[[str], Collection[str]] | None = None,
        unreached: Callable[[BaseException], bool] = lambda _: False,
    ) -> None:
        self._send_to = send
        self._unreached = unreached
        """Whether a failure never reached Prometheus (a refused connection): its backoff does not double."""
        self._wake = wake
        self._owned = owned
        self.answers: dict[QueryKey, Answer] = {}
        """The newest completed answer per query."""
        self.wanted: dict[QueryKey, Wanted] = {}
        """Queries passes read, for the refresher."""
        self._pending: dict[QueryKey, Answer] = {}
        """The query being asked, per query."""
        self._good: dict[QueryKey, Answer] = {}
        """The newest successful answer per query (what passes fall back on while it fails)."""
        self._backoff: dict[QueryKey, Backoff] = {}
        """Queries whose last answer failed: not asked again before `retry_at`."""
        self._next: dict[QueryKey, Answer] = {}
        """Scoped queries to be asked again for pods their answers were not asked for, not sent yet (`_extend`)."""
        self._sent_at: dict[QueryKey, float] = {}
        """When each query was last sent (monotonic)."""
        self._owned_at: dict[str, tuple[float, frozenset[str]]] = {}
        """Namespace -> (when, the pods of the pools run here), for `_owned_pods`."""
        self._due: list[_Due] = []
        """A heap: when the refresher looks at each query next (entries may be stale: checked when they come up)."""
        self._order = itertools.count()
        self.next_wake = math.inf
        """When the refresher wakes next (monotonic)."""

    def in_flight(self) -> int:
        """Queries sent and not answered yet."""
        return len(self._pending)

    def read(self, reading: Reading, now: datetime, at: float) -> Answer:
        """The answer a pass reads now (it waits for it if it is not done).

        A scoped reading (`pods`) is served only by an answer asked for all of its pods; without one the query is
        asked now for every pod set read within `WANTED_FOR`, and the pass waits for it.

        The newest answer serves while it is younger than `REFRESH_AFTER` of the reader's interval (`ttl`); an
        older one is asked again now if the refresher has not yet (once; after a failure, not before its
        backoff) and serves meanwhile if it succeeded within `stale_after`. While the query fails, the last good
        answer serves if it was asked within `stale_after`, else the failure does. A pass waits only when there
        is no answer at all. Every answer carries the time it was asked, so reusing one never makes old data
        look new.
        """
        self._note_read(reading, now, at)
        key, ttl, stale_after, pods = reading.key, reading.ttl, reading.stale_after, reading.pods
        answer, backoff = self.answers.get(key), self._backoff.get(key)
        if answer is not None and backoff is None and not answer.serves(pods):
            # asked for other pods: wait for a query asked for these too
            pending = self._pending.get(key)
            return pending if pending is not None and pending.serves(pods) else self._extend(key, now, at)
        if answer is not None and backoff is None and at - answer.monotonic < REFRESH_AFTER * ttl:
            return answer
        may_ask = backoff is None or at >= backoff.retry_at
        pending = self._ask(key, now, at, pods) if may_ask else self._pending.get(key)
        if backoff is not None and answer is not None:  # the last answer failed
            good = self.last_good(key, stale_after, pods, at)
            return good if good is not None else answer
        if answer is not None and at - answer.monotonic <= stale_after:
            return answer
        assert pending is not None  # no answer to use: one is being asked
        return pending

    def _note_read(self, reading: Reading, now: datetime, at: float) -> None:
        """Record that a pass read the query (at its interval, for its pods): the refresher's pace and scope."""
        key, ttl, pods = reading.key, reading.ttl, reading.pods
        wanted = self.wanted.get(key)
        readers = {t: seen for t, seen in (wanted.readers if wanted else {}).items() if at - seen <= WANTED_FOR * t}
        readers[ttl] = at
        before = wanted.read_at if wanted is not None else None
        scope = None
        if pods is not None:
            # the same dict, updated in place: pruned when the query is sent (`Wanted.prune`)
            scope = wanted.scope if wanted is not None and wanted.scope is not None else {}
            scope[pods] = (at, ttl)
        self.wanted[key] = Wanted(reading.fetch, min(readers), readers, now, at, before, scope, reading.namespace)
        if wanted is None:
            self._schedule(key, self._due_at(key, at))

    def last_good(self, key: QueryKey, stale_after: float, pods: frozenset[str] | None, at: float) -> Answer | None:
        """The newest successful answer to `key` if it was asked within `stale_after` seconds (for `pods`)."""
        good = self._good.get(key)
        if good is None or not good.serves(pods):
            return None
        return good if at - good.monotonic <= stale_after else None

    def answered(self, key: QueryKey, answer: Answer, ttl: float, at: float) -> None:
        """Record `answer` (done) as the newest to `key`: a success ends the backoff, a failure extends it; the
        query comes due again, and an extension waiting for it is sent (or scheduled)."""
        self.answers[key] = answer  # the newest: one query per key is in flight at a time
        if self._pending.get(key) is answer:
            del self._pending[key]
        if answer.done.exception() is None:
            self._good[key] = answer
            self._backoff.pop(key, None)
        else:
            failed = answer.done.exception()
            failures = self._backoff[key].failures + 1 if key in self._backoff else 1
            if failed is not None and self._unreached(failed):
                failures = 1  # Prometheus was not asked: one interval, as after a first failure
            self._backoff[key] = Backoff(failures, at + backoff_wait(failures, ttl))
        if key in self.wanted:
            self._schedule(key, self._due_at(key, at))
        if key in self._next and key not in self._pending:  # pods waited for while this was in flight
            self._schedule_extension(key, at)

    def refresh(self, at: float) -> float:
        """Ask each query due by `at` again (and send the extensions due), let go of those nobody read within
        `WANTED_FOR` of their interval; when to look again.

        The queries due come off a heap, so one wake-up costs a few queries' work, not a walk over every query
        (8 per namespace): with a walk, a thousand namespaces' answers made the refresher hold the lock passes
        need for milliseconds at each of thousands of wake-ups a second.
        """
        while self._due and self._due[0].at <= at:
            due = heapq.heappop(self._due)
            key = due.key
            if due.extension:
                self._send_extension(key, at)
                continue
            wanted = self.wanted.get(key)
            if wanted is None or key in self._pending:
                continue  # not read any more, or being asked: its answer schedules it again
            if at - wanted.read_at > WANTED_FOR * wanted.ttl:
                del self.wanted[key]
                continue
            when = self._due_at(key, at)
            if when > at:
                heapq.heappush(self._due, _Due(when, next(self._order), key, False))  # a stale entry
                continue
            self._ask(key, wanted.read_now + timedelta(seconds=at - wanted.read_at), at)
        self.next_wake = min(self._due[0].at, at + 1.0) if self._due else at + 1.0
        return self.next_wake

    def _send_extension(self, key: QueryKey, at: float) -> None:
        if key in self._pending or key not in self._next:
            return  # in flight again (it is scheduled when that answers), or already sent
        extension = self._next.pop(key)
        if key in self.wanted:
            self._send(key, extension, at)
        else:  # never the case: a pass asked for it just now
            extension.done.set_exception(OSError("the query is no longer read"))

    def forget_old(self, at: float) -> None:
        """Drop the answers (and their backoff) and sending times older than `KEPT_FOR`."""
        for key in [k for k, a in self.answers.items() if a.done.done() and at - a.monotonic > KEPT_FOR]:
            del self.answers[key]
            self._backoff.pop(key, None)
        for key in [k for k, a in self._good.items() if at - a.monotonic > KEPT_FOR]:
            del self._good[key]
        for key in [k for k, sent in self._sent_at.items() if at - sent > KEPT_FOR]:
            del self._sent_at[key]

    def _ask(self, key: QueryKey, now: datetime, at: float, pods: frozenset[str] | None = None) -> Answer:
        """The query being asked for `key`, starting it if none is. A scoped query asks for the union of the pod
        sets passes read it for; if the one being asked does not include `pods`, the pass waits for the next
        (`_extend`)."""
        pending = self._pending.get(key)
        if pending is not None and not pending.serves(pods):
            return self._extend(key, now, at)
        if pending is None:
            # an extension waiting to be sent is this query: its passes get this answer
            pending = self._next.pop(key, None) or Answer(now, at, Future())
            self._send(key, pending, at)
        return pending

    def _send(self, key: QueryKey, answer: Answer, at: float) -> None:
        """Ask `key` now for `answer`, for the pods wanted now."""
        wanted = self.wanted[key]
        wanted.prune(at)
        covers = wanted.pods()
        if covers is not None and self._owned is not None:
            covers = covers | self._owned_pods(wanted.namespace, at)
        answer.monotonic, answer.covers = at, covers
        self._pending[key] = answer
        self._sent_at[key] = at
        self._send_to(Send(key, answer, wanted.fetch, answer.covers, wanted.ttl))

    def _owned_pods(self, namespace: str, at: float) -> frozenset[str]:
        """The pods of the pools this process runs in `namespace`, asked at most once a second (the eight queries
        of a namespace are sent together); if asking fails, none (the pod sets passes read still count)."""
        known = self._owned_at.get(namespace)
        if known is not None and at - known[0] < 1.0:
            return known[1]
        assert self._owned is not None
        try:
            pods = frozenset(self._owned(namespace))
        except Exception:  # never the refresher's end: the read pod sets are still asked for
            log.exception("listing the pods of the pools run here failed")
            pods = frozenset()
        self._owned_at[namespace] = (at, pods)
        return pods

    def _extend(self, key: QueryKey, now: datetime, at: float) -> Answer:
        """The next scoped query for `key`, asked for every pod set read by then: sent when the query in flight
        (if any) has answered, and at least `EXTEND_GAP` (or twice the last answer's time) after the last one was
        sent, so one query per key is in flight at a time and passes that come meanwhile for pods not asked for
        yet wait for the same one."""
        extension = self._next.get(key)
        if extension is None:
            extension = self._next[key] = Answer(now, at, Future())
            if key not in self._pending:  # else `answered` schedules it when the query in flight answers
                self._schedule_extension(key, at)
        return extension

    def _schedule_extension(self, key: QueryKey, at: float) -> None:
        """Send the waiting extension of `key` now or when its gap is over."""
        start = self._sent_at.get(key, -math.inf) + extension_gap(self.answers.get(key))
        if start <= at:
            self._send(key, self._next.pop(key), at)
        else:
            heapq.heappush(self._due, _Due(start, next(self._order), key, True))
            if start < self.next_wake:
                self._wake()

    def _due_at(self, key: QueryKey, at: float) -> float:
        return due_at(self._backoff.get(key), self.answers.get(key), self.wanted.get(key), at)

    def _schedule(self, key: QueryKey, due: float) -> None:
        """Look at `key` again at `due`, waking the refresher only if that is before its next wake-up."""
        heapq.heappush(self._due, _Due(due, next(self._order), key, False))
        if due < self.next_wake:
            self._wake()


__all__ = ["SharedAnswers"]
