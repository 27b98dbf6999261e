"""When a GPU counts as idle: what the gate waits for and status reports (pure)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuguard.core.inventory import GpuOccupancy, Inventory
    from gpuguard.core.values import GpuReading


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


def is_idle_seen(inventory: Inventory, gpu: GpuOccupancy, idle_threshold_bytes: int) -> bool:
    """Idle by NVML's memory, and no process the /proc walk could not read in full may hold it.

    An exhausted budget never reads as clean (inventory.py says which GPUs such a process could
    hold). The gate's fast path, which reads no /proc, decides on memory alone (``is_idle``).
    """
    return is_idle(gpu.reading, idle_threshold_bytes) and not inventory.partial_on(
        gpu.reading.index
    )
