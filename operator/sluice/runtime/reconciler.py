"""The one reconcile loop: observe through the ports, plan (pure core), publish, prune, write status, emit Events.

`Reconciler(cluster, signals)` runs for the operator (the Kubernetes and Prometheus adapters), for the unit tests
and the benchmark's simulation (the in-memory cluster), and for the real-Envoy benchmark (an EDS-file cluster).
The kopf handlers call `run` in a worker thread and do nothing else. Failure modes, each visible in the status:
- the spec does not parse: `SpecValid=False` with the API-server-style message, an `InvalidSpec` Event, and no
  Istio object is touched;
- the stored status does not parse (written by another version): the unreadable parts are dropped and reported
  in a `StatusPartlyUnreadable` Event; the pool keeps running;
- Prometheus fails (or a credential Secret is missing): the core freezes weights (`MetricsAvailable=False`);
- an Istio object of the same name is not sluice's: it is left alone, `IstioSynced=False (ObjectNotManaged)`;
- the cluster rejects a write (409, 422, 500, a timeout): `IstioSynced=False (WriteFailed)`, retried next pass;
- the pass itself raises: `Ready=False (ReconcileFailed)` with the error, and the exception goes on to kopf.
Status writes: a pass whose decisions (weights, states, incidents, the split, the conditions) differ from the
status stored writes at once; one whose observations alone moved (signals, scores, estimates, reasons, large
pools' compact memory) waits until the stored status is `status_refresh` old (30 s by default; 0: every pass),
and an unchanged status is written again after `HEARTBEAT`. The next pass builds on the last pass's status
either way (kept in this process; a write that fails is not kept). The stored status is always one whole pass
(`lastReconcileTime`): what it shows, that pass computed and published.
Ownership: each pass knows every object it renders; objects labelled for the pool that it no longer renders are
released (deleted, or given back when adopted). Events are derived from the status before and after
(`sluice.core.events`), nowhere else.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from sluice.api.memory import remembered
from sluice.api.snapshot import PoolSnapshot
from sluice.api.v1alpha1 import EndpointStatus, InferencePoolSpec, InferencePoolStatus
from sluice.core import status as conditions
from sluice.core.apiretry import Episode, next_episode, troubles
from sluice.core.compact import stored_form
from sluice.core.events import Event, derive_events
from sluice.core.mesh import PoolId
from sluice.core.observed import Observed, SignalSnapshot
from sluice.core.reconcile import Plan, plan_pass
from sluice.io.kubereads import Tally, tallied
from sluice.io.ports import Cluster, ClusterError, ObjectKey, PromAuth, SignalSource
from sluice.istio.objects import PoolRef
from sluice.istio.render import render
from sluice.istio.rendered import Rendered
from sluice.runtime.fence import PassFence
from sluice.runtime.report import PassReport

log = logging.getLogger("sluice")
HEARTBEAT = timedelta(seconds=60)
STATUS_REFRESH = timedelta(seconds=30)
OBSERVATIONS = frozenset(
    {
        "signals",
        "signals_sampled_at",
        "score",
        "reason",
        "ttft_estimate_seconds",
        "idle_ttft_seconds",
        "idle_ttft_samples",
        "learned_capacity",
        "saturated_batch",
        "rate_at_limit",
        "admission_share",
    }
)
"""A row's fields that move with every reading; a change of these alone waits for `status_refresh`."""


def _key(ref: PoolRef, obj: Rendered) -> ObjectKey:
    return ObjectKey(obj.kind, obj.name, None if obj.namespace == ref.namespace else obj.namespace)


def _elsewhere(plan: Plan) -> frozenset[str]:
    """Namespaces where the pool's EnvoyFilters are, or were at the previous pass."""
    before = plan.previous.mesh if plan.previous is not None else None
    return frozenset(plan.mesh.envoy_filter_namespaces) | frozenset(before.envoy_filter_namespaces if before else ())


def _stamp(status: InferencePoolStatus) -> float:
    return status.last_reconcile_time.timestamp() if status.last_reconcile_time else 0.0


def _newer(mine: InferencePoolStatus | None, theirs: InferencePoolStatus | None) -> InferencePoolStatus | None:
    if mine is None or theirs is None:
        return mine or theirs
    return mine if _stamp(mine) >= _stamp(theirs) else theirs


_NOT_DECISIONS = frozenset({"endpoints", "pod_memory", "endpoint_summary", "signal_checks", "admission"})
"""A stored status' fields that carry rows (their decisions are compared row by row, `_decisions`), and the
preflight's findings and the pool's refusal rates, which are observations (the SignalsReady and Shedding
conditions carry what they decide)."""
Decisions = tuple[tuple[tuple[str, object], ...], tuple[tuple[tuple[str, object], ...], ...]]


def _decisions(status: InferencePoolStatus) -> Decisions:
    """The decisions of a stored form, as plain tuples to compare: the status' own fields and every pod's row (a
    large pool's aggregated pods from its compact memory, whose weights are decisions too) without the observation
    fields. Field by field as pydantic's `==` compares models, without copying a model per row."""
    own = tuple((k, v) for k, v in status.__dict__.items() if k not in _NOT_DECISIONS)
    rows = tuple(
        tuple((k, v) for k, v in row.__dict__.items() if k not in OBSERVATIONS)
        for _, row in sorted(remembered(status).items())
    )
    return own, rows


@dataclass
class _Compared:
    """A status in the form it is stored in, without its pass time, for `_change`; kept for the status last
    written, which the next passes compare with (its stored form and decisions built once, not at every pass)."""

    status: InferencePoolStatus
    stored: InferencePoolStatus
    decisions: Decisions | None = None
    """`_decisions(stored)`, built when first needed."""

    @classmethod
    def of(cls, status: InferencePoolStatus, known: _Compared | None = None) -> _Compared:
        if known is not None and known.status is status:
            return known
        return cls(status, stored_form(status.model_copy(update={"last_reconcile_time": None})))

    def blanked(self) -> Decisions:
        if self.decisions is None:
            self.decisions = _decisions(self.stored)
        return self.decisions

    def written(self) -> InferencePoolStatus:
        """The status as written, with its pass time: a large pool's rows aggregated (`sluice.core.compact`)."""
        return self.stored.model_copy(update={"last_reconcile_time": self.status.last_reconcile_time})


def _change(a: _Compared | None, b: _Compared) -> str:
    """What writing `b` would change in what `a` stored (the pass time aside): "decisions", "observations" or
    "none"."""
    if a is None:
        return "decisions"
    if a.stored == b.stored:
        return "none"
    if a.blanked() != b.blanked():
        return "decisions"
    return "observations"


class Reconciler:
    def __init__(self, cluster: Cluster, signals: SignalSource, status_refresh: timedelta = STATUS_REFRESH) -> None:
        self.cluster = cluster
        self.signals = signals
        self.status_refresh = status_refresh
        self._last_written: dict[str, InferencePoolStatus] = {}
        """Pool uid -> the status this process stored last."""
        self._compared: dict[str, _Compared] = {}
        """Pool uid -> the stored status last compared with, in its stored form (`_Compared.of`)."""
        self._last_pass: dict[str, InferencePoolStatus] = {}
        """Pool uid -> the status of its last pass here whose status was stored or whose write was deferred (the
        memory the next pass builds on)."""
        self._rendered: dict[str, frozenset[ObjectKey]] = {}
        """Pool uid -> the objects its last publishing pass rendered (pruning lists the cluster only on change)."""
        self._api: dict[str, Episode] = {}
        """Pool uid -> the API trouble its passes here are meeting (`sluice.core.apiretry.next_episode`)."""
        self._read_at: dict[str, datetime] = {}
        """Pool uid -> when the error-rate answer its last completed pass read was asked (the same again:
        `repeated`). Kept only once the pass's status is stored, so a pass that failed does not use up a reading."""

    def written_at(self, uid: str) -> datetime | None:
        """When the status of the pool's last pass here (stored or deferred) was stamped (None: nothing
        remembered): a stored status no newer is this process's own, or older."""
        mine = self._last_pass.get(uid)
        return mine.last_reconcile_time if mine is not None else None

    def forget(self, uid: str) -> None:
        self._last_written.pop(uid, None)
        self._compared.pop(uid, None)
        self._last_pass.pop(uid, None)
        self._rendered.pop(uid, None)
        self._read_at.pop(uid, None)
        self._api.pop(uid, None)

    def _through(self, cluster: Cluster) -> Reconciler:
        """This reconciler for one pass whose calls go to `cluster`: the per-pool memory is the same, shared."""
        view = copy.copy(self)
        view.cluster = cluster
        return view

    def _stored(self, uid: str, snapshot: PoolSnapshot) -> InferencePoolStatus | None:
        """The status stored for the pool, as far as this process knows: the newer of its own last write and the
        one the watch delivered."""
        return _newer(self._last_written.get(uid), snapshot.status)

    def _previous(self, snapshot: PoolSnapshot) -> InferencePoolStatus | None:
        """The newer of the stored status and this process's last pass (the watch may lag behind, and a deferred
        write is stored nowhere else)."""
        return _newer(self._last_pass.get(snapshot.meta.uid or ""), snapshot.status)

    def run(self, snapshot: PoolSnapshot, now: datetime, fence: PassFence | None = None) -> PassReport:
        """One pass; with `fence` (a sharded replica), every write of the pass goes through it."""
        if fence is not None:
            return self._through(fence.around(self.cluster)).run(snapshot, now)
        with tallied() as tally:
            try:
                return self._run(snapshot, now, tally)
            finally:  # a pass that failed met its trouble too: the next one reports it
                self._note_api(snapshot, tally, now.timestamp())

    def _note_api(self, snapshot: PoolSnapshot, tally: Tally, at: float) -> None:
        """The pool's API trouble episode after the pass at `at` (Unix seconds: `next_episode`)."""
        if snapshot.spec is None:
            return
        uid, interval = snapshot.meta.uid or snapshot.meta.name, snapshot.spec.interval
        episode = next_episode(
            self._api.get(uid), troubles(tally.met, tally.seconds, tally.slowest, interval), at, interval
        )
        if episode is None:
            self._api.pop(uid, None)
        else:
            self._api[uid] = episode

    def _run(self, snapshot: PoolSnapshot, now: datetime, tally: Tally) -> PassReport:
        started = time.monotonic()
        meta = snapshot.meta
        previous = self._previous(snapshot)
        before = remembered(previous)  # its podMemory decoded once for the whole pass
        report = PassReport(pool=snapshot.key)
        if snapshot.status_problems:
            report.events.append(Event("Warning", "StatusPartlyUnreadable", "; ".join(snapshot.status_problems)[:1000]))
        base = previous or InferencePoolStatus()
        if snapshot.spec is None:
            want = conditions.invalid_spec(snapshot.spec_error or "invalid spec")
            status = conditions.with_condition(base, want, meta.generation, base.conditions, now)
            report.result = "invalid_spec"
            stamped = status.model_copy(update={"last_reconcile_time": now})
            self._finish(report, snapshot, previous, before, stamped, now)
        else:
            try:
                status = self._reconcile(report, snapshot, snapshot.spec, previous, before, now, tally)
            except Exception as failure:
                report.result = "error"
                want = conditions.reconcile_failed(f"{type(failure).__name__}: {failure}"[:500])
                failed = conditions.with_condition(base, want, meta.generation, base.conditions, now)
                stamped = failed.model_copy(update={"last_reconcile_time": now})
                self._finish(report, snapshot, previous, before, stamped, now)
                raise
            self._finish(report, snapshot, previous, before, status, now)
            if report.status_kept and report.errors_asked_at is not None:
                self._read_at[meta.uid or meta.name] = report.errors_asked_at
        report.seconds = time.monotonic() - started
        return report

    def _reconcile(
        self,
        report: PassReport,
        snapshot: PoolSnapshot,
        spec: InferencePoolSpec,
        previous: InferencePoolStatus | None,
        before: Mapping[str, EndpointStatus],
        now: datetime,
        tally: Tally,
    ) -> InferencePoolStatus:
        meta = snapshot.meta
        pods = self.cluster.pods(meta.namespace, spec.selector.match_labels)
        queried = time.monotonic()
        signals = self._read_signals(spec, meta.namespace, [p.name for p in pods], now)
        report.prometheus_seconds = time.monotonic() - queried
        # The error-rate answer this pass reads: the same one as the previous pass's is not a new observation.
        asked = signals.answered_at.get("errorRate")
        if asked is not None and self._read_at.get(meta.uid or meta.name) == asked:
            signals = signals.model_copy(update={"repeated": True})
        report.errors_asked_at = asked
        report.signal_failures = dict(signals.failed)
        observed = Observed(pods=pods, signals=signals, mesh=self.cluster.mesh(meta.namespace, spec))
        pool = PoolId(meta.name, meta.namespace)
        plan = plan_pass(spec, meta.generation, observed, previous, now, snapshot.operation, pool, before)
        synced = conditions.not_published(plan.mesh.refusal)
        if plan.publish:
            synced = self._publish(report, PoolRef(meta.name, meta.namespace, meta.uid), spec, plan)
        earlier = previous.conditions if previous else []
        status = conditions.with_condition(plan.status, synced, meta.generation, earlier, now)
        met = troubles(tally.met, tally.seconds, tally.slowest, spec.interval)
        episode = next_episode(self._api.get(meta.uid or meta.name), met, now.timestamp(), spec.interval)
        return conditions.with_condition(status, conditions.kube_api(episode), meta.generation, earlier, now)

    def _read_signals(self, spec: InferencePoolSpec, namespace: str, pods: list[str], now: datetime) -> SignalSnapshot:
        try:
            auth = self._auth(spec, namespace)
        except LookupError as missing:
            return SignalSnapshot(collected_at=now, failed={"credentials": str(missing)})
        return self.signals.read_signals(spec, namespace, pods, auth, now)

    def _auth(self, spec: InferencePoolSpec, namespace: str) -> PromAuth:
        auth = spec.metrics.auth
        if auth is None:
            return PromAuth()
        token = ca = None
        if auth.bearer_token_secret_ref is not None:
            ref = auth.bearer_token_secret_ref
            token = self.cluster.secret_key(namespace, ref.name, ref.key).strip()
        if auth.ca_secret_ref is not None:
            ref = auth.ca_secret_ref
            ca = self.cluster.secret_key(namespace, ref.name, ref.key)
        return PromAuth(bearer_token=token, ca_pem=ca, insecure_skip_verify=auth.insecure_skip_verify)

    def _publish(self, report: PassReport, ref: PoolRef, spec: InferencePoolSpec, plan: Plan) -> conditions.Want:
        refused: list[str] = []
        failed: list[str] = []
        desired = render(ref, spec, plan)
        for obj in desired:
            try:
                result = self.cluster.apply(obj, ref.uid, spec.routing.adopt_existing)
            except ClusterError as failure:
                failed.append(f"{obj.kind} {obj.name}: {failure.status} {failure.reason}")
                continue
            report.writes.append(result)
            if result.action == "refused":
                refused.append(result.message)
        keys = frozenset(_key(ref, obj) for obj in desired)
        if not failed:
            failed += self._prune(report, ref, keys, _elsewhere(plan))
        return conditions.istio_synced(refused, failed, len(desired))

    def _prune(
        self, report: PassReport, ref: PoolRef, keys: frozenset[ObjectKey], elsewhere: frozenset[str]
    ) -> list[str]:
        """Release what the pool owns and no longer renders; list the cluster only when the rendered set changed.
        EnvoyFilters in other namespaces are looked for where this pass and the previous status wrote them."""
        uid = ref.uid or ref.name
        if self._rendered.get(uid) == keys:
            return []
        try:
            stale = [key for key in self.cluster.owned(ref.namespace, ref.name, elsewhere) if key not in keys]
            for key in stale:
                report.writes.append(self.cluster.release(ref.namespace, key))
        except ClusterError as failure:
            return [f"pruning: {failure.status} {failure.reason}"]
        self._rendered[uid] = keys
        return []

    def _finish(
        self,
        report: PassReport,
        snapshot: PoolSnapshot,
        previous: InferencePoolStatus | None,
        rows: Mapping[str, EndpointStatus],
        status: InferencePoolStatus,
        now: datetime,
    ) -> None:
        meta = snapshot.meta
        report.status = status
        report.events.extend(derive_events(previous, status, rows))
        uid = meta.uid or ""
        stored = self._stored(uid, snapshot)
        before = None if stored is None else _Compared.of(stored, self._compared.get(uid))
        if before is not None:
            self._compared[uid] = before
        after = _Compared.of(status)
        change = _change(before, after)
        age = now - stored.last_reconcile_time if stored and stored.last_reconcile_time else None
        due = (
            age is None
            or change == "decisions"
            or (change == "observations" and age >= self.status_refresh)
            or age >= max(HEARTBEAT, self.status_refresh)
        )
        if due:
            try:
                self.cluster.write_status(meta.namespace, meta.name, after.written())
            except ClusterError as failure:
                log.warning("could not write the status of %s: %s", snapshot.key, failure)
                report.status_outcome = "failed"
            else:
                self._last_written[uid] = status
                self._compared[uid] = after
                report.status_outcome = "written"
        else:
            report.status_outcome = "deferred" if change == "observations" else "skipped"
        if report.status_kept:
            self._last_pass[uid] = status
        for event in report.events:
            try:
                self.cluster.emit(meta.namespace, meta.name, meta.uid, event)
            except ClusterError as failure:
                log.warning("could not emit event %s: %s", event.reason, failure.reason)
