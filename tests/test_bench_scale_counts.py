"""bench-scale's request counts from the emulator's audit log."""

from __future__ import annotations

import json
from pathlib import Path

from sluice.bench.scale import BENCH_AGENT, audit_counts


def test_a_write_is_counted_once_though_the_audit_log_has_its_request_and_its_response(tmp_path: Path) -> None:
    entries = [
        {"verb": "get", "resource": "serviceentries", "subresource": "", "userAgent": "sluice-operator/x"},
        {"verb": "patch", "resource": "inferencepools", "subresource": "status", "userAgent": "sluice-operator/x"},
        {
            "stage": "ResponseComplete",
            "verb": "patch",
            "resource": "inferencepools",
            "subresource": "status",
            "userAgent": "sluice-operator/x",
            "code": "200",
        },
        {"verb": "list", "resource": "inferencepools", "subresource": "", "userAgent": BENCH_AGENT},
    ]
    log = tmp_path / "audit.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in entries))
    assert audit_counts(log, 0) == {"get serviceentries": 1, "patch inferencepools/status": 1}
