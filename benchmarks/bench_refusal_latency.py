"""How fast a sidecar refuses past sluice's admission limit: real Envoy, the inbound cluster as istiod builds it.

    PYTHONPATH=operator:. python benchmarks/bench_refusal_latency.py [--bursts 5] [--burst 20] [--limit 2]

The sidecar of `tests/test_envoy_inbound_limit.py` (the inbound route and cluster shaped as istiod builds them,
sluice's `admission.mode: Enforce` patches merged as Istio's MERGE does) in front of a loopback pod that holds
each request 1.5 s. `--bursts` times, `--burst` requests are sent at once; past `--limit` the sidecar answers 503
without reaching the pod. Per Envoy binary (1.40, and 1.38.3: Istio 1.30's branch) it prints how many were refused
and their time to answer at the client (median, max), measured with Python's urllib on loopback: the sidecar's
own share is smaller. The target (issue "Overload without collapse"): refusals answered in < 50 ms.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.helpers import spec
from tests.test_envoy_inbound_limit import slow_pod
from tests.test_envoy_patches import ENVOYS
from tests.test_envoy_refusals import envoy

from sluice.bench.sidecar import istio_inbound, patched, sidecar_config
from sluice.devstack.stack import free_port
from sluice.istio.envoyfilters import inbound_patches


def _one(port: int) -> tuple[int, float]:
    started = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as answer:
            status = answer.status
    except urllib.error.HTTPError as refused:
        status = refused.code
    return status, time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", type=int, default=5)
    parser.add_argument("--burst", type=int, default=20)
    parser.add_argument("--limit", type=int, default=2)
    args = parser.parse_args()
    for name, binary in sorted(ENVOYS.items()):
        with tempfile.TemporaryDirectory() as workdir, slow_pod() as app:
            listen = free_port()
            route_config, cluster = patched(*istio_inbound(app), inbound_patches(spec(), args.limit))
            with envoy(binary, sidecar_config(listen, route_config, cluster), Path(workdir), "sidecar"):
                refused: list[float] = []
                served = 0
                for _ in range(args.bursts):
                    with ThreadPoolExecutor(args.burst) as pool:
                        answers = list(pool.map(_one, [listen] * args.burst))
                    refused += [seconds for status, seconds in answers if status == 503]
                    served += sum(1 for status, _ in answers if status == 200)
        if not refused:
            print(f"{name}: nothing refused ({served} served)")
            continue
        print(
            f"{name}: {served} served, {len(refused)} refused; time to the 503 at the client: "
            f"median {1000 * statistics.median(refused):.1f} ms, max {1000 * max(refused):.1f} ms"
        )


if __name__ == "__main__":
    main()
