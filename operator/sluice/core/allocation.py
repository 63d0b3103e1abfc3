"""Allocation: verdicts become endpoint weights, one revision subset at a time, then the floor. Pure.

Endpoint weights are relative inside a subset (each DestinationRule subset is its own Envoy cluster), so scaling,
hysteresis, the recovery ramp and the `minRoutablePercent` floor all work per subset. A pod the floor keeps is
marked `floor_held` — a typed fact the status, the Events and the revision split read, never prose.
Called by `sluice.core.reconcile`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sluice.api.v1alpha1 import EndpointState, ProtectionSpec, ScoringSpec
from sluice.core.absorb import Hold
from sluice.core.headroom import PodHeadroom
from sluice.core.policies import POLICIES, Subset
from sluice.core.protection import floor_keep, spare_order
from sluice.core.verdicts import PodVerdict
from sluice.core.weights import ramp, with_hysteresis


@dataclass(frozen=True)
class Allocation:
    weight: int
    state: EndpointState
    scored_weight: int | None = None
    """The weight scoring asked for, before hysteresis or the ramp (None when not scored)."""
    floor_held: bool = False
    headroom: PodHeadroom | None = None
    """scoring.policy headroom: the learned capacity and planned share behind the weight."""
    hold: Hold | None = None
    """A pod zeroed or ramping after an incident that leaves it serving: what weighing its zeroing against the
    others' room concluded (`sluice.core.absorb`); held when its share is > 0 beyond its ramp."""

    @property
    def routable(self) -> bool:
        return self.weight > 0

    @property
    def capacity_held(self) -> bool:
        """Kept routable (or above its ramp) only because the other pods cannot take its share."""
        return self.hold is not None and self.hold.held and self.weight > 0

    @property
    def healthy(self) -> bool:
        """Routable on its own merits, not only because the floor or the others' load keeps it."""
        return self.weight > 0 and not self.floor_held and not self.capacity_held


def allocate(
    scoring: ScoringSpec,
    protection: ProtectionSpec,
    verdicts: Iterable[PodVerdict],
    active_request_bias: float = 1.0,
    window: float = 60.0,
    hashing: bool = False,
) -> dict[str, Allocation]:
    """Each pod's weight, per revision subset. `hashing`: the pool routes by consistent hash
    (`routing.sessionAffinity`), so pods of a hardware class are weighed alike (`sluice.core.policies`)."""
    subsets: dict[str | None, list[PodVerdict]] = {}
    for verdict in verdicts:
        subsets.setdefault(verdict.revision, []).append(verdict)
    out: dict[str, Allocation] = {}
    for members in subsets.values():
        out.update(_allocate_subset(scoring, protection, members, active_request_bias, window, hashing))
    return out


def _allocate_subset(
    scoring: ScoringSpec,
    protection: ProtectionSpec,
    members: list[PodVerdict],
    active_request_bias: float,
    window: float,
    hashing: bool = False,
) -> dict[str, Allocation]:
    live = [v for v in members if v.kind in ("scored", "ramping", "frozen")]
    subset = Subset(scoring, protection, members, live, active_request_bias, window, hashing)
    asked = POLICIES[scoring.policy](subset)
    out = {
        v.name: _weigh(
            scoring,
            v,
            asked.weights.get(v.name),
            asked.headroom.get(v.name),
            v.name in asked.regroup,
            asked.holds.get(v.name),
        )
        for v in members
    }
    return _apply_floor(scoring, protection.min_routable_percent, members, out)


def _weigh(
    scoring: ScoringSpec,
    verdict: PodVerdict,
    target: int | None,
    headroom: PodHeadroom | None,
    regroup: bool = False,
    hold: Hold | None = None,
) -> Allocation:
    previous = verdict.previous
    if hold is not None and hold.frozen and previous is not None:
        return Allocation(previous.weight, previous.state, hold=hold)
    if hold is not None and hold.held and target is not None:
        state: EndpointState = "Recovering" if verdict.kind == "ramping" else "Routable"
        return Allocation(max(scoring.min_weight, target), state, target, headroom=headroom, hold=hold)
    if verdict.kind == "quiet" and hold is not None:
        return Allocation(0, "Zeroed", hold=hold)
    if verdict.kind == "frozen" and previous is not None:
        held = min(scoring.max_weight, max(scoring.min_weight, previous.weight))
        return Allocation(held, "Recovering" if previous.state == "Recovering" else "Routable", headroom=headroom)
    if target is None:
        return Allocation(0, "Zeroed")
    if verdict.kind == "ramping" and verdict.ramp_percent is not None:
        return Allocation(ramp(target, verdict.ramp_percent, scoring), "Recovering", target, headroom=headroom)
    was_routable = previous is not None and previous.state == "Routable" and not regroup
    weight = with_hysteresis(target, previous.weight if was_routable and previous else None, scoring.hysteresis_percent)
    return Allocation(weight, "Routable", target, headroom=headroom)


def _apply_floor(
    scoring: ScoringSpec, min_routable_percent: int, members: list[PodVerdict], out: dict[str, Allocation]
) -> dict[str, Allocation]:
    eligible = [v for v in members if v.eligible]
    short = floor_keep(len(eligible), min_routable_percent) - sum(1 for v in eligible if out[v.name].routable)
    if short <= 0:
        return out
    # A pod the floor already keeps stays kept (no churn without new facts); then pods without evidence of
    # harm; then the mildest, oldest incident.
    spare = sorted(
        (v for v in eligible if not out[v.name].routable),
        key=lambda v: (
            not (v.previous is not None and v.previous.floor_held),
            v.kind != "awaiting",
            *spare_order(v.memory.incident, v.signals.error_rate, v.memory.last_incident_at),
        ),
    )
    for verdict in spare[:short]:
        out[verdict.name] = Allocation(scoring.min_weight, "Routable", floor_held=True)
    return out
