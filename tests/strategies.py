"""Hypothesis strategies for InferencePool specs as users write them (camelCase wire dicts, durations as strings).

`accepted_pool_specs()` leans on the edges of the API: zeros where they are allowed, 1ms and 8760h durations,
alpha 0 and 1, minWeight equal to maxWeight, single-step canaries, many or no bands, query overrides, label keys
with prefixes. Each spec is built to satisfy the rules and then kept only if the CRD (schema + CEL, as an API
server checks it) accepts it, so a spec the models refuse is a disagreement between the two, not a bad draw.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from hypothesis import strategies as st

from sluice.api.crd import build_crd
from sluice.api.durations import format_duration
from sluice.emulator.apivalidation import SchemaRegistry, ValidationFailed

Wire = dict[str, Any]
Draw = Any

POOL_NAME = "pool"
REVISION_LABEL = "sluice.dev/revision"

_ALNUM = "abz09AZ"


def _names(first: str, middle: str, last: str, max_middle: int = 10) -> st.SearchStrategy[str]:
    """Names of one character, or a first and last character around a middle (cheaper than from_regex)."""
    longer = st.builds(
        lambda a, b, c: a + b + c,
        st.sampled_from(first),
        st.text(alphabet=middle, max_size=max_middle),
        st.sampled_from(last),
    )
    return st.sampled_from(first) | longer


label_names = _names(_ALNUM, _ALNUM + "-_.", _ALNUM)
label_keys = st.one_of(
    label_names,
    st.builds("{}/{}".format, st.sampled_from(["app.kubernetes.io", "example.com", "a" * 63 + ".b" * 95]), label_names),
    st.just("N" * 63),
)
label_values = st.one_of(st.just(""), st.just("V" * 63), label_names)
prometheus_label_names = _names("aZ_", "aZ09_", "aZ09_", max_middle=6)
service_names = _names("az", "az09-", "az09", max_middle=8)


def durations(min_ms: int = 1, max_ms: int = 8760 * 3600 * 1000) -> st.SearchStrategy[str]:
    """Go-style durations between the bounds, with the bounds themselves and round values likely."""
    millis = st.one_of(
        st.sampled_from([min_ms, max_ms]),
        st.sampled_from([m for m in (1, 250, 1000, 1500, 60_000, 90_000, 3_600_000) if min_ms <= m <= max_ms]),
        st.integers(min_ms, max_ms),
    )
    return millis.map(lambda ms: format_duration(ms / 1000))


def unit_floats(*, exclude_min: bool = False, exclude_max: bool = False) -> st.SearchStrategy[float]:
    edges = [x for x, excluded in ((0.0, exclude_min), (1.0, exclude_max)) if not excluded]
    inner = st.floats(0, 1, exclude_min=exclude_min, exclude_max=exclude_max, allow_nan=False)
    return st.one_of(st.sampled_from(edges), inner) if edges else inner


def percents(*, exclude_min: bool = True) -> st.SearchStrategy[float]:
    inner = st.floats(0, 100, exclude_min=exclude_min, allow_nan=False)
    return st.one_of(st.sampled_from([100.0, 1.0, 0.001]), inner)


@st.composite
def _scoring(draw: Draw) -> Wire:
    baseline_ms = draw(st.sampled_from([1, 100, 3_600_000]) | st.integers(1, 10_000))
    min_weight = draw(st.sampled_from([1, 100000]) | st.integers(1, 100000))
    scoring: Wire = {
        "alpha": draw(unit_floats()),
        "ttftBaseline": format_duration(baseline_ms / 1000),
        "ttftFloor": format_duration(draw(st.integers(1, baseline_ms)) / 1000),
        "defaultTtft": draw(durations(max_ms=60_000)),
        "kvCacheCoefficient": draw(unit_floats()),
        "kvCacheThreshold": draw(unit_floats(exclude_max=True)),
        "queueCoefficient": draw(unit_floats()),
        "queueReference": draw(st.sampled_from([1e-6, 1e6]) | st.floats(0, 1e6, exclude_min=True)),
        "smoothing": draw(unit_floats(exclude_max=True)),
        "sharpness": draw(st.sampled_from([1.0, 4.0]) | st.floats(1, 4)),
        "hysteresisPercent": draw(st.sampled_from([0.0, 100.0]) | st.floats(0, 100)),
        "minWeight": min_weight,
        "maxWeight": draw(st.sampled_from([min_weight, 100000]) | st.integers(min_weight, 100000)),
    }
    if draw(st.booleans()):
        scoring["ttftTimeout"] = draw(durations())
    return _some_of(draw, scoring, together=(("ttftFloor", "ttftBaseline"), ("minWeight", "maxWeight")))


@st.composite
def _protection(draw: Draw) -> Wire:
    rates = draw(st.lists(unit_floats(), max_size=10, unique=True))
    bands = []
    for rate in rates:
        band: Wire = {"maxErrorRate": rate, "weightPercent": draw(percents())}
        if draw(st.booleans()):
            band["maxTtftP95"] = draw(durations(min_ms=0))
        bands.append(band)
    cap = draw(percents())
    recovery = {
        "quietPeriod": draw(durations()),
        "initialPercent": draw(st.sampled_from([cap]) | st.floats(0, cap, exclude_min=True)),
        "growthFactor": draw(st.sampled_from([10.0]) | st.floats(1, 10, exclude_min=True)),
        "stepInterval": draw(durations()),
        "capPercent": cap,
    }
    outlier = {
        "enabled": draw(st.booleans()),
        "consecutive5xxErrors": draw(st.integers(0, 1000)),
        "interval": draw(durations()),
        "baseEjectionTime": draw(durations()),
        "maxEjectionPercent": draw(st.integers(0, 100)),
    }
    protection: Wire = {
        "fastZeroErrorRate": draw(unit_floats(exclude_min=True)),
        "loraFailureRate": draw(unit_floats(exclude_min=True)),
        "zeroOnOom": draw(st.booleans()),
        "zeroOnRestart": draw(st.booleans()),
        "consecutiveFailures": draw(st.integers(1, 100)),
        "bands": bands,
        "belowBandsPercent": draw(percents()),
        "recovery": _some_of(draw, recovery, together=(("initialPercent", "capPercent"),)),
        "minRoutablePercent": draw(st.integers(0, 100)),
        "outlierDetection": _some_of(draw, outlier),
    }
    return _some_of(draw, protection)


@st.composite
def _canary(draw: Draw) -> Wire:
    stable = draw(label_values)
    candidate = draw(label_values)
    if candidate == stable:
        candidate = "v2" if stable != "v2" else "v3"
    steps = [*sorted(draw(st.sets(st.integers(1, 99), max_size=19))), 100]
    analysis = {
        "interval": draw(durations()),
        "maxTtftP95": draw(durations(min_ms=0)),
        "maxErrorRate": draw(unit_floats()),
        "maxTtftRatioToStable": draw(st.sampled_from([1.0]) | st.floats(1, 100)),
        "minRequests": draw(st.integers(0, 10_000)),
        "disabledGates": draw(st.lists(st.sampled_from(["errorRate", "ttftP95", "ttftRatioToStable"]), unique=True)),
    }
    canary: Wire = {
        "stableRevision": stable,
        "candidateRevision": candidate,
        "steps": draw(st.sampled_from([[100], [1, 100], steps])),
        "stepInterval": draw(durations(min_ms=0)),
        "analysis": _some_of(draw, analysis),
        "maxFailedChecks": draw(st.integers(1, 100)),
        "paused": draw(st.booleans()),
        "shadow": _some_of(
            draw,
            {
                "mirrorPercent": draw(st.floats(0.0001, 100) | st.sampled_from([100.0])),
                "duration": draw(durations()),
                "analysis": _some_of(draw, analysis),
            },
        ),
    }
    return _some_of(draw, canary)


@st.composite
def _metrics(draw: Draw, needs_load_query: bool) -> Wire:
    placeholders = ["$selector", "$namespace", "$pods", "$window", "$podLabel"]
    query = st.lists(st.sampled_from(placeholders), min_size=0, max_size=3).map(
        lambda used: "sum by ($podLabel) (rate(m{" + ",".join(used) + "}[$window]))"
    )
    names = ["ttft", "ttftP95", "kvCacheUsage", "queueLength", "runningRequests", "requestRate", "errorRate"]
    queries = {name: draw(query) for name in draw(st.sets(st.sampled_from(names)))}
    if needs_load_query:
        queries.setdefault("queueLength", draw(query))
    metrics: Wire = {
        "prometheusUrl": draw(st.sampled_from(["http://prometheus:9090", "https://prom.example/api/prom"])),
        "window": draw(durations()),
        "timeout": draw(durations()),
        "staleAfter": draw(durations()),
        "podLabel": draw(prometheus_label_names),
        "namespaceLabel": draw(prometheus_label_names),
        "extraLabels": draw(st.dictionaries(prometheus_label_names, st.text(max_size=8), max_size=3)),
        "queries": queries,
    }
    if draw(st.booleans()):
        metrics["auth"] = {"bearerTokenSecretRef": {"name": "prom", "key": "token"}, "insecureSkipVerify": True}
    return _some_of(draw, metrics, keep=("queries",) if needs_load_query else ())


@st.composite
def _routing(draw: Draw) -> Wire:
    routing: Wire = {
        "weightsVia": draw(st.sampled_from(["VirtualService", "EnvoyFilter"])),
        "endpointWeights": draw(st.booleans()),
        "routeName": draw(st.sampled_from(["default", "r"])),
        "gateways": draw(st.sampled_from([["mesh"], ["mesh", "istio-system/public"]])),
        "clusterDomain": draw(st.sampled_from(["cluster.local", "c"])),
        "adoptExisting": draw(st.booleans()),
    }
    balancing = draw(st.sampled_from(["none", "affinity", "leastRequest"]))
    if balancing == "affinity":
        routing["sessionAffinity"] = {"header": "x-session-id", "hashBalanceFactor": draw(st.integers(100, 1000))}
    elif balancing == "leastRequest":
        routing["leastRequest"] = {
            "choiceCount": draw(st.integers(2, 10)),
            "activeRequestBias": draw(st.sampled_from([0.0, 4.0]) | st.floats(0, 4)),
        }
    return _some_of(draw, routing)


def _some_of(draw: Draw, fields: Wire, keep: tuple[str, ...] = (), together: tuple[tuple[str, str], ...] = ()) -> Wire:
    """A random subset of the fields, as users leave most of them to their defaults.

    Pairs in `together` were drawn against each other (a floor below its baseline): both stay or both go, since
    one alone would be checked against the other's default.
    """
    chosen = {name for name in fields if draw(st.integers(0, 3)) > 0}  # three in four: more edges per spec
    for first, second in together:
        if first in chosen or second in chosen:
            chosen |= {first, second}
    return {name: value for name, value in fields.items() if name in chosen or name in keep}


@st.composite
def _pool_specs(draw: Draw) -> Wire:
    engine = draw(st.sampled_from(["vllm", "sglang", "trtllm", "triton", "tgi", "custom"]))
    match_labels = draw(st.dictionaries(label_keys, label_values, min_size=1, max_size=4))
    match_labels.pop(REVISION_LABEL, None)
    spec: Wire = {
        "selector": {"matchLabels": match_labels or {"app": "llm"}},
        "targetPort": draw(st.sampled_from([1, 65535]) | st.integers(1, 65535)),
        "service": draw(st.sampled_from(["llm", "a" * 63]) | service_names),
        "engine": engine,
        "interval": draw(durations(min_ms=1000)),
        "metrics": draw(_metrics(needs_load_query=engine == "custom")),
        "capacity": {
            "classLabel": draw(label_keys),
            "classes": draw(st.dictionaries(label_values, st.sampled_from([1e-9, 1e9]) | st.floats(1e-9, 1e9))),
            "default": draw(st.sampled_from([1e-9, 1.0]) | st.floats(1e-9, 1e9)),
        },
        "scoring": draw(_scoring()),
        "protection": draw(_protection()),
        "routing": draw(_routing()),
    }
    if draw(st.booleans()):
        spec["servicePort"] = draw(st.integers(1, 65535))
    if draw(st.booleans()):
        spec["canary"] = draw(_canary())
    return _some_of(draw, spec, keep=("selector", "targetPort", "service", "engine", "metrics"))


def pool_object(spec: Wire, name: str = POOL_NAME) -> Wire:
    """The whole object a user applies, around a spec."""
    return {
        "apiVersion": "inference.sluice.dev/v1alpha1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": "llm"},
        "spec": spec,
    }


@cache
def crd_registry() -> SchemaRegistry:
    """The API server's view: the CRD the current models generate."""
    registry = SchemaRegistry()
    registry.add_crd(build_crd())
    return registry


def accepted_by_the_crd(spec: Wire) -> bool:
    try:
        crd_registry().validate(pool_object(spec))
    except ValidationFailed:
        return False
    return True


def accepted_pool_specs() -> st.SearchStrategy[Wire]:
    """Spec wire dicts at the edges of the API that the CRD accepts."""
    return _pool_specs().filter(accepted_by_the_crd)
