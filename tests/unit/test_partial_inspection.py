"""A process the /proc walk's budget cut short is never read as one that holds nothing."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone

from builders import STATUS_CONTEXT, gpu, inventory, nvml, plan_request, training_job

from gpuguard.core.gate.run import GateSettings, set_blockers
from gpuguard.core.inventory import build_inventory
from gpuguard.core.levels import Level
from gpuguard.core.status.document import to_json
from gpuguard.core.status.judge import assess
from gpuguard.core.status.text import render_text
from gpuguard.core.values import MIB, ProcScan

NOW = datetime(2026, 12, 1, 21, 0, tzinfo=timezone.utc)
FLOOD = "more than 65,536 open descriptors"


def test_a_partial_holder_of_a_gpu_keeps_it_from_reading_idle() -> None:
    """GPU 0 with no memory used is not idle while a process seen on it was not fully read."""
    flood = replace(training_job(40, 0), partial=FLOOD)
    found = inventory(nvml(gpu(0), gpu(1)), flood)
    assert [(p.pid, p.gpus, p.reason) for p in found.partial] == [(40, (0,), FLOOD)]
    report = assess(found, STATUS_CONTEXT, NOW)
    assert report.idle_gpus == frozenset({1})
    assert report.level is Level.WARNING
    text = render_text(report)
    assert "PID 40 (python3, alice) not fully inspected: more than 65,536" in text
    assert "1 not fully inspected" in text
    scan = to_json(report)["scan"]
    assert scan["partial"] == [
        {"pid": 40, "user": "alice", "comm": "python3", "reason": FLOOD, "gpus": [0]}
    ]
    blockers = set_blockers(found, GateSettings(plan_request(gpu_set=None), 16 * MIB, 1.0))
    assert blockers == (
        "GPU 0: PID 40 (python3, alice) could hold it and was not fully inspected: " + FLOOD,
    )


def test_a_partial_process_showing_only_a_control_node_could_hold_any_gpu() -> None:
    """Seen holding nvidiactl only, its GPU is unknown: no GPU of the host reads idle."""
    flood = replace(training_job(41), device_files=frozenset({"/dev/nvidiactl"}), partial=FLOOD)
    report = assess(inventory(nvml(gpu(0), gpu(1)), flood), STATUS_CONTEXT, NOW)
    assert report.idle_gpus == frozenset()


def test_a_partial_process_nvml_lists_is_taken_at_nvmls_word() -> None:
    """NVML lists it on GPU 1 and the part read shows no device file: a holder, not foreign."""
    flood = replace(training_job(42), partial=FLOOD)
    found = inventory(nvml(gpu(0), gpu(1, (42, 500))), flood)
    assert found.foreign == ()
    assert [h.pid for h in found.holders] == [42]
    assert found.partial[0].gpus == (1,)


def test_a_partial_process_with_no_nvidia_file_is_named_and_blocks_nothing() -> None:
    """No NVIDIA file in what was read and not listed: named in status (OK), every GPU idle.

    Any user can open many descriptors: that alone must not turn monitoring to WARNING.
    """
    flood = replace(training_job(43), partial="a maps file larger than 8 MiB")
    report = assess(inventory(nvml(gpu(0)), flood), STATUS_CONTEXT, NOW)
    assert report.idle_gpus == frozenset({0})
    assert report.level is Level.OK
    assert "PID 43 (python3, alice) not fully inspected: a maps file larger" in render_text(report)


def test_processes_the_walk_did_not_reach_are_counted_in_status() -> None:
    """A walk whose budget of processes or time ran out says how many it left unread."""
    found = build_inventory(nvml(gpu(0)), ProcScan((), not_visited=7), 16 * MIB)
    report = assess(found, STATUS_CONTEXT, NOW)
    assert report.level is Level.WARNING
    assert "7 processes not inspected" in render_text(report)
    assert to_json(report)["scan"]["not_visited"] == 7


def test_a_flood_of_partial_processes_names_ten_and_counts_the_rest() -> None:
    """Hundreds of flooding processes make eleven findings, not hundreds; --json lists all."""
    flood = [replace(training_job(100 + n), partial=FLOOD) for n in range(300)]
    report = assess(inventory(nvml(gpu(0)), *flood), STATUS_CONTEXT, NOW)
    partial = [f.message for f in report.findings if "not fully inspected" in f.message]
    assert len(partial) == 11
    assert partial[-1] == "290 more processes not fully inspected"
    assert len(to_json(report)["scan"]["partial"]) == 300
