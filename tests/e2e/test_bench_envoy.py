"""The real-Envoy benchmark keeps working: a short run through real Envoy, Prometheus and the sluice core."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.bench.envoy import main

pytestmark = pytest.mark.slow


def test_short_real_envoy_run_serves_every_request_and_publishes_weights(tmp_path: Path) -> None:
    argv = ["--out", str(tmp_path), "--requests", "40", "--rate", "8", "--interval", "1", "--window", "4"]
    assert main([*argv, "--sglang-peers", "round_robin"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    (run,) = results["runs"]
    for strategy in ("round-robin", "least-request", "sluice", "sglang-router round_robin"):
        row = run["real"][strategy]
        assert row["failed"] == 0, strategy
        assert row["completed"] == 40, strategy  # 40 requests, no warm-up
        # every answer named its server through Envoy and the peer router (X-Served-By)
        assert set(row["share"]) <= {"a100", "rtx4090", "cpu"}, (strategy, row["share"])
        assert sum(row["share"].values()) == pytest.approx(1.0)
    weights = run["real"]["sluice"]["weights"]
    assert weights is not None
    assert weights["a100-0"] > weights["cpu-0"] >= 1
    assert "How far the simulation is from the real run" in (tmp_path / "report.md").read_text()
