"""`gpuguard status` shows the daemon's last sweeps of an ended run's survivors."""

from __future__ import annotations

import snapshots

from gpuguard.core.snapshot import Snapshot, Unreadable, from_json
from gpuguard.core.status.text import _watch_lines

UNIT = "sglang.service"


def sweep(at: str, summary: object) -> dict[str, object]:
    """A sweep record as the daemon's snapshot keeps it (daemon._sweep_record)."""
    return {"at": at, "invocation_id": "5" * 32, "result": "reaped", "summary": summary}


def test_the_last_three_sweeps_are_shown_escaped() -> None:
    """Newest three, one line each; a control character in the file cannot reach the terminal."""
    records = [sweep(f"T{n}", f"reaped {n} survivors of run 577f5c37") for n in range(5)]
    records[-1]["summary"] = "reaped 1 survivor\x1b[2J of run 577f5c37\nforged line"
    view = snapshots.running(
        snapshots.written({UNIT: snapshots.unit(verdict="ok", survivors=tuple(records))})
    )
    lines = [line for line in _watch_lines(view, UNIT, None) if line.startswith("survivors ")]
    assert lines[:2] == [
        "survivors T2: reaped 2 survivors of run 577f5c37",
        "survivors T3: reaped 3 survivors of run 577f5c37",
    ]
    assert len(lines) == 3
    assert "\x1b" not in lines[2]
    assert "\n" not in lines[2]


def test_survivors_of_the_wrong_shape_make_the_snapshot_unreadable() -> None:
    """Damaged survivors: the snapshot is named unreadable (core.snapshot), never read as none."""
    document = snapshots.written({UNIT: snapshots.unit()}).to_json()
    for value in (None, "text", [1, "x"], {"a": 1}):
        document["units"][UNIT]["survivors"] = value
        found = from_json(document)
        assert isinstance(found, Unreadable)
        assert f'units["{UNIT}"].survivors' in found.reason
    document["units"][UNIT]["survivors"] = [{"at": "T", "invocation_id": "5" * 32}]
    read = from_json(document)
    assert isinstance(read, Snapshot)
    lines = _watch_lines(snapshots.running(read), UNIT, None)
    assert not [line for line in lines if line.startswith("survivors ")]  # no summary: no line
