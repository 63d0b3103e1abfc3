"""One analysis check of a canary candidate: the revisions' figures this pass, their capacities at comparable load,
the gates. Pure.

A check passes only when every enabled gate was evaluated on data: too little traffic, an enabled gate without
data, or a routable candidate pod without fresh samples, is Inconclusive — never Pass. Called for a live step
(`sluice.core.canarysteps`) and for the shadow (`sluice.core.canaryshadow`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.api.v1alpha1 import AnalysisSpec, CanarySpec, CheckResult, Gate
from sluice.core.abtest import buckets


@dataclass(frozen=True)
class RevisionStats:
    """One revision's figures this pass: pod counts, and request-weighted signals over its pods with data."""

    routable_pods: int = 0
    healthy_pods: int = 0
    """Routable pods that the floor does not merely keep."""
    requests: float | None = None
    error_rate: float | None = None
    ttft_p95: float | None = None
    incidents: int = 0
    stale_pods: tuple[str, ...] = ()
    """Routable pods without fresh samples: their last values are not evidence, so no check can pass."""
    window: float = 0.0
    """The span the figures cover (`metrics.window`): a check judges the last `window` seconds."""
    capacity: float | None = None
    """Requests/s the healthy routable pods can take, when each one's rests on a measurement (headroom policy);
    None otherwise."""
    classes: float = 0.0
    """The healthy routable pods' class coefficients K summed (0 when one has no known class)."""
    per_k: float | None = None
    """Requests/s per unit of K learned by those of them with a learned capacity and a known class; None without."""
    quiet: bool = False
    """No healthy pod of it shows load this pass (headroom policy: weighed by its latency ranking,
    `sluice.core.policies`): none reads a utilisation of INFORMATIVE or more, no KV cache past KV_ROOM."""

    @property
    def rate(self) -> float | None:
        return self.requests / self.window if self.requests is not None and self.window > 0 else None


@dataclass(frozen=True)
class Check:
    result: CheckResult
    reason: str


COMPARABLE = 1.25
"""A candidate is judged against the stable revision at comparable load while its utilisation is at most this
multiple of the stable revision's, plus `COMPARABLE_SLACK` (`spec.canary.comparableLoad`): an M/M/1 TTFT at 0.6
against 0.48 is 1.3x for load alone. Provenance: hand-set, not swept."""
COMPARABLE_SLACK = 0.05


@dataclass(frozen=True)
class Capacities:
    """What the candidate and the stable revision can take: requests/s when `absolute` (the stable revision's
    learned capacity per unit of K), else in units of K (their declared classes alone)."""

    candidate: float
    stable: float
    basis: str
    absolute: bool

    @property
    def percent(self) -> float:
        """The candidate's share at which both revisions run at one utilisation."""
        return 100.0 * self.candidate / (self.candidate + self.stable)

    def loads(self, cand: RevisionStats, stable: RevisionStats) -> tuple[float, float] | None:
        """(candidate, stable) load over the window — a share of capacity when `absolute`, requests/s per unit of
        K otherwise — when both rates are known."""
        if cand.rate is None or stable.rate is None:
            return None
        return cand.rate / self.candidate, stable.rate / self.stable

    def comparable(self, loads: tuple[float, float] | None) -> bool:
        if loads is None:
            return True
        return loads[0] <= COMPARABLE * loads[1] + (COMPARABLE_SLACK if self.absolute else 0.0)

    def describe(self, loads: tuple[float, float]) -> str:
        if self.absolute:
            return f"the candidate at {loads[0]:.0%} of its capacity, the stable revision at {loads[1]:.0%}"
        return (
            f"the candidate at {loads[0]:.2f} req/s per unit of K, the stable revision at {loads[1]:.2f} (no learned "
            "capacity: by declared classes)"
        )


def capacities(stable: RevisionStats | None, cand: RevisionStats) -> Capacities | None:
    """The two revisions' capacities: the candidate's classes' K against the stable revision's, in requests/s at
    the stable revision's learned capacity per unit of K when some of its pods learned one (`absolute`), in units
    of K otherwise; with a candidate pod of no known class, its own learned capacity against the stable
    revision's. None when neither can be had.

    Not the candidate's own figure first: one or two pods learn theirs from the few requests of the first steps,
    and on underprovisioned-canary it ranged 4.5-11.8 req/s for an A100 the stable ones put at 15, so the split
    it gave moved 11-32 % from pass to pass and put the stable pods past their knee. A candidate slower per unit
    of K than the stable revision is then judged at the stable revision's load per unit of K: what it would
    serve after promotion, and what its TTFT gates should see."""
    if stable is None:
        return None
    if cand.classes > 0 and stable.classes > 0:
        if stable.per_k:
            basis = "its classes' K at the stable revision's learned capacity per unit of K"
            return Capacities(cand.classes * stable.per_k, stable.classes * stable.per_k, basis, True)
        return Capacities(cand.classes, stable.classes, "its classes' K against the stable revision's", False)
    if cand.capacity and stable.capacity:
        return Capacities(cand.capacity, stable.capacity, "learned", True)
    return None


def _gate(gate: Gate, analysis: AnalysisSpec, cand: RevisionStats, stable: RevisionStats | None) -> str | None:
    """None when the gate holds; the failure in words when it does not; raises LookupError naming missing data."""
    if gate == "errorRate":
        if cand.error_rate is None:
            raise LookupError("candidate errorRate")
        if cand.error_rate > analysis.max_error_rate:
            return f"error rate {cand.error_rate:.2%} > {analysis.max_error_rate:.2%}"
        return None
    limit = analysis.max_ttft_p95 if gate == "ttftP95" else analysis.max_ttft_ratio_to_stable
    if limit is None:
        return None
    if cand.ttft_p95 is None:
        raise LookupError("candidate ttftP95")
    if gate == "ttftP95":
        if cand.ttft_p95 > limit:
            return f"TTFT p95 {cand.ttft_p95 * 1000:.0f}ms > {limit * 1000:.0f}ms"
        return None
    if stable is None or not stable.ttft_p95:
        raise LookupError("stable ttftP95")
    ratio = cand.ttft_p95 / stable.ttft_p95
    return f"TTFT p95 {ratio:.2f}x stable > {limit:.2f}x" if ratio > limit else None


GATES: tuple[Gate, ...] = ("errorRate", "ttftP95", "ttftRatioToStable")


def enabled_gates(analysis: AnalysisSpec) -> tuple[Gate, ...]:
    limits = {"ttftP95": analysis.max_ttft_p95, "ttftRatioToStable": analysis.max_ttft_ratio_to_stable}
    return tuple(g for g in GATES if g not in analysis.disabled_gates and (g == "errorRate" or limits[g] is not None))


def check(
    analysis: AnalysisSpec,
    candidate: RevisionStats,
    stable: RevisionStats | None,
    metrics_usable: bool,
    stable_serves: bool = True,
    requests_cap: float | None = None,
    loads: tuple[Capacities, tuple[float, float]] | None = None,
) -> Check:
    """One analysis check of the candidate. Pass only when every enabled gate was evaluated on data.

    The ratio to stable compares two revisions serving side by side; at a step where the stable revision takes
    no traffic (100 %) there is nothing to compare with, so that gate does not apply (and the reason says so).
    `loads` (the capacities and the (candidate, stable) loads on them; `spec.canary.comparableLoad`): a ratio
    failure taken while the candidate was busier than the stable revision beyond `COMPARABLE` says nothing of the
    candidate itself, so it makes the check Inconclusive, not Fail.
    """
    if candidate.incidents:
        return Check("Fail", f"{candidate.incidents} candidate pod(s) zeroed for an incident")
    if not metrics_usable:
        return Check("Inconclusive", "metrics unavailable")
    if candidate.stale_pods:
        return Check("Inconclusive", f"stale signals for pod {', '.join(candidate.stale_pods)}: not evidence")
    if candidate.requests is None or candidate.requests < analysis.min_requests:
        seen = 0 if candidate.requests is None else round(candidate.requests)
        return Check("Inconclusive", f"{seen} requests in the window, need {analysis.min_requests}")
    failures: list[str] = []
    missing: list[str] = []
    incomparable = ""
    gates = [g for g in enabled_gates(analysis) if stable_serves or g != "ttftRatioToStable"]
    for gate in gates:
        try:
            failure = _gate(gate, analysis, candidate, stable)
        except LookupError as lack:
            missing.append(f"{gate} ({lack.args[0]})")
            continue
        if failure and gate == "ttftRatioToStable" and loads is not None and not loads[0].comparable(loads[1]):
            incomparable = f"{failure}, but not at comparable load: {loads[0].describe(loads[1])}"
        elif failure:
            failures.append(failure)
    if failures:  # every request is evidence of a failure, the testers' included
        return Check("Fail", "; ".join(failures))
    if incomparable:
        return Check("Inconclusive", incomparable)
    if missing:
        return Check("Inconclusive", "no data for gate " + ", ".join(missing))
    if requests_cap is not None and candidate.requests is not None:
        counted = min(candidate.requests, requests_cap)
        if counted < analysis.min_requests:  # but not of a pass: the testers' requests alone never make one
            return Check(
                "Inconclusive",
                f"{round(counted)} requests in the window counted (header-routed ones excluded: at most what the "
                f"split and mirror send, estimated from the stable revision's), need {analysis.min_requests}",
            )
    applied = ", ".join(gates) or "none enabled"
    skipped = "" if stable_serves or "ttftRatioToStable" not in enabled_gates(analysis) else "; ttftRatioToStable "
    skipped += "does not apply: the stable revision takes no traffic at this step" if skipped else ""
    return Check("Pass", f"within every gate ({applied}){skipped}")


def requests_cap(spec: CanarySpec, stable: RevisionStats | None, planned: int, forced_to: str | None) -> float | None:
    """The most candidate requests a check counts while header routes carry testers (None: no cap): the share
    the split sends — for an A/B test, its buckets' share — estimated from the stable revision's requests. No cap
    at 100 % or with the split forced to one side: the stable revision then serves nobody to estimate from, and
    every user is on the candidate anyway."""
    if spec.match is None or forced_to is not None:
        return None
    share = buckets(spec.ab_test.key_alphabet, spec.ab_test.percent).share if spec.ab_test else float(planned)
    if share >= 100:
        return None
    return split_share(stable, share / (100 - share))


def split_share(stable: RevisionStats | None, ratio: float) -> float:
    """The candidate requests the split (or the mirror) accounts for: `ratio` times the stable revision's. With
    header routes, the candidate's own count also holds the testers' requests, which the engines' metrics cannot
    tell apart (no request carries its route); counting at most this share keeps them from passing a check's
    minRequests alone. No stable figure: nothing is counted."""
    if stable is None or stable.requests is None:
        return 0.0
    return stable.requests * ratio
