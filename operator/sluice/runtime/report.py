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
    """The status this pass computed (written, or skipped because unchanged)."""
    events: list[Event] = field(default_factory=list)
    writes: list[WriteResult] = field(default_factory=list)
    status_written: bool = False
    seconds: float = 0.0
    result: PassResult = "ok"
    prometheus_seconds: float | None = None
    signal_failures: dict[str, str] = field(default_factory=dict)
    errors_asked_at: datetime | None = None
    """When the error-rate answer the pass read was asked."""
