"""The demo's story as a test: every claim `make demo` prints is checked here, on the same stack."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sluice.devstack.demo import run_story, summary
from sluice.devstack.stack import Stack

pytestmark = pytest.mark.slow


def test_every_claim_of_the_demo_holds(tmp_path: Path) -> None:
    with Stack(tmp_path, deadline_seconds=400) as stack:
        story = asyncio.run(run_story(stack, quiet=True))
    print(summary(story))
    failed = [claim.text for claim in story.claims if not claim.held]
    assert not failed, failed
    assert len(story.claims) == 13
    served = [s for s in story.traffic.finished() if s.ok]
    assert len(served) > 500
