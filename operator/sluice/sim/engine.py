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

The step time is vllm-sr-sim's `ComputedProfile.prefill_iter_latency` (max of the memory time, weights plus every
scheduled sequence's KV read over effective bandwidth, and the compute time, FLOPs of all scheduled tokens over
peak tensor FLOP/s), fed with the step's exact token count, sequence count and attention work. Not modelled: CPU
scheduling overhead between steps, CUDA graphs, prefix caching, speculative decoding.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from fleet_sim.gpu_profiles import ComputedProfile


@dataclass(frozen=True)
class EngineConfig:
    """vLLM's scheduler knobs (same names, snake_case)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    block_size: int = 16


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

    # ------------------------------------------------------------------------------------ the public surface

    def fits(self, prompt: int, output: int) -> bool:
        """Whether a request could ever run here (vLLM rejects a request longer than the KV cache at validation)."""
        return self._blocks_for(prompt + output) <= self.total_blocks

    def submit(self, req_id: int, now: float, prompt: int, output: int) -> Sequence:
        sequence = Sequence(req_id=req_id, arrival=now, prompt=max(1, prompt), output=max(1, output))
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

    def _preempt(self, sequence: Sequence) -> None:
        self.free_blocks += sequence.blocks
        sequence.blocks = 0
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
                self.free_blocks -= need
                sequence.blocks += need
            scheduled.append((sequence, tokens))
            budget -= tokens
            index += 1
        while self.waiting and budget > 0 and len(running) < self.config.max_num_seqs and not preempted:
            sequence = self.waiting[0]
            tokens = min(sequence.tokens - sequence.computed, budget)
            need = self._blocks_for(sequence.computed + tokens) - sequence.blocks
            if need > self.free_blocks:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.free_blocks -= need
            sequence.blocks += need
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
        for sequence, tokens in self.step:
            sequence.computed += tokens
            if sequence.computed < sequence.prompt + sequence.generated:
                continue  # a prefill chunk that did not reach the end of the prompt yet
            sequence.generated += 1
            if sequence.first_token_at is None:
                sequence.first_token_at = end
                events.append(StepEvent(end, sequence, "first_token"))
            if sequence.generated >= sequence.output:
                sequence.finished_at = end
                self.free_blocks += sequence.blocks
                sequence.blocks = 0
                done = True
                events.append(StepEvent(end, sequence, "finished"))
        if done:
            self.running = [s for s in self.running if s.finished_at is None]
        self.step = []
        return events
