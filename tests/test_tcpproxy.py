"""The partitionable TCP forwarder of the sharded chaos scene, against an echo server on loopback: it relays both
ways; partitioned, it accepts nothing new and relays nothing (the bytes and the end of a connection held, not
lost, nothing closed); healed, it delivers what it held."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from sluice.devstack.tcpproxy import TcpProxy
from sluice.io.kubereads import ABORT_ON_CLOSE


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    """An upstream that echoes what it reads, and closes when its client half-closes."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while chunk := conn.recv(4096):
                conn.sendall(chunk)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()
    stop.set()
    thread.join(timeout=2)
    listener.close()


@pytest.fixture
def proxy(echo: tuple[str, int]) -> Iterator[TcpProxy]:
    with TcpProxy(echo, lifetime=30) as running:
        yield running


def connect(proxy: TcpProxy, timeout: float = 2.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout)


def established(proxy: TcpProxy, count: int = 1) -> None:
    """Until the proxy relays `count` connections (a partition then finds them open, not in its backlog)."""
    end = time.monotonic() + 2
    while proxy.counts.accepted < count and time.monotonic() < end:
        time.sleep(0.02)
    assert proxy.counts.accepted >= count


def test_bytes_pass_both_ways(proxy: TcpProxy) -> None:
    with connect(proxy) as client:
        client.sendall(b"hello")
        assert client.recv(16) == b"hello"
    assert proxy.counts.accepted == 1


def test_a_partition_hangs_an_open_connection_without_closing_it_and_the_heal_delivers_what_was_held(
    proxy: TcpProxy,
) -> None:
    with connect(proxy) as client:
        client.sendall(b"before")
        assert client.recv(16) == b"before"
        proxy.partition()
        assert proxy.counts.held == 1
        client.sendall(b"during")
        client.settimeout(0.6)
        with pytest.raises(TimeoutError):  # dropped packets: no answer, no reset, no end of stream
            client.recv(16)
        proxy.heal()
        client.settimeout(2.0)
        assert client.recv(16) == b"during"


def test_a_partition_accepts_no_new_connection_until_healed(proxy: TcpProxy) -> None:
    proxy.partition()
    # The kernel may complete the handshake into the backlog, but nothing is relayed: the request hangs.
    with connect(proxy) as client:
        client.sendall(b"knock")
        client.settimeout(0.6)
        with pytest.raises(TimeoutError):
            client.recv(16)
        assert proxy.counts.accepted == 0
        proxy.heal()
        client.settimeout(2.0)
        assert client.recv(16) == b"knock"
    assert proxy.counts.accepted == 1


def test_a_connection_closed_during_the_partition_ends_only_after_the_heal(proxy: TcpProxy) -> None:
    client = connect(proxy)
    client.sendall(b"x")
    assert client.recv(1) == b"x"
    established(proxy)
    proxy.partition()
    client.shutdown(socket.SHUT_WR)  # the client's end is held like its bytes: the upstream still serves it
    time.sleep(0.5)
    assert proxy.counts.open == 1
    proxy.heal()
    client.settimeout(2.0)
    assert client.recv(16) == b""  # the upstream saw the end and closed
    client.close()
    deadline = time.monotonic() + 2
    while proxy.counts.open and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proxy.counts.open == 0


def test_bytes_sent_before_a_normal_close_during_the_partition_are_delivered_after_the_heal() -> None:
    received = recording_upstream()
    with TcpProxy(received.address, lifetime=30) as proxy:
        client = connect(proxy)
        established(proxy)
        proxy.partition()
        client.sendall(b"PATCH status")
        client.close()  # FIN: its kernel would go on retransmitting the request
        time.sleep(0.5)
        assert received.data() == b""
        proxy.heal()
        assert received.wait_for(b"PATCH status")


def test_bytes_of_a_connection_aborted_during_the_partition_are_never_delivered() -> None:
    received = recording_upstream()
    with TcpProxy(received.address, lifetime=30) as proxy:
        client = connect(proxy)
        established(proxy)
        proxy.partition()
        client.sendall(b"PATCH status")
        time.sleep(0.3)
        client.setsockopt(*ABORT_ON_CLOSE)  # as the operator's API clients close
        client.close()  # RST: its kernel drops what was not acknowledged
        time.sleep(0.5)
        proxy.heal()
        assert not received.wait_for(b"PATCH", seconds=1.0)


def test_a_connection_made_during_the_partition_and_given_up_is_never_relayed() -> None:
    received = recording_upstream()
    with TcpProxy(received.address, lifetime=30) as proxy:
        proxy.partition()
        client = connect(proxy)
        client.sendall(b"PATCH status")
        time.sleep(0.3)
        client.close()  # its handshake never answered: it never reached the other side
        proxy.heal()
        assert not received.wait_for(b"PATCH", seconds=1.0)
        assert proxy.counts.accepted == 0


class Recording:
    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self.listener.getsockname()
        self._data = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.listener.settimeout(10)
        with contextlib.suppress(OSError):
            conn, _ = self.listener.accept()
            with conn, contextlib.suppress(OSError):
                while chunk := conn.recv(4096):
                    with self._lock:
                        self._data += chunk

    def data(self) -> bytes:
        with self._lock:
            return bytes(self._data)

    def wait_for(self, wanted: bytes, seconds: float = 2.0) -> bool:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if wanted in self.data():
                return True
            time.sleep(0.05)
        return False


def recording_upstream() -> Recording:
    """An upstream that keeps what it reads."""
    return Recording()


def test_the_proxy_stops_by_itself_at_the_end_of_its_lifetime(echo: tuple[str, int]) -> None:
    with TcpProxy(echo, lifetime=0.5) as short:
        time.sleep(1.0)
        with contextlib.suppress(OSError), connect(short, timeout=0.5) as client:
            client.sendall(b"late")
            client.settimeout(0.5)
            with contextlib.suppress(TimeoutError):
                assert client.recv(16) == b""
        assert short.counts.accepted == 0
