"""Status and the gate judge evidence truthfully: state D, uninspectable PIDs (pure core)."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone

import pytest
from builders import (
    STATUS_CONTEXT,
    TRAINING_CGROUP,
    gpu,
    inventory,
    nvml,
    plan_request,
    process,
    v1_gpu,
)

from gpuguard.core.gate.run import GateSettings, set_blockers
from gpuguard.core.inventory import build_inventory
from gpuguard.core.levels import Level
from gpuguard.core.status.document import to_json
from gpuguard.core.status.judge import assess
from gpuguard.core.status.text import render_text
from gpuguard.core.values import MIB, NvmlHealth, NvmlReading, ProcScan

NOW = datetime(2026, 12, 1, 3, 0, tzinfo=timezone.utc)


BUSY = nvml(gpu(0, (10, 2000)))
"""GPU 0 with PID 10 listed on it (2000 MiB)."""


def judged(scan: ProcScan, *, as_root: bool = True) -> tuple[Level, str]:
    """Assess the busy GPU 0 with this /proc evidence."""
    report = assess(
        build_inventory(BUSY, scan, 16 * MIB), replace(STATUS_CONTEXT, as_root=as_root), NOW
    )
    return report.level, render_text(report)


@pytest.mark.parametrize(
    ("kernel_wait", "as_root", "level", "said", "unsaid"),
    [
        pytest.param(
            ("uvm_spin_loop", "uvm_spin_loop+0x8c/0x190 [nvidia_uvm]", "do_syscall_64+0x71/0x290"),
            True,
            Level.CRITICAL,
            (
                "is stuck in the NVIDIA driver (state D, in uvm_spin_loop)",
                "a GPU reset or reboot may be needed",
            ),
            (),
            id="in-the-nvidia-driver-is-critical",
        ),
        pytest.param(
            ("kernel_clone", "kernel_clone+0x1d3/0x400", "__do_sys_vfork+0x66/0x90"),
            True,
            Level.OK,
            ("in uninterruptible sleep (state D, in kernel_clone, not the NVIDIA driver)",),
            ("reset",),
            id="elsewhere-is-uninterruptible-sleep",
        ),
        pytest.param(
            (),
            False,
            Level.WARNING,
            ("uninterruptible sleep (state D); where it waits is visible only to root",),
            (),
            id="no-visible-wait-is-a-warning-that-says-why",
        ),
    ],
)
def test_state_d_is_judged_by_where_the_kernel_says_it_waits(
    kernel_wait: tuple[str, ...],
    *,
    as_root: bool,
    level: Level,
    said: tuple[str, ...],
    unsaid: tuple[str, ...],
) -> None:
    """A frame of nvidia_uvm on the kernel stack: stuck in the driver, reset or reboot.

    A vfork() parent's stack (recorded from a 6.x kernel) names no driver: not an alarm.
    Without root wchan reads "0" and stack is closed: unknown, so a warning, not CRITICAL.
    """
    job = process(
        10,
        0,
        cgroup=TRAINING_CGROUP,
        cmdline=("python3", "train.py"),
        state="D",
        kernel_wait=kernel_wait,
    )
    judged_level, text = judged(ProcScan((job,)), as_root=as_root)
    assert judged_level is level
    for phrase in said:
        assert phrase in text
    for phrase in unsaid:
        assert phrase not in text


def test_hidden_pid_is_uninspectable_not_vanished() -> None:
    """/proc has the PID but will not show it (hidepid=): OK level, no "no such process"."""
    scan = ProcScan((), hidden=frozenset({10}))
    level, text = judged(scan, as_root=False)
    assert level is Level.OK
    assert "no such process" not in text
    assert "NVML lists PID 10 (2000 MiB), which exists but is not inspectable without root" in text
    merged = build_inventory(BUSY, scan, 16 * MIB)
    assert merged.vanished == ()
    assert to_json(assess(merged, STATUS_CONTEXT, NOW))["uninspectable"] == [
        {"pid": 10, "gpu": 0, "used_mib": 2000}
    ]
    request = plan_request(gpu_set=frozenset({0}))
    blockers = set_blockers(merged, GateSettings(request, 16 * MIB, 1.0))
    assert "GPU 0: NVML lists PID 10, which /proc does not let gpuguard inspect" in blockers


def test_v1_gpu_without_an_estimate_is_a_warning_not_busy_by_live_processes() -> None:
    """No reserve known yet: say so; never "in use by live processes" when nobody holds it."""
    old_driver = NvmlReading(NvmlHealth.OK, None, "512.15", (v1_gpu(0, 530),))
    report = assess(inventory(old_driver), STATUS_CONTEXT, NOW)
    assert report.level is Level.WARNING
    assert report.headline.startswith(
        "GPU 0: the v1 memory API counts the driver's reserved memory as used and no estimate"
    )
