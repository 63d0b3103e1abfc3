"""What one pass did, typed: read by the handlers (logs) and the operator's metrics. Pure data."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from sluice.api.v1alpha1 import InferencePoolStatus
from sluice.core.events import Event
from sluice.io.ports import WriteResult

PassResult = Literal["ok", "invalid_spec", "error"]
StatusOutcome = Literal["written", "failed", "deferred", "skipped"]
"""What became of a pass's status: written; due and its write failed; only its observations moved and the stored
status is younger than the refresh (written later); unchanged (`sluice_status_writes_total{result}`)."""


@dataclass
class PassReport:
    pool: str
    """namespace/name."""
    status: InferencePoolStatus | None = None
    """The status this pass computed (written, or not: unchanged, or only its observations moved)."""
    events: list[Event] = field(default_factory=list)
    writes: list[WriteResult] = field(default_factory=list)
    status_outcome: StatusOutcome = "skipped"
    seconds: float = 0.0
    result: PassResult = "ok"
    prometheus_seconds: float | None = None
    signal_failures: dict[str, str] = field(default_factory=dict)
    errors_asked_at: datetime | None = None
    """When the error-rate answer the pass read was asked."""

    @property
    def status_written(self) -> bool:
        return self.status_outcome == "written"

    @property
    def status_kept(self) -> bool:
        """The next pass builds on this pass's status (written, or not due); not when its write failed."""
        return self.status_outcome != "failed"
