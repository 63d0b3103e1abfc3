"""A pool's Prometheus queries as last rendered, kept per spec: the same at every pass until the spec changes.

`QueryPlans` renders (through `sluice.core.presets`) a pass's namespace-wide queries (`PassPlan`), the same
queries for given pods by name (scoped), and the preflight's (`CheckPlan`), once per spec object and namespace
(and pods, when a query names them): rendering them was ~3 % of a 300-pool operator, and a few thousand pod names
cost milliseconds. Used by `sluice.io.prometheus.PromIO`, from the pass threads and the query threads.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from sluice.api.v1alpha1 import InferencePoolSpec
from sluice.core.observed import SignalName
from sluice.core.presets import CheckPlan, build_queries, check_queries, names_pods

FRESHNESS_KEY = "sampleTime"
"""Name under which the freshness query's failure is reported (it is not a signal)."""

PASS_PLANS = 8192
"""Pools' rendered queries kept (`QueryPlans.for_pass`, `QueryPlans.checks`); past it they are all rendered anew."""
SCOPED_PLANS = 16
"""Scoped queries kept (`QueryPlans.scoped`); past it they are all rendered anew."""


@dataclass(frozen=True)
class PassPlan:
    """A pool's queries for a pass."""

    unsupported: tuple[SignalName, ...]
    freshness: bool
    """Whether the engine has a freshness query (`FRESHNESS_KEY` in `queries`)."""
    queries: dict[str, str]
    """Signal name (and `FRESHNESS_KEY`) -> the namespace-wide query."""
    own: frozenset[str]
    """The keys of `queries` over the pool's own pods (`$pods`): never asked for other pods."""
    pods: tuple[str, ...] | None
    """The pods `queries` name (when `own`): rendered again when they change."""
    signals: tuple[SignalName, ...]
    """The signals of `queries`, in their order."""


_Key = TypeVar("_Key", bound=Hashable)
_Plan = TypeVar("_Plan")


class _Rendered(Generic[_Key, _Plan]):
    """What was rendered per key, for the spec it was rendered from (`limit` at most)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._store: dict[_Key, tuple[InferencePoolSpec, _Plan]] = {}

    def recall(self, key: _Key, spec: InferencePoolSpec) -> _Plan | None:
        """What was rendered for `spec` under `key`, if it is still that spec's."""
        with self._lock:
            known = self._store.get(key)
        return known[1] if known is not None and known[0] is spec else None

    def keep(self, key: _Key, spec: InferencePoolSpec, plan: _Plan) -> _Plan:
        """Remember `plan` for `spec` (the spec is kept: its id is not reused while it is here)."""
        with self._lock:
            if len(self._store) >= self._limit:
                self._store.clear()
            self._store[key] = (spec, plan)
        return plan


class QueryPlans:
    """The queries of the pools as last rendered, per spec (its id: the spec object is kept with them)."""

    def __init__(self) -> None:
        self._scoped: _Rendered[tuple[int, str, frozenset[str]], dict[str, str | None]] = _Rendered(SCOPED_PLANS)
        """Scoped queries per (spec, namespace, pods): the queries of a namespace are asked together for the same
        pods."""
        self._passes: _Rendered[tuple[int, str], PassPlan] = _Rendered(PASS_PLANS)
        """A pool's namespace-wide queries per (spec, namespace)."""
        self._checks: _Rendered[tuple[int, str], CheckPlan] = _Rendered(PASS_PLANS)
        """The preflight's queries per (spec, namespace)."""

    def scoped(self, spec: InferencePoolSpec, namespace: str, pods: frozenset[str]) -> dict[str, str | None]:
        """The pool's queries (by signal name, and the freshness query) for `pods` by name, rendered once per
        (spec, namespace, pods)."""
        key = (id(spec), namespace, pods)
        known = self._scoped.recall(key, spec)
        if known is not None:
            return known
        plan = build_queries(spec, namespace, sorted(pods), by_pod=True)
        rendered: dict[str, str | None] = {str(name): text for name, text in plan.queries.items()}
        rendered[FRESHNESS_KEY] = plan.freshness
        return self._scoped.keep(key, spec, rendered)

    def for_pass(self, spec: InferencePoolSpec, namespace: str, pod_names: list[str]) -> PassPlan:
        """The pool's queries for a pass (`build_queries(..., namespace_wide=True)`), rendered once per spec and
        namespace (and pods, when a query names them)."""
        key = (id(spec), namespace)
        known = self._passes.recall(key, spec)
        if known is not None and (known.pods is None or known.pods == tuple(sorted(pod_names))):
            return known
        built = build_queries(spec, namespace, pod_names, namespace_wide=True)
        queries: dict[str, str] = {str(name): query for name, query in built.queries.items()}
        if built.freshness is not None:
            queries[FRESHNESS_KEY] = built.freshness
        # a query over the pool's own pods (`$pods`) stays its own: never asked for other pods
        own = frozenset(signal for signal in queries if names_pods(spec, signal))
        pods = tuple(sorted(pod_names)) if own else None  # sorted, as the query names them
        signals = tuple(built.queries)
        plan = PassPlan(built.unsupported, built.freshness is not None, queries, own, pods, signals)
        return self._passes.keep(key, spec, plan)

    def checks(self, spec: InferencePoolSpec, namespace: str) -> CheckPlan:
        """The preflight's queries for the pool's namespace, rendered once per spec and namespace."""
        key = (id(spec), namespace)
        known = self._checks.recall(key, spec)
        return known if known is not None else self._checks.keep(key, spec, check_queries(spec, namespace))


__all__ = ["FRESHNESS_KEY", "PASS_PLANS", "SCOPED_PLANS", "PassPlan", "QueryPlans"]
