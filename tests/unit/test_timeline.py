"""The incident's timeline from journal entries: systemd 252/257 samples, hostile entries."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from sglangstop import drained_then_self_killed

from gpuguard.adapters import journalquery
from gpuguard.core import timeline
from gpuguard.core.detector import LoopSettings
from gpuguard.core.startfailure import classify

if TYPE_CHECKING:
    from collections.abc import Mapping

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
        _SYSTEMD_INVOCATION_ID=fields.pop(
            "_SYSTEMD_INVOCATION_ID", "aaaabbbbccccddddeeeeffff00001111"
        ),
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
def test_sglangs_own_sigkill_after_a_clean_drain_is_no_failed_start(release: str) -> None:
    """An operator's stop that SGLang ended in its own SIGKILL (exit 137): a stop, no failure.

    Its unit result is 'signal' with no stop timeout (issue 34); the run was stopped on
    request, never a failed start or a loop.
    """
    found = timeline.build(drained_then_self_killed(release), UNIT)
    assert "killed" not in kinds(found)
    assert found.story.failed_starts == ()
    assert found.story.stop_timeouts == ()
    assert any("stopped by a stop job" in line for line in found.story.operator)
    assert found.story.verdict.startswith("no loop")


def test_systemds_kills_of_threads_are_told_as_tasks_not_processes() -> None:
    """The "Killing process N (…)" lines of systemd name each thread it kills too: they are tasks.

    A real vLLM 0.32.0 under systemd 252 (cgroup v2) gave 52 such lines for a few processes,
    most of them its threads (issue 34).
    """
    recorded = sample("bookworm", "stop-sigterm-timeout")
    killed = next(e for e in recorded if "Killing process" in str(e.get("MESSAGE")))
    at = int(killed["__MONOTONIC_TIMESTAMP"])
    threads = [
        killed
        | {
            "MESSAGE": f"{UNIT}: Killing process {tid} ({name}) with signal SIGKILL.",
            "__CURSOR": f"{killed['__CURSOR']};thread={tid}",
            "__MONOTONIC_TIMESTAMP": str(at + tid),
            "__REALTIME_TIMESTAMP": str(int(killed["__REALTIME_TIMESTAMP"]) + tid),
        }
        for tid, name in ((901, "pt_gloo_runloop"), (902, "ZMQbg/Reaper"), (903, "ZMQbg/IO/0"))
    ]
    found = timeline.build(sorted([*recorded, *threads], key=_monotonic), UNIT)
    text = timeline.render_text(found, since=None)
    assert "tasks systemd SIGKILLed (processes and their threads): 4" in text
    assert "processes systemd SIGKILLed" not in text


def _monotonic(entry: Mapping[str, object]) -> int:
    return int(str(entry["__MONOTONIC_TIMESTAMP"]))


@pytest.mark.parametrize("release", RELEASES)
def test_survivor_of_sigkill_is_named_once(release: str) -> None:
    """SIGKILL of PID 57 is logged twice: one row; the survivor is named."""
    found = timeline.build(sample(release, "stop-sigkill-survivor"), UNIT)
    assert kinds(found).count("killed") == 1
    assert kinds(found).count("stop-timed-out") == 2  # stop-sigterm, then final-sigterm
    survivors = " | ".join(found.story.survivors)
    assert "Processes still around after final SIGKILL" in survivors
    assert re.search(r"PID \d+: remained running after the run stopped", survivors)


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
def test_operators_restart_with_a_left_over_is_a_finding_and_pids_count_once(release: str) -> None:
    """The operator's restart found a left-over: a finding, no loop; each PID counted once."""
    found = timeline.build(sample(release, "left-over-process"), UNIT)
    assert "left-over-process" in kinds(found, timeline.SYSTEMD)
    assert found.story.would == ()
    assert len(found.story.operator) == 2  # the restart's stop job, then the final stop
    assert len(found.story.findings) == 1
    assert "a finding, not a loop" in found.story.findings[0]
    # systemd names the first worker three times (remains running, left over twice, remains
    # running again) and the second once: two PIDs.
    assert len(found.story.survivors) == 2
    first = found.story.survivors[0]
    assert "remained running after the run stopped" in first
    assert "left over at the start" in first
    assert found.story.verdict.startswith("no loop: ")
    text = timeline.render_text(found, since=None)
    assert "survivors and left-overs: 2" in text
    assert "nothing: no restart loop" in text


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
        daemon_line(base, 610, event="survivors of an ended run", unit=UNIT, pids=[191],
                    summary="reaped 1 survivor of run bdab810c within 1.0 s of its end"),
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
        f"run 55556666: result 'exit-code'; it printed [PyTorch: CUDA out of memory] {said}",
    )
    assert kinds(found, timeline.UNIT).count("gpu-oom-output") == 1  # the same line twice: once
    assert any(
        line.startswith("restart loop: reason=stop timed out") for line in found.story.gpuguard
    )
    assert "recovery finished: result=restarted reaped=1" in found.story.gpuguard
    assert "recovery: stopping unit" in found.story.gpuguard  # no fields: no dangling ": "
    # The reaper's outcome and the daemon's sweep name the same PID: one survivor.
    assert found.story.survivor_pids == 1
    [tp3] = [line for line in found.story.survivors if line.startswith("PID 191: ")]
    assert "reaped by gpuguard" in tp3
    assert "swept by gpuguard's daemon: reaped 1 survivor of run bdab810c" in tp3
    assert found.story.healthy is not None
    assert found.story.healthy.startswith("run bbbbcccc started and has not failed since (60.0 s")
    text = timeline.render_text(found, since=None)
    assert "what gpuguard decided and did: 4" in text  # the sweep too
    assert "healthy: run bbbbcccc" in text


def gate_server_line(base: dict[str, Any], step_us: int, message: object) -> dict[str, Any]:
    """A line the gate server (gpuguard-gate.service, root) wrote about a request."""
    return entry_like(
        base,
        step_us,
        MESSAGE=message,
        _SYSTEMD_UNIT="gpuguard-gate.service",
        _TRANSPORT="stdout",
        _PID="77",
        _UID="0",
    )


def test_a_gate_verdict_counts_only_from_the_gate_server_never_from_the_units_output() -> None:
    """The unit printing the gate's exact verdict line makes no row; the server's own line does."""
    base = sample("bookworm", "stop-sigterm-timeout")[0]
    verdict = "gpuguard gate: sglang.service: Start allowed: GPUs 0-3 idle [GPUs 0-3]"
    entries = [
        unit_output(base, 10, verdict),  # what the drop-in's client prints, or the unit imitates
        unit_output(base, 11, f"gate for {UNIT} from PID 300: {verdict}"),  # the server's words
        gate_server_line(base, 20, f"gate for {UNIT} from PID 300 (uid 1000, {UNIT}): accepted"),
        gate_server_line(base, 30, f"gate for {UNIT} from PID 300: {verdict}"),
        gate_server_line(base, 40, f"gate for {UNIT} from PID 300: exit 0"),
        gate_server_line(base, 50, f"gate for x{UNIT} from PID 301: {verdict}"),
    ]
    found = timeline.build(entries, UNIT)
    assert [(row.source, row.kind) for row in found.rows] == [
        (timeline.GPUGUARD, "gate-server"),
        (timeline.GPUGUARD, "gate-verdict"),
        (timeline.GPUGUARD, "gate-exit"),
    ]
    assert found.story.gpuguard == (f"gate for {UNIT} from PID 300: {verdict}",)


def crash_then_a_gated_restart(*, gate_allowed: bool) -> list[dict[str, Any]]:
    """A crash, and a restart beside the crashed run's worker and resource_tracker (systemd 252).

    The gate reaps the worker and allows the start (when ``gate_allowed``); ExecStart= then
    finds the tracker alone.
    """
    recorded = sample("bookworm", "restart-loop-start-limit")
    pid1 = [e for e in recorded if e.get("_PID") == "1" and e.get("UNIT") == UNIT]
    crashed, started = pid1[:5], pid1[5]  # started, exited 1, failed, restart, stopped; next
    restart = str(started["INVOCATION_ID"])
    left_over = next(
        e for e in sample("bookworm", "left-over-process") if "left-over" in str(e.get("MESSAGE"))
    )
    base = crashed[-1]

    def same_boot(entry: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in entry.items() if not k.startswith("__") and k != "_BOOT_ID"}

    def found(step_us: int, pid: int, comm: str) -> dict[str, Any]:
        message = (
            f"{UNIT}: Found left-over process {pid} ({comm}) in control group while starting "
            "unit. Ignoring."
        )
        fields = same_boot(left_over) | {"INVOCATION_ID": restart, "MESSAGE": message}
        return entry_like(base, step_us, **fields)

    verdict = (
        f"gate for {UNIT} from PID 300: gpuguard gate: GPUs of {UNIT} idle after 1.2 s, "
        "1 stale holder(s) reaped: start allowed [GPUs 0-3]"
    )
    gate = [gate_server_line(base, 3_000_000, verdict)] if gate_allowed else []
    ready = "(APIServer pid=91) INFO:     Application startup complete."
    return [
        *crashed,
        found(1_000_000, 109, "VLLM::Worker"),
        found(1_000_001, 254, "python"),
        *gate,
        found(3_500_000, 254, "python"),
        entry_like(base, 4_000_000, **same_boot(started)),
        unit_output(base, 40_000_000, ready),
    ]


def test_a_left_over_the_gate_found_idle_after_a_crash_is_no_loop_in_explain() -> None:
    """The gate allowed the restart with the GPUs idle: the tracker left over holds none: no loop.

    Issue 34: explain ended with "verdict … restart loop" beside "healthy: run … has not failed
    since" for one crash, one restart and a left-over resource_tracker.
    """
    found = timeline.build(crash_then_a_gated_restart(gate_allowed=True), UNIT)
    assert found.story.verdict.startswith("no loop"), found.story.verdict
    assert any("254 (python)" in line and "holding none" in line for line in found.story.findings)
    ungated = timeline.build(crash_then_a_gated_restart(gate_allowed=False), UNIT)
    assert ungated.story.verdict.startswith("restart loop")  # the journal alone cannot tell


def test_a_left_over_the_daemons_sweep_found_idle_is_no_loop_and_no_disagreement() -> None:
    """The daemon swept the crashed run's Worker and found the GPUs idle: its "no loop" stands.

    Issue 34, the daemon alone on a real vLLM's crash: the daemon's verdict "no loop" (its
    inventory: the left-over tracker holds nothing) was printed as a disagreement, the replay
    calling the same moment a loop with no GPU evidence. Its sweep line saying the GPUs were
    idle is that evidence; "GPUs not idle", or a sweep after the verdict, is not.
    """
    entries = crash_then_a_gated_restart(gate_allowed=False)
    base = entries[-3]  # the tracker named again at ExecStart=

    def sweep(summary: str) -> dict[str, Any]:
        line = {"event": "survivors of an ended run", "unit": UNIT, "pids": [109]}
        return daemon_line(base, 10_000, **line, summary=summary)

    verdict = daemon_line(
        base, 20_000, event="verdict", unit=UNIT, looping=False, reason="up and running"
    )
    idle = "reaped 1 survivor of run c42bbf27 within 1.5 s of its end; GPUs idle at +2.0 s"
    found = timeline.build([*entries, sweep(idle), verdict], UNIT)
    assert found.story.disagreements == (), found.story.disagreements
    assert found.story.verdict.startswith("no loop"), found.story.verdict
    busy = "reaped 1 survivor of run c42bbf27 within 1.5 s of its end; GPUs not idle"
    assert len(timeline.build([*entries, sweep(busy), verdict], UNIT).story.disagreements) == 1
    late = daemon_line(base, 30_000, event="survivors of an ended run", unit=UNIT, summary=idle)
    assert len(timeline.build([*entries, verdict, late], UNIT).story.disagreements) == 1


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
        gate_server_line(base, 10, list(f"gate for {UNIT} from PID 3: gpuguard gate: ".encode())),
        unit_output(base, 15, list(b"gpuguard gate: passed \xff\xfe")),
        unit_output(base, 20, None),
        unit_output(base, 30, {"nested": ["x"]}),
        daemon_line(base, 40) | {"MESSAGE": "[" * 100_000},
        daemon_line(base, 50) | {"MESSAGE": '{"event": ["signal"], "unit": "sglang.service"}'},
        daemon_line(base, 60) | {"MESSAGE": list(b'{"event": "verdict", "unit": 5}')},
    ]
    found = timeline.build(junk, UNIT)
    assert [(row.source, row.kind) for row in found.rows] == [(timeline.GPUGUARD, "gate-verdict")]
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
    # The unit's copy of the gate's verdict is not read: only the gate server's own line counts.
    assert not re.compile(commands[1][-3].removeprefix("--grep=")).search("gpuguard gate: passed")
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


def test_the_stop_reaps_outcome_through_the_gate_server_is_a_survivor() -> None:
    """Workers the stop-reap reaped through the gate server are survivors, by their own PID.

    The server copies the reaper's console line, outcome and PID first; the holder's command
    after them may imitate a pair; the unit's copy of the line and a neighbour's reap count for
    nothing.
    """
    base = sample("bookworm", "clean-start-stop")[0]
    reaper = (
        "2026-12-01T23:59:28.023103Z [info     ] reap outcome                   "
        "outcome=exited pid=228 command='sglang::scheduler_TP0 outcome=killed pid=1 ' "
        "detail=None reason='left over from an earlier run of sglang.service (the ledger saw it "
        "descend from run b115846fd5c4, uid 0; it moved to tp-worker-0-205.scope)' "
        "signals=['SIGTERM'] start_time=4242 unit=tp-worker-0-205.scope"
    )
    entries = [
        gate_server_line(base, 10, f"reap for {UNIT} from PID 291: {reaper}"),
        gate_server_line(
            base, 20, f"reap for x{UNIT} from PID 292: {reaper.replace('228', '229')}"
        ),
        unit_output(base, 30, reaper.replace("228", "230")),
    ]
    found = timeline.build(entries, UNIT)
    assert found.story.survivors == ("PID 228: reaped by gpuguard",)
    assert found.story.survivor_pids == 1
    assert [row.kind for row in found.rows] == ["reap-outcome"]
    assert found.rows[0].text.startswith("reap outcome: pid=228 outcome=exited; reap for ")


def test_a_stop_reaps_warning_outcome_is_a_survivor_too() -> None:
    """A holder the stop-reap could not kill (logged as a warning) is told, not dropped."""
    base = sample("bookworm", "clean-start-stop")[0]
    reaper = (
        "2026-12-01T23:59:28.023103Z [warning  ] reap outcome                   "
        "outcome=unkillable pid=231 command='sglang::scheduler_TP1' detail='D state' "
        "reason='in sglang.service' signals=['SIGTERM', 'SIGKILL'] start_time=4243"
    )
    found = timeline.build(
        [gate_server_line(base, 10, f"reap for {UNIT} from PID 291: {reaper}")], UNIT
    )
    assert [row.kind for row in found.rows] == ["reap-outcome"]
    assert found.rows[0].text.startswith("reap outcome: pid=231 outcome=unkillable; reap for ")
    assert found.story.survivor_pids == 1


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


def recorded(name: str) -> list[str]:
    """The releases with a recorded sample ``name`` (the newest samples exist for 252 only)."""
    return [release for release in RELEASES if (SAMPLES / release / f"{name}.jsonl").is_file()]


@pytest.mark.parametrize("release", RELEASES)
def test_start_limit_hit_is_told_as_a_loop_systemd_ended_with_what_to_do(release: str) -> None:
    """The start limit: the story says systemd ended the loop and names reset-failed."""
    found = timeline.build(sample(release, "restart-loop-start-limit"), UNIT)
    assert len(found.story.start_limit) == 1
    assert f"systemctl reset-failed {UNIT}" in found.story.start_limit[0]
    assert found.story.verdict.startswith("restart loop: ")
    assert "start limit ended the loop" in found.story.verdict
    text = timeline.render_text(found, since=None)
    assert "systemd ended a restart loop (start limit): 1" in text


@pytest.mark.parametrize("release", recorded("restart-counter-clean-exit"))
def test_clean_exits_restarted_by_systemd_are_told_as_a_loop(release: str) -> None:
    """Only the restart counter tells it: six clean exits that systemd restarted are a loop."""
    found = timeline.build(sample(release, "restart-counter-clean-exit"), UNIT)
    assert len(found.story.failed_starts) == 6
    assert "restart counter at 6" in found.story.failed_starts[-1]
    assert found.story.would
    assert "nothing: no restart loop" not in timeline.render_text(found, since=None)


@pytest.mark.parametrize("release", recorded("operator-restart"))
def test_operators_restarts_and_stop_start_are_never_a_loop(release: str) -> None:
    """Two `systemctl restart`s and a `stop` + `start`: stopped on request, never a loop."""
    found = timeline.build(sample(release, "operator-restart"), UNIT)
    assert found.story.would == ()
    assert len(found.story.operator) == 3
    assert found.story.verdict.startswith("no loop: ")


@pytest.mark.parametrize("release", recorded("left-over-at-start"))
def test_left_over_at_an_operators_start_is_a_finding(release: str) -> None:
    """A left-over found at a start with no failure and no restart: a finding, never a loop."""
    found = timeline.build(sample(release, "left-over-at-start"), UNIT)
    assert found.story.would == ()
    assert len(found.story.findings) == 1
    assert len(found.story.survivors) == 1  # one PID, named twice by systemd


def test_a_recovery_is_not_promised_for_holders_outside_the_cgroup_without_provenance() -> None:
    """The server names a holder systemd never saw in the cgroup: no 'would have recovered'.

    The daemon stops a unit only when its plan can free the GPUs: the replay says needs-operator.
    """
    entries = sample("bookworm", "restart-loop-start-limit")
    base = entries[0]
    run = next(e["INVOCATION_ID"] for e in entries if e.get("INVOCATION_ID"))
    held = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 119.84 GiB. GPU 3 has a "
        "total capacity of 140.40 GiB of which 21.06 GiB is free. Process 192 has 119.34 GiB "
        "memory in use."
    )
    entries.append({**unit_output(base, 5, held), "_SYSTEMD_INVOCATION_ID": run})
    found = timeline.build(entries, UNIT)
    would = found.story.would[0]
    assert would.startswith("gpuguard would have acted: needs-operator (stale-gpu-holders)")
    assert "PID 192" in would
    assert "would reap nothing" in would
    assert f"gpuguard reap --unit {UNIT} --scope patterns" in would
    assert "it would have recovered" not in would
    assert any(line.startswith("PID 192: named by the server") for line in found.story.survivors)


def test_where_the_daemon_said_otherwise_the_difference_is_printed() -> None:
    """A daemon verdict that the replay of the same entries does not reach is printed, with why."""
    entries = sample("bookworm", "operator-restart")
    base = entries[-1]
    entries.append(
        daemon_line(base, 10, event="restart loop", unit=UNIT, looping=True, reason="forged?")
    )
    found = timeline.build(entries, UNIT)
    assert len(found.story.disagreements) == 1
    assert "the daemon said a restart loop (forged?)" in found.story.disagreements[0]
    assert "replayed from the journal: no loop" in found.story.disagreements[0]
    agreeing = [
        *sample("bookworm", "operator-restart"),
        daemon_line(base, 10, event="verdict", unit=UNIT, looping=False, reason="starting"),
    ]
    assert timeline.build(agreeing, UNIT).story.disagreements == ()


def test_the_daemons_verdict_is_compared_with_what_it_had_read_not_what_came_meanwhile() -> None:
    """An entry stamped before the daemon's line but read after its verdict is no disagreement."""
    entries = sample("bookworm", "restart-loop-start-limit")

    def disagreements(after: int, read_through_s: float | None) -> tuple[str, ...]:
        line: dict[str, Any] = {"event": "verdict", "unit": UNIT, "looping": False}
        line |= {"reason": "starting", "read_through_s": read_through_s}
        said = daemon_line(entries[after], 1, **line)
        return timeline.build(
            [*entries[: after + 1], said, *entries[after + 1 :]], UNIT
        ).story.disagreements

    flips = next(i for i in range(1, len(entries)) if disagreements(i, None))
    before = int(entries[flips - 1]["__MONOTONIC_TIMESTAMP"]) / 1e6
    assert disagreements(flips, before) == ()
    assert len(disagreements(flips, None)) == 1


def test_a_lines_signature_label_is_the_one_the_daemons_classifier_picks() -> None:
    """A warm-up OOM of vLLM contains PyTorch's "CUDA out of memory": the label is vLLM's.

    The classifier (startfailure.classify) takes the most specific signature, the last of the
    table that matches; the first match named a different server and cause than the daemon's.
    """
    entries = sample("bookworm", "restart-loop-start-limit")
    base = entries[0]
    run = next(e["INVOCATION_ID"] for e in entries if e.get("INVOCATION_ID"))
    warm_up = (
        "RuntimeError: CUDA out of memory occurred when warming up sampler with 256 dummy "
        "requests. Please try lowering `max_num_seqs` or `gpu_memory_utilization` when "
        "initializing the engine."
    )
    entries.append({**unit_output(base, 5, warm_up), "_SYSTEMD_INVOCATION_ID": run})
    found = timeline.build(entries, UNIT)
    [row] = [row for row in found.rows if row.kind == "gpu-oom-output" and "warming" in row.text]
    assert row.text.startswith("[vLLM: CUDA out of memory occurred when warming up sampler] ")
    recognised = classify(warm_up)
    assert recognised is not None
    assert recognised.signature.server == "vLLM"


def test_pids_only_the_units_out_of_memory_lines_name_are_shown_as_its_word_not_counted() -> None:
    """The unit prints 40 out-of-memory lines naming 40 PIDs: listed as its word, 0 counted.

    Any process of the unit can print such a line naming any PID; doctor counts the same way.
    """
    entries = sample("bookworm", "restart-loop-start-limit")
    base = entries[0]
    run = next(e["INVOCATION_ID"] for e in entries if e.get("INVOCATION_ID"))
    for step, pid in enumerate(range(5000, 5040)):
        held = (
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 119.84 GiB. GPU 3 has "
            f"a total capacity of 140.40 GiB of which 21.06 GiB is free. Process {pid} has "
            "119.34 GiB memory in use."
        )
        entries.append({**unit_output(base, 5 + step, held), "_SYSTEMD_INVOCATION_ID": run})
    found = timeline.build(entries, UNIT)
    named = [line for line in found.story.survivors if "(its word)" in line]
    assert named, found.story.survivors
    assert all(line.startswith("PID 50") for line in named), named
    assert found.story.survivor_pids == 0
    assert "survivors and left-overs: 0 PIDs" in timeline.render_text(found, since=None)


def reaper_said(outcome: str, pid: int) -> str:
    """The reaper's console line as the gate server copies it."""
    return (
        "2026-12-01T23:59:28.023103Z [info     ] reap outcome                   "
        f"outcome={outcome} pid={pid} command='sglang::scheduler_TP0' detail=None "
        "reason='left over from an earlier run of sglang.service'"
    )


def test_explain_counts_each_healed_start_and_ended_loop_once_with_its_loading() -> None:
    """A gate that killed a holder and exited 0, a recovery that restarted: 2 prevented.

    A gate whose holder was already gone, one that exited 1, and the unit's own imitation of
    the server's lines count nothing.
    """
    base = sample("bookworm", "clean-start-stop")[0]
    healed = f"gate for {UNIT} from PID 300: "
    entries = [
        gate_server_line(base, 10, f"{healed}{reaper_said('killed', 228)}"),
        gate_server_line(base, 20, f"{healed}exit 0"),
        gate_server_line(base, 30, f"gate for {UNIT} from PID 301: {reaper_said('gone', 229)}"),
        gate_server_line(base, 40, f"gate for {UNIT} from PID 301: exit 0"),
        gate_server_line(base, 50, f"gate for {UNIT} from PID 302: {reaper_said('exited', 230)}"),
        gate_server_line(base, 60, f"gate for {UNIT} from PID 302: exit 1"),
        unit_output(base, 70, f"gate for {UNIT} from PID 303: {reaper_said('killed', 231)}"),
        unit_output(base, 80, f"gate for {UNIT} from PID 303: exit 0"),
        daemon_line(base, 90, event="recovery finished", unit=UNIT, result="restarted"),
        daemon_line(base, 99, event="recovery finished", unit=UNIT, result="failed"),
    ]
    found = timeline.with_prevented(timeline.build(entries, UNIT), 210.0)
    assert found.story.prevented == (
        "gpuguard prevented 2 failed starts (1 healed by the gate, 1 loop ended by the daemon), "
        "7 min of loading at its shortest learned start (3 min 30 s each)"
    )
    text = timeline.render_text(found, since=None)
    assert "failed starts gpuguard prevented: 1" in text
    assert timeline.to_json(found, since=None)["story"]["prevented"] == found.story.prevented  # type: ignore[index]
    nothing = timeline.with_prevented(timeline.build(entries[2:8], UNIT), None)
    assert nothing.story.prevented is None


def test_a_run_that_printed_its_ready_line_and_then_failed_is_a_crash_not_a_failed_start() -> None:
    """A failed run that had printed its own server's ready line is told as a crash (issue 34).

    The real vLLM served 45 s before its API server was SIGKILLed: explain listed that run under
    "failed starts". Only the configured server's ready line counts (SGLang prints uvicorn's
    "Application startup complete." before its warm-up), and without a server none does.
    """
    entries = sample("bookworm", "restart-loop-start-limit")
    first = next(e for e in entries if e.get("_PID") == "1" and e.get("INVOCATION_ID"))
    run = str(first["INVOCATION_ID"])
    ready = "[2026-12-07 23:45:29] The server is fired up and ready to roll!"
    uvicorn = "INFO:     Application startup complete."
    said = [
        unit_output(first, 1000, uvicorn, _SYSTEMD_INVOCATION_ID=run),
        unit_output(first, 2000, ready, _SYSTEMD_INVOCATION_ID=run),
    ]
    before = timeline.build(entries, UNIT, server="sglang").story
    assert len(before.failed_starts) == 5
    assert before.crashes == ()
    found = timeline.build([*entries, *said], UNIT, server="sglang")
    assert len(found.story.failed_starts) == 4
    [crash] = found.story.crashes
    assert crash.startswith(f"run {run[:8]}: result 'exit-code'")
    assert crash.endswith("it had printed its ready line (a crash, not a failed start)")
    assert not any(line.startswith(f"run {run[:8]}") for line in found.story.failed_starts)
    assert found.story.verdict == before.verdict  # the detector counts it failed all the same
    text = timeline.render_text(found, since=None)
    assert "crashes after the server was ready (no failed start): 1" in text
    assert timeline.to_json(found, since=None)["story"]["crashes"] == [crash]  # type: ignore[index]
    # uvicorn's line alone is no ready line of SGLang's; with no server configured none counts.
    only_uvicorn = timeline.build([*entries, said[0]], UNIT, server="sglang").story
    assert only_uvicorn.crashes == ()
    assert len(only_uvicorn.failed_starts) == 5
    assert timeline.build([*entries, *said], UNIT).story.crashes == ()
    vllm = timeline.build([*entries, said[0]], UNIT, server="vllm").story
    assert len(vllm.crashes) == 1
