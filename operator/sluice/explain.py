"""Human-readable views of a pool's status: the per-pod table and the summary lines. Pure.

Used by `sluice plan` (stderr) and by the live views of the demo.
"""

from __future__ import annotations

from sluice.api.v1alpha1 import Condition, EndpointStatus, InferencePoolStatus, ScoringSpec, SignalChecks


def _num(value: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, fmt)


def endpoint_table(rows: list[EndpointStatus]) -> str:
    """One line per pod. SCORE is the cube's score, or under the headroom policy the learned capacity (req/s);
    IDLE is headroom's learned idle TTFT; REASON spells out capacity, its source and the planned share."""
    header = (
        "POD",
        "REV",
        "CLASS",
        "K",
        "TTFT",
        "P95",
        "KV",
        "QUEUE",
        "ERR",
        "RPS",
        "SCORE",
        "IDLE",
        "WEIGHT",
        "STATE",
        "REASON",
    )
    lines = [header]
    for row in rows:
        s = row.signals
        lines.append(
            (
                row.pod,
                row.revision or "-",
                row.hardware_class or "-",
                f"{row.capacity:g}",
                _num(s.ttft_seconds, ".0f", 1000) + ("ms" if s.ttft_seconds is not None else ""),
                _num(s.ttft_p95_seconds, ".0f", 1000) + ("ms" if s.ttft_p95_seconds is not None else ""),
                _num(s.kv_cache_usage, ".0%"),
                _num(s.queue_length, ".0f"),
                _num(s.error_rate, ".1%"),
                _num(s.request_rate, ".1f"),
                f"{row.score:.2f}",
                _num(row.idle_ttft_seconds, ".0f", 1000) + ("ms" if row.idle_ttft_seconds is not None else ""),
                str(row.weight),
                row.state,
                row.reason,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line[:-1], widths, strict=True)) + "  " + line[-1]
        for line in lines
    )


def scoring_line(scoring: ScoringSpec) -> str:
    """The weight policy and its knobs, as `sluice plan` prints them under the table."""
    if scoring.policy == "headroom":
        return (
            f"scoring: headroom (targetUtilization {scoring.target_utilization:g}, clientSidecars "
            f"{scoring.client_sidecars:g}, smoothing {scoring.smoothing:g}, hysteresis {scoring.hysteresis_percent:g}%)"
        )
    return (
        f"scoring: cube (sharpness {scoring.sharpness:g}, alpha {scoring.alpha:g}, smoothing {scoring.smoothing:g}, "
        f"hysteresis {scoring.hysteresis_percent:g}%)"
    )


def summary(status: InferencePoolStatus) -> str:
    lines = [f"routable pods: {status.routable}"]
    counted = status.endpoint_summary
    if counted is not None:
        states = ", ".join(f"{state} {n}" for state, n in counted.by_state.items())
        verdicts = ", ".join(f"{verdict} {n}" for verdict, n in counted.by_verdict.items())
        buckets = ", ".join(f"{b.low}-{b.high}: {b.pods}" for b in counted.weights)
        lines.append(
            f"rows: {counted.listed} of {counted.pods} pods listed ({counted.aggregated} plainly Routable pods "
            f"aggregated, {counted.unlisted} others over the row cap); every row: kubectl sluice plan"
        )
        lines.append(f"pods by state: {states}; by verdict: {verdicts}; weights: {buckets}")
    for condition in status.conditions:
        lines.append(f"{condition.type}={condition.status} ({condition.reason}): {condition.message}")
    if status.mesh is not None:
        m = status.mesh
        filters = f", EnvoyFilters in {', '.join(m.envoy_filter_namespaces)}" if m.envoy_filter_namespaces else ""
        waypoint = f" waypoint={m.waypoint}" if m.waypoint else ""
        lines.append(
            f"mesh: {m.dataplane}{waypoint}, port {m.service_port or '-'}, exportTo {','.join(m.export_to)}{filters}"
        )
    if status.revision_weights:
        split = ", ".join(f"{rev} {weight}%" for rev, weight in sorted(status.revision_weights.items()))
        lines.append(f"revision split: {split}")
    if status.canary is not None:
        c = status.canary
        step = "-" if c.step_index is None else str(c.step_index + 1)
        if c.stage == "Shadow" and c.phase not in ("Promoted", "Idle"):
            step = "shadow"
        mirror = f" mirror={c.mirror_percent:g}%" if c.mirror_percent is not None else ""
        mirror += f" abShare={c.ab_share:g}%" if c.ab_share is not None else ""
        lines.append(
            f"canary: {c.phase} stable={c.stable_revision or '-'} candidate={c.candidate_revision or '-'} "
            f"step={step} weight={c.weight}%{mirror} failedChecks={c.failed_checks} - {c.message}"
        )
        if c.shadow_verdict:
            lines.append(f"shadow: {c.shadow_verdict}")
    return "\n".join(lines)


def checks_report(checks: SignalChecks, ready: Condition | None) -> str:
    """The preflight (`status.signalChecks`) as `kubectl sluice doctor` prints it: one line per signal, then
    what is wrong and how to fix it."""
    head = f"engine {checks.engine}, checked {checks.checked_at.isoformat() if checks.checked_at else 'never'}"
    if checks.samples_per_window is not None:
        head += f", {checks.samples_per_window:g} samples per metrics.window (median over the pods)"
    lines = [head, f"{'SIGNAL':<16} {'STATE':<12} {'PODS OK':>7} {'AFFECTED':>8} {'OLDEST':>7}  SERIES"]
    for check in checks.signals:
        oldest = f"{check.oldest_sample_seconds}s" if check.oldest_sample_seconds is not None else "-"
        series = " | ".join(check.series) or "-"
        lines.append(
            f"{check.signal:<16} {check.state:<12} {check.pods_ok:>7} {check.pods_affected:>8} {oldest:>7}  {series}"
        )
    findings = [check for check in checks.signals if check.state not in ("Ok", "NotProvided")]
    for check in findings:
        lines.append(f"\n{check.signal}: {check.state}: {check.message}")
        if check.fix:
            lines.append(f"  fix: {check.fix}")
    absent = [check for check in checks.signals if check.state == "NotProvided"]
    if absent:
        lines.append("\nnot provided:" + "".join(f"\n  {check.signal}: {check.message}" for check in absent))
    if ready is not None:
        lines.append(f"\nSignalsReady={ready.status} ({ready.reason}): {ready.message}")
    return "\n".join(lines) + "\n"
