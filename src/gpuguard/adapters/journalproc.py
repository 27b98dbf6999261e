"""One journalctl process: started to die with its follower, in its own group, ended as a group.

Each journalctl runs in its own process group, so the follower's ``close()`` also ends what a
wrapper forked (``nsenter -t PID -a journalctl`` forks journalctl into the container's pid
namespace). It is also started with ``PR_SET_PDEATHSIG=SIGKILL``: if the follower's process
dies without closing (SIGKILL, a crash), the kernel kills the journalctl it started; none is
left running. This module owns those steps and how an exit or a failed start is said.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from typing import TYPE_CHECKING

from gpuguard.adapters import signals

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable

_STOP_GRACE_S = 1.0
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None]:
    """What the child runs before exec: ask the kernel for SIGKILL when its parent dies.

    libc is loaded and the parent's PID taken here, in the parent: the child only calls
    prctl(2) and getppid(2). A parent already gone before the prctl is caught by comparing PIDs.
    The kernel ties the signal to the *thread* that forked: the follower is driven from one
    long-lived thread (the daemon's main loop).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def child() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return child


def end_group(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM the group, give it a second, SIGKILL what is left, reap; the leader's status.

    The leader is only reaped at the end: while it is a zombie its pid (the group id) cannot be
    reused, so the SIGKILL cannot reach a stranger's group.
    """
    if proc.returncode is not None:
        return proc.returncode
    signals.signal_own_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE_S
    while not _has_exited(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    signals.signal_own_group(proc.pid, signal.SIGKILL)
    return proc.wait()


def _has_exited(pid: int) -> bool:
    """Whether our child ``pid`` has exited, without reaping it."""
    try:
        result = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return result is not None


def describe_exit(returncode: int | None) -> str:
    """How journalctl ended, for the restart's reason ("exited with status 1")."""
    if returncode is None:
        return "ended"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


def spawn_error(program: str, err: OSError) -> str:
    """Why journalctl could not be started, with the next step when it is missing."""
    if isinstance(err, FileNotFoundError):
        return (
            f"cannot run {program!r}: not found (journalctl comes with systemd; install it, "
            "or configure the journalctl command)"
        )
    if isinstance(err, PermissionError):
        return f"cannot run {program!r}: permission denied"
    return f"cannot run {program!r}: {err.strerror or err}"
