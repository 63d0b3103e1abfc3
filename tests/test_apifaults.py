"""The API emulator's fault plan: matching, firing, delays and answers, decided with a seeded random and a
stepped clock (no server, no sleeping)."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from sluice.emulator.apifaultplan import CloseWatch, FaultPlan, Latency, PlanError, ServerError, Throttle, load_plan
from sluice.emulator.apifaults import (
    Counters,
    FaultInjector,
    FaultRequest,
    WatchCut,
    decide,
    delay_seconds,
    error_answer,
    expired_message,
    fires,
    throttle_answer,
)

LEASE_RENEWAL = FaultRequest(
    "update", "coordination.k8s.io", "leases", "llm", "shard-0", "admin", "sluice-operator/x-1"
)
POOL_LIST = FaultRequest("list", "inference.sluice.dev", "inferencepools", "llm", "", "admin", "kubectl/v1.32.4")
POD_WATCH = FaultRequest("watch", "", "pods", "llm", "", "admin", "sluice-operator/x-1", resource_version="1200")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def plan(*rules: str, seed: int = 0) -> FaultPlan:
    return load_plan(f"seed: {seed}\nrules:\n" + "".join(f"- {rule}\n" for rule in rules))


def fired(injector: FaultInjector, request: FaultRequest, times: int) -> list[str]:
    """The rule deciding each of `times` requests ("" when none)."""
    return [(d.rule.name if (d := injector.decide(request)).rule else "") for _ in range(times)]


# ------------------------------------------------------------------------------------------------ matching


@pytest.mark.parametrize(
    ("match", "lease", "pools"),
    [
        ("{}", True, True),
        ("{verbs: [update, patch]}", True, False),
        ("{resources: [leases]}", True, False),
        ("{groups: ['']}", False, False),
        ("{groups: [inference.sluice.dev]}", False, True),
        ("{namespaces: [other]}", False, False),
        ("{users: [admin]}", True, True),
        ("{userAgents: [sluice-operator/]}", True, False),
        ("{userAgents: [kubectl/, sluice-operator/]}", True, True),
        ("{verbs: [update], userAgents: [kubectl/]}", False, False),
    ],
)
def test_a_rule_matches_on_every_field_it_names_and_any_value_of_each(match: str, lease: bool, pools: bool) -> None:
    injector = FaultInjector(plan(f"{{name: r, match: {match}, effect: {{type: error, code: 500}}}}"))
    assert fired(injector, LEASE_RENEWAL, 1) == (["r"] if lease else [""])
    assert fired(injector, POOL_LIST, 1) == (["r"] if pools else [""])


def test_watch_faults_select_only_watches_and_expiry_only_watches_from_a_version() -> None:
    injector = FaultInjector(
        plan("{name: e, effect: {type: expireWatch}}", "{name: c, effect: {type: closeWatch, afterEvents: 1}}")
    )
    assert fired(injector, POOL_LIST, 1) == [""]
    assert fired(injector, POD_WATCH, 1) == ["e"]
    from_now = FaultRequest("watch", "", "pods", "llm", "", "admin", "", resource_version="0")
    assert fired(injector, from_now, 1) == ["c"]


# ------------------------------------------------------------------------------------------------ firing


def test_every_nth_matched_request_fires_and_a_burst_takes_the_next_ones_too() -> None:
    injector = FaultInjector(plan("{name: r, every: 4, burst: 2, effect: {type: error, code: 503}}"))
    assert fired(injector, POOL_LIST, 10) == ["", "", "", "r", "r", "", "", "r", "r", ""]


def test_a_limit_stops_the_rule_even_inside_a_burst() -> None:
    injector = FaultInjector(plan("{name: r, burst: 3, limit: 2, effect: {type: error, code: 503}}"))
    assert fired(injector, POOL_LIST, 5) == ["r", "r", "", "", ""]


def test_a_probability_fires_about_that_often_and_a_seed_replays_the_same_requests() -> None:
    rule = "{name: r, probability: 0.25, effect: {type: error, code: 500}}"
    first = fired(FaultInjector(plan(rule, seed=7)), POOL_LIST, 2000)
    assert first == fired(FaultInjector(plan(rule, seed=7)), POOL_LIST, 2000)
    assert first != fired(FaultInjector(plan(rule, seed=8)), POOL_LIST, 2000)
    assert 0.22 < first.count("r") / 2000 < 0.28


def test_fires_draws_only_when_a_chance_decides() -> None:
    rule = plan("{name: r, every: 2, effect: {type: error, code: 500}}").rules[0]

    def no_draw() -> float:
        raise AssertionError("drew")

    assert fires(rule, Counters(), no_draw) == (False, Counters(matched=1))
    assert fires(rule, Counters(matched=1), no_draw) == (True, Counters(matched=2, fired=1))


def test_a_rule_fires_only_inside_its_window_counted_from_the_plan_installation() -> None:
    clock = Clock()
    injector = FaultInjector(plan("{name: r, after: 10, until: 20, effect: {type: error, code: 503}}"), clock)
    seen = []
    for elapsed in (0.0, 9.99, 10.0, 19.99, 20.0):
        clock.now = 100.0 + elapsed
        seen += fired(injector, POOL_LIST, 1)
    assert seen == ["", "", "r", "r", ""]
    clock.now = 500.0
    injector.install(injector.plan)  # a new plan's window starts when it is installed
    clock.now = 510.0
    assert fired(injector, POOL_LIST, 1) == ["r"]


def test_latency_rules_add_up_and_the_first_other_firing_rule_decides() -> None:
    rules = plan(
        "{name: slow, effect: {type: latency, seconds: 0.2}}",
        "{name: slower, match: {verbs: [list]}, effect: {type: latency, seconds: 0.3}}",
        "{name: first, every: 2, effect: {type: error, code: 500}}",
        "{name: second, effect: {type: error, code: 503}}",
    )
    one, counters = decide(rules, {}, POOL_LIST, 0.0, random.Random(0))
    two, counters = decide(rules, counters, POOL_LIST, 0.0, random.Random(0))
    assert (one.delays, one.rule and one.rule.name) == ((("slow", 0.2), ("slower", 0.3)), "second")
    assert two.rule is not None
    assert two.rule.name == "first"
    assert counters["second"] == Counters(matched=1, fired=1)  # not read once `first` decided


def test_a_latency_distribution_has_the_p50_and_p99_it_was_given() -> None:
    latency = Latency(type="latency", p50=0.05, p99=0.8)
    rng = random.Random(3)
    draws = sorted(delay_seconds(latency, lambda: rng.gauss(0.0, 1.0)) for _ in range(20000))
    assert statistics.median(draws) == pytest.approx(0.05, rel=0.05)
    assert draws[int(0.99 * len(draws))] == pytest.approx(0.8, rel=0.1)
    assert delay_seconds(Latency(type="latency", seconds=0.25), lambda: 9.0) == 0.25


# ------------------------------------------------------------------------------------------------ answers


def test_a_priority_and_fairness_429_is_plain_text_with_retry_after_and_the_pf_uids() -> None:
    answer = throttle_answer(Throttle(type="throttle", retry_after_seconds=4))
    headers = dict(answer.headers)
    assert answer.code == 429
    assert answer.body == b"Too many requests, please try again later.\n"
    assert headers["Retry-After"] == "4"
    assert headers["Content-Type"] == "text/plain; charset=utf-8"
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["X-Kubernetes-PF-FlowSchema-UID"]
    assert headers["X-Kubernetes-PF-PriorityLevel-UID"]


def test_the_watch_caches_429_is_a_too_many_requests_status_with_retry_after_seconds() -> None:
    answer = throttle_answer(Throttle(type="throttle", shape="storageInitializing", retry_after_seconds=2))
    assert dict(answer.headers)["Retry-After"] == "2"
    assert json.loads(answer.body) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": "storage is (re)initializing",
        "reason": "TooManyRequests",
        "details": {"retryAfterSeconds": 2},
        "code": 429,
    }


def test_a_500_is_an_internal_error_status_naming_its_cause_twice() -> None:
    answer = error_answer(ServerError(type="error", code=500, message="etcdserver: request timed out"))
    body = json.loads(answer.body)
    assert (answer.code, body["reason"], body["code"]) == (500, "InternalError", 500)
    assert body["message"] == "Internal error occurred: etcdserver: request timed out"
    assert body["details"] == {"causes": [{"message": "etcdserver: request timed out"}]}
    assert "Retry-After" not in dict(answer.headers)


def test_a_503_is_the_shutting_down_status_with_retry_after_unless_told_otherwise() -> None:
    answer = error_answer(ServerError(type="error", code=503))
    body = json.loads(answer.body)
    assert (body["reason"], body["message"], body["code"]) == ("ServiceUnavailable", "apiserver is shutting down", 503)
    assert dict(answer.headers)["Retry-After"] == "1"
    quiet = error_answer(
        ServerError(type="error", code=503, message="apiserver cacher is stopped", retry_after_seconds=0)
    )
    assert "Retry-After" not in dict(quiet.headers)


def test_an_expired_watch_names_the_version_asked_and_the_oldest_kept() -> None:
    assert expired_message(1200, 1500) == "too old resource version: 1200 (1500)"
    assert expired_message(1500, 1500) == "too old resource version: 1500 (1501)"


def test_a_watch_cut_counts_events_but_not_bookmarks_and_takes_the_earlier_deadline() -> None:
    cut = WatchCut(CloseWatch(type="closeWatch", after_events=2, after_seconds=5.0))
    assert [cut.sent(kind) for kind in ("ADDED", "BOOKMARK", "MODIFIED")] == [False, False, True]
    assert cut.deadline(now=10.0, deadline=1810.0) == (15.0, True)
    assert cut.deadline(now=10.0, deadline=12.0) == (12.0, False)  # the watch's own timeout comes first
    assert WatchCut(CloseWatch(type="closeWatch", after_events=0)).at_once()
    untouched = WatchCut(None)
    assert (untouched.sent("ADDED"), untouched.deadline(0.0, 30.0), untouched.at_once()) == (
        False,
        (30.0, False),
        False,
    )


# ------------------------------------------------------------------------------------------------ records


def test_what_was_served_is_counted_per_rule_and_recorded_with_request_and_time() -> None:
    clock = Clock()
    injector = FaultInjector(plan("{name: r, effect: {type: error, code: 503}}"), clock)
    clock.now = 103.5
    injector.record("r", "error", LEASE_RENEWAL, "503")
    status = injector.status()
    assert status["served"] == 1
    assert status["rules"] == [{"name": "r", "effect": "error", "matched": 0, "served": 1}]
    records = status["records"]
    assert isinstance(records, list)
    assert records[0] | {"userAgent": ""} == {
        "at": 3.5,
        "rule": "r",
        "effect": "error",
        "detail": "503",
        "verb": "update",
        "group": "coordination.k8s.io",
        "resource": "leases",
        "namespace": "llm",
        "name": "shard-0",
        "user": "admin",
        "userAgent": "",
    }


# ------------------------------------------------------------------------------------------------ bad plans


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (
            "rules: [{name: r, effect: {type: latency, p50: 0.5, p99: 0.1}}]",
            "rules[0].effect: p99 (0.1) must not be below p50 (0.5)",
        ),
        ("rules: [{name: r, effect: {type: latency}}]", "rules[0].effect: give seconds, or both p50 and p99"),
        ("rules: [{name: r, effect: {type: throttle, retryAfterSeconds: 60}}]", "rules[0].effect.retryAfterSeconds"),
        ("rules: [{name: r, effect: {type: error, code: 502}}]", "rules[0].effect.code"),
        ("rules: [{name: r, effect: {type: teapot}}]", "rules[0].effect: Input tag 'teapot'"),
        ("rules: [{name: r, probability: 0, effect: {type: expireWatch}}]", "rules[0].probability"),
        ("rules: [{name: r, every: 2, probability: 0.5, effect: {type: expireWatch}}]", "probability or every"),
        ("rules: [{name: r, after: 5, until: 5, effect: {type: expireWatch}}]", "until (5.0) must be after"),
        ("rules: [{name: r, match: {verbs: [list]}, effect: {type: expireWatch}}]", "needs the watch verb"),
        ("rules: [{name: r, match: {verb: [list]}, effect: {type: expireWatch}}]", "rules[0].match.verb: Extra"),
        ("rules: [{name: r, effect: {type: closeWatch}}]", "give afterEvents, afterSeconds"),
        ("rules: [{name: a, effect: {type: expireWatch}}, {name: a, effect: {type: expireWatch}}]", "unique: a"),
        ("- just a list", "must be a mapping"),
        ("rules: [", "not YAML or JSON"),
    ],
)
def test_a_bad_plan_is_refused_with_the_field_named(text: str, named: str) -> None:
    with pytest.raises(PlanError, match=r"^plan\.yaml: ") as refused:
        load_plan(text, "plan.yaml")
    assert named in str(refused.value)


def test_a_plan_reads_from_json_as_well_and_an_empty_one_has_no_rules() -> None:
    assert load_plan('{"seed": 3, "rules": [{"name": "r", "effect": {"type": "expireWatch"}}]}').seed == 3
    assert load_plan("").rules == ()
