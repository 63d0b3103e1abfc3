"""The run invariants over recorded evidence: each checker passes a clean history and reports the violation in a
history that has one (built here, one deliberate fault at a time)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from sluice.api.jsontypes import JsonObject, JsonValue
from sluice.core.shards import lease_body
from sluice.devstack.invariants import (
    CanaryRecord,
    LeaseSeen,
    PodGone,
    Version,
    Write,
    audit_writes,
    canary_records,
    canary_regressions,
    endpoint_addresses,
    foreign_writes,
    lease_records,
    pods_gone,
    recreation_loops,
    weight_after_deletion,
    writes_outside_terms,
)
from sluice.istio.ownership import MANAGED_BY, ORIGINAL_ANNOTATION, ownership


def service_entry(at: float, *ips: str, event: str = "MODIFIED") -> Version:
    endpoints: list[JsonValue] = [{"address": ip, "weight": 10} for ip in ips]
    body: JsonObject = {"metadata": {"name": "llama-endpoints", "namespace": "llm"}, "spec": {"endpoints": endpoints}}
    return Version(at, event, "serviceentries", "llama-endpoints", body)


# ------------------------------------------------------------------------------------ (a)


def test_a_pod_dropped_within_one_pass_of_its_deletion_is_clean() -> None:
    history = [service_entry(0.0, "10.0.0.1", "10.0.0.2", event="ADDED"), service_entry(11.5, "10.0.0.1")]
    gone = [PodGone("b", "10.0.0.2", 10.0)]
    assert weight_after_deletion(history, gone, one_pass=2.0) == []


def test_a_pod_still_listed_a_pass_after_its_deletion_is_a_violation() -> None:
    history = [service_entry(0.0, "10.0.0.1", "10.0.0.2", event="ADDED"), service_entry(13.0, "10.0.0.1")]
    (found,) = weight_after_deletion(history, [PodGone("b", "10.0.0.2", 10.0)], one_pass=2.0)
    assert found.invariant == "weight-after-deletion"
    assert "still has an endpoint" in found.detail


def test_a_pod_listed_again_after_it_was_dropped_is_a_violation() -> None:
    history = [
        service_entry(0.0, "10.0.0.1", "10.0.0.2", event="ADDED"),
        service_entry(11.0, "10.0.0.1"),
        service_entry(20.0, "10.0.0.1", "10.0.0.2"),
    ]
    (found,) = weight_after_deletion(history, [PodGone("b", "10.0.0.2", 10.0)], one_pass=2.0)
    assert "10.00s after" in found.detail


def test_pod_deletions_are_read_from_the_pod_versions() -> None:
    def pod(at: float, event: str, deleting: bool = False) -> Version:
        meta: JsonObject = {"name": "b", "namespace": "llm"}
        if deleting:
            meta["deletionTimestamp"] = "2026-12-05T01:00:00Z"
        return Version(at, event, "pods", "b", {"metadata": meta, "status": {"podIP": "10.0.0.2"}})

    assert pods_gone([pod(1.0, "ADDED"), pod(4.0, "MODIFIED", True), pod(6.0, "DELETED", True)]) == [
        PodGone("b", "10.0.0.2", 4.0)
    ]


# ------------------------------------------------------------------------------------ (b)


def virtual_service(
    at: float, labels: JsonObject, managers: list[JsonValue], annotations: JsonObject | None = None
) -> Version:
    meta: JsonObject = {"name": "llama", "namespace": "llm", "labels": labels, "managedFields": managers}
    if annotations:
        meta["annotations"] = annotations
    return Version(at, "MODIFIED", "virtualservices", "llama", {"metadata": meta, "spec": {}})


USER_ENTRY: JsonObject = {"manager": "kubectl-client-side-apply", "operation": "Update", "time": "2026-12-05T01:00:00Z"}
SLUICE_ENTRY: JsonObject = {"manager": "sluice", "operation": "Apply", "time": "2026-12-05T01:00:09Z"}


def test_sluice_writing_its_own_object_is_clean() -> None:
    ours: JsonObject = {**MANAGED_BY}
    history = [
        virtual_service(1.0, ours, [SLUICE_ENTRY]),
        virtual_service(9.0, ours, [{**SLUICE_ENTRY, "time": "2026-12-05T01:00:19Z"}]),
    ]
    assert foreign_writes(history) == []


def test_sluice_writing_a_users_object_is_a_violation() -> None:
    history = [virtual_service(1.0, {}, [USER_ENTRY]), virtual_service(9.0, {}, [USER_ENTRY, SLUICE_ENTRY])]
    (found,) = foreign_writes(history)
    assert (found.invariant, found.subject, found.at) == ("foreign-write", "virtualservices/llm/llama", 9.0)


def test_a_user_changing_their_own_object_and_an_adoption_are_clean() -> None:
    edited = {**USER_ENTRY, "time": "2026-12-05T01:00:05Z"}
    adopted = virtual_service(9.0, {**MANAGED_BY}, [edited, SLUICE_ENTRY], {ORIGINAL_ANNOTATION: "{}"})
    history = [virtual_service(1.0, {}, [USER_ENTRY]), virtual_service(5.0, {}, [edited]), adopted]
    assert foreign_writes(history) == []


# ------------------------------------------------------------------------------------ (c)


def churn(times: list[float]) -> list[Version]:
    body: JsonObject = {"metadata": {"name": "llama", "namespace": "llm"}}
    versions = [Version(0.0, "ADDED", "destinationrules", "llama", body)]
    for at in times:
        versions += [
            Version(at, "DELETED", "destinationrules", "llama", body),
            Version(at + 0.1, "ADDED", "destinationrules", "llama", body),
        ]
    return versions


def test_an_object_recreated_now_and_then_is_clean() -> None:
    assert recreation_loops(churn([10.0, 40.0, 70.0]), limit=2, window=30.0) == []


def test_an_object_recreated_in_a_loop_is_a_violation() -> None:
    (found,) = recreation_loops(churn([10.0, 12.0, 14.0, 16.0]), limit=2, window=30.0)
    assert found.invariant == "recreation-loop"
    assert "3 times within 30s" in found.detail


# ------------------------------------------------------------------------------------ (d)


def canary(at: float, phase: str, step: int | None, candidate: str = "v2", op: str = "") -> CanaryRecord:
    return CanaryRecord(at, "llama", phase, step, candidate, op)


def test_a_rollout_stepping_forward_rolling_back_and_retrying_is_clean() -> None:
    records = [
        canary(1, "Progressing", 0),
        canary(2, "Progressing", 1),
        canary(3, "RolledBack", 1),
        canary(4, "Progressing", 0, op="a:retry"),
        canary(5, "Progressing", 1, op="a:retry"),
        canary(6, "Promoted", 3, op="b:promote"),
        canary(7, "Progressing", 0, candidate="v3"),
        canary(8, "Progressing", 1, candidate="v3"),
        canary(9, "RolledBack", 0, candidate="v3"),  # failed checks, no operation
    ]
    assert canary_regressions(records) == []


def test_progress_lost_at_a_restart_is_a_violation() -> None:
    records = [canary(1, "Progressing", 1), canary(2, "Progressing", 2), canary(3, "Progressing", 0)]
    (found,) = canary_regressions(records)
    assert (found.at, found.detail) == (3, "stepIndex went back from 2 to 0 without a rollback")


def test_a_step_going_back_is_a_violation() -> None:
    (found,) = canary_regressions([canary(1, "Progressing", 1), canary(2, "Progressing", 0)])
    assert found.detail == "stepIndex went back from 1 to 0 without a rollback"


def test_a_skipped_step_is_a_violation() -> None:
    (found,) = canary_regressions([canary(1, "Progressing", 0), canary(2, "Progressing", 2)])
    assert found.detail == "stepIndex jumped from 0 to 2 without a promotion"


def test_a_step_dropped_mid_rollout_is_a_violation() -> None:
    (found,) = canary_regressions([canary(1, "Progressing", 1), canary(2, "Progressing", None)])
    assert "lost mid-rollout" in found.detail


def test_canary_records_are_read_from_pool_versions() -> None:
    body: JsonObject = {
        "metadata": {"name": "llama"},
        "status": {"canary": {"phase": "Progressing", "stepIndex": 1, "candidateRevision": "v2"}},
    }
    assert canary_records([Version(3.0, "MODIFIED", "inferencepools", "llama", body)]) == [
        CanaryRecord(3.0, "llama", "Progressing", 1, "v2", "")
    ]


# ------------------------------------------------------------------------------------ (e)


def leases() -> list[LeaseSeen]:
    return [
        LeaseSeen(0.0, "shard-0", "replica-a", 15.0),
        LeaseSeen(10.0, "shard-0", "replica-a", 15.0),
        LeaseSeen(40.0, "shard-0", "replica-b", 15.0),
    ]


def test_writes_within_the_writers_term_are_clean() -> None:
    writes = [Write(5.0, "replica-a", "shard-0", "pool/a"), Write(24.0, "replica-a", "shard-0", "pool/a")]
    writes.append(Write(41.0, "replica-b", "shard-0", "pool/a"))
    assert writes_outside_terms(writes, leases()) == []


def test_a_write_after_the_term_expired_is_a_violation() -> None:
    (found,) = writes_outside_terms([Write(26.0, "replica-a", "shard-0", "pool/a")], leases())
    assert found.detail == "written by replica-a 1.00s after its term on shard-0 ended"


def test_a_write_while_another_replica_holds_the_shard_is_a_violation() -> None:
    (found,) = writes_outside_terms([Write(41.0, "replica-a", "shard-0", "pool/a")], leases())
    assert found.detail == "written by replica-a while shard-0 was held by replica-b"


def test_sluice_writing_a_pools_status_is_not_a_foreign_write() -> None:
    meta: JsonObject = {"name": "llama", "namespace": "llm", "managedFields": [USER_ENTRY]}
    before = Version(1.0, "ADDED", "inferencepools", "llama", {"metadata": meta})
    after_meta: JsonObject = {**meta, "managedFields": [USER_ENTRY, SLUICE_ENTRY]}
    after = Version(3.0, "MODIFIED", "inferencepools", "llama", {"metadata": after_meta})
    assert foreign_writes([before, after]) == []


# ------------------------------------------------------------------------------------ a recorded run


RECORDED = Path(__file__).parent / "fixtures" / "faultrun-evidence.jsonl"
"""Evidence recorded by `tests/e2e/test_prom_faults.py` (bodies trimmed to what the checkers read): a foreign
DestinationRule sluice refused and then replaced once the user deleted it, and a pod deleted during a Prometheus
outage, dropped from the ServiceEntry 1.0 s later."""


def recorded() -> list[Version]:
    return [Version(**json.loads(line)) for line in RECORDED.read_text().splitlines()]


def test_the_recorded_run_breaks_no_invariant() -> None:
    evidence = recorded()
    gone = pods_gone(evidence)
    assert [g.pod for g in gone] == ["llama-a100-1"]
    assert weight_after_deletion(evidence, gone, one_pass=3.0) == []
    assert foreign_writes(evidence) == []
    assert recreation_loops(evidence, limit=2, window=60.0) == []


def test_the_recorded_run_without_the_write_that_dropped_the_deleted_pod_breaks_a() -> None:
    evidence = recorded()
    (gone,) = pods_gone(evidence)
    dropping = next(
        v
        for v in evidence
        if v.resource == "serviceentries" and v.at > gone.at and gone.ip not in endpoint_addresses(v.body)
    )
    (found,) = weight_after_deletion([v for v in evidence if v is not dropping], [gone], one_pass=3.0)
    assert found.invariant == "weight-after-deletion"


def test_the_recorded_run_with_sluice_writing_the_foreign_rule_breaks_b() -> None:
    evidence = recorded()
    foreign = next(v for v in evidence if v.resource == "destinationrules" and ownership(v.body, None) == "foreign")
    meta = foreign.body["metadata"]
    assert isinstance(meta, dict)
    entries = meta["managedFields"]
    assert isinstance(entries, list)
    meta = {**meta, "managedFields": [*entries, SLUICE_ENTRY]}
    written = Version(foreign.at + 0.5, "MODIFIED", foreign.resource, foreign.name, {**foreign.body, "metadata": meta})
    (found,) = foreign_writes([*evidence, written])
    assert found.subject == "destinationrules/llm/sluice-llama"


def test_the_recorded_run_with_the_rule_recreated_again_and_again_breaks_c() -> None:
    evidence = recorded()
    cycle = [v for v in evidence if v.resource == "destinationrules" and v.event in ("DELETED", "ADDED")][1:]
    assert [v.event for v in cycle] == ["DELETED", "ADDED"]
    last = max(v.at for v in evidence)
    again = [replace(v, at=last + 1 + i + (0.1 if v.event == "ADDED" else 0)) for i in range(3) for v in cycle]
    (found,) = recreation_loops([*evidence, *again], limit=2, window=60.0)
    assert found.invariant == "recreation-loop"


# ------------------------------------------------------------------------------------ (e) from Leases and the audit


def lease_version(at: float, holder: str | None) -> Version:
    body = lease_body("llm", "sluice", "sluice-shard-0-of-2", "shard", holder, "1", 10, "2026-12-05T01:00:00Z", False)
    return Version(at, "MODIFIED", "leases", "sluice-shard-0-of-2", body)


def answered(agent: str, name: str, code: str = "200", verb: str = "patch") -> dict[str, object]:
    """An audit entry as the emulator writes one once a write is answered (`ApiServer._audit_outcome`)."""
    return {
        "stage": "ResponseComplete",
        "user": "system:serviceaccount:llm:sluice",
        "verb": verb,
        "group": "inference.sluice.dev",
        "resource": "inferencepools",
        "subresource": "status",
        "namespace": "llm",
        "name": name,
        "userAgent": agent,
        "code": code,
    }


def test_a_write_after_the_writers_lease_expired_is_found_from_leases_and_the_audit() -> None:
    leases = lease_records([lease_version(0.0, "host-41-ab12cd"), lease_version(5.0, "host-41-ab12cd")])
    assert leases[-1] == LeaseSeen(5.0, "sluice-shard-0-of-2", "host-41-ab12cd", 10.0)
    audit = [
        (8.0, answered("sluice-operator/host-41 OpenAPI", "llama")),
        (12.0, answered("sluice-operator/host-41", "llama", code="409")),  # refused: nothing was written
        (16.5, answered("sluice-operator/host-41", "llama")),
        (17.0, answered("kubectl/v1.33", "llama")),  # not the operator
    ]
    writes = audit_writes(audit, ["host-41-ab12cd"], lambda resource, name: "sluice-shard-0-of-2")
    assert [(w.at, w.writer) for w in writes] == [(8.0, "host-41-ab12cd"), (16.5, "host-41-ab12cd")]
    (found,) = writes_outside_terms(writes, leases)
    assert (found.at, found.detail) == (
        16.5,
        "written by host-41-ab12cd 1.50s after its term on sluice-shard-0-of-2 ended",
    )


def test_a_released_lease_ends_the_term_at_once() -> None:
    leases = lease_records([lease_version(0.0, "host-41-ab12cd"), lease_version(3.0, None)])
    writes = audit_writes(
        [(4.0, answered("sluice-operator/host-41", "llama"))], ["host-41-ab12cd"], lambda r, n: "sluice-shard-0-of-2"
    )
    (found,) = writes_outside_terms(writes, leases)
    assert found.detail == "written by host-41-ab12cd while sluice-shard-0-of-2 was held by nobody"


def test_member_leases_are_not_shard_terms() -> None:
    body = lease_body(
        "llm", "sluice", "sluice-member-x", "member", "host-41-ab12cd", "1", 10, "2026-12-05T01:00:00Z", False
    )
    assert lease_records([Version(1.0, "MODIFIED", "leases", "sluice-member-x", body)]) == []


def test_a_replica_started_with_an_identity_is_judged_under_it() -> None:
    """`--identity replica-a`: the holder is not `<host>-<pid>-<tag>`; the audit's writer is mapped to it."""
    leases = lease_records([lease_version(0.0, "replica-a"), lease_version(5.0, "replica-b")])
    audit = [
        (3.0, answered("sluice-operator/node-a-41", "llama")),
        (6.0, answered("sluice-operator/node-a-41", "llama")),
    ]
    writes = audit_writes(
        audit, ["replica-a", "replica-b"], lambda r, n: "sluice-shard-0-of-2", {"node-a-41": "replica-a"}
    )
    assert [w.writer for w in writes] == ["replica-a", "replica-a"]
    (found,) = writes_outside_terms(writes, leases)
    assert (found.at, found.detail) == (6.0, "written by replica-a while sluice-shard-0-of-2 was held by replica-b")
