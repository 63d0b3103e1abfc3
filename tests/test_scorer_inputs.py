"""Each signal scorer depends on the one signal it declares (`SignalScorer.reads`), and on no other."""

import pytest

from sluice.api.v1alpha1 import ScoringSpec
from sluice.core.observed import ALL_SIGNALS, SIGNAL_FIELD, PodSignals
from sluice.core.scoring import SCORERS

# A value for every signal, each past the scorers' knees (a nearly full cache, a long queue).
EVERY = {
    "ttft_seconds": 0.4,
    "ttft_p95_seconds": 0.9,
    "kv_cache_usage": 0.95,
    "queue_length": 12.0,
    "running_requests": 30.0,
    "request_rate": 5.0,
    "error_rate": 0.01,
    "lora_failure_rate": 0.0,
    "sleeping": 0.0,
    "refused_rate": 3.0,
}


def test_every_signal_has_a_value_here() -> None:
    assert set(EVERY) == set(SIGNAL_FIELD.values())


@pytest.mark.parametrize("scorer", SCORERS, ids=lambda s: s.name)
def test_a_scorer_reads_its_declared_signal(scorer):
    scoring = ScoringSpec()
    field = SIGNAL_FIELD[scorer.reads]
    assert scorer.score(scoring, PodSignals.model_validate({**EVERY, field: None})) is None
    only = PodSignals.model_validate({field: EVERY[field]})
    assert scorer.score(scoring, only) == scorer.score(scoring, PodSignals.model_validate(EVERY))
    value = scorer.score(scoring, only)
    assert value is not None
    assert value < 1.0


@pytest.mark.parametrize(
    ("scorer", "other"),
    [(scorer, other) for scorer in SCORERS for other in ALL_SIGNALS if other != scorer.reads],
    ids=lambda x: x if isinstance(x, str) else x.name,
)
def test_a_scorer_ignores_the_other_signals(scorer, other):
    scoring = ScoringSpec()
    without = PodSignals.model_validate({**EVERY, SIGNAL_FIELD[other]: None})
    assert scorer.score(scoring, without) == scorer.score(scoring, PodSignals.model_validate(EVERY))
