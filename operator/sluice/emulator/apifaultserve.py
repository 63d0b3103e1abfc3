"""The HTTP side of the API emulator's faults: the `/_faults` admin endpoint and faults' answers as responses.

Called by `apiserver`. `/_faults` is the emulator's own endpoint, not a Kubernetes API: `GET` reports the plan and
what it served (`FaultInjector.status`), `PUT` replaces the plan (a YAML or JSON body; `kubectl replace --raw
/_faults -f plan.yaml` sends one) and answers with the new status. Only the cluster admin (system:masters) may use
it; anyone else gets kube-apiserver's 403 for a non-resource path.
"""

from __future__ import annotations

import json

import aiohttp.web

from sluice.emulator.apifaultplan import PlanError, load_plan
from sluice.emulator.apifaults import Answer, FaultInjector, FaultRequest
from sluice.emulator.apirbac import User, forbidden_path_message

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
