"""Evidence of a run for `sluice.devstack.invariants`: every version of the watched objects, with the time it was
seen, and the API server's audit entries, stamped when they were read.

Local-stack tool. `Recorder` watches (one thread per resource, the official client's `watch`, resumed from the
last resourceVersion when a watch ends) the Istio objects sluice writes, the pools, the pods and the Leases of a
namespace, and tails the emulator's audit file. Times are `time.monotonic()`, one clock for all the evidence.
The audit file (`sluice.emulator.apiserver.AuditFile`) has no timestamps and no bodies: an entry's time here is
when this process read it, a bound late by the poll period and the file's flush.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client as k8s
from kubernetes import watch

from sluice.api.jsontypes import JsonObject, text
from sluice.devstack.invariants import Version
from sluice.istio.kinds import ISTIO_KINDS

ISTIO_RESOURCES = tuple(kind.plural for kind in ISTIO_KINDS.values())


def _list_call(api: k8s.ApiClient, resource: str, namespace: str) -> tuple[Callable[..., Any], tuple[str, ...]]:
    """The list function a watch of `resource` streams, and its positional arguments."""
    if resource == "pods":
        return k8s.CoreV1Api(api).list_namespaced_pod, (namespace,)
    if resource == "leases":
        return k8s.CoordinationV1Api(api).list_namespaced_lease, (namespace,)
    custom = k8s.CustomObjectsApi(api)
    if resource == "inferencepools":
        return custom.list_namespaced_custom_object, ("inference.sluice.dev", "v1alpha1", namespace, resource)
    kind = next(k for k in ISTIO_KINDS.values() if k.plural == resource)
    return custom.list_namespaced_custom_object, (kind.group, kind.version, namespace, resource)


class Recorder:
    """`with Recorder(api, namespace, audit_file, seconds) as recorder:` ... `recorder.versions`,
    `recorder.audit`. Stops by itself after `seconds`."""

    def __init__(
        self,
        api: k8s.ApiClient,
        namespace: str,
        audit_file: Path | None,
        seconds: float,
        resources: tuple[str, ...] = (*ISTIO_RESOURCES, "inferencepools", "pods", "leases"),
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.audit_file = audit_file
        self.resources = resources
        self.end = time.monotonic() + seconds
        self.versions: list[Version] = []
        self.audit: list[tuple[float, JsonObject]] = []
        """(when read, the audit entry)."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._watch, args=(r,), name=f"record-{r}", daemon=True) for r in resources
        ]
        if audit_file is not None:
            self._threads.append(threading.Thread(target=self._tail, name="record-audit", daemon=True))

    def __enter__(self) -> Recorder:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)

    def snapshot(self) -> list[Version]:
        with self._lock:
            return list(self.versions)

    def _running(self) -> bool:
        return not self._stop.is_set() and time.monotonic() < self.end

    def _watch(self, resource: str) -> None:
        call, args = _list_call(self.api, resource, self.namespace)
        version = ""
        while self._running():
            stream = watch.Watch()  # type: ignore[no-untyped-call]
            options: dict[str, Any] = {"timeout_seconds": 1, "_request_timeout": 5}  # short: `stop` is heard
            if version:
                options["resource_version"] = version
            try:
                for event in stream.stream(call, *args, **options):  # type: ignore[no-untyped-call]
                    version = self._keep(resource, event) or version
                    if not self._running():
                        break
            except k8s.ApiException:
                version = ""  # expired (410): watch again from a list, whose ADDED events repeat what is there
                time.sleep(0.1)
            except (OSError, ValueError):
                time.sleep(0.1)
            finally:
                stream.stop()  # type: ignore[no-untyped-call]

    def _keep(self, resource: str, event: dict[str, Any]) -> str:
        """Record one watch event; its resourceVersion ("" for a bookmark or an error)."""
        if event.get("type") not in ("ADDED", "MODIFIED", "DELETED"):
            return ""
        body: JsonObject = event["raw_object"]
        seen = Version(time.monotonic(), str(event["type"]), resource, text(body, "metadata", "name"), body)
        with self._lock:
            self.versions.append(seen)
        return text(body, "metadata", "resourceVersion")

    def _tail(self) -> None:
        assert self.audit_file is not None
        offset = 0
        while self._running():
            with contextlib.suppress(OSError), self.audit_file.open("rb") as log:
                log.seek(offset)
                data = log.read()
                complete = data[: data.rfind(b"\n") + 1]  # a line still being written is not an entry yet
                offset += len(complete)
                now = time.monotonic()
                entries = [json.loads(line) for line in complete.splitlines() if line.strip()]
                with self._lock:
                    self.audit += [(now, entry) for entry in entries]
            time.sleep(0.05)


__all__ = ["ISTIO_RESOURCES", "Recorder"]
