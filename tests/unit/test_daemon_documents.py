"""A unit's saved state as a typed document: what it writes, how a damaged one is taken back.

The snapshot's document is tests/unit/test_snapshot.py's.
"""

from __future__ import annotations

import json

from gpuguard.daemon.documents import UNIT_STATE_SCHEMA, UnitStateDocument

RECORD = {"started_at": "2026-01-01T00:00:00+00:00", "result": "restarted"}


def test_a_saved_unit_state_round_trips() -> None:
    """What the daemon saves is what it takes back, with no problem named."""
    saved = UnitStateDocument("b00t", {"attempts_without_help": 1}, (RECORD,), None)
    document, problems = UnitStateDocument.parse(json.loads(json.dumps(saved.to_json())))
    assert problems == []
    assert document == saved
    assert saved.to_json()["schema_version"] == UNIT_STATE_SCHEMA


def test_a_file_from_before_versions_is_read_as_version_one() -> None:
    """Older daemons wrote no schema_version: the same fields, taken back as they are."""
    document, problems = UnitStateDocument.parse(
        {"boot_id": "b00t", "planner": {}, "recoveries": [RECORD], "in_progress": RECORD}
    )
    assert problems == []
    assert document.in_progress == RECORD
    assert document.recoveries == (RECORD,)


def test_each_damaged_field_is_named_and_starts_fresh() -> None:
    """A wrong type never stops the daemon: that part is left out, the rest is kept."""
    document, problems = UnitStateDocument.parse(
        {"boot_id": 7, "planner": [1], "recoveries": [RECORD, "x", 3], "in_progress": "yes"}
    )
    assert problems == [
        "planner is not an object",
        "2 recoveries are not objects",
        "in_progress is not an object",
    ]
    assert document == UnitStateDocument(None, None, (RECORD,), None)


def test_an_unknown_version_is_left_out_whole() -> None:
    """A newer gpuguard's file is not half-understood: the unit starts fresh, and says why."""
    document, problems = UnitStateDocument.parse({"schema_version": 2, "recoveries": [RECORD]})
    assert problems == ["schema_version 2 is not 1"]
    assert document == UnitStateDocument(None, None, (), None)
