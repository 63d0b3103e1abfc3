"""The real-Envoy cross-check's verdict across seeds: per seed and on the medians, the 25 % agreement bound."""

from __future__ import annotations

from typing import Any

from sluice.bench.envoy import summary_lines


def run(seed: int, real: float | None, simulated: float) -> dict[str, Any]:
    return {
        "seed": seed,
        "real": {"sluice": {"ttft_p99_ms_vs_least-request": real}},
        "simulated": {"sluice": {"ttft_p99_ms_vs_least-request": simulated}},
    }


def test_each_seed_and_the_medians_are_judged_against_the_bound() -> None:
    # The three single runs on record: 0.73x, 0.60x and 0.85x real against 0.61x simulated.
    lines = summary_lines([run(1, 0.73, 0.61), run(2, 0.60, 0.61), run(3, 0.85, 0.61)])
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ") and line[2].isdigit()}
    assert rows["1"].rstrip().endswith("| 1.20 | yes |")  # 0.73 / 0.61 = 1.197
    assert rows["2"].rstrip().endswith("| 0.98 | yes |")
    assert rows["3"].rstrip().endswith("| 1.39 | no |")  # 0.85 / 0.61 = 1.393
    verdict = lines[-1]
    assert "real 0.73x [0.60–0.85]" in verdict
    assert "median real / median simulated 1.20 (within 25 %: yes)" in verdict


def test_the_medians_can_say_no() -> None:
    verdict = summary_lines([run(1, 0.85, 0.61), run(2, 0.80, 0.61), run(3, 0.60, 0.61)])[-1]
    assert "median real / median simulated 1.31 (within 25 %: no)" in verdict


def test_a_seed_without_a_ratio_is_shown_and_left_out_of_the_medians() -> None:
    lines = summary_lines([run(1, None, 0.61), run(2, 0.70, 0.61)])
    assert any(line.startswith("| 1 | - |") for line in lines)
    assert "Over 1 seed(s): real 0.70x" in lines[-1]


def test_each_sluice_strategy_that_ran_gets_its_own_verdict() -> None:
    # sluice-affinity's ratios on the chat-sessions-mixed traces (seeds 7-9): 0.72/0.70, 0.70/0.63, 0.84/0.85.
    runs = [
        {"seed": seed, "real": {"sluice-affinity": {key: a}}, "simulated": {"sluice-affinity": {key: b}}}
        for seed, a, b in ((7, 0.72, 0.70), (8, 0.70, 0.63), (9, 0.84, 0.85))
        for key in ["ttft_p99_ms_vs_least-request"]
    ]
    lines = summary_lines(runs, "sluice-affinity")
    assert lines[0].startswith("| seed | sluice-affinity P99 / least-request, real |")
    assert "median real / median simulated 1.03 (within 25 %: yes)" in lines[-1]  # 0.72 / 0.70
    assert summary_lines(runs)[-1].startswith("| 9 | - |")  # the plain sluice row did not run
