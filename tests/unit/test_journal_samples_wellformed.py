"""The recorded journal samples (tests/journal_samples) are well-formed and their expectations fit.

Cheap checks, no container: the samples are re-recorded by tests/e2e/record_samples.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

SAMPLES = Path(__file__).resolve().parents[1] / "journal_samples"
RELEASES = {"bookworm": 252, "trixie": 257}
KINDS = {
    "starting",
    "started",
    "stopping",
    "stopped",
    "main-process-exited",
    "failed-with-result",
    "restart-scheduled",
    "stop-sigterm-timed-out",
    "processes-still-around-after-SIGKILL",
    "left-over-process-found",
    "start-limit-hit",
    "deactivated-successfully",
}
KIND_FIELDS = {
    "main-process-exited": {"code", "status", "signal"},
    "failed-with-result": {"result"},
    "restart-scheduled": {"n_restarts"},
    "left-over-process-found": {"pid", "comm"},
    "stop-sigterm-timed-out": {"final"},
    "processes-still-around-after-SIGKILL": {"final"},
}
SAMPLE_FILES = sorted(SAMPLES.glob("*/*.jsonl"))


def _lines(sample: Path) -> list[dict[str, Any]]:
    entries = []
    for number, line in enumerate(sample.read_text().splitlines(), start=1):
        entry = json.loads(line)
        assert isinstance(entry, dict), f"{sample.name}:{number} is not a JSON object"
        entries.append(entry)
    return entries


def _expect_path(sample: Path) -> Path:
    return sample.with_name(sample.name.removesuffix(".jsonl") + ".expect.json")


def test_samples_exist_for_each_release_with_a_readme() -> None:
    """Each release directory holds samples, a README.md, and nothing unexpected."""
    for release in RELEASES:
        directory = SAMPLES / release
        assert (directory / "README.md").is_file()
        assert list(directory.glob("*.jsonl"))
        for path in directory.iterdir():
            assert path.name == "README.md" or path.name.endswith((".jsonl", ".expect.json"))


@pytest.mark.parametrize("sample", SAMPLE_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_line_is_a_journal_entry_with_a_cursor(sample: Path) -> None:
    """Every line is a JSON object as journalctl prints it, with a unique __CURSOR."""
    entries = _lines(sample)
    assert entries
    cursors = [entry.get("__CURSOR") for entry in entries]
    assert all(isinstance(cursor, str) and cursor.startswith("s=") for cursor in cursors)
    assert len(set(cursors)) == len(cursors)
    for entry in entries:
        assert isinstance(entry.get("__REALTIME_TIMESTAMP"), str)
        assert "MESSAGE" in entry


@pytest.mark.parametrize("sample", SAMPLE_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_expectations_refer_to_the_sample_lines(sample: Path) -> None:
    """The sidecar has one expectation per line, by line number and the same __CURSOR."""
    entries = _lines(sample)
    document = json.loads(_expect_path(sample).read_text())
    assert document["sample"] == sample.name
    assert document["systemd"] == RELEASES[sample.parent.name]
    expected = document["entries"]
    assert [item["line"] for item in expected] == list(range(1, len(entries) + 1))
    for item in expected:
        assert item["cursor"] == entries[item["line"] - 1]["__CURSOR"]


@pytest.mark.parametrize("sample", SAMPLE_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_expectations_are_consistent_with_the_raw_fields(sample: Path) -> None:
    """Kinds are known and carry their fields; `trusted` follows the trusted `_` fields."""
    entries = _lines(sample)
    for item in json.loads(_expect_path(sample).read_text())["entries"]:
        entry = entries[item["line"] - 1]
        trusted = entry.get("_UID") == "0" and (
            entry.get("_PID") == "1" or entry.get("_SYSTEMD_CGROUP") == "/init.scope"
        )
        assert item["trusted"] is trusted
        kind = item["kind"]
        if kind is None:
            continue
        assert kind in KINDS
        assert item["unit"] == entry.get("UNIT")
        assert item["invocation_id"] == entry.get("INVOCATION_ID")
        assert KIND_FIELDS.get(kind, set()) <= item.keys()


def test_every_sidecar_has_its_sample() -> None:
    """No expectation file is left without the sample it describes."""
    for expect in SAMPLES.glob("*/*.expect.json"):
        assert expect.with_name(expect.name.removesuffix(".expect.json") + ".jsonl").is_file()


def test_forged_samples_hold_untrusted_lifecycle_claims() -> None:
    """The forged samples contain lifecycle claims that must be rejected as untrusted."""
    for release in RELEASES:
        document = json.loads((SAMPLES / release / "forged-entries.expect.json").read_text())
        claims = [item for item in document["entries"] if item["kind"] == "restart-scheduled"]
        assert claims
        assert not any(item["trusted"] for item in claims)
