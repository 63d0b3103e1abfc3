"""`spec.canary`: a candidate revision rolled out in staged steps, after a shadow phase or as an A/B test, gated
by analysis checks; header routes for testers (Istio StringMatch, checked with RE2 as Envoy compiles it).
"""

from __future__ import annotations

import itertools
import re
from typing import ClassVar, Literal

import re2  # type: ignore[import-untyped]
from pydantic import Field, field_validator

from sluice.api.base import LABEL_KEY, LABEL_VALUE, LABEL_VALUE_MAX_LENGTH, ApiModel
from sluice.api.durations import Duration
from sluice.api.rules import Rule, cel_string, positive_duration

Gate = Literal["errorRate", "ttftP95", "ttftRatioToStable"]
"""A canary analysis gate: error rate, absolute TTFT p95, TTFT p95 relative to the stable revision."""


class AnalysisSpec(ApiModel):
    rules: ClassVar[tuple[Rule, ...]] = (positive_duration("interval"),)

    interval: Duration = Field(default=30.0, description="Time between two canary checks.")
    max_ttft_p95: Duration | None = Field(default=1.0, description="Candidate TTFT p95 above this fails a check.")
    max_error_rate: float = Field(default=0.01, ge=0, le=1, description="Candidate error rate above this fails.")
    max_ttft_ratio_to_stable: float | None = Field(
        default=1.5, ge=1, description="Candidate TTFT p95 above this multiple of the stable one fails."
    )
    min_requests: int = Field(
        default=20, ge=0, description="Candidate requests in the window below which a check is Inconclusive."
    )
    disabled_gates: list[Gate] = Field(
        default_factory=list,
        max_length=3,
        description="Gates switched off explicitly. A gate that is on and has no data makes the check "
        "Inconclusive (never Pass), so an engine without a TTFT histogram needs ttftP95 and ttftRatioToStable here.",
    )


class ShadowSpec(ApiModel):
    """A phase before the first live step: the candidate gets a mirrored copy of the stable revision's requests.

    Envoy sends the copy fire-and-forget and discards the candidate's answers, so no user is served by it; the
    candidate is judged on its own signals under that load. Costs (docs/guide.md, "Shadow canaries"): mirrored
    requests use candidate capacity, non-idempotent requests run twice, a streamed answer is generated in full.
    """

    rules: ClassVar[tuple[Rule, ...]] = (positive_duration("duration"),)

    mirror_percent: float = Field(
        default=100.0,
        ge=0.0001,
        le=100,
        description="Share of the stable revision's requests copied to the candidate (VirtualService "
        "mirrors[].percentage; request_mirror_policies in EnvoyFilter mode). At least 0.0001 (one in a million, "
        "the EnvoyFilter form's resolution: a smaller share would render as no mirror).",
    )
    duration: Duration = Field(
        default=120.0,
        description="Minimum time in shadow; the shadow passes after it, on a passing check, to the first live step.",
    )
    analysis: AnalysisSpec = Field(
        default_factory=AnalysisSpec,
        description="The shadow's own gates (same kinds as canary.analysis), judged on the candidate under the "
        "mirrored load; ttftRatioToStable compares it with the stable revision under live load.",
    )


_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False


def re2_error(pattern: str) -> str | None:
    """Why RE2 (Envoy's safe_regex engine) refuses `pattern`, or None. The program-size cap Envoy also applies is
    not computed here: Istio's bootstrap raises it to 32768 (istio pkg/bootstrap/config.go), and RE2 builds
    measure programs differently (a Unicode class costs far more in this binding than in Envoy's), so a size
    computed here would refuse what the mesh's proxies accept."""
    try:
        re2.compile(pattern, _RE2_OPTIONS)
    except re2.error as failure:
        reason = failure.args[0] if failure.args else failure
        return reason.decode() if isinstance(reason, bytes) else str(reason)
    return None


def _one_condition(match: StringMatch) -> bool:
    return sum(value is not None for value in (match.exact, match.prefix, match.regex)) == 1


class StringMatch(ApiModel):
    """One header condition, as Istio's StringMatch: exactly one of exact, prefix or regex."""

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="(has(self.exact) ? 1 : 0) + (has(self.prefix) ? 1 : 0) + (has(self.regex) ? 1 : 0) == 1",
            message="set exactly one of exact, prefix or regex",
            check=_one_condition,
            field_path=".exact",
        ),
    )

    exact: str | None = Field(default=None, max_length=1024, description="The header's whole value.")
    prefix: str | None = Field(default=None, min_length=1, max_length=1024, description="A prefix of the value.")
    regex: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="An RE2 expression the whole value must match (Envoy's safe_regex; no look-around, no "
        "back-references). Checked with RE2 by the operator and `sluice plan`, which the API server cannot do.",
    )

    @field_validator("regex")
    @classmethod
    def _compiles_as_re2(cls, pattern: str | None) -> str | None:
        if pattern is not None and (reason := re2_error(pattern)) is not None:
            raise ValueError(f"not an RE2 expression Envoy compiles: {reason}")
        return pattern


HEADER_NAME = r"^[a-z0-9!#$%&'*+.^_`|~-]{1,256}$"
"""A request header, lower case (Istio refuses upper-case header matches; HTTP/2 sends them lower case)."""


class CanaryRoute(ApiModel):
    """Requests whose headers all match (`cookie` matches the Cookie header: a regex finds one cookie in it)."""

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel=f"self.all(k, k.matches({cel_string(HEADER_NAME)}))",
            message="header names are HTTP tokens in lower case (Istio refuses upper-case header matches)",
            check=lambda headers: all(re.fullmatch(HEADER_NAME, name) for name in headers),
            on="headers",
        ),
    )

    headers: dict[str, StringMatch] = Field(
        min_length=1, max_length=16, description="Header name -> condition; every one must hold."
    )


COOKIE_NAME = r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,256}$"
"""A cookie name: an HTTP token (RFC 6265)."""
KeyAlphabet = Literal["hex", "alphanumeric", "digits"]


def _one_key(key: StickyKey) -> bool:
    return (key.header is None) != (key.cookie is None)


class StickyKey(ApiModel):
    """Where a user's key travels: a request header, or a cookie (matched inside the Cookie header)."""

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="has(self.header) != has(self.cookie)",
            message="set exactly one of header or cookie",
            check=_one_key,
            field_path=".header",
        ),
    )

    header: str | None = Field(default=None, pattern=HEADER_NAME, description="A lower-case request header.")
    cookie: str | None = Field(default=None, pattern=COOKIE_NAME, description="A cookie's name.")


class AbTestSpec(ApiModel):
    """An A/B test: each user (a key value) stays on one revision for the whole experiment.

    Istio's weighted routes pick per request, so the assignment is a rule every proxy evaluates the same way: a
    regex on the key's last two characters sends a fixed set of buckets to the candidate (docs/guide.md, "A/B
    tests"). The share is exact for keys whose last characters are uniform over `keyAlphabet` (random ids)."""

    rules: ClassVar[tuple[Rule, ...]] = (positive_duration("duration"),)

    key: StickyKey = Field(description="The user's key.")
    percent: float = Field(gt=0, lt=100, description="Share of keys assigned to the candidate, in percent.")
    duration: Duration = Field(
        description="Length of the experiment: after it, a passing check promotes the candidate (failed checks "
        "roll it back at any time, as in a staged rollout)."
    )
    key_alphabet: KeyAlphabet = Field(
        default="hex",
        description="The characters keys end in: hex (UUIDs, hashes), alphanumeric, digits. Decides the buckets "
        "(two trailing characters: 256, 3844 or 100) and so how close the assigned share comes to `percent`.",
    )


def _distinct_revisions(canary: CanarySpec) -> bool:
    return canary.candidate_revision is None or canary.candidate_revision != canary.stable_revision


class CanarySpec(ApiModel):
    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!has(self.candidateRevision) || !has(self.stableRevision) "
            "|| self.candidateRevision != self.stableRevision",
            message="candidateRevision must differ from stableRevision",
            check=_distinct_revisions,
            field_path=".candidateRevision",
        ),
        Rule(
            cel="!has(self.abTest) || !has(self.shadow)",
            message="abTest and shadow are two kinds of rollout: choose one",
            check=lambda canary: canary.ab_test is None or canary.shadow is None,
            field_path=".abTest",
        ),
        Rule(
            cel="self.all(s, s >= 0 && s <= 100)",
            message="steps must be between 0 and 100",
            check=lambda steps: all(0 <= step <= 100 for step in steps),
            on="steps",
        ),
        Rule(
            cel="self.steps[0] > 0 || has(self.match)",
            message="a first step of 0 % (testers only) needs header routes in canary.match",
            check=lambda canary: canary.steps[0] > 0 or canary.match is not None,
            field_path=".steps",
        ),
        Rule(
            cel="self.isSorted() && self.all(s, self.exists_one(t, t == s))",
            message="steps must be strictly increasing",
            check=lambda steps: all(a < b for a, b in itertools.pairwise(steps)),
            on="steps",
        ),
        Rule(
            cel="self[size(self) - 1] == 100",
            message="the last step must be 100",
            check=lambda steps: steps[-1] == 100,
            on="steps",
        ),
    )

    revision_label: str = Field(
        default="sluice.dev/revision", pattern=LABEL_KEY, description="Pod label naming a pod's revision."
    )
    stable_revision: str | None = Field(
        default=None,
        max_length=LABEL_VALUE_MAX_LENGTH,
        pattern=LABEL_VALUE,
        description="Revision taking traffic before the first rollout. Afterwards status.canary.stableRevision rules.",
    )
    candidate_revision: str | None = Field(
        default=None,
        max_length=LABEL_VALUE_MAX_LENGTH,
        pattern=LABEL_VALUE,
        description="Revision to roll out. Changing it restarts the rollout at the first step; removing it aborts.",
    )
    steps: list[int] = Field(
        default=[5, 25, 50, 100],
        min_length=1,
        max_length=20,
        description="Candidate traffic percentages, strictly increasing, ending at 100. With canary.match, a first "
        "step of 0 holds users on the stable revision while testers reach the candidate (Argo Rollouts' "
        "setHeaderRoute): its checks can fail it but never pass it (testers' requests alone), so it ends by "
        "`kubectl sluice skip-step` (or promote) once the testers are satisfied.",
    )
    step_interval: Duration = Field(default=60.0, description="Minimum time spent at each step.")
    analysis: AnalysisSpec = Field(default_factory=AnalysisSpec, description="Checks that gate each step.")
    max_failed_checks: int = Field(default=3, ge=1, le=100, description="Failed checks that roll the candidate back.")
    paused: bool = Field(default=False, description="Hold the current step; checks still run and can roll back.")
    match: list[CanaryRoute] | None = Field(
        default=None,
        min_length=1,
        max_length=8,
        description="Header routes: a request matching any entry goes to the candidate at every stage of the "
        "rollout (shadow and paused included), ahead of the weighted split — testers meet the candidate before "
        "users do. Rendered as a route of its own on sluice's VirtualService (not in weightsVia EnvoyFilter). "
        "Matched requests never satisfy analysis.minRequests on their own (docs/guide.md, 'Header routes').",
    )
    ab_test: AbTestSpec | None = Field(
        default=None,
        description="An A/B test instead of steps: a fixed share of users (by key) on the candidate for a "
        "duration, each user always on the same revision; the same gates, promotion and rollback.",
    )
    comparable_load: bool = Field(
        default=True,
        description="Judge the candidate at the stable revision's load: a step is published at no more than the "
        "share the candidate's hardware classes carry at the stable revision's load per unit of K (by "
        "capacity.classes), a ttftRatioToStable failure taken while the candidate was busier than the stable "
        "revision beyond 1.25x is Inconclusive, and the last step waits until the candidate can carry the pool: "
        "within scoring.targetUtilization of its classes at the stable pods' learned capacity per unit of K, or "
        "with nothing learned until its classes add up to the stable revision's (or, while no stable pod shows load, "
        "to 0.3 / scoring.targetUtilization of them). status.canary.capacityHeld says "
        "when a step is held; false publishes every step as written.",
    )
    shadow: ShadowSpec | None = Field(
        default=None,
        description="Shadow phase before the first live step: mirrored traffic only, judged by its own analysis; "
        "a failed shadow rolls back before any user request reaches the candidate, unless the split was forced to "
        "it because the stable revision had no healthy pod (status.canary.servedUsers).",
    )
