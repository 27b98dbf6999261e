"""Processes that flood the /proc walk: millions of descriptors, tens of thousands of mappings.

Shared by the budget tests and bench/hostile_inputs.py. ``Flood`` starts one in its own session
and waits for its ``ready`` line; ``kill`` ends the group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

# argv: mode count device where path processes. fds: opens ``device`` (first, or moved to the
# top of the table when where is "last", or also mapped as CUDA maps it when "mapped"), then
# dup()s /dev/null ``count`` times, raising RLIMIT_NOFILE to fit (root may raise it up to
# fs.nr_open); with ``processes`` > 1 it first forks into that many processes that each do so
# (where one process may not hold them all). maps: maps ``device`` once, then ``count`` single
# pages of ``path`` (or anonymous memory) with alternating protections, so that none merge.
SCRIPT = r"""
import ctypes, os, resource, signal, sys
mode, count = sys.argv[1], int(sys.argv[2])
device = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] else None
where = sys.argv[4] if len(sys.argv) > 4 else "first"
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
processes = int(sys.argv[6]) if len(sys.argv) > 6 else 1
ready_r, ready_w = os.pipe()
for _ in range(processes - 1):
    if os.fork() == 0:
        break
else:
    processes = 0  # the parent: it reports when every child is ready
if mode == "fds":
    want = count + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
    else:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    held = os.open(device, os.O_RDWR) if device else None
    if held is not None and where == "mapped":
        assert libc.mmap(None, 4096, 3, 1, held, 0) != ctypes.c_void_p(-1).value
    null = os.open("/dev/null", os.O_RDONLY)
    for _ in range(count):
        os.dup(null)
    if held is not None and where == "last":
        os.dup2(held, count + 32)
        os.close(held)
elif mode == "maps":
    if device:
        fd = os.open(device, os.O_RDWR)
        assert libc.mmap(None, 4096, 3, 1, fd, 0) != ctypes.c_void_p(-1).value
        os.close(fd)
    path = sys.argv[5] if len(sys.argv) > 5 else ""
    if path:
        fd = os.open(path, os.O_RDONLY)
        base = libc.mmap(None, 4096 * count, 1, 2, fd, 0)
    else:
        base = libc.mmap(None, 4096 * count, 3, 0x22, -1, 0)
    assert base != ctypes.c_void_p(-1).value
    for i in range(0, count, 2):
        libc.mprotect(base + i * 4096, 4096, 0)
if processes:
    os.write(ready_w, b".")
    while True:
        signal.pause()  # a child waits here until its group is killed
got = 0
while got < int(sys.argv[6] if len(sys.argv) > 6 else 1) - 1:
    got += len(os.read(ready_r, 4096))
print("ready", os.getpid(), flush=True)
sys.stdin.readline()
"""


class Flood:
    """A running flood process, killed at ``kill``."""

    def __init__(
        self,
        mode: str,
        count: int,
        device: Path | None = None,
        *,
        where: str = "first",
        path: Path | None = None,
        processes: int = 1,
    ) -> None:
        """Start it and wait until its descriptors or mappings are in place."""
        argv = [sys.executable, "-c", SCRIPT, mode, str(count), str(device or ""), where]
        self.popen = subprocess.Popen(
            [*argv, str(path or ""), str(processes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline().split()
        if line[:1] != ["ready"]:
            self.kill()
            message = f"the {mode} flood of {count} did not start"
            raise RuntimeError(message)
        self.pid = int(line[1])

    def kill(self) -> None:
        """End it and reap it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=30)
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None:
                stream.close()


def fd_ceiling() -> int:
    """How many descriptors one process may open here (fs.nr_open, or the hard limit).

    fs.nr_open where this process may raise its hard limit (CAP_SYS_RESOURCE), else that limit.
    """
    import resource  # noqa: PLC0415

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if not _may_raise():
        return hard
    with open("/proc/sys/fs/nr_open") as file:  # noqa: PTH123
        return int(file.read())


def _may_raise() -> bool:
    """Whether this process has CAP_SYS_RESOURCE (bit 24 of CapEff)."""
    with open("/proc/self/status") as file:  # noqa: PTH123
        for line in file:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 24 & 1)
    return False
