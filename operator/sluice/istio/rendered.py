"""`Rendered`: one Istio object as sluice renders it. Pure data.

Its kind, name and namespace are typed fields (the writers key, log and address the object by them); `body` is the
JSON object sent to the API, exactly as written. Built by `sluice.istio.objects.istio_object`, which takes all of
them from the same values.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.api.jsontypes import JsonObject


@dataclass(frozen=True)
class Rendered:
    kind: str
    """The Istio kind (`sluice.istio.kinds`): `ServiceEntry`, `DestinationRule`, `VirtualService`, `EnvoyFilter`."""
    name: str
    namespace: str
    body: JsonObject
    """The whole object as written: apiVersion, kind, metadata and spec."""
