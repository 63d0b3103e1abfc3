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
IssueVerdict = tuple[float, bool] | None
IssuePredicate = Callable[[dict[str, Any], str], IssueVerdict]


def _ratio(mine: float, theirs: float) -> float:
    if math.isinf(theirs):
        return 1.0 if math.isinf(mine) else 0.0
    return math.inf if theirs <= 0 else mine / theirs


def _figure(r: dict[str, Any], strategy: str, i: int, key: str) -> float | None:
    rows = r["strategies"].get(strategy)
    if rows is None or rows[i].get(key) is None:
        return None
    return float(rows[i][key][0])


def _worst_ratio(
    r: dict[str, Any], strategy: str, key: str, lo: float, hi: float, versus: Callable[[int], float | None]
) -> float | None:
    ratios = []
    for i, load in enumerate(r["loads"]):
        if lo - 1e-9 <= load <= hi + 1e-9:
            mine, theirs = _figure(r, strategy, i, key), versus(i)
            if mine is not None and theirs is not None:
                ratios.append(_ratio(mine, theirs))
    return max(ratios) if ratios else None


def _lr(r: dict[str, Any], key: str) -> Callable[[int], float | None]:
    return lambda i: _figure(r, "least-request", i, key)


def _best_peer(r: dict[str, Any], key: str) -> Callable[[int], float | None]:
    def best(i: int) -> float | None:
        values = [v for p in PEERS if (v := _figure(r, p, i, key)) is not None]
        return min(values) if values else None

    return best


def _heterogeneous(r: dict[str, Any]) -> bool:
    return len({s["hardware"] for s in r["servers"]}) > 1 and not _has_incident(r)


def _has_incident(r: dict[str, Any]) -> bool:
    return any("incident_ttft_p99_ms" in rows[0] for rows in r["strategies"].values())


def _at_most(bound: float, value: float | None) -> IssueVerdict:
    return None if value is None else (value, value <= bound)


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
    theirs = max((r["goodput"][p][0] for p in versus if p in r["goodput"]), default=None)
    if theirs is None or s not in r["goodput"]:
        return None
    mine = r["goodput"][s][0]
    value = math.inf if theirs <= 0 and mine > 0 else (1.0 if theirs <= 0 else mine / theirs)
    return value, value >= bound


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
    return None if mine is None or theirs is None else _at_most(1.0, _ratio(mine, theirs))


def _t_overload_completed(r: dict[str, Any], s: str) -> IssueVerdict:
    i = _overload(r)
    if i is None or _has_incident(r):
        return None
    mine, theirs = _figure(r, s, i, "completed"), _figure(r, "least-request", i, "completed")
    if mine is None or not theirs:
        return None
    value = mine / theirs
    return value, value >= 1.0


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
        worst = ratio if worst is None else max(worst, ratio)
        met = met and mine[0] <= lr[2]  # the median within (or below) least-request's interval
    return None if worst is None else (worst, met)


def _t_incident(r: dict[str, Any], s: str) -> IssueVerdict:
    if not _has_incident(r):
        return None
    return _at_most(0.5, _worst_ratio(r, s, "incident_ttft_p99_ms", 0.0, 10.0, _lr(r, "incident_ttft_p99_ms")))


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
)


def issue_checks(scenarios: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every routing-issue target that applies to a scenario, for the headroom policy and the cube side by side.

    Ratios are of medians over seeds (worst over the loads the target covers); `x` reads "times the reference".
    """
    out = []
    for name, r in scenarios.items():
        for label, pattern, predicate in ISSUE_TARGETS:
            row: dict[str, Any] = {"scenario": name, "held_out": bool(r.get("held_out")), "target": label}
            for candidate in CANDIDATES:
                verdict = predicate(r, candidate) if candidate in r["strategies"] else None
                row[candidate] = None if verdict is None else (pattern.format(verdict[0]), verdict[1])
            if any(row[c] is not None for c in CANDIDATES):
                out.append(row)
    return out


def issue_table(checks: list[dict[str, Any]]) -> str:
    lines = [
        "| scenario | role | target | headroom (sluice) | met | cube (sluice-cube) | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in checks:
        cells = []
        for candidate in CANDIDATES:
            value = c[candidate]
            cells += ["-", "-"] if value is None else [value[0], "yes" if value[1] else "**no**"]
        role = "held out" if c["held_out"] else "tuning"
        lines.append(f"| {c['scenario']} | {role} | {c['target']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
