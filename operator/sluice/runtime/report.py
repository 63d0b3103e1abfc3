"""What one pass did, typed: read by the handlers (logs) and the operator's metrics. Pure data."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from sluice.api.v1alpha1 import InferencePoolStatus
from sluice.core.events import Event
from sluice.io.ports import WriteResult

PassResult = Literal["ok", "invalid_spec", "error"]


@dataclass
class PassReport:
    pool: str
    """namespace/name."""
    status: InferencePoolStatus | None = None
    """The status this pass computed (written, or not: unchanged, or only its observations moved)."""
    events: list[Event] = field(default_factory=list)
    writes: list[WriteResult] = field(default_factory=list)
    status_written: bool = False
    status_deferred: bool = False
    """Only observations changed and the stored status is younger than the refresh: written later."""
    status_kept: bool = False
    """The next pass builds on this pass's status (written, or not due); False when the write failed."""
    status_failed: bool = False
    """The status was due and its write failed."""
    seconds: float = 0.0
    result: PassResult = "ok"
    prometheus_seconds: float | None = None
    signal_failures: dict[str, str] = field(default_factory=dict)
    errors_asked_at: datetime | None = None
    """When the error-rate answer the pass read was asked."""
