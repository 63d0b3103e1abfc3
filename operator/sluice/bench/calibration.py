"""Checks that the simulated servers saturate where the physics says, for the report's calibration table.

Called by `sluice.bench.report`. For each (hardware, model) the engine is measured, not asked:
- prefill tokens/s: prompt-only requests (2048 tokens, 1 output token) kept queued; prompt tokens over busy time;
- decode step time: 32 sequences (fewer if the KV cache holds fewer) of ~2k-token context decoding together; the
  mean of the last 32 steps, long after the prompts were prefilled.
Each is compared with a first-principles estimate written here independently of fleet_sim's code:
- prefill ≈ utilisation × peak FLOP/s ÷ (2 × parameters), at `PREFILL_UTILISATION` (a typical achieved MFU for
  large prefill GEMMs; fleet_sim's roofline assumes peak, so its figure is expected above this estimate);
- a decode step ≈ (weight bytes + KV bytes read) ÷ peak memory bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sluice.sim.engine import Engine
from sluice.sim.profiles import HARDWARE, MODELS, server_profile

PREFILL_UTILISATION = 0.6
DECODE_BATCH = 32
CONTEXT = 2048


@dataclass(frozen=True)
class Calibration:
    hardware: str
    model: str
    prefill_tokens_per_s: float
    prefill_estimate: float
    decode_batch: int
    decode_step_ms: float
    decode_estimate_ms: float

    @property
    def prefill_ratio(self) -> float:
        return self.prefill_tokens_per_s / self.prefill_estimate

    @property
    def decode_ratio(self) -> float:
        return self.decode_step_ms / self.decode_estimate_ms


def _run(engine: Engine) -> list[float]:
    """Run to completion; the step durations, in order."""
    steps: list[float] = []
    last = 0.0
    while engine.next_event_time() < math.inf:
        at = engine.next_event_time()
        engine.advance_to(at)
        steps.append(at - last)
        last = at
    return steps


def calibrate(hardware: str, model: str) -> Calibration:
    spec, hw = MODELS[model], HARDWARE[hardware]
    params = spec.active_param_count()
    prefill = Engine(server_profile(hardware, model))
    for i in range(16):
        prefill.submit(i, 0.0, CONTEXT, 1)
    _run(prefill)
    prefill_rate = 16 * CONTEXT / prefill.busy_seconds
    decode = Engine(server_profile(hardware, model))
    batch = min(DECODE_BATCH, decode.total_blocks * decode.config.block_size // (CONTEXT + 80))
    for i in range(batch):
        decode.submit(i, 0.0, CONTEXT, 64)
    steps = _run(decode)
    decode_steps = steps[-32:]  # the last steps: every sequence is decoding, the prompts are long done
    kv_bytes = batch * CONTEXT * spec.kv_bytes_per_token_dtype(2.0)
    decode_estimate = (spec.param_bytes_per_gpu(1, 2.0) + kv_bytes) / hw.mem_bw
    return Calibration(
        hardware=hardware,
        model=model,
        prefill_tokens_per_s=prefill_rate,
        prefill_estimate=PREFILL_UTILISATION * hw.fp16_tc_flops / (2 * params),
        decode_batch=batch,
        decode_step_ms=1000 * sum(decode_steps) / len(decode_steps),
        decode_estimate_ms=1000 * decode_estimate,
    )


def table(rows: list[Calibration]) -> str:
    lines = [
        "| hardware | model | prefill tok/s (engine) | estimate | ratio | decode batch | decode step (engine) "
        "| estimate | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.hardware} | {r.model} | {r.prefill_tokens_per_s:,.0f} | {r.prefill_estimate:,.0f} "
            f"| {r.prefill_ratio:.2f} | {r.decode_batch} × 2k | {r.decode_step_ms:.1f} ms "
            f"| {r.decode_estimate_ms:.1f} ms "
            f"| {r.decode_ratio:.2f} |"
        )
    return "\n".join(lines)
