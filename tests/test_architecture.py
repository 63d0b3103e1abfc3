"""ARCHITECTURE.md's module map stays true: every module of the package is named there, and every module it names
exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "operator" / "sluice"
NAMED = re.compile(r"`(sluice(?:\.[a-z_0-9]+)*)`")


def modules() -> set[str]:
    out = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.add(".".join(parts))
    return out


def named() -> set[str]:
    return set(NAMED.findall((ROOT / "ARCHITECTURE.md").read_text()))


def test_every_module_is_on_the_map() -> None:
    missing = sorted(modules() - named())
    assert not missing, f"ARCHITECTURE.md does not name: {missing}"


def test_the_map_names_only_modules_that_exist() -> None:
    gone = sorted(name for name in named() - modules() if not any(m.startswith(name + ".") for m in modules()))
    assert not gone, f"ARCHITECTURE.md names modules that do not exist: {gone}"
