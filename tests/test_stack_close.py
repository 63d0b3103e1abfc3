"""The local stack stops its clients before the servers they use (real processes, loopback only)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sluice.devstack.kubelet import PodSpec, PodState
from sluice.devstack.stack import Stack

SERVER = """
import socket, sys, time
listener = socket.create_server(("127.0.0.1", 0))
open(sys.argv[1], "w").write(str(listener.getsockname()[1]))
listener.settimeout(0.2)
end = time.monotonic() + 60
while time.monotonic() < end:
    try:
        listener.accept()[0].close()
    except TimeoutError:
        pass
"""

CLIENT = """
import signal, socket, sys, time
port = int(sys.argv[1])
def shutdown(*_):
    time.sleep(0.5)  # an operator finishing its pass and clearing its Leases
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        verdict = "server answered"
    except OSError as failure:
        verdict = f"server gone: {failure}"
    open(sys.argv[2], "w").write(verdict)
    sys.exit(0)
signal.signal(signal.SIGTERM, shutdown)
open(sys.argv[3], "w").write("ready")
time.sleep(60)
"""


def _wait_for(path: Path) -> str:
    end = time.monotonic() + 20
    while time.monotonic() < end:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path.name} never written")


def test_close_stops_the_clients_while_their_servers_still_answer(tmp_path: Path) -> None:
    stack = Stack(tmp_path)
    stack.spawn([sys.executable, "-c", SERVER, str(tmp_path / "port")], "server.log", service=True)
    port = _wait_for(tmp_path / "port")
    stack.spawn([sys.executable, "-c", CLIENT, port, str(tmp_path / "verdict"), str(tmp_path / "ready")], "client.log")
    _wait_for(tmp_path / "ready")
    stack.close()
    assert (tmp_path / "verdict").read_text() == "server answered"
    assert stack.processes == []


def test_a_kubelet_due_to_restart_a_server_as_the_stack_closes_ends_without_an_error(tmp_path: Path) -> None:
    """`close` can begin while the kubelet is between its check of the closing flag and a restart: the restart
    is refused (nothing starts once closing) and the kubelet ends quietly, not with that refusal."""
    stack = Stack(tmp_path)
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    exited.wait(timeout=20)
    crashed = PodState(PodSpec("crashed", "a100", "v1", "127.0.40.1"), process=exited)  # reported first
    due = PodState(PodSpec("due", "a100", "v1", "127.0.40.2"), process=exited, restart_at=0.0)  # then restarted

    def report_and_close(state: PodState) -> None:  # `close` begins while the kubelet reports the crash
        stack._closing = True

    stack._report = report_and_close  # type: ignore[method-assign]
    stack.pods = {"crashed": crashed, "due": due}
    asyncio.run(asyncio.wait_for(stack.kubelet(), timeout=20))
    assert due.process is exited  # not restarted
    stack.close()


def test_a_relative_work_directory_is_made_absolute_so_prometheus_finds_its_targets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prometheus reads a relative file_sd path from its config file's directory: `out/x/prometheus/out/x/...`.
    monkeypatch.chdir(tmp_path)
    stack = Stack(Path("out") / "stack")
    assert stack.workdir == tmp_path / "out" / "stack"
    assert stack.targets_file == tmp_path / "out" / "stack" / "prometheus" / "targets.json"
    assert stack.kubeconfig.is_absolute()
