"""First passes admitted a few at a time. Pure: the state is a value, each step returns the next one.

A pool's first pass (the daemon started, or its shard came back to this replica) reads everything the steady
passes no longer read: the namespace's pods, the mesh side, every Istio object (a GET each), the objects the pool
owns (a list per kind). When a replica starts, or takes over shards, a thousand pools would send all of that
at once, to an API server that may already be slow (and answers 429s once API Priority and Fairness queues are
full). So at most `limit` first passes run at a time, the others waiting their turn in the order they asked;
steady passes are not held (they keep the pools already running fresh, on the workers the first passes leave).
The shell is `sluice.runtime.wakeups.FirstPassGate`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Admission:
    limit: int
    """First passes running at most (`--first-passes`)."""
    running: frozenset[str] = frozenset()
    waiting: tuple[str, ...] = ()
    """Pools waiting their turn, first come first."""

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError(f"first passes at a time (--first-passes) must be at least 1, not {self.limit}")

    def ask(self, pool: str) -> tuple[Admission, bool]:
        """`pool` wants to begin its first pass: admitted now (True), or put in line."""
        if pool in self.running:
            return self, True
        if len(self.running) < self.limit and not self.waiting:
            return replace(self, running=self.running | {pool}), True
        if pool in self.waiting:
            return self, False
        return replace(self, waiting=(*self.waiting, pool)), False

    def done(self, pool: str) -> tuple[Admission, tuple[str, ...]]:
        """`pool`'s first pass ended (or it stopped waiting: deleted, stopped): the pools admitted in its place."""
        running = self.running - {pool}
        waiting = tuple(other for other in self.waiting if other != pool)
        admitted = waiting[: max(0, self.limit - len(running))]
        return Admission(self.limit, running | frozenset(admitted), waiting[len(admitted) :]), admitted
