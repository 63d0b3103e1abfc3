"""Run benchmark scenarios and write `results.json`, `report.md` and PNG plots. Called by `sluice bench`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from sluice.bench.scenario import Scenario, load
from sluice.bench.sim import STRATEGIES, RunResult, Simulation, summarise

COLUMNS = [
    ("ttft_mean_ms", "mean TTFT", "{:.1f} ms"),
    ("ttft_p50_ms", "P50", "{:.0f} ms"),
    ("ttft_p90_ms", "P90", "{:.0f} ms"),
    ("ttft_p99_ms", "P99 TTFT", "{:.0f} ms"),
    ("e2e_p99_ms", "E2E P99", "{:.0f} ms"),
    ("output_tokens_per_s", "output tok/s", "{:.0f}"),
    ("completed", "completed", "{}"),
    ("failed", "failed", "{}"),
    ("slowest_class_share", "on slowest class", "{:.1%}"),
]


def run_scenario(scenario: Scenario) -> tuple[dict[str, dict[str, Any]], dict[str, RunResult], float]:
    started = time.perf_counter()
    hardware = {s.name: s.hardware for s in scenario.servers}
    figures: dict[str, dict[str, Any]] = {}
    runs: dict[str, RunResult] = {}
    for strategy in scenario.strategies or STRATEGIES:
        result = Simulation(scenario, strategy).run()
        runs[strategy] = result
        figures[strategy] = summarise(result, hardware)
    for strategy, row in figures.items():
        for reference in ("round-robin", "least-request", "oracle"):
            base = figures.get(reference)
            if base is None or strategy == reference:
                continue
            for key in ("ttft_mean_ms", "ttft_p99_ms", "output_tokens_per_s"):
                if row.get(key) is not None and base.get(key):
                    row[f"{key}_vs_{reference}"] = row[key] / base[key]
    return figures, runs, time.perf_counter() - started


def _fmt(value: Any, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def table(figures: dict[str, dict[str, Any]]) -> str:
    head = "| strategy | " + " | ".join(label for _, label, _ in COLUMNS) + " | P99 vs RR | P99 vs LR |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 3)]
    for strategy, row in figures.items():
        cells = [_fmt(row.get(key), pattern) for key, _, pattern in COLUMNS]
        vs_rr = _fmt(row.get("ttft_p99_ms_vs_round-robin"), "{:.2f}x")
        vs_lr = _fmt(row.get("ttft_p99_ms_vs_least-request"), "{:.2f}x")
        lines.append(f"| {strategy} | " + " | ".join(cells) + f" | {vs_rr} | {vs_lr} |")
    return "\n".join(lines)


def plot(name: str, runs: dict[str, RunResult], out: Path) -> list[str]:
    import matplotlib  # noqa: PLC0415 - optional, only for the report

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    files = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for strategy, result in runs.items():
        ttfts = sorted(
            o.ttft * 1000 for o in result.outcomes if o.ok and o.ttft is not None and o.req_id >= result.warm_up
        )
        if ttfts:
            ax.plot(ttfts, [i / len(ttfts) for i in range(1, len(ttfts) + 1)], label=strategy)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"{name}: TTFT CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    path = out / f"{name}-ttft-cdf.png"
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    files.append(path.name)
    sluice = runs.get("sluice")
    if sluice is not None and sluice.weights:
        fig, ax = plt.subplots(figsize=(7, 4))
        names = sorted(sluice.weights[0][1])
        times = [t for t, _ in sluice.weights]
        for server in names:
            ax.step(times, [w.get(server, 0) for _, w in sluice.weights], where="post", label=server)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("published endpoint weight")
        ax.set_title(f"{name}: sluice weights over time")
        ax.legend(fontsize=8)
        path = out / f"{name}-sluice-weights.png"
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        files.append(path.name)
    return files


def _ratio(figures: dict[str, Any], strategy: str, key: str, reference: str) -> float | None:
    a, b = figures.get(strategy, {}).get(key), figures.get(reference, {}).get(key)
    return a / b if a is not None and b else None


def targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """The benchmark's stated targets, each with the measured value and whether it is met (None: not run)."""
    out: list[tuple[str, str, bool | None]] = []

    def check(label: str, value: float | None, limit: float, below: bool = True, unit: str = "x") -> None:
        if value is None:
            out.append((label, "not run", None))
            return
        met = value <= limit if below else value >= limit
        out.append((label, f"{value:.2f}{unit} (target {'<=' if below else '>='} {limit:g}{unit})", met))

    seed = results.get("seed-000", {}).get("strategies", {})
    if seed:
        check("seed-000: sluice mean TTFT vs round robin", _ratio(seed, "sluice", "ttft_mean_ms", "round-robin"), 0.25)
        check("seed-000: sluice P99 TTFT vs round robin", _ratio(seed, "sluice", "ttft_p99_ms", "round-robin"), 0.10)
        check("seed-000: sluice P99 TTFT vs least-request", _ratio(seed, "sluice", "ttft_p99_ms", "least-request"), 0.5)
        check(
            "seed-000: sluice throughput vs least-request",
            _ratio(seed, "sluice", "output_tokens_per_s", "least-request"),
            1.0,
            below=False,
        )
        check("seed-000: sluice P99 TTFT vs oracle", _ratio(seed, "sluice", "ttft_p99_ms", "oracle"), 1.5)
    homo = results.get("homogeneous", {}).get("strategies", {})
    if homo:
        worst = max(
            abs((_ratio(homo, "sluice", key, "least-request") or 1.0) - 1.0)
            for key in ("ttft_mean_ms", "ttft_p99_ms", "e2e_p99_ms", "output_tokens_per_s")
        )
        check("homogeneous: largest difference to least-request (mean, P99, E2E P99, tok/s)", worst * 100, 5, unit="%")
    for name in ("degrading-node", "bad-canary"):
        figs = results.get(name, {}).get("strategies", {})
        if figs:
            key = "incident_ttft_p99_ms"
            check(f"{name}: incident P99 TTFT vs least-request", _ratio(figs, "sluice", key, "least-request"), 1.0)
            sluice_err = figs.get("sluice", {}).get("incident_error_rate")
            lr_err = figs.get("least-request", {}).get("incident_error_rate")
            if sluice_err is not None and lr_err is not None:
                out.append(
                    (
                        f"{name}: incident error rate, sluice vs least-request",
                        f"{sluice_err:.2%} vs {lr_err:.2%}",
                        sluice_err <= lr_err,
                    )
                )
    return out


def run(scenario_files: list[Path], out: Path, plots: bool = True) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    sections = ["# sluice routing benchmark", ""]
    for path in scenario_files:
        scenario = load(path)
        figures, runs, seconds = run_scenario(scenario)
        results[scenario.name] = {"description": scenario.description, "seconds": seconds, "strategies": figures}
        sections += [f"## {scenario.name}", "", scenario.description.strip(), "", table(figures), ""]
        sections.append(f"_{scenario.workload.requests} requests per strategy, simulated in {seconds:.1f} s._")
        if plots:
            for file in plot(scenario.name, runs, out):
                sections += ["", f"![{file}]({file})"]
        sections.append("")
        print(f"{scenario.name} ({seconds:.1f}s)\n{table(figures)}\n", flush=True)
    checks = targets(results)
    if checks:
        lines = ["## Targets", "", "| target | measured | met |", "|---|---|---|"]
        lines += [
            f"| {label} | {value} | {'-' if met is None else ('yes' if met else '**no**')} |"
            for label, value, met in checks
        ]
        sections = sections[:2] + lines + [""] + sections[2:]
        print("\n".join(lines))
    results["targets"] = [{"target": label, "measured": value, "met": met} for label, value, met in checks]
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "report.md").write_text("\n".join(sections))
    return results
