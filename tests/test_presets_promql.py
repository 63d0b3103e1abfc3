"""Every engine preset, run by the real Prometheus against known series: each signal comes out as expected.

The series are written as OpenMetrics, turned into TSDB blocks by the real `promtool`, and served by the real
`prometheus`; the queries go through sluice's own Prometheus I/O. So a preset that reads the wrong metric, a
ratio that divides by the wrong thing, or a histogram read the wrong way gives a wrong number here.
Three pods per engine: `ok` (TTFT 50 ms, no failure series at all), `bad` (TTFT 300 ms, 40 % failures),
`idle` (gauges only, no traffic: every rate-based signal must be missing, never 0).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sluice.core.observed import ALL_SIGNALS, SIGNAL_FIELD, PodSignals, SignalSnapshot
from sluice.core.presets import build_queries
from sluice.core.signalcheck import screen
from sluice.devstack.stack import free_port
from sluice.io.promanswers import plain_vector_values, pod_values
from sluice.io.prometheus import PromAuth, PromIO
from tests.engine_fixtures import Fixture, all_fixtures, history
from tests.helpers import spec

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("promtool") is None, reason="needs the Prometheus package (make stack-deps)"),
]

NAMESPACE = "llm"
UPSTREAM = "upstream"  # the engines' own expositions (tests/fixtures/engines), one pod per fixture
FIXTURES = all_fixtures()
SCRAPED_TWICE = {"vllm-v0-11": "vllm-twice", "sglang-priority": "sglang-twice"}
"""Fixture pods also written as a pod that two scrape jobs read (every series twice, `job` apart)."""
STEP = 10  # seconds between samples
SPAN = 180  # seconds of history before the module starts
AHEAD = 900
"""Seconds of samples after it: every query of the module, whenever it runs, has samples up to its own time
within one step, so `rate()` extrapolates no differently at the module's end than at its start (with the series
ending at the start, a query 11 s later read a counter's rate ~10 % low, and 25 s later 25 % low)."""
PODS = ("ok", "bad", "idle")

# Per pod: TTFT buckets reached per second (le -> cumulative rate), sum rate, requests/s ok and failed.
TTFT = {"ok": ({0.1: 1.0, 0.5: 1.0}, 0.05), "bad": ({0.1: 0.0, 0.5: 1.0}, 0.3)}
GAUGES = {"kv": {"ok": 0.4, "bad": 0.9, "idle": 0.1}, "queue": {"ok": 2, "bad": 7, "idle": 0}}
GAUGES["running"] = {"ok": 3, "bad": 5, "idle": 0}
GOOD = {"ok": 1.0, "bad": 0.6, "idle": 0.0}
FAILED = {"bad": 0.4}  # "ok" has no failure series at all: a failure would have created it


def line(name: str, labels: dict[str, str], value: float, at: int) -> str:
    rendered = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{rendered}}} {value} {at}"


def series(engine: str) -> list[tuple[str, dict[str, str], str, float]]:
    """(metric, labels, kind, per-second rate or gauge value) for the engine's exported metrics."""
    out: list[tuple[str, dict[str, str], str, float]] = []
    names = {
        "vllm": ("vllm:time_to_first_token_seconds", "vllm:kv_cache_usage_perc", "vllm:num_requests_waiting"),
        "sglang": ("sglang:time_to_first_token_seconds", "sglang:token_usage", "sglang:num_queue_reqs"),
        "trtllm": ("trtllm_time_to_first_token_seconds", "trtllm_kv_cache_utilization", "trtllm_num_requests_waiting"),
        "triton": (
            "nv_inference_first_response_histogram_ms",
            "nv_trt_llm_kv_cache_block_metrics",
            "nv_trt_llm_request_metrics",
        ),
        "tgi": ("", "", "tgi_queue_size"),
    }[engine]
    running = {
        "vllm": ("vllm:num_requests_running", {}),
        "sglang": ("sglang:num_running_reqs", {}),
        "trtllm": ("trtllm_num_requests_running", {}),
        "triton": ("nv_trt_llm_request_metrics", {"request_type": "scheduled"}),
        "tgi": ("tgi_batch_current_size", {}),
    }[engine]
    scale = 1000.0 if engine == "triton" else 1.0
    for pod in PODS:
        base = {"namespace": NAMESPACE, "pod": pod}
        if engine == "triton":  # Triton labels every series with its model (one served directly here)
            base = {**base, "model": "tensorrt_llm", "version": "1"}
        if pod in TTFT and names[0]:
            buckets, mean = TTFT[pod]
            for le, rate in [*buckets.items(), (float("inf"), 1.0)]:
                bound = "+Inf" if le == float("inf") else f"{le * scale:g}"
                out.append((f"{names[0]}_bucket", {**base, "le": bound}, "counter", rate))
            out.append((f"{names[0]}_sum", base, "counter", mean * scale))
            out.append((f"{names[0]}_count", base, "counter", 1.0))
        if names[1]:
            kv_name = "vllm:gpu_cache_usage_perc" if engine == "vllm" and pod == "bad" else names[1]  # the old name
            extra = {"kv_cache_block_type": "fraction"} if engine == "triton" else {}
            out.append((kv_name, {**base, **extra}, "gauge", GAUGES["kv"][pod]))
        queue_extra = {"request_type": "waiting"} if engine == "triton" else {}
        out.append((names[2], {**base, **queue_extra}, "gauge", GAUGES["queue"][pod]))
        out.append((running[0], {**base, **running[1]}, "gauge", GAUGES["running"][pod]))
        out.extend(_requests(engine, base, pod))
        out.extend(_sidecar({"namespace": NAMESPACE, "pod": pod}, pod))
    return out


# The pod's Istio sidecar, inbound side: istio_requests_total with the labels istio/proxy's stats filter writes
# (testdata/metric/server_request_total.yaml.tmpl at istio/proxy 86a72d0, 2026-08-22), response_flags as Envoy's
# short flags (source/common/stream_info/utility.cc: "-" for none, UO upstream overflow, RL rate limited).
# Per pod: (response_code, response_flags, requests/s); `idle` has no sidecar series at all.
SIDECAR = {
    "ok": [("200", "-", 1.0), ("503", "UO", 0.5), ("429", "RL", 0.25), ("503", "UO,URX", 0.05)],
    "bad": [("200", "-", 0.6), ("503", "UF", 0.1)],
}
REFUSED = {"ok": 0.8, "bad": 0.0}
"""UO and RL, alone or with another flag, are the sidecar's refusals; UF (an upstream connection failure) is not."""


def _sidecar(base: dict[str, str], pod: str) -> list[tuple[str, dict[str, str], str, float]]:
    istio = {
        "reporter": "destination",
        "source_workload": "istio-ingressgateway",
        "source_canonical_service": "istio-ingressgateway",
        "source_canonical_revision": "latest",
        "source_workload_namespace": "istio-system",
        "source_principal": "spiffe://cluster.local/ns/istio-system/sa/istio-ingressgateway-service-account",
        "source_app": "istio-ingressgateway",
        "source_version": "unknown",
        "source_cluster": "Kubernetes",
        "destination_workload": "llama",
        "destination_workload_namespace": NAMESPACE,
        "destination_principal": f"spiffe://cluster.local/ns/{NAMESPACE}/sa/default",
        "destination_app": "llama",
        "destination_version": "v1",
        "destination_service": f"llama.{NAMESPACE}.svc.cluster.local",
        "destination_canonical_service": "llama",
        "destination_canonical_revision": "v1",
        "destination_service_name": "llama",
        "destination_service_namespace": NAMESPACE,
        "destination_cluster": "Kubernetes",
        "request_protocol": "http",
        "grpc_response_status": "",
        "connection_security_policy": "mutual_tls",
    }
    rows = []
    for code, flags, rate in SIDECAR.get(pod, []):
        rows.append(("istio_requests_total", {**base, **istio, "response_code": code, "response_flags": flags}, rate))
        # the pod's sidecar also counts the requests the pod itself sends out (reporter="source", under its own pod
        # label): never refusals of its inbound side
        source = {**istio, "reporter": "source", "response_code": code, "response_flags": flags}
        rows.append(("istio_requests_total", {**base, **source, "destination_workload": "adapter-store"}, rate))
    return [(n, labels, "counter", v) for n, labels, v in rows]


def _requests(engine: str, base: dict[str, str], pod: str) -> list[tuple[str, dict[str, str], str, float]]:
    good, failed = GOOD[pod], FAILED.get(pod)
    if engine == "vllm":
        # HTTP view (instrumentator, grouped statuses) and engine view; the engine counts only what it finished.
        rows = [
            ("http_requests_total", {**base, "handler": "/v1/completions", "method": "POST", "status": "2xx"}, good)
        ]
        rows.append(("vllm:request_success_total", {**base, "finished_reason": "length"}, good))
        if failed:
            rows.append(
                (
                    "http_requests_total",
                    {**base, "handler": "/v1/completions", "method": "POST", "status": "5xx"},
                    failed,
                )
            )
        return [(n, labels, "counter", v) for n, labels, v in rows]
    if engine == "sglang":
        # each answer counted by SGLang's HTTP middleware per route template and status
        rows = [("sglang:num_requests_total", base, good + (failed or 0.0))]
        http = {**base, "endpoint": "/v1/completions", "method": "POST"}
        rows.append(("sglang:http_responses_total", {**http, "status_code": "200"}, good))
        if failed:
            rows.append(("sglang:http_responses_total", {**http, "status_code": "500"}, failed))
        return [(n, labels, "counter", v) for n, labels, v in rows]
    ok_name, bad_name, bad_labels = {
        "trtllm": ("trtllm_request_success_total", "trtllm_request_error_total", {"http_code": "500"}),
        "triton": ("nv_inference_request_success", "nv_inference_request_failure", {"reason": "BACKEND"}),
        "tgi": ("tgi_request_success", "tgi_request_failure", {"err": "generation"}),
    }[engine]
    if engine == "triton":
        base = {**base, "model": "tensorrt_llm", "version": "1"}
    rows = [(ok_name, base, good)] + ([(bad_name, {**base, **bad_labels}, failed)] if failed else [])
    return [(n, labels, "counter", v) for n, labels, v in rows]


def openmetrics(now: int) -> str:
    lines = []
    for engine in ("vllm", "sglang", "trtllm", "triton", "tgi"):
        for name, labels, kind, value in series(engine):
            for at in range(now - SPAN, now + AHEAD + 1, STEP):
                sample = value * (at - (now - SPAN)) if kind == "counter" else value
                lines.append(line(name, {**labels, "engine": engine}, round(sample, 6), at))
    until = now + AHEAD
    for fixture in FIXTURES:
        lines += history(fixture, UPSTREAM, now, STEP, until)
        if fixture.pod in SCRAPED_TWICE:  # the same pod also scraped by a second job
            twice = SCRAPED_TWICE[fixture.pod]
            lines += history(fixture, UPSTREAM, now, STEP, until, pod=twice, job="engine")
            lines += history(fixture, UPSTREAM, now, STEP, until, pod=twice, job="podmonitor")
    return (
        "\n".join(sorted(set(lines), key=lambda text: (text.rsplit(" ", 2)[0], int(text.rsplit(" ", 1)[1]))))
        + "\n# EOF\n"
    )


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("promql")
    (work / "series.om").write_text(openmetrics(int(time.time()) // STEP * STEP))
    data = work / "data"
    subprocess.run(
        ["promtool", "tsdb", "create-blocks-from", "openmetrics", "-q", str(work / "series.om"), str(data)], check=True
    )
    (work / "prometheus.yml").write_text("global: {}\n")
    port = free_port()
    process = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={data}",
            "--storage.tsdb.retention.time=1d",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(work / "prometheus.log").open("w"),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        else:
            pytest.fail(f"Prometheus not ready within 30 s (see {work / 'prometheus.log'})")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=20)


def read(url: str, engine: str, admission: dict[str, Any] | None = None, **metrics: Any) -> SignalSnapshot:
    io = PromIO()
    try:
        served = {"triton": {"servedModel": "tensorrt_llm"}} if engine == "triton" else {}
        pool = spec(
            engine=engine,
            metrics={"prometheusUrl": url, "window": "1m", "extraLabels": {"engine": engine}, **served, **metrics},
            **({"admission": admission} if admission else {}),
        )
        return io.read_signals(pool, NAMESPACE, list(PODS), PromAuth(), datetime.now(UTC))
    finally:
        io.close()


EXPECTED = {
    # engine: {pod: {field: value}}; a field absent from a row must be missing (None)
    "vllm": {
        "ok": {
            "ttft_seconds": 0.05,
            "ttft_p95_seconds": 0.095,
            "kv_cache_usage": 0.4,
            "queue_length": 2,
            "running_requests": 3,
            "request_rate": 1.0,
            "error_rate": 0.0,
        },
        "bad": {
            "ttft_seconds": 0.3,
            "ttft_p95_seconds": 0.48,
            "kv_cache_usage": 0.9,
            "queue_length": 7,
            "running_requests": 5,
            "request_rate": 0.6,
            "error_rate": 0.4,
        },
        "idle": {"kv_cache_usage": 0.1, "queue_length": 0, "running_requests": 0, "request_rate": 0.0},
    },
    "sglang": {
        "ok": {
            "ttft_seconds": 0.05,
            "ttft_p95_seconds": 0.095,
            "kv_cache_usage": 0.4,
            "queue_length": 2,
            "running_requests": 3,
            "request_rate": 1.0,
            "error_rate": 0.0,
        },
        "bad": {
            "ttft_seconds": 0.3,
            "ttft_p95_seconds": 0.48,
            "kv_cache_usage": 0.9,
            "queue_length": 7,
            "running_requests": 5,
            "request_rate": 1.0,
            "error_rate": 0.4,
        },
        "idle": {"kv_cache_usage": 0.1, "queue_length": 0, "running_requests": 0, "request_rate": 0.0},
    },
}
for _engine in ("trtllm", "triton"):
    EXPECTED[_engine] = {
        "ok": {**EXPECTED["vllm"]["ok"]},
        "bad": {**EXPECTED["vllm"]["bad"]},
        "idle": {"kv_cache_usage": 0.1, "queue_length": 0, "running_requests": 0, "request_rate": 0.0},
    }
EXPECTED["tgi"] = {
    "ok": {"queue_length": 2, "running_requests": 3, "request_rate": 1.0, "error_rate": 0.0},
    "bad": {"queue_length": 7, "running_requests": 5, "request_rate": 0.6, "error_rate": 0.4},
    "idle": {"queue_length": 0, "running_requests": 0, "request_rate": 0.0},
}
FIELDS = (
    "ttft_seconds",
    "ttft_p95_seconds",
    "kv_cache_usage",
    "queue_length",
    "running_requests",
    "request_rate",
    "error_rate",
)


@pytest.mark.parametrize("engine", sorted(EXPECTED))
def test_each_preset_reads_the_expected_signals_from_real_prometheus(prometheus: str, engine: str) -> None:
    snapshot = read(prometheus, engine)
    assert snapshot.failed == {}
    for pod, expected in EXPECTED[engine].items():
        got = snapshot.pods[pod]
        for field in FIELDS:
            value = getattr(got, field)
            if field in expected:
                assert value == pytest.approx(expected[field], rel=0.02, abs=1e-6), (engine, pod, field)
            else:
                assert value is None, (engine, pod, field, "no traffic must read as missing, not 0")


@pytest.mark.parametrize("engine", sorted(EXPECTED))
def test_under_enforce_each_preset_reads_the_sidecars_refusals_from_istios_counter(
    prometheus: str, engine: str
) -> None:
    """The same for every engine: UO and RL answers of the pod's own sidecar (reporter destination) per second;
    a pod whose sidecar answered and refused nothing reads 0; a pod without the metric reads nothing, not 0.
    Without Enforce the counter is not asked at all."""
    snapshot = read(prometheus, engine, admission={"mode": "Enforce"})
    assert snapshot.failed == {}
    for pod in PODS:
        value = snapshot.pods[pod].refused_rate
        if pod in REFUSED:
            assert value == pytest.approx(REFUSED[pod], rel=0.02, abs=1e-6), (engine, pod)
        else:
            assert value is None, (engine, pod, "a pod without Istio's counter has unknown refusals, not 0")
    assert all(values.refused_rate is None for values in read(prometheus, engine).pods.values())


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm", "triton", "tgi"])
def test_sample_times_are_the_samples_own_timestamps(prometheus: str, engine: str) -> None:
    """The newest sample at or before the query, by its own timestamp (a multiple of the step), not the query's
    time: placed on the operator's clock from when it asked (`FRESHNESS`: the sample's time less the evaluation's),
    so within the request's latency of the multiple."""
    before = time.time()
    snapshot = read(prometheus, engine)
    after = time.time()
    assert snapshot.freshness_known
    assert set(snapshot.sampled_at) == set(PODS)
    (stamp,) = {stamp.timestamp() for stamp in snapshot.sampled_at.values()}
    assert snapshot.collected_at is not None
    # A sample time is capped at the time the queries were asked (`values_snapshot`): when Prometheus evaluates
    # the query just past a step boundary asked just before it, the newest sample is that cap, not a step multiple.
    off_step = min(stamp % STEP, STEP - stamp % STEP)
    assert off_step < 0.5 or stamp == snapshot.collected_at.timestamp()
    assert before - STEP - 1 < stamp <= after


@pytest.mark.parametrize("skew", [30.0, -30.0])
def test_an_operator_whose_clock_is_off_prometheus_reads_the_samples_age_on_prometheus_clock(
    prometheus: str, skew: float
) -> None:
    """A replica 30 s ahead of Prometheus (or behind) reads the newest sample as old as it is on Prometheus'
    clock (at most a step here), on its own clock: judged against an absolute `timestamp()`, the one ahead read
    every sample 30 s older, stale, and froze every pool it held (the chaos matrix's clock-skew case)."""
    io = PromIO()
    try:
        pool = spec(
            engine="vllm", metrics={"prometheusUrl": prometheus, "window": "1m", "extraLabels": {"engine": "vllm"}}
        )
        now = datetime.now(UTC) + timedelta(seconds=skew)
        snapshot = io.read_signals(pool, NAMESPACE, list(PODS), PromAuth(), now)
    finally:
        io.close()
    assert set(snapshot.sampled_at) == set(PODS)
    ages = {pod: (now - at).total_seconds() for pod, at in snapshot.sampled_at.items()}
    assert all(0.0 <= age <= STEP + 1 for age in ages.values()), ages


def test_an_override_is_run_as_written(prometheus: str) -> None:
    snapshot = read(
        prometheus, "vllm", queries={"queueLength": "max by ($podLabel) (vllm:num_requests_waiting{$selector}) * 10"}
    )
    assert snapshot.pods["bad"].queue_length == pytest.approx(70)


def test_a_scoped_read_asks_real_prometheus_for_its_pods_by_name(prometheus: str) -> None:
    """A replica's pods by name (`PromIO(scoped=True)`), hundreds of them, sent as a POST form: real Prometheus
    answers for those pods only, with the same values as the namespace-wide query."""
    asked = ["ok", "bad", *(f"gone-{i:04d}" for i in range(400))]
    io = PromIO(scoped=True, preflight=False)  # the preflight asks namespace-wide, once a minute
    try:
        pool = spec(
            engine="vllm", metrics={"prometheusUrl": prometheus, "window": "1m", "extraLabels": {"engine": "vllm"}}
        )
        snapshot = io.read_signals(pool, NAMESPACE, asked, PromAuth(), datetime.now(UTC))
        answered = {pod for answer in io._shares.answers.values() for pod in answer.done.result()}
    finally:
        io.close()
    assert snapshot.failed == {}
    assert answered == {"ok", "bad"}  # "idle" has series in the namespace, but was not asked for
    for pod in ("ok", "bad"):
        for field, value in EXPECTED["vllm"][pod].items():
            assert getattr(snapshot.pods[pod], field) == pytest.approx(value, rel=0.02, abs=1e-6), (pod, field)


@pytest.mark.parametrize("engine", sorted(EXPECTED))
def test_real_prometheus_answers_to_every_preset_take_the_plain_reading(prometheus: str, engine: str) -> None:
    """The operator reads answers aggregated by pod without `json.loads` (`plain_vector_values`): it must apply to
    what this Prometheus really writes for every preset query (else the saving is gone unseen) and read the same
    values as the JSON decoder (else a pass reads numbers Prometheus did not answer)."""
    served = {"triton": {"servedModel": "tensorrt_llm"}} if engine == "triton" else {}
    pool = spec(
        engine=engine,
        metrics={"prometheusUrl": prometheus, "window": "1m", "extraLabels": {"engine": engine}, **served},
    )
    plan = build_queries(pool, NAMESPACE, list(PODS), namespace_wide=True)
    unseen = ("sleeping", "loraFailureRate")  # no series of theirs here (the fixtures below have them)
    texts = [q for signal, q in plan.queries.items() if signal not in unseen] + [plan.freshness or ""][
        : bool(plan.freshness)
    ]
    for text in texts:
        form = urllib.parse.urlencode({"query": text}).encode()
        with urllib.request.urlopen(f"{prometheus}/api/v1/query", data=form, timeout=10) as answer:
            body = answer.read().decode()
        plain = plain_vector_values(body, "pod")
        assert plain is not None, (engine, text, body[:200])
        assert plain == pod_values(json.loads(body)["data"]["result"], "pod"), (engine, text)
        assert plain, (engine, text, "an answer with no series reads nothing either way: not a comparison")


# --------------------------------------------------------------------- the engines' own expositions, every mode


def read_upstream(url: str, engine: str, pods: list[str], settings: dict[str, Any]) -> SignalSnapshot:
    io = PromIO()
    try:
        pool = spec(engine=engine, metrics={"prometheusUrl": url, "window": "1m", **settings})
        return io.read_signals(pool, UPSTREAM, pods, PromAuth(), datetime.now(UTC))
    finally:
        io.close()


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda f: f.pod)
def test_each_preset_reads_its_engines_own_exposition_as_the_source_says(prometheus: str, fixture: Fixture) -> None:
    """Every mode a real deployment runs, as the engine's source emits it (every family and label): the preset's
    value per signal is the fixture's truth, and a signal the mode cannot give reads nothing, never a number."""
    snapshot = read_upstream(prometheus, fixture.engine, [fixture.pod], fixture.settings)
    assert snapshot.failed == {}
    got = snapshot.pods.get(fixture.pod) or PodSignals()
    for signal in ALL_SIGNALS:
        value = getattr(got, SIGNAL_FIELD[signal])
        if signal in fixture.truth:
            assert value == pytest.approx(fixture.truth[signal], rel=1e-3, abs=1e-6), (fixture.pod, signal)
        else:
            assert value is None, (fixture.pod, signal, fixture.absent.get(signal, "no truth stated"))


PREFLIGHT_MISSING = {
    # what the engine's flags removed: named Missing, with the flag
    "vllm-no-log-stats": {"ttft", "ttftP95", "kvCacheUsage", "queueLength", "runningRequests", "requestRate"},
    "triton-no-histograms": {"ttft", "ttftP95"},
}
"""Per fixture pod, the signals the preflight must report Missing (every other mode: none)."""
VERSION_NOT_PROVIDED = {
    # what the engine's version or backend cannot give at all: NotProvided, not a missing flag
    "trtllm-v1-1": {"kvCacheUsage", "queueLength", "runningRequests", "errorRate"},
    "tgi-llamacpp": {"queueLength", "runningRequests"},
}


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda f: f.pod)
def test_the_preflight_finds_each_modes_series_as_they_are(prometheus: str, fixture: Fixture) -> None:
    """On the engines' real shapes the preflight sees one series per identity (no false duplicate), every signal
    with a truth Ok, and every signal the mode lacks Missing (naming the flag) or NotProvided."""
    pool = spec(engine=fixture.engine, metrics={"prometheusUrl": prometheus, "window": "1m", **fixture.settings})
    snapshot = read_upstream(prometheus, fixture.engine, [fixture.pod], fixture.settings)
    screened = screen(pool, snapshot, [fixture.pod], datetime.now(UTC))
    assert screened.refused == {}
    assert screened.checks is not None
    if not fixture.samples:  # nothing exported in this mode: the pod has no series at all
        assert screened.checks.unscraped == [fixture.pod]
        assert screened.ready[:2] == ("False", "PodsNotScraped")
        return
    states = {check.signal: check for check in screened.checks.signals}
    for signal in fixture.truth:
        assert states[signal].state == "Ok", (fixture.pod, signal, states[signal].message)
    missing = {signal for signal, check in states.items() if check.state == "Missing"}
    assert missing == PREFLIGHT_MISSING.get(fixture.pod, set()), fixture.pod
    assert all(states[signal].fix for signal in missing), fixture.pod
    for signal in VERSION_NOT_PROVIDED.get(fixture.pod, set()):
        assert states[signal].state == "NotProvided", (fixture.pod, signal, states[signal])
    assert screened.ready[:2] == (("False", "SeriesMissing") if missing else ("True", "AllPresent")), screened.ready


@pytest.mark.parametrize("pod", sorted(SCRAPED_TWICE.values()))
def test_a_pod_scraped_twice_has_its_duplicated_values_refused_naming_series_and_labels(
    prometheus: str, pod: str
) -> None:
    """Two scrape jobs on one pod: every sum would double. Detected on the raw series (the preflight counts them
    per identity), the values are not used, the condition says which series."""
    fixture = next(f for f in FIXTURES if SCRAPED_TWICE.get(f.pod) == pod)
    pool = spec(engine=fixture.engine, metrics={"prometheusUrl": prometheus, "window": "1m"})
    snapshot = read_upstream(prometheus, fixture.engine, [pod], {})
    assert snapshot.pods[pod].request_rate == pytest.approx(2 * fixture.truth["requestRate"])  # what a sum reads
    screened = screen(pool, snapshot, [pod], datetime.now(UTC))
    assert screened.snapshot.pods[pod].queue_length is None
    assert {"queueLength", "runningRequests", "kvCacheUsage", "ttft"} <= set(screened.refused[pod])
    status, reason, message = screened.ready
    assert (status, reason) == ("False", "DuplicateSeries")
    queue = next(c for c in screened.checks.signals if c.signal == "queueLength") if screened.checks else None
    assert queue is not None
    assert queue.state == "Duplicated"
    assert queue.pods == [pod]
    assert "2 raw series per (" in queue.message
    assert queue.series[0] in queue.message
    assert queue.series[0] in message
