"""The operator's /metrics page as the local-stack tools and the end-to-end tests read it.

Local-stack tool: the page is read over HTTP on 127.0.0.1 (`--metrics-port`); a page that cannot be read is None,
never an error, since the operator may be starting, stopped or killed."""

from __future__ import annotations

import urllib.request


def operator_page(port: int) -> str | None:
    """The operator's /metrics page on `port`; None while it cannot be read."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            return str(answer.read().decode())
    except OSError:
        return None


def samples(page: str | None) -> dict[str, float]:
    """Series (`name{labels}`) -> value of every sample on a page (empty for None)."""
    found = {}
    for line in (page or "").splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            found[series] = float(value)
    return found


def passes_done(port: int, pool: str) -> float | None:
    """`sluice_reconcile_total` of one pool (every result) from the operator's /metrics on `port`; None when the
    page cannot be read or has no such series yet."""
    prefix = f'sluice_reconcile_total{{pool="{pool}",'
    counts = [v for series, v in samples(operator_page(port)).items() if series.startswith(prefix)]
    return sum(counts) if counts else None


__all__ = ["operator_page", "passes_done", "samples"]
