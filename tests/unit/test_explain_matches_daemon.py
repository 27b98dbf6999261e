"""`explain`'s replay and the daemon's own verdicts, row by row, on every recorded journal.

The daemon runs over the twins (tests/support/daemontwins.py) on a recorded journal, its log
lines kept as journald would store gpuguard.service's output; the timeline of the journal plus
those lines must reach each verdict the daemon logged, at the moment it logged it (the
comparison ``explain`` prints under "where the daemon's logged verdict differs"). Scenario (c)
of the e2e suite does the same against a real systemd; this covers every sample we recorded,
on an idle host and with an earlier run's worker holding a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from daemontwins import (
    GpuHost,
    JournalClock,
    JournaledRecorder,
    Process,
    ReplayFollower,
    UnitTwin,
    daemon_twin,
    newest_invocation,
    twin_settings,
)

from gpuguard.core import timeline
from gpuguard.core.values import UnitProvenance
from gpuguard.unitsettings import UnitSettings

UNIT = "sglang.service"
SAMPLES = Path(__file__).resolve().parent.parent / "journal_samples"
CASES = sorted(
    (path.parent.name, path.stem)
    for path in SAMPLES.glob("*/*.jsonl")
    if not path.stem.endswith(".no-all")
)


def replay(
    tmp_path: Path, entries: list[dict[str, Any]], host: GpuHost
) -> tuple[JournaledRecorder, UnitTwin]:
    """The daemon over ``entries`` (live, at once) and ``host``; its log and its unit twin."""
    settings = twin_settings(tmp_path, {UNIT: UnitSettings()})
    clock = JournalClock.of(entries)
    boot = str(entries[-1]["_BOOT_ID"])
    log = JournaledRecorder(clock=clock.monotonic, realtime_s=clock.realtime_s, boot_id=boot)
    twin = UnitTwin(invocation=newest_invocation(entries))
    runs = frozenset(str(e["INVOCATION_ID"]) for e in entries if e.get("INVOCATION_ID"))
    harness = daemon_twin(
        settings,
        ReplayFollower(entries),
        host,
        twin,
        log=log,
        clock=clock,
        provenance=lambda state: UnitProvenance(None, runs - {state.invocation_id or ""}, 0),
        boot_id=boot,
    )
    assert harness.daemon.run() == 0
    return log, twin


def _sample(release: str, name: str) -> list[dict[str, Any]]:
    lines = (SAMPLES / release / f"{name}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _host(holder: str) -> GpuHost:
    """Four GPUs; GPU 0 held by nothing, an earlier run's worker, or one that escaped."""
    host = GpuHost()
    if holder == "earlier-run":  # in the unit's cgroup, an ended run's id: the daemon reaps it
        host.add(Process(501, (0,), 30000, f"/system.slice/{UNIT}", "0" * 32))
    elif holder == "escaped":  # its own transient scope and id: nothing proves it the unit's
        host.add(Process(502, (0,), 30000, "/system.slice/run-u42.scope", "e" * 32))
    return host


HOLDERS = ("none", "earlier-run", "escaped")


@pytest.mark.parametrize("holder", HOLDERS)
@pytest.mark.parametrize(("release", "name"), CASES, ids=[f"{r}-{n}" for r, n in CASES])
def test_explain_reaches_every_verdict_the_daemon_logged(
    tmp_path: Path, release: str, name: str, holder: str
) -> None:
    """Each of the daemon's verdicts (looping or not) is the replay's at that moment."""
    entries = _sample(release, name)
    log, _twin = replay(tmp_path, entries, _host(holder))
    verdicts = [fields for _, _, fields in log.lines if isinstance(fields.get("looping"), bool)]
    assert verdicts, [event for _, event, _ in log.lines]
    told = timeline.build([*entries, *log.entries], UNIT)
    assert told.gpuguard_seen
    assert told.story.disagreements == (), told.story.disagreements
    last = "restart loop: " if verdicts[-1]["looping"] else "no loop: "
    assert told.story.verdict.startswith(last), (told.story.verdict, verdicts[-1])


@pytest.mark.parametrize("holder", HOLDERS)
@pytest.mark.parametrize("name", ["restart-loop-start-limit", "stop-sigkill-survivor"])
def test_every_line_the_daemon_logged_about_the_unit_is_a_row(
    tmp_path: Path, name: str, holder: str
) -> None:
    """Row by row: each verdict, decision and action the daemon logged is in explain's table.

    In its order, as its own kind; the daemon's refusal to stop a unit it cannot free (the
    blockers and the operator's command) included.
    """
    entries = _sample("bookworm", name)
    log, _twin = replay(tmp_path, entries, _host(holder))
    said = [
        (event.replace(": ", "-").replace(" ", "-"), event)
        for _, event, fields in log.lines
        if fields.get("unit") == UNIT
    ]
    told = timeline.build([*entries, *log.entries], UNIT)
    rows = [(row.kind, row.text) for row in told.rows if row.source == timeline.GPUGUARD]
    assert [kind for kind, _ in rows] == [kind for kind, _ in said]
    assert all(text.startswith(event) for (_, text), (_, event) in zip(rows, said, strict=True))
    if holder == "escaped" and name == "restart-loop-start-limit":
        refused = next(text for kind, text in rows if "cannot-prove" in kind)
        assert f"command=gpuguard reap --unit {UNIT} --scope patterns" in refused
        assert "PID 502" in refused
