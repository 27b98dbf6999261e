"""Which kernel Xids stop a unit: a reset-class fault on its GPUs since it last came up (pure).

NVML health sees most GPUs that need a reset; some faults it does not (a GSP timeout, Xid 119,
can leave a GPU that answers NVML and reports healthy), and the kernel's Xid line is then the
only evidence. A fault counts for a unit when all hold:

* its class (catalogue.py) is ``reset-gpu`` or ``reboot``: no kill and no restart can cure it;
* it was logged after the unit's last good start: the newest run that stayed up (or ended
  cleanly), and any start systemd did not schedule as an automatic restart (an operator's
  ``systemctl start`` after the reset the runbook asks for; the gate tells those apart by
  systemd's ``NRestarts``, which such a start sets back to 0). A fault before either has been
  dealt with, or did not stop the server;
* its PCI address is one NVML gives a GPU of the unit's set. An address NVML does not know
  (a lost GPU has none) never widens the set: status reports it, and NVML's "lost" decides.

Only ``_TRANSPORT=kernel`` entries become Xid events at all (xid/events.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from gpuguard.core.escaping import escape
from gpuguard.core.events import EventKind
from gpuguard.core.xid.catalogue import XidClass, lookup
from gpuguard.core.xid.events import normalize_pci

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from gpuguard.core.events import UnitEvent
    from gpuguard.core.values import GpuReading
    from gpuguard.core.xid.events import XidEvent

RESET_CLASSES: Final = frozenset({XidClass.RESET_GPU, XidClass.REBOOT})
MAX_FAULTS: Final = 16
"""Faults a snapshot carries per unit: the newest one per GPU is all a decision needs."""
_MAX_ADDRESSES: Final = 64
"""PCI addresses remembered: more GPUs than any host has; the oldest goes first."""


@dataclass(frozen=True, slots=True)
class XidFault:
    """A reset-class Xid that counts for a unit: where, which, and when (for people)."""

    pci_bus_id: str
    code: int
    time: str | None


@dataclass(slots=True)
class LastUp:
    """When a unit last came up, from PID 1's events (history too) and the detector's verdicts.

    A start is an automatic restart when PID 1 scheduled one ("Scheduled restart job") since
    the previous start and no stop job or start limit cancelled it; any other start (an
    operator's, a dependency's, gpuguard's recovery) moves ``since_s``, and so does a run that
    stayed up.
    """

    since_s: float | None = None
    _restart_scheduled: bool = False
    _invocation: str | None = None

    def observe(self, event: UnitEvent) -> None:
        """Fold in one trusted event of the unit, in journal order."""
        if event.kind is EventKind.RESTART_SCHEDULED:
            self._restart_scheduled = True
        elif event.kind is EventKind.START_LIMIT_HIT or (
            event.kind in {EventKind.STOPPING, EventKind.STOPPED} and event.job_type == "stop"
        ):
            self._restart_scheduled = False  # the scheduled restart will not come
        elif event.kind in {EventKind.STARTING, EventKind.STARTED}:
            if event.invocation_id is None or event.invocation_id == self._invocation:
                return
            self._invocation = event.invocation_id
            if not self._restart_scheduled:
                self.stayed_up(event.monotonic_s)
            self._restart_scheduled = False

    def stayed_up(self, started_s: float | None) -> None:
        """A run that started at ``started_s`` came up (or was started by hand)."""
        if started_s is not None and (self.since_s is None or started_s > self.since_s):
            self.since_s = started_s


@dataclass(slots=True)
class FaultLog:
    """The newest reset-class Xid of each PCI address: a storm of other Xids cannot evict it."""

    newest: dict[str, XidEvent] = field(default_factory=dict)

    def add(self, event: XidEvent) -> None:
        """Keep ``event`` when it is reset-class and the newest of its address."""
        if not needs_reset(event.code) or event.monotonic_s is None:
            return
        kept = self.newest.get(event.pci_bus_id)
        if kept is None and len(self.newest) >= _MAX_ADDRESSES:
            oldest = min(self.newest.values(), key=lambda e: e.monotonic_s or 0.0)
            del self.newest[oldest.pci_bus_id]
        if kept is None or (kept.monotonic_s or 0.0) <= event.monotonic_s:
            self.newest[event.pci_bus_id] = event

    def since(self, since_s: float | None) -> list[XidEvent]:
        """The kept faults logged after ``since_s`` (None: all), oldest first."""
        found = counting(self.newest.values(), since_s)
        return sorted(found, key=lambda event: event.monotonic_s or 0.0)[-MAX_FAULTS:]


def needs_reset(code: int) -> bool:
    """Whether an Xid of this code leaves a GPU no kill can free."""
    return lookup(code).xid_class in RESET_CLASSES


def counting(events: Iterable[XidEvent], since_s: float | None) -> list[XidEvent]:
    """The reset-class events logged after ``since_s`` (journal monotonic time; None: all)."""
    return [
        event
        for event in events
        if needs_reset(event.code)
        and event.monotonic_s is not None
        and (since_s is None or event.monotonic_s > since_s)
    ]


def to_record(event: XidEvent, time: str | None) -> dict[str, Any]:
    """A fault as the daemon's snapshot carries it for the gate."""
    return {"pci_bus_id": event.pci_bus_id, "code": event.code, "time": time}


def from_records(value: object) -> tuple[XidFault, ...]:
    """Faults read back from a snapshot; anything of the wrong shape is left out."""
    if not isinstance(value, list):
        return ()
    faults = []
    for item in value[:MAX_FAULTS]:
        if not isinstance(item, dict):
            continue
        pci, code, time = item.get("pci_bus_id"), item.get("code"), item.get("time")
        address = normalize_pci(pci) if isinstance(pci, str) else None
        if address is None or not isinstance(code, int) or isinstance(code, bool):
            continue
        faults.append(XidFault(address, code, time if isinstance(time, str) else None))
    return tuple(faults)


def blockers(
    faults: Sequence[XidFault], gpus: Sequence[GpuReading], gpu_set: frozenset[int] | None
) -> tuple[str, ...]:
    """One phrase per GPU of the set with a counting fault (its newest), naming the Xid."""
    index_of = {
        address: gpu.index
        for gpu in gpus
        if gpu.pci_bus_id and (address := normalize_pci(gpu.pci_bus_id)) is not None
    }
    newest: dict[int, XidFault] = {}
    for fault in faults:
        index = index_of.get(fault.pci_bus_id)
        if index is not None and (gpu_set is None or index in gpu_set):
            newest[index] = fault
    return tuple(_phrase(index, newest[index]) for index in sorted(newest))


def _phrase(index: int, fault: XidFault) -> str:
    info = lookup(fault.code)
    what = "a reboot" if info.xid_class is XidClass.REBOOT else "a GPU reset"
    when = f" at {escape(fault.time, 40)}" if fault.time else ""
    return (
        f"GPU {index} had Xid {fault.code} ({info.meaning}){when} since the unit last came up: "
        f"it needs {what} (docs/xid.md)"
    )
