"""Issue 36: status says one story, true now, in words an operator reads (no internal values)."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import snapshots
from builders import STATUS_CONTEXT, UNIT, gpu, nvml, process

from gpuguard.core import timeline
from gpuguard.core.detector import Detector
from gpuguard.core.doctor import AuditedUnit, History, HostFacts, build_history, diagnose
from gpuguard.core.events import parse_entry
from gpuguard.core.inventory import Inventory, build_inventory
from gpuguard.core.leftovers import WatchedUnit
from gpuguard.core.levels import Level
from gpuguard.core.snapshot import Snapshot, Unreadable, parse
from gpuguard.core.status.document import to_json
from gpuguard.core.status.judge import assess
from gpuguard.core.status.report import UnitView
from gpuguard.core.status.text import render_text
from gpuguard.core.timeline.render import render_text as explain_text
from gpuguard.core.unitconfig import UnitConfig
from gpuguard.core.values import MIB, NvmlHealth, ProcScan, UnitProvenance
from gpuguard.core.xid.hung import parse_hung_entry

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
PUBLIC = Path(__file__).resolve().parents[1] / "journal_public"
RECORDED = Path(__file__).resolve().parents[1] / "journal_samples" / "bookworm"
HEADLINE_LIMIT = 180
"""One line of a wide screen, after ``gpuguard status: LEVEL - `` (core.status.judge's limit)."""
MISSING = nvml(health=NvmlHealth.UNAVAILABLE, reason="NVML unavailable: Driver Not Loaded")


def test_a_refusal_while_nvml_is_missing_exits_critical() -> None:
    """The gate refused because NVML is missing: status prints CRITICAL and exits 2, not 3."""
    refused = UnitView(
        UNIT,
        "failed (failed)",
        "GPUs 0 (from config)",
        ({"time": "t2", "result": "refused", "blockers": ["NVML unavailable: Driver Not Loaded"]},),
    )
    context = replace(STATUS_CONTEXT, units=(refused,))
    report = assess(build_inventory(MISSING, ProcScan(()), 16 * MIB), context, NOW)
    text = render_text(report)
    assert "CRITICAL: the gate refused the last start" in text
    assert report.level is Level.CRITICAL
    assert to_json(report)["exit_code"] == 2
    assert text.startswith(f"gpuguard status: CRITICAL - the gate refused the last start of {UNIT}")
    assert "cannot be read: NVML unavailable: Driver Not Loaded" in text


def test_no_python_none_reaches_the_screen() -> None:
    """Every optional field of the daemon's record left empty: status prints words, never None."""
    watch = snapshots.unit(
        looping=True,
        verdict="3 failed runs in 600 s",
        cause=None,
        cause_detail=None,
        n_restarts=None,
        action=None,
        recoveries=({"started_at": None, "result": None},),
        survivors=({"at": None, "summary": "1 left"},),
    )
    snapshot = snapshots.written({UNIT: watch})
    unit = UnitView(
        UNIT,
        "activating (auto-restart)",
        "GPUs 0 (from config)",
        ({"time": None, "result": "refused", "waited_s": None, "blockers": None},),
    )
    context = replace(STATUS_CONTEXT, daemon=snapshots.running(snapshot), units=(unit,))
    report = assess(build_inventory(nvml(gpu(0)), ProcScan(()), 16 * MIB), context, NOW)
    text = render_text(report)
    assert f"Unit {UNIT}" in text
    assert "restart loop" in text
    assert "None" not in text


# --- loops as systemd tells them ---------------------------------------------------------------


def public(name: str) -> list[dict[str, Any]]:
    """A public excerpt converted to journal JSON (tests/journal_public/README.md)."""
    return [json.loads(line) for line in (PUBLIC / f"{name}.jsonl").read_text().splitlines()]


def explained(entries: list[dict[str, Any]], unit: str) -> tuple[timeline.Timeline, str]:
    """``explain``'s timeline of these entries and the text it prints."""
    found = timeline.build(entries, unit)
    return found, explain_text(found, since=None)


def test_pre_248_exit_and_failure_texts_are_read() -> None:
    """Before 248 systemd logged the exit and the result without MESSAGE_ID: both are events."""
    kinds = [parse_entry(e, "run-u70.service") for e in public("systemd-8558")]
    assert [k.kind.value if k else None for k in kinds] == ["started", "main-exited", "failed"]
    exited = kinds[1]
    assert exited is not None
    assert (exited.exit_code, exited.exit_status, kinds[2].result if kinds[2] else None) == (
        "exited",
        208,
        "exit-code",
    )


def test_a_run_whose_main_process_failed_is_never_healthy_pre_248() -> None:
    """In systemd #8558: Started, then a failed exit in the old texts: failed, never healthy."""
    found, text = explained(public("systemd-8558"), "run-u70.service")
    assert found.story.healthy is None
    assert "has not failed since" not in text
    assert any("status 208" in line or "exit-code" in line for line in found.story.failed_starts)


def test_a_failed_main_exit_with_current_fields_is_never_healthy() -> None:
    """The lines of systemd 252 up to "Main process exited … status=1/FAILURE": not healthy."""
    lines = (RECORDED / "restart-loop-start-limit.jsonl").read_text().splitlines()
    entries = [json.loads(line) for line in lines]
    exit_at = next(
        i
        for i, e in enumerate(entries)
        if e.get("MESSAGE_ID") == "98e322203f7a4ed290d09fe03c09fe15"
    )
    found, text = explained(entries[: exit_at + 1], "sglang.service")
    assert "status=1/FAILURE" in str(entries[exit_at]["MESSAGE"])
    assert found.story.healthy is None
    assert "has not failed since" not in text
    assert any("status 1" in line for line in found.story.failed_starts)


def test_a_start_limit_hit_is_a_loop_systemd_ended_and_nothing_says_no_loop() -> None:
    """optimus-manager PR #1: the start limit ended a loop; no line beside it says "no loop"."""
    found, text = explained(public("optimus-manager-pr1"), "optimus-manager.service")
    assert found.story.start_limit
    assert found.story.verdict.startswith("restart loop: ")
    assert "start limit" in found.story.verdict
    assert "no restart loop" not in text
    assert "no loop" not in text
    assert "a loop takes" not in text


@pytest.mark.parametrize(
    ("name", "unit", "rule"),
    [
        ("okd-507", "bootkube.service", "restart counter is at 10940, at least 500"),
        ("minikube-5690", "kubelet.service", "restart counter is at 558"),
    ],
)
def test_systemds_restart_counter_is_evidence_of_a_loop(name: str, unit: str, rule: str) -> None:
    """A counter far past the threshold is a loop even with no failure line in view."""
    found, text = explained(public(name), unit)
    assert found.story.verdict.startswith("restart loop: ")
    assert rule in found.story.verdict
    assert "no restart loop" not in text


def test_a_counter_that_climbs_within_the_window_is_a_loop() -> None:
    """26 runs started and restarted in 57 s, no failure line in view: systemd counted a loop."""
    detector = Detector("sglang.service")
    start = 1_000.0
    said = {
        "39f53479d3a045ac8e11786248231fbf": "Started sglang.service.",
        "5eb03494b6584870a536b337290809b3": "sglang.service: Scheduled restart job, restart "
        "counter is at {n}.",
    }
    for n in range(1, 27):
        for step, (message_id, text) in enumerate(said.items()):
            at = start + n * 2.2 + step
            entry = {
                "__CURSOR": f"s=t;i={n}.{step}",
                "__MONOTONIC_TIMESTAMP": str(int(at * 1e6)),
                "__REALTIME_TIMESTAMP": str(int((1.8e9 + at) * 1e6)),
                "_PID": "1",
                "_UID": "0",
                "UNIT": "sglang.service",
                "MESSAGE_ID": message_id,
                "N_RESTARTS": str(n),
                "INVOCATION_ID": f"{n:032x}",
                "MESSAGE": text.format(n=n),
            }
            event = parse_entry(entry, "sglang.service")
            assert event is not None
            detector.observe(event, live=True)
    diagnosis = detector.diagnose(start + 58, None)
    assert diagnosis.looping
    assert "restarted sglang.service 26 times within 600 s" in diagnosis.reason


def test_doctor_never_says_never_above_its_own_start_limit_hit() -> None:
    """A gated unit whose journal shows a start-limit hit: doctor names the loop that escapes it."""
    history = build_history(
        [
            json.loads(line)
            for line in (RECORDED / "restart-loop-start-limit.jsonl").read_text().splitlines()
        ],
        "sglang.service",
    )
    assert history.start_limit_hits == 1
    unit = UnitConfig(
        unit="sglang.service",
        load_state="loaded",
        kill_mode="mixed",
        timeout_stop_s=120.0,
        timeout_start_s=600.0,
        restart="always",
        restart_s=0.1,
        start_limit_interval_s=10.0,
        start_limit_burst=5,
        drop_in_paths=("/etc/systemd/system/sglang.service.d/gpuguard-gate.conf",),
    )
    audited = AuditedUnit(config=unit, history=history, environment={}, gpus=None, user_uid=0)
    found = next(
        f
        for f in diagnose(
            audited, {}, HostFacts(300.0, nvidia_devices=False, persistenced_running=False)
        )
        if f.code == "restart"
    )
    said = "\n".join([found.title, *found.evidence])
    assert "1 start-limit hits" in said
    assert "never hits the start limit" not in said
    assert "escapes the start limit" in found.title
    assert "ended a faster loop" in found.title


def test_a_loop_by_the_counter_is_never_called_healthy() -> None:
    """OKD #507: the newest run only just started; beside a loop verdict nothing says healthy."""
    found, text = explained(public("okd-507"), "bootkube.service")
    assert found.story.verdict.startswith("restart loop: ")
    assert found.story.healthy is None
    assert "has not failed since" not in text


# --- a headline that is true now and fits a line -----------------------------------------------

A = "sglang-a.service"
OLD_REFUSAL = {
    "time": "2026-11-29T11:50:00+00:00",
    "result": "refused",
    "blockers": [
        "GPU 0: 30000 MiB used, held by PID 777 (sglang::tp0, run-u9.scope): killed minutes ago",
        "GPU 7 is lost (another configuration's GPU)",
    ],
}


def refused_unit_status(found: Inventory) -> tuple[str, str, Level]:
    """Status of A (GPUs 0,1; not running) whose gate's newest decision is OLD_REFUSAL."""
    watched = (
        WatchedUnit(
            A, ("sglang",), frozenset({0, 1}), None, UnitProvenance(None, frozenset(), 0), "0,1"
        ),
    )
    unit = UnitView(A, "activating (auto-restart)", "GPUs 0,1", (OLD_REFUSAL,))
    context = replace(
        STATUS_CONTEXT,
        watched_units={A: ("sglang",)},
        watched=watched,
        units=(unit,),
    )
    report = assess(found, context, NOW)
    return report.headline, render_text(report), report.level


def test_a_refusal_names_todays_blockers_once_in_one_line() -> None:
    """Today's escaped worker, not the refusal's old PIDs or lost GPU, once, in one line."""
    found = build_inventory(
        nvml(gpu(0, (30, 100000)), gpu(1)),
        ProcScan(
            (
                process(
                    30,
                    0,
                    cgroup="/system.slice/run-u42.scope",
                    invocation_id="c" * 32,
                    cmdline=("sglang::tp0",),
                ),
            )
        ),
        16 * MIB,
    )
    headline, text, level = refused_unit_status(found)
    assert level is Level.CRITICAL
    assert headline.startswith(f"{A}: the gate refused its last start; its GPUs are held by")
    assert "PID 30" in headline
    assert "PID 777" not in headline
    assert "GPU 7" not in headline
    assert f"`gpuguard reap --unit {A} --scope patterns`" in headline
    assert len(headline) <= HEADLINE_LIMIT
    assert headline.count("PID 30") == 1
    [finding] = [line for line in text.splitlines() if line.startswith("CRITICAL: the gate")]
    assert finding.count("PID 30") == 1
    assert "PID 777" not in finding


def test_a_refusal_leaves_the_headline_once_its_blockers_are_gone() -> None:
    """The refusal's holders are gone and A's GPUs idle: OK, the refusal only history."""
    found = build_inventory(nvml(gpu(0), gpu(1)), ProcScan(()), 16 * MIB)
    headline, text, level = refused_unit_status(found)
    assert level is Level.OK
    assert "refused" not in headline
    assert "its cause is gone: its GPUs are idle now" in text


def test_every_headline_fits_one_line() -> None:
    """A long finding is cut in the headline and said whole below it."""
    long = "x" * 400
    watch = snapshots.unit(
        looping=True, cause="does-not-fit", cause_detail=long, verdict="3 failed runs"
    )
    context = replace(STATUS_CONTEXT, daemon=snapshots.running(snapshots.written({UNIT: watch})))
    report = assess(build_inventory(nvml(gpu(0)), ProcScan(()), 16 * MIB), context, NOW)
    assert len(report.headline) <= HEADLINE_LIMIT
    assert report.headline.endswith("(details below)")
    assert long in render_text(report)


# --- the kernel saying a GPU hangs ---------------------------------------------------------------


def kernel(message: object, transport: str = "kernel") -> dict[str, object]:
    """A journal entry with this MESSAGE, read from /dev/kmsg unless ``transport`` says not."""
    return {
        "_TRANSPORT": transport,
        "MESSAGE": message,
        "__MONOTONIC_TIMESTAMP": "12000000",
        "__REALTIME_TIMESTAMP": "1771000000000000",
        "_BOOT_ID": "b" * 32,
    }


@pytest.mark.parametrize(
    ("line", "said", "gpu"),
    [
        (  # NVIDIA/open-gpu-kernel-modules pull request #1252's excerpt
            (
                "nvidia-modeset: ERROR: GPU:0: Error while waiting for GPU progress: "
                "0x0000ca7d:0 2:0:200:192"
            ),
            "nvidia-modeset waited for GPU progress in vain",
            "GPU:0",
        ),
        (  # NVIDIA/open-gpu-kernel-modules pull request #1031's excerpt
            (
                "NVRM: krcWatchdog_IMPL: RC watchdog: GPU is probably locked!  Notify Timeout "
                "Seconds: 7"
            ),
            "the NVIDIA driver's RC watchdog found the GPU locked",
            None,
        ),
    ],
)
def test_kernel_lines_that_say_a_gpu_hangs_are_read(line: str, said: str, gpu: str | None) -> None:
    """Each hung-GPU text, from the kernel only, with what said it and the GPU it names."""
    found = parse_hung_entry(kernel(line))
    assert found is not None
    assert (found.said, found.gpu, found.text) == (said, gpu, line)
    assert parse_hung_entry(kernel(line, transport="stdout")) is None  # anyone can print it


def test_a_hostile_hung_line_stays_one_escaped_line() -> None:
    """Control characters in the rest of the line are escaped; a huge line costs its prefix."""
    line = (
        "nvidia-modeset: ERROR: GPU:1\\n: Error while waiting for GPU progress: \x1b[2J"
        + "x" * 10**6
    )
    found = parse_hung_entry(kernel(line.replace("\\n", "\n")))
    assert found is not None
    assert found.gpu is None  # "1\n" is not a GPU number
    assert "\x1b" not in found.text
    assert "\n" not in found.text
    assert len(found.text) < 1000


def test_a_hung_line_without_its_text_makes_the_snapshot_unreadable_and_named() -> None:
    """``xid.hung`` is optional, but each line in it must carry the text status shows."""
    document = replace(snapshots.QUIET, gpu_hangs=({"said": "x", "gpu": None},)).to_json()
    found = parse(json.dumps(document))
    assert isinstance(found, Unreadable)
    assert "xid.hung[0].text is missing" in found.reason
    del document["xid"]["hung"]
    assert isinstance(parse(json.dumps(document)), Snapshot)


def test_explain_says_no_none_when_systemd_left_a_number_out() -> None:
    """Systemd 252's loop with EXIT_STATUS= and N_RESTARTS= removed: explain prints no None."""
    lines = (RECORDED / "restart-loop-start-limit.jsonl").read_text().splitlines()
    entries = [json.loads(line) for line in lines]
    for entry in entries:
        entry.pop("EXIT_STATUS", None)
        entry.pop("N_RESTARTS", None)
    found, text = explained(entries, "sglang.service")
    assert found.story.failed_starts
    assert "None" not in text
    # The daemon's evidence lines (its log, status's unit block) from the same entries.
    detector = Detector("sglang.service")
    for entry in entries:
        event = parse_entry(entry, "sglang.service")
        if event is not None:
            detector.observe(event, live=True)
    evidence = detector.diagnose(int(entries[-1]["__MONOTONIC_TIMESTAMP"]) / 1e6, None).evidence
    assert any("restart scheduled, counter at unknown" in line for line in evidence), evidence
    assert not [line for line in evidence if "None" in line], evidence


def test_a_run_systemd_started_is_not_called_starting() -> None:
    """After "Started", the verdict says started and not failed, never "is starting"."""
    lines = (RECORDED / "clean-start-stop.jsonl").read_text().splitlines()
    entries = [json.loads(line) for line in lines]
    started_at = next(
        i
        for i, e in enumerate(entries)
        if e.get("MESSAGE_ID") == "39f53479d3a045ac8e11786248231fbf"
    )
    detector = Detector("sglang.service")
    for entry in entries[: started_at + 1]:
        event = parse_entry(entry, "sglang.service")
        if event is not None:
            detector.observe(event, live=True)
    at = int(entries[started_at]["__MONOTONIC_TIMESTAMP"]) / 1e6 + 5
    reason = detector.diagnose(at, None).reason
    assert "is starting" not in reason
    assert "started at " in reason
    assert "has not failed" in reason


def test_explain_shows_the_kernel_saying_a_gpu_hangs() -> None:
    """The hung-GPU kernel line is a kernel row of explain's table, with what said it."""
    lines = (RECORDED / "clean-start-stop.jsonl").read_text().splitlines()
    entries = [json.loads(line) for line in lines]
    line = "nvidia-modeset: ERROR: GPU:0: Error while waiting for GPU progress: 0x0000ca7d:0"
    hung = kernel(line) | {
        "__CURSOR": "s=k;i=1",
        "_BOOT_ID": entries[-1]["_BOOT_ID"],
        "__MONOTONIC_TIMESTAMP": entries[-1]["__MONOTONIC_TIMESTAMP"],
        "__REALTIME_TIMESTAMP": entries[-1]["__REALTIME_TIMESTAMP"],
    }
    found, text = explained([*entries, hung], "sglang.service")
    [row] = [row for row in found.rows if row.kind == "gpu-hangs"]
    assert row.source == "kernel"
    assert row.text == f"nvidia-modeset waited for GPU progress in vain: {line}"
    assert line in text


def test_doctor_says_unknown_for_a_start_limit_systemd_did_not_report() -> None:
    """A unit whose StartLimitBurst= systemd did not report: "unknown" on screen, never None."""
    unit = UnitConfig(unit="sglang.service", load_state="loaded", restart="always", restart_s=1.0)
    audited = AuditedUnit(config=unit, history=History(), environment={}, gpus=None, user_uid=0)
    host = HostFacts(300.0, nvidia_devices=False, persistenced_running=False)
    found = next(f for f in diagnose(audited, {}, host) if f.code == "restart")
    said = "\n".join([found.title, *found.evidence])
    assert "StartLimitBurst=unknown" in said
    assert "None" not in said
