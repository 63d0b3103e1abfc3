"""The chaos runner's readings of the operator's /metrics: when a case counts as resumed, and which counters
moved during it."""

from __future__ import annotations

from sluice.devstack.chaos import Resumption, conditions_back, moved
from sluice.devstack.metricspage import samples

OK = 'sluice_reconcile_total{pool="llm/llama",result="ok"}'
STARTED = 'sluice_last_pass_timestamp_seconds{pool="llm/llama"}'


def test_a_pass_counts_only_once_an_ok_pass_ends_after_a_post_clear_start_was_seen() -> None:
    resumption = Resumption(cleared_wall=100.0)
    # an ok pass counted since the clear, but the last pass started before it: not yet
    assert not resumption.passed("llama", {OK: 11.0, STARTED: 99.0})
    # a pass started after the clear is seen: its ok count is the baseline, so the ok pass counted before it
    # (the pass that started at 99) does not count for it
    assert not resumption.passed("llama", {OK: 11.0, STARTED: 100.5})
    assert not resumption.passed("llama", {OK: 11.0, STARTED: 100.5})
    assert resumption.passed("llama", {OK: 12.0, STARTED: 100.5})


def test_nothing_counts_while_the_operators_page_cannot_be_read() -> None:
    resumption = Resumption(cleared_wall=100.0)
    assert not resumption.passed("llama", {})
    assert resumption.seen == {}


def test_conditions_are_back_when_each_watched_status_is_as_before() -> None:
    before = {"Ready": ("True", "WeightsPublished"), "MetricsAvailable": ("True", "Fresh")}
    assert conditions_back(before, {"Ready": ("True", "Other"), "MetricsAvailable": ("True", "Fresh")})
    assert not conditions_back(before, {"Ready": ("True", "x"), "MetricsAvailable": ("False", "QueryFailed")})


def test_moved_sums_the_counters_that_rose_over_pools_leaving_quiet_ones_out() -> None:
    before = {
        OK: 10.0,
        'sluice_reconcile_total{pool="llm/mistral",result="ok"}': 5.0,
        'sluice_events_total{pool="llm/llama",reason="X"}': 1.0,
    }
    after = {
        OK: 12.0,
        'sluice_reconcile_total{pool="llm/mistral",result="ok"}': 8.0,
        'sluice_events_total{pool="llm/llama",reason="X"}': 4.0,
        "sluice_kube_retries_total": 0.0,
    }
    assert moved(before, after) == {'sluice_reconcile_total{result="ok"}': 5.0}


def test_after_a_restart_the_counters_are_read_from_zero() -> None:
    before = {OK: 40.0}
    after = {OK: 3.0}
    assert moved(before, after) == {'sluice_reconcile_total{result="ok"}': 3.0}


def test_a_metrics_page_is_read_as_series_and_values_and_an_unread_page_as_nothing() -> None:
    page = '# HELP x\n# TYPE x counter\nsluice_reconcile_total{pool="llm/llama",result="ok"} 12.0\nup 1\n'
    assert samples(page) == {OK: 12.0, "up": 1.0}
    assert samples(None) == {}
