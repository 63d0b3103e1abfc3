"""The engines' expositions, as their own source emits them (tests/fixtures/engines/<engine>/<mode>.prom).

Each fixture is one pod's whole scrape in one deployment mode, transcribed from the engine's source (the
`# upstream:` and `# source:` lines name the repository, commit and file:line of each family), with the truth its
scenario implies (`# truth:`) and the signals the mode cannot give (`# truth-absent:`). `# elapsed: N` says the
server started N seconds before the scrape, its counters from 0 at a constant rate: `history` turns the scrape
into that history, sample by sample, with the labels a scrape adds (`namespace`, `pod`, `job`, `instance`), for
the real Prometheus (`promtool tsdb create-blocks-from openmetrics`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "engines"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)$")
_CUMULATIVE_TYPES = {"counter", "histogram", "summary", "gaugehistogram"}

POOL_SETTINGS: dict[tuple[str, str], dict[str, object]] = {
    # Triton serving the TensorRT-LLM model directly: clients call tensorrt_llm, not an ensemble
    ("triton", "single"): {"triton": {"servedModel": "tensorrt_llm"}},
}
"""Per fixture, the pool's metrics settings its deployment needs (beyond the engine)."""


@dataclass
class Fixture:
    engine: str
    mode: str
    path: Path
    elapsed: int
    truth: dict[str, float]
    absent: dict[str, str]
    samples: list[tuple[str, str, float, bool]] = field(default_factory=list)
    """(name, label text without braces, value, cumulative) per sample line of the scrape."""

    @property
    def pod(self) -> str:
        return f"{self.engine}-{self.mode}"

    @property
    def settings(self) -> dict[str, object]:
        return POOL_SETTINGS.get((self.engine, self.mode), {})


def _family_of(name: str, types: dict[str, str]) -> str | None:
    if name in types:
        return types[name]
    for suffix in ("_bucket", "_sum", "_count", "_total", "_created", "_gsum", "_gcount"):
        if name.endswith(suffix) and name.removesuffix(suffix) in types:
            return types[name.removesuffix(suffix)]
    return None


def load(path: Path) -> Fixture:
    header: dict[str, str] = {}
    truth: dict[str, float] = {}
    absent: dict[str, str] = {}
    types: dict[str, str] = {}
    samples: list[tuple[str, str, float, bool]] = []
    for line in path.read_text().splitlines():
        if line.startswith("# sluice-fixture:"):
            header.update(part.split("=", 1) for part in line.split(":", 1)[1].split())  # type: ignore[arg-type]
        elif line.startswith("# elapsed:"):
            header["elapsed"] = line.split(":", 1)[1].strip()
        elif line.startswith("# truth:"):
            truth.update({k: float(v) for k, v in (p.split("=", 1) for p in line.split(":", 1)[1].split())})
        elif line.startswith("# truth-absent:"):
            signal, _, why = line.split(":", 1)[1].strip().partition(" ")
            absent[signal] = why
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            types[name] = kind.strip()
        elif line.startswith("#") or not line.strip():
            continue
        else:
            match = _SAMPLE.match(line.strip())
            assert match is not None, f"{path.name}: not a sample line: {line!r}"
            name, labels, value = match.group(1), (match.group(2) or "{}")[1:-1], float(match.group(3))
            kind = _family_of(name, types)
            cumulative = kind in _CUMULATIVE_TYPES and not name.endswith("_created") and "quantile=" not in labels
            samples.append((name, labels, value, cumulative))
    return Fixture(header["engine"], header["mode"], path, int(header["elapsed"]), truth, absent, samples)


def all_fixtures() -> list[Fixture]:
    return [load(path) for path in sorted(FIXTURES.glob("*/*.prom"))]


def history(
    fixture: Fixture, namespace: str, now: int, step: int, until: int, pod: str | None = None, job: str = "engine"
) -> list[str]:
    """The fixture's scrape as OpenMetrics sample lines: the scrape is the one taken at `now`, the server having
    started `elapsed` seconds before; a sample every `step` seconds from its start to `until` (counters growing
    linearly from 0 at the same rate past `now`, gauges constant), with the scrape's own labels."""
    start = now - fixture.elapsed
    scrape = f'namespace="{namespace}",pod="{pod or fixture.pod}",job="{job}",instance="{pod or fixture.pod}:8000"'
    lines = []
    for name, labels, value, cumulative in fixture.samples:
        series = f"{name}{{{scrape}{',' + labels if labels else ''}}}"
        for at in range(start, until + 1, step):
            sample = value * (at - start) / fixture.elapsed if cumulative else value
            lines.append(f"{series} {_number(sample)} {at}")
    return lines


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(round(value, 9))
