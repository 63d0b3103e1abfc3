"""The operator's settings, frozen, built once from the command line (`sluice.cli`) and handed to the kopf
handlers through kopf's `memo` — nothing reads the environment at import time."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorConfig:
    kubeconfig: str | None = None
    namespaces: tuple[str, ...] = ()
    """Namespaces to watch; empty: the whole cluster."""
    metrics_port: int | None = None
    metrics_address: str = "0.0.0.0"
    peering: str | None = None
    """KopfPeering name (high availability); None: standalone."""
    workers: int = 16
    """Worker threads running passes (each pass blocks one on its HTTP calls); the Kubernetes client keeps as many
    connections open, so no call waits for a new TLS handshake. 16: under an API server answering at p50 0.3 s,
    8 per replica let pools of 300 over 2 replicas go 45–87 s without a pass (docs/faults.md, `make chaos-scale`)."""
    pod_metrics: bool = True
    """Per-pod series (`sluice_endpoint_weight{pod}`) on /metrics; off: per-pool series only."""
    peering_lifetime: int = 15
    """Seconds after which a replica that stopped refreshing its peering record is replaced."""
    shards: int = 1
    """Pools split by a stable hash of namespace/name, each shard owned by one replica through a Lease; 1: no
    Leases, this process runs every pool."""
    lease_namespace: str = "default"
    """Namespace of the shard Leases (the operator's own)."""
    status_refresh: float = 30.0
    """Seconds: a status whose observations alone moved (signals, scores, reasons) is written once the stored
    one is this old; decisions (weights, states, the split, conditions) are written at the pass that makes them.
    0: every pass whose status changed."""
    identity: str | None = None
    """holderIdentity in the Leases (default: pod name and pid, with a random suffix)."""
    first_passes: int | None = None
    """Pools' first passes (at start, or when a shard is taken over) running at most at a time, the others waiting
    their turn (`sluice.core.admission`); None: half the workers (at least 1), the other half left to the pools
    already passing."""

    @property
    def first_pass_limit(self) -> int:
        return self.first_passes if self.first_passes is not None else max(1, self.workers // 2)

    @property
    def first_pass_delay(self) -> float:
        """With peering, replicas exchange records at start; the first pass waits so a lower-priority replica
        has paused before it could write (otherwise two replicas starting together both act once)."""
        return 5.0 if self.peering else 0.0
