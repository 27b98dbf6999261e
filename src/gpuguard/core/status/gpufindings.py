"""Findings about the GPUs themselves: NVML, health, memory estimates, MIG, unbacked PIDs (pure).

What each GPU says through NVML, and what NVML's process list claims that ``/proc`` does not
back (a vanished PID, a host PID inside a container, a reused one): each with its level and,
where a kill cannot help, what to do instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuguard.core.baseline import CONFIRM_AFTER_S, plausible_max
from gpuguard.core.health import health_warnings, needs_reboot, reset_reasons
from gpuguard.core.levels import Level
from gpuguard.core.mig import UNJUDGED, mig_on, pending_change
from gpuguard.core.status.report import Finding
from gpuguard.core.status.words import CONTAINER_NOTE, OUTSIDE_NOTE, by_gpu, mib, size
from gpuguard.core.values import MemoryApi, NvmlHealth, ReservedSource

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gpuguard.core.inventory import GpuOccupancy, Inventory
    from gpuguard.core.values import GpuReading


def nvml_findings(inventory: Inventory) -> list[Finding]:
    """NVML that timed out, is too old, or is missing (with no holders, nothing can be judged)."""
    nvml = inventory.nvml
    if nvml.health is NvmlHealth.OK:
        return []
    reason = nvml.reason or nvml.health.value
    if nvml.health is NvmlHealth.TIMED_OUT:
        return [Finding(Level.CRITICAL, reason)]
    if nvml.health is NvmlHealth.DRIVER_TOO_OLD:
        return [Finding(Level.WARNING, reason)]
    # Without NVML the /proc scan is the only evidence; with none at all we cannot judge.
    level = Level.WARNING if inventory.holders else Level.UNKNOWN
    return [Finding(level, reason)]


def _v1_findings(inventory: Inventory) -> list[Finding]:
    """Say when memory figures are estimates, and when they cannot even be that."""
    estimated: list[str] = []
    findings: list[Finding] = []
    for gpu in inventory.gpus:
        memory = gpu.reading.memory
        if memory is None or memory.api is not MemoryApi.V1:
            continue
        if memory.reserved_bytes is None:
            bound = plausible_max(memory)
            above = (
                f"; its {mib(memory.used_bytes)} in use is more than a driver reserves (at most "
                f"{mib(bound)}): memory held by something, never learned as the reserve"
                if memory.used_bytes > bound
                else ""
            )
            findings.append(
                Finding(
                    Level.WARNING,
                    f"GPU {gpu.reading.index}: the v1 memory API counts the driver's reserved "
                    "memory as used and no estimate of it exists yet, so idle cannot be told "
                    "from busy (set v1_reserved_mib, or run gpuguard as root while it is idle)"
                    + above,
                )
            )
        else:
            if memory.reserved_source is ReservedSource.UNCONFIRMED:
                findings.append(
                    Finding(
                        Level.WARNING,
                        f"GPU {gpu.reading.index}: the v1 reserve learned for it "
                        f"({mib(memory.reserved_bytes)}) is not confirmed yet: an idle reading "
                        f"{CONFIRM_AFTER_S:.0f} s or more after the first confirms it; until "
                        "then the GPU is not called idle",
                    )
                )
            estimated.append(
                f"GPU {gpu.reading.index} {mib(memory.reserved_bytes)} "
                f"({memory.reserved_source or 'reported'})"
            )
    if estimated:
        findings.insert(
            0,
            Finding(
                Level.OK,
                "memory use is estimated: the v1 memory API counts the driver's reserved memory "
                "as used; taken out: " + ", ".join(estimated),
            ),
        )
    return findings


def gpu_findings(inventory: Inventory) -> list[Finding]:
    """Each GPU's health, MIG mode, memory nobody explains, and PIDs NVML lists but /proc lacks."""
    findings: list[Finding] = _v1_findings(inventory)
    for gpu in inventory.gpus:
        reading = gpu.reading
        if reasons := reset_reasons(reading):
            findings.append(Finding(Level.CRITICAL, _reset_advice(reading, reasons)))
        elif reading.problem:
            findings.append(Finding(Level.WARNING, f"GPU {reading.index}: {reading.problem}"))
        findings.extend(
            Finding(Level.WARNING, f"GPU {reading.index}: {warning}")
            for warning in health_warnings(reading)
        )
        if mig_on(reading):
            # Its unattributed memory may well be another tenant's instance: said here, once.
            findings.append(Finding(Level.WARNING, _mig_finding(reading)))
            continue
        if change := pending_change(reading):
            findings.append(Finding(Level.OK, f"GPU {reading.index}: {change}"))
        if gpu.unattributed_bytes:
            findings.append(
                Finding(
                    Level.CRITICAL,
                    f"GPU {reading.index}: {mib(gpu.unattributed_bytes)} in use that no visible "
                    "process explains (a process in another PID namespace, or the driver "
                    "still releasing it)",
                )
            )
        findings.extend(_namespace_findings(gpu))
    findings.extend(_claim_findings(inventory))
    findings.extend(
        Finding(
            Level.OK,
            f"GPU {hidden.gpu_index}: NVML lists PID {hidden.pid}"
            f"{'' if hidden.used_bytes is None else f' ({mib(hidden.used_bytes)})'}"
            ", which exists but is not inspectable without root",
        )
        for hidden in inventory.uninspectable
    )
    return findings


def _mig_finding(reading: GpuReading) -> str:
    change = pending_change(reading)
    return (
        f"GPU {reading.index}: MIG mode is on: {UNJUDGED}; the gate and the daemon neither wait "
        "on nor reap from it (check its instances with `nvidia-smi mig -lgi` and "
        "`nvidia-smi`)" + (f"; {change}" if change else "")
    )


def _namespace_findings(gpu: GpuOccupancy) -> list[Finding]:
    """Inside a PID namespace: memory credited to this container's holders, or used outside."""
    index = gpu.reading.index
    findings = []
    if gpu.container_bytes:
        findings.append(
            Finding(
                Level.OK,
                f"GPU {index}: {mib(gpu.container_bytes)} held by processes of this container "
                f"({CONTAINER_NOTE})",
            )
        )
    if gpu.outside_bytes:
        findings.append(
            Finding(
                Level.WARNING,
                f"GPU {index}: {mib(gpu.outside_bytes)} {OUTSIDE_NOTE}",
            )
        )
    return findings


def _claim_findings(inventory: Inventory) -> list[Finding]:
    """NVML PIDs /proc does not back: gone (on a host) or from another PID namespace."""
    in_namespace = inventory.containment.foreign_pids
    if in_namespace:
        findings = [
            Finding(
                Level.OK,
                f"GPU {index}: NVML lists host PIDs "
                + ", ".join(f"{g.pid}{size(g.used_bytes)}" for g in gone)
                + ", of another PID namespace (the driver reports host PIDs)",
            )
            for index, gone in by_gpu(inventory.vanished).items()
        ]
    else:
        findings = [
            Finding(
                Level.CRITICAL,
                f"GPU {gone.gpu_index}: NVML lists PID {gone.pid}{size(gone.used_bytes)}"
                " but /proc has no such process",
            )
            for gone in inventory.vanished
        ]
    findings.extend(
        Finding(
            Level.OK if in_namespace else Level.CRITICAL,
            f"GPU {other.gpu_index}: NVML lists PID {other.pid}{size(other.used_bytes)}, a PID "
            f"from another PID namespace or a reused one: PID {other.pid} here is an unrelated "
            f"process that holds no device file of GPU {other.gpu_index} (not credited, never "
            "signalled)",
        )
        for other in inventory.foreign
    )
    return findings


def _reset_advice(reading: GpuReading, reasons: Sequence[str]) -> str:
    """What is wrong and what to do: killing processes cannot free such a GPU."""
    index = reading.index
    what = "; ".join(reasons)
    if needs_reboot(reading):
        return (
            f"GPU {index} needs a reboot ({what}): no kill or restart can free it; drain the "
            "host and reboot it (docs/runbook.md, GPU needs a reset)"
        )
    return (
        f"GPU {index} needs a GPU reset ({what}): no kill or restart can free it; stop every "
        f"process using it, then run `nvidia-smi -r -i {index}` as root, or reboot "
        "(docs/runbook.md, GPU needs a reset)"
    )
