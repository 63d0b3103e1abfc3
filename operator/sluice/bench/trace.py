"""The arrival trace of a benchmark run: one list of requests replayed identically for every strategy.

Called by `sluice.bench.sim` and `sluice.bench.report`. Common random numbers: the trace depends only on the
scenario's workload and the seed, never on the strategy. Poisson arrival times are drawn once at unit rate and
scaled by `1 / rate`, so the points of a load sweep are the same requests arriving faster, not new draws. Each request
carries its prompt and output lengths, a session id (for consistent hashing) and the client sidecar it comes from.

`write_azure_csv` writes the trace in the AzurePublicDataset format (TIMESTAMP, ContextTokens, GeneratedTokens)
that kubernetes-sigs' inference-perf replays (`load.type: trace_replay`, `load.trace.format: AzurePublicDataset`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import fleet_sim
from fleet_sim.workload.synthetic import CdfWorkload

from sluice.bench.scenario import WorkloadSpec

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


def write_azure_csv(trace: list[Arrival], path: Path) -> None:
    """The AzurePublicDataset CSV (TIMESTAMP, ContextTokens, GeneratedTokens) inference-perf's trace replay reads."""
    epoch = datetime(2026, 1, 1, tzinfo=UTC)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for a in trace:
        stamp = (epoch + timedelta(seconds=a.at)).strftime("%Y-%m-%d %H:%M:%S.%f")
        lines.append(f"{stamp},{a.prompt},{a.output}")
    path.write_text("\n".join(lines) + "\n")
