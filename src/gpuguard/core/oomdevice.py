"""Which GPU a start-failure line means: ``cuda:1`` in the server's numbering → NVML's GPU (pure).

A server numbers the GPUs it sees from 0, after CUDA_VISIBLE_DEVICES picked and ordered them,
so "cuda:1 ran out of memory" on a unit with ``CUDA_VISIBLE_DEVICES=2,3`` is NVML's GPU 3. The
number comes from the unit's own output, which its user writes: it only ever selects a GPU the
unit sees (a number past them is said and ignored), and it only shapes what the diagnosis
says; it never decides what is reaped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuguard.core.escaping import escape
from gpuguard.core.values import MIB

if TYPE_CHECKING:
    from gpuguard.core.gpuset import CudaView
    from gpuguard.core.inventory import Inventory

_SHOWN_HOLDERS = 3


def device_phrases(view: CudaView, inventory: Inventory) -> tuple[str, ...] | None:
    """For each CUDA device k the unit sees, "GPU 3, held by PID 77 (python3, training.service)".

    None when the numbering cannot be told (``view.note`` says why).
    """
    if view.indices is None:
        return None
    by_index = {gpu.reading.index: gpu for gpu in inventory.gpus}
    phrases = []
    for index in view.indices:
        gpu = by_index.get(index)
        if gpu is None:
            phrases.append(f"GPU {index}, which NVML does not list now")
            continue
        holders = [h for pid in gpu.holder_pids if (h := inventory.holder(pid)) is not None]
        memory = gpu.reading.memory
        used = "" if memory is None else f" ({memory.used_bytes // MIB} MiB used)"
        if not holders:
            phrases.append(f"GPU {index}{used}, held by no process now")
            continue
        named = ", ".join(
            f"PID {h.pid} ({escape(h.comm)}, {h.owner})" for h in holders[:_SHOWN_HOLDERS]
        )
        more = len(holders) - _SHOWN_HOLDERS
        phrases.append(
            f"GPU {index}{used}, held by {named}" + (f" and {more} more" if more > 0 else "")
        )
    return tuple(phrases)


def describe_device(device: int, phrases: tuple[str, ...] | None, note: str | None = None) -> str:
    """What ``cuda:device`` of a failure line means here, for the diagnosis's detail."""
    if phrases is None:
        return f"cuda:{device} cannot be placed: {note or 'the CUDA numbering is unknown'}"
    if device >= len(phrases):
        seen = len(phrases)
        return (
            f"cuda:{device} names no GPU the unit sees ({seen} visible to it): ignored, "
            "the unit's output is not evidence for other GPUs"
        )
    return f"cuda:{device} = {phrases[device]}"
