"""bench-scale's request counts from the emulator's audit log, and when its measured window may start."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.bench.scale import BENCH_AGENT, audit_counts, passing


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


class _Page(http.server.BaseHTTPRequestHandler):
    text = ""

    def do_GET(self) -> None:
        body = self.text.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def operator_page() -> Iterator[tuple[int, type[_Page]]]:
    """An operator's /metrics page on loopback, its text set by the test."""
    page = type("Page", (_Page,), {"text": ""})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], page
    finally:
        server.shutdown()
        server.server_close()


def stamps(*ages: float) -> str:
    now = time.time()
    return "".join(
        f'sluice_last_pass_timestamp_seconds{{pool="bench/p{i}"}} {now - age}\n' for i, age in enumerate(ages)
    )


def test_the_window_waits_for_every_pool_to_pass_within_two_intervals(
    operator_page: tuple[int, type[_Page]],
) -> None:
    port, page = operator_page
    page.text = stamps(1.0, 4.0, 9.0)
    assert passing([port], 3, 5.0) is True
    page.text = stamps(1.0, 4.0, 11.0)  # one pool's last pass over two intervals old: a backlog
    assert passing([port], 3, 5.0) is False
    page.text = stamps(1.0, 4.0)  # a pool not passed at all yet
    assert passing([port], 3, 5.0) is False
    page.text = "sluice_passes_total 3\n"  # an operator that does not export the gauge (a `--code` baseline)
    assert passing([port], 3, 5.0) is None
