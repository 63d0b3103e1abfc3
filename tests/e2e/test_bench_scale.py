"""`make bench-scale` keeps working, and a steady pass costs what the design says: a short run of 5 pools."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.bench.scale import main
from sluice.core.presets import PRESETS, check_every, check_queries
from tests.helpers import spec

pytestmark = pytest.mark.slow


def test_a_short_run_measures_every_pool_and_steady_passes_read_nothing(tmp_path: Path) -> None:
    args = ["--pools", "5", "--pods", "4", "--namespaces", "2", "--seconds", "12", "--warmup", "60"]
    main([*args, "--out", str(tmp_path)])
    (result,) = json.loads((tmp_path / "results.json").read_text())
    assert result["pools_with_status"] == 5
    assert result["passes_per_second"] > 0
    verbs = result["api_by_verb"]
    assert not [call for call in verbs if call.startswith(("get ", "list "))], verbs  # no GET, no list per pass
    # Per signal of the vLLM preset and the sample times, for each of the 2 namespaces, not per pool: asked again
    # half an interval after it was asked, so two per interval; the preflight's two per raw series and one for the
    # samples per window likewise, every check_every (30 s at a 5 s interval).
    pool = spec(engine="vllm", interval="5s")
    signals, checks = len(PRESETS["vllm"]) + 1, 2 * len(check_queries(pool, "ns").series) + 1
    seconds, every = result["seconds"], check_every(pool)
    bound = 2 * (signals * (2 * seconds / 5 + 2) + checks * (2 * seconds / every + 2))
    assert result["promql_per_second"] * seconds <= bound
    assert result["unavailable"] == {}  # every pool's signals fresh at the end
    assert "MetricsUnavailable" not in result["events_by_reason"]
    assert result["pass_age_max"] is not None
    assert result["pass_age_max"] < 2 * 5
    assert (tmp_path / "report.md").read_text().count("| 5 in 2 namespaces |") == 1
