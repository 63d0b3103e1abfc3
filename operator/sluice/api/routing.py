"""`spec.routing`: how weights reach Istio: through sluice's VirtualService or an EnvoyFilter, per-pod endpoint
weights, where the routing applies (gateways, exportTo), session affinity, least-request tuning and retries.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from sluice.api.base import CLIENT_NAMESPACE, DNS_1123_LABEL, DNS_SUBDOMAIN, ApiModel, WeightsVia
from sluice.api.durations import Duration
from sluice.api.rules import Rule, positive_duration


class SessionAffinitySpec(ApiModel):
    header: str = Field(
        min_length=1,
        pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$",
        description="Request header whose value keeps a conversation on one pod (consistent hash).",
    )
    hash_balance_factor: int | None = Field(
        default=None,
        ge=100,
        description="Bounded-load hashing: a pod above this percent of the mean load spills over (e.g. 150).",
    )


class LeastRequestSpec(ApiModel):
    choice_count: int = Field(
        default=2,
        ge=2,
        le=10,
        description="Hosts sampled per pick, used only while every endpoint weight is equal: with routing."
        "endpointWeights the weights differ, Envoy (1.38 to 1.40) picks by weighted EDF and never reads it "
        "(the pool's SpecValid condition says so when it is set to anything but 2).",
    )
    active_request_bias: float = Field(
        default=1.0,
        ge=0,
        le=4,
        description="Exponent of (active+1) dividing a weight under weighted EDF (unequal weights); 0 is weighted "
        "round robin. Envoy 1.38 to 1.40 ignore it while every weight is equal.",
    )


RetryOn = Literal["connect-failure", "refused-stream", "reset", "gateway-error", "5xx"]
"""Failures Envoy sees before any of the response reaches the client, so a retry never duplicates a stream: no
connection, a reset before the headers, a 502/503/504, and with `5xx` any 5xx answer (plus resets: Envoy's `5xx`
covers connect-failure and refused-stream too). Envoy retries on the response headers, before it forwards any of
them, and never once it has sent the client part of an answer."""


class RetrySpec(ApiModel):
    """VirtualService retries, so a pod being zeroed or restarting costs a retry, not an error."""

    rules: ClassVar[tuple[Rule, ...]] = (
        positive_duration("per_try_timeout"),
        positive_duration("backoff"),
        Rule(
            cel="self.all(c, c == 429 || c >= 500)",
            message="status codes to retry are 429 or server errors (500-599)",
            check=lambda codes: all(code == 429 or code >= 500 for code in codes),
            on="status_codes",
        ),
    )

    attempts: int = Field(default=2, ge=1, le=10, description="Retries allowed per request.")
    retry_on: list[RetryOn] = Field(
        default=["connect-failure", "refused-stream", "reset", "gateway-error"],
        min_length=1,
        max_length=5,
        description="When to retry. Only failures before the response starts are offered: Envoy never retries once "
        "it has sent response bytes to the client, and an LLM request is expensive to repeat.",
    )
    status_codes: list[Annotated[int, Field(ge=429, le=599)]] = Field(
        default_factory=list,
        max_length=10,
        description="Server errors to retry besides gateway-error (e.g. [500] for an engine's internal error), or "
        "429 (a pod's sidecar past a tenant's share, admission.tenants: another pod's may have room): written as "
        "numbers in Istio's retryOn, which istiod turns into Envoy's retriable_status_codes. A retried server "
        "error runs its prompt again on another pod (its prefill is paid twice); a 429 was refused before it ran.",
    )
    per_try_timeout: Duration | None = Field(
        default=None,
        description="Timeout of one attempt, including the whole streamed answer: unset for long generations.",
    )
    backoff: Duration | None = Field(default=None, description="Minimum time between two attempts.")
    retry_remote_localities: bool = Field(default=True, description="Retries may go to pods in other localities.")
    retry_ignore_previous_hosts: bool = Field(
        default=True, description="A retry goes to another pod than the one that failed."
    )


def _gateways_exported(routing: RoutingSpec) -> bool:
    names = routing.client_namespaces
    if names is None or "*" in names:
        return True
    return all(gateway.partition("/")[0] in names for gateway in routing.gateways if "/" in gateway)


MAX_NAMESPACES = 64
ClientNamespace = Annotated[str, Field(max_length=63, pattern=CLIENT_NAMESPACE)]
"""An exportTo entry sluice accepts: '.', '*' or a namespace name."""
Gateway = Annotated[
    str,
    Field(
        min_length=1,
        max_length=317,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
    ),
]
"""A VirtualService gateway reference: 'mesh', '<name>' or '<namespace>/<name>'."""


class RoutingSpec(ApiModel):
    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!self.exists(n, n == '*') || size(self) == 1",
            message="'*' (every namespace) cannot be listed with other namespaces",
            check=lambda names: "*" not in names or len(names) == 1,
            on="client_namespaces",
        ),
        Rule(
            cel="!has(self.clientNamespaces) || self.clientNamespaces.exists(n, n == '*') || self.gateways.all(g, "
            "g.indexOf('/') < 0 || g.substring(0, g.indexOf('/')) in self.clientNamespaces)",
            message="a gateway in another namespace only sees sluice's routing if that namespace is exported to: "
            "list the namespace of every '<namespace>/<name>' gateway in clientNamespaces (and the namespace its "
            "pods run in, when it differs)",
            check=_gateways_exported,
            field_path=".clientNamespaces",
        ),
        Rule(
            cel="!has(self.sessionAffinity) || !has(self.leastRequest)",
            message="sessionAffinity (consistent hash) replaces least-request: set one of them",
            check=lambda routing: routing.session_affinity is None or routing.least_request is None,
            field_path=".sessionAffinity",
        ),
        Rule(
            cel="!has(self.retries) || self.weightsVia == 'VirtualService'",
            message="retries are set on sluice's VirtualService route: with weightsVia EnvoyFilter the route and "
            "its retries belong to the VirtualService's owner",
            check=lambda routing: routing.retries is None or routing.weights_via == "VirtualService",
            field_path=".retries",
        ),
    )

    weights_via: WeightsVia = Field(
        default="VirtualService",
        description="Where revision weights go: an operator-owned VirtualService, or an EnvoyFilter route patch "
        "for meshes whose VirtualService belongs to someone else.",
    )
    endpoint_weights: bool = Field(
        default=True,
        description="Publish per-pod weights through a STATIC ServiceEntry (EDS-only pushes). "
        "Off: revision weights only.",
    )
    route_name: str = Field(
        default="default",
        min_length=1,
        description="EnvoyFilter mode: name of the HTTP route to patch in the service's virtual host.",
    )
    session_affinity: SessionAffinitySpec | None = Field(
        default=None, description="Keep a session on one pod while it is routable."
    )
    least_request: LeastRequestSpec | None = Field(
        default=None, description="Envoy least-request tuning, applied with an EnvoyFilter CLUSTER patch."
    )
    gateways: list[Gateway] = Field(
        default=["mesh"],
        min_length=1,
        max_length=MAX_NAMESPACES,
        description="Where the routing applies, as in a VirtualService: 'mesh' (every sidecar) and gateways as "
        "'<namespace>/<name>' or '<name>' (the pool's namespace).",
    )
    client_namespaces: list[ClientNamespace] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_NAMESPACES,
        description="Namespaces whose proxies (sidecars and gateway deployments) call the Service: '.' (the pool's "
        "own), namespace names, or '*' (every namespace) alone. Sets exportTo on every object sluice writes (the "
        "pool's own namespace always included) and where the EnvoyFilters go: one copy in each listed namespace, "
        "or one in routing.rootNamespace for '*' (pushed to every proxy of the mesh at each change). Unset: "
        "exported as the Service is (its networking.istio.io/exportTo annotation, else every namespace), "
        "EnvoyFilters in the pool's namespace only, and status.mesh says which proxies that reaches.",
    )
    root_namespace: str = Field(
        default="istio-system",
        max_length=63,
        pattern=DNS_1123_LABEL,
        description="The mesh's root namespace (meshConfig.rootNamespace): where EnvoyFilters go for "
        "clientNamespaces ['*'].",
    )
    cluster_domain: str = Field(
        default="cluster.local",
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description="Cluster DNS domain used to build service host names: a DNS name (lowercase labels joined by "
        "single dots).",
    )
    adopt_existing: bool = Field(
        default=False, description="Take over Istio objects of the same names that sluice did not create."
    )
    retries: RetrySpec | None = Field(
        default=None,
        description="Retries on the VirtualService route (VirtualService mode): a pod zeroed or OOM-restarting "
        "costs the client a retry instead of an error.",
    )
