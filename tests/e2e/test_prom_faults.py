"""Prometheus faults on the local stack: the fault proxy between the operator and the real Prometheus (the pool's
`spec.metrics.prometheusUrl` names the proxy), an outage then a partial answer, and the run's invariants checked
over what the API server recorded (`sluice.devstack.invariants`, evidence from `sluice.devstack.recorder`).

Bounded: the proxy and the recorder stop by themselves; the whole module takes about a minute and a half.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from sluice.devstack.invariants import (
    canary_records,
    canary_regressions,
    foreign_writes,
    pods_gone,
    recreation_loops,
    weight_after_deletion,
)
from sluice.devstack.kubelet import PodSpec
from sluice.devstack.promfaults import Faults, ProxyThread, error_answer
from sluice.devstack.recorder import Recorder
from sluice.devstack.stack import Stack, free_port
from sluice.io.kubereads import load_api_client
from sluice.istio.ownership import ownership
from tests.e2e.conftest import (
    BASE_PODS,
    FOREIGN_DR,
    Background,
    condition,
    operator_stack,
    pool_manifest,
    rows,
    running_traffic,
    wait_for_passes,
    wait_until,
    weights,
)

pytestmark = pytest.mark.slow
METRICS_PORT = free_port()
SPARE = PodSpec("llama-a100-1", "a100", "v1", "127.0.20.4")
"""Deleted during the outage: sluice must drop it though its metrics are frozen."""
ONE_PASS = 3.0
"""The pool's interval (2 s) and the daemon's minimum gap between passes (1 s)."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, background: Background) -> Iterator[Stack]:
    args = ["--metrics-port", str(METRICS_PORT), "--metrics-address", "127.0.0.1"]
    yield from operator_stack(Path(tmp_path_factory.mktemp("stack")), background, [*BASE_PODS, SPARE], args)


def metrics_status(stack: Stack) -> str:
    return str(condition(stack.pool("llama"), "MetricsAvailable")["status"])


def test_an_outage_freezes_weights_a_partial_answer_freezes_one_pod_and_no_invariant_breaks(
    stack: Stack, background: Background
) -> None:
    recorder = Recorder(load_api_client(str(stack.kubeconfig)), stack.namespace, stack.workdir / "audit.jsonl", 120)
    proxy = ProxyThread(stack.prometheus_url, lifetime=120, seed=7)
    with proxy, recorder:
        traffic = running_traffic(stack, background, rate=6.0)
        next(traffic)
        try:
            run_faults(stack, proxy)
        finally:
            next(traffic, None)  # stops the load
    evidence = recorder.snapshot()
    (stack.workdir / "evidence.jsonl").write_text("".join(json.dumps(asdict(v)) + "\n" for v in evidence))
    gone = pods_gone(evidence)
    assert [g.pod for g in gone] == [SPARE.name]
    violations = [
        *weight_after_deletion(evidence, gone, ONE_PASS),
        *foreign_writes(evidence),
        *recreation_loops(evidence, limit=2, window=60.0),
        *canary_regressions(canary_records(evidence)),
    ]
    assert [str(v) for v in violations] == []
    dropped = min(v.at for v in evidence if v.resource == "serviceentries" and v.at > gone[0].at)
    print(f"pod deleted during the outage -> its endpoint gone {dropped - gone[0].at:.1f}s after the deletion was seen")
    foreign = [v for v in evidence if v.resource == "destinationrules" and ownership(v.body, None) == "foreign"]
    assert foreign  # the foreign DestinationRule's versions were recorded, so (b) had something to judge


def run_faults(stack: Stack, proxy: ProxyThread) -> None:
    """A foreign object first (sluice must leave it alone), then the pool through the proxy, an outage with a pod
    deleted during it, the time to resume, and a partial answer missing one pod's series."""
    stack.kubectl("apply", "-f", "-", stdin=FOREIGN_DR)
    stack.kubectl("apply", "-f", "-", stdin=pool_manifest(stack).replace(stack.prometheus_url, proxy.proxy.url))
    wait_until(lambda: condition(stack.pool("llama"), "IstioSynced")["reason"] == "ObjectNotManaged", 30, "refused")
    stack.kubectl("delete", "destinationrule", "sluice-llama", "-n", "llm")
    wait_until(lambda: metrics_status(stack) == "True", 30, "fresh metrics through the proxy")
    wait_until(lambda: len(weights(stack)) == 4 and all(weights(stack).values()), 30, "every pod routed")

    proxy.set_faults(Faults(outage=True))
    began = time.monotonic()
    down = wait_until(lambda: metrics_status(stack) == "False" and stack.pool("llama"), 30, "MetricsAvailable=False")
    assert "weights frozen" in condition(down, "MetricsAvailable")["message"]
    before = weights(stack)
    stack.delete_pod(SPARE.name)
    wait_until(lambda: SPARE.name not in weights(stack), 15, "the deleted pod dropped during the outage")
    wait_for_passes(METRICS_PORT, "llm/llama", 3, 20)
    assert weights(stack) == {pod: weight for pod, weight in before.items() if pod != SPARE.name}
    assert metrics_status(stack) == "False"

    proxy.set_faults(Faults())
    cleared = time.monotonic()
    wait_until(lambda: metrics_status(stack) == "True", 40, "metrics again after the outage", every=0.1)
    resumed = time.monotonic() - cleared
    print(f"\noutage of {cleared - began:.1f}s cleared -> MetricsAvailable=True in {resumed:.1f}s")

    proxy.set_faults(Faults(drop_pods=frozenset({"llama-cpu-0"})))
    frozen = wait_until(
        lambda: rows(stack.pool("llama"))["llama-cpu-0"].get("verdict") == "frozen" and stack.pool("llama"),
        30,
        "the pod missing from the answers frozen",
    )
    assert rows(frozen)["llama-cpu-0"]["weight"] > 0
    assert condition(frozen, "MetricsAvailable")["status"] == "True"
    assert "no fresh samples (weight frozen): llama-cpu-0" in condition(frozen, "Degraded")["message"]
    proxy.set_faults(Faults())
    cleared = time.monotonic()
    wait_until(lambda: rows(stack.pool("llama"))["llama-cpu-0"].get("verdict") == "scored", 30, "scored again")
    print(f"partial answer cleared -> the pod scored again in {time.monotonic() - cleared:.1f}s")


TWO_SERIES = 'label_replace(vector(1), "a", "x", "", "") or label_replace(vector(1), "a", "y", "", "")'


@pytest.mark.parametrize(
    ("query", "error_type"), [("sum(", "bad_data"), (f"({TWO_SERIES}) + on() ({TWO_SERIES})", "execution")]
)
def test_the_proxys_error_answers_are_shaped_as_the_real_prometheus_answers(
    stack: Stack, query: str, error_type: str
) -> None:
    url = f"{stack.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(url, timeout=5)
    real = raised.value
    real_body = json.loads(real.read())
    status, body = error_answer(error_type)
    ours = json.loads(body)
    assert (status, list(ours), ours["errorType"]) == (real.code, list(real_body), real_body["errorType"])
    assert real.headers["Content-Type"] == "application/json"
    print(f"\nPrometheus {real.code}: {real_body}")
