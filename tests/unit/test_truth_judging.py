"""Status and the gate judge evidence truthfully: state D, uninspectable PIDs (pure core)."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone

from gpuguard.core.gate import GateSettings, set_blockers
from gpuguard.core.inventory import build_inventory
from gpuguard.core.policy import PlanRequest, Scope
from gpuguard.core.status import Level, StatusContext, assess, render_text, to_json
from gpuguard.core.values import (
    MIB,
    GpuMemory,
    GpuReading,
    MemoryApi,
    NvmlHealth,
    NvmlProcess,
    NvmlReading,
    ProcessFacts,
    ProcessIdentity,
    ProcessListKind,
    ProcScan,
    UnitProvenance,
)

NOW = datetime(2026, 12, 1, 3, 0, tzinfo=timezone.utc)
CONTEXT = StatusContext(
    watched_units={"sglang.service": ("sglang",)},
    protected_names=("nvidia-persistenced",),
    idle_threshold_bytes=16 * MIB,
    as_root=True,
)


def busy_gpu(index: int, pid: int, mib: int) -> GpuReading:
    """A v2 GPU with one listed process."""
    return GpuReading(
        index=index,
        minor=index,
        memory=GpuMemory(143771 * MIB, mib * MIB, 0, MemoryApi.V2),
        processes=(NvmlProcess(pid, mib * MIB, ProcessListKind.COMPUTE),),
    )


def facts(pid: int, *, state: str = "S", kernel_wait: tuple[str, ...] = ()) -> ProcessFacts:
    """A root process holding /dev/nvidia0."""
    return ProcessFacts(
        identity=ProcessIdentity(pid, 100),
        ppid=1,
        state=state,
        comm="python3",
        cmdline=("python3", "train.py"),
        uid=0,
        user="root",
        cgroup="/system.slice/train.service",
        device_files=frozenset({"/dev/nvidia0"}),
        kernel_wait=kernel_wait,
    )


def judged(scan: ProcScan, *, as_root: bool = True) -> tuple[Level, str]:
    """Assess one busy GPU 0 (PID 10, 2000 MiB) with this /proc evidence."""
    nvml = NvmlReading(NvmlHealth.OK, None, "550.54.15", (busy_gpu(0, 10, 2000),))
    report = assess(build_inventory(nvml, scan, 16 * MIB), replace(CONTEXT, as_root=as_root), NOW)
    return report.level, render_text(report)


def test_state_d_in_the_nvidia_driver_is_critical() -> None:
    """A frame of nvidia_uvm on the kernel stack: stuck in the driver, reset or reboot."""
    frames = ("uvm_spin_loop", "uvm_spin_loop+0x8c/0x190 [nvidia_uvm]", "do_syscall_64+0x71/0x290")
    level, text = judged(ProcScan((facts(10, state="D", kernel_wait=frames),)))
    assert level is Level.CRITICAL
    assert "is stuck in the NVIDIA driver (state D, in uvm_spin_loop)" in text
    assert "a GPU reset or reboot may be needed" in text


def test_state_d_elsewhere_is_uninterruptible_sleep() -> None:
    """A vfork() parent's stack (recorded from a 6.x kernel) names no driver: not an alarm."""
    frames = ("kernel_clone", "kernel_clone+0x1d3/0x400", "__do_sys_vfork+0x66/0x90")
    level, text = judged(ProcScan((facts(10, state="D", kernel_wait=frames),)))
    assert level is Level.OK
    assert "in uninterruptible sleep (state D, in kernel_clone, not the NVIDIA driver)" in text
    assert "reset" not in text


def test_state_d_with_no_visible_wait_is_a_warning_that_says_why() -> None:
    """Without root wchan reads "0" and stack is closed: unknown, so a warning, not CRITICAL."""
    level, text = judged(ProcScan((facts(10, state="D"),)), as_root=False)
    assert level is Level.WARNING
    assert "uninterruptible sleep (state D); where it waits is visible only to root" in text


def test_hidden_pid_is_uninspectable_not_vanished() -> None:
    """/proc has the PID but will not show it (hidepid=): OK level, no "no such process"."""
    scan = ProcScan((), hidden=frozenset({10}))
    level, text = judged(scan, as_root=False)
    assert level is Level.OK
    assert "no such process" not in text
    assert "NVML lists PID 10 (2000 MiB), which exists but is not inspectable without root" in text
    nvml = NvmlReading(NvmlHealth.OK, None, "550.54.15", (busy_gpu(0, 10, 2000),))
    inventory = build_inventory(nvml, scan, 16 * MIB)
    assert inventory.vanished == ()
    assert to_json(assess(inventory, CONTEXT, NOW))["uninspectable"] == [
        {"pid": 10, "gpu": 0, "used_mib": 2000}
    ]
    request = PlanRequest(
        unit="sglang.service",
        scope=Scope.UNIT,
        patterns=("sglang",),
        gpu_set=frozenset({0}),
        protected_names=(),
        untouchable_pids=frozenset(),
        provenance=UnitProvenance(None),
        live_invocation=None,
    )
    blockers = set_blockers(inventory, GateSettings(request, 16 * MIB, 1.0))
    assert "GPU 0: NVML lists PID 10, which /proc does not let gpuguard inspect" in blockers


def test_v1_gpu_without_an_estimate_is_a_warning_not_busy_by_live_processes() -> None:
    """No reserve known yet: say so; never "in use by live processes" when nobody holds it."""
    v1 = GpuReading(index=0, minor=0, memory=GpuMemory(143771 * MIB, 530 * MIB, None, MemoryApi.V1))
    nvml = NvmlReading(NvmlHealth.OK, None, "512.15", (v1,))
    report = assess(build_inventory(nvml, ProcScan(()), 16 * MIB), CONTEXT, NOW)
    assert report.level is Level.WARNING
    assert report.headline.startswith(
        "GPU 0: the v1 memory API counts the driver's reserved memory as used and no estimate"
    )
