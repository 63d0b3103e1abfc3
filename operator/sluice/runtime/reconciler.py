"""One reconcile pass against the real world: parse, observe, plan (pure core), apply, write status, emit Events.

The only orchestration function; the kopf handlers call it in a worker thread and do nothing else. Failure
modes, each visible in the pool's status:
- the spec does not parse: `SpecValid=False` with the API-server-style message, an `InvalidSpec` Event, and no
  Istio object is touched;
- the stored status does not parse (written by another version): the unreadable parts are dropped and reported
  in a `StatusPartlyUnreadable` Event; the pool keeps running;
- Prometheus fails (or a Secret is missing): the core freezes weights (`MetricsAvailable=False`);
- an Istio object of the same name is not sluice's: it is left alone, `IstioSynced=False (ObjectNotManaged)`;
- the API rejects a write: `IstioSynced=False (WriteFailed)`, retried next pass;
- the pass itself raises: `Ready=False (ReconcileFailed)` with the error, and the exception goes on to kopf.
Events are derived from the status written before and the status written now (`sluice.core.events`), nowhere
else. State lives in the status; the in-memory copy of the last status written only covers the moments before
the watch delivers it back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from sluice.api.errors import format_validation_error
from sluice.api.v1alpha1 import InferencePool, InferencePoolSpec, InferencePoolStatus
from sluice.core import status as conditions
from sluice.core.events import Event, derive_events
from sluice.core.observed import Observed, SignalSnapshot
from sluice.core.reconcile import Plan, plan_pass
from sluice.io.kube import KubeIO, WriteResult, observed_pod
from sluice.io.prometheus import PromAuth, PromIO
from sluice.istio.render import PoolRef, render

log = logging.getLogger("sluice")
HEARTBEAT = timedelta(seconds=60)


@dataclass
class PassReport:
    pool: str
    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    writes: list[WriteResult] = field(default_factory=list)
    status_written: bool = False
    seconds: float = 0.0
    result: str = "ok"
    prometheus_seconds: float | None = None
    signal_failures: dict[str, str] = field(default_factory=dict)


def _comparable(status: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in status.items() if k != "lastReconcileTime"}


class Reconciler:
    def __init__(self, kube: KubeIO, prom: PromIO) -> None:
        self.kube = kube
        self.prom = prom
        self._last_written: dict[str, dict[str, Any]] = {}

    def forget(self, uid: str) -> None:
        self._last_written.pop(uid, None)

    def _previous(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The newer of the status in the body and the one this process wrote last."""
        uid = body.get("metadata", {}).get("uid", "")
        mine, theirs = self._last_written.get(uid), body.get("status") or None
        if mine is None:
            return theirs
        if theirs is None:
            return mine
        return mine if str(mine.get("lastReconcileTime", "")) >= str(theirs.get("lastReconcileTime", "")) else theirs

    def run(self, body: dict[str, Any], now: datetime) -> PassReport:
        started = time.monotonic()
        meta = body.get("metadata", {})
        name, namespace = meta.get("name", ""), meta.get("namespace", "default")
        generation = meta.get("generation")
        previous, problems = conditions.read_status(self._previous(body))
        report = PassReport(pool=f"{namespace}/{name}", status={})
        if problems:
            report.events.append(Event("Warning", "StatusPartlyUnreadable", "; ".join(problems)[:1000]))
        try:
            pool = InferencePool.model_validate({**body, "status": None})
        except ValidationError as failure:
            message = format_validation_error("InferencePool", name, failure)
            base = previous or InferencePoolStatus()
            status = conditions.with_condition(
                base, conditions.invalid_spec(message), generation, base.conditions, now
            ).model_copy(update={"last_reconcile_time": now})
            report.result = "invalid_spec"
            self._finish(report, body, previous, status, now)
            report.seconds = time.monotonic() - started
            return report
        try:
            status = self._reconcile(report, pool, previous, now)
        except Exception as failure:
            report.result = "error"
            base = previous or InferencePoolStatus()
            want = conditions.reconcile_failed(f"{type(failure).__name__}: {failure}"[:500])
            status = conditions.with_condition(base, want, generation, base.conditions, now)
            self._finish(report, body, previous, status.model_copy(update={"last_reconcile_time": now}), now)
            raise
        self._finish(report, body, previous, status, now)
        report.seconds = time.monotonic() - started
        return report

    def _reconcile(
        self, report: PassReport, pool: InferencePool, previous: InferencePoolStatus | None, now: datetime
    ) -> InferencePoolStatus:
        spec, meta = pool.spec, pool.metadata
        pods = [observed_pod(p) for p in self.kube.list_pods(meta.namespace, spec.selector.match_labels)]
        queried = time.monotonic()
        signals = self._signals(spec, meta.namespace, [p.name for p in pods], now)
        report.prometheus_seconds = time.monotonic() - queried
        report.signal_failures = dict(signals.failed)
        plan = plan_pass(spec, meta.generation, Observed(pods=pods, signals=signals), previous, now)
        synced = conditions.NOTHING_TO_PUBLISH
        if plan.publish:
            synced = self._publish(report, PoolRef(meta.name, meta.namespace, meta.uid), spec, plan)
        before = previous.conditions if previous else []
        return conditions.with_condition(plan.status, synced, meta.generation, before, now)

    def _signals(self, spec: InferencePoolSpec, namespace: str, pods: list[str], now: datetime) -> SignalSnapshot:
        try:
            auth = self._auth(spec, namespace)
        except LookupError as missing:
            return SignalSnapshot(collected_at=now, failed={"credentials": str(missing)})
        return self.prom.read_signals(spec, namespace, pods, auth, now)

    def _auth(self, spec: InferencePoolSpec, namespace: str) -> PromAuth:
        auth = spec.metrics.auth
        if auth is None:
            return PromAuth()
        token = ca = None
        if auth.bearer_token_secret_ref is not None:
            ref = auth.bearer_token_secret_ref
            token = self.kube.read_secret_key(namespace, ref.name, ref.key).strip()
        if auth.ca_secret_ref is not None:
            ref = auth.ca_secret_ref
            ca = self.kube.read_secret_key(namespace, ref.name, ref.key)
        return PromAuth(bearer_token=token, ca_pem=ca, insecure_skip_verify=auth.insecure_skip_verify)

    def _publish(self, report: PassReport, ref: PoolRef, spec: InferencePoolSpec, plan: Plan) -> conditions.Want:
        refused: list[str] = []
        failed: list[str] = []
        for desired in render(ref, spec, plan):
            try:
                result = self.kube.sync_object(desired, ref.uid, spec.routing.adopt_existing)
            except ApiException as failure:
                failed.append(f"{desired['kind']} {desired['metadata']['name']}: {failure.status} {failure.reason}")
                continue
            report.writes.append(result)
            if result.action == "refused":
                refused.append(result.message)
        written = sum(1 for w in report.writes if w.action in ("created", "updated"))
        return conditions.istio_synced(refused, failed, written, len(report.writes))

    def _finish(
        self,
        report: PassReport,
        body: dict[str, Any],
        previous: InferencePoolStatus | None,
        status: InferencePoolStatus,
        now: datetime,
    ) -> None:
        meta = body.get("metadata", {})
        namespace, name = meta.get("namespace", "default"), meta.get("name", "")
        report.events.extend(derive_events(previous, status))
        wire = status.model_dump(mode="json", by_alias=True, exclude_none=True)
        report.status = wire
        last_wire = self._previous(body) or {}
        last = last_wire.get("lastReconcileTime")
        stale = last is None or now - datetime.fromisoformat(str(last).replace("Z", "+00:00")) >= HEARTBEAT
        if _comparable(wire) != _comparable(last_wire) or stale:
            self.kube.write_status(namespace, name, wire)
            self._last_written[meta.get("uid", "")] = wire
            report.status_written = True
        for event in report.events:
            try:
                self.kube.emit_event(namespace, name, meta.get("uid"), event)
            except ApiException as failure:
                log.warning("could not emit event %s: %s", event.reason, failure.reason)
