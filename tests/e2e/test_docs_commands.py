"""The command blocks the docs mark `<!-- local-stack -->` run literally, line by line, against the local stack.

README.md and docs/guide.md mark each fenced block a reader types against the local stack. This test runs every
line of them, unchanged, in a directory laid out as the checkout after `make demo DEMO_ARGS=--keep` (its
`out/demo/kubeconfig` is this stack's), so a command that needs a flag the docs do not show fails here. Two
kubectl behaviours are expected rather than errors: `kubectl diff` exits 1 when it found differences, and a watch
(`-w`) runs until stopped (it must print before it is stopped after a few seconds).
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.devstack.stack import ROOT, Stack

pytestmark = pytest.mark.slow

MARKED_BLOCK = re.compile(r"<!-- local-stack -->\n```[a-z]*\n(.*?)```", re.S)
DOCS = [ROOT / "README.md", ROOT / "docs" / "guide.md"]


def marked_commands(path: Path) -> list[str]:
    lines = [line.strip() for block in MARKED_BLOCK.findall(path.read_text()) for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Stack]]:
    """A stack with its pool and pods' objects, and a directory that looks like the checkout after the demo. GIE's
    InferencePool CRD is installed beside sluice's: the docs' commands must name sluice's kind unambiguously."""
    stack = Stack(Path(tmp_path_factory.mktemp("docs")), deadline_seconds=300)
    stack.workdir.mkdir(parents=True, exist_ok=True)
    try:
        stack.start_apiserver(with_gie=True)
        root = stack.workdir / "checkout"
        (root / "out" / "demo").mkdir(parents=True)
        (root / "out" / "demo" / "kubeconfig").symlink_to(stack.kubeconfig)
        (root / "examples").symlink_to(ROOT / "examples")
        stack.kubectl("apply", "-f", str(ROOT / "examples" / "pools" / "heterogeneous.yaml"))
        yield root, stack
    finally:
        stack.close()


def run_literally(commands: list[str], cwd: Path, env: dict[str, str]) -> None:
    for command in commands:
        if command.startswith("export "):
            name, _, value = command.removeprefix("export ").partition("=")
            env[name] = value  # as typed; relative paths resolve in the checkout, the commands' working directory
            continue
        watching = " -w" in f" {command} " or "--watch" in command
        process = subprocess.Popen(
            ["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            out, err = process.communicate(timeout=4 if watching else 60)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
            assert watching, f"{command!r} did not finish"
            assert out.strip(), f"{command!r} printed nothing while watching"
            continue
        allowed = (0, 1) if shlex.split(command)[:2] == ["kubectl", "diff"] else (0,)
        assert process.returncode in allowed, f"{command!r} exited {process.returncode}: {err.strip()}"
        assert "--validate=false" not in err, f"{command!r}: {err.strip()}"


def test_the_docs_mark_the_local_stack_blocks_they_contain() -> None:
    assert len(marked_commands(ROOT / "README.md")) >= 5
    assert len(marked_commands(ROOT / "docs" / "guide.md")) >= 6


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_marked_command_runs_as_written(checkout: tuple[Path, Stack], doc: Path) -> None:
    root, stack = checkout
    env = stack.kube_env()  # the guide's reader has a kubeconfig in place
    env.pop("PYTHONWARNINGS", None)
    run_literally(marked_commands(doc), root, env)
