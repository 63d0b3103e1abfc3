"""Which client Sidecars hide the pool's hosts from their proxies. Pure.

A namespace's `Sidecar` (else the root namespace's selector-less one, the mesh default) limits what its proxies
see to its egress hosts (pilot/pkg/model/sidecar.go): one whose hosts do not include the pool's hides sluice's
routing from them. The findings go into the mesh plan (`sluice.core.mesh`).
"""

from __future__ import annotations

from sluice.api.v1alpha1 import InferencePoolSpec
from sluice.core.observed import ObservedSidecar


def _matches(pattern: str, sidecar_namespace: str, namespace: str, host: str) -> bool:
    """A Sidecar egress host `<namespace>/<dnsName>` (pilot/pkg/model/sidecar.go): '*' any namespace, '.' the
    Sidecar's own, '~' none; a dnsName '*' or '*.<suffix>' wildcard."""
    where, _, name = pattern.rpartition("/")
    if where == "~":
        return False
    if where not in ("*", "") and (sidecar_namespace if where == "." else where) != namespace:
        return False
    if name == "*":
        return True
    if name.startswith("*."):
        return host.endswith(name[1:])
    return name == host


def _hidden(sidecar: ObservedSidecar, namespace: str, hosts: list[str]) -> list[str]:
    """The hosts no egress listener of the Sidecar lets its proxies see."""
    if sidecar.egress_hosts is None:
        return []
    return [
        host
        for host in hosts
        if not any(
            _matches(p, sidecar.namespace, namespace, host) for listener in sidecar.egress_hosts for p in listener
        )
    ]


def sidecar_findings(
    spec: InferencePoolSpec, namespace: str, sidecars: list[ObservedSidecar], hosts: list[str]
) -> list[str]:
    """Sidecars that hide the pool's hosts from proxies that call it: a namespace's own Sidecar, else the root
    namespace's selector-less one (the mesh default). In a namespace routing.clientNamespaces lists, hiding any of
    the hosts is a finding; elsewhere only the Service visible and the ServiceEntry host hidden is (its proxies
    would follow the VirtualService to a cluster they do not have) — a Sidecar hiding the Service too just means
    the namespace is no client."""
    root = spec.routing.root_namespace
    listed = spec.routing.client_namespaces
    clients = None if listed is None or "*" in listed else {namespace if n == "." else n for n in listed}
    findings = []
    for sidecar in sorted(sidecars, key=lambda s: (s.namespace, s.name)):
        if sidecar.namespace == root and sidecar.selects_workloads:
            continue  # a root-namespace Sidecar with a selector governs nothing outside the root namespace
        if clients is not None and sidecar.namespace not in clients and sidecar.namespace != root:
            continue
        hidden = _hidden(sidecar, namespace, hosts)
        if not hidden:
            continue
        if clients is None and (hosts[0] in hidden or len(hosts) == 1):
            continue  # not a client: it does not see the Service either
        if sidecar.namespace == root and not sidecar.selects_workloads:
            scope = "namespaces without their own Sidecar"
        elif sidecar.selects_workloads:
            scope = f"some workloads of namespace {sidecar.namespace}"
        else:
            scope = f"namespace {sidecar.namespace}"
        findings.append(
            f"Sidecar {sidecar.namespace}/{sidecar.name} hides {', '.join(hidden)} from the proxies of {scope}: "
            f"add '{namespace}/*' (or the hosts) to its egress hosts"
        )
    return findings
