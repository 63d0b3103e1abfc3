"""An asyncio event loop on a thread of its own, for synchronous callers of the local stack.

Local-stack tool. The kubelet (`Stack.kubelet`) and the load generator (`Traffic.run`) are coroutines; the
end-to-end tests and the chaos runner (`sluice.devstack.chaos`) drive the stack synchronously and run them here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any


class Background:
    """An event loop in a thread, for the kubelet and the traffic while the caller runs synchronously."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def start(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Callable[[], Any]) -> None:
        self.loop.call_soon_threadsafe(fn)

    def close(self) -> None:
        for task in asyncio.all_tasks(self.loop):
            self.loop.call_soon_threadsafe(task.cancel)
        time.sleep(0.5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


__all__ = ["Background"]
