"""The benchmark's model of the vLLM router's `cache_aware` policy, held to its source.

vllm-project/router `src/policies/cache_aware.rs` @2f2db0d9a6d0 (`select_worker`): imbalanced when max load - min load >
`balance_abs_threshold` and max load > min load x `balance_rel_threshold`, then the least loaded worker (the first
minimum); otherwise the prompt is matched against the tree of routed prompts, and past `cache_threshold` (strictly)
the worker that last took the deepest matched node is chosen, below it the least loaded; the prompt is inserted for
the chosen worker at routing time. Defaults from its command line (`src/main.rs` @03e9af5c1982; vllm-router
0.1.17's `--help` says the same): 0.3, 64, 1.5.
"""

from __future__ import annotations

from sluice.bench.dataplane import CacheAwareRouter
from sluice.sim.engine import block_hashes

HOSTS = ["w0", "w1", "w2"]


def _prompt(*segments: tuple[int, int]) -> tuple[list[int], int]:
    tokens = sum(n for _, n in segments)
    return block_hashes(segments, 16), tokens


def test_an_unmatched_prompt_goes_to_the_least_loaded_worker_and_a_match_follows_it_there() -> None:
    router = CacheAwareRouter(HOSTS)
    router.in_flight.update({"w0": 3, "w1": 1, "w2": 2})
    first = router.pick(*_prompt((1, 320), (2, 64)))
    assert first == "w1"
    router.in_flight.update({"w0": 0, "w1": 5, "w2": 0})  # busier now, but within the balance thresholds
    assert router.pick(*_prompt((1, 320), (3, 64))) == "w1"  # 320 of 384 tokens matched: past 0.3
    assert router.decisions == {"imbalanced": 0, "cache": 1, "least_load": 1}


def test_a_match_below_the_threshold_is_not_followed() -> None:
    router = CacheAwareRouter(HOSTS)
    router.in_flight.update({"w0": 0, "w1": 1, "w2": 1})
    assert router.pick(*_prompt((1, 64), (2, 64))) == "w0"
    router.in_flight.update({"w0": 2, "w1": 0, "w2": 1})
    # 64 of 400 tokens shared: 0.16, below 0.3: the least loaded, not the worker that holds the prefix
    assert router.pick(*_prompt((1, 64), (3, 336))) == "w1"


def test_the_latest_worker_to_take_a_shared_prefix_gets_the_next_request_sharing_it() -> None:
    router = CacheAwareRouter(HOSTS)
    system = (7, 480)
    router.in_flight.update({"w0": 0, "w1": 1, "w2": 1})
    assert router.pick(*_prompt(system, (10, 32))) == "w0"
    router.in_flight.update({"w0": 1, "w1": 1, "w2": 0})
    # imbalance needs both thresholds: 1 - 0 is not > 64, so the cache decides
    assert router.pick(*_prompt(system, (11, 32))) == "w0"


def test_loads_apart_by_both_thresholds_send_to_the_least_loaded_whatever_the_cache() -> None:
    router = CacheAwareRouter(HOSTS)
    router.in_flight.update({"w0": 0, "w1": 0, "w2": 0})
    assert router.pick(*_prompt((1, 320), (2, 64))) == "w0"
    router.in_flight.update({"w0": 100, "w1": 30, "w2": 50})  # 100 - 30 > 64 and 100 > 30 x 1.5
    assert router.pick(*_prompt((1, 320), (3, 64))) == "w1"
    router.in_flight.update({"w0": 100, "w1": 70, "w2": 50})  # 100 - 50 = 50: not past 64
    assert router.pick(*_prompt((1, 320), (4, 64))) == "w1"  # the latest to take the prefix
