"""A chaos run's results: one record per fault case, written as JSON and as the markdown report's table. Pure.

Local-stack tool, called by `sluice.devstack.chaos`. Every figure comes from the run: the seconds a fault was held
and the time to resume are measured on the runner's clock, the conditions from the recorded pool versions, the
Events and the operator's counters as differences between readings before and after the case.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sluice.devstack.chaoschecks import INVARIANTS, SHARDED_INVARIANTS


@dataclass(frozen=True)
class CaseResult:
    """What one fault case did."""

    name: str
    fault: str
    """What was done, in words."""
    held_seconds: float
    """From the fault's start to its end (the clear), measured."""
    resume_seconds: float | None
    """From the fault's end to the pools resumed (`sluice.devstack.chaos.RESUMED`); None: not within the wait."""
    interval_seconds: float
    conditions: Mapping[str, Sequence[str]]
    """Pool -> condition states shown during the case that differ from the pool's state before it."""
    events: Mapping[str, int]
    """`pool/Reason` -> Events emitted (new or counted again) during the case."""
    counters: Mapping[str, float]
    """The operator's counters that moved during the case (`name{label}` -> increase)."""
    served: Mapping[str, int]
    """Faults served per rule (API emulator) or per effect, as the injector counted them."""
    canary: tuple[str, str]
    """The canary pool's rollout before the case and after it."""
    canary_steps: Sequence[str]
    """Each change of the canary during the case, with its time from the fault's start."""
    window: tuple[float, float, float]
    """The fault's start, its end and the end of the case, on the evidence's clock (`evidence.jsonl`'s `at`)."""
    violations: Mapping[str, Sequence[str]]
    """Invariant letter -> violations (empty: held)."""
    blind_versions: Mapping[str, int] = field(default_factory=dict)
    """Pool -> the ServiceEntry versions (f) judged (present for each pool judged, 0 included)."""
    data_plane: Mapping[str, str] = field(default_factory=dict)
    """Pool -> what the data plane sent while it read no route (istiod down), against what sluice published; sluice
    itself cannot see it."""
    observed: Sequence[str] = field(default_factory=list)
    """What the run saw besides the columns (the sharded cases: the Leases' hand-overs, when the shards were
    shared evenly again, the replicas' logged shard transitions, the clock each replica stamps its Leases with)."""

    @property
    def held(self) -> bool:
        return not any(self.violations.values())


@dataclass(frozen=True)
class NotRun:
    """A case of the matrix that this run did not run, and why."""

    name: str
    reason: str


def results_json(cases: Sequence[CaseResult], not_run: Sequence[NotRun], meta: Mapping[str, str]) -> str:
    document = {
        "meta": dict(meta),
        "cases": [{**asdict(c), "held": c.held} for c in cases],
        "notRun": [asdict(n) for n in not_run],
    }
    return json.dumps(document, indent=2) + "\n"


def results_from_json(text: str) -> tuple[list[CaseResult], dict[str, str]]:
    """The cases and the run's description from `results_json`'s document (the report rendered again from them)."""
    document = json.loads(text)
    fields = set(CaseResult.__dataclass_fields__)
    cases = []
    for case in document["cases"]:
        kept = {k: v for k, v in case.items() if k in fields}
        kept["canary"], kept["window"] = tuple(kept["canary"]), tuple(kept["window"])
        cases.append(CaseResult(**kept))
    return cases, dict(document["meta"])


def _resume(case: CaseResult) -> str:
    if case.resume_seconds is None:
        return "**not resumed** within the wait"
    intervals = case.resume_seconds / case.interval_seconds
    return f"{case.resume_seconds:.1f} s ({intervals:.1f} intervals)"


def _reported(case: CaseResult) -> str:
    parts = []
    for pool, states in case.conditions.items():
        parts.append(f"{pool}: " + (", ".join(states) if states else "no condition changed"))
    if case.events:
        parts.append("Events: " + ", ".join(f"{k} ×{n}" for k, n in sorted(case.events.items())))
    if case.counters:
        parts.append("counters: " + ", ".join(f"{k} +{v:g}" for k, v in sorted(case.counters.items())))
    if case.served:
        parts.append("faults served: " + ", ".join(f"{k} {n}" for k, n in sorted(case.served.items())))
    for pool, seen in case.data_plane.items():
        parts.append(f"data plane, unseen by sluice: {pool}: {seen}")
    parts += [f"seen: {line}" for line in case.observed]
    return "<br>".join(parts).replace("|", "\\|")


def _invariants(case: CaseResult) -> str:
    cells = []
    for letter, found in case.violations.items():
        cells.append(f"({letter}) held" if not found else f"**({letter}) broken: {len(found)}**")
        if letter == "f":
            judged = sum(case.blind_versions.values())
            cells[-1] += f" ({judged} ServiceEntry version{'' if judged == 1 else 's'} judged)"
    return ", ".join(cells)


def report_table(cases: Sequence[CaseResult]) -> str:
    """The markdown table: one row per case."""
    lines = [
        "| fault | held | what sluice reported (conditions, Events, counters) | time to resume "
        "| canary (before → after) | invariants |",
        "|---|---|---|---|---|---|",
    ]
    for case in cases:
        steps = f" (changes: {'; '.join(case.canary_steps)})" if case.canary_steps else ""
        canary = f"{case.canary[0]} → {case.canary[1]}{steps}"
        lines.append(
            f"| **{case.name}**: {case.fault} | {case.held_seconds:.1f} s | {_reported(case)} | {_resume(case)} "
            f"| {canary} | {_invariants(case)} |"
        )
    return "\n".join(lines) + "\n"


RESUME_TARGET = 2
"""Intervals from a fault's end to the pools resumed: the matrix's target."""


def findings(cases: Sequence[CaseResult]) -> str:
    """Every violation, every case that did not resume or resumed later than the target, named (or a line saying
    there were none)."""
    lines = []
    for case in cases:
        for letter, found in case.violations.items():
            named = {**INVARIANTS, **SHARDED_INVARIANTS}[letter]
            lines += [f"- {case.name}, ({letter}) {named}: {v}" for v in found]
        if case.resume_seconds is None:
            lines.append(f"- {case.name}: the pools had not resumed when the runner stopped waiting")
        elif case.resume_seconds > RESUME_TARGET * case.interval_seconds:
            intervals = case.resume_seconds / case.interval_seconds
            lines.append(
                f"- {case.name}: resumed {case.resume_seconds:.1f} s after the fault ended, {intervals:.1f} intervals "
                f"(target: {RESUME_TARGET})"
            )
    done = "None: every invariant held and every case resumed within the target.\n"
    return "\n".join(lines) + "\n" if lines else done


def not_run_list(not_run: Sequence[NotRun]) -> str:
    if not not_run:
        return "None: every case was run (the sharded scene's in the section above, when its results exist).\n"
    return "".join(f"- **{n.name}** — not yet run: {n.reason}\n" for n in not_run)


NOT_RUN: tuple[NotRun, ...] = ()
"""Every case runs: istiod down in the matrix, clock skew, a partition and (e) in the sharded scene
(`sharded_section`)."""


SHARDED_RESULTS = "out/chaos-shards/results.json"


def sharded_section(document: Mapping[str, Any] | None) -> str:
    """The sharded scene's cases (`make chaos-shards`: `python -m sluice.devstack.chaos --sharded`), from that
    run's results.json; a paragraph saying it was not run without them."""
    heading = "## Sharded replicas: a partition and clock skew\n\n"
    if not document or not document.get("cases"):
        return heading + (
            f"Not run with this report: `make chaos-shards` writes {SHARDED_RESULTS}. Without it, clock skew between "
            "replicas, a replica partitioned from the API server and (e) no write outside a shard term are not run "
            "(this run's single replica has no shard Leases).\n"
        )
    cases, meta = results_from_json(json.dumps(document))
    letters = "; ".join(f"({k}) {v}" for k, v in {**INVARIANTS, **SHARDED_INVARIANTS}.items())
    return (
        heading + f"`make chaos-shards` (`python -m sluice.devstack.chaos --sharded`, {meta['form']}) at commit "
        f"{meta['commit']}, {meta['started']}, on a {meta['cpus']}-core machine{_load(meta)}. Every figure below "
        "was measured by that run.\n\n"
        f"One local stack: {meta.get('pools', '')}. The replicas are the only ones sharing the pools; the runner "
        "and the recorder reach the API emulator directly. The cases run in sequence; each is cleared before the "
        "next, and the next begins once the shards are shared evenly again. The columns as in the matrix above "
        f'(time to resume: {meta["resumed"]}, summed over both replicas\' /metrics); "seen" lines: the shard '
        "Leases' hand-overs and when the shards were shared evenly again (from the Lease versions the recorder "
        "saw), the shard transitions each replica logged, and each replica's `renewTime` minus the moment the "
        "recorder saw it on the emulator's clock (the same machine's; a little under 0 is the watch's delivery), "
        f"so a shifted clock shows as its offset. Invariants: {letters}; (e) judges every write of a replica to "
        "a pool (its status, Events, Istio objects) answered 2xx in the audit log against the last version of "
        "the pool's shard Lease seen before it: another holder, none, or a renewal older than the Lease's "
        "duration is a violation.\n\n" + report_table(cases) + "\n" + findings(cases)
    )


def scale_section(scale: Mapping[str, Any] | None) -> str:
    """The sharded replicas under API pressure (`make chaos-scale`, benchmarks/bench_shards.py --api-pressure),
    from that run's results.json as it wrote them; a line saying it was not run without them."""
    heading = "## Sharded replicas under API pressure\n\n"
    scale = scale or {}
    runs = [r for r in scale.get("results", []) if "oldest_last_pass_intervals" in r]
    if not runs:
        return heading + "Not run with this report: `make chaos-scale` writes out/chaos-scale/results.json.\n"
    machine = scale.get("machine", {})
    lines = [
        f"`make chaos-scale` (benchmarks/bench_shards.py --api-pressure) at commit {scale.get('commit', 'unknown')}"
        f", {scale.get('started', 'unknown')}, on a {machine.get('cpus', '?')}-core machine (the API emulator, "
        "Prometheus and every replica on it). Sharded replicas (`--shards`) while the API emulator answers them "
        "with latency and 429s; every 2 s of the measured window each pool's last pass start is read from every "
        "replica's `sluice_last_pass_timestamp_seconds`, and each pool's oldest age is kept. Target: every pool "
        "younger than 3 intervals (a figure, not asserted in CI).\n\n"
        "| pools | replicas | workers each | interval | API faults (served) | measured | oldest last pass "
        "| median pool's oldest | pools under 3 intervals | passes/s (wanted) |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    ]
    for r in runs:
        served = ", ".join(f"{k} {v}" for k, v in r.get("faults_served", {}).items())
        lines.append(
            f"| {r['pools']} | {r['replicas']} | {r.get('workers', '?')} | {r['interval_s']} s "
            f"| {r['api_pressure']} ({served}) "
            f"| {r['measure_seconds']:g} s | {r['oldest_last_pass_intervals']:.2f} intervals "
            f"| {r['median_oldest_last_pass_intervals']:.2f} | {r['pools_younger_than_3_intervals']} of {r['pools']} "
            f"| {r['passes_per_s']:g} ({r['expected_passes_per_s']:g}) |\n"
        )
    return heading + "".join(lines)


def _load(meta: Mapping[str, str]) -> str:
    """The machine's load as the run recorded it (the 1-minute load average at its start and end)."""
    if "load" not in meta:
        return ""
    return f" whose 1-minute load average was {meta['load']} (wall-clock figures grow with it)"


def report_markdown(
    cases: Sequence[CaseResult],
    not_run: Sequence[NotRun],
    meta: Mapping[str, str],
    scale: Mapping[str, Any] | None = None,
    sharded: Mapping[str, Any] | None = None,
) -> str:
    """The whole report: how it was run, what the columns mean, the table, the findings, the sharded replicas under
    API pressure (`scale_section`), the sharded scene's cases (`sharded_section`), what was not run."""
    letters = "; ".join(f"({k}) {v}" for k, v in INVARIANTS.items())
    return (
        "# Chaos report\n\n"
        f"Generated by `make chaos` (`python -m sluice.devstack.chaos`, {meta['form']}) at commit {meta['commit']}, "
        f"{meta['started']}, on a {meta['cpus']}-core machine{_load(meta)}. Every figure below was measured by that "
        "run.\n\n"
        "One local stack (API emulator, real Prometheus behind the fault proxy, simulated vLLM pods, one operator "
        f"process) with two pools at a {meta['interval']} interval, both under load: {meta.get('pools', '')}. "
        "The cases run in sequence on that stack; the faults are cleared between them.\n\n"
        "- **held**: from the fault's injection to its end (the clear), measured.\n"
        f"- **time to resume**: {meta['resumed']}. In intervals: seconds / the pools' interval; the target is two.\n"
        "- **what sluice reported**: the condition states the pools showed during the case that differ from their "
        "state before it (from every pool version the API server's watch delivered), the Events emitted or "
        "counted again during the case, and the operator's counters that moved (`/metrics`, summed over pools).\n"
        f"- **invariants**, checked by code over the recorded evidence (`sluice.devstack.chaoschecks`): {letters}. "
        "(f) is judged for each pool whose status versions showed MetricsAvailable=False during the case (read "
        "from the evidence, in every case), from the ServiceEntry of its last pass that was not blind to its last "
        "blind status, and over the span in which no operator ran (SIGKILL: nothing can write then, so that span "
        "holds no version by construction). Each (f) cell gives the ServiceEntry versions it judged: 0 means no "
        "version was written while blind (sluice skips writing an object that would not change), so there was "
        "nothing to compare.\n\n"
        "## The matrix\n\n"
        + report_table(cases)
        + "\n## Findings\n\n"
        + findings(cases)
        + "\n"
        + scale_section(scale)
        + "\n"
        + sharded_section(sharded)
        + "\n## Not yet run\n\n"
        + not_run_list(not_run)
    )


__all__ = [
    "NOT_RUN",
    "CaseResult",
    "NotRun",
    "findings",
    "not_run_list",
    "report_markdown",
    "report_table",
    "results_from_json",
    "results_json",
    "scale_section",
    "sharded_section",
]
