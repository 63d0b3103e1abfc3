"""Each invariant checker finds the defect it guards against in a real run: the operator started with one defect put
in (`tests.e2e.broken_operator`) on the local stack, the evidence recorded from the API server
(`sluice.devstack.recorder`) and judged by `sluice.devstack.invariants` — the same checkers that find nothing
against the real operator in `test_prom_faults.py`, so a green run there means something.

Covered: (a) a pod cache that never drops a deleted pod, (b) an ownership check that reads a foreign object as
absent, (c) objects deleted and created again on each write, (d) the stored canary progress not read after a
restart, (f) a pass blind to its metrics that re-weights anyway (an even split); (e), a replica's writes without its
shard fence, needs sharded replicas: `test_broken_operator_shards.py`.
Bounded: the recorder stops by itself; the module takes about a minute and a half.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.devstack.chaoschecks import blind_spans, weights_kept
from sluice.devstack.invariants import (
    canary_records,
    canary_regressions,
    foreign_writes,
    pods_gone,
    recreation_loops,
    weight_after_deletion,
)
from sluice.devstack.kubelet import PodSpec
from sluice.devstack.recorder import Recorder
from sluice.devstack.stack import Stack
from sluice.io.kubereads import load_api_client
from sluice.istio.ownership import ownership
from tests.e2e.conftest import (
    BASE_PODS,
    FOREIGN_DR,
    Background,
    condition,
    module_stack,
    pool_manifest,
    running_traffic,
    wait_until,
    weights,
)

pytestmark = pytest.mark.slow
SPARE = PodSpec("llama-a100-1", "a100", "v1", "127.0.20.4")
"""Deleted while the operator that never forgets a pod runs."""
ONE_PASS = 3.0
"""The pool's interval (2 s) and the daemon's minimum gap between passes (1 s), as in `test_prom_faults.py`."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, background: Background) -> Iterator[Stack]:
    yield from module_stack(Path(tmp_path_factory.mktemp("stack")), background, [*BASE_PODS, SPARE])


CANDIDATE = PodSpec("llama-v2-a100-0", "a100", "v2", "127.0.20.5")
CANARY = {
    "candidateRevision": "v2",
    "steps": [10, 50, 100],
    "stepInterval": "4s",
    "analysis": {"maxTtftP95": "10s", "maxTtftRatioToStable": 20},  # loose: this is about progress, not capacity
    "comparableLoad": False,
}


DEAD_PROMETHEUS = "http://127.0.0.1:9"
"""Nothing listens there: every query of the pool is refused at once, and its next pass is blind."""


def metrics_available(stack: Stack) -> str:
    return str(condition(stack.pool("llama"), "MetricsAvailable")["status"])


def step_index(stack: Stack) -> int | None:
    index = (stack.pool("llama")["status"].get("canary") or {}).get("stepIndex")
    return index if isinstance(index, int) else None


def start_broken(stack: Stack, defect: str) -> None:
    """The operator with `defect` (`tests.e2e.broken_operator.DEFECTS`), as `Stack.start_operator` runs it."""
    command = [sys.executable, "-m", "tests.e2e.broken_operator", defect, "operator", "-n", stack.namespace]
    stack.operator = stack.spawn([*command, "--kubeconfig", str(stack.kubeconfig)], f"operator-{defect}.log")


def test_each_checker_finds_the_defect_it_guards_against(stack: Stack, background: Background) -> None:
    recorder = Recorder(load_api_client(str(stack.kubeconfig)), stack.namespace, stack.workdir / "audit.jsonl", 150)
    with recorder:
        traffic = running_traffic(stack, background, rate=6.0)
        next(traffic)
        try:
            start_broken(stack, "pods-never-forgotten")
            stack.kubectl("apply", "-f", "-", stdin=pool_manifest(stack))
            wait_until(lambda: len(weights(stack)) == 4 and all(weights(stack).values()), 60, "every pod routed")
            stack.delete_pod(SPARE.name)
            time.sleep(3 * ONE_PASS)  # three passes on: the real operator drops it within one (test_prom_faults)
            assert SPARE.name in weights(stack)
            stack.stop_operator()

            stack.kubectl("delete", "destinationrule", "sluice-llama", "-n", "llm")
            stack.kubectl("apply", "-f", "-", stdin=FOREIGN_DR)
            start_broken(stack, "foreign-taken")
            taken = stack.istio
            wait_until(lambda: ownership(taken("destinationrules", "sluice-llama"), None) == "ours", 30, "taken")
            stack.stop_operator()

            start_broken(stack, "recreated-each-pass")
            wait_until(lambda: recreation_loops(recorder.snapshot(), 2, 60.0), 40, "objects created again")
            stack.stop_operator()

            stack.add_pod(CANDIDATE)
            stack.start_operator([])  # the real one, to its second step
            stack.patch_pool("llama", {"spec": {"canary": CANARY}})
            wait_until(lambda: step_index(stack) == 1, 60, "the canary at its second step")
            stack.stop_operator()
            start_broken(stack, "canary-forgotten")
            wait_until(lambda: step_index(stack) == 0, 30, "the canary begun again")
            stack.stop_operator()

            start_broken(stack, "reweighted-while-blind")
            url = stack.pool("llama")["spec"]["metrics"]["prometheusUrl"]
            stack.patch_pool("llama", {"spec": {"metrics": {"prometheusUrl": DEAD_PROMETHEUS}}})
            wait_until(lambda: metrics_available(stack) == "False", 30, "the pool blind")
            time.sleep(2 * ONE_PASS)  # blind passes, each writing its even split
            stack.patch_pool("llama", {"spec": {"metrics": {"prometheusUrl": url}}})
            wait_until(lambda: metrics_available(stack) == "True", 30, "the pool seeing again")
            stack.stop_operator()
        finally:
            next(traffic, None)  # stops the load
    evidence = recorder.snapshot()
    gone = pods_gone(evidence)
    assert [g.pod for g in gone] == [SPARE.name]
    kept = weight_after_deletion(evidence, gone, ONE_PASS)
    assert [v.subject for v in kept] == ["serviceentries/sluice-llama"]
    assert f"pod {SPARE.name} " in kept[0].detail
    assert [v.subject for v in foreign_writes(evidence)] == ["destinationrules/llm/sluice-llama"]
    assert {v.invariant for v in recreation_loops(evidence, limit=2, window=60.0)} == {"recreation-loop"}
    spans = blind_spans(evidence, "llama", 0.0, math.inf)
    assert len(spans) == 1, spans  # the dead Prometheus, and nothing else, made the pool blind
    reweighted, judged = weights_kept(evidence, "sluice-llama", *spans[0], gone)
    assert judged >= 1
    assert reweighted
    assert all("weights changed while blind" in v.detail for v in reweighted), reweighted
    repeated = canary_regressions(canary_records(evidence))
    assert [(v.subject, v.detail) for v in repeated] == [
        ("inferencepools/llama", "stepIndex went back from 1 to 0 without a rollback")
    ]
