"""The fault cases of the chaos matrix: what each injects into the local stack, and how it is cleared.

Local-stack tool, run by `sluice.devstack.chaos`. A case's `inject` starts its fault, the runner holds it for the
case's duration, and `clear` ends it and returns what the injector counted (faults served). The faults are put
where a cluster makes them: the Kubernetes API emulator's fault plan (`/_faults`, matching only the operator's
requests: `sluice-operator/` and `kopf/` user agents, so the recorder and the runner's reads are not faulted),
the Prometheus fault proxy both pools read through (`sluice.devstack.promfaults`), the pods themselves (deleted
and created again, as a rolling restart does), another writer with kubectl, and the operator's process (SIGKILL).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sluice.api.jsontypes import JsonObject, JsonValue
from sluice.devstack.kubelet import PodSpec
from sluice.devstack.promfaults import Faults, ProxyThread
from sluice.devstack.recorder import Recorder
from sluice.devstack.stack import Stack
from sluice.devstack.traffic import Traffic

OPERATOR_AGENTS = ["sluice-operator/", "kopf/"]
"""The operator's requests: its Kubernetes client, and the watches and patches kopf makes for it."""


@dataclass
class Scene:
    """What the cases act on: the stack with its operator, the Prometheus fault proxy, the recorder."""

    stack: Stack
    proxy: ProxyThread
    recorder: Recorder
    canary_pool: str
    incident_pool: str
    renamed: dict[str, str] = field(default_factory=dict)
    """Pods replaced by the rolling restart: old name -> new name."""
    killed: dict[str, int] = field(default_factory=dict)
    """The operator process the kill case stopped: its `pid` and `returncode`."""
    data_plane: tuple[Traffic, ...] = ()
    """Each pool's load, sent through the routes it reads from sluice's objects (istiod and the proxies)."""


FAST_HOLD = 8.0
CANARY_STEP_HOLD = 35.0
"""Seconds istiod is held down: longer than the canary's step interval (30 s), so the rollout steps meanwhile."""
SERVED_CAP = 60.0
"""Seconds an `until_served` case is held at most, past its hold, for each of its rules to be served once."""


@dataclass(frozen=True)
class FaultCase:
    name: str
    fault: str
    hold: float
    """Seconds the fault is held in a full run (the fast run holds each for `FAST_HOLD`)."""
    inject: Callable[[Scene], None]
    clear: Callable[[Scene], dict[str, int]]
    fast: bool = False
    """Part of the bounded run (CI)."""
    fast_hold: float = FAST_HOLD
    """Seconds held in the bounded run."""
    operator_down: bool = False
    """No operator runs while the fault lasts: (f) judges the fault's span (the blind spans of the metrics are
    read from the evidence, for every case)."""
    until_blind: bool = False
    """Held until both pools show MetricsAvailable=False and each has run two more passes (`hold`, or
    `fast_hold`, caps the wait), rather than for a fixed time."""
    data_plane_blind: bool = False
    """The data plane stops reading sluice's objects (istiod down): the case reports what it sent meanwhile against
    what sluice published (`CaseResult.data_plane`)."""
    until_served: bool = False
    """API cases: held past `hold` until every rule of the plan was served at least once (`SERVED_CAP` caps the
    wait). A rule on every 12th request needs 12 of the operator's requests, and a pool whose weights do not
    change writes little: 8 s of a quiet steady state served none."""


# ------------------------------------------------------------------------------------ the API emulator


def install_plan(stack: Stack, rules: list[JsonObject]) -> None:
    """Replace the API emulator's fault plan, as a harness does: `kubectl replace --raw /_faults`."""
    stack.kubectl("replace", "--raw", "/_faults", "-f", "-", stdin=json.dumps({"seed": 7, "rules": rules}))


def served_by_rule(stack: Stack) -> dict[str, int]:
    status = json.loads(stack.kubectl("get", "--raw", "/_faults").stdout)
    return {str(rule["name"]): int(rule["served"]) for rule in status["rules"]}


def operator_only(rule: JsonObject) -> JsonObject:
    """The rule matching only the operator's requests (besides what its own `match` asks)."""
    given = rule.get("match")
    match: JsonObject = dict(given) if isinstance(given, dict) else {}
    match["userAgents"] = list[JsonValue](OPERATOR_AGENTS)
    return {**rule, "match": match}


def api_plan(*rules: JsonObject) -> Callable[[Scene], None]:
    def inject(scene: Scene) -> None:
        install_plan(scene.stack, [operator_only(rule) for rule in rules])

    return inject


def clear_api(scene: Scene) -> dict[str, int]:
    served = served_by_rule(scene.stack)
    install_plan(scene.stack, [])
    return served


LATENCY: JsonObject = {"name": "slow", "effect": {"type": "latency", "p50": 0.3, "p99": 2.0}}
THROTTLE: JsonObject = {"name": "apf-429", "every": 20, "effect": {"type": "throttle", "retryAfterSeconds": 1}}
BURST_500: JsonObject = {"name": "etcd-500", "every": 12, "burst": 3, "effect": {"type": "error", "code": 500}}
BURST_503: JsonObject = {"name": "shutdown-503", "every": 15, "burst": 3, "effect": {"type": "error", "code": 503}}
EXPIRE: JsonObject = {
    "name": "expire-410",
    "match": {"verbs": ["watch"]},
    "every": 2,
    "effect": {"type": "expireWatch"},
}
CLOSE: JsonObject = {
    "name": "close",
    "match": {"verbs": ["watch"]},
    "effect": {"type": "closeWatch", "afterSeconds": 3},
}
BLACKOUT: JsonObject = {"name": "all-503", "effect": {"type": "error", "code": 503}}


# ------------------------------------------------------------------------------------ Prometheus


def prom(faults: Faults) -> Callable[[Scene], None]:
    def inject(scene: Scene) -> None:
        scene.proxy.set_faults(faults)

    return inject


def clear_prom(scene: Scene) -> dict[str, int]:
    scene.proxy.set_faults(Faults())
    return {}


def partial(scene: Scene) -> None:
    """One healthy stable pod of each pool missing from every answer, as a scrape that missed targets leaves it."""
    first: dict[str, str] = {}
    for name, state in sorted(scene.stack.pods.items()):
        if not state.deleted and state.spec.revision == "v1" and state.spec.error_rate == 0:
            first.setdefault(state.spec.app, name)
    scene.proxy.set_faults(Faults(drop_pods=frozenset(first.values())))


# ------------------------------------------------------------------------------------ pods, writers, the operator


def rolling_restart(scene: Scene) -> None:
    """Each stable pod of the canary pool and each healthy pod of the incident pool replaced one by one: the new
    pod first (a surge of one), Ready, then the old one deleted, as a Deployment's rolling restart does."""
    stack = scene.stack
    live = [s for s in stack.pods.values() if not s.deleted and s.spec.error_rate == 0 and s.spec.revision == "v1"]
    for state in live:
        old = state.spec
        name = f"{old.name}-r{len(scene.renamed) + 1}"
        address = old.ip.rsplit(".", 1)[0] + f".{100 + len(scene.renamed)}"
        stack.add_pod(PodSpec(name, old.hardware, old.revision, address, app=old.app))
        end = time.monotonic() + 60
        while not stack.pods[name].ready and time.monotonic() < end:
            time.sleep(0.2)
        stack.delete_pod(old.name)
        scene.renamed[old.name] = name


def no_clear(_: Scene) -> dict[str, int]:
    return {}


def other_writer(scene: Scene) -> None:
    """Someone else edits sluice's DestinationRule and deletes its VirtualService and a ServiceEntry."""
    stack = scene.stack
    edit = json.dumps({"spec": {"trafficPolicy": {"loadBalancer": {"simple": "RANDOM"}}}})
    canary, incident = f"sluice-{scene.canary_pool}", f"sluice-{scene.incident_pool}"
    stack.kubectl("patch", "destinationrule", canary, "-n", stack.namespace, "--type", "merge", "-p", edit)
    stack.kubectl("delete", "virtualservice", canary, "-n", stack.namespace)
    stack.kubectl("delete", "serviceentry", incident, "-n", stack.namespace)


def kill_operator(scene: Scene) -> None:
    process = scene.stack.operator
    scene.stack.stop_operator(kill=True)
    if process is not None:
        scene.killed = {"pid": process.pid, "returncode": process.returncode}


KILLED = "killed by SIGKILL (exit -9)"
RESTARTED = "restarted (a new pid)"


def restart_operator(scene: Scene) -> dict[str, int]:
    """Start the operator again; what was served read from the processes: the killed one's return code, and
    whether the new one is another process."""
    process = scene.stack.start_operator()
    return {
        KILLED: int(scene.killed.get("returncode") == -signal.SIGKILL),
        RESTARTED: int(bool(scene.killed) and process.pid != scene.killed["pid"]),
    }


WITHHELD = "route reads withheld"


def istiod_down(scene: Scene) -> None:
    """The data plane stops reading sluice's objects: each pool's load keeps the routes it last read."""
    for traffic in scene.data_plane:
        traffic.withheld = 0
        traffic.pushes = False


def istiod_up(scene: Scene) -> dict[str, int]:
    for traffic in scene.data_plane:
        traffic.pushes = True
    return {WITHHELD: sum(t.withheld for t in scene.data_plane)}


CASES = (
    FaultCase(
        "api-5xx",
        "API 500 and 503 bursts: 3 requests in a row fail, every 12th (500) and every 15th (503) request",
        20,
        api_plan(BURST_500, BURST_503),
        clear_api,
        fast=True,
        until_served=True,
    ),
    FaultCase(
        "watch-drops",
        "every watch closed after 3 s, every 2nd resumed watch answered 410 Expired",
        20,
        api_plan(EXPIRE, CLOSE),
        clear_api,
        fast=True,
        until_served=True,
    ),
    FaultCase(
        "prom-outage",
        "Prometheus refuses connections (outage), held until both pools show MetricsAvailable=False and two "
        "more passes ran",
        60,
        prom(Faults(outage=True)),
        clear_prom,
        fast=True,
        fast_hold=60.0,  # a cap: answers younger than the pools' staleAfter (15 s) are still used
        until_blind=True,
    ),
    FaultCase(
        "operator-sigkill",
        "the operator SIGKILLed, restarted after the hold",
        10,
        kill_operator,
        restart_operator,
        fast=True,
        operator_down=True,
    ),
    FaultCase(
        "other-writer",
        "kubectl edits sluice's DestinationRule, deletes its VirtualService and a ServiceEntry",
        10,
        other_writer,
        no_clear,
        fast=True,
    ),
    FaultCase(
        "api-429", "API 429 with Retry-After: 1 on 5 % of requests (every 20th)", 30, api_plan(THROTTLE), clear_api
    ),
    FaultCase("api-latency", "API latency, p50 0.3 s, p99 2 s, on every request", 20, api_plan(LATENCY), clear_api),
    FaultCase(
        "prom-slow",
        "Prometheus answers 1.5 s late (the pool's query timeout is 2 s)",
        20,
        prom(Faults(latency=1.5)),
        clear_prom,
    ),
    FaultCase(
        "prom-timeout",
        "Prometheus never answers (queries time out), held until both pools show MetricsAvailable=False and two "
        "more passes ran",
        60,
        prom(Faults(hang=True)),
        clear_prom,
        until_blind=True,
    ),
    FaultCase("prom-partial", "one pod of each pool missing from every answer", 20, partial, clear_prom),
    FaultCase(
        "prom-error",
        "Prometheus answers every query with an error (HTTP 500, errorType `unavailable`), held until both pools "
        "show MetricsAvailable=False and two more passes ran",
        60,
        prom(Faults(error="unavailable")),
        clear_prom,
        until_blind=True,
    ),
    FaultCase(
        "rolling-restart",
        "model servers replaced one by one (new pod Ready, then the old one deleted)",
        0,
        rolling_restart,
        no_clear,
    ),
    FaultCase(
        "istiod-down",
        "istiod down: the data plane keeps the routes it last read from sluice's objects (as Envoy keeps the last "
        "configuration pushed) while sluice goes on writing them; held past one canary step",
        CANARY_STEP_HOLD,
        istiod_down,
        istiod_up,
        data_plane_blind=True,
    ),
    FaultCase(
        "api-blackout",
        "every request of the operator answered 503 (the operator cut off from the API)",
        20,
        api_plan(BLACKOUT),
        clear_api,
    ),
)


__all__ = [
    "CASES",
    "FAST_HOLD",
    "KILLED",
    "RESTARTED",
    "WITHHELD",
    "FaultCase",
    "Scene",
    "install_plan",
    "served_by_rule",
]
