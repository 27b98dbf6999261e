"""The v1 memory API's reserved carve-out: learned or configured, so that idle is idle (pure).

NVML's v2 memory call reports the memory the driver reserves for itself apart from ``used``;
drivers older than 515 have only the v1 call, whose ``used`` includes it (hundreds of MiB on an
idle GPU). Counted as use, every idle GPU looks busy and the gate refuses every start. So that
reserve is estimated and taken out of ``used``:

- configured (``v1_reserved_mib``): the operator knows it, e.g. from ``nvidia-smi`` on an idle GPU;
- else learned per GPU model (name and total memory: the same model under the same driver
  reserves the same amount): the smallest v1 ``used`` seen on any GPU of that model while no
  process held it (NVML lists none, and /proc shows no holder of its device file except
  protected daemons such as nvidia-persistenced, which hold no memory of their own). Taking the
  minimum over siblings keeps memory leaked on one GPU from being learned as its reserve: it is
  reported as unattributed instead.

The reserve can only be over-estimated (it is at most any reading of ``used``), and the minimum
only falls; a learned value is bounded by ``total / LEARNED_CAP_DIVISOR`` so that memory a dying
process has not yet released can never be learned as "reserved" (nor a forged state file make a
busy GPU look idle by more than that).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from gpuguard.core.protection import is_protected
from gpuguard.core.values import MIB, GpuMemory, MemoryApi, ReservedSource

if TYPE_CHECKING:
    from collections.abc import Collection, Mapping

    from gpuguard.core.inventory import Inventory
    from gpuguard.core.values import GpuReading, NvmlReading

# Driver reserves seen with the v1 API are 0.3-1 % of the framebuffer (A100 80 GB: ~560 MiB);
# 1/32 (~3 %) leaves room for every model and none for a model's weights.
LEARNED_CAP_DIVISOR = 32


def learn(
    inventory: Inventory, known: Mapping[str, int], protected: Collection[str]
) -> dict[str, int]:
    """``known`` (model → bytes) lowered by every v1 GPU that nothing holds in ``inventory``.

    ``inventory`` must be built from the raw reading (``used`` still including the reserve), by
    root: without root another user's job is invisible in /proc and would look like no holder.
    """
    learned = dict(known)
    for gpu in inventory.gpus:
        reading = gpu.reading
        memory = reading.memory
        if memory is None or memory.api is not MemoryApi.V1:
            continue
        if reading.lost or reading.processes or memory.used_bytes > _cap(memory):
            continue
        holders = (inventory.holder(pid) for pid in gpu.holder_pids)
        if all(h is not None and is_protected(h, protected) for h in holders):
            model = model_of(reading, memory)
            learned[model] = min(learned.get(model, memory.used_bytes), memory.used_bytes)
    return learned


def model_of(reading: GpuReading, memory: GpuMemory) -> str:
    """The key a reserve is learned under: GPUs of one model under one driver reserve alike."""
    return f"{reading.name or 'unknown GPU'} {memory.total_bytes // MIB} MiB"


def apply(
    nvml: NvmlReading, configured_bytes: int | None, learned: Mapping[str, int]
) -> NvmlReading:
    """The reading with each v1 GPU's reserve (configured, else learned) taken out of ``used``.

    A GPU with neither keeps its raw ``used`` and no reserve: its idleness stays unknown.
    """
    return replace(nvml, gpus=tuple(_apply_one(g, configured_bytes, learned) for g in nvml.gpus))


def _apply_one(
    reading: GpuReading, configured_bytes: int | None, learned: Mapping[str, int]
) -> GpuReading:
    memory = reading.memory
    if memory is None or memory.api is not MemoryApi.V1 or memory.reserved_bytes is not None:
        return reading
    if configured_bytes is not None:
        reserve, source = configured_bytes, ReservedSource.CONFIGURED
    elif (model := model_of(reading, memory)) in learned:
        reserve, source = min(learned[model], _cap(memory)), ReservedSource.LEARNED
    else:
        return reading
    reserve = min(max(reserve, 0), memory.used_bytes)
    return replace(
        reading,
        memory=GpuMemory(
            memory.total_bytes, memory.used_bytes - reserve, reserve, memory.api, source
        ),
    )


def _cap(memory: GpuMemory) -> int:
    return memory.total_bytes // LEARNED_CAP_DIVISOR
