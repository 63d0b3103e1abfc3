"""The PromQL presets are made of: what a preset reads (`Series`, `Reading`) and the query shapes every engine's
preset is built from (a ratio with its zero, a rate, a gauge, a histogram's mean and p95). Pure string building.

Queries are *vector* queries over the whole pool (`sum by ($podLabel)`), with the presets' placeholders
(`$selector`, `$window`, `$podLabel`) left for `sluice.core.presets` to fill in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Series:
    """A raw metric a preset reads, as the preflight checks it (`sluice.core.signalcheck`)."""

    name: str
    """The metric name (a histogram's `_count`)."""
    identity: tuple[str, ...] = ()
    """The engine's own labels that tell its series of one pod apart (data-parallel rank, finish reason, ...): two
    raw series of one pod with the same values of these are one series scraped twice, or split by a label the
    preset does not expect, and the signal is not used for that pod."""
    matchers: str = ""
    """Label matchers the preset adds (`,model="..."`), with the preset's placeholders."""
    needed: bool = True
    """False for a series that appears only with its first event (a failure counter): never reported missing."""
    lazy: bool = False
    """The engine creates it with its first request (a labelled child made on use): missing only for a pod that
    shows traffic (requests running, waiting or finished)."""
    fix: str = ""
    """What makes the engine export it, for the preflight's message."""

    @property
    def key(self) -> str:
        """The series as the preflight names it: its name and the preset's matchers."""
        return f"{self.name}{{{self.matchers.lstrip(',')}}}" if self.matchers else self.name


@dataclass(frozen=True)
class Reading:
    """One signal of a preset: its query, and the raw series the query reads."""

    query: str
    series: tuple[Series, ...]
    any_of: bool = False
    """The needed series are alternatives (one name per engine generation): one of them is enough."""
    unavailable_when: tuple[str, str] | None = None
    """(a series key, why): a pod that has that series but not the reading's runs an engine version or backend
    that cannot give the signal: NotProvided for it, not Missing."""


def ratio(numerator: str, denominator: str) -> str:
    """failed/total per pod. The denominator counts every request, failed ones included, and a failure would
    create the failure series; so a pod with traffic and no failure series has measurably failed 0 requests.
    A pod with no traffic reads nothing (0/0), never 0."""
    return f"(({numerator}) or (0 * ({denominator}))) / ({denominator})"


def all_requests(succeeded: str, failed: str) -> str:
    """succeeded + failed per pod, also for a pod whose failure series does not exist yet (vector `+` would
    drop it, leaving the error rate of a pod with traffic and no failures missing)."""
    return f"({succeeded}) + (({failed}) or (0 * ({succeeded})))"


def worst_of(*queries: str) -> str:
    """The highest of several per-pod ratios (each labelled by its source so `or` keeps them all)."""
    tagged = [f'label_replace({query}, "sluice_source", "{i}", "", "")' for i, query in enumerate(queries)]
    return "max by ($podLabel) (" + " or ".join(tagged) + ")"


def mean_of_histogram(name: str, matchers: str = "", scale: str = "") -> str:
    return (
        f"sum by ($podLabel) (rate({name}_sum{{$selector{matchers}}}[$window])) / "
        f"sum by ($podLabel) (rate({name}_count{{$selector{matchers}}}[$window])){scale}"
    )


def p95_of_histogram(name: str, matchers: str = "", scale: str = "") -> str:
    return (
        f"histogram_quantile(0.95, sum by ($podLabel, le) (rate({name}_bucket{{$selector{matchers}}}[$window]))){scale}"
    )


def rate(name: str, extra: str = "") -> str:
    return f"sum by ($podLabel) (rate({name}{{$selector{extra}}}[$window]))"


def gauge(aggregation: str, name: str, extra: str = "") -> str:
    return f"{aggregation} by ($podLabel) ({name}{{$selector{extra}}})"
