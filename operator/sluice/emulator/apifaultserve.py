"""The HTTP side of the API emulator's faults: the `/_faults` admin endpoint, faults' answers as responses, and
`FaultServing`, the part of `apiserver.ApiServer` that asks the plan and serves, records and audits its faults.

Called by `apiserver`. `/_faults` is the emulator's own endpoint, not a Kubernetes API: `GET` reports the plan and
what it served (`FaultInjector.status`), `PUT` replaces the plan (a YAML or JSON body; `kubectl replace --raw
/_faults -f plan.yaml` sends one) and answers with the new status. Only the cluster admin (system:masters) may use
it; anyone else gets kube-apiserver's 403 for a non-resource path.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import aiohttp.web

from sluice.emulator.apifaultplan import CloseWatch, ExpireWatch, FaultRule, PlanError, load_plan
from sluice.emulator.apifaults import Answer, Decision, FaultInjector, FaultRequest, WatchCut, expired_message
from sluice.emulator.apirbac import User, forbidden_path_message
from sluice.emulator.apistore import ApiError, ResourceType, Store

FAULTS_PATH = "/_faults"


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    body: dict[str, object] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
    body |= {"message": message, "reason": reason, "code": code}
    return aiohttp.web.json_response(body, status=code)


def admin(injector: FaultInjector, user: User, method: str, body: bytes) -> aiohttp.web.Response:
    """`GET` or `PUT /_faults` for the admin; 403 for anyone else, 405 for other methods, 400 for a bad plan."""
    verb = {"GET": "get", "PUT": "put"}.get(method, method.lower())
    if not user.is_admin:
        return _status(403, "Forbidden", forbidden_path_message(user, verb, FAULTS_PATH))
    if method == "PUT":
        try:
            plan = load_plan(body.decode("utf-8", errors="replace"), "fault plan")
        except PlanError as failure:
            return _status(400, "BadRequest", str(failure))
        injector.install(plan)
    elif method != "GET":
        return _status(405, "MethodNotAllowed", f"{FAULTS_PATH} answers GET and PUT, not {method}")
    return aiohttp.web.json_response(injector.status())


def respond(answer: Answer) -> aiohttp.web.Response:
    """The answer byte for byte: its own Content-Type, never aiohttp's default charset suffix."""
    response = aiohttp.web.Response(status=answer.code, body=answer.body)
    for name, value in answer.headers:
        response.headers[name] = value
    return response


def audit_entry(request: FaultRequest, subresource: str, code: int, rule: str, effect: str) -> dict[str, str]:
    """The audit trail's entry for a request answered by a fault (stage ResponseComplete, with the rule)."""
    return {
        "stage": "ResponseComplete",
        "user": request.user,
        "verb": request.verb,
        "group": request.group,
        "resource": request.resource,
        "subresource": subresource,
        "namespace": request.namespace,
        "name": request.name,
        "userAgent": request.user_agent,
        "code": str(code),
        "fault": rule,
        "effect": effect,
    }


def answer_detail(answer: Answer) -> str:
    """How a fault's answer is recorded: its code and Retry-After, and the Status reason when there is one."""
    headers = dict(answer.headers)
    detail = str(answer.code)
    if "Retry-After" in headers:
        detail += f" Retry-After {headers['Retry-After']}"
    if headers.get("Content-Type") == "application/json":
        detail += f" {json.loads(answer.body).get('reason', '')}"
    return detail


class ClosedByFault(Exception):
    """A closeWatch fault ends the stream (as kube-apiserver ends a watch it stops: the response just ends)."""


class FaultServing:
    """The fault plan's side of `ApiServer` (a mixin: the server declares the fields and the two hooks)."""

    faults: FaultInjector
    fault_sleep: Callable[[float], Awaitable[None]]
    store: Store
    audit: list[dict[str, str]]

    def _verb(self, request: Any) -> str:
        raise NotImplementedError

    def _write_audit(self, entry: dict[str, str]) -> None:
        raise NotImplementedError

    def _wake_watches(self) -> None:
        raise NotImplementedError

    def _serve_admin(self, request: Any, user: User) -> aiohttp.web.Response:
        """`/_faults`; a plan replaced there wakes the open watches, which ask it now, not at their next wake-up."""
        installed = self.faults.generation
        answer = admin(self.faults, user, str(request._raw_request.method), request.body)
        if self.faults.generation != installed:
            self._wake_watches()
        return answer

    async def _decide_fault(
        self, request: Any, rtype: ResourceType, user: User
    ) -> tuple[FaultRequest | None, Decision]:
        """The fault plan's decision for a resource request; a latency fault's delay is waited here."""
        if not self.faults.active:
            return None, Decision()
        asked = self._fault_request(request, rtype, user)
        decision = self.faults.decide(asked)
        for rule, seconds in decision.delays:
            self.faults.record(rule, "latency", asked, f"delay {seconds:.6f}s")
        if decision.delay > 0:
            await self.fault_sleep(decision.delay)
        return asked, decision

    def _fault_request(self, request: Any, rtype: ResourceType, user: User) -> FaultRequest:
        """What a rule can match of one resource request."""
        return FaultRequest(
            self._verb(request),
            rtype.group,
            rtype.plural,
            (request.namespace or "") if rtype.namespaced else "",
            request.name or "",
            user.name,
            request.headers.get("User-Agent", ""),
            request.params.get("resourceVersion", ""),
        )

    def _open_watch_fault(
        self, request: Any, rtype: ResourceType, user: User, seen_up_to: int
    ) -> tuple[FaultRule, FaultRequest] | None:
        """A plan installed while a watch is open is asked for it, as for a watch from the version it has seen up
        to: a closeWatch or expireWatch rule that fires is the watch's fault from then on (None: none fires). Only
        those rules are asked (`FaultInjector.decide_open_watch`): the others' counters are left as they were."""
        if not self.faults.active:
            return None
        asked = replace(self._fault_request(request, rtype, user), resource_version=str(seen_up_to))
        rule = self.faults.decide_open_watch(asked).rule
        if rule is None or not isinstance(rule.effect, CloseWatch | ExpireWatch):
            return None
        return rule, asked

    def _reask_watch(
        self, request: Any, rtype: ResourceType, user: User, seen_up_to: int, deadline: float
    ) -> tuple[tuple[FaultRule, FaultRequest] | None, WatchCut, float, bool]:
        """An open watch asks a plan installed since it began: its fault (None: none fires), its closeWatch
        progress, and its deadline (on the event loop's clock) with whether the fault's comes first."""
        fault = self._open_watch_fault(request, rtype, user, seen_up_to)
        effect = fault[0].effect if fault is not None else None
        cut = WatchCut(effect if isinstance(effect, CloseWatch) else None)
        return (fault, cut, *cut.deadline(asyncio.get_running_loop().time(), deadline))

    def _serve_fault(self, asked: FaultRequest, request: Any, rule: FaultRule, answer: Answer) -> aiohttp.web.Response:
        self.faults.record(rule.name, rule.effect.type, asked, answer_detail(answer))
        self._audit_fault(asked, request.subresource or "", answer.code, rule)
        return respond(answer)

    def _audit_fault(self, asked: FaultRequest, subresource: str, code: int, rule: FaultRule) -> None:
        entry = audit_entry(asked, subresource, code, rule.name, rule.effect.type)
        self.audit.append(entry)
        self._write_audit(entry)

    async def _expire_watch(
        self, response: aiohttp.web.StreamResponse, since: int, rule: FaultRule, asked: FaultRequest
    ) -> aiohttp.web.StreamResponse:
        """The watch cache's answer to a watch from a version it no longer holds: the watch is accepted (200) and
        its only event is an ERROR carrying the 410 Expired Status (k8s.io/apiserver v0.32.0
        pkg/storage/cacher/cacher.go Watch: `return newErrWatcher(err), nil`, "to match the uncached watch
        implementation ... other errors must fail with a watch event of type ERROR"), then the stream ends. An open
        watch expired by a plan installed since gets the same message, the watch cache's; kube-apiserver's uncached
        etcd3 watch sends "The resourceVersion for the provided watch is too old." mid-stream (etcd3/watcher.go
        interpretWatchError), also a 410 Expired, on which clients list again just the same."""
        expired = ApiError(410, "Expired", expired_message(since, self.store.revision))
        await response.write((json.dumps({"type": "ERROR", "object": expired.status()}) + "\n").encode())
        self.faults.record(rule.name, rule.effect.type, asked, f"ERROR 410 Expired: {expired.message}")
        self._audit_fault(asked, "", 200, rule)
        return response

    def _watch_closed(self, rule: FaultRule, asked: FaultRequest, detail: str) -> None:
        self.faults.record(rule.name, rule.effect.type, asked, detail)
        self._audit_fault(asked, "", 200, rule)
