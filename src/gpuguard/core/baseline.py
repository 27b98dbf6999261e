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

A host that installs gpuguard because of leaked memory may show it on every GPU the first time
gpuguard looks, so a learned value must be plausible and confirmed:

- plausible: at most what drivers really reserve (``plausible_max``: 2.5 % of the framebuffer and
  never more than 1.5 GiB; the published figures are 103 MiB to ~1 GB, docs/facts.md §2.3). A
  reading above it is memory somebody holds, never a reserve; it is never learned, and a forged
  state file cannot make a busy GPU look idle by more than it;
- confirmed: seen again, within ``TOLERANCE``, on a second occasion at least
  ``CONFIRM_AFTER_S`` after the first (a process that just died has released its memory by then,
  or the second reading is lower and starts over). Until then the estimate is shown as
  unconfirmed and the GPU is not called idle on its strength (idle.py).

The reserve can only be over-estimated (it is at most any reading of ``used``), and the minimum
only falls.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from gpuguard.core.protection import is_protected
from gpuguard.core.values import MIB, GpuMemory, MemoryApi, ReservedSource

if TYPE_CHECKING:
    from collections.abc import Collection, Mapping

    from gpuguard.core.inventory import Inventory
    from gpuguard.core.values import GpuReading, NvmlReading

PLAUSIBLE_SHARE = 40
"""A reserve is at most 1/40 (2.5 %) of the framebuffer: the A10's 513 MiB of 24 GiB (2.1 %) is
the largest share published."""
PLAUSIBLE_MAX_BYTES = 1536 * MIB
"""And at most 1.5 GiB whatever the GPU: the largest published idle v1 figure is ~1 GB."""
CONFIRM_AFTER_S = 60.0
"""The second occasion comes at least this long after the first."""
TOLERANCE = 64 * MIB
"""How far a second reading may lie above the first and still confirm it."""


@dataclass(frozen=True, slots=True)
class Learned:
    """A reserve learned for one GPU model: the bytes, when first seen, whether seen twice."""

    bytes: int
    first_s: float
    confirmed: bool = False


def plausible_max(memory: GpuMemory) -> int:
    """The most a driver reserves on a GPU of this size (see the module doc)."""
    return min(memory.total_bytes // PLAUSIBLE_SHARE, PLAUSIBLE_MAX_BYTES)


def learn(
    inventory: Inventory,
    known: Mapping[str, Learned],
    protected: Collection[str],
    now_s: float,
) -> dict[str, Learned]:
    """``known`` (model → reserve) updated by every v1 GPU that nothing holds in ``inventory``.

    ``inventory`` must be built from the raw reading (``used`` still including the reserve), by
    root: without root another user's job is invisible in /proc and would look like no holder.
    ``now_s``: the wall-clock time of the reading (an occasion).
    """
    seen: dict[str, int] = {}
    for gpu in inventory.gpus:
        reading = gpu.reading
        memory = reading.memory
        if memory is None or memory.api is not MemoryApi.V1:
            continue
        if reading.lost or reading.processes or memory.used_bytes > plausible_max(memory):
            continue
        holders = (inventory.holder(pid) for pid in gpu.holder_pids)
        if all(h is not None and is_protected(h, protected) for h in holders):
            model = model_of(reading, memory)
            seen[model] = min(seen.get(model, memory.used_bytes), memory.used_bytes)
    learned = dict(known)
    for model, value in seen.items():
        learned[model] = _occasion(known.get(model), value, now_s)
    return learned


def _occasion(old: Learned | None, value: int, now_s: float) -> Learned:
    """One more plausible idle reading of a model: first, confirming, or lower (start over)."""
    if old is None or value < old.bytes - TOLERANCE:
        return Learned(value, now_s)
    confirms = now_s - old.first_s >= CONFIRM_AFTER_S and value <= old.bytes + TOLERANCE
    return Learned(min(old.bytes, value), old.first_s, old.confirmed or confirms)


def model_of(reading: GpuReading, memory: GpuMemory) -> str:
    """The key a reserve is learned under: GPUs of one model under one driver reserve alike."""
    return f"{reading.name or 'unknown GPU'} {memory.total_bytes // MIB} MiB"


def apply(
    nvml: NvmlReading, configured_bytes: int | None, learned: Mapping[str, Learned]
) -> NvmlReading:
    """The reading with each v1 GPU's reserve (configured, else learned) taken out of ``used``.

    A GPU with neither keeps its raw ``used`` and no reserve: its idleness stays unknown. A
    learned reserve not yet confirmed is taken out too, marked unconfirmed.
    """
    return replace(nvml, gpus=tuple(_apply_one(g, configured_bytes, learned) for g in nvml.gpus))


def _apply_one(
    reading: GpuReading, configured_bytes: int | None, learned: Mapping[str, Learned]
) -> GpuReading:
    memory = reading.memory
    if memory is None or memory.api is not MemoryApi.V1 or memory.reserved_bytes is not None:
        return reading
    if configured_bytes is not None:
        reserve, source = configured_bytes, ReservedSource.CONFIGURED
    elif (found := learned.get(model_of(reading, memory))) is not None:
        reserve = min(found.bytes, plausible_max(memory))
        source = ReservedSource.LEARNED if found.confirmed else ReservedSource.UNCONFIRMED
    else:
        return reading
    reserve = min(max(reserve, 0), memory.used_bytes)
    return replace(
        reading,
        memory=GpuMemory(
            memory.total_bytes, memory.used_bytes - reserve, reserve, memory.api, source
        ),
    )
