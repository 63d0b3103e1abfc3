"""The API emulator's label selectors, as Kubernetes defines them (equality, set-based, existence)."""

from __future__ import annotations

import pytest

from sluice.emulator.apiselect import label_selector_matches

LABELS = {"app": "llama", "tier": "gpu", "sluice.dev/pool": "p1"}


@pytest.mark.parametrize(
    ("selector", "matches"),
    [
        ("", True),
        ("app=llama", True),
        ("app==llama", True),
        ("app=mistral", False),
        ("app!=mistral", True),
        ("app!=llama", False),
        ("missing!=x", True),
        ("missing=x", False),
        ("app=llama,tier=gpu", True),
        ("app=llama,tier=cpu", False),
        ("tier in (gpu, cpu)", True),
        ("tier in (cpu)", False),
        ("missing in (x)", False),
        ("tier notin (cpu)", True),
        ("tier notin (gpu,cpu)", False),
        ("missing notin (x)", True),
        ("sluice.dev/pool", True),
        ("missing", False),
        ("!missing", True),
        ("!app", False),
        ("app=llama,tier in (gpu),!missing,sluice.dev/pool=p1", True),
    ],
)
def test_label_selector(selector: str, matches: bool) -> None:
    assert label_selector_matches(selector, LABELS) is matches
    assert label_selector_matches(selector, dict(LABELS)) is matches, "the same answer with the parse cached"
