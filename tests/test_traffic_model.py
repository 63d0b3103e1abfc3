"""The local stack's load generator decides as Envoy does: which route a request takes, and what is retried.

Envoy's semantics followed here: header matchers (exact, prefix, safe_regex as a whole-value RE2 match; a missing
header matches nothing), and retry_on (`5xx` covers any 5xx answer plus resets and refused connections;
`retriable-status-codes` only the codes listed; `gateway-error` only 502/503/504).
"""

from __future__ import annotations

import asyncio

from sluice.devstack.routes import RetryPolicy, headers_match
from sluice.devstack.traffic import Traffic


def test_header_conditions_match_as_envoy_does():
    conditions = {"x-team": {"prefix": "ml-"}, "x-tester": {"exact": "yes"}}
    assert headers_match({"x-team": "ml-infra", "x-tester": "yes"}, conditions)
    assert not headers_match({"x-team": "ml-infra"}, conditions)  # every condition must hold
    assert not headers_match({"x-team": "web", "x-tester": "yes"}, conditions)
    whole = {"x-user-id": {"regex": "[0-7][0-9a-f]"}}
    assert headers_match({"x-user-id": "7f"}, whole)
    assert not headers_match({"x-user-id": "a7f"}, whole)  # the regex must match the whole value


def test_what_each_retry_on_retries():
    default = RetryPolicy.of({"attempts": 2, "retryOn": "connect-failure,refused-stream,reset,gateway-error"})
    assert default.retries("gateway-error")
    assert default.retries("reset")
    assert not default.retries("500")
    assert not default.retries(None)  # failed after the answer started: never retried
    five = RetryPolicy.of({"attempts": 2, "retryOn": "5xx"})
    assert five.retries("500")
    assert five.retries("gateway-error")
    assert five.retries("connect-failure")
    assert not five.retries("429")
    codes = RetryPolicy.of({"attempts": 2, "retryOn": "reset,500"})
    assert codes.retries("500")
    assert not codes.retries("503")


def test_with_istiod_down_the_load_keeps_the_routes_it_last_read() -> None:
    """`Traffic.pushes` False: the route reads stop (the proxies keep the last configuration pushed), each skipped
    read counted; True again: they resume."""
    reads: list[bool] = []

    class Counted(Traffic):
        def refresh_routes(self) -> None:
            reads.append(self.pushes)

    async def run(pushes: bool, seconds: float) -> Counted:
        traffic = Counted(stack=None, pool="llama", pushes=pushes)  # type: ignore[arg-type]
        task = asyncio.create_task(traffic._refresh_loop())
        await asyncio.sleep(seconds)
        task.cancel()
        return traffic

    down = asyncio.run(run(False, 1.2))
    assert reads == []
    assert down.withheld >= 2
    up = asyncio.run(run(True, 1.2))
    assert len(reads) >= 2
    assert all(reads)
    assert up.withheld == 0
