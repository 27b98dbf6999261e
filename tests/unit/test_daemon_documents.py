"""The daemon's files as typed documents: what they write, and how a damaged one is taken back."""

from __future__ import annotations

import json

from gpuguard.daemon.documents import (
    SNAPSHOT_SCHEMA,
    UNIT_STATE_SCHEMA,
    Snapshot,
    UnitSnapshot,
    UnitStateDocument,
)

RECORD = {"started_at": "2026-01-01T00:00:00+00:00", "result": "restarted"}


def unit_snapshot() -> UnitSnapshot:
    """A looping unit with one recovery behind it."""
    return UnitSnapshot(
        systemd_state="activating (start-pre)",
        unit_found=True,
        looping=True,
        verdict="restart loop",
        cause="stale-gpu-holders",
        cause_detail=None,
        starts_in_window=3,
        failures_in_window=3,
        n_restarts=7,
        oom_device=None,
        evidence=("GPU 0: PID 4242 holds 4000 MiB",),
        action="recover",
        action_reason="GPU cause",
        needs_operator=False,
        recoveries=(RECORD,),
        recovery_in_progress=False,
        survivors=(),
        reset_xids=({"code": 79},),
    )


def test_the_snapshot_writes_the_documented_fields() -> None:
    """The keys docs/status.md lists, JSON-serialisable, at SNAPSHOT_SCHEMA."""
    document = Snapshot(
        pid=10,
        start_time=99,
        running=True,
        ready=True,
        started_at="2026-01-01T00:00:00+00:00",
        dry_run=False,
        journal_state="following",
        journal_reason=None,
        units={"sglang.service": unit_snapshot()},
        xids=({"code": 79},),
        xids_malformed=2,
    ).to_json()
    assert json.loads(json.dumps(document)) == document
    assert document["schema_version"] == SNAPSHOT_SCHEMA == 1
    assert document["journal"] == {"state": "following", "reason": None}
    assert document["xid"] == {"recent": [{"code": 79}], "malformed": 2}
    unit = document["units"]["sglang.service"]
    assert set(unit) == {
        "systemd_state",
        "unit_found",
        "looping",
        "verdict",
        "cause",
        "cause_detail",
        "starts_in_window",
        "failures_in_window",
        "n_restarts",
        "oom_device",
        "evidence",
        "action",
        "action_reason",
        "needs_operator",
        "recoveries",
        "recovery_in_progress",
        "survivors",
        "reset_xids",
        "liveness",
    }
    assert unit["reset_xids"] == [{"code": 79}]
    assert unit["evidence"] == ["GPU 0: PID 4242 holds 4000 MiB"]
    assert unit["recoveries"] == [RECORD]


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
