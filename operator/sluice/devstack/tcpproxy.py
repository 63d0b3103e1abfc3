"""A TCP forwarder that can be partitioned: what stands between one operator replica and the API server in the
sharded chaos scene, so that one replica can be cut off while the others keep the API.

Local-stack tool (`sluice.devstack.chaosshards`; never imported by the operator). `TcpProxy` listens on
127.0.0.1 and relays bytes, both ways and unread (TLS passes through: the replica's kubeconfig names the proxy's
port, the certificate is the API emulator's for 127.0.0.1), to one upstream address. `partition()` makes it
behave as a network that drops every packet, not as a server that went away:
- no new connection is accepted: the listener stays open but unserved, so a client's connection waits in the
  kernel's backlog (or, the backlog full, its SYNs go unanswered) and its TLS handshake hangs until the client's
  own timeout;
- the open connections are not closed: nothing they send is relayed either way, so requests and watches hang
  until their timeouts, as they would behind dropped packets.
`heal()` lets everything through again. What a side sent meanwhile is held and then delivered, late, as TCP
delivers after a partition the bytes its sender kept retransmitting: a kernel goes on retransmitting what was not
acknowledged after its process closed the socket (FIN: its end is held and delivered after the bytes), but drops it
when the socket was aborted (RST, `SO_LINGER` 0): then what was held is dropped and the other side is reset once
packets pass again. The proxy stops by itself at the end of its `lifetime`.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from dataclasses import dataclass

POLL = 0.2
"""Seconds between the relay threads' looks at the gate and the lifetime."""


@dataclass
class ProxyCounts:
    accepted: int = 0
    """Connections accepted and relayed."""
    partitions: int = 0
    held: int = 0
    """Connections open when the last partition began (left hanging)."""
    open: int = 0


class TcpProxy:
    """`with TcpProxy(("127.0.0.1", port), lifetime=600) as proxy:` ... `proxy.port`, `proxy.partition()`,
    `proxy.heal()`."""

    def __init__(self, upstream: tuple[str, int], lifetime: float, backlog: int = 16) -> None:
        self.upstream = upstream
        self.end = time.monotonic() + lifetime
        self.counts = ProxyCounts()
        self._gate = threading.Event()
        """Set: packets pass. Clear: partitioned."""
        self._gate.set()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(backlog)
        self._listener.settimeout(POLL)
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name=f"tcp-proxy-{self.port}", daemon=True)

    @property
    def partitioned(self) -> bool:
        return not self._gate.is_set()

    def __enter__(self) -> TcpProxy:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def partition(self) -> None:
        with self._lock:
            if self._gate.is_set():
                self.counts.partitions += 1
                self.counts.held = self.counts.open
            self._gate.clear()

    def heal(self) -> None:
        self._gate.set()

    def close(self) -> None:
        """Stop relaying and close every socket (held bytes are dropped)."""
        self._closed.set()
        with self._lock:
            sockets, self._sockets = set(self._sockets), set()
        for sock in (self._listener, *sockets):
            with contextlib.suppress(OSError):
                sock.close()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * POLL + 1)

    def _running(self) -> bool:
        return not self._closed.is_set() and time.monotonic() < self.end

    def _passable(self) -> bool:
        """Wait until packets pass (True), or the proxy ends (False)."""
        while self._running():
            if self._gate.wait(POLL):
                return self._running()
        return False

    def _accept(self) -> None:
        """Accept and relay; while partitioned, a connection the kernel completed is kept unserved (its client
        waits for its handshake's answer) and relayed after the heal only if its client is still there."""
        waiting: list[socket.socket] = []
        try:
            while self._running():
                if waiting and self._gate.is_set():
                    for client in waiting:
                        sent = self._still_there(client)
                        if sent is None:
                            client.close()
                        else:
                            self._connect(client, sent)
                    waiting.clear()
                try:
                    client, _ = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                if self._gate.is_set():
                    self._connect(client, b"")
                else:
                    waiting.append(client)
        finally:
            for client in waiting:
                client.close()
            self.close()

    @staticmethod
    def _still_there(client: socket.socket) -> bytes | None:
        """What a connection kept unserved sent meanwhile, or None if its client closed or aborted it (it gave up
        before it could have reached the other side)."""
        chunks = []
        client.setblocking(False)
        try:
            while True:
                chunk = client.recv(65536)
                if not chunk:
                    return None
                chunks.append(chunk)
        except BlockingIOError:
            return b"".join(chunks)
        except OSError:
            return None

    def _connect(self, client: socket.socket, sent: bytes) -> None:
        try:
            server = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            client.close()
            return
        self._relay(client, server, sent)

    def _relay(self, client: socket.socket, server: socket.socket, sent: bytes) -> None:
        for sock in (client, server):
            sock.settimeout(POLL)
        with self._lock:
            self._sockets |= {client, server}
            self.counts.accepted += 1
            self.counts.open += 1
        ends = [threading.Event(), threading.Event()]
        if sent:
            self._deliver(server, sent)
        for (source, target), done in zip(((client, server), (server, client)), ends, strict=True):
            threading.Thread(
                target=self._pump, args=(source, target, done, ends), name=f"tcp-proxy-{self.port}-pump", daemon=True
            ).start()

    def _pump(
        self, source: socket.socket, target: socket.socket, done: threading.Event, ends: list[threading.Event]
    ) -> None:
        """Relay one direction. While partitioned, what the source sends is held in order (its end too) as the
        bytes a sender retransmits until they get through, and delivered after the heal; a source that aborts
        (RST) meanwhile loses what was held, as an aborted sender drops its unacknowledged bytes."""
        held: list[bytes] = []
        """Chunks read while partitioned; an empty chunk is the source's end."""
        try:
            while self._running():
                if held and self._gate.is_set() and not self._flush(target, held):
                    return
                try:
                    data = source.recv(65536)
                except TimeoutError:
                    continue
                except ConnectionResetError:
                    held.clear()
                    if self._passable():  # the far side learns of it once packets pass again
                        self._abort(target)
                    return
                held.append(data)
                if self._gate.is_set() and not self._flush(target, held):
                    return
                if not data and not self._passable():
                    return
        except OSError:
            return
        finally:
            done.set()
            if all(e.is_set() for e in ends):
                self._forget(source, target)

    def _flush(self, target: socket.socket, held: list[bytes]) -> bool:
        """Deliver what was held; False once the source's end was delivered (a half-close)."""
        chunks = list(held)
        held.clear()
        for chunk in chunks:
            if not chunk:
                with contextlib.suppress(OSError):
                    target.shutdown(socket.SHUT_WR)
                return False
            self._deliver(target, chunk)
        return True

    def _deliver(self, target: socket.socket, data: bytes) -> None:
        view = memoryview(data)
        while view and self._running():
            try:
                sent = target.send(view)
            except TimeoutError:  # nothing was sent: the peer's window is full
                continue
            view = view[sent:]

    @staticmethod
    def _abort(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()

    def _forget(self, *sockets: socket.socket) -> None:
        with self._lock:
            self.counts.open -= 1
            for sock in sockets:
                self._sockets.discard(sock)
                with contextlib.suppress(OSError):
                    sock.close()


__all__ = ["ProxyCounts", "TcpProxy"]
