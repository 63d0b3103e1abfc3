"""`make chaos`: the fault matrix on the local stack, one stack for the whole run.

Local-stack tool: `python -m sluice.devstack.chaos --out DIR [--fast] [--case NAME ...] [--report FILE]`. It starts
the stack (`sluice.devstack.stack`) with the operator, two pools read through the Prometheus fault proxy — one
mid-canary (a candidate revision stepped every `CANARY_STEP` seconds), one mid-incident (a pod failing most of its
requests, zeroed) — load on both, and a `Recorder`. Then each case of `sluice.devstack.chaoscases.CASES` in turn:
inject, hold, clear, wait for the pools to resume (`RESUMED`), and judge the case's evidence
(`sluice.devstack.chaoschecks`). `--fast` runs the cases marked fast, each held `FAST_HOLD` seconds (CI's form);
`--case` only the cases named (`make chaos CHAOS_ARGS="--case prom-error"`). `--sharded` runs the sharded scene's
cases instead (`sluice.devstack.chaosshards`: two replicas, a partition, clock skew, invariant (e); `make
chaos-shards`), whose results the whole report shows in their own section (`--shards-results`).
Writes `DIR/results.json`, `DIR/report.md` (and the report to `--report`); every process started is stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from sluice.devstack.chaoscases import CASES, SERVED_CAP, FaultCase, Scene, served_by_rule
from sluice.devstack.chaoschecks import (
    Window,
    canary_changes,
    canary_state,
    case_violations,
    condition_states,
)
from sluice.devstack.chaoschecks import conditions_seen as seen_conditions
from sluice.devstack.chaosreport import (
    NOT_RUN,
    SHARDED_RESULTS,
    CaseResult,
    report_markdown,
    results_from_json,
    results_json,
    sharded_section,
)
from sluice.devstack.invariants import Version
from sluice.devstack.kubelet import PodSpec
from sluice.devstack.loop import Background
from sluice.devstack.metricspage import operator_page, samples
from sluice.devstack.promfaults import ProxyThread
from sluice.devstack.recorder import Recorder
from sluice.devstack.stack import ROOT, Stack, free_port
from sluice.devstack.traffic import Traffic
from sluice.io.kubereads import load_api_client

INTERVAL = 2.0
"""The pools' `spec.interval`."""
ONE_PASS = 3.0
"""One pass as invariant (a) allows it: the interval and the daemon's minimum gap between passes (1 s)."""
CANARY_STEP = 30.0
WARM_UP = 20.0
"""Seconds of load before the first case, once the pools have published: the rate window (10 s) filled twice."""
RESUME_WAIT = 90.0
WATCHED = ("Ready", "MetricsAvailable", "IstioSynced")
BLIND_PASSES = 2
"""Passes of each pool run after both went blind, before a case held `until_blind` is cleared."""
RESUMED = (
    "the first moment (polled every 0.25 s) after the fault's end at which, for each pool, the operator has "
    "counted a pass with result `ok` after the first poll that saw a pass started after the fault's end "
    "(`sluice_reconcile_total`, `sluice_last_pass_timestamp_seconds`; the ok count is read at that poll, so a "
    "pass that started and ended between two polls counts only at the next one), the pool's Ready, "
    "MetricsAvailable and IstioSynced conditions are back to what they were before the case, and every Istio "
    "object sluice had published before the case exists with its DestinationRule's spec as it was"
)
CANARY, INCIDENT = "llama", "mistral"
PODS = [
    PodSpec("llama-a100-0", "a100", "v1", "127.0.33.1"),
    PodSpec("llama-4090-0", "rtx4090", "v1", "127.0.33.2"),
    PodSpec("llama-v2-a100-0", "a100", "v2", "127.0.33.3"),
    PodSpec("mistral-a100-0", "a100", "v1", "127.0.33.11", app=INCIDENT),
    PodSpec("mistral-a100-1", "a100", "v1", "127.0.33.12", app=INCIDENT),
    PodSpec("mistral-4090-0", "rtx4090", "v1", "127.0.33.13", app=INCIDENT, error_rate=0.6),
]
FAILING = next(p for p in PODS if p.error_rate > 0)
RATES = {CANARY: 6.0, INCIDENT: 4.0}
"""Requests per second of load on each pool."""
STEPS = list(range(20, 101, 5))
POOLS = (
    f"`{CANARY}` mid-canary (candidate v2 stepped by {STEPS[1] - STEPS[0]} % every {CANARY_STEP:g} s from "
    f"{STEPS[0]} %, {RATES[CANARY]:g} requests/s) and `{INCIDENT}` mid-incident (one of its "
    f"{sum(p.app == INCIDENT for p in PODS)} pods, {FAILING.name}, fails {FAILING.error_rate:.0%} of its requests "
    f"and is zeroed; {RATES[INCIDENT]:g} requests/s)"
)
FOREIGN = (  # someone else's policy for the canary pool's host: sluice must never write it
    "apiVersion: networking.istio.io/v1\nkind: DestinationRule\nmetadata: {name: llama-by-hand, namespace: llm}\n"
    "spec: {host: llama.llm.svc.cluster.local, trafficPolicy: {connectionPool: {http: {maxRetries: 3}}}}\n"
)


def pool_manifest(name: str, prometheus: str, canary: bool) -> str:
    """The demo pool (`examples/local/pool.yaml`) as `name`, selecting `app: name`, read through `prometheus`;
    the canary pool steps its candidate v2 by 5 % every `CANARY_STEP` seconds with loose gates: one candidate pod
    carries up to the whole step's share, and the cases judge the rollout's progress, not the candidate's capacity
    (with the default ratio to stable, 1.5, a run rolled it back at 65 % on its TTFT, 2.2x stable's)."""
    pool: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "local" / "pool.yaml").read_text())
    pool["metadata"]["name"] = name
    pool["spec"].update(selector={"matchLabels": {"app": name}}, service=name)
    pool["spec"]["metrics"]["prometheusUrl"] = prometheus
    if canary:
        pool["spec"]["canary"].update(
            candidateRevision="v2",
            steps=STEPS,
            stepInterval=f"{CANARY_STEP:.0f}s",
            analysis={
                "interval": "5s",
                "minRequests": 5,
                "maxErrorRate": 0.2,
                "maxTtftP95": "10s",
                "maxTtftRatioToStable": 20,
            },
            comparableLoad=False,
        )
    return yaml.safe_dump(pool)


# ------------------------------------------------------------------------------------ readings


def counters(port: int) -> dict[str, float]:
    """Every sample of the operator's /metrics page (empty while it cannot be read)."""
    return samples(operator_page(port))


QUIET = ("sluice_events_total", "sluice_kube_retry_wait_seconds_total", "sluice_reconcile_duration", "sluice_gc_")
"""Counters the report leaves out: the Events are listed on their own, the rest says nothing a reader needs."""


def moved(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """The `_total` counters that went up, summed over pools (`name{result}` style keys). After a restart the
    counters start again from 0: the case reads them from 0."""
    restarted = sum(v for k, v in after.items() if k.startswith("sluice_reconcile_total")) < sum(
        v for k, v in before.items() if k.startswith("sluice_reconcile_total")
    )
    base = {} if restarted else before
    totals: dict[str, float] = {}
    for series, value in after.items():
        if "_total" not in series or series.startswith(("python_", "process_")) or "_created" in series:
            continue
        name, _, labels = series.partition("{")
        if series.startswith(QUIET) or 'action="unchanged"' in series:
            continue
        kept = [p for p in labels.rstrip("}").split(",") if p and not p.startswith(("pool=", "pod=", "signal="))]
        key = name + (f"{{{','.join(kept)}}}" if kept else "")
        totals[key] = totals.get(key, 0.0) + value - base.get(series, 0.0)
    return {k: round(v, 3) for k, v in totals.items() if v > 0}


def events(stack: Stack) -> dict[str, int]:
    """`object/Reason` -> count of every Event in the namespace."""
    found: dict[str, int] = {}
    for event in stack.events():
        key = f"{event.get('involvedObject', {}).get('name', '?')}/{event.get('reason', '?')}"
        found[key] = found.get(key, 0) + int(event.get("count") or 1)
    return found


def published(stack: Stack) -> dict[tuple[str, str], Any]:
    """sluice's Istio objects now: (plural, name) -> spec."""
    assert stack.custom is not None
    found = {}
    for plural in ("serviceentries", "destinationrules", "virtualservices"):
        listed: Any = stack.custom.list_namespaced_custom_object("networking.istio.io", "v1", stack.namespace, plural)
        for item in listed["items"]:
            if item["metadata"]["name"].startswith("sluice-"):
                found[(plural, item["metadata"]["name"])] = item["spec"]
    return found


@dataclass
class Before:
    """The readings a case starts from."""

    conditions: dict[str, dict[str, tuple[str, str]]]
    objects: dict[tuple[str, str], Any]
    counters: dict[str, float]
    events: dict[str, int]
    canary: str
    logs: dict[str, int] = field(default_factory=dict)
    """Per replica, the size of its log (the sharded scene: what it logs during the case is read from there)."""


def read_before(scene: Scene, port: int) -> Before:
    stack = scene.stack
    pools = {p: stack.pool(p) for p in (CANARY, INCIDENT)}
    return Before(
        conditions={p: condition_states(body) for p, body in pools.items()},
        objects=published(stack),
        counters=counters(port),
        events=events(stack),
        canary=canary_state(pools[CANARY]),
    )


def ok_key(pool: str) -> str:
    return f'sluice_reconcile_total{{pool="llm/{pool}",result="ok"}}'


def passes(now: Mapping[str, float], pool: str) -> float:
    """The pool's passes of every result on one reading of /metrics."""
    prefix = f'sluice_reconcile_total{{pool="llm/{pool}",'
    return sum(v for k, v in now.items() if k.startswith(prefix))


@dataclass
class Resumption:
    """The pass half of `RESUMED`, over successive readings of /metrics: per pool, the ok count at the first
    reading that showed a pass started after the fault's end (`cleared_wall`, on the operator's clock)."""

    cleared_wall: float
    seen: dict[str, float] = field(default_factory=dict)

    def passed(self, pool: str, now: Mapping[str, float]) -> bool:
        """True once an ok pass was counted after the reading that first showed a pass started after the end."""
        ok = now.get(ok_key(pool))
        started = now.get(f'sluice_last_pass_timestamp_seconds{{pool="llm/{pool}"}}')
        if ok is None or started is None:
            return False
        if pool not in self.seen:
            if started >= self.cleared_wall:
                self.seen[pool] = ok
            return False
        return ok > self.seen[pool]


def conditions_back(before: Mapping[str, tuple[str, str]], now: Mapping[str, tuple[str, str]]) -> bool:
    """The watched conditions have the status they had before the case."""
    return all(now.get(k, ("", ""))[0] == before.get(k, ("", ""))[0] for k in WATCHED)


def resumed(scene: Scene, port: int, before: Before, resumption: Resumption) -> bool:
    """`RESUMED`, read once (every pool's reading taken, so each pool's first post-clear pass is seen on time)."""
    return back(scene.stack, (CANARY, INCIDENT), counters(port), before, resumption)


def back(stack: Stack, pools: Sequence[str], now: Mapping[str, float], before: Before, resumption: Resumption) -> bool:
    """`RESUMED` for `pools` from the operators' counters `now`: each pool's pass counted (every pool's reading
    taken, no short cut, so each pool's first post-clear pass is seen on time), its watched conditions back, and
    every object published before the case there again with its DestinationRule's spec."""
    counted = [resumption.passed(pool, now) for pool in pools]
    if not all(counted):
        return False
    if not all(conditions_back(before.conditions[p], condition_states(stack.pool(p))) for p in pools):
        return False
    objects = published(stack)
    if any(key not in objects for key in before.objects):
        return False
    return all(objects[k] == spec for k, spec in before.objects.items() if k[0] == "destinationrules")


def blind_now(scene: Scene) -> bool:
    return all(
        condition_states(scene.stack.pool(p)).get("MetricsAvailable", ("", ""))[0] == "False"
        for p in (CANARY, INCIDENT)
    )


def hold_until_blind(scene: Scene, port: int, cap: float) -> None:
    """Until both pools show MetricsAvailable=False and each ran `BLIND_PASSES` more passes, at most `cap` s."""
    end = time.monotonic() + cap
    if wait(lambda: blind_now(scene), cap) is None:
        return
    first = counters(port)
    wait(
        lambda: all(passes(counters(port), p) >= passes(first, p) + BLIND_PASSES for p in (CANARY, INCIDENT)),
        max(0.0, end - time.monotonic()),
    )


# ------------------------------------------------------------------------------------ one case


def wait(check: Callable[[], bool], seconds: float, every: float = 0.25) -> float | None:
    """Seconds until `check` held (None: not within `seconds`); a check that raises counts as not yet."""
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        try:
            if check():
                return time.monotonic() - began
        except Exception:  # a read during a fault may fail; the next poll reads again
            pass
        time.sleep(every)
    return None


def run_case(scene: Scene, case: FaultCase, hold: float, port: int) -> CaseResult:
    """Inject, hold, clear, wait for the pools to resume, then judge the case's evidence."""
    before = read_before(scene, port)
    started = time.monotonic()
    case.inject(scene)
    if case.until_blind:
        hold_until_blind(scene, port, hold)
    else:
        time.sleep(max(0.0, hold - (time.monotonic() - started)))
    if case.until_served:
        wait(lambda: all(n > 0 for n in served_by_rule(scene.stack).values()), SERVED_CAP)
    plane = data_plane_seen(scene, started) if case.data_plane_blind else {}
    served = case.clear(scene)
    cleared, cleared_wall = time.monotonic(), time.time()
    resumption = Resumption(cleared_wall)
    resume = wait(lambda: resumed(scene, port, before, resumption), RESUME_WAIT)
    time.sleep(INTERVAL)  # one more interval of evidence after the resume
    ended = time.monotonic()
    evidence = scene.recorder.snapshot()
    window = Window(started, cleared, ended, operator_down=case.operator_down)
    entries = {p: f"sluice-{p}" for p in (CANARY, INCIDENT)}
    violations, judged = case_violations(evidence, window, entries, ONE_PASS)
    return case_result(
        (case.name, case.fault),
        scene.stack,
        before,
        evidence,
        window,
        resume,
        counters(port),
        served,
        (violations, judged),
        data_plane=plane,
    )


def case_result(
    named: tuple[str, str],
    stack: Stack,
    before: Before,
    evidence: Sequence[Version],
    window: Window,
    resume: float | None,
    now: Mapping[str, float],
    served: Mapping[str, int],
    judged: tuple[Mapping[str, Sequence[str]], Mapping[str, int]],
    canary: str = CANARY,
    **extra: Any,
) -> CaseResult:
    """A case's row from what was read before it (`before`), its evidence and window, the seconds it took to
    resume, the operators' counters `now`, what the injector served and the invariants judged (violations, and
    the ServiceEntry versions (f) judged); `canary`: the pool mid-canary; `extra`: the scene's own columns."""
    started, cleared, ended = window.started, window.cleared, window.ended
    after_events = events(stack)
    violations, blind = judged
    return CaseResult(
        name=named[0],
        fault=named[1],
        held_seconds=round(cleared - started, 1),
        resume_seconds=None if resume is None else round(resume, 1),
        interval_seconds=INTERVAL,
        conditions={p: seen_conditions(evidence, p, c, started, ended) for p, c in before.conditions.items()},
        events={k: n - before.events.get(k, 0) for k, n in after_events.items() if n > before.events.get(k, 0)},
        counters=moved(before.counters, now),
        served=served,
        canary=(before.canary, canary_state(stack.pool(canary))),
        canary_steps=canary_changes(evidence, canary, started, ended, started),
        window=(round(started, 3), round(cleared, 3), round(ended, 3)),
        violations=violations,
        blind_versions=blind,
        **extra,
    )


def _shares(counts: Mapping[str, float]) -> str:
    total = sum(counts.values()) or 1.0
    return ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(counts.items()))


def data_plane_seen(scene: Scene, since: float) -> dict[str, str]:
    """Per pool, at the end of a case in which the data plane read no route: what sluice published last (the canary
    pool's revision split, the other pool's ServiceEntry weights), the versions of its objects written since
    `since`, the routes the data plane held (read before `since`), and the shares it sent meanwhile (from the
    requests it finished)."""
    out: dict[str, str] = {}
    for traffic in scene.data_plane:
        pool = traffic.pool
        name = f"sluice-{pool}"
        written = [
            v
            for v in scene.recorder.snapshot()
            if v.at >= since and v.name == name and v.resource in ("serviceentries", "virtualservices")
        ]
        split = scene.stack.pool(pool).get("status", {}).get("revisionWeights") or {}
        if len(split) > 1:
            published, sent = _shares(split), _shares(traffic.share(since, key="revision"))
            held = _shares(dict(traffic.routes[0]))
        else:
            entry = scene.stack.istio("serviceentries", name) or {}
            pod_at = {state.spec.ip: p for p, state in scene.stack.pods.items()}
            endpoints = entry.get("spec", {}).get("endpoints", [])
            published = _shares({pod_at.get(e["address"], e["address"]): e.get("weight", 1) for e in endpoints})
            sent = _shares(traffic.share(since))
            held = _shares({pod: weight for endpoints in traffic.routes[1].values() for pod, _, weight in endpoints})
        out[pool] = (
            f"published {published} ({len(written)} ServiceEntry/VirtualService versions written meanwhile); "
            f"the data plane held {held} and sent {sent}"
        )
    return out


# ------------------------------------------------------------------------------------ the run


def setup(stack: Stack, proxy_url: str, background: Background, port: int) -> tuple[Traffic, ...]:
    """Pods, the operator, a foreign object, the two pools, load on both; until both pools have published. The
    load on each pool (its data plane)."""
    for pod in PODS:
        stack.add_pod(PodSpec(pod.name, pod.hardware, pod.revision, pod.ip, app=pod.app, error_rate=pod.error_rate))
    stack.start_operator(["--metrics-port", str(port), "--metrics-address", "127.0.0.1"])
    stack.kubectl("apply", "-f", "-", stdin=FOREIGN)
    for name in (CANARY, INCIDENT):
        stack.kubectl("apply", "-f", "-", stdin=pool_manifest(name, proxy_url, canary=name == CANARY))
    data_plane = tuple(Traffic(stack, name, rate=rate) for name, rate in RATES.items())
    for traffic in data_plane:
        background.start(traffic.run(stack.remaining()))

    def healthy() -> bool:
        states = [condition_states(stack.pool(p)) for p in (CANARY, INCIDENT)]
        return all(s.get(k, ("", ""))[0] == "True" for s in states for k in WATCHED)

    if wait(healthy, 180, every=1.0) is None:
        raise RuntimeError("the pools did not publish within 180 s: see operator.log in the work directory")
    time.sleep(WARM_UP)
    if wait(lambda: condition_states(stack.pool(INCIDENT)).get("Degraded", ("", ""))[0] == "True", 60, 1.0) is None:
        raise RuntimeError(f"{INCIDENT} did not show Degraded=True within 60 s: the run would not be mid-incident")
    if wait(lambda: canary_state(stack.pool(CANARY)).startswith("Progressing"), 60, every=1.0) is None:
        raise RuntimeError(f"{CANARY}'s canary was not Progressing within 60 s: the run would not be mid-canary")
    return data_plane


def save_evidence(recorder: Recorder, path: Path) -> None:
    """Every version the recorder saw, one JSON line each (`at` on the clock of the cases' windows)."""
    path.write_text("".join(json.dumps(asdict(v)) + "\n" for v in recorder.snapshot()))


def run(workdir: Path, fast: bool, only: Collection[str] = ()) -> list[CaseResult]:
    """The matrix (or its fast cases, or the cases named in `only`) on one stack; the results in order."""
    cases = [c for c in CASES if (c.fast or not fast) and (not only or c.name in only)]
    seconds = 400 + sum(
        (c.fast_hold if fast else c.hold) + RESUME_WAIT / 2 + SERVED_CAP * c.until_served for c in cases
    )
    background = Background()
    stack = Stack(workdir, deadline_seconds=seconds).__enter__()
    background.start(stack.kubelet())
    port = free_port()
    try:
        api = load_api_client(str(stack.kubeconfig))
        proxy = ProxyThread(stack.prometheus_url, lifetime=seconds, seed=7)
        with proxy as server, Recorder(api, stack.namespace, None, seconds) as recorder:
            data_plane = setup(stack, server.url, background, port)
            scene = Scene(stack, proxy, recorder, CANARY, INCIDENT, data_plane=data_plane)
            results = [run_case(scene, case, case.fast_hold if fast else case.hold, port) for case in cases]
            save_evidence(recorder, workdir.parent / "evidence.jsonl")
            return results
    finally:
        background.call(stack.stop_kubelet)
        stack.close()
        background.close()


def git_commit() -> str:
    found = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    return found.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sluice.devstack.chaos", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for results.json, report.md and the stack")
    parser.add_argument("--fast", action="store_true", help="only the fast cases, each held 8 s (CI's form)")
    parser.add_argument("--report", type=Path, help="also write the markdown report here (docs/chaos-report.md)")
    parser.add_argument(
        "--scale-results",
        type=Path,
        default=ROOT / "out" / "chaos-scale" / "results.json",
        help="`make chaos-scale`'s results, reported in their own section when the file exists",
    )
    parser.add_argument(
        "--shards-results",
        type=Path,
        default=ROOT / SHARDED_RESULTS,
        help="`make chaos-shards`' results, reported in their own section when the file exists",
    )
    parser.add_argument(
        "--sharded",
        action="store_true",
        help="the sharded scene's cases instead (two replicas, a partition, clock skew: sluice.devstack.chaosshards); "
        "DIR/report.md is then that section alone",
    )
    parser.add_argument("--case", action="append", default=[], help="run only this case (repeatable)")
    parser.add_argument(
        "--from-results", action="store_true", help="render the report again from DIR/results.json, without a run"
    )
    args = parser.parse_args(argv)
    run_cases: Callable[[Path, bool, Collection[str]], list[CaseResult]]
    if args.sharded:
        from sluice.devstack import chaosshards  # noqa: PLC0415 - it reads the pools through this module

        cases, pools, run_cases = [c.name for c in chaosshards.CASES], chaosshards.SCENE, chaosshards.run
    else:
        cases, pools, run_cases = [c.name for c in CASES], POOLS, run
    unknown = sorted(set(args.case) - set(cases))
    if unknown:
        parser.error(f"unknown case {', '.join(unknown)}: choose from {', '.join(cases)}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_results:
        results, meta = results_from_json((args.out / "results.json").read_text())
    else:
        began, began_load = datetime.now(UTC), os.getloadavg()[0]
        results = run_cases(args.out.resolve() / "stack", args.fast, args.case)
        meta = {
            "started": began.strftime("%Y-%m-%d %H:%M UTC"),
            "commit": git_commit(),
            "cpus": str(os.cpu_count()),
            "form": f"the cases {', '.join(args.case)}" if args.case else "fast cases" if args.fast else "whole matrix",
            "interval": f"{INTERVAL:g} s",
            "resumed": RESUMED,
            "pools": pools,
            "load": f"{began_load:.2f} at the start and {os.getloadavg()[0]:.2f} at the end",
        }
        (args.out / "results.json").write_text(results_json(results, () if args.sharded else NOT_RUN, meta))
    if args.sharded:
        text = sharded_section(json.loads(results_json(results, (), meta)))
    else:
        scale = json.loads(args.scale_results.read_text()) if args.scale_results.exists() else None
        sharded = json.loads(args.shards_results.read_text()) if args.shards_results.exists() else None
        text = report_markdown(results, NOT_RUN, meta, scale, sharded)
    (args.out / "report.md").write_text(text)
    if args.report is not None:
        args.report.write_text(text)
    broken = [r.name for r in results if not r.held]
    print(
        f"{len(results)} cases; invariants broken in: {', '.join(broken) or 'none'}; report: {args.out / 'report.md'}"
    )


if __name__ == "__main__":
    main()
