"""`kubectl sluice`: the kubectl plugin for InferencePools (installed as `kubectl-sluice` with the package).

    kubectl sluice status POOL [-w]          the per-pod explanation and the rollout, live with -w
    kubectl sluice explain POOL POD          one pod: its verdict, signals, weight and why
    kubectl sluice plan POOL                 what a pass would do now, from the live pods and the last signals seen
    kubectl sluice doctor POOL [--prometheus URL]
                                             per signal: are the series the engine preset reads there, fresh, one
                                             per pod? (the operator's preflight, or asked of URL now); exit 1 if not
    kubectl sluice promote POOL [--force]    finish the rollout (after a passing check, or skipping analysis)
    kubectl sluice abort|retry|pause|resume|skip-step POOL

It uses the user's kubeconfig and context like any kubectl plugin (`--kubeconfig`, `--context`, `-n`), prints
errors as kubectl does (`error: ...` on stderr, exit 1). Operations are a one-shot annotation
(`sluice.api.operation`) that the operator applies once and records in `status.canary.lastOperation`; the plugin
waits for that record and prints it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException

from sluice.api.memory import remembered
from sluice.api.operation import OPERATION_ANNOTATION
from sluice.api.snapshot import PoolSnapshot, parse_snapshot
from sluice.api.v1alpha1 import GROUP, PLURAL, VERSION, Condition, InferencePoolStatus, SignalChecks
from sluice.core.mesh import PoolId
from sluice.core.observed import Observed, SignalSnapshot
from sluice.core.reconcile import plan_pass
from sluice.core.signalcheck import screen
from sluice.core.status import find
from sluice.core.verdicts import not_routable_because
from sluice.explain import checks_report, endpoint_table, summary
from sluice.io.kube import KubeCluster
from sluice.io.ports import PromAuth
from sluice.io.prometheus import PromIO

OPERATIONS = ("promote", "abort", "retry", "pause", "resume", "skip-step")


class PluginError(Exception):
    """Printed as kubectl prints errors; exit code 1."""


class Session:
    """The user's cluster, as their kubeconfig and context say."""

    def __init__(self, args: argparse.Namespace) -> None:
        try:
            contexts, active = k8s_config.list_kube_config_contexts(config_file=args.kubeconfig)
        except (k8s_config.ConfigException, OSError) as failure:
            raise PluginError(f"cannot read the kubeconfig: {failure}") from failure
        chosen = next((c for c in contexts if c["name"] == args.context), None) if args.context else active
        if chosen is None:
            raise PluginError(f'context "{args.context}" does not exist')
        configuration = k8s.Configuration()
        k8s_config.load_kube_config(
            config_file=args.kubeconfig, context=chosen["name"], client_configuration=configuration
        )
        self.api = k8s.ApiClient(configuration)
        self.custom = k8s.CustomObjectsApi(self.api)
        self.context = chosen["name"]
        self.user = chosen["context"].get("user", "unknown")
        self.namespace = args.namespace or chosen["context"].get("namespace") or "default"

    def pool(self, name: str) -> dict[str, Any]:
        try:
            return cast(
                dict[str, Any], self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)
            )
        except ApiException as failure:
            raise PluginError(_api_error(failure, name)) from failure


def _api_error(failure: ApiException, name: str) -> str:
    if failure.status == 404:
        return f'{PLURAL}.{GROUP} "{name}" not found'
    try:
        return str(json.loads(failure.body or "{}").get("message") or failure.reason)
    except json.JSONDecodeError:
        return f"{failure.status} {failure.reason}"


def _status(pool: dict[str, Any]) -> InferencePoolStatus:
    snapshot = parse_snapshot(pool)
    if snapshot.status is None:
        raise PluginError(f'InferencePool "{snapshot.meta.name}" has no status yet: is the operator running?')
    return snapshot.status


def render_status(pool: dict[str, Any]) -> str:
    status = _status(pool)
    meta = pool["metadata"]
    head = f"InferencePool {meta['namespace']}/{meta['name']}  last pass {status.last_reconcile_time}"
    return f"{head}\n{endpoint_table(status.endpoints)}\n\n{summary(status)}\n"


def cmd_status(session: Session, args: argparse.Namespace) -> int:
    sys.stdout.write(render_status(session.pool(args.pool)))
    if not args.watch:
        return 0
    seen = session.pool(args.pool)["metadata"]["resourceVersion"]
    stream = k8s_watch.Watch()
    deadline = time.monotonic() + args.timeout if args.timeout else None
    try:
        for event in stream.stream(
            session.custom.list_namespaced_custom_object,
            GROUP,
            VERSION,
            session.namespace,
            PLURAL,
            field_selector=f"metadata.name={args.pool}",
            resource_version=seen,
            timeout_seconds=int(args.timeout) if args.timeout else None,
        ):
            obj = event["object"]
            if event["type"] == "DELETED":
                raise PluginError(f'InferencePool "{args.pool}" was deleted')
            if obj.get("status"):
                sys.stdout.write("\n" + render_status(obj))
                sys.stdout.flush()
            if deadline is not None and time.monotonic() > deadline:
                break
    except KeyboardInterrupt:
        pass
    finally:
        stream.stop()
    return 0


def cmd_explain(session: Session, args: argparse.Namespace) -> int:
    status = _status(session.pool(args.pool))
    row = next((r for r in status.endpoints if r.pod == args.pod), None)
    if row is None:
        row = remembered(status).get(args.pod)
        if row is None:
            raise PluginError(f'pod "{args.pod}" is not in InferencePool "{args.pool}"')
        sys.stdout.write("(no row of its own in the status: its remembered state; signals: kubectl sluice plan)\n")
    fields = row.model_dump(mode="json", by_alias=True, exclude_none=True)
    signals = fields.pop("signals", {})
    width = max(len(k) for k in fields)
    lines = [f"{key.ljust(width)}  {value}" for key, value in fields.items()]
    lines.append("signals:" + "".join(f"\n  {k}: {v}" for k, v in signals.items()))
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def cmd_plan(session: Session, args: argparse.Namespace) -> int:
    pool = session.pool(args.pool)
    snapshot: PoolSnapshot = parse_snapshot(pool)
    if snapshot.spec is None:
        raise PluginError(snapshot.spec_error or "invalid spec")
    status = _status(pool)
    # The user's own request, named as theirs in audit logs (not as the operator's).
    cluster = KubeCluster(session.api, user_agent="kubectl-sluice")
    pods = cluster.pods(snapshot.meta.namespace, snapshot.spec.selector.match_labels)
    now = datetime.now(UTC)
    # The last observation is what the status recorded: the signals of each pod, as seen at the last pass.
    last = SignalSnapshot(
        collected_at=status.last_reconcile_time,
        pods={row.pod: row.signals for row in status.endpoints},
    )
    mesh = cluster.mesh(snapshot.meta.namespace, snapshot.spec)
    seen = Observed(pods=pods, signals=last, mesh=mesh)
    pool_id = PoolId(snapshot.meta.name, snapshot.meta.namespace)
    plan = plan_pass(snapshot.spec, snapshot.meta.generation, seen, status, now, pool=pool_id)
    before = {name: row.weight for name, row in remembered(status).items()}
    sys.stdout.write(f"what a pass would do now ({now.isoformat()}), from the live pods and the signals last seen:\n")
    if status.endpoint_summary is not None and status.endpoint_summary.listed < status.endpoint_summary.pods:
        sys.stdout.write(
            "(the status records signals only for the pods it lists; the others show their remembered weight, "
            "frozen: the operator's sluice_endpoint_weight metric has every pod's live weight)\n"
        )
    sys.stdout.write(endpoint_table(plan.status.endpoints) + "\n\n" + summary(plan.status) + "\n")
    changes = [
        f"  {r.pod}: {before.get(r.pod, 0)} -> {r.weight}"
        for r in plan.status.endpoints
        if before.get(r.pod, 0) != r.weight
    ]
    sys.stdout.write("weight changes:\n" + ("\n".join(changes) if changes else "  none") + "\n")
    return 0


def cmd_doctor(session: Session, args: argparse.Namespace) -> int:
    pool = session.pool(args.pool)
    if args.prometheus is None:
        status = _status(pool)
        if status.signal_checks is None:
            said = find(status.conditions, "SignalsReady")
            why = f" (SignalsReady={said.status} ({said.reason}): {said.message})" if said is not None else ""
            raise PluginError(f'InferencePool "{args.pool}" has no preflight in its status{why}')
        checks, ready = status.signal_checks, find(status.conditions, "SignalsReady")
        sys.stdout.write(f"the operator's preflight (status.signalChecks) of {session.namespace}/{args.pool}:\n")
    else:
        checks, ready = _doctor_now(session, pool, args)
        sys.stdout.write(f"asked {args.prometheus} now for {session.namespace}/{args.pool}:\n")
    sys.stdout.write(checks_report(checks, ready))
    return 0 if ready is not None and ready.status == "True" else 1


def _doctor_now(session: Session, pool: dict[str, Any], args: argparse.Namespace) -> tuple[SignalChecks, Condition]:
    """The preflight run here against the Prometheus the user names (a port-forward, say), with the pool's own
    settings and its live pods: what the operator would find, without waiting for it."""
    snapshot = parse_snapshot(pool)
    if snapshot.spec is None:
        raise PluginError(snapshot.spec_error or "invalid spec")
    metrics = snapshot.spec.metrics.model_copy(update={"prometheus_url": args.prometheus.rstrip("/")})
    spec = snapshot.spec.model_copy(update={"metrics": metrics})
    cluster = KubeCluster(session.api, user_agent="kubectl-sluice")
    pods = cluster.pods(snapshot.meta.namespace, spec.selector.match_labels)
    token = Path(args.bearer_token_file).read_text().strip() if args.bearer_token_file else None
    auth = PromAuth(bearer_token=token, insecure_skip_verify=args.insecure_skip_tls_verify)
    now = datetime.now(UTC)
    io = PromIO(max_workers=8)
    try:
        signals = io.read_signals(spec, snapshot.meta.namespace, [p.name for p in pods], auth, now)
    finally:
        io.close()
    if signals.failed:
        failures = "; ".join(f"{name}: {why}" for name, why in sorted(signals.failed.items()))
        raise PluginError(f"Prometheus at {args.prometheus} did not answer: {failures}")
    ready_pods = [p.name for p in pods if not not_routable_because(p)]
    screened = screen(spec, signals, ready_pods, now)
    if screened.checks is None:
        raise PluginError(f"engine {spec.engine} has no preset: nothing to check")
    status, reason, message = screened.ready
    condition = Condition(type="SignalsReady", status=status, reason=reason, message=message, last_transition_time=now)
    return screened.checks, condition


def cmd_operation(session: Session, args: argparse.Namespace) -> int:
    session.pool(args.pool)  # a clear "not found" first
    request = {"id": uuid.uuid4().hex[:16], "op": args.verb, "force": bool(getattr(args, "force", False))}
    request["by"] = f"{session.user}@{session.context}"
    patch = {"metadata": {"annotations": {OPERATION_ANNOTATION: json.dumps(request, separators=(",", ":"))}}}
    try:
        session.custom.patch_namespaced_custom_object(GROUP, VERSION, session.namespace, PLURAL, args.pool, patch)
    except ApiException as failure:
        raise PluginError(_api_error(failure, args.pool)) from failure
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline:
        status = parse_snapshot(session.pool(args.pool)).status
        record = status.canary.last_operation if status and status.canary else None
        if record is not None and record.id == request["id"]:
            forced = " (forced: analysis skipped)" if record.forced else ""
            line = f"inferencepool.{GROUP}/{args.pool} {args.verb}: {record.result.lower()}{forced}: {record.message}\n"
            if record.result != "Applied":
                raise PluginError(line.strip())
            sys.stdout.write(line)
            return 0
        time.sleep(0.5)
    raise PluginError(
        f"{args.verb} requested, but the operator did not act on it within {args.wait:g}s (is it running?)"
    )


def build_parser() -> argparse.ArgumentParser:
    # kubectl's global flags go before or after the verb, so each verb parser knows them too (without defaults,
    # so a flag given before the verb is not reset by the verb's parser).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--kubeconfig", default=argparse.SUPPRESS, help="kubeconfig file (default: $KUBECONFIG)")
    common.add_argument("--context", default=argparse.SUPPRESS, help="kubeconfig context (default: the current one)")
    common.add_argument("-n", "--namespace", default=argparse.SUPPRESS, help="namespace (default: the context's)")
    parser = argparse.ArgumentParser(
        prog="kubectl sluice", description="Inspect and operate sluice InferencePools.", parents=[common]
    )
    verbs = parser.add_subparsers(dest="verb", required=True)
    status = verbs.add_parser("status", parents=[common], help="the per-pod explanation table and the rollout")
    status.add_argument("pool")
    status.add_argument("-w", "--watch", action="store_true", help="keep printing as the status changes")
    status.add_argument("--timeout", type=float, default=0, help="with -w: stop after this many seconds (0: never)")
    status.set_defaults(handler=cmd_status)
    explain = verbs.add_parser("explain", parents=[common], help="one pod: verdict, signals, weight and why")
    explain.add_argument("pool")
    explain.add_argument("pod")
    explain.set_defaults(handler=cmd_explain)
    plan = verbs.add_parser(
        "plan", parents=[common], help="what a pass would do now, from the live pods and the last signals seen"
    )
    plan.add_argument("pool")
    plan.set_defaults(handler=cmd_plan)
    doctor = verbs.add_parser(
        "doctor",
        parents=[common],
        help="per signal: are the series the preset reads there, fresh and one per pod, and what makes the engine "
        "export a missing one (exit 1 unless SignalsReady is True)",
    )
    doctor.add_argument("pool")
    doctor.add_argument(
        "--prometheus",
        metavar="URL",
        help="ask this Prometheus now (e.g. a port-forward) instead of reading the status",
    )
    doctor.add_argument("--bearer-token-file", metavar="FILE", help="with --prometheus: a bearer token to send")
    doctor.add_argument(
        "--insecure-skip-tls-verify", action="store_true", help="with --prometheus: do not verify its certificate"
    )
    doctor.set_defaults(handler=cmd_doctor)
    helps = {
        "promote": "finish the rollout now (after a passing check at this step)",
        "abort": "roll the candidate back now",
        "retry": "roll a rolled-back candidate out again from the first step",
        "pause": "hold the current step",
        "resume": "release a pause",
        "skip-step": "go to the next step now (after a passing check at this step)",
    }
    for verb in OPERATIONS:
        sub = verbs.add_parser(verb, parents=[common], help=helps[verb])
        sub.add_argument("pool")
        if verb in ("promote", "skip-step"):
            sub.add_argument("--force", action="store_true", help="skip analysis (recorded as forced)")
        sub.add_argument("--wait", type=float, default=30.0, help="seconds to wait for the operator's answer")
        sub.set_defaults(handler=cmd_operation)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for flag in ("kubeconfig", "context", "namespace"):  # given before the verb, after it, or not at all
        if not hasattr(args, flag):
            setattr(args, flag, None)
    try:
        session = Session(args)
        code: int = args.handler(session, args)
    except PluginError as failure:
        sys.stderr.write(f"error: {failure}\n")
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
