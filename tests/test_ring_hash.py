"""The benchmark's Envoy RING_HASH with bounded load, held to Envoy's source (envoyproxy/envoy; the copies read:
`ring_hash_lb.cc` @0d2acde2e8d7, `thread_aware_lb_impl.cc` @0336fd611e57), and the real benchmark's ring
configuration to the Envoy the test extra installs (1.40).

`source/extensions/load_balancing_policies/ring_hash/ring_hash_lb.cc` (the ring: scale and per-host point counts)
and `source/extensions/load_balancing_policies/common/thread_aware_lb_impl.cc` (`BoundedLoadHashingLoadBalancer`).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from sluice.bench.control import SESSION_HEADER
from sluice.bench.dataplane import EnvoyRingHash
from sluice.bench.envoy import envoy_config, prompt_text, write_eds
from sluice.bench.scenario import ConversationSpec, WorkloadSpec
from sluice.bench.trace import Arrival, make_trace
from sluice.devstack.modelserver import token_segments
from sluice.sim.engine import block_hashes
from tests.test_envoy_patches import envoy_validate


def test_equal_hosts_get_a_quarter_of_the_minimum_ring_each() -> None:
    ring = EnvoyRingHash(dict.fromkeys("abcd", 0))
    ring.update(dict.fromkeys("abcd", 1.0))
    assert Counter(ring.owners) == dict.fromkeys("abcd", 256)  # ceil(1024 / 4)


def test_weights_scale_the_points_from_the_lightest_host() -> None:
    ring = EnvoyRingHash(dict.fromkeys("abcd", 0))
    ring.update({"a": 2.0, "b": 1.0, "c": 1.0, "d": 1.0})
    # normalised 0.4 / 0.2 x 3; scale = ceil(0.2 x 1024) / 0.2 = 1025; running sums 410, 615, 820, 1025
    assert Counter(ring.owners) == {"a": 410, "b": 205, "c": 205, "d": 205}
    assert ring.points == sorted(ring.points)


def test_a_key_keeps_its_host_and_a_weight_change_rebuilds_the_ring() -> None:
    ring = EnvoyRingHash(dict.fromkeys("abcd", 0))
    ring.update(dict.fromkeys("abcd", 1.0))
    before = {k: ring.pick(str(k)) for k in range(2000)}
    assert before == {k: ring.pick(str(k)) for k in range(2000)}
    assert set(before.values()) == set("abcd")
    ring.update(dict.fromkeys("abcd", 2.0))  # the same shares: no rebuild
    assert ring.rebuilds == 1
    ring.update({"a": 2.0, "b": 1.0, "c": 1.0, "d": 1.0})
    assert ring.rebuilds == 2
    after = {k: ring.pick(str(k)) for k in range(2000)}
    moved = sum(1 for k in before if before[k] != after[k]) / len(before)
    to_a = sum(1 for k in before if after[k] == "a" and before[k] != "a") / len(before)
    assert 0.10 < to_a <= moved  # a's share went from 1/4 to 2/5: keys moved to it, and others between the rest


def test_bounded_load_spills_a_key_whose_host_is_past_its_slots() -> None:
    active = dict.fromkeys("abcd", 0)
    ring = EnvoyRingHash(active, balance_factor=150)
    ring.update(dict.fromkeys("abcd", 1.0))
    key = "session-7"
    home = ring.pick(key)
    # 8 active in this Envoy, all on `home`: total slots ceil(9 x 150 / 100) = 14, a host's ceil(14 / 4) = 4
    active[home] = 8
    spilled = ring.pick(key)
    assert spilled != home
    assert ring.pick(key) == spilled  # the spill order is fixed per key
    active[home] = 4
    active[spilled] = 0
    # 4 active: total ceil(5 x 1.5) = 8, slots 2; home at 4 is past them
    assert ring.pick(key) != home
    active[home] = 2
    # 2 active: total ceil(3 x 1.5) = 5, slots ceil(1.25) = 2; 2 / 2 <= 1: home is kept
    assert ring.pick(key) == home
    unbounded = EnvoyRingHash(active)
    unbounded.update(dict.fromkeys("abcd", 1.0))
    active[home] = 100
    assert unbounded.pick(key) == home


def test_when_every_host_is_past_its_slots_the_least_overloaded_is_taken() -> None:
    active = {"a": 9, "b": 9, "c": 3, "d": 9}
    ring = EnvoyRingHash(active, balance_factor=100)
    ring.update(dict.fromkeys("abcd", 1.0))
    # 30 active: total slots 31, a host's ceil(7.75) = 8: only c is within; every key that spills goes to c
    keys = [k for k in range(200) if ring.ring_host(EnvoyRingHash.key_hash(str(k))) != "c"]
    assert {ring.pick(str(k)) for k in keys} == {"c"}
    active["c"] = 12
    # 39 active: total slots 40, a host's 10: a, b and d (9) are within and keep their keys
    assert all(ring.pick(str(k)) == ring.ring_host(EnvoyRingHash.key_hash(str(k))) for k in keys)


def test_the_real_benchmarks_ring_hash_cluster_is_accepted_by_real_envoy(tmp_path: Path) -> None:
    write_eds(tmp_path, [("127.0.30.1", 1), ("127.0.30.2", 1)])
    config = envoy_config(tmp_path, 18080, 18081, "RING_HASH", hash_header=SESSION_HEADER)
    cluster = config["static_resources"]["clusters"][0]
    assert cluster["common_lb_config"]["consistent_hashing_lb_config"] == {"hash_balance_factor": 150}
    route = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert route["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["hash_policy"] == [
        {"header": {"header_name": "x-session-id"}}
    ]
    result = envoy_validate(config, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_later_turn_sent_to_a_real_server_shares_the_earlier_turns_words_and_answer() -> None:
    talk = ConversationSpec(turns=6, think_seconds=5.0, system_prompts=2, system_tokens=100)
    trace = make_trace(WorkloadSpec(lengths="lmsys", conversation=talk), 4.0, 120.0, 2, 1)
    sessions: dict[int, list[Arrival]] = {}
    for a in trace:
        sessions.setdefault(a.session, []).append(a)
    first, second = next(turns for turns in sessions.values() if len(turns) > 1)[:2]
    earlier = token_segments(prompt_text(first).split(), first.output)
    later = token_segments(prompt_text(second).split(), second.output)
    assert len(prompt_text(second).split()) == second.prompt
    shared = first.prompt + first.output  # the earlier prompt, then its answer as the server streamed it
    assert later[:shared] == earlier
    assert block_hashes(later, 16)[: shared // 16] == block_hashes(earlier, 16)[: shared // 16]
