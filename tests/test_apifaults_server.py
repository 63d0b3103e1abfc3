"""The API emulator serves its fault plan over HTTP: `/_faults` for the admin only, each fault where
kube-apiserver would produce it (APF's 429 before authorization, a storage error after it), watches closed or
expired, and nothing changed while no rule fires. In process, on loopback; latency is recorded, not slept."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import kmock
import pytest
import pytest_asyncio

from sluice.emulator import apirbac
from sluice.emulator.apifaultplan import load_plan
from sluice.emulator.apiserver import ApiServer, _HttpServer, main

CONFIGMAPS = "/api/v1/namespaces/default/configmaps"
NAMESPACES = "/api/v1/namespaces"
ADMIN = {"Authorization": "Bearer local-stack"}


@dataclass
class Api:
    server: ApiServer
    session: aiohttp.ClientSession
    bot: dict[str, str]
    slept: list[float]

    def plan(self, *rules: str) -> None:
        self.server.faults.install(load_plan("rules:\n" + "".join(f"- {rule}\n" for rule in rules)))

    async def put_plan(self, *rules: str) -> dict[str, object]:
        """The plan replaced as a harness does it: `PUT /_faults` (which wakes the open watches)."""
        body = "rules:\n" + "".join(f"- {rule}\n" for rule in rules)
        async with self.session.put("/_faults", data=body, headers=ADMIN) as response:
            assert response.status == 200
            return dict(await response.json())


@pytest_asyncio.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    slept: list[float] = []

    async def record_sleep(seconds: float) -> None:
        slept.append(seconds)

    server = ApiServer(fault_sleep=record_sleep, audit_path=tmp_path / "audit.jsonl")
    server.store.create(server.store.find_type("", "namespaces"), "v1", None, {"metadata": {"name": "default"}})
    server.store.create(server.store.find_type("", "configmaps"), "v1", "default", {"metadata": {"name": "one"}})
    bot = {"Authorization": "Bearer " + server.authenticator.mint(apirbac.service_account_user("default", "bot"))}
    async with (
        server,
        kmock.Server(server, host="127.0.0.1", port=0, server_cls=_HttpServer) as http,
        aiohttp.ClientSession(f"http://127.0.0.1:{http.port}") as session,
    ):
        yield Api(server, session, bot, slept)


async def answer(response: aiohttp.ClientResponse) -> tuple[int, dict[str, str], bytes]:
    return response.status, dict(response.headers), await response.read()


# ------------------------------------------------------------------------------------------------ /_faults


@pytest.mark.asyncio
async def test_the_admin_replaces_and_reads_the_plan_and_anyone_else_is_refused(api: Api) -> None:
    plan = "rules: [{name: slow, effect: {type: latency, seconds: 0.5}}]"
    put = await api.session.put("/_faults", data=plan, headers=ADMIN)
    assert put.status == 200
    assert [rule["name"] for rule in (await put.json())["plan"]["rules"]] == ["slow"]
    refused = await api.session.put("/_faults", data="rules: []", headers=api.bot)
    assert refused.status == 403
    assert (await refused.json())["message"] == (
        'forbidden: User "system:serviceaccount:default:bot" cannot put path "/_faults"'
    )
    assert (await api.session.get("/_faults", headers=api.bot)).status == 403
    status = await (await api.session.get("/_faults", headers=ADMIN)).json()
    assert [rule["name"] for rule in status["plan"]["rules"]] == ["slow"]  # the refused PUT changed nothing


@pytest.mark.asyncio
async def test_a_bad_plan_is_refused_with_400_naming_the_field_and_the_old_plan_stays(api: Api) -> None:
    api.plan("{name: keep, effect: {type: expireWatch}}")
    bad = await api.session.put("/_faults", data="rules: [{name: r, effect: {type: error, code: 404}}]", headers=ADMIN)
    body = await bad.json()
    assert (bad.status, body["reason"]) == (400, "BadRequest")
    assert "rules[0].effect.code" in body["message"]
    assert [rule.name for rule in api.server.faults.plan.rules] == ["keep"]
    assert (await api.session.post("/_faults", data="", headers=ADMIN)).status == 405


# ------------------------------------------------------------------------------------------------ answers


@pytest.mark.asyncio
async def test_a_throttle_comes_before_authorization_as_the_apf_filter_does(api: Api) -> None:
    api.plan("{name: apf, effect: {type: throttle, retryAfterSeconds: 3}}")
    code, headers, body = await answer(await api.session.get(CONFIGMAPS, headers=api.bot))  # bot may not list
    assert (code, body) == (429, b"Too many requests, please try again later.\n")
    assert headers["Retry-After"] == "3"
    assert headers["Content-Type"] == "text/plain; charset=utf-8"
    assert "X-Kubernetes-PF-FlowSchema-UID" in headers
    assert "X-Kubernetes-PF-PriorityLevel-UID" in headers


@pytest.mark.asyncio
async def test_a_server_error_comes_after_authorization_so_a_forbidden_request_stays_forbidden(api: Api) -> None:
    api.plan("{name: etcd, effect: {type: error, code: 500, message: 'etcdserver: request timed out'}}")
    assert (await api.session.get(CONFIGMAPS, headers=api.bot)).status == 403
    code, headers, body = await answer(await api.session.get(CONFIGMAPS, headers=ADMIN))
    assert (code, headers["Content-Type"]) == (500, "application/json")
    assert json.loads(body)["message"] == "Internal error occurred: etcdserver: request timed out"
    assert [rule["served"] for rule in api.server.faults.status()["rules"]] == [1]  # the 403 was not a fault


@pytest.mark.asyncio
async def test_a_503_burst_fails_consecutive_writes_then_writes_succeed(api: Api) -> None:
    api.plan("{name: burst, match: {verbs: [create]}, burst: 3, limit: 3, effect: {type: error, code: 503}}")
    codes = []
    for index in range(5):
        created = await api.session.post(CONFIGMAPS, json={"metadata": {"name": f"c{index}"}}, headers=ADMIN)
        codes.append(created.status)
    assert codes == [503, 503, 503, 201, 201]
    names = {name for _, name in api.server.store.bucket(api.server.store.find_type("", "configmaps"))}
    assert names == {"one", "c3", "c4"}  # the refused writes left nothing


@pytest.mark.asyncio
async def test_latency_waits_the_drawn_delay_before_answering(api: Api) -> None:
    api.plan("{name: slow, match: {verbs: [get]}, effect: {type: latency, seconds: 0.75}}")
    assert (await api.session.get(f"{CONFIGMAPS}/one", headers=ADMIN)).status == 200
    assert (await api.session.get(CONFIGMAPS, headers=ADMIN)).status == 200
    assert api.slept == [0.75]
    assert api.server.faults.records[0]["detail"] == "delay 0.750000s"


@pytest.mark.asyncio
async def test_a_watch_is_closed_after_its_events_or_its_seconds(api: Api) -> None:
    api.plan("{name: close, match: {namespaces: [default]}, effect: {type: closeWatch, afterEvents: 1}}")
    watch = await api.session.get(CONFIGMAPS, params={"watch": "true"}, headers=ADMIN)
    lines = (await asyncio.wait_for(watch.read(), timeout=10)).splitlines()
    assert [json.loads(line)["type"] for line in lines] == ["ADDED"]
    api.plan("{name: close, effect: {type: closeWatch, afterSeconds: 0.2}}")
    now = str(api.server.store.revision)
    quiet = await api.session.get(CONFIGMAPS, params={"watch": "true", "resourceVersion": now}, headers=ADMIN)
    assert await asyncio.wait_for(quiet.read(), timeout=10) == b""
    assert api.server.faults.records[0]["detail"] == "closed after 0.2s"


@pytest.mark.asyncio
async def test_a_watch_resumed_from_a_version_gets_the_expired_error_event_and_ends(api: Api) -> None:
    api.plan("{name: expire, effect: {type: expireWatch}}")
    revision = api.server.store.revision
    watch = await api.session.get(CONFIGMAPS, params={"watch": "true", "resourceVersion": "1000"}, headers=ADMIN)
    assert watch.status == 200
    (line,) = (await asyncio.wait_for(watch.read(), timeout=10)).splitlines()
    assert json.loads(line) == {
        "type": "ERROR",
        "object": {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": f"too old resource version: 1000 ({revision})",
            "code": 410,
            "reason": "Expired",
        },
    }
    fresh = await api.session.get(CONFIGMAPS, params={"watch": "true", "timeoutSeconds": "1"}, headers=ADMIN)
    assert b'"ADDED"' in await asyncio.wait_for(fresh.read(), timeout=10)  # a watch from now is not expired


@pytest.mark.asyncio
async def test_a_plan_installed_while_watches_are_open_is_asked_for_them_and_ends_them(api: Api) -> None:
    # Watches live for minutes (kopf asks 300 s): a plan that only judged new watches would not touch them.
    now = str(api.server.store.revision)
    closing = await api.session.get(CONFIGMAPS, params={"watch": "true", "resourceVersion": now}, headers=ADMIN)
    expiring = await api.session.get(NAMESPACES, params={"watch": "true", "resourceVersion": now}, headers=ADMIN)
    await asyncio.sleep(0.2)
    await api.put_plan(
        "{name: expire, match: {resources: [namespaces]}, effect: {type: expireWatch}}",
        "{name: close, effect: {type: closeWatch, afterSeconds: 0.2}}",
    )
    assert await asyncio.wait_for(closing.read(), timeout=10) == b""
    (line,) = (await asyncio.wait_for(expiring.read(), timeout=10)).splitlines()
    event = json.loads(line)
    assert (event["type"], event["object"]["code"], event["object"]["reason"]) == ("ERROR", 410, "Expired")
    assert event["object"]["message"].startswith(f"too old resource version: {now} (")
    assert {r["rule"] for r in api.server.faults.records} == {"close", "expire"}


@pytest.mark.asyncio
async def test_asking_an_open_watch_leaves_the_other_rules_counters_as_they_were(api: Api) -> None:
    now = str(api.server.store.revision)
    watch = await api.session.get(CONFIGMAPS, params={"watch": "true", "resourceVersion": now}, headers=ADMIN)
    await asyncio.sleep(0.2)
    await api.put_plan(
        "{name: apf, every: 2, effect: {type: throttle}}",
        "{name: close, match: {verbs: [watch]}, effect: {type: closeWatch, afterSeconds: 0.2}}",
    )
    assert await asyncio.wait_for(watch.read(), timeout=10) == b""
    async with api.session.get("/_faults", headers=ADMIN) as response:
        matched = {rule["name"]: rule["matched"] for rule in (await response.json())["rules"]}
    assert matched == {"apf": 0, "close": 1}
    # every 2nd request the throttle rule matches is its first 429: the watch asked did not count as one
    first = await api.session.get(CONFIGMAPS, headers=ADMIN)
    second = await api.session.get(CONFIGMAPS, headers=ADMIN)
    assert (first.status, second.status) == (200, 429)


@pytest.mark.asyncio
async def test_a_served_fault_is_in_the_audit_trail_with_its_rule(api: Api) -> None:
    api.plan("{name: apf, every: 2, effect: {type: throttle}}")
    for _ in range(2):
        await api.session.get(CONFIGMAPS, headers=ADMIN)
    faulted = [entry for entry in api.server.audit if "fault" in entry]
    assert faulted == [
        {
            "stage": "ResponseComplete",
            "user": "sluice-local-admin",
            "verb": "list",
            "group": "",
            "resource": "configmaps",
            "subresource": "",
            "namespace": "default",
            "name": "",
            "userAgent": faulted[0]["userAgent"],
            "code": "429",
            "fault": "apf",
            "effect": "throttle",
        }
    ]
    assert api.server.audit_file is not None
    api.server.audit_file.close()  # drains the writer thread
    written = [json.loads(line) for line in api.server.audit_file.path.read_text().splitlines()]
    assert [entry for entry in written if "fault" in entry] == faulted


@pytest.mark.asyncio
async def test_answers_are_unchanged_byte_for_byte_while_no_rule_fires(api: Api) -> None:
    async def bodies() -> list[bytes]:
        got = [await (await api.session.get(path, headers=ADMIN)).read() for path in (CONFIGMAPS, f"{CONFIGMAPS}/one")]
        watch = await api.session.get(CONFIGMAPS, params={"watch": "true", "timeoutSeconds": "1"}, headers=ADMIN)
        return [*got, await asyncio.wait_for(watch.read(), timeout=10)]

    without = await bodies()
    api.plan("{name: never, match: {namespaces: [elsewhere]}, effect: {type: throttle}}")
    assert await bodies() == without


def test_a_bad_plan_file_stops_the_emulator_before_it_serves_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "faults.yaml"
    plan.write_text("rules: [{name: r, effect: {type: throttle, retryAfterSeconds: 0}}]")
    with pytest.raises(SystemExit) as stopped:
        main(["--kubeconfig", str(tmp_path / "kubeconfig"), "--faults", str(plan)])
    assert stopped.value.code == 2
    assert f"{plan}: rules[0].effect.retryAfterSeconds: Input should be greater than or equal to 1" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "kubeconfig").exists()
