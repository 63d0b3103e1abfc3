"""One shard Lease renewal, sent again within the Lease's validity. Called by `sluice.runtime.sharding.ShardLeases`
from the lease thread.

Each send waits a short timeout for its answer (`RENEW_TIMEOUT`: client-go's leader election retries a renewal
every RetryPeriod, 2 s by default, until its RenewDeadline: k8s.io/client-go `tools/leaderelection/leaderelection.go`,
`renew`, at commit 32ce75a7), and a send that got a 429, a 5xx or no answer is sent again as
`sluice.core.apiretry.next_try` decides, never past what is left of the shard's validity (`Tenures.left`): a
renewal is of no use once the validity is over, the shard must then be taken back in a new term.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator

from kubernetes.client.exceptions import ApiException

from sluice.io.kubereads import Retrying, send
from sluice.runtime.fence import Tenures

log = logging.getLogger("sluice.sharding")
RENEW_TIMEOUT = 2.0


class Lapsed(Exception):
    """The shard's validity ended before the renewal could be sent (again)."""


@contextlib.contextmanager
def _validity(tenures: Tenures, index: int) -> Iterator[float]:
    left = tenures.left(index)
    if left <= 0:
        raise Lapsed(index)
    yield left


def renew(
    write: Callable[[float], object],
    tenures: Tenures,
    index: int,
    retrying: Retrying,
    timeout: float = RENEW_TIMEOUT,
    after: ApiException | None = None,
) -> float | None:
    """`write(timeout)` sent, and sent again while `send` says so within the shard's validity. Returns when the
    send that succeeded was sent (the new validity counts from it), or None when a send after an earlier one met a
    409: the earlier one may have landed without its answer reaching here, so the Lease may well be this
    replica's; the list of the same round tells (its holder, its resourceVersion). Raises `Lapsed`, or the last
    `ApiException` when the renewal is not sent again. `after`: what its first send met (a renewal sent again
    after every shard's first send)."""
    sends: list[float] = [] if after is None else [retrying.clock()]

    def once(left: float | None) -> object:
        sends.append(retrying.clock())
        return write(min(timeout, timeout if left is None else left))

    try:
        send(once, retrying, functools.partial(_validity, tenures, index), after)
    except ApiException as failure:
        if failure.status != 409 or len(sends) < 2:
            raise
        log.warning("shard %d: a renewal sent again met a 409; the list tells whose the Lease is", index)
        return None
    return sends[-1]
