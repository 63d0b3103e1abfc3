"""The JSON readers narrow instead of trusting a shape."""

from sluice.api.jsontypes import members, text

POD = {"metadata": {"name": "p-0", "labels": {"app": "m"}}, "spec": "not a mapping", "status": None}


def test_members_walks_mappings_and_gives_an_empty_one_elsewhere() -> None:
    assert members(POD, "metadata", "labels") == {"app": "m"}
    assert members(POD, "spec") == {}
    assert members(POD, "spec", "containers") == {}
    assert members(POD, "status", "phase") == {}
    assert members(POD, "missing") == {}
    assert members(["a list"], "metadata") == {}


def test_text_reads_strings_only() -> None:
    assert text(POD, "metadata", "name") == "p-0"
    assert text(POD, "metadata", "labels") == ""
    assert text(POD, "spec", default="-") == "not a mapping"
    assert text(POD, "status", default="-") == "-"
    assert text(POD, "metadata", "missing", default="?") == "?"
    assert text("bare") == "bare"
    assert text(3, default="n") == "n"
