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
import time
from pathlib import Path
from typing import Any

import pytest
from daemontwins import GpuHost, JournaledRecorder, Process, ReplayFollower, UnitTwin

from gpuguard.config import Settings
from gpuguard.core import timeline
from gpuguard.core.values import UnitProvenance
from gpuguard.daemon.loop import Daemon
from gpuguard.daemon.ports import Ports
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
    settings = Settings(
        units={UNIT: UnitSettings()},
        runtime_dir=tmp_path / "run",
        state_dir=tmp_path / "lib",
        reap_grace_s=1.0,
        gate_timeout_s=5.0,
    )
    newest_mono = max(int(e["__MONOTONIC_TIMESTAMP"]) for e in entries) / 1e6
    newest_real = max(int(e["__REALTIME_TIMESTAMP"]) for e in entries) / 1e6
    shift = newest_mono + 1.0 - time.monotonic()  # the journal's clock, a second later
    boot = str(entries[-1]["_BOOT_ID"])
    log = JournaledRecorder(
        clock=lambda: time.monotonic() + shift,
        realtime_s=lambda monotonic_s: newest_real + monotonic_s - newest_mono,
        boot_id=boot,
    )
    invocation = next(e["INVOCATION_ID"] for e in reversed(entries) if "INVOCATION_ID" in e)
    twin = UnitTwin(invocation=str(invocation))
    runs = frozenset(str(e["INVOCATION_ID"]) for e in entries if e.get("INVOCATION_ID"))
    daemons: list[Daemon] = []
    turns = [0]

    def sleep(seconds: float) -> None:
        del seconds
        turns[0] += 1
        if turns[0] > 3:
            daemons[0].request_stop()

    ports = Ports(
        gather=host.gather,
        show_unit=twin.show,
        control=twin.control,
        reap=host.reap,
        notifier=log,
        log=log,
        wall=lambda: newest_real + 1.0,
        monotonic=lambda: time.monotonic() + shift,
        sleep=sleep,
        write_snapshot=lambda _document: None,
        load_unit_state=lambda _unit: None,
        save_unit_state=lambda _unit, _state: None,
        untouchable=frozenset(),
        provenance=lambda state: UnitProvenance(None, runs - {state.invocation_id or ""}, 0),
        boot_id=boot,
    )
    daemons.append(Daemon(settings, ReplayFollower(entries), ports))
    assert daemons[0].run() == 0
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
