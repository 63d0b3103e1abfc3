"""What one pass's queries cost Prometheus: namespace-wide, or naming a replica's pods (queries by shard).

    python benchmarks/bench_scoped_queries.py [--pools 1000] [--pods 16] [--named 4000 8000] [--repeat 3]

Real Prometheus scrapes `sluice.bench.scale`'s exporter (every pod's vLLM series, ±10 % at each scrape, 5 s)
for 75 s, so the rate windows have samples; then each of the vLLM preset's signal queries is asked as the
operator renders it — namespace-wide, and for the first N pods by name (what a replica of R shards asks: N =
pods / R) — as a POST form, and the median wall time of `--repeat` answers is printed, with the sum over the
signals (one pass's queries). Prometheus is the only busy process while it answers; the figures are this
machine's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from sluice.api.v1alpha1 import InferencePoolSpec
from sluice.bench.scale import Exporter, pod_name
from sluice.core.presets import build_queries
from sluice.devstack.stack import free_port


def answer_ms(url: str, query: str, repeat: int) -> float:
    spent = []
    for _ in range(repeat):
        start = time.perf_counter()
        form = urllib.parse.urlencode({"query": query}).encode()
        with urllib.request.urlopen(f"{url}/api/v1/query", data=form, timeout=120) as answer:
            json.loads(answer.read())
        spent.append(time.perf_counter() - start)
    return statistics.median(spent) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--pools", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=16)
    parser.add_argument("--named", type=int, nargs="+", default=[4000, 8000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--scrape-seconds", type=float, default=75.0)
    args = parser.parse_args()
    exporter = Exporter(args.pools, args.pods)
    exporter_port = exporter.start()
    home = Path(tempfile.mkdtemp(prefix="sluice-scoped-"))
    config = {
        "global": {"scrape_interval": "5s", "scrape_timeout": "4s"},
        "scrape_configs": [
            {
                "job_name": f"part-{i}",
                "honor_labels": True,
                "params": {"part": [str(i)]},
                "static_configs": [{"targets": [f"127.0.0.1:{exporter_port}"]}],
            }
            for i in range(len(exporter.parts))
        ],
    }
    (home / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    command = [
        "prometheus",
        f"--config.file={home / 'prometheus.yml'}",
        f"--storage.tsdb.path={home / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        pods = [pod_name(p, i) for p in range(args.pools) for i in range(args.pods)]
        pool = InferencePoolSpec.model_validate(
            {
                "selector": {"matchLabels": {"app": "llm"}},
                "service": "llm",
                "targetPort": 8000,
                "metrics": {"prometheusUrl": url},
            }
        )
        time.sleep(args.scrape_seconds)
        wide = build_queries(pool, "bench", pods, namespace_wide=True).queries
        named = {n: build_queries(pool, "bench", sorted(pods[:n]), by_pod=True).queries for n in args.named}
        print(f"{len(pods)} pods; ms per answer, median of {args.repeat}")
        print("signal", f"namespace-wide ({len(pods)})", *(f"{n} by name" for n in args.named), sep=" | ")
        totals = [0.0] * (1 + len(args.named))
        for signal in sorted(wide):
            row = [answer_ms(url, wide[signal], args.repeat)]
            row += [answer_ms(url, named[n][signal], args.repeat) for n in args.named]
            totals = [t + r for t, r in zip(totals, row, strict=True)]
            print(signal, *(f"{ms:.0f}" for ms in row), sep=" | ")
        print("one pass (sum)", *(f"{ms:.0f}" for ms in totals), sep=" | ")
    finally:
        process.terminate()
        process.wait(timeout=20)
        exporter.stop()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
