"""A client that hangs up in the middle of a streamed list costs the API emulator nothing: no error, no trace."""

from __future__ import annotations

import asyncio
import logging

import kmock
import pytest

from sluice.emulator.apiserver import LIST_CHUNK, ApiServer, _HttpServer

LEASES = "/apis/coordination.k8s.io/v1/namespaces/default/leases"


@pytest.mark.asyncio
async def test_a_client_hanging_up_mid_list_is_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    server = ApiServer()
    store = server.store
    store.create(store.find_type("", "namespaces"), "v1", None, {"metadata": {"name": "default"}})
    leases = store.find_type("coordination.k8s.io", "leases")
    padding = "x" * 400  # ~0.5 KB per item: the list is far larger than the transport's buffer
    for i in range(LIST_CHUNK * 40):
        lease = {"metadata": {"name": f"l{i}", "annotations": {"pad": padding}}, "spec": {"holderIdentity": "x"}}
        store.create(leases, "v1", "default", lease)
    caplog.set_level(logging.DEBUG)
    async with server, kmock.Server(server, host="127.0.0.1", port=0, server_cls=_HttpServer) as http:
        reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
        writer.write(f"GET {LEASES} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer local-stack\r\n\r\n".encode())
        await writer.drain()
        assert b"200 OK" in await reader.readuntil(b"\r\n")
        await reader.read(1024)
        writer.close()  # hangs up with most of the list unsent
        await writer.wait_closed()
        await asyncio.sleep(1.0)  # the handler meets the closed connection
        # the server still answers
        reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
        writer.write(b"GET /version HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer local-stack\r\n\r\n")
        await writer.drain()
        assert b"200 OK" in await reader.readuntil(b"\r\n")
        writer.close()
        assert server.errors == []  # what a handler raised, kept by kmock (answered as a 500 nobody receives)
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert errors == [], [(r.name, r.getMessage(), r.exc_info) for r in errors]
