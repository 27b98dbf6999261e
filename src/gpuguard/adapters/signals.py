"""Every signal gpuguard sends leaves through here: the one module to audit for what root kills.

Two kinds, kept apart by their arguments. A foreign process the kill policy chose is signalled
only through the pidfd that pinned it (the reaper), so a PID reused meanwhile cannot redirect
the signal. gpuguard's own children (the NVML snapshot child, the journalctl group) are
signalled by the PID or group that only gpuguard's own fork or spawn can have named.
tests/unit/test_layers.py fails when any other module sends a signal.
"""

from __future__ import annotations

import contextlib
import os
import signal


def send_pinned(pidfd: int, sig: signal.Signals) -> None:
    """Signal the process that ``pidfd`` pinned; the kernel's errors reach the caller."""
    signal.pidfd_send_signal(pidfd, sig)


def kill_own_child(pid: int) -> None:
    """SIGKILL a child gpuguard forked itself and has not reaped; one already gone is fine."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def signal_own_group(pgid: int, sig: signal.Signals) -> None:
    """Signal the group a child gpuguard spawned as its leader leads (not yet reaped)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
