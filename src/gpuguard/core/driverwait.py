"""Whether a process's kernel wait is inside the NVIDIA driver (pure).

A process in an uninterruptible wait (state D) is stuck in the driver only when the kernel says
so: its wchan or a frame of its kernel stack names the NVIDIA driver (``nvidia``, ``nvidia_uvm``,
``nvidia_modeset``: the marks ``nvidia`` and ``uvm``). A vfork() parent, a FUSE or NFS read, a
disk write are in state D too and end by themselves: a SIGKILL sent then takes effect when the
wait ends. Only a wait in the driver can need a GPU reset; status, the reaper's words and the
gate say it by this one rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Sequence

DRIVER_MARKS: Final = ("nvidia", "uvm")
"""Module and symbol names of the NVIDIA kernel driver (nvidia, nvidia_uvm, nvidia_modeset)."""


def in_driver(kernel_wait: Sequence[str]) -> str | None:
    """The first wchan or stack frame inside the NVIDIA driver, or None when none is."""
    return next((f for f in kernel_wait if any(m in f.lower() for m in DRIVER_MARKS)), None)
