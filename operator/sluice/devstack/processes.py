"""The local stack's processes: each in a session of its own, waited for until ready, stopped by process group.

Local-stack tool. What `sluice.devstack.stack.Stack` starts is stopped with `stop_processes`; `wait_for` polls a
readiness check until a deadline and fails early when the process it waits for has exited; nothing is started once
the stack is closing (`StackClosing`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable


class StackClosing(RuntimeError):
    """A process asked of a stack that is closing: nothing starts once `close` has begun."""


def stop_processes(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to every process group at once, then wait for each (SIGKILL after 10 s)."""
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=5)


def wait_for(
    ready: Callable[[], bool], seconds: float, what: str, process: subprocess.Popen[bytes] | None = None
) -> None:
    """Until `ready()` (`seconds` at most, then an error naming `what`); an error at once if `process` exits."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if ready():
            return
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode}")
        time.sleep(0.1)
    raise TimeoutError(f"{what} not ready after {seconds:.0f}s")


def answers_ok(url: str) -> bool:
    """Whether `url` answers 200 within a second."""
    try:
        with urllib.request.urlopen(url, timeout=1) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False
