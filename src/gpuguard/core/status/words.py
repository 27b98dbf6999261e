"""Phrases both the findings and the screen use: sizes, GPU lists, Xid lines (pure).

Said one way in both places, so a finding and the line it explains never drift apart; also the
daemon's Xid events matched to NVML's GPUs, which the findings, the screen and the JSON show.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuguard.core.escaping import escape
from gpuguard.core.since import within
from gpuguard.core.values import MIB
from gpuguard.core.xid.events import normalize_pci

if TYPE_CHECKING:
    from collections.abc import Sequence
    from datetime import datetime

    from gpuguard.core.inventory import Holder, Inventory, VanishedProcess
    from gpuguard.core.snapshot import DaemonView, XidRecord


def said(value: object, missing: str = "unknown") -> str:
    """A recorded value for a screen, escaped; ``missing`` for one not recorded (never ``None``).

    Records in the snapshot and the gate's log are plain JSON: any field may be absent or null,
    and Python's ``None`` is not a word an operator should read.
    """
    if value is None or value == "":
        return missing
    return escape(str(value))


def mib(value: int) -> str:
    """Bytes as whole MiB, as every line of status says them."""
    return f"{value // MIB} MiB"


def size(used_bytes: int | None) -> str:
    """`` (N MiB)`` after a PID, or nothing when NVML gave no figure."""
    return "" if used_bytes is None else f" ({mib(used_bytes)})"


def gpu_list(holder: Holder) -> str:
    """The GPUs a holder holds (``GPU 0,1``), or its device files when no GPU is known."""
    if holder.gpus:
        return "GPU " + ",".join(str(u.gpu_index) for u in holder.gpus)
    return "NVIDIA device files"


def by_gpu(vanished: Sequence[VanishedProcess]) -> dict[int, list[VanishedProcess]]:
    """Vanished PIDs grouped by the GPU NVML listed them on."""
    grouped: dict[int, list[VanishedProcess]] = {}
    for gone in vanished:
        grouped.setdefault(gone.gpu_index, []).append(gone)
    return grouped


CONTAINER_NOTE = "per-process amounts not available: the driver reports host PIDs"
OUTSIDE_NOTE = (
    "used from outside this container (another container or the host): no process here "
    "holds the GPU; reported, never reaped, and a start gated on this GPU waits for it"
)


@dataclass(frozen=True, slots=True)
class GpuXid:
    """A kernel Xid the daemon saw, with the GPU NVML gives its PCI address (None: none)."""

    xid: XidRecord
    gpu: int | None


def xid_events(
    inventory: Inventory, daemon: DaemonView | None, since: datetime | None = None
) -> list[GpuXid]:
    """The daemon's recent kernel Xid events, each with the GPU index NVML gives its PCI id.

    ``gpu`` is None when NVML knows no GPU at that address (reported, not dropped). With
    ``since``, only the events logged from then on.
    """
    snapshot = daemon.snapshot if daemon is not None else None
    if snapshot is None:
        return []
    by_pci = {
        normalize_pci(gpu.reading.pci_bus_id): gpu.reading.index
        for gpu in inventory.gpus
        if gpu.reading.pci_bus_id
    }
    return [
        GpuXid(xid, by_pci.get(normalize_pci(xid.pci_bus_id)))
        for xid in snapshot.xids
        if within(since, xid.time)
    ]


def xid_phrase(xid: XidRecord) -> str:
    """One kernel Xid for people: code, class, time, the driver's detail and its PID."""
    who = f", pid {xid.pid}" if xid.pid is not None else ""
    return (
        f"Xid {xid.code} ({escape(xid.xid_class)}) at {said(xid.time, 'an unknown time')}: "
        f"{escape(xid.detail)}{who}"
    )


def as_list(value: object) -> list[Any]:
    """A record's field that should be a list."""
    return value if isinstance(value, list) else []
