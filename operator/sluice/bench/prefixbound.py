"""A floor under every router's TTFT on a trace with prefix reuse: what no placement of the requests can beat.

Each request alone on an idle engine of the fleet's fastest class for it, with every full block that any request
arriving before it would fill (its prompt and its whole answer) already cached there, however many: no queue, no
batch to share a step with, no eviction, and the best cache any router could have built. Its prompt is then
prefilled from the first block not seen before, in chunks of `max_num_batched_tokens`, the last token always
computed (vLLM's hit cap), each chunk taking the engine's step time (`Engine.step_seconds`: sharing a step or
splitting a chunk only adds time). A target below this floor is one no router can meet; a router's distance above
it is what queueing and lost cache cost it. `tests/test_prefix_bound.py` checks it against the simulation's own
TTFTs, request by request.
"""

from __future__ import annotations

from collections.abc import Iterable

from sluice.bench.scenario import Scenario
from sluice.bench.trace import Arrival
from sluice.sim.engine import OWN_CONTENT, Engine, EngineConfig, Sequence, block_hashes
from sluice.sim.profiles import server_profile


def alone_seconds(engine: Engine, prompt: int, cached: int) -> float:
    """Time to the first token of a `prompt`-token request with `cached` tokens found, alone on an idle `engine`."""
    chunk = engine.config.max_num_batched_tokens
    seconds, computed = 0.0, cached
    while computed < prompt:
        tokens = min(chunk, prompt - computed)
        sequence = Sequence(req_id=0, arrival=0.0, prompt=prompt, output=1)
        sequence.computed = computed
        seconds += engine.step_seconds([(sequence, tokens)])
        computed += tokens
    return seconds


def ttft_floor(scenario: Scenario, trace: Iterable[Arrival]) -> dict[int, float]:
    """Arrival index -> the least TTFT (seconds) any router could give it on this fleet."""
    config = EngineConfig(scenario.engine.max_num_batched_tokens, scenario.engine.max_num_seqs)
    hardware = sorted({s.hardware for s in scenario.servers})
    engines = [Engine(server_profile(h, scenario.model), config) for h in hardware]
    block = config.block_size
    seen: set[int] = set()
    floor: dict[int, float] = {}
    for arrival in sorted(trace, key=lambda a: (a.at, a.index)):
        prompt = max(1, arrival.prompt)
        segments = arrival.segments or ((OWN_CONTENT + arrival.index, prompt + arrival.output),)
        hashes = block_hashes(segments, block)
        most = min((prompt - 1) // block, len(hashes))
        found = 0
        while found < most and hashes[found] in seen:
            found += 1
        floor[arrival.index] = min(alone_seconds(e, prompt, found * block) for e in engines)
        seen.update(hashes)
    return floor
