"""The preflight's decisions (`sluice.core.signalcheck`), pure: what is refused, what each check says, the
condition. What Prometheus answers for real shapes is tested in test_presets_promql.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from sluice.core.observed import (
    SIGNAL_FIELD,
    CheckAnswers,
    Observed,
    ObservedPod,
    PodSignals,
    SeriesAnswer,
    SignalSnapshot,
)
from sluice.core.presets import preset_series
from sluice.core.reconcile import plan_pass
from sluice.core.signalcheck import MIN_SAMPLES, screen
from tests.helpers import spec

NOW = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
PODS = ["a", "b"]
GOOD = PodSignals(
    ttft_seconds=0.1,
    ttft_p95_seconds=0.2,
    kv_cache_usage=0.5,
    queue_length=1,
    running_requests=3,
    request_rate=2.0,
    error_rate=0.0,
)


def answers(
    pods: list[str] = PODS,
    age: float = 2.0,
    duplicated: dict[str, dict[str, float]] | None = None,
    lacking: dict[str, set[str]] | None = None,
    samples: float = 10.0,
) -> CheckAnswers:
    """The preflight's answers for a vLLM pool where every series the preset reads is there for `pods`, but for
    `lacking` (series -> pods without it) and `duplicated` (series -> pod -> raw series per identity)."""
    series = []
    for key in preset_series(spec(engine="vllm")):
        have = [p for p in pods if p not in (lacking or {}).get(key, set())]
        series.append(
            SeriesAnswer(
                name=key,
                per_identity={p: (duplicated or {}).get(key, {}).get(p, 1.0) for p in have},
                newest=dict.fromkeys(have, -float(age)),  # the sample's time less the evaluation's
            )
        )
    return CheckAnswers(asked_at=NOW, series=series, samples_per_window=dict.fromkeys(pods, samples))


def snapshot(checks: CheckAnswers | None, **values: PodSignals) -> SignalSnapshot:
    return SignalSnapshot(collected_at=NOW, pods=values or dict.fromkeys(PODS, GOOD), checks=checks)


def states(screened_checks: object) -> dict[str, str]:
    return {c.signal: c.state for c in screened_checks.signals}  # type: ignore[attr-defined]


def test_every_series_there_once_and_fresh_is_signals_ready() -> None:
    screened = screen(spec(engine="vllm"), snapshot(answers()), PODS, NOW)
    assert screened.ready[:2] == ("True", "AllPresent")
    assert screened.refused == {}
    found = states(screened.checks)
    assert found["loraFailureRate"] == "NotProvided"  # vLLM's HTTP metrics leave its load route out
    assert {s for s, state in found.items() if state != "Ok"} == {"loraFailureRate"}


def test_a_missing_series_names_the_pod_and_the_flag() -> None:
    checks = answers(lacking={"vllm:num_requests_waiting": {"b"}})
    screened = screen(spec(engine="vllm"), snapshot(checks), PODS, NOW)
    assert screened.ready[:2] == ("False", "SeriesMissing")
    queue = next(c for c in screened.checks.signals if c.signal == "queueLength")  # type: ignore[union-attr]
    assert (queue.state, queue.pods, queue.pods_ok) == ("Missing", ["b"], 1)
    assert queue.message == "no vllm:num_requests_waiting for b"
    assert queue.fix is not None
    assert "--disable-log-stats" in queue.fix


def test_either_kv_name_is_enough_but_neither_is_missing() -> None:
    old_only = answers(lacking={"vllm:kv_cache_usage_perc": {"a", "b"}})
    assert states(screen(spec(engine="vllm"), snapshot(old_only), PODS, NOW).checks)["kvCacheUsage"] == "Ok"
    neither = answers(lacking={"vllm:kv_cache_usage_perc": {"a"}, "vllm:gpu_cache_usage_perc": {"a", "b"}})
    assert states(screen(spec(engine="vllm"), snapshot(neither), PODS, NOW).checks)["kvCacheUsage"] == "Missing"


def test_duplicated_raw_series_are_refused_for_that_pod_only() -> None:
    checks = answers(duplicated={"vllm:num_requests_running": {"a": 2.0}})
    screened = screen(spec(engine="vllm"), snapshot(checks), PODS, NOW)
    assert screened.snapshot.pods["a"].running_requests is None
    assert screened.snapshot.pods["b"].running_requests == 3
    assert screened.snapshot.pods["a"].queue_length == 1  # another series: used
    assert set(screened.refused["a"]) == {"runningRequests"}
    assert screened.ready[:2] == ("False", "DuplicateSeries")
    assert "vllm:num_requests_running has 2 raw series per (model_name, engine)" in screened.ready[2]


@pytest.mark.parametrize(
    ("field", "value"),
    [("kv_cache_usage", 1.7), ("error_rate", 1.2), ("request_rate", -0.5), ("queue_length", -1.0)],
)
def test_a_value_out_of_range_is_missing_never_a_number(field: str, value: float) -> None:
    bad = GOOD.model_copy(update={field: value})
    screened = screen(spec(engine="vllm"), snapshot(answers(), a=bad, b=GOOD), PODS, NOW)
    assert getattr(screened.snapshot.pods["a"], field) is None
    assert getattr(screened.snapshot.pods["b"], field) == getattr(GOOD, field)
    assert screened.ready[:2] == ("False", "ValuesOutOfRange")
    assert f"read {value:g}, outside" in screened.ready[2]
    assert "from vllm:" in screened.refused["a"][signal_of(field)]  # the series it was read from


def signal_of(field: str) -> str:
    return next(signal for signal, name in SIGNAL_FIELD.items() if name == field)


def test_an_override_out_of_range_names_the_override() -> None:
    pool = spec(engine="vllm", metrics={"queries": {"kvCacheUsage": "max by ($podLabel) (my_kv_percent{$selector})"}})
    bad = GOOD.model_copy(update={"kv_cache_usage": 55.0})  # a percentage where a ratio is expected
    screened = screen(pool, snapshot(answers(), a=bad, b=GOOD), PODS, NOW)
    assert screened.refused["a"]["kvCacheUsage"] == (
        "read 55, outside 0 to 1 (from the query override metrics.queries.kvCacheUsage)"
    )


def test_values_at_their_bounds_are_kept() -> None:
    edge = GOOD.model_copy(update={"kv_cache_usage": 1.0, "error_rate": 0.0, "queue_length": 0.0})
    screened = screen(spec(engine="vllm"), snapshot(answers(), a=edge, b=GOOD), PODS, NOW)
    assert screened.refused == {}


def test_old_samples_are_stale_and_a_pod_without_any_series_is_not_scraped() -> None:
    stale = screen(spec(engine="vllm"), snapshot(answers(age=400)), PODS, NOW)
    assert stale.ready[:2] == ("False", "SeriesStale")
    unscraped = screen(spec(engine="vllm"), snapshot(answers(pods=["a"])), PODS, NOW)
    assert unscraped.ready[:2] == ("False", "PodsNotScraped")
    assert unscraped.checks is not None
    assert unscraped.checks.unscraped == ["b"]
    assert states(unscraped.checks)["queueLength"] == "Ok"  # the signals are judged over the scraped pods


def test_a_window_with_too_few_samples_says_so() -> None:
    one = screen(spec(engine="vllm"), snapshot(answers(samples=1)), PODS, NOW)
    assert one.ready[:2] == ("False", "WindowTooShort")  # rate() reads nothing from one sample
    few = screen(spec(engine="vllm"), snapshot(answers(samples=MIN_SAMPLES - 1)), PODS, NOW)
    assert few.ready[:2] == ("True", "WindowShort")  # a 30 s scrape in a 1m window: read, but unsteady
    assert "advised" in few.ready[2]
    enough = screen(spec(engine="vllm"), snapshot(answers(samples=MIN_SAMPLES)), PODS, NOW)
    assert enough.ready[:2] == ("True", "AllPresent")


def test_no_preflight_yet_is_unknown_and_refuses_only_out_of_range_values() -> None:
    bad = GOOD.model_copy(update={"kv_cache_usage": 3.0})
    screened = screen(spec(engine="vllm"), snapshot(None, a=bad), PODS, NOW)
    assert screened.ready[:2] == ("Unknown", "NotChecked")
    assert screened.snapshot.pods["a"].kv_cache_usage is None


def test_a_sleeping_engine_is_not_routed_and_says_why() -> None:
    pods = [ObservedPod(name=name, ip=f"10.0.0.{i}", labels={"app": "llama"}) for i, name in enumerate(PODS)]
    asleep = GOOD.model_copy(update={"sleeping": 1.0})
    awake = GOOD.model_copy(update={"sleeping": 0.0})
    observed = Observed(pods=pods, signals=SignalSnapshot(collected_at=NOW, pods={"a": asleep, "b": awake}))
    plan = plan_pass(spec(engine="vllm"), 1, observed, None, NOW)
    rows = {row.pod: row for row in plan.status.endpoints}
    assert rows["a"].weight == 0
    assert "asleep" in rows["a"].reason
    assert rows["b"].weight > 0
    assert [e.pod for e in plan.endpoints] == ["b"]


def test_failed_check_queries_are_unknown_not_pods_not_scraped() -> None:
    checks = answers(pods=[])  # Prometheus answered nothing ...
    failing = checks.model_copy(
        update={"series": [a.model_copy(update={"failed": "timed out"}) for a in checks.series], "failed": "timed out"}
    )
    screened = screen(spec(engine="vllm"), snapshot(failing), PODS, NOW)
    assert screened.ready[:2] == ("Unknown", "CheckFailed")  # ... because it failed: no pod is said unscraped
    assert screened.checks is not None
    assert screened.checks.unscraped == []


def test_sample_ages_are_taken_when_the_check_was_asked() -> None:
    """A check answer is reused for up to half its period: a sample 31 s old when asked, read 30 s later, is not
    61 s old (staleAfter 60 s)."""
    checks = answers(age=31).model_copy(update={"asked_at": NOW})
    later = NOW + timedelta(seconds=30)
    screened = screen(spec(engine="vllm"), snapshot(checks), PODS, later)
    assert screened.ready[:2] == ("True", "AllPresent")
    assert screened.checks is not None
    ages = {c.oldest_sample_seconds for c in screened.checks.signals} - {None}
    assert ages == {31}


SGLANG_KEYS = {
    "sglang:time_to_first_token_seconds_count": True,  # made with the first request
    "sglang:num_requests_total": True,
    "sglang:http_responses_total": True,
    "sglang:token_usage": False,  # the scheduler's gauges exist from the start
    "sglang:num_queue_reqs": False,
    "sglang:num_running_reqs": False,
}


def sglang_answers(busy: bool) -> CheckAnswers:
    """An SGLang pod "a": its scheduler gauges, and its tokenizer and HTTP series only once it served requests."""
    newest = {"a": -2.0}
    series = [
        SeriesAnswer(
            name=key, per_identity={"a": 1.0} if busy or not lazy else {}, newest=newest if busy or not lazy else {}
        )
        for key, lazy in SGLANG_KEYS.items()
    ]
    return CheckAnswers(asked_at=NOW, series=series, samples_per_window={"a": 10.0})


def test_an_idle_pod_lacks_the_series_its_engine_makes_with_the_first_request_without_a_finding() -> None:
    idle = PodSignals(kv_cache_usage=0.0, queue_length=0, running_requests=0)
    quiet = screen(spec(engine="sglang"), snapshot(sglang_answers(busy=False), a=idle), ["a"], NOW)
    assert quiet.ready[:2] == ("True", "AllPresent")
    ttft = next(c for c in quiet.checks.signals if c.signal == "ttft")  # type: ignore[union-attr]
    assert "no request yet" in ttft.message
    serving = idle.model_copy(update={"running_requests": 3})  # serving, and still no tokenizer series
    busy = screen(spec(engine="sglang"), snapshot(sglang_answers(busy=False), a=serving), ["a"], NOW)
    assert busy.ready[:2] == ("False", "SeriesMissing")
    assert {c.signal for c in busy.checks.signals if c.state == "Missing"} == {  # type: ignore[union-attr]
        "ttft",
        "ttftP95",
        "requestRate",
        "errorRate",
    }


def test_an_override_reading_out_of_range_is_a_finding() -> None:
    pool = spec(engine="vllm", metrics={"queries": {"kvCacheUsage": "max by ($podLabel) (my_kv_percent{$selector})"}})
    bad = GOOD.model_copy(update={"kv_cache_usage": 55.0})
    screened = screen(pool, snapshot(answers(), a=bad, b=bad), PODS, NOW)
    assert screened.ready[:2] == ("False", "ValuesOutOfRange")
    kv = next(c for c in screened.checks.signals if c.signal == "kvCacheUsage")  # type: ignore[union-attr]
    assert (kv.state, kv.pods) == ("OutOfRange", PODS)


def test_a_pod_scraped_once_so_far_is_judged_at_the_next_check() -> None:
    checks = answers(lacking={"vllm:num_requests_waiting": {"b"}})
    checks.samples_per_window["b"] = 1.0  # its first scrape: the check may have come between its series
    screened = screen(spec(engine="vllm"), snapshot(checks), PODS, NOW)
    assert screened.ready[:2] == ("True", "AllPresent")
    assert "b: scraped fewer than twice" in screened.ready[2]
    everyone = answers(lacking={"vllm:num_requests_waiting": {"b"}}, samples=1.0)  # the window, not the pods
    assert screen(spec(engine="vllm"), snapshot(everyone), PODS, NOW).ready[:2] == ("False", "SeriesMissing")


def test_a_pod_without_a_scrape_count_is_judged_not_taken_for_new() -> None:
    """A pod whose scrapes could not be counted (no `up` kept, and its engine exports no freshness gauge, as vLLM
    with --disable-log-stats) is judged like the others: its missing series are a finding."""
    checks = answers(lacking={"vllm:num_requests_waiting": {"b"}})
    del checks.samples_per_window["b"]
    screened = screen(spec(engine="vllm"), snapshot(checks), PODS, NOW)
    assert screened.ready[:2] == ("False", "SeriesMissing")
