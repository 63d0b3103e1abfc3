"""A chaos case judged over recorded evidence: the weights kept while the control plane is blind, the conditions a
pool showed, the violations counted for the case they happened in, and the report's rows."""

from __future__ import annotations

import json

from sluice.api.jsontypes import JsonObject, JsonValue
from sluice.devstack.chaoschecks import (
    Window,
    blind_spans,
    canary_changes,
    case_violations,
    conditions_seen,
    weights_kept,
)
from sluice.devstack.chaosreport import (
    NOT_RUN,
    CaseResult,
    findings,
    report_markdown,
    report_table,
    results_from_json,
    results_json,
)
from sluice.devstack.invariants import PodGone, Version


def entry(at: float, weights: dict[str, int], event: str = "MODIFIED") -> Version:
    endpoints: list[JsonValue] = [{"address": ip, "weight": w} for ip, w in weights.items()]
    body: JsonObject = {"metadata": {"name": "sluice-llama", "namespace": "llm"}, "spec": {"endpoints": endpoints}}
    return Version(at, event, "serviceentries", "sluice-llama", body)


def pool(at: float, **conditions: tuple[str, str]) -> Version:
    listed: list[JsonValue] = [{"type": k, "status": s, "reason": r} for k, (s, r) in conditions.items()]
    body: JsonObject = {"metadata": {"name": "llama", "namespace": "llm"}, "status": {"conditions": listed}}
    return Version(at, "MODIFIED", "inferencepools", "llama", body)


BEFORE = {"10.0.0.1": 60, "10.0.0.2": 40}


def test_the_same_weights_written_again_while_blind_are_kept() -> None:
    history = [entry(0.0, BEFORE, "ADDED"), entry(12.0, BEFORE)]
    assert weights_kept(history, "sluice-llama", 10.0, 30.0, []) == ([], 1)


def test_a_weight_changed_while_blind_is_a_violation_naming_the_endpoint() -> None:
    history = [entry(0.0, BEFORE, "ADDED"), entry(12.0, {"10.0.0.1": 70, "10.0.0.2": 30})]
    (found,), _ = weights_kept(history, "sluice-llama", 10.0, 30.0, [])
    assert found.invariant == "weights-kept"
    assert "10.0.0.1 60->70" in found.detail


def test_a_deleted_pods_endpoint_may_leave_while_blind() -> None:
    history = [entry(0.0, BEFORE, "ADDED"), entry(12.0, {"10.0.0.1": 60})]
    assert weights_kept(history, "sluice-llama", 10.0, 30.0, [PodGone("b", "10.0.0.2", 11.0)]) == ([], 1)


def test_the_service_entry_deleted_while_blind_is_a_violation() -> None:
    history = [entry(0.0, BEFORE, "ADDED"), entry(12.0, BEFORE, "DELETED")]
    (found,), _ = weights_kept(history, "sluice-llama", 10.0, 30.0, [])
    assert "deleted" in found.detail


def test_changes_before_the_blindness_and_after_its_end_are_not_judged() -> None:
    history = [entry(0.0, BEFORE, "ADDED"), entry(5.0, {"10.0.0.1": 50}), entry(31.0, {"10.0.0.1": 10})]
    assert weights_kept(history, "sluice-llama", 10.0, 30.0, []) == ([], 0)


CHANGED = {"10.0.0.1": 70, "10.0.0.2": 30}
ENTRIES = {"llama": "sluice-llama"}


def test_the_first_blind_pass_is_judged_against_the_last_pass_that_was_not_blind() -> None:
    # a pass publishes the ServiceEntry, then writes the status: the first blind pass's ServiceEntry (3.9) comes
    # before the first blind status (4.0), and the recovering pass's (7.9) before the status showing it (8.0)
    history = [
        entry(0.9, BEFORE, "ADDED"),
        pool(1.0, MetricsAvailable=("True", "Fresh")),
        entry(3.9, CHANGED),
        pool(4.0, MetricsAvailable=("False", "QueryFailed")),
        pool(6.0, MetricsAvailable=("False", "QueryFailed")),
        entry(7.9, {"10.0.0.1": 10, "10.0.0.2": 90}),
        pool(8.0, MetricsAvailable=("True", "Fresh")),
    ]
    found, judged = case_violations(history, Window(2.0, 7.0, 10.0), ENTRIES, one_pass=3.0)
    (violation,) = found["f"]
    assert "at 3.90s" in violation
    assert "10.0.0.1 60->70" in violation
    assert judged == {"llama": 1}


def test_blindness_is_judged_until_the_pool_sees_again_not_until_the_fault_was_cleared() -> None:
    history = [
        entry(0.9, BEFORE, "ADDED"),
        pool(1.0, MetricsAvailable=("True", "Fresh")),
        pool(4.0, MetricsAvailable=("False", "QueryFailed")),
        entry(8.9, CHANGED),  # after the clear (5.0), written by a pass that was still blind
        pool(9.0, MetricsAvailable=("False", "QueryFailed")),
        pool(11.0, MetricsAvailable=("True", "Fresh")),
    ]
    found, judged = case_violations(history, Window(2.0, 5.0, 14.0), ENTRIES, one_pass=3.0)
    assert len(found["f"]) == 1
    assert judged == {"llama": 1}


def test_blind_spans_run_from_the_last_sighted_status_to_the_last_blind_one_or_the_end() -> None:
    history = [
        pool(1.0, MetricsAvailable=("True", "Fresh")),
        pool(4.0, MetricsAvailable=("False", "QueryFailed")),
        pool(6.0, MetricsAvailable=("False", "QueryFailed")),
        pool(8.0, MetricsAvailable=("True", "Fresh")),
        pool(10.0, MetricsAvailable=("False", "QueryFailed")),
    ]
    assert blind_spans(history, "llama", 2.0, 12.0) == [(1.0, 6.0), (8.0, 12.0)]
    assert blind_spans(history, "llama", 9.0, 12.0) == [(8.0, 12.0)]  # the first began before the window
    assert blind_spans(history[:1], "llama", 0.0, 12.0) == []


def test_with_no_operator_running_the_faults_span_is_judged_and_counted_even_when_empty() -> None:
    history = [entry(0.9, BEFORE, "ADDED"), pool(1.0, MetricsAvailable=("True", "Fresh"))]
    found, judged = case_violations(history, Window(2.0, 7.0, 10.0, operator_down=True), ENTRIES, one_pass=3.0)
    assert found["f"] == []
    assert judged == {"llama": 0}


def test_conditions_seen_are_those_that_differ_from_the_baseline_each_once() -> None:
    baseline = {"MetricsAvailable": ("True", "Fresh"), "Ready": ("True", "WeightsPublished")}
    history = [
        pool(1.0, MetricsAvailable=("False", "QueryFailed"), Ready=("True", "WeightsPublished")),
        pool(2.0, MetricsAvailable=("False", "QueryFailed"), Ready=("True", "WeightsPublished")),
        pool(3.0, MetricsAvailable=("True", "Fresh"), Ready=("True", "WeightsPublished")),
    ]
    assert conditions_seen(history, "llama", baseline, 0.0, 10.0) == ["MetricsAvailable=False (QueryFailed)"]


def test_a_violation_counts_for_the_case_in_whose_window_it_happened() -> None:
    history = [
        entry(0.0, BEFORE, "ADDED"),
        Version(10.0, "DELETED", "pods", "b", {"metadata": {"name": "b"}, "status": {"podIP": "10.0.0.2"}}),
        entry(20.0, {"10.0.0.1": 60}),  # dropped 10 s after the deletion: (a) broken
    ]
    during, judged = case_violations(history, Window(5.0, 8.0, 25.0), {"llama": "sluice-llama"}, one_pass=3.0)
    assert len(during["a"]) == 1
    assert "f" not in during  # not blind: (f) is not judged
    assert judged == {}
    later, _ = case_violations(history, Window(30.0, 35.0, 40.0), {"llama": "sluice-llama"}, one_pass=3.0)
    assert later["a"] == []


def test_the_report_marks_a_broken_invariant_and_a_case_that_did_not_resume() -> None:
    case = CaseResult(
        name="prom-outage",
        fault="Prometheus refuses connections",
        held_seconds=20.0,
        resume_seconds=None,
        interval_seconds=2.0,
        conditions={"llama": ["MetricsAvailable=False (QueryFailed)"]},
        events={"llama/MetricsUnavailable": 1},
        counters={'sluice_reconcile_total{result="ok"}': 10},
        served={},
        canary=("Progressing step 1 (25%)", "Progressing step 2 (30%)"),
        canary_steps=["Progressing step 2 (30%) at +4.5 s"],
        window=(10.0, 30.0, 36.0),
        violations={"a": [], "f": ["weights-kept at 3.00s: serviceentries/sluice-llama: weights changed"]},
        blind_versions={"llama": 3, "mistral": 0},
        data_plane={"llama": "published v1 70%, v2 30%; the data plane sent v1 75%, v2 25%"},
    )
    row = report_table([case]).splitlines()[2]
    assert "data plane, unseen by sluice: llama: published v1 70%, v2 30%; the data plane sent v1 75%" in row
    assert "**(f) broken: 1** (3 ServiceEntry versions judged)" in row
    assert "**not resumed**" in row
    assert "(a) held" in row
    assert "**(f) broken: 1**" in row
    assert "MetricsAvailable=False (QueryFailed)" in row
    assert "Progressing step 1 (25%) → Progressing step 2 (30%) (changes: Progressing step 2 (30%) at +4.5 s)" in row
    assert "prom-outage, (f) last weights kept while blind: weights-kept" in findings([case])


def canary(at: float, phase: str, index: int, weight: int) -> Version:
    status: JsonObject = {"canary": {"phase": phase, "stepIndex": index, "weight": weight}}
    return Version(at, "MODIFIED", "inferencepools", "llama", {"metadata": {"name": "llama"}, "status": status})


def test_canary_changes_are_timed_from_the_faults_start() -> None:
    history = [
        canary(1.0, "Progressing", 0, 20),
        canary(12.0, "Progressing", 1, 25),
        canary(13.0, "Progressing", 1, 25),
    ]
    assert canary_changes(history, "llama", 10.0, 20.0, 10.0) == ["Progressing step 1 (25%) at +2.0 s"]
    assert canary_changes(history, "llama", 12.5, 20.0, 10.0) == []


def test_a_case_that_resumed_later_than_two_intervals_is_a_finding() -> None:
    case = CaseResult(
        name="prom-error",
        fault="Prometheus answers 500",
        held_seconds=20.0,
        resume_seconds=11.9,
        interval_seconds=2.0,
        conditions={},
        events={},
        counters={},
        served={},
        canary=("", ""),
        canary_steps=[],
        window=(0.0, 20.0, 34.0),
        violations={"a": []},
    )
    assert findings([case]) == "- prom-error: resumed 11.9 s after the fault ended, 6.0 intervals (target: 2)\n"
    on_time = CaseResult(**{**case.__dict__, "resume_seconds": 3.9})
    assert findings([on_time]).startswith("None")


def test_the_results_document_gives_back_the_cases_it_was_written_from() -> None:
    case = CaseResult(
        name="api-5xx",
        fault="bursts",
        held_seconds=20.1,
        resume_seconds=1.3,
        interval_seconds=2.0,
        conditions={"llama": ["Degraded=True (SignalsMissing)"]},
        events={"llama/CanaryAdvanced": 1},
        counters={"sluice_kube_retries_total": 18.0},
        served={"etcd-500": 12},
        canary=("Progressing step 0 (20%)", "Progressing step 1 (25%)"),
        canary_steps=["Progressing step 1 (25%) at +10.0 s"],
        window=(1.0, 21.1, 24.4),
        violations={"a": [], "f": []},
        blind_versions={"llama": 0},
        data_plane={"llama": "published v1 70%, v2 30%"},
    )
    cases, meta = results_from_json(results_json([case], NOT_RUN, {"commit": "abc"}))
    assert cases == [case]
    assert meta == {"commit": "abc"}


def test_the_reports_description_of_the_machine_and_the_pools_is_the_runs() -> None:
    meta = {
        "form": "fast cases",
        "commit": "abc",
        "started": "now",
        "cpus": "2",
        "interval": "2 s",
        "resumed": "r",
        "pools": "`llama` stepped every 9 s",
        "load": "0.50 at the start and 3.00 at the end",
    }
    text = report_markdown([], NOT_RUN, meta)
    assert "2-core machine whose 1-minute load average was 0.50 at the start and 3.00 at the end" in text
    assert "`llama` stepped every 9 s" in text
    assert "shared with other CPU-heavy processes" not in text
    assert "libfaketime is not installed" not in text


def test_the_sharded_run_under_api_pressure_is_reported_as_measured_or_said_not_run() -> None:
    meta = {"form": "f", "commit": "abc", "started": "now", "cpus": "2", "interval": "2 s", "resumed": "r"}
    assert "Not run with this report: `make chaos-scale`" in report_markdown([], NOT_RUN, meta)
    run = {
        "api_pressure": "latency p50 0.3 s, p99 2 s; 429 Retry-After 1 on every 20th request",
        "faults_served": {"slow": 9000, "apf-429": 450},
        "oldest_last_pass_intervals": 2.61,
        "median_oldest_last_pass_intervals": 1.2,
        "pools_younger_than_3_intervals": 300,
        "pools": 300,
        "replicas": 2,
        "workers": 16,
        "interval_s": 10,
        "passes_per_s": 29.1,
        "expected_passes_per_s": 30.0,
        "measure_seconds": 120.0,
    }
    text = report_markdown([], NOT_RUN, meta, {"machine": {"cpus": 2}, "commit": "def", "results": [run]})
    assert "at commit def" in text
    assert (
        "| 300 | 2 | 16 | 10 s | latency p50 0.3 s, p99 2 s; 429 Retry-After 1 on every 20th request (slow 9000, "
        "apf-429 450) | 120 s | 2.61 intervals | 1.20 | 300 of 300 | 29.1 (30) |"
    ) in text


def test_the_sharded_cases_are_reported_in_their_own_section_or_said_not_run() -> None:
    meta = {"form": "f", "commit": "abc", "started": "now", "cpus": "2", "interval": "2 s", "resumed": "r"}
    assert "Not run with this report: `make chaos-shards`" in report_markdown([], NOT_RUN, meta)
    case = CaseResult(
        name="replica-partition",
        fault="one replica's proxy drops every packet",
        held_seconds=15.0,
        resume_seconds=5.5,
        interval_seconds=2.0,
        conditions={"pool-0": []},
        events={},
        counters={},
        served={"connections left hanging": 16},
        canary=("Progressing step 0 (20%)", "Progressing step 0 (20%)"),
        canary_steps=[],
        window=(10.0, 25.0, 33.0),
        violations={"a": [], "e": ["write-outside-term at 26.00s: inferencepools/pool-1: written by replica-a"]},
        observed=["Lease hand-overs: sluice-shard-1-of-4 replica-a → replica-b at +10.8 s"],
    )
    document = results_json([case], (), {**meta, "load": "1.00 at the start and 2.00 at the end"})
    assert results_from_json(document)[0] == [case]
    text = report_markdown([], NOT_RUN, meta, sharded=json.loads(document))
    assert "## Sharded replicas: a partition and clock skew" in text
    assert "seen: Lease hand-overs: sluice-shard-1-of-4 replica-a → replica-b at +10.8 s" in text
    assert "**(e) broken: 1**" in text
    assert "replica-partition, (e) no write outside a shard term: write-outside-term" in text
    assert "load average was 1.00 at the start and 2.00 at the end" in text
    assert NOT_RUN == ()
    assert "## Not yet run\n\nNone: every case was run" in text
