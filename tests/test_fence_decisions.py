"""The write fence's decision (`core.shards.Fence.deadline`) and the Lease objects' readers: pure, given now."""

from __future__ import annotations

import pytest

from sluice.core.shards import Fence, Tenure, holder_of, lease_body, lease_view, role_of, version_of


def test_a_write_goes_only_while_the_shard_is_held_in_the_pass_term_and_valid() -> None:
    fence = Fence(shard=2, term=7)
    held = Tenure(term=7, valid_until=108.0)
    assert fence.deadline(held, 100.0) == pytest.approx(8.0), "the request may take what is left of the validity"
    assert fence.deadline(held, 108.0) is None, "validity over"
    assert fence.deadline(None, 100.0) is None, "not held (or given up, or the fence closed)"
    assert fence.deadline(Tenure(term=8, valid_until=120.0), 100.0) is None, "held again, but in another term"
    assert Fence(shard=2, term=None).deadline(held, 100.0) is None, "the pass began while the shard was not held"


def test_a_lease_body_reads_back_through_the_readers() -> None:
    body = lease_body(
        "llm", "sluice", "sluice-shard-1-of-4", "shard", "a", "41", 10, "2026-12-01T00:00:00.000000Z", True
    )
    assert (holder_of(body), version_of(body), role_of(body)) == ("a", "41", "shard")
    assert body["spec"] == {
        "holderIdentity": "a",
        "leaseDurationSeconds": 10,
        "renewTime": "2026-12-01T00:00:00.000000Z",
        "acquireTime": "2026-12-01T00:00:00.000000Z",
    }
    view = lease_view(body, 30.0, unchanged_for=2.5)
    assert (view.holder, view.resource_version, view.duration, view.unchanged_for) == ("a", "41", 10.0, 2.5)
    cleared = lease_body("llm", "sluice", "sluice-shard-1-of-4", "shard", None, None, 10, "t", False)
    assert holder_of(cleared) is None
    assert "resourceVersion" not in cleared["metadata"]
    assert lease_view({"metadata": {}}, 30.0, 0.0).duration == 30.0, "no duration listed: the replica's own"
