"""The facts that tie a process to a unit's run: its environment, its uids, PID 1's journal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.adapters.procread import parse_invocation_id, parse_uids
from gpuguard.adapters.systemd import parse_invocations, provenance, unit_uid
from gpuguard.core.unitstate import UnitState

ID = "0123456789abcdef0123456789abcdef"
UNIT = "sglang.service"


def test_invocation_id_is_read_from_a_nul_separated_block() -> None:
    """The variable anywhere in the block, as systemd sets it."""
    assert parse_invocation_id(f"PATH=/bin\0INVOCATION_ID={ID}\0HOME=/\0".encode()) == ID
    assert parse_invocation_id(f"INVOCATION_ID={ID}\0".encode()) == ID


def test_ambiguous_or_malformed_invocation_ids_count_as_none() -> None:
    """Two values, a malformed one, one cut off by the read limit, or none: no evidence."""
    assert parse_invocation_id(f"INVOCATION_ID={ID}\0INVOCATION_ID={ID}\0".encode()) is None
    assert parse_invocation_id(f"INVOCATION_ID={ID.upper()}\0".encode()) is None
    assert parse_invocation_id(f"INVOCATION_ID={ID}x\0".encode()) is None
    assert parse_invocation_id(f"A=1\0INVOCATION_ID={ID}".encode()) is None  # truncated
    assert parse_invocation_id(f"XINVOCATION_ID={ID}\0".encode()) is None
    assert parse_invocation_id(b"") is None


@given(st.binary(max_size=4096))
def test_any_environment_block_is_parsed_without_raising(block: bytes) -> None:
    """Hostile environments (the process writes its own) never raise."""
    result = parse_invocation_id(block)
    assert result is None or len(result) == 32


def test_uids_come_from_the_last_uid_line() -> None:
    """The Name: line is the process's to choose: a fake Uid: inside it is ignored."""
    status = b"Name:\tx\nUid:\t0\t0\t0\t0\nState:\tS\nUid:\t1000\t1000\t1000\t1000\n"
    assert parse_uids(status) == (1000, 1000, 1000, 1000)
    assert parse_uids(b"Name:\tx\nUid:\t1000\t0\t0\t0\n") == (1000, 0, 0, 0)
    assert parse_uids(b"Name:\tx\nUid:\t1000\n") == ()
    assert parse_uids(b"Name:\tx\n") == ()


def _entry(**fields: str) -> str:
    return json.dumps({"__CURSOR": "s=1", **fields})


def test_only_pid_1s_entries_for_the_unit_name_its_runs() -> None:
    """PID 1's UNIT= entries count; the unit's own output or another unit's do not."""
    other = "f" * 32
    text = "\n".join(
        [
            _entry(_PID="1", UNIT=UNIT, INVOCATION_ID=ID),
            _entry(_PID="4242", UNIT=UNIT, INVOCATION_ID=other),  # written by someone else
            _entry(_PID="1", UNIT="other.service", INVOCATION_ID=other),
            _entry(_PID="1", UNIT=UNIT, INVOCATION_ID="not-an-id"),
            "not json",
            "[1, 2]",
            _entry(_PID="1", UNIT=UNIT, INVOCATION_ID=other * 1000),
            "",
        ]
    )
    assert parse_invocations(text, UNIT) == frozenset({ID})


@given(st.text(max_size=2000))
def test_any_journal_output_is_parsed_without_raising(text: str) -> None:
    """The output of journalctl, whatever its text, never makes the parser raise."""
    assert isinstance(parse_invocations(text, UNIT), frozenset)


def test_unit_user_resolves_to_a_uid() -> None:
    """User= unset is root; a name or a number resolves; an unknown name is unknown."""
    assert unit_uid(UnitState(UNIT)) == 0
    assert unit_uid(UnitState(UNIT, user="root")) == 0
    assert unit_uid(UnitState(UNIT, user="1234")) == 1234
    assert unit_uid(UnitState(UNIT, user="nobody-such-user-gpuguard")) is None
    assert unit_uid(UnitState("nosuchdyn.service", dynamic_user=True)) is None


def test_provenance_is_unknown_when_systemd_cannot_be_asked() -> None:
    """Outside the unit a failing systemctl makes everything unknown; inside, only orphans."""
    failed = UnitState(UNIT, error="systemctl failed: no bus")
    assert provenance(failed).problem == "systemctl failed: no bus"
    inside = provenance(failed, inside=True)
    assert inside.problem is None
    assert inside.invocations == frozenset()
    assert inside.uid is None
    nameless = UnitState(UNIT, active_state="active")
    assert provenance(nameless).problem == f"{UNIT} is running but systemd names no invocation id"


def test_the_live_run_is_never_an_ended_one() -> None:
    """A running unit's invocation is excluded; a stopped unit's last one is an ended run."""
    running = UnitState(UNIT, active_state="active", invocation_id=ID)
    assert ID not in provenance(running).invocations
    assert ID in provenance(running, inside=True).invocations  # as ExecStopPost=
    stopped = UnitState(UNIT, active_state="inactive", invocation_id=ID)
    assert ID in provenance(stopped).invocations


SAMPLES = Path(__file__).resolve().parent.parent / "journal_samples"


@pytest.mark.parametrize("release", ["bookworm", "trixie"])
def test_real_journals_name_the_units_runs(release: str) -> None:
    """Recorded real journals (systemd 252, 257): PID 1 stamps every run's INVOCATION_ID."""
    found: set[str] = set()
    for sample in sorted((SAMPLES / release).glob("*.jsonl")):
        text = sample.read_text(encoding="utf-8")
        runs = parse_invocations(text, UNIT)
        expected = set()
        for line in text.splitlines():
            entry = json.loads(line)
            if entry.get("_PID") == "1" and entry.get("UNIT") == UNIT:
                expected.add(entry["INVOCATION_ID"])
        assert runs == expected, sample.name
        found |= runs
    assert len(found) >= 3
