"""Which processes gpuguard must never signal, and which GPUs count as idle (pure)."""

from __future__ import annotations

from pathlib import PurePath
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Collection

    from gpuguard.core.holders import Holder
    from gpuguard.core.values import GpuReading


def is_protected(holder: Holder, protected_names: Collection[str]) -> bool:
    """True for driver daemons, monitors, display servers and anything configured.

    Matched on ``comm`` (the kernel's 15-character name) and on the basename of argv[0], so both
    ``nvidia-persistenced`` and ``/usr/bin/nvidia-persistenced --verbose`` match.
    """
    names = set(protected_names)
    argv0 = PurePath(holder.cmdline[0]).name if holder.cmdline else ""
    return holder.comm in names or argv0 in names or any(n[:15] == holder.comm for n in names)


def is_idle(reading: GpuReading, idle_threshold_bytes: int) -> bool:
    """Idle means the next start can allocate: no process has memory on the GPU.

    That is: NVML lists no process on it (a protected one too: gpuguard will not kill it, but
    its memory is not free either) and its used memory is within the threshold. A process that
    merely opened /dev/nvidiaN (an exporter, nvidia-smi) holds no memory and does not count:
    waiting on it would block every start. Memory kept through an inherited fd by a process
    NVML does not list still shows in ``used``. Never idle when NVML could not read the GPU's
    memory: an error is not evidence of idleness.
    """
    if reading.memory is None or reading.lost or reading.processes:
        return False
    return reading.memory.used_bytes <= idle_threshold_bytes
