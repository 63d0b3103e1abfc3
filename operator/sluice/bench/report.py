"""Run benchmark scenarios and write `results.json`, `report.md` and PNG plots. Called by `sluice bench`.

For each scenario: measure the fleet's capacity (strategy-independent, `sluice.bench.capacity`), then for every
offered load of the sweep and every seed build one arrival trace and replay it through every strategy. Figures are
medians over seeds with a distribution-free interval for the median (order statistics; with 5 seeds it is the
min–max range, which covers the median with probability 1 − 2·0.5⁵ ≈ 94 %). Goodput at SLO is the highest offered
load of the sweep at which, and at every lower load, P99 TTFT stays within the scenario's SLO. Targets are checked in
`sluice.bench.targets`, each against every baseline too.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import statistics
import time
from pathlib import Path
from typing import Any

from sluice.bench import calibration, targets
from sluice.bench.capacity import best_split, fleet_capacity, server_curves
from sluice.bench.scenario import Scenario, load
from sluice.bench.sim import STRATEGIES, Simulation, summarise
from sluice.bench.trace import make_trace, write_azure_csv

KEPT = (
    "ttft_p50_ms",
    "ttft_p99_ms",
    "ttft_mean_ms",
    "tpot_mean_ms",
    "error_rate",
    "output_tokens_per_s",
    "completed",
    "weight_changes_per_min",
)


def _job(args: tuple[Scenario, float, int, dict[str, float], bool]) -> dict[str, Any]:
    """One trace (a load and a seed) through every strategy of the scenario."""
    scenario, rate, seed, split, keep_weights = args
    seeded = scenario.model_copy(update={"seed": seed})
    trace = make_trace(scenario.workload, rate, scenario.workload.duration, seed, scenario.dataplane.sidecars)
    out: dict[str, Any] = {"strategies": {}, "weights": None}
    for strategy in scenario.strategies or STRATEGIES:
        result = Simulation(seeded, strategy, trace, split).run()
        out["strategies"][strategy] = summarise(result)
        if strategy == "sluice" and keep_weights:
            out["weights"] = result.weights
    return out


def median_interval(values: list[float]) -> tuple[float, float, float]:
    """The median and the narrowest symmetric order-statistic interval that covers it with ≥ 95 % (min–max if none
    does: with 5 seeds that is the case, 94 %)."""
    ordered = sorted(values)
    n = len(ordered)
    lo = 0
    for k in range(n // 2, -1, -1):
        coverage = 1 - 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n
        if coverage >= 0.95:
            lo = k + 1
            break
    return statistics.median(ordered), ordered[max(0, lo - 1)], ordered[min(n - 1, n - lo)]


def _aggregate(cells: list[list[dict[str, Any]]], strategies: list[str]) -> dict[str, Any]:
    """cells[load][seed] -> strategy -> figure -> (median, lo, hi) per load."""
    out: dict[str, Any] = {}
    for strategy in strategies:
        per_load = []
        for seeds in cells:
            row: dict[str, Any] = {}
            for key in KEPT:
                values = [s["strategies"][strategy][key] for s in seeds if s["strategies"][strategy][key] is not None]
                row[key] = median_interval(values) if values else None
            row["share"] = seeds[0]["strategies"][strategy]["share"]
            for key in ("incident_ttft_p99_ms", "incident_error_rate", "peak_kv", "preemptions", "unfinished"):
                values = [s["strategies"][strategy].get(key) for s in seeds]
                if all(v is not None for v in values):
                    row[key] = median_interval([float(v) for v in values])
            per_load.append(row)
        out[strategy] = per_load
    return out


def goodput(
    cells: list[list[dict[str, Any]]], loads: list[float], capacity: float, slo_ms: float, strategy: str
) -> tuple[float, float, float]:
    """Per seed, the highest load (req/s) at which it and every lower load keep P99 TTFT within the SLO."""
    order = sorted(range(len(loads)), key=lambda i: loads[i])
    per_seed = []
    for seed in range(len(cells[0])):
        best = 0.0
        for i in order:
            p99 = cells[i][seed]["strategies"][strategy]["ttft_p99_ms"]
            if p99 is None or p99 > slo_ms:
                break
            best = loads[i] * capacity
        per_seed.append(best)
    return median_interval(per_seed)


def run_scenario(scenario: Scenario, jobs: int) -> dict[str, Any]:
    started = time.perf_counter()
    curves = server_curves(scenario)
    capacity = fleet_capacity(scenario)
    strategies = list(scenario.strategies or STRATEGIES)
    loads = scenario.loads
    seeds = [scenario.seed + i for i in range(scenario.seeds)]
    keep_at = min(range(len(loads)), key=lambda i: abs(loads[i] - 0.7))
    work = []
    for i, fraction in enumerate(loads):
        rate = fraction * capacity
        split = best_split(scenario, rate)
        work += [(scenario, rate, seed, split, i == keep_at and j == 0) for j, seed in enumerate(seeds)]
    if jobs > 1:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            done = pool.map(_job, work)
    else:
        done = [_job(w) for w in work]
    cells = [done[i * len(seeds) : (i + 1) * len(seeds)] for i in range(len(loads))]
    figures = _aggregate(cells, strategies)
    slo = scenario.slo.ttft_p99_ms
    good = {s: goodput(cells, loads, capacity, slo, s) for s in strategies}
    return {
        "description": scenario.description,
        "faults": [e.model_dump(exclude_none=True) for e in scenario.events],
        "retries": scenario.dataplane.retries,
        "held_out": scenario.held_out,
        "same_traces_as": scenario.same_traces_as,
        "capacity": capacity,
        "servers": [
            {
                "name": s.name,
                "hardware": s.hardware,
                "capacity": curves[s.hardware].capacity,
                "idle_p99_ms": curves[s.hardware].runs[0].p99_ttft * 1000,
                "p99_at_90_ms": curves[s.hardware].runs[8].p99_ttft * 1000,
                "peak_kv_at_90": curves[s.hardware].runs[8].peak_kv,
                "peak_waiting_at_90": curves[s.hardware].runs[8].peak_waiting,
                "preemptions_at_110": curves[s.hardware].runs[10].preemptions,
            }
            for s in scenario.servers
        ],
        "loads": loads,
        "slo_ttft_p99_ms": slo,
        "seeds": seeds,
        "strategies": figures,
        "goodput": good,
        "weights": cells[keep_at][0]["weights"],
        "weights_load": loads[keep_at],
        "seconds": time.perf_counter() - started,
    }


def _cell(value: tuple[float, float, float] | None, pattern: str = "{:.0f}") -> str:
    if value is None:
        return "-"
    med, lo, hi = value

    def f(x: float) -> str:
        return "∞" if math.isinf(x) else pattern.format(x)

    return f"{f(med)} [{f(lo)}–{f(hi)}]"


def scenario_section(name: str, r: dict[str, Any]) -> list[str]:
    if r.get("same_traces_as"):
        role = (
            f"on {r['same_traces_as']}'s traces (same seeds, servers and workload; only the control loop differs): "
            "not held out"
        )
    else:
        role = "held out of tuning" if r.get("held_out") else "used to choose the headroom parameters"
    lines = [f"## {name}", "", str(r["description"]).strip(), "", f"_Scenario {role}._", ""]
    lines += [
        "| server | hardware | capacity (req/s) | P99 TTFT idle | P99 TTFT at 90 % | peak KV at 90 % "
        "| peak queue at 90 % | preemptions at 110 % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in r["servers"]:
        lines.append(
            f"| {s['name']} | {s['hardware']} | {s['capacity']:.2f} | {s['idle_p99_ms']:.0f} ms "
            f"| {s['p99_at_90_ms']:.0f} ms | {s['peak_kv_at_90']:.0%} | {s['peak_waiting_at_90']} "
            f"| {s['preemptions_at_110']} |"
        )
    capacity = r["capacity"]
    lines += [
        "",
        f"Fleet capacity (sum of the servers' saturated throughput): **{capacity:.2f} req/s**. "
        f"SLO: P99 TTFT ≤ {r['slo_ttft_p99_ms']:.0f} ms. Seeds: {len(r['seeds'])}.",
        "",
    ]
    loads = r["loads"]
    for key, label in (
        ("ttft_p99_ms", "P99 TTFT (ms)"),
        ("ttft_p50_ms", "P50 TTFT (ms)"),
        ("ttft_mean_ms", "Mean TTFT (ms)"),
    ):
        lines += [f"{label}, median [interval] over seeds, by offered load (share of capacity):", ""]
        lines += ["| strategy | " + " | ".join(f"{x:.0%} ({x * capacity:.1f}/s)" for x in loads) + " |"]
        lines += ["|---|" + "---|" * len(loads)]
        for strategy, per_load in r["strategies"].items():
            lines.append(f"| {strategy} | " + " | ".join(_cell(row[key]) for row in per_load) + " |")
        lines.append("")
    churn = {k: v for k, v in r["strategies"].items() if any(row.get("weight_changes_per_min") for row in v)}
    if churn:
        lines += ["Published weight changes per minute (measured window), by load:", ""]
        lines += ["| strategy | " + " | ".join(f"{x:.0%}" for x in loads) + " |", "|---|" + "---|" * len(loads)]
        for strategy, per_load in churn.items():
            cells = [_cell(row.get("weight_changes_per_min"), "{:.1f}") for row in per_load]
            lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "| strategy | goodput at SLO (req/s) | share of capacity | first load over the SLO |",
        "|---|---|---|---|",
    ]
    for strategy, value in r["goodput"].items():
        per_load = r["strategies"][strategy]
        breaks = next(
            (
                f"{x:.0%}"
                for x, row in zip(loads, per_load, strict=True)
                if row["ttft_p99_ms"][0] > r["slo_ttft_p99_ms"]
            ),
            "none in the sweep",
        )
        lines.append(f"| {strategy} | {_cell(value, '{:.1f}')} | {value[0] / capacity:.0%} | {breaks} |")
    lines.append("")
    if any("incident_ttft_p99_ms" in rows[0] for rows in r["strategies"].values()):
        lines += ["Incident (requests arriving in the 60 s after the first event), at each load:", ""]
        lines += ["| strategy | " + " | ".join(f"{x:.0%}: P99 TTFT / errors" for x in loads) + " |"]
        lines += ["|---|" + "---|" * len(loads)]
        for strategy, per_load in r["strategies"].items():
            cells = [
                f"{_cell(row.get('incident_ttft_p99_ms'))} / {_cell(row.get('incident_error_rate'), '{:.1%}')}"
                for row in per_load
            ]
            lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def plot(name: str, r: dict[str, Any], out: Path) -> list[str]:
    import matplotlib  # noqa: PLC0415 - optional, only for the report

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    files = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    loads = [x * 100 for x in r["loads"]]
    for ax, key, label in ((axes[0], "ttft_p50_ms", "P50"), (axes[1], "ttft_p99_ms", "P99")):
        for strategy, per_load in r["strategies"].items():
            med = [min(row[key][0], 1e6) if row[key] else math.nan for row in per_load]
            lo = [m - min(row[key][1], 1e6) if row[key] else 0 for m, row in zip(med, per_load, strict=True)]
            hi = [min(row[key][2], 1e6) - m if row[key] else 0 for m, row in zip(med, per_load, strict=True)]
            ax.errorbar(loads, med, yerr=[lo, hi], label=strategy, capsize=2, marker="o", markersize=3)
        ax.axhline(r["slo_ttft_p99_ms"], color="grey", linestyle=":", linewidth=1)
        ax.set_yscale("log")
        ax.set_xlabel("offered load (% of measured capacity)")
        ax.set_ylabel(f"{label} TTFT (ms, log)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{name}: TTFT vs offered load (median and interval over seeds)")
    fig.tight_layout()
    path = out / f"{name}-ttft-vs-load.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    files.append(path.name)
    weights = r.get("weights")
    if weights:
        fig, ax = plt.subplots(figsize=(7, 4))
        for server in sorted(weights[0][1]):
            ax.step([t for t, _ in weights], [w.get(server, 0) for _, w in weights], where="post", label=server)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("published endpoint weight")
        ax.set_title(f"{name}: sluice weights over time at {r['weights_load']:.0%} load (first seed)")
        ax.legend(fontsize=8)
        path = out / f"{name}-sluice-weights.png"
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        files.append(path.name)
    return files


def run(scenario_files: list[Path], out: Path, plots: bool = True, jobs: int | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    jobs = jobs or int(os.environ.get("SLUICE_BENCH_JOBS", "2"))
    scenarios = [load(p) for p in scenario_files]
    results: dict[str, Any] = {"scenarios": {}}
    sections: list[str] = []
    pairs = sorted({(s.hardware, sc.model) for sc in scenarios for s in sc.servers})
    rows = [calibration.calibrate(h, m) for h, m in pairs]
    results["calibration"] = [r.__dict__ for r in rows]
    for scenario in scenarios:
        r = run_scenario(scenario, jobs)
        results["scenarios"][scenario.name] = r
        sections += scenario_section(scenario.name, r)
        if plots:
            for file in plot(scenario.name, r, out):
                sections += [f"![{file}]({file})", ""]
        sections.append(
            f"_{scenario.name}: {len(r['loads'])} loads × {len(r['seeds'])} seeds × "
            f"{len(r['strategies'])} strategies simulated in {r['seconds']:.0f} s._\n"
        )
        print(f"{scenario.name}: {r['seconds']:.0f} s", flush=True)
        # The first sweep point's trace, for replaying the same arrivals elsewhere (inference-perf's trace replay).
        work = scenario.workload
        trace = make_trace(work, scenario.loads[0] * r["capacity"], work.duration, scenario.seed, 1)
        write_azure_csv(trace, out / f"{scenario.name}-trace.csv")
    results["seconds"] = time.perf_counter() - started
    text = render(results, sections)
    results["targets"] = targets.check(results["scenarios"])
    results["issue_targets"] = targets.issue_checks(results["scenarios"])
    (out / "results.json").write_text(json.dumps(results, indent=2, default=_json) + "\n")
    (out / "report.md").write_text(text)
    print(targets.table(results["targets"]))
    print(targets.issue_table(results["issue_targets"]))
    return results


def render(results: dict[str, Any], sections: list[str]) -> str:
    """The report's text from the results: the calibration, the issue's targets, the targets, the sections."""
    checks = targets.check(results["scenarios"])
    issue = targets.issue_checks(results["scenarios"])
    rows = [calibration.Calibration(**row) for row in results["calibration"]]
    head = [
        "# sluice routing benchmark",
        "",
        "## Calibration of the simulated servers",
        "",
        calibration.table(rows),
        "",
        f"Prefill estimate at {calibration.PREFILL_UTILISATION:.0%} of peak "
        "FLOP/s over 2 × parameters; decode estimate (weights + KV read) over peak bandwidth.",
        "",
        "## The routing issue's targets: headroom (sluice) and the cube (sluice-cube) on the same runs",
        "",
        targets.issue_table(issue),
        "",
        "## Targets",
        "",
        targets.table(checks),
        "",
    ]
    return "\n".join(head + sections + [f"_Total: {results['seconds']:.0f} s._", ""])


def rerender(results_file: Path, scenario_files: list[Path], out: Path) -> str:
    """The report again from a stored results.json, without simulating: the figures are the stored ones; the
    scenarios' labels (description, held out, same traces as) are refreshed from their current files. Plots are
    linked if present next to the results."""
    results = json.loads(results_file.read_text())
    for scenario in (load(p) for p in scenario_files):
        if scenario.name in results["scenarios"]:
            r = results["scenarios"][scenario.name]
            r.update(description=scenario.description, held_out=scenario.held_out)
            r["same_traces_as"] = scenario.same_traces_as
    sections: list[str] = []
    for name, r in results["scenarios"].items():
        sections += scenario_section(name, r)
        for file in (f"{name}-ttft-vs-load.png", f"{name}-sluice-weights.png"):
            if (results_file.parent / file).exists():
                sections += [f"![{file}]({file})", ""]
        sections.append(
            f"_{name}: {len(r['loads'])} loads × {len(r['seeds'])} seeds × "
            f"{len(r['strategies'])} strategies simulated in {r['seconds']:.0f} s._\n"
        )
    text = render(results, sections)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text)
    return text


def _json(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return str(value)
