"""CPU to fetch and decode one namespace-wide Prometheus answer of N series, as the operator reads it.

    python benchmarks/bench_prom_decode.py [--series 16000] [--repeat 40]

A loopback HTTP server serves a vector answer as Prometheus writes a `sum by (pod)` result (one `pod` label, a
timestamp and a string value per series, no spaces). Measured side by side: the calling thread's CPU per answer
(median) for what `sluice.io.prometheus` runs now (the request over the client's session, the body read as
text by `vector_values`), for prometheus-api-client's `custom_query` (requests' `.json()`, stdlib json) split
by `pod_values` — what it ran before — and for the same request decoded with orjson; and the decoders alone.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_api_client import PrometheusConnect

from sluice.io.promanswers import plain_vector_values, pod_values, vector_values
from sluice.io.promtransport import ask, open_transport


def answer(series: int) -> bytes:
    result = [
        {"metric": {"pod": f"pool-{i // 16:04d}-{i % 16:02d}"}, "value": [1796119200.123, f"{0.5 + i % 7 / 100:.6f}"]}
        for i in range(series)
    ]
    answer = {"status": "success", "data": {"resultType": "vector", "result": result}}
    return json.dumps(answer, separators=(",", ":")).encode()


def cpu_ms(run: Callable[[], Any], repeat: int) -> float:
    spent = []
    for _ in range(repeat):
        start = time.thread_time()
        run()
        spent.append(time.thread_time() - start)
    return statistics.median(spent) * 1000


def split(items: list[dict[str, Any]]) -> dict[str, float]:
    return pod_values(items, "pod")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--series", type=int, default=16000)
    parser.add_argument("--repeat", type=int, default=40)
    args = parser.parse_args()
    body = answer(args.series)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = PrometheusConnect(url=f"http://127.0.0.1:{server.server_address[1]}", timeout=5)
    transport = open_transport((client.url, None, False, 4.0), True)
    params = {"timeout": "4s"}
    text = body.decode()
    if plain_vector_values(text, "pod") != split(json.loads(body)["data"]["result"]):
        raise SystemExit("the two readings differ")
    rows: list[tuple[str, Callable[[], Any]]] = [
        (
            "request + vector_values (what the operator runs)",
            lambda: vector_values(ask(transport, "q", "4s", None), "pod"),
        ),
        ("custom_query + pod_values (before)", lambda: split(client.custom_query("q", params=params))),
        ("plain_vector_values alone", lambda: plain_vector_values(text, "pod")),
        ("json.loads alone", lambda: json.loads(body)),
    ]
    try:
        orjson = importlib.import_module("orjson")  # not a dependency: measured when present

        def orjson_query() -> Any:
            response = transport.session.get(f"{client.url}/api/v1/query", params={"query": "q", **params}, timeout=5)
            return split(orjson.loads(response.content)["data"]["result"])

        rows += [("same request, orjson + split", orjson_query), ("orjson.loads alone", lambda: orjson.loads(body))]
    except ImportError:
        print("orjson not installed: its rows are left out")
    print(f"{args.series} series, {len(body) / 1e6:.2f} MB answer; CPU of the calling thread per answer, median")
    try:
        for name, run in rows:
            print(f"  {name:48s} {cpu_ms(run, args.repeat):6.1f} ms")
    finally:
        server.shutdown()


if __name__ == "__main__":
    main()
