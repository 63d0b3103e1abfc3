"""`free_port` must not hand out a port an outgoing connection can take before the server binds it.

CI once failed with a real Envoy's "cannot bind '127.0.0.1:38801': Address already in use": 38801 came from
`bind(("127.0.0.1", 0))`, i.e. from the kernel's ephemeral range, which every outgoing connection (the readiness
polls in the same test) draws from too.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from sluice.devstack.stack import free_port

RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not RANGE.exists(), reason="Linux's ephemeral port range")
def test_ports_come_from_below_the_ephemeral_range_and_are_never_handed_out_twice() -> None:
    low = int(RANGE.read_text().split()[0])
    ports = [free_port() for _ in range(200)]
    assert all(port < low for port in ports), [port for port in ports if port >= low][:5]
    assert len(set(ports)) == len(ports)


def test_a_port_in_use_is_skipped() -> None:
    taken = free_port()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", taken))
        listener.listen()
        for _ in range(200):
            port = free_port()
            assert port != taken
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port))  # the port handed out is bindable now
