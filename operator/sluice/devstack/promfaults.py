"""A Prometheus fault proxy for the local stack: sluice's queries pass through it to the real Prometheus, and faults
are switched on and off while it runs.

Local-stack tool (tests and fault runs; never imported by the operator). `FaultProxy` listens on 127.0.0.1 and
forwards every request (sluice's PromIO asks only `/api/v1/query`, GET or a POST form, see
`sluice.io.promtransport.ask`; the preflight and `kubectl sluice doctor` ask the same path) to the upstream
Prometheus, then applies the faults set now (`Faults`):
- `latency`: seconds added before forwarding;
- `hang`: no answer at all until the client gives up (or `hang_limit`, or the proxy's end);
- `error`: an error answer shaped as Prometheus' HTTP API writes one (`error_answer`);
- `drop_fraction` / `drop_pods`: a partial answer, series dropped from a vector result as a scrape that missed
  targets would leave them (`partial_answer`, seeded);
- `outage`: the port refuses connections (the listener is closed and open connections reset) until cleared.
Faults are set through an admin listener of their own (`POST /faults` with a JSON object, `DELETE /faults`,
`GET /faults` for the counters), which stays up during an outage. The proxy has a lifetime and stops by itself.
The pure parts (`parse_faults`, `error_answer`, `partial_answer`) are tested alone; the proxy with an upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import aiohttp
from aiohttp import web

from sluice.api.jsontypes import JsonObject, JsonValue

# Prometheus' HTTP API error answers: web/api/v1/api.go (`respondError`) at v2.42 (the Debian package the local stack
# runs; prometheus/prometheus blob 003276ee): the body is `response{Status: "error", ErrorType, Error}` with
# `data` and `warnings` omitted when empty, serialised compactly in that field order, `Content-Type:
# application/json`, and the status code per errorType below; any other type (`unavailable`) is a 500.
ERROR_STATUS: Mapping[str, int] = {
    "bad_data": 400,
    "execution": 422,
    "canceled": 503,
    "timeout": 503,
    "internal": 500,
    "not_found": 404,
    "unavailable": 500,
}
ERROR_MESSAGE: Mapping[str, str] = {
    # The `error` texts Prometheus writes for each type (promql/engine.go ErrQueryTimeout / ErrQueryCanceled; the
    # execution and bad_data texts as the stack's Prometheus 2.42 wrote them, tests/e2e/test_prom_faults.py).
    "timeout": "query timed out in expression evaluation",
    "canceled": "query was canceled in expression evaluation",
    "execution": 'found duplicate series for the match group {pod="x"} on the right hand-side of the operation: '
    '[{pod="x"}, {pod="x"}];many-to-many matching not allowed: matching labels must be unique on one side',
    "bad_data": 'invalid parameter "query": 1:5: parse error: unclosed left parenthesis',
    "internal": "expanding series: storage error",
    "not_found": "not found",
    "unavailable": "TSDB not ready",
}


class FaultsError(ValueError):
    """A fault setting the proxy cannot take; the message names the field."""


@dataclass(frozen=True)
class Faults:
    """The faults applied to each query now (all off by default)."""

    latency: float = 0.0
    hang: bool = False
    error: str | None = None
    drop_fraction: float = 0.0
    drop_pods: frozenset[str] = frozenset()
    outage: bool = False

    def as_json(self) -> JsonObject:
        found = asdict(self)
        return {**found, "drop_pods": sorted(self.drop_pods)}


def _number(body: Mapping[str, JsonValue], key: str, low: float, high: float) -> float:
    value = body.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise FaultsError(f"{key}: must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def _flag(body: Mapping[str, JsonValue], key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise FaultsError(f"{key}: must be true or false, got {value!r}")
    return value


def parse_faults(body: JsonValue) -> Faults:
    """Faults from the admin path's JSON object; an unknown field or a bad value is refused, naming it."""
    if not isinstance(body, dict):
        raise FaultsError(f"faults: must be a JSON object, got {body!r}")
    unknown = sorted(set(body) - set(Faults.__dataclass_fields__))
    if unknown:
        raise FaultsError(f"{unknown[0]}: unknown fault (known: {', '.join(Faults.__dataclass_fields__)})")
    error = body.get("error")
    if error is not None and error not in ERROR_STATUS:
        raise FaultsError(f"error: must be one of {', '.join(ERROR_STATUS)}, got {error!r}")
    pods = body.get("drop_pods", [])
    if not isinstance(pods, list) or not all(isinstance(p, str) for p in pods):
        raise FaultsError(f"drop_pods: must be a list of pod names, got {pods!r}")
    return Faults(
        latency=_number(body, "latency", 0.0, 120.0),
        hang=_flag(body, "hang"),
        error=error if isinstance(error, str) else None,
        drop_fraction=_number(body, "drop_fraction", 0.0, 1.0),
        drop_pods=frozenset(p for p in pods if isinstance(p, str)),
        outage=_flag(body, "outage"),
    )


def error_answer(error_type: str, message: str | None = None) -> tuple[int, bytes]:
    """The status code and body Prometheus answers an API error of `error_type` with (api.go `respondError`)."""
    body = {"status": "error", "errorType": error_type, "error": message or ERROR_MESSAGE[error_type]}
    return ERROR_STATUS[error_type], json.dumps(body, separators=(",", ":")).encode()


def partial_answer(body: bytes, faults: Faults, rng: random.Random, pod_label: str = "pod") -> bytes:
    """A vector answer without the series of `faults.drop_pods` and, of the rest, each dropped with probability
    `drop_fraction` (drawn from `rng`, one draw per series in order): what a scrape that missed those targets
    leaves. Anything else (an error, a scalar, a matrix, a body that is not JSON) passes unchanged."""
    if not faults.drop_pods and faults.drop_fraction <= 0.0:
        return body
    try:
        answer = json.loads(body)
    except ValueError:
        return body
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, dict) or data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
        return body
    kept = []
    for series in data["result"]:
        labels = series.get("metric", {}) if isinstance(series, dict) else {}
        if labels.get(pod_label) in faults.drop_pods:
            continue
        if faults.drop_fraction > 0.0 and rng.random() < faults.drop_fraction:
            continue
        kept.append(series)
    answer["data"] = {**data, "result": kept}
    return json.dumps(answer, separators=(",", ":")).encode()


@dataclass
class Counters:
    """What the proxy did so far."""

    forwarded: int = 0
    errors: int = 0
    hung: int = 0
    abandoned: int = 0
    """Hung queries whose client gave up (their connection closed)."""
    partial: int = 0
    refused_since: list[float] = field(default_factory=list)
    """Monotonic times an outage began."""


HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})


class FaultProxy:
    """Forward to `upstream`, with `Faults` switched at run time. Start with `await proxy.start()`; it stops by
    itself after `lifetime` seconds (or `await proxy.stop()`)."""

    def __init__(
        self, upstream: str, lifetime: float, seed: int = 0, hang_limit: float = 30.0, pod_label: str = "pod"
    ) -> None:
        if lifetime <= 0:
            raise FaultsError(f"lifetime: must be positive, got {lifetime}")
        self.upstream = upstream.rstrip("/")
        self.lifetime = lifetime
        self.hang_limit = hang_limit
        self.pod_label = pod_label
        self.rng = random.Random(seed)
        self.faults = Faults()
        self.counters = Counters()
        self.port = 0
        self.admin_port = 0
        self._proxy: web.AppRunner | None = None
        self._admin: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None
        self._timer: asyncio.Task[None] | None = None
        self.stopped = asyncio.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    async def start(self) -> None:
        self._http = aiohttp.ClientSession(auto_decompress=False)
        admin = web.Application()
        admin.router.add_route("*", "/faults", self._admin_faults)
        self._admin, self.admin_port = await _listen(admin, 0)
        await self._open()
        self._timer = asyncio.create_task(self._expire())

    async def stop(self) -> None:
        """Close both listeners and the upstream session (idempotent)."""
        if self.stopped.is_set():
            return
        self.stopped.set()
        await self._close()
        if self._admin is not None:
            await self._admin.cleanup()
        if self._http is not None:
            await self._http.close()
        if self._timer is not None and self._timer is not asyncio.current_task():
            self._timer.cancel()

    async def set_faults(self, faults: Faults) -> None:
        """Apply `faults` from now on; an outage closes the port at once, clearing it opens the port again."""
        if faults.outage and self._proxy is not None:
            self.counters.refused_since.append(time.monotonic())
            await self._close()
        elif not faults.outage and self._proxy is None and not self.stopped.is_set():
            await self._open()
        self.faults = faults

    async def _expire(self) -> None:
        await asyncio.sleep(self.lifetime)
        await self.stop()

    async def _open(self) -> None:
        app = web.Application(client_max_size=4 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._proxy, self.port = await _listen(app, self.port)

    async def _close(self) -> None:
        runner, self._proxy = self._proxy, None
        if runner is None:
            return
        await runner.cleanup()  # open keep-alive connections are closed too: a process that died answers nothing

    async def _admin_faults(self, request: web.Request) -> web.Response:
        if request.method == "DELETE":
            await self.set_faults(Faults())
        elif request.method == "POST":
            try:
                await self.set_faults(parse_faults(await request.json()))
            except (FaultsError, ValueError) as failure:
                return web.json_response({"error": str(failure)}, status=400)
        counters = asdict(self.counters)
        return web.json_response({"faults": self.faults.as_json(), "counters": counters})

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        faults = self.faults
        if faults.latency > 0:
            await asyncio.sleep(faults.latency)
        if faults.hang:
            self.counters.hung += 1
            await self._hang(request)
            if request.transport is not None:  # still there at the limit: dropped without an answer
                request.transport.close()
            return web.Response(status=504)  # never reaches the client: its connection is gone
        if faults.error is not None and request.path.startswith("/api/"):
            self.counters.errors += 1
            status, body = error_answer(faults.error)
            return web.Response(status=status, body=body, content_type="application/json")
        assert self._http is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        async with self._http.request(
            request.method, self.upstream + request.path_qs, headers=headers, data=await request.read()
        ) as upstream:
            body = await upstream.read()
            answer_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
        self.counters.forwarded += 1
        if upstream.status == 200 and request.path.startswith("/api/v1/query"):
            changed = partial_answer(_plain(body, answer_headers), faults, self.rng, self.pod_label)
            if changed is not body:
                self.counters.partial += 1
                answer_headers.pop("Content-Encoding", None)
                body = changed
        return web.Response(status=upstream.status, body=body, headers=answer_headers)

    async def _hang(self, request: web.Request) -> None:
        """Until the client gives up (its connection closes), the hang is cleared, `hang_limit` or the end."""
        end = time.monotonic() + self.hang_limit
        while time.monotonic() < end and self.faults.hang and not self.stopped.is_set():
            transport = request.transport
            if transport is None or transport.is_closing():
                self.counters.abandoned += 1
                return
            await asyncio.sleep(0.05)


def _plain(body: bytes, headers: dict[str, str]) -> bytes:
    """The body decompressed when Prometheus gzipped it (the proxy forwards `Accept-Encoding` as sent)."""
    if headers.get("Content-Encoding", "").lower() == "gzip":
        with contextlib.suppress(OSError):
            plain = gzip.decompress(body)
            headers.pop("Content-Encoding", None)
            return plain
    return body


async def _listen(app: web.Application, port: int) -> tuple[web.AppRunner, int]:
    """`app` on 127.0.0.1:`port` (0: any free port); returns the runner and the port bound."""
    runner = web.AppRunner(app, shutdown_timeout=0.1, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, reuse_address=True)
    await site.start()
    bound: int = runner.addresses[0][1]  # the port bound when 0 was asked
    return runner, bound


class ProxyThread:
    """A `FaultProxy` on an event loop of its own thread, for synchronous tests: `with ProxyThread(url, 90) as p:`."""

    def __init__(self, upstream: str, lifetime: float, seed: int = 0) -> None:
        self.loop = asyncio.new_event_loop()
        self.proxy = FaultProxy(upstream, lifetime, seed)
        self._thread = threading.Thread(target=self.loop.run_forever, name="prom-fault-proxy", daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self.loop).result(timeout=10)
        return self.proxy

    def set_faults(self, faults: Faults) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.set_faults(faults), self.loop).result(timeout=10)

    def __exit__(self, *_: object) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.proxy.stop(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


__all__ = [
    "ERROR_STATUS",
    "FaultProxy",
    "Faults",
    "FaultsError",
    "ProxyThread",
    "error_answer",
    "parse_faults",
    "partial_answer",
]
