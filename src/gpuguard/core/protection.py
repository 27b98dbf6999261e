"""Which processes gpuguard must never signal, whatever the scope or the caller (pure).

The one home of that rule: the kill policy refuses exactly the processes ``never_signal``
names a reason for, before any other rule is asked.
"""

from __future__ import annotations

from pathlib import PurePath
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Collection

    from gpuguard.core.inventory import Holder


def is_protected(holder: Holder, protected_names: Collection[str]) -> bool:
    """True for driver daemons, monitors, display servers and anything configured.

    Matched on ``comm`` (the kernel's 15-character name) and on the basename of argv[0], so both
    ``nvidia-persistenced`` and ``/usr/bin/nvidia-persistenced --verbose`` match.
    """
    names = set(protected_names)
    argv0 = PurePath(holder.cmdline[0]).name if holder.cmdline else ""
    return holder.comm in names or argv0 in names or any(n[:15] == holder.comm for n in names)


def never_signal(
    holder: Holder, protected_names: Collection[str], untouchable_pids: Collection[int]
) -> str | None:
    """Why ``holder`` must never be signalled, or None when other rules decide.

    PID 1 and 2, kernel threads, gpuguard itself and its ancestors (and the gate's caller),
    and the protected processes (``is_protected``).
    """
    if holder.pid <= 2:
        return f"PID {holder.pid} is never signalled"
    if holder.kernel_thread:
        return "kernel thread"
    if reason := never_signal_pid(holder.pid, untouchable_pids):
        return reason
    if is_protected(holder, protected_names):
        return f"protected process ({holder.comm})"
    return None


def never_signal_pid(pid: int, untouchable_pids: Collection[int]) -> str | None:
    """Why ``pid`` is never signalled whatever process it is, or None.

    The reaper asks this again of every target, with its own lineage, before the first signal:
    a plan that reached it with such a PID is a bug, refused rather than carried out.
    """
    if pid <= 2:
        return f"PID {pid} is never signalled"
    if pid in untouchable_pids:
        return "gpuguard itself or one of its ancestors"
    return None
