"""Command line: `sluice plan` (the offline planner), `sluice operator` (run the operator: kopf), `sluice crd`
(print the CRD), `sluice reference` (print the field reference) and `sluice bench` (the routing benchmark).

`sluice plan -f POOL.yaml --observed OBSERVED.yaml [--state STATE.json] [--now ISO] [--state-out FILE]` runs one
reconcile pass offline: the Istio objects go to stdout as a YAML stream, the explanation table to stderr. The
state is the pool's status (exactly what the operator keeps in the cluster), so runs can be chained.
Exit codes: 0 planned, 2 invalid input (the message names the field and the rule), 1 anything else.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from sluice.api.crd import crd_yaml
from sluice.api.errors import format_validation_error
from sluice.api.memory import readable
from sluice.api.reference import render_reference
from sluice.api.status import read_status
from sluice.api.v1alpha1 import InferencePool, InferencePoolStatus
from sluice.core.compact import stored_form
from sluice.core.events import Event
from sluice.core.observed import Observed
from sluice.core.presets import build_queries
from sluice.core.reconcile import plan_pass
from sluice.explain import endpoint_table, scoring_line, summary
from sluice.istio.objects import PoolRef
from sluice.istio.render import render
from sluice.runtime.config import OperatorConfig


class InputError(Exception):
    """Bad input: exit 2 with this message."""


def load_yaml(path: str) -> Any:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        return yaml.safe_load(text)
    except OSError as failure:
        raise InputError(f"cannot read {path}: {failure.strerror}") from failure
    except yaml.YAMLError as failure:
        raise InputError(f"{path} is not valid YAML: {failure}") from failure


def parse_pool(document: Any) -> InferencePool:
    if not isinstance(document, dict):
        raise InputError("the pool file must hold one InferencePool object")
    name = str((document.get("metadata") or {}).get("name", ""))
    try:
        pool = InferencePool.model_validate({**document, "status": None})
    except ValidationError as failure:
        raise InputError(format_validation_error("InferencePool", name, failure)) from failure
    return pool.model_copy(update={"status": _lenient_status(document.get("status"), "the pool's status")})


def _lenient_status(raw: Any, where: str) -> InferencePoolStatus | None:
    """A stored status as far as this version can read it; what it cannot read is dropped and said."""
    if raw is not None and not isinstance(raw, dict):
        raise InputError(f"{where} must be a mapping")
    status, problems = read_status(raw)
    status, unreadable = readable(status)
    for problem in [*problems, *unreadable]:
        sys.stderr.write(f"warning: {where}: {problem}\n")
    return status


def parse_observed(document: Any) -> Observed:
    try:
        return Observed.model_validate(document or {})
    except ValidationError as failure:
        raise InputError(format_validation_error("Observed", "observed", failure)) from failure


def parse_state(path: str | None, pool: InferencePool) -> InferencePoolStatus | None:
    if path is None:
        return pool.status
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as failure:
        raise InputError(f"cannot use state {path}: {failure}") from failure
    return _lenient_status(data, f"state {path}")


def parse_now(text: str | None) -> datetime:
    if text is None:
        return datetime.now(UTC)
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as failure:
        raise InputError(f"--now {text!r} is not an ISO 8601 time") from failure
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _event_line(event: Event) -> str:
    return f"  {event.type:<7} {event.reason:<18} {event.message}"


def cmd_plan(args: argparse.Namespace) -> int:
    pool = parse_pool(load_yaml(args.file))
    observed = parse_observed(load_yaml(args.observed))
    previous = parse_state(args.state, pool)
    now = parse_now(args.now)
    meta = pool.metadata
    ref = PoolRef(meta.name, meta.namespace, meta.uid)
    plan = plan_pass(pool.spec, meta.generation, observed, previous, now, pool=ref.id)
    objects = render(ref, pool.spec, plan)
    if plan.publish:
        sys.stdout.write(yaml.safe_dump_all([obj.body for obj in objects], sort_keys=False))
    else:
        sys.stdout.write("# no routable pod: sluice leaves the mesh's objects as they are\n")
    err = sys.stderr
    err.write(f"InferencePool {meta.namespace}/{meta.name} at {now.isoformat()}\n")
    err.write(endpoint_table(plan.status.endpoints) + "\n")
    err.write(scoring_line(pool.spec.scoring) + "\n\n")
    err.write(summary(plan.status) + "\n")
    if plan.events:
        err.write("events:\n" + "\n".join(_event_line(e) for e in plan.events) + "\n")
    if args.show_queries:
        queries = build_queries(pool.spec, meta.namespace, [p.name for p in observed.pods], namespace_wide=True)
        err.write("queries (namespace-wide, shared by the namespace's pools; each keeps its own pods):\n")
        for signal, query in queries.queries.items():
            err.write(f"  {signal}: {query}\n")
        if queries.unsupported:
            err.write(f"  not provided by {pool.spec.engine}: {', '.join(queries.unsupported)}\n")
    if args.state_out:
        Path(args.state_out).write_text(
            json.dumps(stored_form(plan.status).model_dump(mode="json", by_alias=True, exclude_none=True), indent=2)
            + "\n"
        )
    return 0


def cmd_crd(_: argparse.Namespace) -> int:
    sys.stdout.write(crd_yaml())
    return 0


def cmd_reference(_: argparse.Namespace) -> int:
    sys.stdout.write(render_reference())
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, not {text}")
    return value


def operator_config(args: argparse.Namespace) -> OperatorConfig:
    return OperatorConfig(
        kubeconfig=args.kubeconfig,
        namespaces=tuple(args.namespace),
        metrics_port=args.metrics_port,
        metrics_address=args.metrics_address,
        pod_metrics=not args.no_pod_metrics,
        workers=args.workers,
        peering=args.peering,
        peering_lifetime=args.peering_lifetime,
        shards=args.shards,
        lease_namespace=args.lease_namespace or os.environ.get("POD_NAMESPACE") or "default",
        identity=args.identity,
        status_refresh=args.status_refresh,
        first_passes=args.first_passes,
    )


def configure_logging(level: str, json_logs: bool = False) -> None:
    """One handler on the root logger (kopf's: its text or JSON format, with the object a handler logs about),
    at `level` for every logger. `kopf.configure` sets the root level itself (INFO unless debug or quiet), so
    the level is set after it."""
    import logging  # noqa: PLC0415 - the offline commands need none of this

    import kopf  # noqa: PLC0415

    kopf.configure(
        verbose=level == "debug",
        quiet=level in ("warning", "error"),
        log_format=kopf.LogFormat.JSON if json_logs else kopf.LogFormat.FULL,
    )
    logging.getLogger().setLevel(getattr(logging, level.upper()))


def cmd_operator(args: argparse.Namespace) -> int:
    """Run the operator (kopf) in this process until interrupted."""
    config = operator_config(args)
    if config.shards < 1:
        raise InputError(f"--shards must be at least 1, not {config.shards}")
    if config.shards > 1 and config.peering:
        raise InputError("--shards and --peering exclude each other: with shards every replica is active")
    if config.kubeconfig:
        # kopf logs in on its own, from $KUBECONFIG; the operator's own client is given the file explicitly.
        os.environ["KUBECONFIG"] = config.kubeconfig
    import kopf  # noqa: PLC0415 - the offline commands need none of this

    from sluice.runtime.handlers import Runtime  # noqa: PLC0415 - importing registers the handlers

    configure_logging(args.log_level, args.json_logs)
    common: dict[str, Any] = {
        "clusterwide": not config.namespaces,
        "namespaces": list(config.namespaces),
        "liveness_endpoint": args.liveness,
        "memo": kopf.Memo(runtime=Runtime(config)),
    }
    if config.peering:
        # High availability: replicas share a KopfPeering; the highest priority acts, the others pause.
        # Equal priorities would pause everyone, so each replica draws its own unless one is given.
        priority = args.priority if args.priority is not None else random.randint(1, 1_000_000)
        kopf.run(standalone=False, peering_name=config.peering, priority=priority, **common)
    else:
        kopf.run(standalone=True, **common)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """The routing-quality benchmark (a tool: imports the simulation only when asked for)."""
    from sluice.bench.report import rerender, run  # noqa: PLC0415

    files = [Path(f) for f in args.scenario]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise InputError(f"no such scenario: {', '.join(missing)}")
    if args.from_results:
        stored = Path(args.from_results)
        if not stored.exists():
            raise InputError(f"--from-results: no such file: {stored}")
        print(rerender(stored, files, Path(args.out)))
        return 0
    run(files, Path(args.out), plots=not args.no_plots)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description=__doc__.splitlines()[0] if __doc__ else None)
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="run one reconcile pass offline")
    plan.add_argument("-f", "--file", required=True, help="InferencePool YAML ('-' for stdin)")
    plan.add_argument("--observed", required=True, help="OBSERVED YAML: pods and their signals")
    plan.add_argument("--state", help="previous status as JSON (default: the pool's own .status)")
    plan.add_argument("--state-out", help="write the new status (JSON) here, as the operator stores it")
    plan.add_argument("--now", help="time of the pass, ISO 8601 (default: now)")
    plan.add_argument("--show-queries", action="store_true", help="also print the PromQL the pool would run")
    plan.set_defaults(handler=cmd_plan)
    crd = commands.add_parser("crd", help="print the InferencePool CRD generated from the API models")
    crd.set_defaults(handler=cmd_crd)
    reference = commands.add_parser("reference", help="print the field reference (Markdown) generated from the CRD")
    reference.set_defaults(handler=cmd_reference)
    run = commands.add_parser("operator", help="run the operator against the cluster in KUBECONFIG (or in-cluster)")
    run.add_argument("-n", "--namespace", action="append", default=[], help="watch these namespaces (default: all)")
    run.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, in-cluster, ~/.kube/config)")
    run.add_argument("--liveness", help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    run.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    run.add_argument("--metrics-port", type=int, help="serve the operator's Prometheus metrics on this port")
    run.add_argument("--peering", help="KopfPeering name for high availability (several replicas, one active)")
    run.add_argument("--priority", type=int, help="this replica's peering priority (default: random)")
    run.add_argument("--metrics-address", default="0.0.0.0", help="address for the metrics endpoint")
    run.add_argument(
        "--workers",
        type=_positive,
        default=OperatorConfig.workers,
        help=f"threads running passes (default: {OperatorConfig.workers}; a pass mostly waits on the API server "
        "and Prometheus)",
    )
    run.add_argument(
        "--no-pod-metrics", action="store_true", help="no per-pod series on /metrics (large fleets: per-pool only)"
    )
    run.add_argument(
        "--peering-lifetime", type=int, default=15, help="seconds before a silent replica's peering record expires"
    )
    run.add_argument(
        "--shards",
        type=int,
        default=1,
        help="split the pools into N shards, each owned by one replica through a coordination.k8s.io Lease "
        "(replicas run standalone, no peering); 1: this process runs every pool, no Leases",
    )
    run.add_argument("--lease-namespace", help="namespace of the shard Leases (default: $POD_NAMESPACE or default)")
    run.add_argument(
        "--identity", help="holderIdentity in the shard Leases, unique per process (default: host, pid, random tag)"
    )
    run.add_argument(
        "--status-refresh",
        type=_seconds,
        default=30.0,
        help="seconds before a status whose observations alone moved (signals, scores, reasons) is written again; "
        "weights, states, the split and conditions are written at once (default: 30; 0: every pass)",
    )
    run.add_argument(
        "--first-passes",
        type=_positive,
        help="pools' first passes (at start, on a shard taken over) run at most this many at a time, the others "
        "waiting their turn (default: half the workers)",
    )
    run.add_argument("--json-logs", action="store_true", help="log as JSON lines")
    run.set_defaults(handler=cmd_operator)
    bench = commands.add_parser("bench", help="routing-quality benchmark: simulated fleets, strategies side by side")
    bench.add_argument("--scenario", action="append", required=True, help="scenario YAML (repeatable)")
    bench.add_argument("--out", default="out/bench", help="directory for results.json, report.md and plots")
    bench.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    bench.add_argument(
        "--from-results",
        help="re-render report.md from a stored results.json without simulating (labels from the scenario files)",
    )
    bench.set_defaults(handler=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.handler(args)
    except InputError as failure:
        sys.stderr.write(f"error: {failure}\n")
        return 2
    return code
