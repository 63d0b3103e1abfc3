"""The arrival trace of a benchmark run: one list of requests replayed identically for every strategy.

Called by `sluice.bench.sim` and `sluice.bench.report`. Common random numbers: the trace depends only on the
scenario's workload and the seed, never on the strategy. Poisson arrival times are drawn once at unit rate and
scaled by `1 / rate`, so the points of a load sweep are the same requests arriving faster, not new draws. Each request
carries its prompt and output lengths, a session id (for consistent hashing) and the client sidecar it comes from.

With `workload.conversation` the requests are turns of sessions (`conversation_trace`): sessions start as a Poisson
process (unit-rate draws scaled, as above), each turn's prompt is its system prompt, every earlier turn's user tokens
and answer, then its own user tokens; its `segments` say so, for the servers' prefix caches. Turns arrive at their
session's start plus exponential think gaps that do not scale with the load, whatever the earlier answers took (an
open loop: a turn may arrive before the previous answer is complete, as in a replayed trace). The same sessions, with
the same contents and gaps, arrive at every load.

`write_azure_csv` writes the trace in the AzurePublicDataset format (TIMESTAMP, ContextTokens, GeneratedTokens)
that kubernetes-sigs' inference-perf replays (`load.type: trace_replay`, `load.trace.format: AzurePublicDataset`).
"""

from __future__ import annotations

import functools
import json
import lzma
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import fleet_sim
from fleet_sim.workload.synthetic import CdfWorkload

from sluice.bench.scenario import ConversationSpec, WorkloadSpec
from sluice.sim.engine import OWN_CONTENT

CDF_FILES = {"lmsys": "lmsys_cdf.json", "azure": "azure_cdf.json", "agent_heavy": "agent_heavy_cdf.json"}


@dataclass(frozen=True)
class Arrival:
    index: int
    at: float
    prompt: int
    output: int
    session: int
    client: int
    draw: float
    """A uniform draw owned by this request (the error injection uses it, so every strategy sees the same fate)."""
    tenant: str | None = None
    """The tenant it is sent for (`WorkloadSpec.tenants`), drawn from its own stream: traces without tenants are
    the same draws as before."""
    segments: tuple[tuple[int, int], ...] | None = None
    """What its prompt's and output's tokens are (content id, length), for prefix caches; None: its own."""


def _lengths(work: WorkloadSpec, count: int, seed: int) -> list[tuple[int, int]]:
    if work.lengths == "fixed":
        return [(work.prompt_tokens, work.output_tokens)] * count
    source = Path(str(fleet_sim.__file__)).parent / "data" / CDF_FILES[work.lengths]
    gen = CdfWorkload(source, seed=seed)
    out = []
    for i in range(count):
        req = gen.sample_request(i, 0.0)
        out.append((min(int(req.l_in), work.max_prompt_tokens), max(1, min(int(req.l_out), work.max_output_tokens))))
    return out


def _times(work: WorkloadSpec, rate: float, count: int, rng: random.Random) -> list[float]:
    """Arrival times at mean `rate`: Poisson (unit-rate draws scaled, so a sweep replays the same draws faster),
    or on/off bursts of `burst_factor` x the quiet rate for `burst_seconds` every `period`, by thinning."""
    out, t = [], 0.0
    if work.arrival == "poisson":
        for _ in range(count):
            t += rng.expovariate(1.0)
            out.append(t / rate)
        return out
    quiet = work.period - work.burst_seconds
    base = rate * work.period / (quiet + work.burst_factor * work.burst_seconds)
    peak = base * work.burst_factor
    while len(out) < count:
        t += rng.expovariate(peak)
        if t % work.period < work.burst_seconds or rng.random() < base / peak:
            out.append(t)
    return out


def make_trace(work: WorkloadSpec, rate: float, duration: float, seed: int, clients: int) -> list[Arrival]:
    """Requests arriving at `rate` per second for `duration` seconds: the same draws for any strategy."""
    if work.conversation is not None:
        return conversation_trace(work, rate, duration, seed, clients)
    if work.trace_file is not None:
        return mooncake_trace(work, rate, duration, seed, clients)
    rng = random.Random(f"trace-{seed}")
    count = max(1, int(rate * duration * 1.3) + 50)
    times = _times(work, rate, count, rng)
    lengths = _lengths(work, count, seed)
    meta = random.Random(f"meta-{seed}")
    tenants = random.Random(f"tenant-{seed}")
    names, weights = list(work.tenants), list(work.tenants.values())
    out = []
    for i, (at, (prompt, output)) in enumerate(zip(times, lengths, strict=True)):
        if at > duration:
            break
        tenant = tenants.choices(names, weights)[0] if names else None
        out.append(
            Arrival(
                i, at, prompt, output, meta.randrange(work.sessions), meta.randrange(clients), meta.random(), tenant
            )
        )
    return out


def _turns(
    work: WorkloadSpec, talk: ConversationSpec, key: str, session: int, system: int, draws: list[tuple[int, int]]
) -> list[tuple[float, int, int, tuple[tuple[int, int], ...]]]:
    """One session's turns: (gap after the previous turn, prompt, output, segments). Content ids: the system
    prompts first, then one per turn (its user tokens) in order of session; every answer is `ANSWER` (what an
    answer holds is told apart by what comes before it, as block hashes chain)."""
    rng = random.Random(f"session-{key}")
    head: list[tuple[int, int]] = [(system, talk.system_tokens)] if talk.system_prompts and talk.system_tokens else []
    history = sum(n for _, n in head)
    out: list[tuple[float, int, int, tuple[tuple[int, int], ...]]] = []
    base = talk.system_prompts + session * len(draws)
    for turn, (user, output) in enumerate(draws):
        prompt = history + user
        if prompt > work.max_prompt_tokens or (turn > 0 and rng.random() < 1.0 / talk.turns):
            break
        gap = rng.expovariate(1.0 / talk.think_seconds) if turn > 0 and talk.think_seconds > 0 else 0.0
        said = (base + turn, user)
        answer = (ANSWER, output)
        out.append((gap, prompt, output, (*head, said, answer)))
        head += [said, answer]
        history = prompt + output
    return out


def _zipf_choice(rng: random.Random, count: int, exponent: float) -> int:
    if exponent <= 0:
        return rng.randrange(count)
    return rng.choices(range(count), [1.0 / (k + 1) ** exponent for k in range(count)])[0]


ANSWER = 1 << 61
"""The content of every answer: the local stack's servers answer `tok` repeated, and a client sends it back."""
MAX_TURNS = 48
"""Length draws set aside per session, whatever it uses (so a session's lengths do not depend on the load); a
session ends at its 48th turn at the latest."""
MEAN_TURNS_SESSIONS = 1000
"""Sessions whose turn count gives the mean that turns the request rate into a session rate: the same at any load."""


class _Sessions:
    """Session k of a seed: its system prompt, tenant and turns, the same draws whatever the load."""

    def __init__(self, work: WorkloadSpec, seed: int) -> None:
        self.work = work
        self.seed = seed
        self.systems = random.Random(f"system-{seed}")
        self.tenants = random.Random(f"tenant-{seed}")
        self.lengths = _length_stream(work, seed)
        self.drawn: list[tuple[str | None, list[tuple[float, int, int, tuple[tuple[int, int], ...]]]]] = []

    def __getitem__(self, k: int) -> tuple[str | None, list[tuple[float, int, int, tuple[tuple[int, int], ...]]]]:
        talk = self.work.conversation
        assert talk is not None
        names, weights = list(self.work.tenants), list(self.work.tenants.values())
        while len(self.drawn) <= k:
            index = len(self.drawn)
            system = _zipf_choice(self.systems, max(1, talk.system_prompts), talk.popularity)
            tenant = self.tenants.choices(names, weights)[0] if names else None
            draws = [next(self.lengths) for _ in range(MAX_TURNS)]
            self.drawn.append((tenant, _turns(self.work, talk, f"{self.seed}-{index}", index, system, draws)))
        return self.drawn[k]


def _length_stream(work: WorkloadSpec, seed: int) -> Iterator[tuple[int, int]]:
    while True:
        yield from _lengths(work, 4096, seed)
        seed += 1_000_003


def conversation_trace(work: WorkloadSpec, rate: float, duration: float, seed: int, clients: int) -> list[Arrival]:
    """Turns of sessions arriving at `rate` requests per second on average for `duration` seconds. Sessions start
    from before 0 (three mean session lengths), so that the run begins with sessions already under way, as a
    service does; their turns before 0 are not sent (the servers' caches start cold)."""
    talk = work.conversation
    assert talk is not None
    sessions = _Sessions(work, seed)
    mean_turns = sum(len(sessions[k][1]) for k in range(MEAN_TURNS_SESSIONS)) / MEAN_TURNS_SESSIONS
    session_rate = rate / mean_turns
    lead = 3.0 * talk.turns * talk.think_seconds
    starts = random.Random(f"trace-{seed}")
    meta = random.Random(f"meta-{seed}")
    requests: list[tuple[float, int, int, int, tuple[tuple[int, int], ...], str | None]] = []
    unit, session = 0.0, 0
    while True:
        unit += starts.expovariate(1.0)
        at = unit / session_rate - lead
        if at > duration:
            break
        tenant, turns = sessions[session]
        for gap, prompt, output, segments in turns:
            at += gap
            if 0.0 <= at <= duration:
                requests.append((at, session, prompt, output, segments, tenant))
        session += 1
    requests.sort(key=lambda r: (r[0], r[1]))
    return [
        Arrival(i, at, prompt, output, session, meta.randrange(clients), meta.random(), tenant, segments)
        for i, (at, session, prompt, output, segments, tenant) in enumerate(requests)
    ]


MOONCAKE_BLOCK = 512
"""Tokens per `hash_ids` entry in the Mooncake traces."""
ROOT = Path(__file__).resolve().parents[3]


@functools.lru_cache(maxsize=4)
def _mooncake_records(path: str) -> tuple[tuple[float, int, int, tuple[int, ...]], ...]:
    file = ROOT / path
    opener = lzma.open if file.suffix == ".xz" else open
    with opener(file, "rt") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    return tuple(
        (r["timestamp"] / 1000.0, int(r["input_length"]), int(r["output_length"]), tuple(r["hash_ids"])) for r in rows
    )


def mooncake_trace(work: WorkloadSpec, rate: float, duration: float, seed: int, clients: int) -> list[Arrival]:
    """A window of a Mooncake trace (`work.trace_file`) replayed at `rate` requests per second on average.

    Its timestamps are scaled by the trace's own mean rate over `rate` (so the reuse distances shrink with them);
    each seed replays its own window of the trace (start drawn from the seed), the same for every strategy and
    every load. A request's prompt is its `hash_ids` blocks, 512 tokens each (the last as long as the input
    leaves), as content its prefix cache can match; its output is its own. The trace has no session ids: a
    request's session is the earlier request's that first sent its first two blocks (the same first 1024 tokens:
    the same conversation or document), else a new one — an inference, for the strategies that hash sessions."""
    assert work.trace_file is not None
    records = _mooncake_records(work.trace_file)
    span = records[-1][0] - records[0][0]
    scale = (len(records) / span) / rate
    window = duration / scale
    start = random.Random(f"window-{seed}").uniform(0.0, max(0.0, span - window))
    meta = random.Random(f"meta-{seed}")
    sessions: dict[int, int] = {}
    out: list[Arrival] = []
    for at, prompt, output, hashes in records:
        if at < start:
            continue
        if (at - start) * scale > duration:
            break
        key = hashes[1] if len(hashes) > 1 else -1 - len(out)
        session = sessions.setdefault(key, len(sessions))
        blocks = [(h, MOONCAKE_BLOCK) for h in hashes[:-1]]
        blocks.append((hashes[-1], prompt - MOONCAKE_BLOCK * (len(hashes) - 1)))
        segments = (*blocks, (OWN_CONTENT + len(out), max(1, output)))
        index = len(out)
        out.append(
            Arrival(
                index,
                (at - start) * scale,
                prompt,
                max(1, output),
                session,
                meta.randrange(clients),
                meta.random(),
                None,
                segments,
            )
        )
    return out


def write_azure_csv(trace: list[Arrival], path: Path) -> None:
    """The AzurePublicDataset CSV (TIMESTAMP, ContextTokens, GeneratedTokens) inference-perf's trace replay reads."""
    epoch = datetime(2026, 1, 1, tzinfo=UTC)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for a in trace:
        stamp = (epoch + timedelta(seconds=a.at)).strftime("%Y-%m-%d %H:%M:%S.%f")
        lines.append(f"{stamp},{a.prompt},{a.output}")
    path.write_text("\n".join(lines) + "\n")
