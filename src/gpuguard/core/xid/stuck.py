"""A process stuck in the driver after an application Xid: no reap will end it (pure).

After an application fault (Xid 13, 31, 43 …) the faulting process normally dies or is reaped
and the GPU is usable again. Sometimes it stays: running (state R, spinning in ``nvidia_uvm``)
or in uninterruptible sleep (D), holding its memory, and SIGKILL does not end it. Reaping it
again on every restart is a loop; only a GPU reset or a reboot frees it, so it is reported as
"stuck in the driver after Xid N" and the daemon stops at needs operator.

The PID in the kernel's line is a claim: the driver prints what it was told, and a PID is reused.
A holder is the process an Xid names only when it started before that Xid; one that started
after it is another process. Stuck takes both: the Xid names it, and it is still there after
SIGKILL (the reaper's ``unkillable``) or, seen by status, in state R or D.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from gpuguard.core.xid.catalogue import XidClass, lookup

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from gpuguard.core.snapshot import XidRecord
    from gpuguard.core.xid.events import XidEvent

STUCK_STATES: Final = frozenset({"R", "D"})


@dataclass(frozen=True, slots=True)
class XidClaim:
    """An application Xid that names a process: its code, PID and when the kernel logged it."""

    code: int
    pid: int
    monotonic_s: float
    """Seconds since boot (the journal's monotonic stamp): comparable to a process's start."""
    time: str | None = None
    """The wall-clock time, for people."""


def claims(events: Iterable[XidEvent]) -> list[XidClaim]:
    """The application Xids among ``events`` that name a PID and carry a monotonic stamp."""
    return [
        XidClaim(event.code, event.pid, event.monotonic_s)
        for event in events
        if event.pid is not None
        and event.monotonic_s is not None
        and lookup(event.code).xid_class is XidClass.APPLICATION
    ]


def claims_from_snapshot(records: Iterable[XidRecord]) -> list[XidClaim]:
    """The same from the daemon's snapshot (``xid.recent``): those with a PID and a stamp."""
    return [
        XidClaim(record.code, record.pid, float(record.monotonic_s), record.time)
        for record in records
        if record.pid is not None
        and record.pid >= 0
        and record.code >= 0
        and record.monotonic_s is not None
        and lookup(record.code).xid_class is XidClass.APPLICATION
    ]


def named_by(pid: int, started_s: float, xid_claims: Sequence[XidClaim]) -> XidClaim | None:
    """The newest application Xid naming this very process (it started before the Xid).

    ``started_s``: the process's start in seconds since boot (``/proc/PID/stat`` field 22 over
    the clock tick).
    """
    for claim in reversed(xid_claims):
        if claim.pid == pid and started_s <= claim.monotonic_s:
            return claim
    return None


def stuck_phrase(claim: XidClaim) -> str:
    """For people: "stuck in the driver after Xid 31 (GPU memory page fault) at T"."""
    when = f" at {claim.time}" if claim.time else ""
    return f"stuck in the driver after Xid {claim.code} ({lookup(claim.code).meaning}){when}"
