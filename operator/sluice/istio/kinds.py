"""The Istio kinds sluice writes: apiVersion and plural, declared once. Pure data.

Used by the renderer (apiVersion), the Kubernetes adapter (paths), the pruning pass (which kinds to list) and the
local stack (the API emulator serves them; the traffic generator reads them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IstioKind:
    kind: str
    group: str
    version: str
    plural: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


SERVICE_ENTRY = IstioKind("ServiceEntry", "networking.istio.io", "v1", "serviceentries")
DESTINATION_RULE = IstioKind("DestinationRule", "networking.istio.io", "v1", "destinationrules")
VIRTUAL_SERVICE = IstioKind("VirtualService", "networking.istio.io", "v1", "virtualservices")
ENVOY_FILTER = IstioKind("EnvoyFilter", "networking.istio.io", "v1alpha3", "envoyfilters")  # v1alpha3 only

ISTIO_KINDS: dict[str, IstioKind] = {
    k.kind: k for k in (SERVICE_ENTRY, DESTINATION_RULE, VIRTUAL_SERVICE, ENVOY_FILTER)
}
