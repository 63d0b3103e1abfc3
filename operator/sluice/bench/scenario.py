"""Benchmark scenarios: the YAML format of `benchmarks/scenarios/*.yaml`, as pydantic models. Read by `sluice bench`.

```yaml
name: seed-000
description: ...
seed: 7                        # the first seed; `seeds` consecutive seeds are run
seeds: 5
model: llama-3.1-8b            # one model per pool (sluice.sim.profiles.MODELS)
servers:                       # one iteration-level engine each (sluice.sim.engine)
  - {name: a100-0, hardware: a100, revision: v1}
  - {name: cpu-0, hardware: cpu}
engine: {max_num_batched_tokens: 2048, max_num_seqs: 256, prefix_caching: false}
workload:
  arrival: poisson             # poisson | bursty (`burst_factor` x the quiet rate for `burst_seconds` every `period`)
  lengths: fixed               # fixed | lmsys | azure | agent_heavy (fleet_sim's length CDFs)
  prompt_tokens: 2048          # for `fixed`
  output_tokens: 128
  sessions: 200                # distinct session ids (consistent hashing keys on them)
  conversation:                # optional: requests that share prefixes (then sessions are conversations)
    turns: 5                   # mean turns per session; each turn's prompt is the conversation so far
    think_seconds: 20          # mean gap between turns
    system_prompts: 8          # shared system prompts (and their length)
    system_tokens: 1500
  duration: 300                # seconds of arrivals per run
  warm_up: 60                  # seconds of arrivals left out of the figures
loads: [0.2, 0.5, 0.8, 1.0]    # offered load as fractions of the fleet's measured capacity (a sweep)
slo: {ttft_p99_ms: 1000}       # goodput: the highest load whose P99 TTFT stays within it
dataplane:
  sidecars: 8                  # client Envoys, each with its own active counts and its own copy of the weights
  choice_count: 2              # LEAST_REQUEST with equal weights
  propagation_delay: 1         # control plane -> every sidecar
  retries: 0                   # retries of a 5xx on another host (retryOn 5xx); 0: Istio's default route
  outlier_detection: true      # consecutive-5xx ejection in every sidecar (the pool's DestinationRule)
sluice:                        # the real sluice core in the loop
  interval: 5                  # seconds between passes
  scrape_interval: 15          # Prometheus scrape
  window: 60                   # rate/quantile window
  pool: {}                     # InferencePool spec overrides (camelCase), merged over the benchmark's default
events:                        # things that happen during the run
  - {at: 120, server: a100-0, slowdown: 4.0}
  - {at: 0, server: v2-0, error_rate: 0.3}
strategies: [round-robin, least-request, sluice]   # default: all
held_out: true                 # not used to choose sluice's parameters (stated in the report)
```
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

Hardware = Literal["h100", "a100", "l40s", "a10g", "rtx4090", "cpu"]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ServerSpec(_Model):
    name: str
    hardware: Hardware
    revision: str = "v1"
    error_rate: float = Field(default=0.0, ge=0, le=1)
    inbound_max_requests: int | None = Field(default=None, gt=0)
    """This pod's sidecar's inbound limit, in place of the data plane's (`DataPlaneSpec.inbound_max_requests`)."""


class EngineSpec(_Model):
    max_num_batched_tokens: int = Field(default=2048, gt=0)
    max_num_seqs: int = Field(default=256, gt=0)
    prefix_caching: bool = False
    """vLLM's automatic prefix caching (`sluice.sim.engine`); set it where requests share prefixes."""


class ConversationSpec(_Model):
    """Requests that share tokens: sessions of several turns (each turn's prompt is the conversation so far) and
    system prompts shared across sessions. A turn's new user tokens and its answer are one draw of `lengths` (its
    prompt and output); a session ends after its turns, or when its next prompt would pass `max_prompt_tokens`."""

    turns: float = Field(default=1.0, ge=1)
    """Mean turns per session (geometric: a session goes on after each turn with probability 1 - 1/turns)."""
    think_seconds: float = Field(default=0.0, ge=0)
    """Mean gap between one turn's arrival and the next's (exponential; not scaled by the load)."""
    system_prompts: int = Field(default=0, ge=0)
    """Distinct system prompts, one per session, shared across sessions; 0: none."""
    system_tokens: int = Field(default=0, ge=0)
    popularity: float = Field(default=0.0, ge=0)
    """Zipf exponent of the system prompt a session takes (0: uniform)."""


class WorkloadSpec(_Model):
    arrival: Literal["poisson", "bursty"] = "poisson"
    lengths: Literal["fixed", "lmsys", "azure", "agent_heavy"] = "fixed"
    prompt_tokens: int = 2048
    output_tokens: int = 128
    max_prompt_tokens: int = 8192
    max_output_tokens: int = 2048
    sessions: int = Field(default=200, gt=0)
    burst_factor: float = 4.0
    burst_seconds: float = 10.0
    period: float = 60.0
    duration: float = Field(default=300.0, gt=0)
    warm_up: float = Field(default=60.0, ge=0)
    trace_file: str | None = None
    """A Mooncake-format trace (JSON lines: timestamp ms, input_length, output_length, hash_ids of 512-token
    blocks; `.xz` read as is), relative to the repository: its requests replayed (`sluice.bench.trace`)."""
    conversation: ConversationSpec | None = None
    """Requests that share prefixes (`sluice.bench.trace`): sessions are conversations, each carried in the
    session header. None: every request's tokens are its own, and `sessions` ids are drawn at random."""
    tenants: dict[str, float] = Field(default_factory=dict)
    """Tenant -> its share of the arrivals (relative weights), sent in the pool's `admission.tenants.header`: a
    noisy tenant is one whose share of a load exceeds its percent in the pool. Empty: no tenant header."""

    @model_validator(mode="after")
    def _one_source(self) -> WorkloadSpec:
        if self.trace_file is not None and self.conversation is not None:
            raise ValueError("workload: set trace_file or conversation, not both")
        return self


class SloSpec(_Model):
    ttft_p99_ms: float = Field(default=1000.0, gt=0)


class DataPlaneSpec(_Model):
    sidecars: int = Field(default=8, gt=0)
    choice_count: int = Field(default=2, gt=0)
    propagation_delay: float = Field(default=1.0, ge=0)
    load_poll_interval: float = Field(default=1.0, gt=0)
    """How often the modelled vLLM router's power_of_two polls `/get_load`."""
    retries: int = Field(default=0, ge=0, le=10)
    """Retries of a 5xx by the client's sidecar (a route's `retries: {attempts: N, retryOn: 5xx}`), each after
    Envoy's jittered back-off (25 ms base) on a host not tried before where Envoy picks the host
    (`retryIgnorePreviousHosts`, 5 host selections), through the router where one does. 0: none, as Istio's
    default route, whose retryOn never matches an HTTP 500."""
    inbound_max_requests: int | None = Field(default=None, gt=0)
    """Requests each pod's sidecar lets through to its engine at once (Istio's `Sidecar.inboundConnectionPool`, a
    circuit breaker on the inbound cluster); past it the sidecar answers 503 with `x-envoy-overloaded` at once,
    which the caller's Envoy counts as a 5xx and may retry on another pod (`refusal_retries`). None: no limit."""
    reported_limits: bool = False
    """The sidecars enforce the inbound limits sluice reports (`admission.mode: Report` in the pool, status
    `inboundLimit`) as an inbound limit would, from the pass that reports them: what enforcing them would do."""
    refusal_retries: int = Field(default=2, ge=0, le=10)
    """Retries of a refused request on another pod: Istio's default route policy retries a 503 twice on hosts not
    tried before (istio/istio `pilot/pkg/networking/core/route/retry/retry.go`, `DefaultPolicy`), and so does
    `routing.retries` under gateway-error (`tests/test_envoy_refusals.py`: real Envoy does). Counted apart from
    `retries` (a route has one `num_retries`: a scenario setting both models two routes' policies at once)."""
    outlier_detection: bool = True
    """Every client sidecar ejects hosts on consecutive 5xx as the pool's DestinationRule says
    (`protection.outlierDetection` of the benchmark's pool), for every strategy where Envoy picks the host."""


class SluiceSpec(_Model):
    interval: float = 5.0
    scrape_interval: float = 15.0
    window: float = 60.0
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
    seeds: int = Field(default=5, gt=0)
    model: str = "llama-3.1-8b"
    servers: list[ServerSpec]
    engine: EngineSpec = Field(default_factory=EngineSpec)
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec)
    loads: list[float] = Field(default_factory=lambda: [0.7], min_length=1)
    slo: SloSpec = Field(default_factory=SloSpec)
    dataplane: DataPlaneSpec = Field(default_factory=DataPlaneSpec)
    sluice: SluiceSpec = Field(default_factory=SluiceSpec)
    events: list[EventSpec] = Field(default_factory=list)
    strategies: list[str] | None = None
    """Which strategies to run (default: all)."""
    held_out: bool = False
    """Not used to choose the routing policy's parameters (the report says which scenarios were)."""
    same_traces_as: str | None = None
    """A variant of that scenario on the same seeds, servers and workload (e.g. only the control loop differs):
    it shares its traces, so it is never held out."""

    @model_validator(mode="after")
    def _variant_not_held_out(self) -> Scenario:
        if self.same_traces_as is not None and self.held_out:
            raise ValueError(
                f"same_traces_as: {self.name} shares {self.same_traces_as}'s traces, so it is not held out"
            )
        return self


def load(path: str | Path) -> Scenario:
    return Scenario.model_validate(yaml.safe_load(Path(path).read_text()))
