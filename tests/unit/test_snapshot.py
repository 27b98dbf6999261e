"""The daemon's snapshot document: what it writes, and the one total parser every reader uses."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import pytest
import snapshots
from builders import STATUS_CONTEXT, gpu, nvml
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.adapters import daemonsnapshot
from gpuguard.adapters.procfs import read_identity
from gpuguard.adapters.state import write_json
from gpuguard.core.inventory import build_inventory
from gpuguard.core.levels import Level
from gpuguard.core.snapshot import (
    SNAPSHOT_SCHEMA,
    Problem,
    Snapshot,
    UnitSnapshot,
    Unreadable,
    from_json,
    parse,
)
from gpuguard.core.status.document import to_json
from gpuguard.core.status.judge import assess
from gpuguard.core.status.text import render_text
from gpuguard.core.values import MIB, ProcScan

if TYPE_CHECKING:
    from pathlib import Path

RECORD = {"started_at": "2026-01-01T00:00:00+00:00", "result": "restarted"}
NOW = datetime(2026, 1, 1, 0, 1, tzinfo=timezone.utc)


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
        liveness={
            "state": "up",
            "summary": "up (ready 1 min 43 s after its start)",
            "level": None,
            "last_start": {"invocation_id": "a" * 32, "ready_s": 103.2, "phases": {"load": 80}},
            "engine_deaths": 0,
            "stuck_starts": 1,
        },
    )


def busy_snapshot() -> Snapshot:
    """A daemon with a looping unit, an Xid, its counters and its time stamp."""
    return replace(
        snapshots.QUIET,
        units={"sglang.service": unit_snapshot()},
        xids=(snapshots.xid(79, "0000:3b:00", pid=4242, monotonic_s=12.5, time="T"),),
        xids_malformed=2,
        metrics={"recoveries": [["sglang.service", "restarted", 1]]},
    )


def test_the_snapshot_writes_the_documented_fields() -> None:
    """The keys docs/status.md lists, JSON-serialisable, at SNAPSHOT_SCHEMA."""
    document = busy_snapshot().to_json()
    assert json.loads(json.dumps(document)) == document
    assert document["schema_version"] == SNAPSHOT_SCHEMA == 1
    assert document["journal"] == {"state": "attached", "reason": None}
    assert document["xid"]["malformed"] == 2
    assert document["xid"]["recent"][0]["code"] == 79
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


def test_what_the_writer_writes_the_parser_reads_back_unchanged() -> None:
    """Written as daemon.json is (sorted keys), parsed: the same value, the same document."""
    written = busy_snapshot()
    text = json.dumps(written.to_json(), indent=1, sort_keys=True)
    assert parse(text) == written
    assert parse(text.encode()) == written
    assert from_json(written.to_json()) == written
    quiet = replace(written, metrics=None, updated_at=None)
    assert parse(json.dumps(quiet.to_json())) == quiet


def _paths(document: object, prefix: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Every key path of the typed frame (the free-form records inside it left out)."""
    free = {"recoveries", "survivors", "reset_xids", "metrics"}
    found: list[tuple[str | int, ...]] = []
    if isinstance(document, dict):
        for key, value in document.items():
            found.append((*prefix, key))
            if key not in free:
                found.extend(_paths(value, (*prefix, key)))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            found.extend(_paths(value, (*prefix, index)))
    return found


def _parent(document: Any, path: tuple[str | int, ...]) -> Any:
    for key in path[:-1]:
        document = document[key]
    return document


FIELD_PATHS = [
    path
    for path in _paths(busy_snapshot().to_json())
    if path
    not in {
        ("metrics",),  # optional ones
        ("xid", "hung"),  # absent from daemons before issue 36
        ("units", "sglang.service", "liveness"),
        ("units", "sglang.service", "liveness", "last_start", "phases", "load"),  # data
        ("units", "sglang.service", "liveness", "last_start", "invocation_id"),  # not read
    }
    and not (len(path) == 2 and path[0] == "units")  # a unit's name is data, not a field
]


@pytest.mark.parametrize("path", FIELD_PATHS, ids=lambda path: ".".join(map(str, path)))
def test_a_missing_or_renamed_field_is_unreadable_and_named(path: tuple[str | int, ...]) -> None:
    """Each field of the frame, renamed: never read as "nothing there", always named."""
    document = busy_snapshot().to_json()
    parent = _parent(document, path)
    if isinstance(parent, list):
        parent[int(path[-1])] = 12345  # an item of the wrong type: no list here holds integers
    else:
        parent[f"{path[-1]}_renamed"] = parent.pop(path[-1])
    found = from_json(document)
    assert isinstance(found, Unreadable), path
    assert found.problem is Problem.MALFORMED
    assert str(path[-1]) in found.reason or path[0] == "schema_version"


def test_an_optional_field_may_be_left_out() -> None:
    """No metrics (no exporter), no liveness (an older writer): still the same daemon."""
    document = busy_snapshot().to_json()
    del document["metrics"]
    del document["units"]["sglang.service"]["liveness"]
    found = from_json(document)
    assert isinstance(found, Snapshot)
    assert found.metrics is None
    assert found.units["sglang.service"].liveness is None


@pytest.mark.parametrize(
    ("version", "problem", "said"),
    [
        (0, Problem.TOO_OLD, "written by an older gpuguard daemon (schema_version 0;"),
        (2, Problem.TOO_NEW, "written by a newer gpuguard daemon (schema_version 2;"),
        ("1", Problem.MALFORMED, "schema_version is missing or not an integer"),
        (True, Problem.MALFORMED, "schema_version is missing or not an integer"),
    ],
)
def test_an_unknown_version_says_which_side_is_older(
    version: object, problem: Problem, said: str
) -> None:
    """A version this gpuguard does not read is the daemon's age, not a damaged file."""
    document = busy_snapshot().to_json() | {"schema_version": version}
    found = from_json(document)
    assert isinstance(found, Unreadable)
    assert found.problem is problem
    assert said in found.reason


@pytest.mark.parametrize(
    "data",
    [b"", b"{", b"\xff\xfe\x00", b"[]", b"null", b"[" * 100_000, "{}".encode("utf-16")],
)
def test_what_is_not_a_snapshot_is_said_so(data: bytes) -> None:
    """Empty, cut short, not UTF-8, not an object, nested past any reason: unreadable."""
    found = parse(data)
    assert isinstance(found, Unreadable)
    assert found.problem is Problem.MALFORMED


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_parse_is_total_over_bytes(data: bytes) -> None:
    """Any bytes: a snapshot or the reason why not, never an exception."""
    assert isinstance(parse(data), Snapshot | Unreadable)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=8,
)


@settings(max_examples=120, deadline=None)
@given(
    st.sampled_from(_paths(busy_snapshot().to_json())),
    st.one_of(st.just("delete"), _JSON),
)
def test_parse_is_total_over_mutated_documents(path: tuple[str | int, ...], value: object) -> None:
    """A field replaced or deleted: a value that writes itself back, or why not; never raised."""
    document = busy_snapshot().to_json()
    parent = _parent(document, path)
    if value == "delete" and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    found = parse(json.dumps(document))
    assert isinstance(found, Snapshot | Unreadable)
    if isinstance(found, Snapshot):
        assert parse(json.dumps(found.to_json())) == found


def _status_of(runtime: Path) -> tuple[Level, str, dict[str, Any]]:
    """`gpuguard status` judged over an idle GPU with the daemon read from ``runtime``."""
    context = replace(STATUS_CONTEXT, daemon=daemonsnapshot.daemon_view(runtime))
    report = assess(build_inventory(nvml(gpu(0)), ProcScan(()), 16 * MIB), context, NOW)
    return report.level, render_text(report), to_json(report)


@pytest.mark.parametrize(("version", "age"), [(0, "an older"), (SNAPSHOT_SCHEMA + 1, "a newer")])
def test_status_says_the_daemon_is_too_old_or_too_new(
    tmp_path: Path, version: int, age: str
) -> None:
    """A snapshot of another version: status says whose, as a WARNING, not "no daemon"."""
    document = snapshots.QUIET.to_json() | {"schema_version": version}
    write_json(daemonsnapshot.snapshot_path(tmp_path), document)
    level, text, doc = _status_of(tmp_path)
    assert level is Level.WARNING
    assert f"Daemon: unknown (its snapshot cannot be read: written by {age} gpuguard daemon" in text
    assert "WARNING: the gpuguard daemon's snapshot (runtime_dir/daemon.json) cannot be" in text
    assert "not running" not in text
    assert doc["daemon"]["state"] == "unreadable"
    assert doc["daemon"]["snapshot"] == {}
    assert doc["daemon"]["unreadable"]["problem"] == ("too-old" if version == 0 else "too-new")


def test_status_names_the_field_a_damaged_snapshot_lacks(tmp_path: Path) -> None:
    """A renamed field: the snapshot is unreadable with the field named, never "nothing"."""
    document = snapshots.QUIET.to_json()
    document["units"] = {"sglang.service": snapshots.QUIET_UNIT.to_json()}
    document["units"]["sglang.service"]["loops"] = document["units"]["sglang.service"].pop(
        "looping"
    )
    write_json(daemonsnapshot.snapshot_path(tmp_path), document)
    level, text, _ = _status_of(tmp_path)
    assert level is Level.WARNING
    assert 'units["sglang.service"].looping is missing' in text


def test_no_snapshot_is_no_daemon_and_a_live_writer_is_running(tmp_path: Path) -> None:
    """No file: "not running", as before; this process's own snapshot: "running"."""
    level, text, doc = _status_of(tmp_path)
    assert level is Level.OK
    assert "Daemon: not running (no snapshot" in text
    assert doc["daemon"] == {"state": "absent", "snapshot": {}}
    identity = read_identity(os.getpid())
    assert identity is not None
    mine = replace(busy_snapshot(), pid=os.getpid(), start_time=identity.start_time)
    write_json(daemonsnapshot.snapshot_path(tmp_path), mine.to_json())
    view = daemonsnapshot.daemon_view(tmp_path)
    assert (view.state, view.snapshot) == ("running", mine)
    _, text, doc = _status_of(tmp_path)
    assert f"Daemon: running (PID {os.getpid()}, since" in text
    assert doc["daemon"]["snapshot"] == json.loads(
        daemonsnapshot.snapshot_path(tmp_path).read_text()
    )  # the file as it is, keys in its order
    assert list(doc["daemon"]["snapshot"]) == sorted(doc["daemon"]["snapshot"])


def test_a_snapshot_too_large_to_read_is_said_so(tmp_path: Path) -> None:
    """Past the size any snapshot has: not read, and status says why."""
    daemonsnapshot.snapshot_path(tmp_path).write_bytes(b" " * (5 << 20))
    level, text, _ = _status_of(tmp_path)
    assert level is Level.WARNING
    assert "Daemon: unknown (its snapshot cannot be read: larger than 4194304 bytes)" in text


def test_the_gate_acts_as_without_a_daemon_on_an_unreadable_snapshot(tmp_path: Path) -> None:
    """A newer daemon's reset-class Xids are not read as ours: no refusal from a guess."""
    identity = read_identity(os.getpid())
    assert identity is not None
    watch = replace(snapshots.QUIET_UNIT, reset_xids=({"pci_bus_id": "0000:3b:00", "code": 79},))
    mine = replace(
        snapshots.QUIET,
        pid=os.getpid(),
        start_time=identity.start_time,
        units={"sglang.service": watch},
    )
    write_json(daemonsnapshot.snapshot_path(tmp_path), mine.to_json())
    assert daemonsnapshot.lists_reset_xids(tmp_path, "sglang.service")
    assert len(daemonsnapshot.reset_xids(tmp_path, "sglang.service")) == 1
    write_json(daemonsnapshot.snapshot_path(tmp_path), mine.to_json() | {"schema_version": 2})
    assert not daemonsnapshot.lists_reset_xids(tmp_path, "sglang.service")
    assert daemonsnapshot.reset_xids(tmp_path, "sglang.service") == ()
    assert daemonsnapshot.xid_claims(tmp_path) == ()
