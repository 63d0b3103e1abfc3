"""bench-scale's request counts from the emulator's audit log, and when its measured window may start."""

from __future__ import annotations

import json
import time
from pathlib import Path

from sluice.bench.scale import BENCH_AGENT, audit_counts, passing
from tests.helpers import FakePrometheus


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


def stamps(*ages: float) -> str:
    now = time.time()
    return "".join(
        f'sluice_last_pass_timestamp_seconds{{pool="bench/p{i}"}} {now - age}\n' for i, age in enumerate(ages)
    )


def test_the_window_waits_for_every_pool_to_pass_within_two_intervals() -> None:
    page = {"text": ""}
    # an operator's /metrics on loopback: the query server of the tests answers any path with the bytes given
    with FakePrometheus(lambda _: (200, page["text"].encode())) as operator:
        port = int(operator.url.rsplit(":", 1)[1])
        page["text"] = stamps(1.0, 4.0, 9.0)
        assert passing([port], 3, 5.0) is True
        page["text"] = stamps(1.0, 4.0, 11.0)  # one pool's last pass over two intervals old: a backlog
        assert passing([port], 3, 5.0) is False
        page["text"] = stamps(1.0, 4.0)  # a pool not passed at all yet
        assert passing([port], 3, 5.0) is False
        page["text"] = "sluice_passes_total 3\n"  # an operator without the gauge (a `--code` baseline)
        assert passing([port], 3, 5.0) is None
