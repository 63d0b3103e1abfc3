"""The routes sluice published, as the client's Envoy reads them: endpoints and weights, header routes, the revision
split, retries and mirrors.

Local-stack tool, used by the load generator (`sluice.devstack.traffic`). Read from the ServiceEntry (per-pod
weights, each endpoint's revision label) and the VirtualService (header routes in order, then the weighted route:
its split over revision subsets, its `retries`, its `mirrors`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, NamedTuple

import re2  # type: ignore[import-untyped]

from sluice.istio.objects import subset_name

Endpoint = tuple[str, str, int]
"""(pod, address, weight): the pod's name when the stack knows the address, else the address."""
Split = dict[str, int]
"""Weight per revision ("" : the whole pool, no subset)."""


@dataclass(frozen=True)
class RetryPolicy:
    """The VirtualService route's `retries`, as Envoy applies them."""

    attempts: int = 0
    retry_on: frozenset[str] = frozenset()
    ignore_previous_hosts: bool = True

    def retries(self, condition: str | None) -> bool:
        """Whether Envoy retries an attempt that failed so: its retryOn name, a status code listed (istiod's
        retriable_status_codes), or any 5xx, reset or connection failure under `5xx`."""
        if condition is None:
            return False
        if condition in self.retry_on:
            return True
        server_error = condition in ("gateway-error", "reset", "connect-failure", "refused-stream") or (
            condition.isdigit() and condition.startswith("5")
        )
        return "5xx" in self.retry_on and server_error

    @classmethod
    def of(cls, retries: dict[str, Any] | None) -> RetryPolicy:
        if not retries:
            return cls()
        return cls(
            attempts=int(retries.get("attempts", 0)),
            retry_on=frozenset(filter(None, str(retries.get("retryOn", "")).split(","))),
            ignore_previous_hosts=bool(retries.get("retryIgnorePreviousHosts", False)),
        )


@dataclass(frozen=True)
class MirrorRoute:
    """One of the VirtualService route's `mirrors`: the revision of its subset and the share of requests copied."""

    revision: str
    percent: float


def headers_match(headers: dict[str, str], conditions: dict[str, dict[str, str]]) -> bool:
    """Envoy's header matching for one Istio match entry: every condition holds (exact, prefix, or a regex that
    matches the whole value, RE2 as Envoy's safe_regex); a missing header matches none."""
    for name, condition in conditions.items():
        value = headers.get(name)
        if value is None:
            return False
        kind, wanted = next(iter(condition.items()))
        if kind == "exact" and value != wanted:
            return False
        if kind == "prefix" and not value.startswith(wanted):
            return False
        if kind == "regex" and re2.fullmatch(wanted, value) is None:
            return False
    return True


class PublishedRoutes(NamedTuple):
    split: Split
    """The weighted route's split (empty: no subsets, the whole pool)."""
    by_revision: dict[str, list[Endpoint]]
    """The ServiceEntry's endpoints per revision label."""
    matched: tuple[tuple[tuple[dict[str, dict[str, str]], ...], Split], ...]
    """The header routes ahead of the weighted one, in order: (their match entries, their split)."""
    retries: RetryPolicy
    mirrors: tuple[MirrorRoute, ...]


def read_routes(entry: dict[str, Any], service: dict[str, Any] | None, pods: dict[str, str]) -> PublishedRoutes:
    """The routes of a ServiceEntry and its VirtualService (`pods`: pod name by address)."""
    by_revision: dict[str, list[Endpoint]] = defaultdict(list)
    for endpoint in entry["spec"].get("endpoints", []):
        revision = endpoint.get("labels", {}).get("sluice.dev/revision", "")
        by_revision[revision].append(
            (
                pods.get(endpoint["address"], endpoint["address"]),
                endpoint["address"],
                int(endpoint.get("weight", 1)),
            )
        )
    revision_of = {subset_name(revision): revision for revision in by_revision if revision}

    def split_of(route: dict[str, Any]) -> Split:
        split: Split = {}
        for target in route.get("route", []):
            subset = target["destination"].get("subset")
            split[revision_of.get(subset, subset) if subset else ""] = int(target.get("weight", 100))
        return split

    http = (service or {}).get("spec", {}).get("http", [{}])
    # Envoy tries the routes in order: the first whose match holds (or that has none) takes the request.
    matched = tuple(
        (tuple(entry.get("headers") or {} for entry in route["match"]), split_of(route))
        for route in http
        if route.get("match")
    )
    http_route: dict[str, Any] = next((route for route in http if not route.get("match")), {})
    mirrors = tuple(
        MirrorRoute(
            revision_of.get(mirror["destination"].get("subset", ""), ""),
            float(mirror.get("percentage", {}).get("value", 100.0)),
        )
        for mirror in http_route.get("mirrors", [])
    )
    return PublishedRoutes(
        split_of(http_route), dict(by_revision), matched, RetryPolicy.of(http_route.get("retries")), mirrors
    )
