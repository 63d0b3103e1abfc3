"""Hardware × model performance profiles of the simulated servers, from vllm-sr-sim's roofline (`ComputedProfile`).

Used by the benchmark's iteration-level engine (`sluice.sim.engine`) and by the local stack's simulated model
server, so both model the same hardware. A profile is fleet_sim's `ProfileBuilder` over a `HardwareSpec` and a
`ModelSpec`: decode steps cost (weights + KV bytes read) / effective bandwidth, prefill chunks cost
max(memory time, FLOPs / peak tensor FLOP/s). Nothing here is fitted to a latency we want to see.

fleet_sim's catalogue has A100, H100, H200, L40S, B60, B200, GB200. The classes it lacks get a spec from datasheet
figures, cited beside each number. One model per pool: heterogeneity is hardware, never a different model.
"""

from __future__ import annotations

import dataclasses

from fleet_sim.gpu_profiles import ComputedProfile, ProfileBuilder, ServingConfig
from fleet_sim.hardware.catalog import A100_SXM, H100_SXM, L40S
from fleet_sim.hardware.spec import HardwareSpec
from fleet_sim.models.catalog import LLAMA_3_1_8B, MISTRAL_7B, QWEN3_8B
from fleet_sim.models.spec import ModelSpec

GIB = 1024**3

# NVIDIA GeForce RTX 4090 (AD102), "NVIDIA Ada GPU Architecture" whitepaper v2.1, appendix table 2:
# 1008 GB/s GDDR6X, 24 GB; FP16 tensor TFLOPS with FP32 accumulate 165.2 dense (330.4 with sparsity; FP16
# accumulate doubles both; vLLM's kernels accumulate in FP32); FP8 330.3 dense. TDP 450 W. PCIe 4.0 x16, no NVLink.
RTX_4090 = HardwareSpec(
    name="RTX-4090",
    mem_bw=1_008_000_000_000,
    mem_capacity=24 * GIB,
    fp16_tc_flops=165_200_000_000_000,
    fp8_tc_flops=330_300_000_000_000,
    nvlink_bw=0,
    inter_node_bw=12_500_000_000,
    pcie_bw=32_000_000_000,
    sm_version=89,
    power=450.0,
    cost_per_hr=0.70,
)

# NVIDIA A10G (AWS g5), NVIDIA A10 datasheet: 600 GB/s GDDR6, 24 GB, FP16 tensor 125 TFLOPS dense (250 sparse).
A10G = HardwareSpec(
    name="A10G",
    mem_bw=600_000_000_000,
    mem_capacity=24 * GIB,
    fp16_tc_flops=125_000_000_000_000,
    fp8_tc_flops=0,
    nvlink_bw=0,
    inter_node_bw=12_500_000_000,
    pcie_bw=32_000_000_000,
    sm_version=86,
    power=150.0,
    cost_per_hr=1.01,
)

# One socket of an Intel Xeon Platinum 8480+ (Sapphire Rapids) serving with vLLM's CPU backend (bf16, AMX).
# Intel ARK: 56 cores, 2.0 GHz base, 8 channels DDR5-4800 -> 8 x 4800 MT/s x 8 B = 307.2 GB/s.
# AMX BF16: 1024 FLOP per cycle per core (Intel Architecture Instruction Set Extensions Reference, AMX TMUL
# 16x32 BF16 tile FMA) -> 56 x 2.0e9 x 1024 = 114.7 TFLOP/s peak. This is the roofline's peak; the sustained
# AMX utilisation of real GEMM kernels is lower, which the calibration table states instead of hiding.
# KV cache: vLLM's CPU backend reserves VLLM_CPU_KVCACHE_SPACE, 4 GiB by default (vLLM CPU installation docs).
XEON_8480 = HardwareSpec(
    name="Xeon-8480+",
    mem_bw=307_200_000_000,
    mem_capacity=256 * GIB,
    fp16_tc_flops=114_700_000_000_000,
    fp8_tc_flops=0,
    nvlink_bw=0,
    inter_node_bw=12_500_000_000,
    pcie_bw=32_000_000_000,
    sm_version=0,
    power=350.0,
    cost_per_hr=0.40,
    other_mem=0,
)
CPU_KV_CACHE_BYTES = 4 * GIB

HARDWARE: dict[str, HardwareSpec] = {
    "h100": H100_SXM,
    "a100": A100_SXM,
    "l40s": L40S,
    "a10g": A10G,
    "rtx4090": RTX_4090,
    "cpu": XEON_8480,
}
MODELS: dict[str, ModelSpec] = {"llama-3.1-8b": LLAMA_3_1_8B, "qwen3-8b": QWEN3_8B, "mistral-7b": MISTRAL_7B}
DEFAULT_MODEL = "llama-3.1-8b"


def server_profile(hardware: str, model: str = DEFAULT_MODEL) -> ComputedProfile:
    """fleet_sim's roofline profile of one server: `model` in fp16/bf16 on one `hardware` device (TP=1)."""
    spec = MODELS[model]
    profile = ProfileBuilder().build(HARDWARE[hardware], spec, ServingConfig(tp=1, dtype_bytes=2.0))
    if hardware == "cpu":
        # The CPU backend's KV space is a fixed reservation, not "what is left of device memory".
        blocks = CPU_KV_CACHE_BYTES // (spec.kv_bytes_per_token_dtype(2.0) * profile.cfg.blk_size)
        profile = dataclasses.replace(profile, total_kv_blks=int(blocks))
    return profile


__all__ = ["DEFAULT_MODEL", "HARDWARE", "MODELS", "ComputedProfile", "server_profile"]
