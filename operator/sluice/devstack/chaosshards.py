"""The chaos matrix's sharded scene: two operator replicas (`--shards`), each reaching the API emulator through a
TCP proxy of its own, and the cases only they can show — a replica partitioned from the API server while the
other keeps it, a replica whose wall clock is shifted — with invariant (e), no write outside a shard term, judged
in every case over the Lease versions and the audit log.

Local-stack tool, run by `python -m sluice.devstack.chaos --sharded` (`make chaos-shards`). The scene: one local
stack, `SHARDS` shards, one pool per shard (`spread_pools`), the first mid-canary as the single-replica scene's
`llama` is, load on every pool; replica `a` and replica `b` started with `--shards`, `--lease-namespace` and
`--identity replica-a|b`, each with a kubeconfig that names its own `sluice.devstack.tcpproxy.TcpProxy`.
Replica `b` runs under libfaketime (PyPI `libfaketime`, the test extra: its vendored `libfaketime.so.1` preloaded)
with its wall clock read from a file (`FAKETIME_TIMESTAMP_FILE`, re-read every second) holding `+0` until a skew
case writes `+30s` or `-30s` into it: the running process sees its clock step, as it would after an NTP step,
and monotonic time is left alone (`FAKETIME_DONT_FAKE_MONOTONIC`). Each case: inject, hold, clear, wait for the
pools to resume (`sluice.devstack.chaos.RESUMED`, over both replicas' /metrics) and for the shards to be shared
evenly again, then judge (a)–(d), (f) (`sluice.devstack.chaoschecks`) and (e) (`sluice.devstack.shardevidence`).
`run`'s `broken` runs replica `a` by another command (an operator with a defect put in, as
`tests/e2e/broken_operator.py` runs one) and makes every case act on it: a checker is then shown to find the defect.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import urllib.parse
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from sluice.api.jsontypes import JsonObject
from sluice.core.shards import shard_lease_name, shard_of
from sluice.devstack.chaos import (
    CANARY_STEP,
    INTERVAL,
    ONE_PASS,
    RESUME_WAIT,
    WATCHED,
    Before,
    Resumption,
    back,
    case_result,
    counters,
    events,
    pool_manifest,
    published,
    wait,
)
from sluice.devstack.chaoschecks import Window, canary_state, case_violations, condition_states
from sluice.devstack.chaosreport import CaseResult
from sluice.devstack.invariants import audit_writes, lease_records
from sluice.devstack.kubelet import PodSpec
from sluice.devstack.loop import Background
from sluice.devstack.recorder import Recorder
from sluice.devstack.shardevidence import (
    balanced_at,
    hand_overs,
    lease_of_pool,
    median_offset,
    merged_readings,
    renew_offsets,
    shard_transitions,
    spread_pools,
    term_violations,
)
from sluice.devstack.stack import Stack, free_port
from sluice.devstack.tcpproxy import TcpProxy
from sluice.devstack.traffic import Traffic
from sluice.io.kubereads import load_api_client

SHARDS = 4
REPLICAS = ("a", "b")
RATE, CANARY_RATE = 3.0, 6.0
"""Requests per second of load on each pool, and on the canary's (the single-replica scene's canary rate: at 3
requests/s its candidate's share at 25 % made too few requests in an analysis interval for a check to pass)."""
WARM_UP = 20.0
BALANCE_WAIT = 60.0
"""Seconds the runner waits after a case for the shards to be shared evenly again."""
TERM_SLACK = 0.5
"""(e)'s allowance for the recorder's stamping of the audit file (read every 0.05 s)."""
SKEW = 30.0
NAMESPACE = "llm"
POOLS = spread_pools(NAMESPACE, SHARDS)
CANARY, INCIDENT = POOLS[0], POOLS[1]
FAILING_RATE = 0.6
SCENE = (
    f"{len(POOLS)} pools, one per shard of {SHARDS} (`--shards {SHARDS}`), at a {INTERVAL:g} s interval, each with "
    f"an A100 and an RTX 4090 pod under {RATE:g} requests/s; `{CANARY}` mid-canary (and a v2 pod, stepped by 5 % "
    f"every {CANARY_STEP:g} s from 20 %, {CANARY_RATE:g} requests/s), `{INCIDENT}` mid-incident (and a second "
    f"A100; its 4090 fails {FAILING_RATE:.0%} of its requests); replicas `replica-a` and `replica-b` (`--shards "
    f"{SHARDS} --lease-namespace {NAMESPACE} --identity replica-X`), each through its own TCP proxy to the API "
    "emulator and under libfaketime (clock offset `+0` but in the skew cases). Each case acts on the replica holding "
    "the canary's shard when it begins, so that its canary's progress is judged across the case"
)


def faketime_env(clock_file: Path) -> dict[str, str]:
    """The environment that runs a process under the vendored libfaketime, its wall clock offset by what
    `clock_file` holds (`+0`, `+30s`, `-30s`; re-read every second), its monotonic clock untouched."""
    found = importlib.util.find_spec("libfaketime")
    if found is None or found.origin is None:
        raise RuntimeError("libfaketime is not installed: it is in the test extra (`make venv`)")
    library = Path(found.origin).parent / "vendor" / "libfaketime" / "src" / "libfaketime.so.1"
    if not library.exists():
        raise RuntimeError(f"libfaketime's library not found at {library}")
    return {
        "LD_PRELOAD": str(library),
        "FAKETIME_TIMESTAMP_FILE": str(clock_file),
        "FAKETIME_CACHE_DURATION": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "DONT_FAKE_MONOTONIC": "1",  # the name libfaketime before 0.9.10 reads
    }


@dataclass
class Replica:
    name: str
    proxy: TcpProxy
    kubeconfig: Path
    port: int
    """Its /metrics, read directly (not through the proxy)."""
    log: Path
    clock_file: Path
    """The file its wall clock's offset is read from (libfaketime)."""
    program: tuple[str, ...] = (sys.executable, "-m", "sluice")
    """The command that runs it, its arguments after it: the operator, or one with a defect put in."""
    processes: list[int] = field(default_factory=list)

    @property
    def identity(self) -> str:
        return f"replica-{self.name}"


@dataclass
class ShardScene:
    stack: Stack
    recorder: Recorder
    replicas: dict[str, Replica]
    wall_minus_mono: float
    """The runner's wall clock minus its monotonic clock: the evidence's `at` on the emulator's wall clock."""
    identities: dict[str, str] = field(default_factory=dict)
    """The process part of a replica's user agent (`<HOSTNAME>-<pid>`) -> its identity, for the audit."""
    target: str = ""
    """The replica the case acts on (the canary's holder when it began, or `acts_on`)."""
    acts_on: str | None = None
    """The replica every case acts on (the one with a defect put in); None: the canary's holder."""


def proxy_kubeconfig(source: Path, target: Path, port: int) -> Path:
    """The stack's kubeconfig with its server moved to the proxy's port (same host: the certificate still fits)."""
    config = yaml.safe_load(source.read_text())
    for cluster in config["clusters"]:
        server = urllib.parse.urlsplit(cluster["cluster"]["server"])
        cluster["cluster"]["server"] = urllib.parse.urlunsplit(server._replace(netloc=f"127.0.0.1:{port}"))
    target.write_text(yaml.safe_dump(config))
    return target


def start_replica(scene: ShardScene, name: str) -> None:
    replica = scene.replicas[name]
    command = [*replica.program, "operator", "-n", NAMESPACE, "--kubeconfig", str(replica.kubeconfig)]
    command += ["--shards", str(SHARDS), "--lease-namespace", NAMESPACE, "--identity", replica.identity]
    command += ["--metrics-port", str(replica.port), "--metrics-address", "127.0.0.1"]
    env = {"HOSTNAME": f"node-{name}"}  # its user agent: sluice-operator/node-<name>-<pid>
    env.update(faketime_env(replica.clock_file))
    process = scene.stack.spawn(command, replica.log.name, kubeconfig=replica.kubeconfig, env=env)
    replica.processes.append(process.pid)
    scene.identities[f"node-{name}-{process.pid}"] = replica.identity


# ------------------------------------------------------------------------------------ readings


def readings(scene: ShardScene) -> dict[str, float]:
    """Both replicas' /metrics as one (`merged_readings`)."""
    return merged_readings([counters(r.port) for r in scene.replicas.values()])


def shard_leases(scene: ShardScene) -> dict[str, str | None]:
    """Shard Lease -> its holder, in the last version the recorder saw."""
    held: dict[str, str | None] = {}
    for seen in lease_records(scene.recorder.snapshot()):
        held[seen.lease] = seen.holder
    return held


def holds_all(scene: ShardScene, name: str) -> bool:
    held = shard_leases(scene)
    return len(held) == SHARDS and all(h == scene.replicas[name].identity for h in held.values())


def balanced(scene: ShardScene) -> bool:
    """Every shard held, each replica holding as many."""
    held, names = shard_leases(scene), identities(scene)
    counts = [sum(1 for h in held.values() if h == r) for r in names]
    return len(held) == SHARDS and all(held.values()) and all(c == SHARDS // len(names) for c in counts)


def identities(scene: ShardScene) -> list[str]:
    return [r.identity for r in scene.replicas.values()]


def log_size(replica: Replica) -> int:
    return replica.log.stat().st_size if replica.log.exists() else 0


def log_since(replica: Replica, offset: int) -> str:
    with replica.log.open("rb") as handle:
        handle.seek(offset)
        return handle.read().decode(errors="replace")


# ------------------------------------------------------------------------------------ the cases


@dataclass(frozen=True)
class ShardCase:
    name: str
    fault: str
    hold: float
    """Seconds held at most (the partition: until the other replica holds every shard, plus two intervals)."""
    inject: Callable[[ShardScene], None]
    clear: Callable[[ShardScene], dict[str, int]]
    until: Callable[[ShardScene], bool] | None = None
    """Held until this holds (then two more intervals), `hold` at most; None: held `hold`."""
    fast: bool = False
    fast_hold: float = 20.0


def canary_holder(scene: ShardScene) -> str:
    """The replica holding the canary pool's shard now."""
    lease = shard_lease_name("sluice", shard_of(NAMESPACE, CANARY, SHARDS), SHARDS)
    holder = shard_leases(scene).get(lease)
    return next(name for name, r in scene.replicas.items() if r.identity == holder)


def acted_on(scene: ShardScene) -> str:
    """The replica a case acts on: `acts_on` if set, else the one holding the canary's shard now."""
    return scene.acts_on or canary_holder(scene)


def other(scene: ShardScene) -> str:
    return next(name for name in scene.replicas if name != scene.target)


def partition(scene: ShardScene) -> None:
    scene.target = acted_on(scene)
    scene.replicas[scene.target].proxy.partition()


def heal(scene: ShardScene) -> dict[str, int]:
    proxy = scene.replicas[scene.target].proxy
    proxy.heal()
    return {"connections left hanging": proxy.counts.held}


def skew(seconds: float) -> Callable[[ShardScene], None]:
    def inject(scene: ShardScene) -> None:
        scene.target = acted_on(scene)
        set_clock(scene, f"{seconds:+.0f}s")

    return inject


def unskew(scene: ShardScene) -> dict[str, int]:
    set_clock(scene, "+0")
    return {}


def set_clock(scene: ShardScene, offset: str) -> None:
    scene.replicas[scene.target].clock_file.write_text(offset + "\n")


CASES = (
    ShardCase(
        "replica-partition",
        "the canary's replica's proxy drops every packet both ways (no connection accepted, open ones left hanging "
        "until their timeouts, what was sent meanwhile delivered on the heal unless its sender aborted it), held "
        "until the other replica holds every shard and two more intervals passed",
        60,
        partition,
        heal,
        until=lambda scene: holds_all(scene, other(scene)),
        fast=True,
        fast_hold=40.0,
    ),
    ShardCase(
        "clock-skew-ahead",
        f"the canary's replica's wall clock stepped {SKEW:+.0f} s, then back (libfaketime; monotonic time untouched)",
        30,
        skew(SKEW),
        unskew,
    ),
    ShardCase(
        "clock-skew-behind",
        f"the canary's replica's wall clock stepped {-SKEW:+.0f} s, then back (libfaketime; monotonic time untouched)",
        30,
        skew(-SKEW),
        unskew,
    ),
)


def read_before(scene: ShardScene) -> Before:
    pools = {p: scene.stack.pool(p) for p in POOLS}
    return Before(
        conditions={p: condition_states(body) for p, body in pools.items()},
        objects=published(scene.stack),
        counters=readings(scene),
        events=events(scene.stack),
        canary=canary_state(pools[CANARY]),
        logs={n: log_size(r) for n, r in scene.replicas.items()},
    )


def resumed(scene: ShardScene, before: Before, resumption: Resumption) -> bool:
    """`sluice.devstack.chaos.RESUMED` for every pool, over both replicas' /metrics."""
    return back(scene.stack, POOLS, readings(scene), before, resumption)


def hold(scene: ShardScene, case: ShardCase, seconds: float) -> None:
    if case.until is None:
        time.sleep(seconds)
        return
    end = time.monotonic() + seconds
    if wait(lambda: case.until is not None and case.until(scene), seconds) is not None:
        time.sleep(min(2 * INTERVAL, max(0.0, end - time.monotonic())))


def observed(scene: ShardScene, before: Before, started: float, cleared: float, ended: float) -> list[str]:
    """What the Leases, the replicas' logs and their clocks showed in the case."""
    evidence = scene.recorder.snapshot()
    records = lease_records(evidence)
    notes = []
    moves = [h for h in hand_overs(records) if started <= h.at < ended]
    if moves:
        parts = [
            f"{h.lease} {h.before or 'nobody'} → {h.after or 'nobody'} at {h.at - started:+.1f} s"
            + (f" ({h.at - cleared:+.1f} s from the end)" if h.at >= cleared else "")
            for h in moves
        ]
        notes.append("Lease hand-overs: " + "; ".join(parts))
    else:
        notes.append("Lease hand-overs: none")
    even = balanced_at(records, identities(scene), SHARDS, cleared)
    notes.append(
        "shards shared evenly again "
        + (f"{even - cleared:.1f} s after the fault's end" if even is not None else "**not within the wait**")
    )
    for name, replica in scene.replicas.items():
        logged = shard_transitions(log_since(replica, before.logs[name]))
        if logged:
            notes.append(
                f"{replica.identity} logged: "
                + ", ".join(f"{what} ×{n}" for (who, what), n in sorted(logged.items()) if who == replica.identity)
            )
        offsets = renew_offsets(evidence, replica.identity, scene.wall_minus_mono, started, cleared)
        offset = median_offset(offsets)
        notes.append(f"{replica.identity}'s renewTime − the emulator's clock during the fault: {offset}")
    return notes


def target_writes(
    scene: ShardScene,
    audit: list[tuple[float, JsonObject]],
    lease_of: Callable[[str, str], str | None],
    started: float,
    cleared: float,
    ended: float,
) -> str:
    """When the replica acted on last wrote to a pool during the fault, and first after it (the audit log)."""
    identity = scene.replicas[scene.target].identity
    writes = audit_writes(audit, scene.identities.values(), lease_of, scene.identities)
    ats = [w.at for w in writes if w.writer == identity]
    during = [at for at in ats if started <= at < cleared]
    after = [at for at in ats if cleared <= at < ended]
    last = f"{max(during) - started:+.1f} s" if during else "none"
    first = f"{min(after) - cleared:+.1f} s from the end" if after else "none"
    return (
        f"replica-{scene.target}'s pool writes (audit): the last during the fault at {last}, the first after it {first}"
    )


def run_case(scene: ShardScene, case: ShardCase, seconds: float) -> CaseResult:
    before = read_before(scene)
    started = time.monotonic()
    case.inject(scene)
    hold(scene, case, seconds)
    served = case.clear(scene)
    cleared, cleared_wall = time.monotonic(), time.time()
    resumption = Resumption(cleared_wall)
    resume = wait(lambda: resumed(scene, before, resumption), RESUME_WAIT)
    wait(lambda: balanced(scene), BALANCE_WAIT)
    time.sleep(INTERVAL)  # one more interval of evidence
    ended = time.monotonic()
    evidence = scene.recorder.snapshot()
    audit = list(scene.recorder.audit)
    window = Window(started, cleared, ended)
    entries = {p: f"sluice-{p}" for p in POOLS}
    violations, judged = case_violations(evidence, window, entries, ONE_PASS)
    lease_of = lease_of_pool(NAMESPACE, POOLS, SHARDS)
    outside, writes = term_violations(evidence, audit, scene.identities, lease_of, started, ended, TERM_SLACK)
    violations = {
        **{k: v for k, v in violations.items() if k != "f"},
        "e": outside,
        **({"f": violations["f"]} if "f" in violations else {}),
    }
    notes = [f"acted on replica-{scene.target}", *observed(scene, before, started, cleared, ended)]
    notes.append(f"(e) judged {writes} pool writes of the replicas against the shard Leases")
    notes.append(target_writes(scene, audit, lease_of, started, cleared, ended))
    return case_result(
        (case.name, case.fault),
        scene.stack,
        before,
        evidence,
        window,
        resume,
        readings(scene),
        served,
        (violations, judged),
        CANARY,
        observed=notes,
    )


# ------------------------------------------------------------------------------------ the run


def pods() -> list[PodSpec]:
    """Each pool's A100 and RTX 4090 (127.0.34.10N+1, +2), the canary's v2 A100 and the incident's second A100
    (+3); the incident pool's 4090 failing."""
    found = []
    for index, pool in enumerate(POOLS):
        base = 10 * index
        failing = FAILING_RATE if pool == INCIDENT else 0.0
        found += [
            PodSpec(f"{pool}-a100-0", "a100", "v1", f"127.0.34.{base + 1}", app=pool),
            PodSpec(f"{pool}-4090-0", "rtx4090", "v1", f"127.0.34.{base + 2}", app=pool, error_rate=failing),
        ]
        if pool == CANARY:
            found.append(PodSpec(f"{pool}-v2-a100-0", "a100", "v2", f"127.0.34.{base + 3}", app=pool))
        if pool == INCIDENT:
            found.append(PodSpec(f"{pool}-a100-1", "a100", "v1", f"127.0.34.{base + 3}", app=pool))
    return found


def setup(scene: ShardScene, background: Background, warm_up: float) -> None:
    stack = scene.stack
    for pod in pods():
        stack.add_pod(pod)
    for name in REPLICAS:
        start_replica(scene, name)
    for pool in POOLS:
        stack.kubectl("apply", "-f", "-", stdin=pool_manifest(pool, stack.prometheus_url, canary=pool == CANARY))
    for pool in POOLS:
        rate = CANARY_RATE if pool == CANARY else RATE
        background.start(Traffic(stack, pool, rate=rate).run(stack.remaining()))

    def healthy() -> bool:
        states = [condition_states(stack.pool(p)) for p in POOLS]
        return all(s.get(k, ("", ""))[0] == "True" for s in states for k in WATCHED) and balanced(scene)

    if wait(healthy, 180, every=1.0) is None:
        raise RuntimeError("the pools did not publish, or the shards were not shared, within 180 s: see the logs")
    time.sleep(warm_up)
    if wait(lambda: canary_state(stack.pool(CANARY)).startswith("Progressing"), 60, every=1.0) is None:
        raise RuntimeError(f"{CANARY}'s canary was not Progressing within 60 s")
    if wait(lambda: condition_states(stack.pool(INCIDENT)).get("Degraded", ("", ""))[0] == "True", 60, 1.0) is None:
        raise RuntimeError(f"{INCIDENT} did not show Degraded=True within 60 s: the run would not be mid-incident")


def run(workdir: Path, fast: bool, only: Collection[str] = (), broken: Sequence[str] = ()) -> list[CaseResult]:
    """The sharded cases (the fast ones, or those named in `only`) on one stack; the results in order. `broken`:
    the command that runs replica `a` in place of `python -m sluice` (an operator with a defect put in), every case
    then acting on `a`."""
    cases = [c for c in CASES if (c.fast or not fast) and (not only or c.name in only)]
    seconds = 300 + sum((c.fast_hold if fast else c.hold) + RESUME_WAIT / 2 + BALANCE_WAIT / 2 for c in cases)
    background = Background()
    stack = Stack(workdir, deadline_seconds=seconds).__enter__()
    background.start(stack.kubelet())
    proxies: list[TcpProxy] = []
    try:
        upstream = urllib.parse.urlsplit(stack.api_url)
        assert upstream.port is not None
        replicas = {}
        for name in REPLICAS:
            proxy = TcpProxy(("127.0.0.1", upstream.port), lifetime=seconds).__enter__()
            proxies.append(proxy)
            clock = workdir / f"clock-{name}"
            clock.write_text("+0\n")
            config = proxy_kubeconfig(stack.kubeconfig, workdir / f"kubeconfig-{name}", proxy.port)
            replica = Replica(name, proxy, config, free_port(), workdir / f"operator-{name}.log", clock)
            if broken and name == "a":
                replica.program = tuple(broken)
            replicas[name] = replica
        api = load_api_client(str(stack.kubeconfig))
        with Recorder(api, NAMESPACE, workdir / "audit.jsonl", seconds) as recorder:
            scene = ShardScene(
                stack, recorder, replicas, time.time() - time.monotonic(), acts_on="a" if broken else None
            )
            setup(scene, background, WARM_UP / 2 if fast else WARM_UP)
            results = [run_case(scene, c, c.fast_hold if fast else c.hold) for c in cases]
            evidence = workdir.parent / "evidence.jsonl"
            evidence.write_text("".join(json.dumps(asdict(v)) + "\n" for v in recorder.snapshot()))
            return results
    finally:
        for proxy in proxies:  # the replicas clear their Leases through them as they stop
            proxy.heal()
        background.call(stack.stop_kubelet)
        stack.close()
        background.close()
        for proxy in proxies:
            proxy.close()


__all__ = ["CASES", "POOLS", "SCENE", "SHARDS", "ShardCase", "faketime_env", "proxy_kubeconfig", "run"]
