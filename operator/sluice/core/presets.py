"""Engine presets made into a pool's queries: the engines' PromQL (`sluice.core.engines`) or the pool's overrides,
placeholders filled in and names escaped, the freshness query, and the preflight's queries of the raw series.

Pure string building. Every query is a *vector* query over the whole pool (`sum by (<pod label>)`), one per
signal per pool, never one per pod; the operator asks for the namespace-wide form (`namespace_wide`), which all
pools of a namespace share. Names substituted into PromQL are escaped, so a pod or namespace name cannot
change the query. Called by the Prometheus I/O module and by `sluice plan --show-queries`.

Template placeholders (presets and user overrides alike): `$selector` (namespace, pods and extra label matchers),
`$namespace`, `$pods` (an escaped regex alternation of the pool's pod names), `$window`, `$podLabel`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from string import Template

from sluice.api.durations import format_duration
from sluice.api.v1alpha1 import Engine, InferencePoolSpec, QueryOverrides
from sluice.core.engines import FRESHNESS_SERIES, READINGS, SIDECAR
from sluice.core.observed import ALL_SIGNALS, SignalName
from sluice.core.promql import Series

# Above this many pods the query selects by namespace only and the caller keeps the pool's pods: a regex of
# thousands of names makes a request line Prometheus may refuse.
POD_REGEX_LIMIT = 200

PRESETS: dict[Engine, dict[SignalName, str]] = {
    engine: {signal: reading.query for signal, reading in readings.items()} for engine, readings in READINGS.items()
}
PRESETS["custom"] = {signal: reading.query for signal, reading in SIDECAR.items()}

OPTIONAL_SIGNALS: frozenset[SignalName] = frozenset({"sleeping", "loraFailureRate", "refusedRate"})
"""Signals whose absence says nothing wrong, never reported missing: an engine started without sleep mode is
awake, a pod that loaded no adapter has no LoRA failure rate, and a pod without a sidecar refuses nothing of its
own (the AdmissionEnforced condition names it; a limited pod without the reading makes the pool's refusals
unknown, `sluice.core.inbound`)."""


def asked(spec: InferencePoolSpec, signal: SignalName) -> bool:
    """Whether the pool reads the signal at all: the sidecar's refusals only while its limits are enforced."""
    return signal not in SIDECAR or spec.admission.mode == "Enforce"


FRESHNESS: dict[Engine, str] = {
    engine: " or ".join(f"max by ($podLabel) (timestamp({s.name}{{$selector{s.matchers}}})) - time()" for s in series)
    for engine, series in FRESHNESS_SERIES.items()
}
"""Per pod, its newest sample's time less the query's evaluation time (<= 0), both on Prometheus' clock: the
operator places it on its own clock from when it asked (`sluice.io.promanswers.values_snapshot`), so a replica
whose clock is off Prometheus' by 30 s does not read every sample as 30 s old (an absolute `timestamp()` judged
against the operator's clock did: the chaos matrix's clock-skew case froze every pool of the skewed replica)."""


def overridden(spec: InferencePoolSpec, signal: str) -> bool:
    """Whether a query override replaces the preset's query for `signal`."""
    return getattr(spec.metrics.queries, SIGNAL_FIELD_OVERRIDE[signal]) is not None


def supported_signals(spec: InferencePoolSpec) -> tuple[SignalName, ...]:
    """Signals the pool can have: the engine preset's, plus any per-signal override."""
    preset = PRESETS[spec.engine]
    return tuple(
        signal
        for signal in ALL_SIGNALS
        if asked(spec, signal)
        and (signal in preset or getattr(spec.metrics.queries, SIGNAL_FIELD_OVERRIDE[signal]) is not None)
    )


def names_pods(spec: InferencePoolSpec, signal: str) -> bool:
    """Whether the signal's query (an override, or the engine's preset; `sampleTime`: the freshness query) uses
    `$pods`, the pool's own pods: such a query is the pool's, never asked for other pods."""
    if signal == "sampleTime":
        template = FRESHNESS.get(spec.engine) or ""
    else:
        field = SIGNAL_FIELD_OVERRIDE.get(signal)
        preset = {str(name): text for name, text in PRESETS[spec.engine].items()}
        template = (getattr(spec.metrics.queries, field) if field else None) or preset.get(signal) or ""
    return "$pods" in template or "${pods}" in template


def escape_string(value: str) -> str:
    """A PromQL double-quoted string literal's content."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_regex(value: str) -> str:
    """RE2-escape, so the value matches itself literally inside `=~`."""
    return re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\1", value)


# QueryOverrides' field per signal: its wire alias is the signal's name.
SIGNAL_FIELD_OVERRIDE: dict[str, str] = {info.alias or name: name for name, info in QueryOverrides.model_fields.items()}


@dataclass(frozen=True)
class QueryPlan:
    """The queries of one pass, and which signals the pool cannot have."""

    queries: dict[SignalName, str]
    unsupported: tuple[SignalName, ...]
    filters_pods_client_side: bool
    freshness: str | None = None
    """Per pod, `timestamp()` of a gauge less the evaluation time (`FRESHNESS`); None for engines without a preset
    (custom)."""


def build_queries(
    spec: InferencePoolSpec,
    namespace: str,
    pod_names: list[str],
    namespace_wide: bool = False,
    by_pod: bool | None = None,
) -> QueryPlan:
    """One PromQL query per supported signal for the whole pool, overrides first, names escaped.

    `namespace_wide`: select by namespace (and extra labels) only, whatever the pool's size, so every pool of a
    namespace with the same metrics settings renders the same query and one answer serves them all (the caller
    keeps each pool's pods). A user template that uses `$pods` stays the pool's own.
    `by_pod`: select the given pods by name whatever their number (True), or by namespace only (False); by
    default by name up to `POD_REGEX_LIMIT` pods unless `namespace_wide`. A replica that owns some of a
    namespace's pools asks for the pods of its own pools (`PromIO(scoped=True)`).
    """
    if by_pod is None:
        by_pod = len(pod_names) <= POD_REGEX_LIMIT and not namespace_wide
    values = _values(spec, namespace, pod_names, by_pod)
    preset = PRESETS[spec.engine]
    queries: dict[SignalName, str] = {}
    unsupported: list[SignalName] = []
    for signal in ALL_SIGNALS:
        if not asked(spec, signal):
            continue
        template = getattr(spec.metrics.queries, SIGNAL_FIELD_OVERRIDE[signal]) or preset.get(signal)
        if template is None:
            unsupported.append(signal)
            continue
        queries[signal] = Template(template).substitute(values)
    freshness = FRESHNESS.get(spec.engine)
    return QueryPlan(
        queries=queries,
        unsupported=tuple(unsupported),
        filters_pods_client_side=not by_pod,
        freshness=Template(freshness).substitute(values) if freshness else None,
    )


def _values(spec: InferencePoolSpec, namespace: str, pod_names: list[str], by_pod: bool) -> dict[str, str]:
    """The placeholders' values, escaped."""
    metrics = spec.metrics
    pods_regex = "|".join(escape_regex(name) for name in sorted(pod_names)) or "$^"
    matchers = [f'{metrics.namespace_label}="{escape_string(namespace)}"']
    if by_pod:
        matchers.append(f'{metrics.pod_label}=~"{escape_string(pods_regex)}"')
    matchers += [f'{key}="{escape_string(value)}"' for key, value in sorted(metrics.extra_labels.items())]
    return {
        "selector": ",".join(matchers),
        "namespace": escape_string(namespace),
        "pods": escape_string(pods_regex),
        "window": format_duration(metrics.window),
        "podLabel": metrics.pod_label,
        "servedModel": escape_string(metrics.triton.served_model),
        "backendModel": escape_string(metrics.triton.backend_model),
    }


def check_every(spec: InferencePoolSpec) -> float:
    """Seconds between two preflights of a namespace's series (the values themselves are read every pass): six
    passes, between 15 s and a minute."""
    return min(60.0, max(15.0, 6 * spec.interval))


@dataclass(frozen=True)
class CheckPlan:
    """The preflight's queries for a pool (namespace-wide, shared by the namespace's pools like the signals')."""

    series: dict[str, tuple[str, str]]
    """Series key -> (most raw series per pod sharing one identity, Unix time of the pod's newest sample)."""
    samples: str | None
    """Samples of the freshness gauge per pod within metrics.window."""


def preset_series(spec: InferencePoolSpec) -> dict[str, Series]:
    """Every raw series the pool's preset reads for the signals no override replaces, by key."""
    found: dict[str, Series] = {}
    for signal, reading in READINGS.get(spec.engine, {}).items():
        if asked(spec, signal) and not overridden(spec, signal):
            for series in reading.series:
                found.setdefault(series.key, series)
            if reading.unavailable_when is not None:  # asked too, to tell an older version from a missing series
                found.setdefault(reading.unavailable_when[0], Series(reading.unavailable_when[0], needed=False))
    return found


def check_queries(spec: InferencePoolSpec, namespace: str) -> CheckPlan:
    """The preflight's PromQL for the pool's namespace: per raw series the preset reads, the most series per
    pod that share the identity the preset expects (`count by (pod, <identity>)`: 1 unless duplicated) and the
    age of the pod's newest sample when the query was evaluated (<= 0, as `FRESHNESS`); the samples per rate
    window of the freshness gauge."""
    values = _values(spec, namespace, [], by_pod=False)
    queries: dict[str, tuple[str, str]] = {}
    for key, series in preset_series(spec).items():
        selected = f"{series.name}{{$selector{series.matchers}}}"
        by = ", ".join(("$podLabel", *series.identity))
        identity = f"max by ($podLabel) (count by ({by}) ({selected}))"
        newest = f"max by ($podLabel) (timestamp({selected})) - time()"  # on Prometheus' clock (`FRESHNESS`)
        queries[key] = (Template(identity).substitute(values), Template(newest).substitute(values))
    # Prometheus' own `up` has a sample per scrape of each target, whatever the engine exports; the freshness
    # gauge answers where `up` is not kept (a federated or remote-written copy)
    freshness = (Series("up"), *FRESHNESS_SERIES.get(spec.engine, ()))
    samples = " or ".join(
        f"min by ($podLabel) (count_over_time({s.name}{{$selector{s.matchers}}}[$window]))" for s in freshness
    )
    return CheckPlan(queries, Template(samples).substitute(values) if samples else None)
