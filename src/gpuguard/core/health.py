"""Judge one GPU's health: does it need a reset before anything can use it again (pure).

Killing a process frees GPU memory only while the GPU works. After a fall off the bus, a
pending row remap or page retirement, or when the driver itself asks for a reset or reboot,
memory does not come back and every restart is wasted, so these facts stop gate and daemon.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuguard.core.values import RecoveryAction

if TYPE_CHECKING:
    from gpuguard.core.values import GpuReading

_RESET_ACTIONS = {
    RecoveryAction.GPU_RESET: "the driver asks for a GPU reset",
    RecoveryAction.DRAIN_AND_RESET: "the driver asks to drain and reset the GPU",
    RecoveryAction.BUS_RESET: "the driver asks for a PCI bus reset",
    RecoveryAction.NODE_REBOOT: "the driver asks for a node reboot",
    RecoveryAction.SYSTEM_REBOOT: "the driver asks for a system reboot",
}

_ADVISORY_ACTIONS = {
    RecoveryAction.DRAIN_P2P: "the driver asks to drain peer-to-peer traffic",
    RecoveryAction.RECOVER_IMEX_DOMAIN: "the driver asks to recover the IMEX domain",
    RecoveryAction.OTHER: "the driver reports a recovery action this gpuguard does not know",
}


def reset_reasons(reading: GpuReading) -> tuple[str, ...]:
    """Why this GPU needs a reset or reboot before it is usable; empty when nothing says so."""
    health = reading.health
    reasons: list[str] = []
    if reading.lost:
        reasons.append("GPU is lost (fallen off the bus)")
    if health.reset_required:
        reasons.append("the driver answers 'GPU requires restart'")
    if health.remapped_rows_pending:
        reasons.append("a memory row remap is pending")
    if health.retired_pages_pending:
        reasons.append("a memory page retirement is pending")
    if health.recovery_action in _RESET_ACTIONS:
        reasons.append(_RESET_ACTIONS[health.recovery_action])
    return tuple(reasons)


def needs_reboot(reading: GpuReading) -> bool:
    """A GPU reset cannot help: the driver asks for a reboot, or the GPU left the bus."""
    action = reading.health.recovery_action
    return reading.lost or action in (RecoveryAction.NODE_REBOOT, RecoveryAction.SYSTEM_REBOOT)


def health_warnings(reading: GpuReading) -> tuple[str, ...]:
    """Health facts an operator should see that do not by themselves block the GPU."""
    health = reading.health
    warnings: list[str] = []
    if health.remapped_rows_failed:
        warnings.append(
            "memory row remapping has failed: the GPU cannot repair its memory any more "
            "(contact NVIDIA support; replacement is likely)"
        )
    if health.volatile_uncorrectable_ecc:
        warnings.append(
            f"{health.volatile_uncorrectable_ecc} uncorrectable ECC error(s) since the last "
            "driver load or GPU reset"
        )
    if health.recovery_action in _ADVISORY_ACTIONS:
        warnings.append(_ADVISORY_ACTIONS[health.recovery_action])
    return tuple(warnings)
