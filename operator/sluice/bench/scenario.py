"""Benchmark scenarios: the YAML format of `benchmarks/scenarios/*.yaml`, as pydantic models.

```yaml
name: seed-000
description: ...
seed: 7
servers:                       # one fleet_sim Instance each
  - {name: a100-0, hardware: a100, revision: v1}
  - {name: cpu-0, hardware: cpu, revision: v1}
workload:
  arrival: poisson             # poisson | bursty (on/off: `burst_factor` x rate for `burst_seconds` every `period`)
  rate: 8.0                    # requests per second (mean)
  requests: 2000
  lengths: fixed               # fixed | lmsys | azure | agent_heavy (fleet_sim's CDFs)
  prompt_tokens: 2048          # for `fixed`
  output_tokens: 128
  warm_up: 0.1                 # share of the first requests left out of the figures
sluice:                        # the real sluice core in the loop
  interval: 5                  # seconds between passes
  scrape_interval: 1           # Prometheus scrape
  window: 10                   # rate/quantile window
  propagation_delay: 1         # control plane -> Envoy
  pool: {}                     # InferencePool spec overrides (camelCase), merged over the default below
events:                        # things that happen during the run
  - {at: 60, server: a100-0, slowdown: 4.0}
  - {at: 30, server: v2-0, error_rate: 0.3}
```
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ServerSpec(_Model):
    name: str
    hardware: Literal["a100", "h100", "a10g", "rtx4090", "cpu"]
    revision: str = "v1"
    error_rate: float = Field(default=0.0, ge=0, le=1)


class WorkloadSpec(_Model):
    arrival: Literal["poisson", "bursty"] = "poisson"
    rate: float = Field(gt=0)
    requests: int = Field(gt=0)
    lengths: Literal["fixed", "lmsys", "azure", "agent_heavy"] = "fixed"
    prompt_tokens: int = 2048
    output_tokens: int = 128
    burst_factor: float = 4.0
    burst_seconds: float = 5.0
    period: float = 30.0
    warm_up: float = Field(default=0.1, ge=0, lt=1)


class SluiceSpec(_Model):
    interval: float = 5.0
    scrape_interval: float = 1.0
    window: float = 10.0
    propagation_delay: float = 1.0
    pool: dict[str, Any] = Field(default_factory=dict)


class EventSpec(_Model):
    at: float
    server: str
    slowdown: float | None = None
    error_rate: float | None = None


class Scenario(_Model):
    name: str
    description: str = ""
    seed: int = 7
    servers: list[ServerSpec]
    workload: WorkloadSpec
    sluice: SluiceSpec = Field(default_factory=SluiceSpec)
    events: list[EventSpec] = Field(default_factory=list)
    strategies: list[str] | None = None
    """Which strategies to run (default: all)."""


def load(path: str | Path) -> Scenario:
    return Scenario.model_validate(yaml.safe_load(Path(path).read_text()))
