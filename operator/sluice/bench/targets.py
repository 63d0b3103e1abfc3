"""The benchmark's targets, computed from the measured figures and checked against every strategy.

Called by `sluice.bench.report`. A target is a predicate on one strategy's figures in one scenario. It is checked
for sluice *and* for every baseline: a target that every baseline meets measures nothing and is removed (listed as
such), so each target left in the report is failed by at least one baseline, named beside it.
"""

from __future__ import annotations

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
