"""The benchmark's targets, computed from the measured figures and checked against every strategy.

Called by `sluice.bench.report`. A target is a predicate on one strategy's figures in one scenario. It is checked
for sluice *and* for every baseline: a target that every baseline meets measures nothing and is removed (listed as
such), so each target left in the report is failed by at least one baseline, named beside it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

BASELINES = (
    "round-robin",
    "least-request",
    "static-capacity",
    "seed-adaptive",
    "power-of-two",
    "consistent-hash",
    "blind-canary",
)
NEAR = 0.7  # the "ordinary busy day" load the single-load targets look at

Verdict = tuple[float, bool] | None
Predicate = Callable[[dict[str, Any], str], Verdict]


def _near(r: dict[str, Any]) -> int:
    return min(range(len(r["loads"])), key=lambda i: abs(r["loads"][i] - NEAR))


def _goodput_share(r: dict[str, Any], strategy: str) -> Verdict:
    value = r["goodput"][strategy][0] / r["capacity"]
    return value, value >= 0.8


def _goodput_vs_best_static(r: dict[str, Any], strategy: str) -> Verdict:
    reference = r["goodput"].get("best-static", (0.0,))[0]
    if not reference:
        return None
    value = r["goodput"][strategy][0] / reference
    return value, value >= 1.0


def _p99_within_slo(r: dict[str, Any], strategy: str) -> Verdict:
    p99 = r["strategies"][strategy][_near(r)]["ttft_p99_ms"]
    return (p99[0], p99[0] <= r["slo_ttft_p99_ms"]) if p99 else None


def _no_worse_than_least_request(r: dict[str, Any], strategy: str) -> Verdict:
    if "least-request" not in r["strategies"]:
        return None
    ratios = []
    for mine, theirs in zip(r["strategies"][strategy], r["strategies"]["least-request"], strict=True):
        if mine["ttft_p99_ms"] and theirs["ttft_p99_ms"] and theirs["ttft_p99_ms"][0] > 0:
            ratios.append(mine["ttft_p99_ms"][0] / theirs["ttft_p99_ms"][0])
    if not ratios:
        return None
    worst = max(ratios)
    return worst, worst <= 1.1


def _incident_p99(r: dict[str, Any], strategy: str) -> Verdict:
    row = r["strategies"][strategy][_near(r)]
    if "incident_ttft_p99_ms" not in row:
        return None
    value = row["incident_ttft_p99_ms"][0]
    return value, value <= r["slo_ttft_p99_ms"]


def _incident_errors(r: dict[str, Any], strategy: str) -> Verdict:
    row = r["strategies"][strategy][_near(r)]
    if "incident_error_rate" not in row:
        return None
    value = row["incident_error_rate"][0]
    return value, value <= 0.01


TARGETS: tuple[tuple[str, str, Predicate], ...] = (
    ("goodput at SLO ≥ 80 % of capacity", "{:.0%}", _goodput_share),
    ("goodput at SLO ≥ the best static split's", "{:.2f}x", _goodput_vs_best_static),
    (f"P99 TTFT within the SLO at the load nearest {NEAR:.0%}", "{:.0f} ms", _p99_within_slo),
    ("P99 TTFT ≤ 1.1 × least-request's at every load", "{:.2f}x", _no_worse_than_least_request),
    (f"incident P99 TTFT within the SLO (load nearest {NEAR:.0%})", "{:.0f} ms", _incident_p99),
    (f"incident error rate ≤ 1 % (load nearest {NEAR:.0%})", "{:.1%}", _incident_errors),
)


def check(scenarios: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for name, r in scenarios.items():
        if "sluice" not in r["strategies"]:
            continue
        for label, pattern, predicate in TARGETS:
            verdict = predicate(r, "sluice")
            if verdict is None:
                continue
            value, met = verdict
            failed_by = []
            for baseline in BASELINES:
                other = predicate(r, baseline) if baseline in r["strategies"] else None
                if other is not None and not other[1]:
                    failed_by.append(baseline)
            out.append(
                {
                    "scenario": name,
                    "target": label,
                    "sluice": pattern.format(value),
                    "met": met,
                    "failed_by": failed_by,
                    "kept": bool(failed_by),
                }
            )
    return out


def table(checks: list[dict[str, Any]]) -> str:
    lines = ["| scenario | target | sluice | met | baselines that fail it |", "|---|---|---|---|---|"]
    removed = []
    for c in checks:
        if not c["kept"]:
            removed.append(f"{c['scenario']}: {c['target']}")
            continue
        met = "yes" if c["met"] else "**no**"
        lines.append(f"| {c['scenario']} | {c['target']} | {c['sluice']} | {met} | {', '.join(c['failed_by'])} |")
    if removed:
        lines += ["", "Removed as degenerate (every baseline meets them): " + "; ".join(removed) + "."]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- the routing issue's targets

CANDIDATES = ("sluice", "sluice-cube")
PEERS = ("round-robin", "least-request", "power-of-two", "consistent-hash")
"""The routers a user could run instead of sluice (Envoy's two policies, the vLLM router's two)."""
UNDEFINED = math.nan
"""A ratio against a reference that has no finite value (least-request's P99 unbounded, or its goodput 0): a
finite figure beats it, but by no factor; printed as such, never as 0.00x or inf x."""
IssueVerdict = tuple[float, bool, bool] | None
"""(worst ratio of medians, met on the medians, met on the interval bounds)."""
IssuePredicate = Callable[[dict[str, Any], str], IssueVerdict]


def _ratio(mine: float, theirs: float) -> float:
    """mine / theirs; UNDEFINED for a finite figure against an unbounded one, ∞ for an unbounded against either."""
    if math.isinf(mine):
        return math.inf
    if math.isinf(theirs):
        return UNDEFINED
    return math.inf if theirs <= 0 else mine / theirs


def _worst(ratios: list[float]) -> float | None:
    """The worst (largest) ratio; UNDEFINED only when every ratio is (the reference unbounded throughout)."""
    defined = [x for x in ratios if not math.isnan(x)]
    if defined:
        return max(defined)
    return UNDEFINED if ratios else None


def _figure(r: dict[str, Any], strategy: str, i: int, key: str, at: int = 0) -> float | None:
    """One figure of a strategy at load i: its median over seeds (at=0), or its interval's lower (1) or upper (2)."""
    rows = r["strategies"].get(strategy)
    if rows is None or rows[i].get(key) is None:
        return None
    return float(rows[i][key][at])


def _worst_ratio(
    r: dict[str, Any], strategy: str, key: str, lo: float, hi: float, versus: Callable[[int, int], float | None]
) -> tuple[float, float] | None:
    """Worst over the loads in [lo, hi] of mine / reference, on the medians and on the bounds (my interval's
    upper end over the reference's lower end: the ratio the intervals cannot rule out)."""
    medians, bounds = [], []
    for i, load in enumerate(r["loads"]):
        if lo - 1e-9 <= load <= hi + 1e-9:
            mine, theirs = _figure(r, strategy, i, key), versus(i, 0)
            mine_hi, theirs_lo = _figure(r, strategy, i, key, 2), versus(i, 1)
            if mine is not None and theirs is not None and mine_hi is not None and theirs_lo is not None:
                medians.append(_ratio(mine, theirs))
                bounds.append(_ratio(mine_hi, theirs_lo))
    worst, bound = _worst(medians), _worst(bounds)
    return None if worst is None or bound is None else (worst, bound)


def _lr(r: dict[str, Any], key: str) -> Callable[[int, int], float | None]:
    return lambda i, at: _figure(r, "least-request", i, key, at)


def _best_peer(r: dict[str, Any], key: str) -> Callable[[int, int], float | None]:
    def best(i: int, at: int) -> float | None:
        values = [v for p in PEERS if (v := _figure(r, p, i, key, at)) is not None]
        return min(values) if values else None

    return best


def _heterogeneous(r: dict[str, Any]) -> bool:
    return len({s["hardware"] for s in r["servers"]}) > 1 and not _has_incident(r)


def _has_incident(r: dict[str, Any]) -> bool:
    return any("incident_ttft_p99_ms" in rows[0] for rows in r["strategies"].values())


def _at_most(bound: float, value: tuple[float, float] | None) -> IssueVerdict:
    """Met: the ratio is at most `bound` (a finite figure against an unbounded reference meets any bound)."""
    if value is None:
        return None
    median, edge = value

    def ok(x: float) -> bool:
        return math.isnan(x) or x <= bound

    return median, ok(median), ok(edge)


def _t_low_p99_lr(r: dict[str, Any], s: str) -> IssueVerdict:
    return (
        _at_most(0.5, _worst_ratio(r, s, "ttft_p99_ms", 0.2, 0.7, _lr(r, "ttft_p99_ms"))) if _heterogeneous(r) else None
    )


def _t_low_p99_peer(r: dict[str, Any], s: str) -> IssueVerdict:
    if not _heterogeneous(r):
        return None
    return _at_most(0.8, _worst_ratio(r, s, "ttft_p99_ms", 0.2, 0.7, _best_peer(r, "ttft_p99_ms")))


def _t_low_mean(r: dict[str, Any], s: str) -> IssueVerdict:
    if not _heterogeneous(r):
        return None
    return _at_most(0.7, _worst_ratio(r, s, "ttft_mean_ms", 0.2, 0.7, _lr(r, "ttft_mean_ms")))


def _t_high_p99(r: dict[str, Any], s: str) -> IssueVerdict:
    if not _heterogeneous(r):
        return None
    return _at_most(0.8, _worst_ratio(r, s, "ttft_p99_ms", 0.7, 0.9, _lr(r, "ttft_p99_ms")))


def _t_never_worse(r: dict[str, Any], s: str) -> IssueVerdict:
    if _has_incident(r):
        return None
    return _at_most(1.0, _worst_ratio(r, s, "ttft_p99_ms", 0.0, 10.0, _lr(r, "ttft_p99_ms")))


def _goodput_ratio(r: dict[str, Any], s: str, versus: tuple[str, ...], bound: float) -> IssueVerdict:
    if not _heterogeneous(r):
        return None
    refs = [r["goodput"][p] for p in versus if p in r["goodput"]]
    if not refs or s not in r["goodput"]:
        return None
    theirs = max(refs, key=lambda g: g[0])
    mine = r["goodput"][s]

    def at_least(a: float, b: float) -> tuple[float, bool]:
        if b <= 0:  # no goodput at all for the reference: beaten by any, by no factor
            return (UNDEFINED, True) if a > 0 else (1.0, False)
        return a / b, a / b >= bound

    (value, met), (_, met_bounds) = at_least(mine[0], theirs[0]), at_least(mine[1], theirs[2])
    return value, met, met_bounds


def _t_goodput_lr(r: dict[str, Any], s: str) -> IssueVerdict:
    return _goodput_ratio(r, s, ("least-request",), 1.5)


def _t_goodput_peer(r: dict[str, Any], s: str) -> IssueVerdict:
    return _goodput_ratio(r, s, PEERS, 1.2)


def _overload(r: dict[str, Any]) -> int | None:
    return next((i for i, load in enumerate(r["loads"]) if load >= 1.1 - 1e-9), None)


def _t_overload_p99(r: dict[str, Any], s: str) -> IssueVerdict:
    i = _overload(r)
    if i is None or _has_incident(r):
        return None
    mine, theirs = _figure(r, s, i, "ttft_p99_ms"), _figure(r, "least-request", i, "ttft_p99_ms")
    mine_hi, theirs_lo = _figure(r, s, i, "ttft_p99_ms", 2), _figure(r, "least-request", i, "ttft_p99_ms", 1)
    if mine is None or theirs is None or mine_hi is None or theirs_lo is None:
        return None
    return _at_most(1.0, (_ratio(mine, theirs), _ratio(mine_hi, theirs_lo)))


def _t_overload_completed(r: dict[str, Any], s: str) -> IssueVerdict:
    i = _overload(r)
    if i is None or _has_incident(r):
        return None
    mine, theirs = _figure(r, s, i, "completed"), _figure(r, "least-request", i, "completed")
    mine_lo, theirs_hi = _figure(r, s, i, "completed", 1), _figure(r, "least-request", i, "completed", 2)
    if mine is None or not theirs or mine_lo is None or not theirs_hi:
        return None
    return mine / theirs, mine / theirs >= 1.0, mine_lo / theirs_hi >= 1.0


def _t_homogeneous(r: dict[str, Any], s: str) -> IssueVerdict:
    if len({x["hardware"] for x in r["servers"]}) > 1 or _has_incident(r):
        return None
    worst = None
    met = True
    for i in range(len(r["loads"])):
        mine, lr = r["strategies"][s][i]["ttft_p99_ms"], r["strategies"]["least-request"][i]["ttft_p99_ms"]
        if mine is None or lr is None:
            continue
        ratio = _ratio(mine[0], lr[0])
        if not math.isnan(ratio):
            worst = ratio if worst is None else max(worst, ratio)
        met = met and mine[0] <= lr[2]  # the median within (or below) least-request's interval
    # The target is itself stated on the interval: the same verdict on the medians and on the bounds.
    return None if worst is None else (worst, met, met)


def _t_incident(r: dict[str, Any], s: str) -> IssueVerdict:
    if not _has_incident(r):
        return None
    return _at_most(0.5, _worst_ratio(r, s, "incident_ttft_p99_ms", 0.0, 10.0, _lr(r, "incident_ttft_p99_ms")))


def _failing_only(r: dict[str, Any]) -> bool:
    """A pod fails a share of its requests and none slows down (scenarios run before faults were recorded: no)."""
    faults = r.get("faults") or []
    return any(f.get("error_rate") for f in faults) and not any(f.get("slowdown") for f in faults)


def _error_ratio(r: dict[str, Any], s: str, i: int, at: int, theirs_at: int) -> float | None:
    """My error rate over least-request's at load i (no errors on either side: 1, equal)."""
    mine, theirs = _figure(r, s, i, "error_rate", at), _figure(r, "least-request", i, "error_rate", theirs_at)
    if mine is None or theirs is None:
        return None
    if theirs <= 0:
        return 1.0 if mine <= 0 else math.inf
    return mine / theirs


def _failing_ratios(r: dict[str, Any], s: str, i: int) -> tuple[float, float, float, float] | None:
    """At load i: P99 over least-request's and errors over least-request's, on the medians and on the bounds."""
    p99, p99_lr = _figure(r, s, i, "ttft_p99_ms"), _figure(r, "least-request", i, "ttft_p99_ms")
    p99_hi, p99_lr_lo = _figure(r, s, i, "ttft_p99_ms", 2), _figure(r, "least-request", i, "ttft_p99_ms", 1)
    errors, errors_edge = _error_ratio(r, s, i, 0, 0), _error_ratio(r, s, i, 2, 1)
    if p99 is None or p99_lr is None or p99_hi is None or p99_lr_lo is None:
        return None
    if errors is None or errors_edge is None:
        return None
    return _ratio(p99, p99_lr), errors, _ratio(p99_hi, p99_lr_lo), errors_edge


def _t_failing_no_worse(r: dict[str, Any], s: str) -> IssueVerdict:
    """P99 ≤ 1.1 x least-request's and error rate ≤ least-request's, at every load: the worst over the loads of
    the worse of P99 / (1.1 x least-request's) and errors / least-request's."""
    if not _failing_only(r):
        return None
    rows = [x for i in range(len(r["loads"])) if (x := _failing_ratios(r, s, i)) is not None]
    if not rows:
        return None
    median = max(max(p / 1.1, e) for p, e, _, _ in rows)
    edge = max(max(p / 1.1, e) for _, _, p, e in rows)
    return median, median <= 1.0, edge <= 1.0


def _t_failing_halves_one(r: dict[str, Any], s: str) -> IssueVerdict:
    """At every load, the P99 or the error rate at most half of least-request's: the worst over the loads of the
    better of the two ratios."""
    if not _failing_only(r):
        return None
    rows = [x for i in range(len(r["loads"])) if (x := _failing_ratios(r, s, i)) is not None]
    if not rows:
        return None
    return _at_most(0.5, (max(min(p, e) for p, e, _, _ in rows), max(min(p, e) for _, _, p, e in rows)))


ISSUE_TARGETS: tuple[tuple[str, str, IssuePredicate], ...] = (
    ("P99 TTFT ≤ 0.5 × least-request, every load 20–70 %", "{:.2f}x", _t_low_p99_lr),
    ("P99 TTFT ≤ 0.8 × the best peer router, every load 20–70 %", "{:.2f}x", _t_low_p99_peer),
    ("mean TTFT ≤ 0.7 × least-request, every load 20–70 %", "{:.2f}x", _t_low_mean),
    ("P99 TTFT ≤ 0.8 × least-request, every load 70–90 %", "{:.2f}x", _t_high_p99),
    ("P99 TTFT ≤ least-request's at every load", "{:.2f}x", _t_never_worse),
    ("goodput at SLO ≥ 1.5 × least-request", "{:.2f}x", _t_goodput_lr),
    ("goodput at SLO ≥ 1.2 × the best peer router", "{:.2f}x", _t_goodput_peer),
    ("overload (110 %): P99 TTFT ≤ least-request", "{:.2f}x", _t_overload_p99),
    ("overload (110 %): completed requests ≥ least-request", "{:.2f}x", _t_overload_completed),
    ("homogeneous: P99 within least-request's interval at every load", "{:.2f}x", _t_homogeneous),
    ("incident P99 TTFT ≤ 0.5 × least-request, every load", "{:.2f}x", _t_incident),
    ("failing pod: P99 TTFT ≤ 1.1 × and errors ≤ least-request's, every load", "{:.2f}x", _t_failing_no_worse),
    ("failing pod: P99 TTFT or errors ≤ 0.5 × least-request's, every load", "{:.2f}x", _t_failing_halves_one),
)


def _verdict_text(verdict: tuple[float, bool, bool], pattern: str, goodput: bool) -> tuple[str, str]:
    value, met, met_bounds = verdict
    if math.isnan(value):
        text = "reference has no goodput (0 req/s)" if goodput else "least-request unbounded"
    elif math.isinf(value):
        text = "∞ (unbounded)"
    else:
        text = pattern.format(value)
    if met and met_bounds:
        return text, "yes"
    return text, "inside interval" if met else "**no**"


def issue_checks(scenarios: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every routing-issue target that applies to a scenario, for the headroom policy and the cube side by side,
    and for every baseline: a target every baseline meets is degenerate (no win).

    Ratios are of medians over seeds (worst over the loads the target covers); `x` reads "times the reference".
    "yes" needs the intervals too (my upper bound against the reference's lower one); a target met on the medians
    only is "inside interval": no difference shown.
    """
    out = []
    for name, r in scenarios.items():
        variant = r.get("same_traces_as")
        for label, pattern, predicate in ISSUE_TARGETS:
            row: dict[str, Any] = {
                "scenario": name,
                "held_out": bool(r.get("held_out")) and not variant,
                "same_traces_as": variant,
                "target": label,
            }
            goodput = "goodput" in label
            for candidate in CANDIDATES:
                verdict = predicate(r, candidate) if candidate in r["strategies"] else None
                row[candidate] = None if verdict is None else _verdict_text(verdict, pattern, goodput)
            judged = {b: v for b in BASELINES if b in r["strategies"] and (v := predicate(r, b)) is not None}
            row["baselines_meeting"] = sorted(b for b, v in judged.items() if v[1])
            row["degenerate"] = bool(judged) and len(row["baselines_meeting"]) == len(judged)
            if any(row[c] is not None for c in CANDIDATES):
                out.append(row)
    return out


def _role(c: dict[str, Any]) -> str:
    if c.get("same_traces_as"):
        return f"{c['same_traces_as']}'s traces (not held out)"
    return "held out" if c["held_out"] else "tuning"


def issue_table(checks: list[dict[str, Any]]) -> str:
    lines = [
        "| scenario | role | target | headroom (sluice) | met | cube (sluice-cube) | met "
        "| baselines that also meet it |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in checks:
        cells = []
        for candidate in CANDIDATES:
            value = c[candidate]
            cells += ["-", "-"] if value is None else list(value)
        baselines = ", ".join(c.get("baselines_meeting", [])) or "none"
        if c.get("degenerate"):
            baselines += " (**every baseline: degenerate, not a win**)"
        lines.append(f"| {c['scenario']} | {_role(c)} | {c['target']} | " + " | ".join(cells) + f" | {baselines} |")
    lines += [
        "",
        "Met: **yes** when the intervals agree (my interval's upper end within the bound × the reference's lower "
        "end); *inside interval* when only the medians meet it — no difference shown; **no** otherwise. "
        '"least-request unbounded": its P99 is ∞ (requests never served) at every load the target covers, so a '
        "finite figure meets it by no factor.",
    ]
    return "\n".join(lines)
