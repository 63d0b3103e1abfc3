"""What one pod-cache reseed costs: one list of a namespace of `--pools` × 16 pods, into the operator's cache.

    python benchmarks/bench_reseed.py --pools 1000 [--repeat 5]

Starts the API emulator of the local stack, creates the pods `make bench-scale` creates (Ready, with an IP),
then lists and seeds the namespace `--repeat` times as a pass does (`KubeCluster._seed`): the wall time and the
operator process's CPU time of each, median, min and max. The emulator runs on the same machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sluice.bench.scale import NAMESPACE, pod_manifest
from sluice.devstack.stack import Stack
from sluice.io.kube import KubeCluster
from sluice.io.kubereads import load_api_client
from sluice.runtime.podcache import PodCache

PODS_PER_POOL = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        stack = Stack(Path(workdir), namespace=NAMESPACE, deadline_seconds=600)
        try:
            stack.workdir.mkdir(parents=True, exist_ok=True)
            stack.start_apiserver()
            core = stack.core
            assert core is not None

            def create(pool: int) -> None:
                for i in range(PODS_PER_POOL):
                    core.create_namespaced_pod(NAMESPACE, pod_manifest(pool, i, stack.address_octet))  # type: ignore[arg-type]

            with ThreadPoolExecutor(8) as workers:
                list(workers.map(create, range(args.pools)))
            cluster = KubeCluster(load_api_client(str(stack.kubeconfig)))
            cache = PodCache()
            walls, cpus = [], []
            for _ in range(args.repeat):
                wall, cpu = time.perf_counter(), time.process_time()
                cluster._seed(cache, NAMESPACE)
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
            cluster.close()
        finally:
            stack.close()
    print(
        f"pods={len(cache)} reseed wall median {statistics.median(walls) * 1000:.0f} ms "
        f"(min {min(walls) * 1000:.0f}, max {max(walls) * 1000:.0f}); "
        f"operator CPU median {statistics.median(cpus) * 1000:.0f} ms "
        f"(min {min(cpus) * 1000:.0f}, max {max(cpus) * 1000:.0f})"
    )


if __name__ == "__main__":
    main()
