"""The API emulator's fault plan: rules declared once as frozen pydantic models, loaded from YAML or JSON.

Read by `apifaults` (which decides, per request, what each rule does) and by `apiserver` (`--faults FILE`, and
`PUT /_faults` at run time). A rule names the requests it matches, when it fires (a probability or every Nth
matched request, in bursts, at most `limit` times, inside a time window counted from the plan's installation) and
the fault it serves: added latency, a 429 from API Priority and Fairness, a 500/503 burst, a watch closed early or
a watch resumed from a resourceVersion answered as expired. `load_plan` refuses a bad plan with every wrong field
named (`rules[0].effect.p99: ...`).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

Verb = Literal["get", "list", "watch", "create", "update", "patch", "delete"]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True)


class RequestMatch(_Model):
    """Which requests a rule matches; an empty list matches any value, several values any of them."""

    verbs: tuple[Verb, ...] = Field(default=(), description="Kubernetes verbs: get, list, watch, create, ...")
    resources: tuple[str, ...] = Field(default=(), description="resource plurals, e.g. leases, inferencepools")
    groups: tuple[str, ...] = Field(default=(), description='API groups; "" is the core group')
    namespaces: tuple[str, ...] = Field(default=(), description="namespaces of namespaced requests")
    users: tuple[str, ...] = Field(default=(), description="user names as authenticated (after impersonation)")
    user_agents: tuple[str, ...] = Field(default=(), description="User-Agent prefixes, e.g. sluice-operator/")


class Latency(_Model):
    """Added delay before the answer: `seconds` fixed, or drawn from a log-normal with the given p50 and p99."""

    type: Literal["latency"]
    seconds: float | None = Field(default=None, ge=0)
    p50: float | None = Field(default=None, gt=0)
    p99: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_form(self) -> Latency:
        if self.seconds is None and (self.p50 is None or self.p99 is None):
            raise ValueError("give seconds, or both p50 and p99")
        if self.seconds is not None and (self.p50 is not None or self.p99 is not None):
            raise ValueError("give seconds or p50/p99, not both")
        if self.p50 is not None and self.p99 is not None and self.p99 < self.p50:
            raise ValueError(f"p99 ({self.p99}) must not be below p50 ({self.p50})")
        return self


class Throttle(_Model):
    """A 429 as kube-apiserver sends it (see `apifaults.throttle_answer` for the sources of each shape)."""

    type: Literal["throttle"]
    shape: Literal["priorityAndFairness", "storageInitializing"] = Field(
        default="priorityAndFairness",
        description="priorityAndFairness: the APF filter's plain-text 429; storageInitializing: the watch "
        "cache's TooManyRequests Status",
    )
    # APF's DroppedRequestsTracker keeps its suggestion between 1 and maxRetryAfter = 32 seconds.
    retry_after_seconds: int = Field(default=1, ge=1, le=32)
    flow_schema_uid: str = Field(default="2b2a4c5e-0f9d-4a41-9a57-6e3a3f3c0a01", min_length=1)
    priority_level_uid: str = Field(default="7d0c1b54-93c8-4a8e-8f36-1c5e0a9b2b02", min_length=1)


class ServerError(_Model):
    """A 500 (InternalError) or 503 (ServiceUnavailable) Status, as kube-apiserver's handlers send them."""

    type: Literal["error"]
    code: Literal[500, 503]
    message: str | None = Field(
        default=None,
        description="500: the cause inside 'Internal error occurred: ...'; 503: the message "
        "(default: kube-apiserver's 'apiserver is shutting down')",
    )
    retry_after_seconds: int | None = Field(
        default=None, ge=0, description="Retry-After header; default 1 for a 503 (as when shutting down), 0: none"
    )


class CloseWatch(_Model):
    """A watch stream ended by the server after `afterEvents` events or `afterSeconds`, whichever comes first."""

    type: Literal["closeWatch"]
    after_events: int | None = Field(default=None, ge=0)
    after_seconds: float | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _a_limit(self) -> CloseWatch:
        if self.after_events is None and self.after_seconds is None:
            raise ValueError("give afterEvents, afterSeconds or both")
        return self


class ExpireWatch(_Model):
    """A watch from a resourceVersion answered with an ERROR event carrying the 410 Expired Status."""

    type: Literal["expireWatch"]


Effect = Annotated[Latency | Throttle | ServerError | CloseWatch | ExpireWatch, Field(discriminator="type")]
WATCH_EFFECTS = ("closeWatch", "expireWatch")


class FaultRule(_Model):
    """One rule: the requests it matches, when it fires, and what it serves."""

    name: str = Field(min_length=1)
    match: RequestMatch = RequestMatch()
    probability: float = Field(default=1.0, gt=0, le=1, description="chance that a matched request fires it")
    every: int | None = Field(default=None, ge=1, description="fire on every Nth matched request instead")
    burst: int = Field(default=1, ge=1, description="once fired, this many consecutive matched requests get it")
    limit: int | None = Field(default=None, ge=1, description="serve the fault at most this many times")
    after: float = Field(default=0.0, ge=0, description="seconds after the plan is installed the rule starts")
    until: float | None = Field(default=None, gt=0, description="seconds after the plan is installed it stops")
    effect: Effect

    @model_validator(mode="after")
    def _consistent(self) -> FaultRule:
        if self.every is not None and self.probability < 1:
            raise ValueError("give probability or every, not both")
        if self.until is not None and self.until <= self.after:
            raise ValueError(f"until ({self.until}) must be after after ({self.after})")
        if self.effect.type in WATCH_EFFECTS and self.match.verbs and "watch" not in self.match.verbs:
            raise ValueError(f"a {self.effect.type} effect needs the watch verb in match.verbs")
        return self


class FaultPlan(_Model):
    """The whole plan; `seed` seeds the random draws so that a run is reproducible."""

    seed: int = 0
    rules: tuple[FaultRule, ...] = ()

    @model_validator(mode="after")
    def _unique_names(self) -> FaultPlan:
        names = [rule.name for rule in self.rules]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"rule names must be unique: {', '.join(twice)}")
        return self


class PlanError(ValueError):
    """A fault plan that cannot be used; the message names every wrong field."""


def _where(location: tuple[int | str, ...]) -> str:
    out = ""
    for part in location:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in ("latency", "throttle", "error", "closeWatch", "expireWatch"):  # the union's tag
            out += f".{part}" if out else part
    return out or "plan"


def load_plan(text: str, source: str = "fault plan") -> FaultPlan:
    """Parse a plan from YAML or JSON (JSON is YAML); `PlanError` names the source and every wrong field."""
    try:
        document = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as failure:
        raise PlanError(f"{source}: not YAML or JSON: {failure}") from None
    if not isinstance(document, dict):
        raise PlanError(f"{source}: must be a mapping with seed and rules, got {type(document).__name__}")
    try:
        return FaultPlan.model_validate(document)
    except ValidationError as failure:
        problems = [
            f"{_where(tuple(error['loc']))}: {error['msg'].removeprefix('Value error, ')}" for error in failure.errors()
        ]
        raise PlanError(f"{source}: " + "; ".join(problems)) from None


def plan_document(plan: FaultPlan) -> str:
    """The plan as JSON, with the wire's camelCase names and without unset optional fields."""
    return json.dumps(plan.model_dump(mode="json", by_alias=True, exclude_none=True))
