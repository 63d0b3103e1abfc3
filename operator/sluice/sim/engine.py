"""An iteration-level model of one vLLM server: the scheduler's semantics, the step time from a roofline model.

Used by the routing simulation (`sluice.bench.sim`, advanced in simulated time) and by the local stack's simulated
model server (`sluice.devstack.modelserver`, advanced in wall-clock time), so both see the same servers.

What it keeps of vLLM's (V1) scheduler, because routing quality depends on exactly these:
- a FCFS waiting queue; running requests are scheduled first, then waiting ones while the step has room;
- a per-step token budget (`max_num_batched_tokens`) shared by decodes (1 token each) and chunked prefills;
- `max_num_seqs` running requests at most;
- paged KV: blocks of `block_size` tokens allocated as a sequence grows, freed when it finishes;
- preemption by recompute: when a running request needs a block and none is free, the most recently admitted
  running request loses its blocks and goes back to the head of the queue, to be prefilled again (prompt plus the
  tokens it had generated); no new waiting request is admitted in a step that preempted.

With `prefix_caching` (vLLM V1's automatic prefix caching as of v0.34.0 (62d4bc3c7), `vllm/v1/core/kv_cache_manager.py`,
`block_pool.py`, `kv_cache_utils.py`): every full block of a request's tokens, prompt and output, is identified by a
hash chained from its parent's; a block stays cached after its request frees it (in reverse order, so its tail is
evicted first) in a free queue taken from its head, least recently freed first (a block holding no full block's
tokens goes to the head); a request scheduled from the waiting queue with nothing computed (new, or preempted) takes
the longest run of its leading blocks found cached, over all its tokens but the last, and prefills only the rest;
cached blocks in the free queue count as free (`kv_cache_usage_perc`). The lookup of a request is counted once, in
tokens, when it is first admitted (`vllm:prefix_cache_queries` / `vllm:prefix_cache_hits`; a preempted request's
second lookup is not, as from v0.27). Not modelled: LoRA and multimodal extra keys, `cache_salt`, the check that a
whole prompt fits before admission (newer vLLM). Requests say what their tokens are by `segments`
(content id, length): two requests share a block exactly when their token streams agree up to its end.

The step time is vllm-sr-sim's `ComputedProfile.prefill_iter_latency` (max of the memory time, weights plus every
scheduled sequence's KV read over effective bandwidth, and the compute time, FLOPs of all scheduled tokens over
peak tensor FLOP/s), fed with the step's exact token count, sequence count and attention work. Not modelled: CPU
scheduling overhead between steps, CUDA graphs, speculative decoding.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from fleet_sim.gpu_profiles import ComputedProfile


@dataclass(frozen=True)
class EngineConfig:
    """vLLM's scheduler knobs (same names, snake_case)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    block_size: int = 16
    prefix_caching: bool = False
    """vLLM V1's automatic prefix caching (on by default in vLLM; off here where no two requests share a token, so
    that those runs do not pay for the bookkeeping: tests/test_prefix_cache.py shows the schedule is the same)."""


OWN_CONTENT = 1 << 62
"""Content ids from here up are a request's own tokens (`submit` without segments); traces use ids below."""

Segments = Seq[tuple[int, int]]
"""What a request's tokens are: (content id, length) pieces in order, the prompt's then the output's. Two requests
whose pieces agree up to a block's end have that block in common."""


def block_hashes(segments: Segments, block_size: int) -> list[int]:
    """The hash of each full block of the token stream `segments` describes, each chained from its parent's (as
    vLLM's `hash_block_tokens(parent_block_hash, block_tokens)`): equal exactly when the prefixes are equal."""
    hashes: list[int] = []
    parent = 0
    piece: list[tuple[int, int, int]] = []
    filled = 0
    for content, length in segments:
        start = 0
        while start < length:
            take = min(block_size - filled, length - start)
            piece.append((content, start, start + take))
            filled += take
            start += take
            if filled == block_size:
                parent = hash((parent, tuple(piece)))
                hashes.append(parent)
                piece = []
                filled = 0
    return hashes


@dataclass(eq=False)  # identity: the scheduler removes *this* sequence from its lists
class Sequence:
    req_id: int
    arrival: float
    prompt: int
    output: int
    computed: int = 0
    """Tokens whose KV is in the cache (reset to 0 by a preemption)."""
    generated: int = 0
    blocks: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    hashes: list[int] | None = None
    """The hashes of the full blocks of its prompt and output (`block_hashes`), with prefix caching."""
    block_ids: list[int] = field(default_factory=list)
    """With prefix caching: the blocks it holds, in order."""
    registered: int = 0
    """With prefix caching: how many of its leading blocks are in the cache's table."""
    cached_tokens: int | None = None
    """Prompt tokens found cached when it was first scheduled; None where nothing was looked up (no cache)."""

    @property
    def tokens(self) -> int:
        """Tokens the next sample needs in the cache: the prompt and everything generated so far."""
        return self.prompt + self.generated


@dataclass(frozen=True)
class StepEvent:
    """Something a client can see, at the end of a step: the first token, or the last."""

    at: float
    sequence: Sequence
    kind: str  # "first_token" | "finished"


@dataclass
class Engine:
    """One server. `submit` requests, `advance_to(t)` runs every step that ends by `t` and returns what happened."""

    profile: ComputedProfile
    config: EngineConfig = field(default_factory=EngineConfig)
    slowdown: float = 1.0
    """Multiplies every step time (a thermal throttle, a noisy neighbour)."""

    def __post_init__(self) -> None:
        self.total_blocks: int = int(self.profile.total_kv_blks)
        self.free_blocks: int = self.total_blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.step: list[tuple[Sequence, int]] = []
        self.step_end: float = math.inf
        self.preemptions_total: int = 0
        self.steps_total: int = 0
        self.busy_seconds: float = 0.0
        caching = self.config.prefix_caching
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.total_blocks) if caching else ())
        """With prefix caching: the free blocks, least recently freed first (the next to be taken)."""
        self.refs: list[int] = [0] * (self.total_blocks if caching else 0)
        self.cached: dict[int, int] = {}
        """Block hash -> the block holding it."""
        self.block_hash: dict[int, int] = {}
        self.prefix_queries_total: int = 0
        """Tokens of the requests looked up in the cache (vLLM's `vllm:prefix_cache_queries`)."""
        self.prefix_hits_total: int = 0
        """Of those, the tokens found cached (`vllm:prefix_cache_hits`)."""
        self.evictions_total: int = 0
        """Cached blocks taken for other content."""

    # ------------------------------------------------------------------------------------ the public surface

    def fits(self, prompt: int, output: int) -> bool:
        """Whether a request could ever run here (vLLM rejects a request longer than the KV cache at validation)."""
        return self._blocks_for(prompt + output) <= self.total_blocks

    def submit(self, req_id: int, now: float, prompt: int, output: int, segments: Segments | None = None) -> Sequence:
        """A request arrives. `segments`: what its prompt's and output's tokens are (prefix caching), summing to at
        least its prompt; without them, its tokens are its own."""
        sequence = Sequence(req_id=req_id, arrival=now, prompt=max(1, prompt), output=max(1, output))
        if self.config.prefix_caching:
            sequence.hashes = block_hashes(
                segments or ((OWN_CONTENT + req_id, prompt + output),), self.config.block_size
            )
        self.waiting.append(sequence)
        if not self.step:
            self._start_step(now)
        return sequence

    def next_event_time(self) -> float:
        return self.step_end

    def advance_to(self, t: float) -> list[StepEvent]:
        events: list[StepEvent] = []
        while self.step and self.step_end <= t:
            end = self.step_end
            events += self._finish_step(end)
            self._start_step(end)
        return events

    @property
    def kv_usage(self) -> float:
        return (self.total_blocks - self.free_blocks) / self.total_blocks if self.total_blocks else 0.0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------------------------ the scheduler

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def _allocate(self, sequence: Sequence, count: int) -> None:
        self.free_blocks -= count
        sequence.blocks += count
        if not self.config.prefix_caching:
            return
        queue, block_hash = self.free_queue, self.block_hash
        for _ in range(count):
            block, _none = queue.popitem(last=False)
            if block in block_hash:  # evicted: its content is gone from the cache
                del self.cached[block_hash.pop(block)]
                self.evictions_total += 1
            self.refs[block] = 1
            sequence.block_ids.append(block)

    def _release(self, sequence: Sequence) -> None:
        """Free its blocks; with prefix caching they stay cached, the last block first in line to be evicted, and
        a block another running request shares stays taken."""
        if not self.config.prefix_caching:
            self.free_blocks += sequence.blocks
            sequence.blocks = 0
            return
        refs, queue, block_hash = self.refs, self.free_queue, self.block_hash
        for block in reversed(sequence.block_ids):
            refs[block] -= 1
            if refs[block] == 0:
                queue[block] = None
                if block not in block_hash:  # nothing cached in it: the first to be taken (vLLM >= 0.24)
                    queue.move_to_end(block, last=False)
                self.free_blocks += 1
        sequence.blocks = 0
        sequence.block_ids = []
        sequence.registered = 0

    def _cache_hit(self, sequence: Sequence) -> list[int]:
        """The cached blocks its leading blocks are, at most all its tokens but one (vLLM recomputes the last)."""
        assert sequence.hashes is not None
        most = min((sequence.tokens - 1) // self.config.block_size, len(sequence.hashes))
        hit: list[int] = []
        cached = self.cached
        for block_hash in sequence.hashes[:most]:
            block = cached.get(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit

    def _take_hit(self, sequence: Sequence, hit: list[int]) -> None:
        refs, queue = self.refs, self.free_queue
        for block in hit:
            if refs[block] == 0:
                del queue[block]
                self.free_blocks -= 1
            refs[block] += 1
        sequence.block_ids = list(hit)
        sequence.blocks = len(hit)
        sequence.registered = len(hit)
        sequence.computed = len(hit) * self.config.block_size

    def _register(self, sequence: Sequence) -> None:
        """Enter its newly filled blocks in the cache's table (a block another request already holds is not)."""
        hashes = sequence.hashes
        assert hashes is not None
        full = min(sequence.computed // self.config.block_size, len(hashes), len(sequence.block_ids))
        for index in range(sequence.registered, full):
            block_hash = hashes[index]
            if block_hash not in self.cached:
                block = sequence.block_ids[index]
                self.cached[block_hash] = block
                self.block_hash[block] = block_hash
        sequence.registered = max(sequence.registered, full)

    def _preempt(self, sequence: Sequence) -> None:
        self._release(sequence)
        sequence.computed = 0
        sequence.preemptions += 1
        self.preemptions_total += 1
        self.waiting.appendleft(sequence)

    def _schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.config.max_num_batched_tokens
        block = self.config.block_size
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        index = 0
        running = self.running
        while index < len(running) and budget > 0:
            sequence = running[index]
            tokens = sequence.prompt + sequence.generated - sequence.computed
            if tokens > budget:  # noqa: PLR1730 - the hot loop: min() is a call
                tokens = budget
            need = -(-(sequence.computed + tokens) // block) - sequence.blocks
            if need > self.free_blocks:
                preempted_itself = False
                while need > self.free_blocks:
                    victim = running.pop()  # the lowest priority under FCFS: the last admitted
                    self._preempt(victim)
                    preempted = True
                    if victim is sequence:
                        preempted_itself = True
                        break
                if preempted_itself:
                    break  # nothing after it is left in the running list
            if need > 0:
                self._allocate(sequence, need)
            scheduled.append((sequence, tokens))
            budget -= tokens
            index += 1
        caching = self.config.prefix_caching
        while self.waiting and budget > 0 and len(running) < self.config.max_num_seqs and not preempted:
            sequence = self.waiting[0]
            hit: list[int] = self._cache_hit(sequence) if caching and sequence.computed == 0 else []
            computed = sequence.computed + len(hit) * self.config.block_size
            tokens = min(sequence.tokens - computed, budget)
            need = self._blocks_for(computed + tokens) - sequence.blocks - len(hit)
            if need + sum(1 for block in hit if self.refs[block] == 0) > self.free_blocks:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if caching and sequence.computed == 0:
                if sequence.preemptions == 0:  # vLLM counts a request's lookup once, not again after a preemption
                    self.prefix_queries_total += sequence.tokens
                    self.prefix_hits_total += computed
                    sequence.cached_tokens = computed
                self._take_hit(sequence, hit)
            self._allocate(sequence, need)
            running.append(sequence)
            scheduled.append((sequence, tokens))
            budget -= tokens
        return scheduled

    def step_seconds(self, scheduled: list[tuple[Sequence, int]]) -> float:
        """fleet_sim's roofline for one step with exactly these sequences and token counts."""
        tokens = 0
        attention = 0.0
        context = 0
        for sequence, n in scheduled:
            tokens += n
            # fleet_sim's attention term is 4·h·d·c·(c/2 + q)·L: pick q so that c·(c/2 + q) equals the true
            # sum over sequences of n·(n/2 + history) (decode tokens do not attend to each other).
            attention += n * (n / 2 + sequence.computed)
            context += sequence.computed + n
        history = attention / tokens - tokens / 2
        seconds = self.profile.prefill_iter_latency(tokens, history, len(scheduled), context / len(scheduled))
        return float(seconds) * self.slowdown

    def _start_step(self, now: float) -> None:
        self.step = self._schedule() if (self.running or self.waiting) else []
        if not self.step:
            self.step_end = math.inf
            return
        seconds = self.step_seconds(self.step)
        self.step_end = now + seconds
        self.busy_seconds += seconds
        self.steps_total += 1

    def _finish_step(self, end: float) -> list[StepEvent]:
        events: list[StepEvent] = []
        done = False
        caching = self.config.prefix_caching
        for sequence, tokens in self.step:
            sequence.computed += tokens
            if caching:
                self._register(sequence)
            if sequence.computed < sequence.prompt + sequence.generated:
                continue  # a prefill chunk that did not reach the end of the prompt yet
            sequence.generated += 1
            if sequence.first_token_at is None:
                sequence.first_token_at = end
                events.append(StepEvent(end, sequence, "first_token"))
            if sequence.generated >= sequence.output:
                sequence.finished_at = end
                self._release(sequence)
                done = True
                events.append(StepEvent(end, sequence, "finished"))
        if done:
            self.running = [s for s in self.running if s.finished_at is None]
        self.step = []
        return events
