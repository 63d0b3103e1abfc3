"""The simulated engine's prefix cache, held to vLLM V1's automatic prefix caching, and the traces that reuse prefixes.

Upstream (vLLM v0.11, `vllm/v1/core/kv_cache_manager.py` `get_computed_blocks`, `vllm/v1/core/block_pool.py`):
- only full blocks are cached, each identified by a hash chained from its parent block's;
- a lookup takes the longest run of leading blocks found cached, over the request's tokens but its last
  (`max_cache_hit_length = request.num_tokens - 1`: the last token is always computed, to sample from it);
- a request's blocks are freed in reverse order into the free queue and stay cached until a new allocation takes
  them from the head of that queue (least recently freed first; a request's tail before its head);
- a cached block in the free queue still counts as free (`kv_cache_usage` is 1 - free / total).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from sluice.bench.scenario import ConversationSpec, EngineSpec, Scenario, ServerSpec, WorkloadSpec
from sluice.bench.sim import Simulation, summarise
from sluice.bench.trace import Arrival, _mooncake_records, make_trace
from sluice.sim.engine import Engine, EngineConfig, StepEvent, block_hashes
from sluice.sim.profiles import server_profile

BLOCK = 16


def _engine(blocks: int | None = None, caching: bool = True) -> Engine:
    profile = server_profile("a100")
    if blocks is not None:
        profile = dataclasses.replace(profile, total_kv_blks=blocks)
    return Engine(profile, EngineConfig(prefix_caching=caching))


def _run(engine: Engine) -> list[StepEvent]:
    events: list[StepEvent] = []
    while engine.next_event_time() < math.inf:
        events += engine.advance_to(engine.next_event_time())
    return events


def _first_token(events: list[StepEvent], req_id: int) -> float:
    return next(e.at for e in events if e.sequence.req_id == req_id and e.kind == "first_token")


def test_block_hashes_are_equal_exactly_as_far_as_the_token_streams_agree() -> None:
    system, other = (1, 40), (2, 40)
    a = block_hashes([system, (10, 30)], BLOCK)  # 70 tokens: 4 full blocks
    b = block_hashes([system, (11, 30)], BLOCK)
    c = block_hashes([other, (10, 30)], BLOCK)
    assert len(a) == 4
    assert a[:2] == b[:2]  # tokens 0..31 are the system prompt's in both
    assert a[2] != b[2]  # block 2 holds tokens 32..47: 8 of the system prompt, then different content
    assert not set(a) & set(c)
    # the same tokens cut into different pieces are the same stream
    assert block_hashes([(1, 40), (10, 30)], BLOCK) == block_hashes([(1, 40), (10, 30)], BLOCK)
    assert block_hashes([(5, 10)], BLOCK) == []  # a partial block is never cached


def test_without_shared_tokens_the_schedule_is_the_same_with_or_without_the_cache() -> None:
    work = WorkloadSpec(lengths="lmsys")
    trace = make_trace(work, 8.0, 60.0, 3, 1)
    runs = []
    for caching in (False, True):
        engine = _engine(caching=caching)
        events: list[tuple[float, int, str]] = []
        for a in trace:
            events += [(e.at, e.sequence.req_id, e.kind) for e in engine.advance_to(a.at)]
            engine.submit(a.index, a.at, a.prompt, a.output)
        events += [(e.at, e.sequence.req_id, e.kind) for e in _run(engine)]
        runs.append((events, engine.prefix_hits_total))
    assert runs[0][0] == runs[1][0]
    assert runs[1][1] == 0


def test_a_shared_prefix_is_prefilled_once_and_only_the_rest_is_computed() -> None:
    engine = _engine()
    system = (1, 2000)
    engine.submit(0, 0.0, 2100, 2, [system, (10, 100), (11, 2)])
    alone = _first_token(_run(engine), 0)
    engine.submit(1, 10.0, 2100, 2, [system, (20, 100), (21, 2)])
    events = _run(engine)
    assert engine.prefix_queries_total == 4200
    assert engine.prefix_hits_total == 2000 // BLOCK * BLOCK  # 125 full blocks of the system prompt
    assert _first_token(events, 1) - 10.0 < 0.5 * alone  # a 100-token prefill against 2100


def test_an_identical_prompt_leaves_its_last_token_to_compute() -> None:
    engine = _engine()
    engine.submit(0, 0.0, 64, 1, [(1, 64), (2, 1)])
    _run(engine)
    engine.submit(1, 1.0, 64, 1, [(1, 64), (3, 1)])
    _run(engine)
    # 64 tokens are 4 full blocks, but a hit covers at most 63 tokens: 3 blocks
    assert engine.prefix_hits_total == 3 * BLOCK


def test_a_turn_hits_the_previous_turns_prompt_and_its_answer() -> None:
    engine = _engine()
    first = [(1, 500), (2, 300)]  # user tokens, then the answer
    engine.submit(0, 0.0, 500, 300, first)
    _run(engine)
    engine.submit(1, 100.0, 900, 10, [*first, (3, 100), (4, 10)])
    _run(engine)
    # the answer's blocks were cached as they filled; its last token was sampled, never computed, so the KV of 799
    # tokens was written: 49 full blocks
    assert engine.prefix_hits_total == 49 * BLOCK


def test_the_least_recently_freed_blocks_are_evicted_first_and_a_requests_tail_before_its_head() -> None:
    engine = _engine(blocks=40)  # 640 tokens of KV
    first, second = [(1, 320), (9, 1)], [(2, 320), (9, 1)]
    engine.submit(0, 0.0, 320, 1, first)  # 20 blocks, freed at the end
    _run(engine)
    engine.submit(1, 1.0, 320, 1, second)  # 20 more, freed after
    _run(engine)
    assert engine.free_blocks == engine.total_blocks  # cached blocks count as free
    assert engine.kv_usage == 0.0
    engine.submit(2, 2.0, 170, 1, [(3, 170), (9, 1)])  # 11 blocks, taken from the head of the free queue
    _run(engine)
    assert engine.evictions_total == 11
    cached = set(engine.cached)
    # request 0's blocks were freed first, its tail first: its last 11 are gone, its first 9 and request 1's stay
    assert [h in cached for h in block_hashes(first, BLOCK)] == [True] * 9 + [False] * 11
    assert all(h in cached for h in block_hashes(second, BLOCK))
    engine.submit(3, 3.0, 321, 1, [(1, 320), (4, 1)])
    _run(engine)
    assert engine.prefix_hits_total == 9 * BLOCK


def test_a_block_shared_with_a_running_request_stays_taken_when_the_other_frees_it() -> None:
    engine = _engine(blocks=40)
    engine.submit(0, 0.0, 320, 200, [(1, 320), (5, 200)])  # 20 blocks, then more while it decodes
    engine.advance_to(engine.next_event_time())  # its prefill: its 20 blocks cached, and held
    engine.submit(1, 0.0, 160, 1, [(1, 160), (6, 1)])  # its 160 tokens are request 0's first 10 blocks
    engine.advance_to(engine.next_event_time())
    assert engine.prefix_hits_total == 9 * BLOCK  # all but the last token: 9 blocks shared, 1 of its own
    assert engine.free_blocks == engine.total_blocks - 21 - 1  # request 0's 21 (one more for its decode), none of 1's
    assert engine.free_blocks == len(engine.free_queue)
    _run(engine)
    assert engine.free_blocks == engine.total_blocks


@pytest.mark.parametrize("think", [0.0, 20.0])
def test_a_conversation_trace_sends_each_turn_the_conversation_so_far(think: float) -> None:
    talk = ConversationSpec(turns=4, think_seconds=think, system_prompts=3, system_tokens=300)
    work = WorkloadSpec(lengths="lmsys", conversation=talk, max_prompt_tokens=6000)
    trace = make_trace(work, 5.0, 200.0, 1, 4)
    by_session: dict[int, list[tuple[int, int, tuple[tuple[int, int], ...]]]] = {}
    for a in trace:
        assert a.segments is not None
        assert sum(n for _, n in a.segments) == a.prompt + a.output
        by_session.setdefault(a.session, []).append((a.prompt, a.output, a.segments))
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert multi
    for turns in multi:
        for (_, _, before), (prompt, _, after) in itertools.pairwise(turns):
            assert after[: len(before)] == before  # the earlier turn, its answer included, leads the later one
            assert prompt == sum(n for _, n in before) + after[len(before)][1]
    systems = {turns[0][2][0] for turns in by_session.values()}
    assert systems <= {(k, 300) for k in range(3)}


def test_a_conversation_trace_is_the_same_sessions_arriving_faster_at_a_higher_load() -> None:
    talk = ConversationSpec(turns=3, think_seconds=10.0, system_prompts=2, system_tokens=100)
    work = WorkloadSpec(lengths="lmsys", conversation=talk)
    slow, fast = make_trace(work, 2.0, 300.0, 5, 1), make_trace(work, 4.0, 300.0, 5, 1)
    assert 1.5 < len(slow) / 300.0 < 2.5  # the request rate asked for
    assert 1.6 < len(fast) / len(slow) < 2.4

    def turns(trace: list[Arrival]) -> dict[int, set[tuple[tuple[int, int], ...]]]:
        out: dict[int, set[tuple[tuple[int, int], ...]]] = {}
        for a in trace:
            assert a.segments is not None
            out.setdefault(a.session, set()).add(a.segments)
        return out

    at_slow, at_fast = turns(slow), turns(fast)
    common = at_slow.keys() & at_fast.keys()
    assert len(common) > 0.6 * len(at_slow)  # at 2x the rate more sessions under way at 0 end before it
    for session in common:  # one conversation: every turn sent at either load extends the shorter ones
        chain = sorted(at_slow[session] | at_fast[session], key=len)
        assert all(longer[: len(shorter)] == shorter for shorter, longer in itertools.pairwise(chain))


def test_a_session_kept_on_one_pod_finds_its_conversation_cached_where_least_request_scatters_it() -> None:
    scenario = Scenario(
        name="two-a100-chat",
        seed=3,
        servers=[ServerSpec(name="a100-0", hardware="a100"), ServerSpec(name="a100-1", hardware="a100")],
        engine=EngineSpec(prefix_caching=True),
        workload=WorkloadSpec(
            lengths="lmsys",
            duration=120.0,
            warm_up=30.0,
            conversation=ConversationSpec(turns=5, think_seconds=5.0),
        ),
    )
    trace = make_trace(scenario.workload, 6.0, scenario.workload.duration, scenario.seed, 4)
    hits = {
        s: summarise(Simulation(scenario, s, trace).run())["prefix_hit_rate"] for s in ("least-request", "ring-hash")
    }
    assert hits["ring-hash"] > 0.6  # every turn after the first finds its conversation on its pod
    assert hits["least-request"] < hits["ring-hash"] - 0.1  # two pods: half its turns land where they were
    off = scenario.model_copy(update={"engine": EngineSpec(prefix_caching=False)})
    assert summarise(Simulation(off, "ring-hash", trace).run())["prefix_hit_rate"] is None  # no cache: none looked up


MOONCAKE = "benchmarks/traces/mooncake-conversation.jsonl.xz"


def test_the_mooncake_trace_is_replayed_as_recorded_its_blocks_as_shared_content() -> None:
    work = WorkloadSpec(trace_file=MOONCAKE, duration=200.0)
    records = _mooncake_records(MOONCAKE)
    assert len(records) == 12031  # as the paper's Table 2 and the file have it
    assert all(len(h) == -(-n // 512) for _, n, _, h in records)  # one id per 512-token block, the last partial
    trace = make_trace(work, 4.0, 200.0, 3, 8)
    assert trace == make_trace(work, 4.0, 200.0, 3, 8)  # the same requests for every strategy
    assert trace != make_trace(work, 4.0, 200.0, 4, 8)  # each seed its own window
    assert 600 < len(trace) < 1000
    by_blocks: dict[int | None, set[int]] = {}
    for a in trace:
        assert a.segments is not None
        assert sum(n for _, n in a.segments) == a.prompt + a.output
        assert all(n == 512 for _, n in a.segments[:-2])
        by_blocks.setdefault(a.segments[1][0] if len(a.segments) > 2 else None, set()).add(a.session)
    # requests opening with the same two blocks are one session; block 0 alone (every request's) is not
    assert all(len(sessions) == 1 for first, sessions in by_blocks.items() if first is not None)
    assert len({a.session for a in trace}) > 1


def test_a_trace_file_and_a_conversation_are_not_both_a_workload() -> None:
    with pytest.raises(ValueError, match="trace_file or conversation"):
        WorkloadSpec(trace_file=MOONCAKE, conversation=ConversationSpec())
