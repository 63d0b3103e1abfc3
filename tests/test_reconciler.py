"""The one reconcile loop against the in-memory cluster: publish, prune, adopt and give back, status, Events,
and every error path. The pass is the real one; only what is behind the ports is memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast

import pytest

from sluice.api.snapshot import parse_snapshot
from sluice.core.observed import ObservedPod, PodSignals, SignalSnapshot
from sluice.io.kubereads import call
from sluice.io.memory import MemoryCluster
from sluice.io.ports import ClusterError
from sluice.runtime.metrics import OperatorMetrics
from sluice.runtime.reconciler import Reconciler
from tests.helpers import T0, at, sig
from tests.test_kube_cluster import SteppedTime, throttled

LABELS = {"app": "llama", "sluice.dev/hardware-class": "a100"}
PODS = [
    ObservedPod(name="a", ip="10.0.0.1", labels=LABELS, service_account="llama-sa"),
    ObservedPod(name="b", ip="10.0.0.2", labels=LABELS, service_account="llama-sa"),
]


class FakeProm:
    def __init__(self) -> None:
        self.ttft = 0.05
        self.kv = 0.2
        self.running = 1.0

    def read_signals(self, spec: Any, namespace: str, pods: list[str], auth: Any, now: Any) -> SignalSnapshot:
        signals = PodSignals(
            ttft_seconds=self.ttft, kv_cache_usage=self.kv, queue_length=0, running_requests=self.running
        )
        return SignalSnapshot(collected_at=now, pods=dict.fromkeys(pods, signals))


def body(status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "apiVersion": "inference.sluice.dev/v1alpha1",
        "kind": "InferencePool",
        "metadata": {"name": "llama", "namespace": "llm", "uid": "u1", "generation": 1},
        "spec": {"selector": {"matchLabels": {"app": "llama"}}, "targetPort": 8000, "service": "llama", **spec},
    }
    if status is not None:
        out["status"] = status
    return out


class Loop:
    """A reconciler over a memory cluster, driven pass by pass like the daemon drives it."""

    def __init__(self, **spec: Any) -> None:
        self.cluster = MemoryCluster(pod_list=list(PODS))
        self.prom = FakeProm()
        self.reconciler = Reconciler(self.cluster, self.prom)
        self.spec = spec
        self.status: dict[str, Any] | None = None

    def run(self, seconds: float, **spec: Any) -> Any:
        self.spec.update(spec)
        report = self.reconciler.run(parse_snapshot(body(self.status, **self.spec)), at(seconds))
        if self.cluster.statuses:
            self.status = self.cluster.statuses[-1][2]
        return report

    def kinds(self) -> set[tuple[str, str]]:
        return {(kind, name) for (_, kind, name) in self.cluster.objects}


def conditions_of(status: Any) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in status.conditions}


# ------------------------------------------------------------------------- publish and status


def test_a_pass_publishes_the_objects_and_writes_the_status_once():
    loop = Loop()
    report = loop.run(0)
    assert loop.kinds() == {
        ("ServiceEntry", "sluice-llama"),
        ("DestinationRule", "sluice-llama"),
        ("VirtualService", "sluice-llama"),
    }
    assert [w.action for w in report.writes] == ["created", "created", "created"]
    assert conditions_of(report.status)["IstioSynced"] == ("True", "Synced")
    assert report.status_written
    again = loop.run(5)
    assert {w.action for w in again.writes} == {"unchanged"}
    assert not again.status_written  # nothing changed: no status write
    assert not loop.run(10).status_written
    assert len(loop.cluster.statuses) == 1


def test_the_pass_after_a_weight_change_writes_no_status_when_it_changes_nothing():
    """The status says what is in sync, not what each pass wrote: when a pod's weight changes, that pass writes
    the status and the ServiceEntry; the next pass, with the same weights, writes neither (IstioSynced said
    "1 written this pass" at the first and not at the second, so each weight change cost two status writes)."""

    class Slowing(FakeProm):
        def read_signals(self, spec: Any, namespace: str, pods: list[str], auth: Any, now: Any) -> SignalSnapshot:
            fast = PodSignals(ttft_seconds=0.05, kv_cache_usage=0.2, queue_length=0, running_requests=1)
            slow = fast.model_copy(update={"ttft_seconds": self.ttft})
            return SignalSnapshot(collected_at=now, pods={p: slow if p == "a" else fast for p in pods})

    loop = Loop(scoring={"policy": "cube"})
    loop.reconciler.signals = prom = Slowing()

    def published() -> dict[str, int]:
        entry = loop.cluster.objects[("llm", "ServiceEntry", "sluice-llama")]
        return {e["address"]: int(e["weight"]) for e in entry["spec"]["endpoints"]}

    loop.run(0)
    loop.run(5)
    before, changed = published(), False
    prom.ttft = 0.1  # pod a slows down, and stays slow
    followed = 0
    for n in range(2, 12):
        report = loop.run(n * 5)
        now = published()
        if now != before:
            assert report.status_written, n
        elif changed:  # the pass right after a weight change, with the same weights
            assert not report.status_written, n
            followed += 1
        before, changed = now, now != before
    assert followed >= 1


def test_an_unchanged_status_is_still_written_as_a_heartbeat_after_a_minute():
    loop = Loop()
    loop.run(0)
    loop.run(5)
    assert not loop.run(30).status_written
    assert loop.run(66).status_written


def test_the_heartbeat_is_due_at_a_minute_exactly():
    loop = Loop()
    loop.run(0)
    assert not loop.run(59).status_written
    assert loop.run(60).status_written


def test_a_status_refresh_longer_than_a_minute_spaces_the_heartbeat_too():
    loop = Loop()
    loop.reconciler.status_refresh = timedelta(seconds=120)
    loop.run(0)
    assert not loop.run(60).status_written
    assert not loop.run(119).status_written
    assert loop.run(120).status_written


def test_a_status_whose_observations_alone_moved_is_written_once_the_stored_one_is_the_refresh_old():
    loop = Loop()
    loop.run(0)
    loop.run(5)  # stored at 0 s: nothing changed
    loop.prom.ttft = 0.06  # both pods alike: the weights stay, the signals and scores move
    deferred = loop.run(10)
    assert not deferred.status_written
    assert deferred.status_outcome == "deferred"
    assert deferred.status_kept
    assert deferred.status is not None
    assert deferred.status.endpoints[0].signals.ttft_seconds == 0.06
    assert loop.status is not None
    assert loop.status["endpoints"][0]["signals"]["ttftSeconds"] == 0.05
    assert not loop.run(25).status_written  # 25 s since the stored status
    written = loop.run(30)  # 30 s: the stored status is the refresh old
    assert written.status_written
    assert loop.status["endpoints"][0]["signals"]["ttftSeconds"] == 0.06
    assert loop.status["lastReconcileTime"] == at(30).isoformat().replace("+00:00", "Z")


def test_a_decision_is_written_at_the_pass_that_makes_it_whatever_the_refresh():
    loop = Loop()
    loop.run(0)
    loop.run(5)
    prom = OneReading()
    prom.errors = 0.5  # over fastZeroErrorRate: pod a is zeroed at this pass
    loop.reconciler.signals = prom
    prom.asked = at(10)
    report = loop.run(10)
    assert report.status_written
    rows = {r["pod"]: r for r in loop.status["endpoints"]}
    assert (rows["a"]["state"], rows["a"]["weight"]) == ("Zeroed", 0)


def test_deferring_a_status_write_changes_nothing_the_passes_decide():
    """The next pass builds on the last pass, written or not: a loop writing every pass and one deferring
    observation-only writes compute the same statuses, pass for pass."""

    class Loaded(FakeProm):
        """Both pods alike and loaded: learned capacities, idle TTFTs and smoothed scores move every pass."""

        n = 0

        def read_signals(self, spec: Any, namespace: str, pods: list[str], auth: Any, now: Any) -> SignalSnapshot:
            wobble = (0.0, 0.02, 0.01, 0.03)[self.n % 4]
            signals = PodSignals(
                ttft_seconds=0.2 + wobble,
                ttft_p95_seconds=0.4 + wobble,
                kv_cache_usage=0.3 + wobble,
                queue_length=1.0,
                running_requests=4.0 + 10 * wobble,
                request_rate=3.0 + 10 * wobble,
                error_rate=0.0,
            )
            return SignalSnapshot(collected_at=now, pods=dict.fromkeys(pods, signals))

    every, deferring = Loop(), Loop()
    every.reconciler.status_refresh = timedelta(0)
    every.reconciler.signals, deferring.reconciler.signals = Loaded(), Loaded()
    written = []
    for n in range(16):
        for loop in (every, deferring):
            cast(Any, loop.reconciler.signals).n = n
        a, b = every.run(n * 5), deferring.run(n * 5)
        assert a.status == b.status, n
        written.append((a.status_written, b.status_written))
    assert sum(a for a, _ in written) == 16
    assert sum(b for _, b in written) < 6


def test_a_large_pools_stored_weights_are_the_published_ones_after_every_pass():
    """Over 64 pods most rows are aggregated into the compact memory: their weights are decisions too."""
    import random  # noqa: PLC0415

    from sluice.api.memory import remembered  # noqa: PLC0415
    from sluice.api.status import read_status  # noqa: PLC0415

    pods = [ObservedPod(name=f"p{i:03d}", ip=f"10.0.{i // 250}.{i % 250 + 1}", labels=LABELS) for i in range(100)]
    rng = random.Random(1)

    class Noisy(FakeProm):
        """A spread of TTFTs, each pod's signals drawn again within ±15 % at every pass."""

        def read_signals(self, spec: Any, namespace: str, pods: list[str], auth: Any, now: Any) -> SignalSnapshot:
            out = {}
            for i, pod in enumerate(pods):
                base, w = 0.1 + 0.002 * i, rng.uniform(-0.15, 0.15)
                out[pod] = PodSignals(
                    ttft_seconds=base * (1 + w),
                    ttft_p95_seconds=2 * base * (1 + w),
                    kv_cache_usage=0.3 + w / 3,
                    queue_length=1.0,
                    running_requests=4.0 * (1 + w),
                    request_rate=3.0 * (1 + w),
                    error_rate=0.0,
                )
            return SignalSnapshot(collected_at=now, pods=out)

    loop = Loop(scoring={"policy": "cube"})
    loop.cluster.pod_list = pods
    loop.reconciler.signals = Noisy()
    ip_of = {p.ip: p.name for p in pods}
    moved = 0
    before: dict[str, int] = {}
    for n in range(40):
        loop.run(n * 5)
        entry = loop.cluster.objects[("llm", "ServiceEntry", "sluice-llama")]
        published = {ip_of[e["address"]]: int(e["weight"]) for e in entry["spec"]["endpoints"]}
        stored, _ = read_status(loop.status)
        assert {pod: row.weight for pod, row in remembered(stored).items() if row.weight > 0} == published, n
        moved += published != before
        before = published
    assert moved > 3  # the weights did move under the noise


def test_weights_that_change_at_consecutive_passes_are_stored_at_each():
    """The second of two weight-changing passes in a row says the same in its conditions as the first: its
    weights alone make it a decision."""

    class Swinging(FakeProm):
        def read_signals(self, spec: Any, namespace: str, pods: list[str], auth: Any, now: Any) -> SignalSnapshot:
            slow = PodSignals(ttft_seconds=self.ttft, kv_cache_usage=0.2, queue_length=0, running_requests=1)
            fast = slow.model_copy(update={"ttft_seconds": 0.05})
            return SignalSnapshot(collected_at=now, pods={p: slow if p == "a" else fast for p in pods})

    loop = Loop(scoring={"policy": "cube"})
    loop.reconciler.signals = prom = Swinging()
    changed = 0
    before: dict[str, int] = {}
    for n in range(8):
        prom.ttft = (0.05, 0.1)[n % 2]  # pod a's weight swings at every pass
        loop.run(n * 5)
        entry = loop.cluster.objects[("llm", "ServiceEntry", "sluice-llama")]
        published = {e["address"]: int(e["weight"]) for e in entry["spec"]["endpoints"]}
        stored = {row["ip"]: row["weight"] for row in loop.status["endpoints"]}
        assert stored == published, n
        changed += published != before
        before = published
    assert changed == 8


def test_a_status_write_that_fails_leaves_the_next_pass_on_the_last_status_kept():
    loop = Loop()
    loop.run(0)
    kept = loop.reconciler.written_at("u1")
    loop.cluster.failures["write_status"] = ClusterError(500, "etcd unavailable")
    report = loop.run(61)  # the heartbeat is due
    assert not report.status_written
    assert not report.status_kept
    assert loop.reconciler.written_at("u1") == kept
    del loop.cluster.failures["write_status"]
    assert loop.run(66).status_written


def test_service_entry_endpoints_carry_the_pods_service_account():
    loop = Loop()
    loop.run(0)
    entry = loop.cluster.objects[("llm", "ServiceEntry", "sluice-llama")]
    assert {e["serviceAccount"] for e in entry["spec"]["endpoints"]} == {"llama-sa"}


# ------------------------------------------------------------------------- pruning


@pytest.mark.parametrize(
    ("toggle", "gone", "added"),
    [
        (
            {"routing": {"weightsVia": "EnvoyFilter"}},
            ("VirtualService", "sluice-llama"),
            ("EnvoyFilter", "sluice-llama-routes"),
        ),
        ({"routing": {"leastRequest": {"choiceCount": 3}}}, None, ("EnvoyFilter", "sluice-llama-lb")),
        ({"routing": {"endpointWeights": False}}, ("ServiceEntry", "sluice-llama"), None),
        (
            {"routing": {"sessionAffinity": {"header": "x-session-id", "hashBalanceFactor": 150}}},
            None,
            ("EnvoyFilter", "sluice-llama-lb"),
        ),
    ],
)
def test_toggling_a_routing_option_prunes_what_is_no_longer_rendered(toggle, gone, added):
    loop = Loop()
    loop.run(0)
    before = loop.kinds()
    on = loop.run(5, **toggle)
    if added:
        assert added in loop.kinds()
    if gone:
        assert gone not in loop.kinds()
        assert "pruned" in {w.action for w in on.writes}
    loop.spec = {}
    off = loop.run(10)  # and back: whatever the option added is pruned again
    assert loop.kinds() == before
    if added:
        assert any(w.action == "pruned" and (w.kind, w.name) == added for w in off.writes)


def test_enforced_admission_renders_a_limit_per_class_and_turning_it_off_prunes_it():
    loop = Loop()
    loop.cluster.pod_list = [
        p.model_copy(update={"labels": {**p.labels, "security.istio.io/tlsMode": "istio"}}) for p in PODS
    ]
    loop.prom.kv, loop.prom.running = 0.5, 20.0  # a full cache would hold 40
    loop.run(0)
    on = loop.run(5, admission={"mode": "Enforce", "batchShare": 0.75})
    assert ("EnvoyFilter", "sluice-llama-inbound-a100") in loop.kinds()
    assert any(w.action == "created" and w.name == "sluice-llama-inbound-a100" for w in on.writes)
    assert {row["inboundLimit"] for row in loop.status["endpoints"]} == {30}
    loop.spec = {}
    off = loop.run(10)
    assert ("EnvoyFilter", "sluice-llama-inbound-a100") not in loop.kinds()
    assert any(w.action == "pruned" and w.name == "sluice-llama-inbound-a100" for w in off.writes)


def test_pruning_lists_the_cluster_only_when_the_rendered_set_changes():
    loop = Loop()
    loop.run(0)
    loop.run(5)
    loop.run(10)
    assert loop.cluster.calls.count("owned") == 1  # the first pass of this process only


def test_objects_of_another_pool_or_nobody_are_never_pruned():
    loop = Loop()
    foreign = {
        "apiVersion": "networking.istio.io/v1",
        "kind": "VirtualService",
        "metadata": {"name": "theirs", "namespace": "llm"},
        "spec": {},
    }
    other = {
        "apiVersion": "networking.istio.io/v1",
        "kind": "DestinationRule",
        "metadata": {
            "name": "sluice-other",
            "namespace": "llm",
            "labels": {"app.kubernetes.io/managed-by": "sluice", "sluice.dev/pool": "other"},
        },
        "spec": {},
    }
    loop.cluster.objects[("llm", "VirtualService", "theirs")] = foreign
    loop.cluster.objects[("llm", "DestinationRule", "sluice-other")] = other
    loop.run(0)
    loop.run(5, routing={"weightsVia": "EnvoyFilter"})
    assert ("VirtualService", "theirs") in loop.kinds()
    assert ("DestinationRule", "sluice-other") in loop.kinds()


# ------------------------------------------------------------------------- adoption


USERS_VS = {
    "apiVersion": "networking.istio.io/v1",
    "kind": "VirtualService",
    "metadata": {
        "name": "sluice-llama",
        "namespace": "llm",
        "labels": {"team": "search"},
        "annotations": {"note": "ours"},
    },
    "spec": {"hosts": ["llama"], "http": [{"route": [{"destination": {"host": "llama"}}]}]},
}


def test_a_foreign_object_is_refused_without_adoption():
    loop = Loop()
    loop.cluster.objects[("llm", "VirtualService", "sluice-llama")] = dict(USERS_VS)
    report = loop.run(0)
    assert conditions_of(report.status)["IstioSynced"] == ("False", "ObjectNotManaged")
    assert loop.cluster.objects[("llm", "VirtualService", "sluice-llama")] == USERS_VS
    assert "ObjectNotManaged" in [e.reason for e in report.events]


def test_an_adopted_object_gets_no_owner_and_is_given_back_exactly_when_adoption_is_turned_off():
    loop = Loop(routing={"adoptExisting": True})
    loop.cluster.objects[("llm", "VirtualService", "sluice-llama")] = dict(USERS_VS)
    loop.run(0)
    adopted = loop.cluster.objects[("llm", "VirtualService", "sluice-llama")]
    assert "ownerReferences" not in adopted["metadata"]
    assert "sluice.dev/original" in adopted["metadata"]["annotations"]
    assert adopted["spec"] != USERS_VS["spec"]
    loop.run(5)  # still adopted: the original is carried from pass to pass
    assert (
        "sluice.dev/original"
        in loop.cluster.objects[("llm", "VirtualService", "sluice-llama")]["metadata"]["annotations"]
    )
    report = loop.run(10, routing={"adoptExisting": False})
    back = loop.cluster.objects[("llm", "VirtualService", "sluice-llama")]
    assert back["spec"] == USERS_VS["spec"]
    assert back["metadata"]["labels"] == USERS_VS["metadata"]["labels"]
    assert back["metadata"]["annotations"] == USERS_VS["metadata"]["annotations"]
    assert "restored" in {w.action for w in report.writes}


def test_an_adopted_object_no_longer_rendered_is_given_back_not_deleted():
    loop = Loop(routing={"adoptExisting": True})
    loop.cluster.objects[("llm", "VirtualService", "sluice-llama")] = dict(USERS_VS)
    loop.run(0)
    loop.run(5, routing={"adoptExisting": True, "weightsVia": "EnvoyFilter"})
    back = loop.cluster.objects[("llm", "VirtualService", "sluice-llama")]
    assert back["spec"] == USERS_VS["spec"]


# ------------------------------------------------------------------------- error paths


@pytest.mark.parametrize(
    ("status", "reason"),
    [(409, "Conflict"), (422, "Unprocessable Entity"), (500, "Internal Server Error"), (0, "timed out")],
)
def test_a_rejected_write_is_write_failed_and_retried_next_pass(status, reason):
    loop = Loop()
    loop.cluster.failures["apply"] = ClusterError(status, reason)
    report = loop.run(0)
    synced = next(c for c in report.status.conditions if c.type == "IstioSynced")
    assert (synced.status, synced.reason) == ("False", "WriteFailed")
    assert f"{status} {reason}" in synced.message
    assert "WriteFailed" in [e.reason for e in report.events]
    assert loop.cluster.calls.count("owned") == 0  # nothing is pruned on a pass that could not publish
    del loop.cluster.failures["apply"]
    recovered = loop.run(5)
    assert conditions_of(recovered.status)["IstioSynced"] == ("True", "Synced")


def test_a_failed_status_write_does_not_fail_the_pass_and_is_written_next_time():
    loop = Loop()
    loop.cluster.failures["write_status"] = ClusterError(409, "Conflict")
    report = loop.run(0)
    assert report.result == "ok"
    assert not report.status_written
    del loop.cluster.failures["write_status"]
    assert loop.run(5).status_written


def test_a_failed_event_does_not_fail_the_pass():
    loop = Loop()
    loop.cluster.failures["emit"] = ClusterError(403, "Forbidden")
    loop.cluster.objects[("llm", "VirtualService", "sluice-llama")] = dict(USERS_VS)
    assert loop.run(0).result == "ok"


def test_a_pass_that_raises_says_so_in_the_status_and_an_event():
    loop = Loop()
    healthy = loop.run(0)
    assert conditions_of(healthy.status)["Ready"] == ("True", "WeightsPublished")
    loop.cluster.failures["pods"] = ClusterError(500, "watch cache exploded")
    with pytest.raises(ClusterError):
        loop.run(5)
    written = loop.cluster.statuses[-1][2]
    ready = next(c for c in written["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ReconcileFailed")
    assert "watch cache exploded" in ready["message"]
    assert loop.cluster.events[-1].reason == "ReconcileFailed"


def test_an_invalid_spec_touches_no_istio_object():
    loop = Loop()
    loop.run(0)
    objects = dict(loop.cluster.objects)
    report = loop.run(5, scoring={"alpha": 7})
    assert report.result == "invalid_spec"
    assert conditions_of(report.status)["SpecValid"] == ("False", "InvalidSpec")
    assert loop.cluster.objects == objects
    assert "InvalidSpec" in [e.reason for e in report.events]


def test_a_status_written_by_another_version_does_not_stop_the_pool():
    loop = Loop()
    loop.run(0)
    assert loop.status is not None
    newer = {
        **loop.status,
        "endpoints": [{**loop.status["endpoints"][0], "state": "Draining"}, loop.status["endpoints"][1]],
    }
    report = Reconciler(loop.cluster, loop.prom).run(parse_snapshot(body(newer)), at(5))
    assert report.result == "ok"
    assert conditions_of(report.status)["SpecValid"] == ("True", "Valid")
    warned = [e for e in report.events if e.reason == "StatusPartlyUnreadable"]
    assert len(warned) == 1
    assert "endpoints: dropped an unreadable entry" in warned[0].message


def test_istio_synced_keeps_its_transition_time_and_sits_with_the_other_conditions():
    loop = Loop()
    first = loop.run(0).status
    loop.prom.ttft = 0.5  # enough to change weights, so the status is written again
    second = loop.run(70).status
    synced = [next(c for c in s.conditions if c.type == "IstioSynced") for s in (first, second)]
    assert synced[0].last_transition_time == synced[1].last_transition_time == T0 + timedelta(0)
    assert [c.type for c in second.conditions] == [
        "Ready",
        "SpecValid",
        "MetricsAvailable",
        "SignalsReady",
        "Degraded",
        "MeshReach",
        "IstioSynced",
        "KubeApiHealthy",
    ]


# ------------------------------------------------------------------------- repeated readings


class OneReading(FakeProm):
    """Every pass reads the same answer (asked at `asked`): what a shared or fallback answer is while Prometheus
    is slow or failing."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = T0
        self.errors = 0.05  # above every default band (2 %), below fast-zeroing (10 %)

    def read_signals(self, spec: Any, namespace: str, pods: list[str], auth: Any, now: Any) -> SignalSnapshot:
        signals = PodSignals(ttft_seconds=0.05, kv_cache_usage=0.2, queue_length=0, running_requests=1)
        bad = signals.model_copy(update={"error_rate": self.errors})
        return SignalSnapshot(
            collected_at=self.asked,
            answered_at={"errorRate": self.asked},
            pods={p: bad if p == "a" else signals for p in pods},
        )


@pytest.mark.parametrize("new_readings", [False, True])
def test_passes_in_a_row_below_every_band_count_only_new_readings(new_readings: bool) -> None:
    loop = Loop()
    prom = OneReading()
    loop.reconciler.signals = prom
    for n in range(5):
        if new_readings:
            prom.asked = at(n * 5)
        loop.run(n * 5)
    row = next(r for r in loop.reconciler._last_written["u1"].endpoints if r.pod == "a")
    if new_readings:
        assert row.state == "Zeroed"  # 3 passes in a row on 3 readings
    else:
        assert row.state != "Zeroed"  # one reading read five times is one failure, not five
        assert row.consecutive_failures == 1


def test_a_fresh_error_rate_zeroes_a_pod_though_another_signal_is_served_from_an_old_answer() -> None:
    """One signal on its last good answer keeps the oldest asking time fixed; the error-rate answer is new."""
    loop = Loop()

    class Fallback(FakeProm):
        def read_signals(self, spec: Any, namespace: str, pods: list[str], auth: Any, now: Any) -> SignalSnapshot:
            signals = PodSignals(ttft_seconds=0.05, kv_cache_usage=0.2, queue_length=0, running_requests=1)
            bad = signals.model_copy(update={"error_rate": 0.5 if now >= at(10) else 0.0})
            return SignalSnapshot(
                collected_at=T0,  # the oldest answer read: the fallback's
                answered_at={"ttft": T0, "errorRate": now},
                pods={p: bad if p == "a" else signals for p in pods},
            )

    loop.reconciler.signals = Fallback()
    for n in range(3):
        loop.run(n * 5)
    row = next(r for r in loop.reconciler._last_written["u1"].endpoints if r.pod == "a")
    assert row.state == "Zeroed"  # at 10 s, on the first new error-rate answer of 50 %


def test_the_status_writes_metric_says_written_deferred_skipped_and_failed_apart():
    """Each pass's status is counted as what became of it: a failed write is not "skipped" (nothing changed),
    nor is a deferred one."""
    metrics = OperatorMetrics()

    def counted(result: str) -> float:
        got = metrics.registry.get_sample_value("sluice_status_writes_total", {"pool": "llm/llama", "result": result})
        return got or 0.0

    loop = Loop()
    metrics.record(loop.run(0))  # written
    metrics.record(loop.run(5))  # nothing changed
    loop.prom.ttft = 0.06
    metrics.record(loop.run(10))  # observations only: deferred
    loop.cluster.failures["write_status"] = ClusterError(500, "etcd unavailable")
    metrics.record(loop.run(30))  # the refresh is due, the write fails
    assert (counted("written"), counted("skipped"), counted("deferred"), counted("failed")) == (1, 1, 1, 1)


class ErringProm(FakeProm):
    """Pod "a" fails half of its requests."""

    def read_signals(self, spec: Any, namespace: str, pods: list[str], auth: Any, now: Any) -> SignalSnapshot:
        healthy = super().read_signals(spec, namespace, pods, auth, now)
        failing = healthy.pods["a"].model_copy(update={"error_rate": 0.5, "request_rate": 5.0})
        return healthy.model_copy(update={"pods": {**healthy.pods, "a": failing}})


def test_a_stored_status_newer_than_the_last_pass_here_is_what_the_next_pass_builds_on():
    """Another replica ran the pool meanwhile (a shard handed over and back, an HA failover) and zeroed pod "a":
    this process's own last pass is older, so the stored status is the one to continue from — "a" stays out of
    the ServiceEntry through its quiet period, though its signals are healthy again."""
    here, there = Loop(), Loop()
    here.run(0)
    there.run(0)
    there.prom = there.reconciler.signals = ErringProm()
    there.run(10)
    assert {row["pod"]: row["state"] for row in there.status["endpoints"]}["a"] == "Zeroed"

    def endpoints() -> set[str]:
        entry = here.cluster.objects[("llm", "ServiceEntry", "sluice-llama")]
        return {e["address"] for e in entry["spec"]["endpoints"]}

    assert endpoints() == {"10.0.0.1", "10.0.0.2"}
    here.status = there.status  # what the watch now delivers
    here.run(15)
    assert endpoints() == {"10.0.0.2"}


def test_a_pass_decodes_the_previous_podmemory_once(monkeypatch):
    """The plan and both derivations of its Events read the previous status' pods from one decoding (it was
    decoded three times per pass: by the plan, and twice by `derive_events`)."""
    from sluice.api import memory  # noqa: PLC0415

    class EverySignal(FakeProm):
        def read_signals(self, spec: Any, namespace: str, pods: list[str], auth: Any, now: Any) -> SignalSnapshot:
            return SignalSnapshot(collected_at=now, pods=dict.fromkeys(pods, sig(ttft=0.1, rps=3.0, queue=1.0)))

    pods = [ObservedPod(name=f"p{i:03d}", ip=f"10.0.{i // 250}.{i % 250 + 1}", labels=LABELS) for i in range(100)]
    loop = Loop(scoring={"policy": "cube"})
    loop.cluster.pod_list = pods
    loop.reconciler.signals = EverySignal()
    loop.run(0)
    loop.run(5)  # the status the next pass starts from holds a podMemory (most of the 100 pods)
    assert loop.status is not None
    assert loop.status.get("podMemory")
    stored = loop.status["podMemory"]
    decoded: list[str] = []
    real = memory.decode

    def counting(text: str | None) -> list[Any]:
        if text == stored:
            decoded.append(text)
        return real(text)

    monkeypatch.setattr(memory, "decode", counting)
    loop.reconciler._last_pass.clear()  # the pass starts from the stored status, as after a restart
    loop.run(10)
    # once when the stored status is read (`readable`), once for the whole pass
    assert len(decoded) == 2


def test_the_status_reaches_the_cluster_port_as_the_model_and_is_serialized_there():
    """`Cluster.write_status` takes the typed status (it took a dict the reconciler had dumped)."""
    from sluice.api.v1alpha1 import InferencePoolStatus  # noqa: PLC0415

    loop = Loop()
    written: list[Any] = []
    real = loop.cluster.write_status

    def recording(namespace: str, name: str, status: Any) -> None:
        written.append(status)
        real(namespace, name, status)

    loop.cluster.write_status = recording  # type: ignore[method-assign]
    loop.run(0)
    (status,) = written
    assert isinstance(status, InferencePoolStatus)
    assert status.routable == "2/2"
    assert loop.cluster.statuses[-1][2]["routable"] == "2/2"  # the wire form, camelCase, as the API server gets it


# ------------------------------------------------------------------------- API trouble (KubeApiHealthy)


@dataclass
class ThrottledPods(MemoryCluster):
    """Lists pods through the client's edge (`call`, as the adapter does), answered 429 (`Retry-After: 1`)
    `throttle` times first."""

    throttle: int = 0
    time: SteppedTime = field(default_factory=SteppedTime)

    def pods(self, namespace: str, match_labels: dict[str, str]) -> list[ObservedPod]:
        def listed() -> list[ObservedPod]:
            if self.throttle > 0:
                self.throttle -= 1
                raise throttled("1")
            return MemoryCluster.pods(self, namespace, match_labels)

        return call(listed, self.time.retrying())


def test_a_throttled_pass_shows_kube_api_healthy_false_until_three_intervals_without_trouble():
    """The 429 the pass's pod list met was waited out and the pass published; the condition says it happened,
    and holds for three intervals (5 s each) after the last trouble, not flipping at every pass."""
    loop = Loop()
    loop.cluster = ThrottledPods(pod_list=list(PODS))
    loop.reconciler = Reconciler(loop.cluster, loop.prom)
    assert conditions_of(loop.run(0).status)["KubeApiHealthy"] == ("True", "Answering")
    loop.cluster.throttle = 1
    throttled_pass = loop.run(5)
    assert conditions_of(throttled_pass.status)["KubeApiHealthy"] == ("False", "Throttled")
    assert conditions_of(throttled_pass.status)["IstioSynced"] == ("True", "Synced")
    assert conditions_of(loop.run(10).status)["KubeApiHealthy"] == ("False", "Throttled")
    assert conditions_of(loop.run(19.9).status)["KubeApiHealthy"] == ("False", "Throttled")
    assert conditions_of(loop.run(20).status)["KubeApiHealthy"] == ("True", "Answering")


def test_a_pass_that_failed_on_the_api_is_reported_by_the_next_one():
    """Every send answered 429 past the retries: the pass fails (its status cannot say so if the API is down);
    the next pass, answered, reports the episode."""
    loop = Loop()
    loop.cluster = ThrottledPods(pod_list=list(PODS))
    loop.reconciler = Reconciler(loop.cluster, loop.prom)
    loop.run(0)
    loop.cluster.throttle = 100
    with pytest.raises(ClusterError):
        loop.run(5)
    loop.cluster.throttle = 0
    assert conditions_of(loop.run(10).status)["KubeApiHealthy"] == ("False", "Throttled")
