"""The VirtualService: clients of the Kubernetes Service are split across the revisions' subsets (or sent whole
to the pool), after the testers' header route and the A/B test's route to the candidate, with the shadow
canary's request mirror and the retry policy on each. Pure.

`route_targets` and `mirror` say the split and the mirror once: the EnvoyFilter route patch
(`sluice.istio.envoyfilters`) renders the same ones in Envoy's terms.
"""

from __future__ import annotations

from sluice.api.durations import format_duration
from sluice.api.jsontypes import JsonObject, JsonValue
from sluice.api.v1alpha1 import InferencePoolSpec
from sluice.core.abtest import key_match
from sluice.core.reconcile import Plan
from sluice.istio.kinds import VIRTUAL_SERVICE
from sluice.istio.objects import (
    PoolRef,
    destination_host,
    destination_port,
    istio_object,
    service_host,
    subset_name,
)
from sluice.istio.rendered import Rendered

ROUTE_NAME = "sluice-weights"
MATCH_ROUTE_NAME = "sluice-match"
AB_ROUTE_NAME = "sluice-ab"


def route_targets(spec: InferencePoolSpec, plan: Plan) -> list[tuple[str | None, int]]:
    """(subset or None for the whole pool, weight) pairs, zero weights dropped."""
    if not plan.revision_weights:
        return [(None, 100)]
    return [(subset_name(rev), weight) for rev, weight in sorted(plan.revision_weights.items()) if weight > 0]


def mirror(plan: Plan) -> tuple[str, float] | None:
    """(candidate subset, percent) of the shadow canary's request mirror; None when none is to be rendered."""
    if plan.mirror is None or plan.mirror.revision not in plan.revisions:
        return None
    return subset_name(plan.mirror.revision), plan.mirror.percent


def render_virtual_service(pool: PoolRef, spec: InferencePoolSpec, plan: Plan) -> Rendered:
    host = destination_host(pool, spec)
    route: list[JsonValue] = []
    for subset, weight in route_targets(spec, plan):
        destination: JsonObject = {"host": host, "port": {"number": destination_port(spec)}}
        if subset:
            destination["subset"] = subset
        route.append({"destination": destination, "weight": weight})
    http: JsonObject = {"name": ROUTE_NAME, "route": route}
    mirrored = mirror(plan)
    if mirrored is not None:
        subset, percent = mirrored
        target: JsonObject = {"host": host, "port": {"number": destination_port(spec)}, "subset": subset}
        http["mirrors"] = [{"destination": target, "percentage": {"value": percent}}]
    retries = render_retries(spec)
    if retries is not None:
        http["retries"] = retries
    # Istio tries routes in order: testers' header match first, then the A/B test's keys, then the split
    candidates = (_steered_route(pool, spec, plan, retries), _ab_route(pool, spec, plan, retries))
    routes: list[JsonValue] = [*(route for route in candidates if route is not None), http]
    body: JsonObject = {
        "hosts": [service_host(pool, spec)],
        "gateways": [*spec.routing.gateways],
        "http": routes,
        "exportTo": [*plan.mesh.export_to],
    }
    return istio_object(VIRTUAL_SERVICE, pool, body)


def _steered_route(pool: PoolRef, spec: InferencePoolSpec, plan: Plan, retries: JsonObject | None) -> JsonObject | None:
    """The header route: requests matching any of `spec.canary.match` go to the candidate's subset (Istio's
    HTTPMatchRequest: headers AND-ed within an entry, entries OR-ed)."""
    canary = spec.canary
    if canary is None or canary.match is None or plan.steer is None or plan.steer not in plan.revisions:
        return None
    matches: list[JsonValue] = [
        {"headers": {name: cond.wire() for name, cond in sorted(entry.headers.items())}} for entry in canary.match
    ]
    return _candidate_route(pool, spec, plan.steer, MATCH_ROUTE_NAME, matches, retries)


def _ab_route(pool: PoolRef, spec: InferencePoolSpec, plan: Plan, retries: JsonObject | None) -> JsonObject | None:
    """The A/B test's route: keys in the candidate's buckets go to it, every request (`sluice.core.abtest`)."""
    canary = spec.canary
    if canary is None or canary.ab_test is None or plan.steer is None or plan.steer not in plan.revisions:
        return None
    headers: JsonObject = {header: {**condition} for header, condition in key_match(canary.ab_test).items()}
    matches: list[JsonValue] = [{"headers": headers}]
    return _candidate_route(pool, spec, plan.steer, AB_ROUTE_NAME, matches, retries)


def _candidate_route(
    pool: PoolRef,
    spec: InferencePoolSpec,
    revision: str,
    name: str,
    matches: list[JsonValue],
    retries: JsonObject | None,
) -> JsonObject:
    destination: JsonObject = {
        "host": destination_host(pool, spec),
        "port": {"number": destination_port(spec)},
        "subset": subset_name(revision),
    }
    route: JsonObject = {"name": name, "match": matches, "route": [{"destination": destination}]}
    if retries is not None:
        route["retries"] = retries
    return route


def render_retries(spec: InferencePoolSpec) -> JsonObject | None:
    """Istio HTTPRetry: only failures before the response starts, to another pod by default."""
    retries = spec.routing.retries
    if retries is None:
        return None
    out: JsonObject = {
        "attempts": retries.attempts,
        # status codes as numbers: istiod moves them to retriable_status_codes and adds retriable-status-codes
        # (pilot/pkg/networking/core/route/retry/retry.go parseRetryOn)
        "retryOn": ",".join([*retries.retry_on, *(str(code) for code in sorted(set(retries.status_codes)))]),
        "retryRemoteLocalities": retries.retry_remote_localities,
        "retryIgnorePreviousHosts": retries.retry_ignore_previous_hosts,
    }
    if retries.per_try_timeout is not None:
        out["perTryTimeout"] = format_duration(retries.per_try_timeout)
    if retries.backoff is not None:
        out["backoff"] = format_duration(retries.backoff)
    return out
