"""Real PID reuse for tests (root): the kernel gives a dead process's PID to a new one.

Also a hook that runs an action the moment a given function is entered (``sys.setprofile``),
so a test can reuse a PID in the very window between two steps of the code under test without
replacing any of it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from types import CodeType, FrameType

_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")
# The same lock as tests/integration/test_gate_socket.py's: suites run side by side in CI.
_LOCK = Path(tempfile.gettempdir()) / "gpuguard-tests-ns_last_pid.lock"


def reuse_pid(pid: int, argv: Sequence[str]) -> subprocess.Popen[bytes]:
    """Start ``argv`` (in a session of its own) as PID ``pid``, which must be free or soon free.

    Rewinds ns_last_pid (root) and forks, retried: a process of someone else's that forks in
    between takes the PID, and is waited out (the PID is free when /proc has no entry for it).
    """
    if not os.access(_LAST_PID, os.W_OK):  # a container's /proc/sys is read-only
        pytest.skip("needs a writable /proc/sys/kernel/ns_last_pid (root, not in a container)")
    deadline = time.monotonic() + 60
    with _LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        while time.monotonic() < deadline:
            if Path(f"/proc/{pid}").exists():
                time.sleep(0.02)
                continue
            _LAST_PID.write_text(str(pid - 1))
            process = subprocess.Popen(argv, start_new_session=True)
            if process.pid == pid:
                return process
            process.kill()
            process.wait()
    pytest.fail(f"PID {pid} was never given out again")


@contextlib.contextmanager
def on_entry(code: CodeType, action: Callable[[FrameType], bool]) -> Iterator[None]:
    """Call ``action`` with the frame as each call of ``code`` begins, until it returns True."""
    done = False

    def profile(frame: FrameType, event: str, _arg: object) -> None:
        nonlocal done
        if done or event != "call" or frame.f_code is not code:
            return
        sys.setprofile(None)  # the action's own calls are not watched
        try:
            done = action(frame)
        finally:
            if not done:
                sys.setprofile(profile)

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)
