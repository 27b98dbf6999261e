"""The incident's timeline from journal entries: systemd 252/257 samples, hostile entries."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from gpuguard.adapters import journalquery
from gpuguard.core import timeline
from gpuguard.core.detector import LoopSettings

UNIT = "sglang.service"
SAMPLES = Path(__file__).resolve().parents[1] / "journal_samples"
RELEASES = ("bookworm", "trixie")
ESC = "\x1b"


def sample(release: str, name: str) -> list[dict[str, Any]]:
    """A recorded journal sample, one dict per entry."""
    lines = (SAMPLES / release / f"{name}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def kinds(found: timeline.Timeline, source: str | None = None) -> list[str]:
    """The kinds of the rows (of one source)."""
    return [row.kind for row in found.rows if source is None or row.source == source]


def entry_like(base: dict[str, Any], step_us: int, **fields: Any) -> dict[str, Any]:
    """An entry stamped ``step_us`` after ``base``, in the same boot, with ``fields``."""
    monotonic = int(base["__MONOTONIC_TIMESTAMP"]) + step_us
    realtime = int(base["__REALTIME_TIMESTAMP"]) + step_us
    return {
        "__CURSOR": f"s=0;i={step_us:x};t={realtime:x}",
        "__MONOTONIC_TIMESTAMP": str(monotonic),
        "__REALTIME_TIMESTAMP": str(realtime),
        "_BOOT_ID": base["_BOOT_ID"],
        **fields,
    }


def unit_output(
    base: dict[str, Any], step_us: int, message: object, **fields: Any
) -> dict[str, Any]:
    """A line the unit wrote (stdout, or the native protocol with fields of its choosing)."""
    return entry_like(
        base,
        step_us,
        MESSAGE=message,
        _SYSTEMD_UNIT=UNIT,
        _TRANSPORT=fields.pop("_TRANSPORT", "stdout"),
        _PID="4242",
        _UID="1000",
        _SYSTEMD_INVOCATION_ID="aaaabbbbccccddddeeeeffff00001111",
        **fields,
    )


def daemon_line(base: dict[str, Any], step_us: int, **line: Any) -> dict[str, Any]:
    """A JSON line gpuguard.service (root) wrote."""
    return entry_like(
        base,
        step_us,
        MESSAGE=json.dumps(line),
        _SYSTEMD_UNIT="gpuguard.service",
        _TRANSPORT="stdout",
        _PID="300",
        _UID="0",
    )


@pytest.mark.parametrize("release", RELEASES)
def test_stop_that_timed_out_and_what_systemd_killed(release: str) -> None:
    """The stop timeout, the SIGKILL of the main process and the timeout result, in order."""
    found = timeline.build(sample(release, "stop-sigterm-timeout"), UNIT)
    assert kinds(found) == [
        "started",
        "stopping",
        "stop-timed-out",
        "killed",
        "main-exited",
        "failed",
        "stopped",
    ]
    assert all(row.source == timeline.SYSTEMD for row in found.rows)
    assert len(found.story.stop_timeouts) == 1
    assert "State 'stop-sigterm' timed out" in found.story.stop_timeouts[0]
    assert len(found.story.sigkilled) == 1
    assert re.search(
        r"Killing process \d+ \(python3\) with signal SIGKILL", found.story.sigkilled[0]
    )
    # The run the stop cut short is no failed start, and no loop came of it.
    assert found.story.failed_starts == ()
    assert not found.gpuguard_seen
    assert found.story.would == ()
    assert found.story.healthy is None


@pytest.mark.parametrize("release", RELEASES)
def test_survivor_of_sigkill_is_named_once(release: str) -> None:
    """SIGKILL of PID 57 is logged twice: one row; the survivor is named."""
    found = timeline.build(sample(release, "stop-sigkill-survivor"), UNIT)
    assert kinds(found).count("killed") == 1
    assert kinds(found).count("stop-timed-out") == 2  # stop-sigterm, then final-sigterm
    survivors = " | ".join(found.story.survivors)
    assert "Processes still around after final SIGKILL" in survivors
    assert re.search(r"Unit process \d+ \(python3\) remains running after unit stopped", survivors)


@pytest.mark.parametrize("release", RELEASES)
def test_restart_loop_before_gpuguard_says_what_it_would_have_done(release: str) -> None:
    """No gpuguard line: the detector replayed says 'recover', from the OOM signature lines."""
    found = timeline.build(sample(release, "restart-loop-start-limit"), UNIT)
    assert not found.gpuguard_seen
    assert len(found.story.failed_starts) == 5
    assert all("CUDA error: out of memory" in line for line in found.story.failed_starts)
    assert all("[PyTorch: CUDA error: out of memory]" in line for line in found.story.failed_starts)
    assert "start-limit-hit" in kinds(found)
    assert len(found.story.would) == 1
    assert found.story.would[0].startswith("gpuguard would have acted: recover (stale-gpu-holders)")
    would = [row for row in found.rows if row.source == timeline.WOULD]
    assert [row.kind for row in would] == ["recover"]
    # It is told at the third failed run (loop_min_starts 3): after three OOM lines.
    before = found.rows[: found.rows.index(would[0])]
    assert sum(row.kind == "gpu-oom-output" for row in before) == 3


def test_replay_uses_the_daemons_settings() -> None:
    """With loop_min_starts 5 the replay speaks at the fifth failed run, not the third."""
    found = timeline.build(
        sample("bookworm", "restart-loop-start-limit"), UNIT, loop=LoopSettings(min_starts=5)
    )
    would = next(row for row in found.rows if row.source == timeline.WOULD)
    before = found.rows[: found.rows.index(would)]
    assert sum(row.kind == "gpu-oom-output" for row in before) == 5


@pytest.mark.parametrize("release", RELEASES)
def test_left_over_process_without_inventory_is_reported_not_recovered(release: str) -> None:
    """A left-over at start is a loop sign; with no GPU evidence the replay says 'report'."""
    found = timeline.build(sample(release, "left-over-process"), UNIT)
    assert "left-over-process" in kinds(found, timeline.SYSTEMD)
    assert any("Found left-over process" in line for line in found.story.survivors)
    assert found.story.would
    assert found.story.would[0].startswith("gpuguard would have acted: report (unknown)")
    assert "no GPU inventory" in found.story.would[0]


@pytest.mark.parametrize("release", RELEASES)
def test_forged_entries_of_another_user_are_not_systemds(release: str) -> None:
    """Entries by `logger --journald` with MESSAGE_ID, UNIT=, N_RESTARTS: none becomes a row."""
    entries = sample(release, "forged-entries")
    expect = json.loads((SAMPLES / release / "forged-entries.expect.json").read_text())
    trusted = [e["kind"] for e in expect["entries"] if e["trusted"] and e["kind"]]
    found = timeline.build(entries, UNIT)
    assert len(kinds(found, timeline.SYSTEMD)) == len(trusted)
    assert all(row.source == timeline.SYSTEMD for row in found.rows)
    assert found.story.would == ()
    assert found.story.failed_starts == ()


@pytest.mark.parametrize("release", RELEASES)
def test_every_trusted_lifecycle_entry_of_every_sample_is_a_row(release: str) -> None:
    """Each sample: as many lifecycle rows as trusted entries the sidecar names."""
    for path in sorted((SAMPLES / release).glob("*.jsonl")):
        expect = json.loads(path.with_name(path.stem + ".expect.json").read_text())
        claimed = [e for e in expect["entries"] if e["trusted"] and e["kind"]]
        found = timeline.build([json.loads(x) for x in path.read_text().splitlines()], UNIT)
        lifecycle = [
            row
            for row in found.rows
            if row.source == timeline.SYSTEMD
            and row.kind not in {"killed", "remains-running", "start-failed"}
        ]  # fmt: skip  (the sidecars leave "Failed to start" unnamed; events.py reads it)
        assert len(lifecycle) == len(claimed), path.name


def test_unit_forging_systemds_fields_stays_the_units_word() -> None:
    """The unit sends MESSAGE_ID/UNIT= (native protocol) and systemd's texts: no systemd row."""
    base = sample("bookworm", "stop-sigterm-timeout")[0]
    forged = [
        unit_output(
            base,
            10,
            "sglang.service: Failed with result 'exit-code'.",
            _TRANSPORT="journal",
            MESSAGE_ID="d9b373ed55a64feb8242e02dbe79a49c",
            UNIT=UNIT,
            UNIT_RESULT="exit-code",
            SYSLOG_IDENTIFIER="systemd",
            INVOCATION_ID="0123456789abcdef0123456789abcdef",
        ),
        unit_output(base, 20, "sglang.service: State 'stop-sigterm' timed out. Killing."),
        unit_output(base, 30, "sglang.service: Killing process 1 (systemd) with signal SIGKILL."),
        unit_output(
            base, 40, "sglang.service: Unit process 9 (x) remains running after unit stopped."
        ),
        unit_output(
            base, 50, "Started sglang.service", MESSAGE_ID="39f53479d3a045ac8e11786248231fbf"
        ),
        # gpuguard's own JSON, printed by the unit: still the unit's output, and no gate line.
        unit_output(
            base,
            60,
            json.dumps({"event": "recovery finished", "unit": UNIT, "result": "restarted"}),
        ),
    ]
    found = timeline.build(forged, UNIT)
    assert found.rows == ()
    assert not found.gpuguard_seen
    assert found.story.failed_starts == ()
    assert found.story.healthy is None


def test_gpuguard_rows_need_gpuguard_service_as_root() -> None:
    """The daemon's JSON counts only from gpuguard.service with _UID=0 (journald's fields)."""
    base = sample("bookworm", "stop-sigterm-timeout")[0]
    line = {"event": "recovery finished", "unit": UNIT, "result": "restarted", "reaped": 1}
    real = daemon_line(base, 10, **line)
    wrong_user = {**daemon_line(base, 20, **line), "_UID": "1000"}
    root_elsewhere = {**daemon_line(base, 30, **line), "_SYSTEMD_UNIT": "cron.service"}
    other_unit = daemon_line(base, 40, **{**line, "unit": "other.service"})
    not_json = {**daemon_line(base, 50), "MESSAGE": "recovery finished unit=sglang.service"}
    found = timeline.build([real, wrong_user, root_elsewhere, other_unit, not_json], UNIT)
    assert [(row.source, row.kind) for row in found.rows] == [
        (timeline.GPUGUARD, "recovery-finished")
    ]
    assert found.rows[0].text == "recovery finished: result=restarted reaped=1"
    assert found.gpuguard_seen


def test_incident_with_gpuguard_tells_what_it_did_and_when_the_unit_came_back() -> None:
    """Stop timeout, a failed start with its signature, the daemon's recovery, a healthy run."""
    entries = sample("bookworm", "stop-sigterm-timeout")
    base = entries[-1]
    new_run = "5555666677778888999900001111aaaa"
    newer_run = "bbbbccccddddeeeeffff000011112222"
    pid1 = {k: base[k] for k in ("_PID", "_UID", "_SYSTEMD_CGROUP", "_SYSTEMD_UNIT", "UNIT")}
    entries += [
        entry_like(base, 100, MESSAGE="Started sglang.service.", INVOCATION_ID=new_run,
                   MESSAGE_ID="39f53479d3a045ac8e11786248231fbf", **pid1),
        {**unit_output(base, 200, "torch.OutOfMemoryError: CUDA out of memory. GPU 3 has"),
         "_SYSTEMD_INVOCATION_ID": new_run},
        {**unit_output(base, 210, "torch.OutOfMemoryError: CUDA out of memory. GPU 3 has"),
         "_SYSTEMD_INVOCATION_ID": new_run},
        entry_like(base, 300, MESSAGE="sglang.service: Failed with result 'exit-code'.",
                   INVOCATION_ID=new_run, UNIT_RESULT="exit-code",
                   MESSAGE_ID="d9b373ed55a64feb8242e02dbe79a49c", **pid1),
        daemon_line(base, 400, event="restart loop", unit=UNIT, looping=True,
                    reason="stop timed out, next start failed", cause="stale-gpu-holders",
                    action="recover", evidence=["a", "b"]),
        daemon_line(base, 500, event="signal", signal="SIGTERM", pid=191, unit="op.scope",
                    reason=f"left over from an earlier run of {UNIT}", command="TP3"),
        daemon_line(base, 600, event="reap outcome", outcome="killed", pid=191,
                    signals=["SIGTERM", "SIGKILL"], unit="op.scope",
                    reason=f"left over from an earlier run of {UNIT}"),
        daemon_line(base, 650, event="recovery: stopping unit", unit=UNIT),
        daemon_line(base, 700, event="recovery finished", unit=UNIT, result="restarted", reaped=1),
        entry_like(base, 800, MESSAGE="Started sglang.service.", INVOCATION_ID=newer_run,
                   MESSAGE_ID="39f53479d3a045ac8e11786248231fbf", **pid1),
        entry_like(base, 60_000_000, MESSAGE="sglang.service: Scheduled restart job.",
                   INVOCATION_ID=newer_run, N_RESTARTS="1",
                   MESSAGE_ID="5eb03494b6584870a536b337290809b3", **pid1),
    ]  # fmt: skip
    found = timeline.build(entries, UNIT)
    assert found.gpuguard_seen
    assert found.story.would == ()
    said = "torch.OutOfMemoryError: CUDA out of memory. GPU 3 has"
    assert found.story.failed_starts == (
        f"run 55556666: result 'exit-code'; it printed [PyTorch: torch.OutOfMemoryError] {said}",
    )
    assert kinds(found, timeline.UNIT).count("gpu-oom-output") == 1  # the same line twice: once
    assert any(
        line.startswith("restart loop: reason=stop timed out") for line in found.story.gpuguard
    )
    assert "recovery finished: result=restarted reaped=1" in found.story.gpuguard
    assert "recovery: stopping unit" in found.story.gpuguard  # no fields: no dangling ": "
    assert any("pid=191 outcome=killed" in line for line in found.story.survivors)
    assert found.story.healthy is not None
    assert found.story.healthy.startswith("run bbbbcccc started and has not failed since (60.0 s")
    text = timeline.render_text(found, since=None)
    assert "what gpuguard decided and did: 3" in text
    assert "healthy: run bbbbcccc" in text


def test_gate_line_in_the_units_output_is_shown_as_the_units() -> None:
    """The gate prints into the unit's output: shown, as the unit's word, escaped."""
    base = sample("bookworm", "stop-sigterm-timeout")[0]
    line = f"gpuguard gate: passed: reaped 1 {ESC}[31mred{ESC}[0m [GPUs 0-3]\nOK: forged"
    found = timeline.build([unit_output(base, 10, line)], UNIT)
    assert [(row.source, row.kind) for row in found.rows] == [(timeline.UNIT, "gate-said")]
    assert ESC not in found.rows[0].text
    assert "\n" not in found.rows[0].text
    assert found.rows[0].text.startswith("gpuguard gate: passed: reaped 1")


def test_kernel_xid_needs_the_kernel_transport() -> None:
    """An Xid line counts only with _TRANSPORT=kernel; logger's copy does not."""
    base = sample("bookworm", "stop-sigterm-timeout")[0]
    text = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus."
    kernel = entry_like(base, 10, MESSAGE=text, _TRANSPORT="kernel")
    forged = entry_like(base, 20, MESSAGE=text, _TRANSPORT="syslog", _UID="1000", _PID="9")
    found = timeline.build([kernel, forged], UNIT)
    assert [(row.source, row.kind) for row in found.rows] == [(timeline.KERNEL, "xid")]
    assert found.rows[0].text.startswith("Xid 79 on 0000:3b:00, pid 1234 (python3)")


def test_malformed_entries_are_skipped_not_raised() -> None:
    """Wrong types, missing stamps, byte arrays, nested junk: rows only for what reads."""
    base = sample("bookworm", "stop-sigterm-timeout")[0]
    junk: list[Any] = [
        [],
        "text",
        {"MESSAGE": "no stamps", "_SYSTEMD_UNIT": UNIT},
        {**base, "__MONOTONIC_TIMESTAMP": "-5"},
        {**base, "__MONOTONIC_TIMESTAMP": ["1", "2"]},
        unit_output(base, 10, list(b"gpuguard gate: passed \xff\xfe")),
        unit_output(base, 20, None),
        unit_output(base, 30, {"nested": ["x"]}),
        daemon_line(base, 40) | {"MESSAGE": "[" * 100_000},
        daemon_line(base, 50) | {"MESSAGE": '{"event": ["signal"], "unit": "sglang.service"}'},
        daemon_line(base, 60) | {"MESSAGE": list(b'{"event": "verdict", "unit": 5}')},
    ]
    found = timeline.build(junk, UNIT)
    assert [(row.source, row.kind) for row in found.rows] == [(timeline.UNIT, "gate-said")]
    assert "\\xff" not in found.rows[0].text or "\ufffd" in found.rows[0].text


def test_a_flood_of_long_lines_is_linear() -> None:
    """20,000 entries of 64 KiB of near-matches: a few seconds at most, every text bounded."""
    base = sample("bookworm", "stop-sigterm-timeout")[0]
    pid1 = {"_PID": "1", "_UID": "0", "_SYSTEMD_CGROUP": "/init.scope", "UNIT": UNIT}
    near = "Killing process 1 (" + "x" * 70 + ") with signal SIGKILL." * 3000
    entries = [entry_like(base, i, MESSAGE=near, **pid1) for i in range(2000)]
    entries += [
        unit_output(base, 10_000 + i, "gpuguard gate: " + "\x1b" * 65_536) for i in range(200)
    ]
    started = time.perf_counter()
    found = timeline.build(entries, UNIT)
    assert time.perf_counter() - started < 10
    assert kinds(found, timeline.SYSTEMD) == []
    assert all(len(row.text) <= 300 for row in found.rows)


def test_boots_are_told_one_after_the_other() -> None:
    """Monotonic stamps of two boots are not compared: each boot in order, oldest boot first."""
    old = sample("bookworm", "stop-sigterm-timeout")
    new = sample("trixie", "stop-sigterm-timeout")
    found = timeline.build([*new, *old], UNIT)
    boots = [row.boot_id for row in found.rows]
    assert boots == sorted(boots, key=lambda b: b != old[0]["_BOOT_ID"])
    assert len(found.story.stop_timeouts) == 2


def test_text_and_json_agree_and_a_long_loop_is_elided() -> None:
    """Text: the table and the story, long middles elided; JSON: every row, the same story."""
    loop = sample("bookworm", "restart-loop-start-limit")
    shift = 20_000_000  # each copy 20 s after the one before, with cursors of its own
    copies = [
        {
            **entry,
            "__CURSOR": f"{entry['__CURSOR']};copy={n}",
            "__MONOTONIC_TIMESTAMP": str(int(entry["__MONOTONIC_TIMESTAMP"]) + n * shift),
            "__REALTIME_TIMESTAMP": str(int(entry["__REALTIME_TIMESTAMP"]) + n * shift),
            **{
                key: f"{entry[key][:-1]}{n}"
                for key in ("INVOCATION_ID", "_SYSTEMD_INVOCATION_ID")
                if key in entry
            },
        }
        for n in range(3)
        for entry in loop
    ]
    found = timeline.build([*copies, *copies], UNIT)  # every entry twice: told once
    assert len(found.rows) == 3 * 33 + 1  # 33 rows a loop, one "would"
    text = timeline.render_text(found, since="-1h")
    doc = json.loads(json.dumps(timeline.to_json(found, since="-1h")))
    assert doc["format"] == 1
    assert doc["since"] == "-1h"
    assert len(doc["rows"]) == len(found.rows)
    assert doc["story"]["would"] == list(found.story.would)
    assert "What happened:" in text
    assert "failed starts: 15" in text
    assert "… 20 more rows (see --json) …" in text
    assert "… 5 more (see --json)" in text  # the story's list of failed starts
    assert "gpuguard: left no line in this journal" in text
    assert timeline.render_text(timeline.build([], UNIT), since=None).endswith(
        "nothing in the journal (this boot)\n"
    )


def test_queries_filter_each_source_and_the_greps_are_regexes() -> None:
    """Four journalctl runs: PID 1 about the unit, its matching output, gpuguard, kernel Xids."""
    commands = journalquery.queries(UNIT, "2026-12-01 05:00")
    assert len(commands) == 4
    assert all(c[0] == "journalctl" and "--since=2026-12-01 05:00" in c for c in commands)
    assert commands[0][-5:] == [
        "_PID=1",
        f"UNIT={UNIT}",
        "+",
        "_SYSTEMD_CGROUP=/init.scope",
        f"UNIT={UNIT}",
    ]
    assert commands[1][-1] == f"_SYSTEMD_UNIT={UNIT}"
    assert commands[3][-1] == "_TRANSPORT=kernel"
    for command in commands:
        for grep in (a.removeprefix("--grep=") for a in command if a.startswith("--grep=")):
            pattern = re.compile(grep)
            assert pattern.search("torch.OutOfMemoryError: CUDA out of memory") or pattern.search(
                "NVRM: Xid (PCI:0000:3b:00): 79"
            )
    assert re.compile(commands[1][-3].removeprefix("--grep=")).search("gpuguard gate: passed")
    assert all("--boot" in c for c in journalquery.queries(UNIT, None))


@pytest.mark.parametrize("server_unit", ["gpuguard-gate.service", "gpuguard-gate@3-120-0.service"])
def test_gate_server_acceptance_and_a_neighbours_reap_lines(server_unit: str) -> None:
    """The gate server's 'accepted' for this unit is gpuguard's; a reap for aa.service is not.

    The resident server's lines, and those of the per-connection instances before 0.1.0-3.
    """
    base = sample("bookworm", "stop-sigterm-timeout")[0]
    server = {"_SYSTEMD_UNIT": server_unit, "_UID": "0", "_PID": "77"}
    accepted = f"gate for {UNIT} from PID 300 (uid 1000, {UNIT}): accepted"
    entries = [
        entry_like(base, 10, MESSAGE=accepted, **server),
        entry_like(base, 20, MESSAGE=f"gate for x{UNIT} from PID 3: accepted", **server),
        entry_like(base, 30, MESSAGE=accepted, **{**server, "_UID": "1000"}),
        daemon_line(base, 40, event="signal", signal="SIGTERM", pid=5, unit="x.scope",
                    reason=f"left over from an earlier run of x{UNIT} (invocation 1)"),
        daemon_line(base, 50, event="signal", signal="SIGTERM", pid=6, unit="x.scope",
                    reason=f"left over from an earlier run of {UNIT} (invocation 1)"),
    ]  # fmt: skip
    found = timeline.build(entries, UNIT)
    assert [(row.kind, row.text[:20]) for row in found.rows] == [
        ("gate-server", accepted[:20]),
        ("signal", "signal: signal=SIGTE"),
    ]
    assert "pid=6 " in found.rows[1].text


def test_an_engines_fatal_line_is_the_units_row_once_per_run() -> None:
    """Explain shows the server's fatal line as the unit's word, with its cause, once per run."""
    base = sample("bookworm", "clean-start-stop")[0]
    line = "(EngineCore_DP0 pid=413) ERROR [core.py:710] EngineCore encountered a fatal error."
    found = timeline.build([unit_output(base, 10, line), unit_output(base, 20, line)], UNIT)
    assert [(row.source, row.kind) for row in found.rows] == [(timeline.UNIT, "engine-fatal")]
    assert found.rows[0].text == f"[EngineCore fatal error] {line}"


def test_the_daemons_dead_engine_and_stuck_start_lines_are_gpuguard_rows() -> None:
    """What the daemon said about a dead engine and a stuck start is in the timeline."""
    base = sample("bookworm", "clean-start-stop")[0]
    lines = [
        daemon_line(base, 10, event="engine dead", unit=UNIT, cause="EngineCore fatal error"),
        daemon_line(base, 20, event="engine dead: decision", unit=UNIT, action="recover"),
        daemon_line(base, 30, event="start stuck", unit=UNIT, summary="stuck in phase x"),
    ]
    found = timeline.build(lines, UNIT)
    assert kinds(found, timeline.GPUGUARD) == [
        "engine-dead",
        "engine-dead-decision",
        "start-stuck",
    ]
    assert found.rows[0].text == "engine dead: cause=EngineCore fatal error"
