"""Authentication and RBAC of the Kubernetes API emulator, enforced on every request as kube-apiserver does.

Local-stack tool, called by `apiserver`. Authentication: a bearer token maps to a user — the kubeconfig's admin
token to a member of `system:masters` (which RBAC never restricts, like a cluster-admin certificate), tokens minted
through the TokenRequest API (`kubectl create token SA`) to `system:serviceaccount:<namespace>:<name>` in the
groups `system:serviceaccounts`, `system:serviceaccounts:<namespace>` and `system:authenticated`; an unknown token
is 401, no token is `system:anonymous`. Authorization: the Roles, ClusterRoles, RoleBindings and
ClusterRoleBindings stored in the emulator, with RBAC's rules (API groups, resources and `resource/subresource`,
verbs, resourceNames, `*`), ClusterRoleBindings cluster-wide, RoleBindings in their namespace; a denial is a 403
worded as the API server words it:
`inferencepools.inference.sluice.dev "llama" is forbidden: User "system:serviceaccount:sluice-system:sluice" cannot
patch resource "inferencepools" in API group "inference.sluice.dev" in the namespace "llm"`.
Impersonation (`kubectl --as`, `--as-group`) needs `impersonate` on users, groups or serviceaccounts (admins have
it); SelfSubjectAccessReview (`kubectl auth can-i`) and SelfSubjectReview (`kubectl auth whoami`) are open to every
authenticated user, as the system:basic-user ClusterRole makes them. Not emulated: aggregated ClusterRoles
(aggregationRule), client certificates.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

ADMIN_GROUP = "system:masters"
AUTHENTICATED = "system:authenticated"
ANONYMOUS = "system:anonymous"
# Paths anyone may read (system:public-info-viewer) and paths every authenticated user may read (system:discovery).
PUBLIC_PATHS = ("/version", "/healthz", "/livez", "/readyz")
DISCOVERY_PREFIXES = ("/api", "/apis", "/openapi", "/version")


@dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...]

    @property
    def is_admin(self) -> bool:
        return ADMIN_GROUP in self.groups


ANONYMOUS_USER = User(ANONYMOUS, ("system:unauthenticated",))


def service_account_user(namespace: str, name: str) -> User:
    return User(
        f"system:serviceaccount:{namespace}:{name}",
        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", AUTHENTICATED),
    )


class Authenticator:
    """Bearer tokens and who they are."""

    def __init__(self) -> None:
        self.tokens: dict[str, User] = {}

    def add(self, token: str, user: User) -> None:
        self.tokens[token] = user

    def mint(self, user: User) -> str:
        token = f"sluice-local.{secrets.token_urlsafe(24)}"
        self.tokens[token] = user
        return token

    def authenticate(self, authorization: str | None) -> User | None:
        """The user of a request; None for a token nobody issued (401)."""
        if not authorization:
            return ANONYMOUS_USER
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        return self.tokens.get(token.strip())


@dataclass(frozen=True)
class Request:
    """What RBAC judges: kube-apiserver's authorizer.Attributes for a resource request."""

    verb: str
    group: str
    resource: str
    subresource: str
    namespace: str
    name: str


def _subject_matches(subject: dict[str, Any], user: User, binding_namespace: str) -> bool:
    kind, name = subject.get("kind"), subject.get("name")
    if kind == "User":
        return name == user.name
    if kind == "Group":
        return name in user.groups
    if kind == "ServiceAccount":
        namespace = subject.get("namespace") or binding_namespace
        return user.name == f"system:serviceaccount:{namespace}:{name}"
    return False


def _rule_allows(rule: dict[str, Any], request: Request) -> bool:
    groups, resources, verbs = rule.get("apiGroups") or [], rule.get("resources") or [], rule.get("verbs") or []
    if "*" not in verbs and request.verb not in verbs:
        return False
    if "*" not in groups and request.group not in groups:
        return False
    wanted = f"{request.resource}/{request.subresource}" if request.subresource else request.resource
    if not any(r in ("*", wanted) or (r == f"*/{request.subresource}" and request.subresource) for r in resources):
        return False
    names = rule.get("resourceNames") or []
    return not names or (bool(request.name) and request.name in names)


class Rbac:
    """RBAC over the RBAC objects of a store: `objects(plural)` returns every stored object of that rbac kind."""

    def __init__(self, objects: Any) -> None:
        self.objects = objects

    def _role_rules(self, ref: dict[str, Any], binding_namespace: str) -> tuple[list[dict[str, Any]], str]:
        kind, name = ref.get("kind"), ref.get("name", "")
        if kind == "ClusterRole":
            found = [o for o in self.objects("clusterroles") if o["metadata"]["name"] == name]
            missing = f'RBAC: clusterrole.rbac.authorization.k8s.io "{name}" not found'
        else:
            found = [
                o
                for o in self.objects("roles")
                if o["metadata"]["name"] == name and o["metadata"].get("namespace") == binding_namespace
            ]
            missing = f'RBAC: role.rbac.authorization.k8s.io "{name}" not found'
        if not found:
            return [], missing
        return list(found[0].get("rules") or []), ""

    def authorize(self, user: User, request: Request) -> tuple[bool, str]:
        """(allowed, reason): the reason names a binding's missing role, as the RBAC authorizer does."""
        if user.is_admin or (AUTHENTICATED in user.groups and (request.group, request.resource) in SELF_REVIEWS):
            return True, ""
        reasons: list[str] = []
        bindings = [(b, "") for b in self.objects("clusterrolebindings")]
        if request.namespace:
            bindings += [
                (b, request.namespace)
                for b in self.objects("rolebindings")
                if b["metadata"].get("namespace") == request.namespace
            ]
        for binding, namespace in bindings:
            if not any(_subject_matches(s, user, namespace) for s in binding.get("subjects") or []):
                continue
            rules, missing = self._role_rules(binding.get("roleRef") or {}, namespace)
            if missing:
                reasons.append(missing)
            if any(_rule_allows(rule, request) for rule in rules):
                return True, ""
        return False, ", ".join(reasons)


SELF_REVIEWS = {("authorization.k8s.io", "selfsubjectaccessreviews"), ("authentication.k8s.io", "selfsubjectreviews")}


def impersonated(headers: dict[str, Any], rbac: Rbac, requester: User) -> User | str:
    """The user a request acts as: the requester, or whom it impersonates if allowed (else the 403 message)."""
    name = headers.get("Impersonate-User")
    groups = [v for k, v in headers.items() if k.lower() == "impersonate-group"]
    if not name:
        return requester
    if name.startswith("system:serviceaccount:") and name.count(":") == 3:
        _, _, namespace, account = name.split(":")
        checks = [Request("impersonate", "", "serviceaccounts", "", namespace, account)]
        target = service_account_user(namespace, account)
    else:
        checks = [Request("impersonate", "", "users", "", "", name)]
        target = User(name, (*groups, AUTHENTICATED))
    checks += [Request("impersonate", "", "groups", "", "", group) for group in groups]
    for check in checks:
        allowed, reason = rbac.authorize(requester, check)
        if not allowed:
            return forbidden_message(requester, check, reason)
    if groups and name.startswith("system:serviceaccount:"):
        target = User(target.name, (*target.groups, *groups))
    return target


def forbidden_message(user: User, request: Request, reason: str) -> str:
    """responsewriters.ForbiddenStatusError's words."""
    resource = f"{request.resource}/{request.subresource}" if request.subresource else request.resource
    text = f'User "{user.name}" cannot {request.verb} resource "{resource}" in API group "{request.group}"'
    text += f' in the namespace "{request.namespace}"' if request.namespace else " at the cluster scope"
    if reason:
        text += f": {reason}"
    group_resource = f"{request.resource}.{request.group}" if request.group else request.resource
    subject = f'{group_resource} "{request.name}"' if request.name else group_resource
    return f"{subject} is forbidden: {text}"


def forbidden_path_message(user: User, verb: str, path: str) -> str:
    return f'forbidden: User "{user.name}" cannot {verb} path "{path}"'


def path_allowed(user: User, path: str) -> bool:
    """Non-resource URLs: public ones for anyone, discovery and OpenAPI for every authenticated user."""
    path = path.rstrip("/") or "/"
    if user.is_admin or path in PUBLIC_PATHS:
        return True
    if AUTHENTICATED not in user.groups:
        return False
    return any(path == prefix or path.startswith(prefix + "/") for prefix in DISCOVERY_PREFIXES)
