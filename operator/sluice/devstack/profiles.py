"""Hardware profiles of the simulated servers: fleet_sim's calibrated GPUs, plus the classes it does not ship.

Used by the simulated model server and by the routing benchmark, so both model the same hardware.
"""

from __future__ import annotations

from fleet_sim.gpu_profiles.manual import ManualProfile
from fleet_sim.gpu_profiles.profiles import A10G, A100_80GB, H100_80GB

# Consumer-GPU and CPU classes fleet_sim does not ship, calibrated so that a 2048-token prompt has seed 000's idle
# TTFT (A100 ~35 ms from fleet_sim's own profile; RTX 4090 ~80 ms; a Xeon CPU node ~300 ms).
RTX4090_CLASS = ManualProfile(
    name="RTX4090-24GB", W=0.0098, H=0.0008, chunk=256, blk_size=16, total_kv_blks=12000, max_slots=32, cost_per_hr=0.7
)
CPU_CLASS = ManualProfile(
    name="Xeon-CPU", W=0.0185, H=0.004, chunk=128, blk_size=16, total_kv_blks=2048, max_slots=4, cost_per_hr=0.4
)
PROFILES: dict[str, ManualProfile] = {
    "a100": A100_80GB,
    "h100": H100_80GB,
    "a10g": A10G,
    "rtx4090": RTX4090_CLASS,
    "cpu": CPU_CLASS,
}


__all__ = ["CPU_CLASS", "PROFILES", "RTX4090_CLASS", "ManualProfile"]
