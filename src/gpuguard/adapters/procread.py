"""Reading one /proc file, and the parsers of what the kernel writes there.

Bounded reads that tolerate short reads (``read_file``, ``read_optional``), the parse of
``stat`` after its *last* ``)`` (a command name may hold anything), of ``status``'s uids, of an
environment block's ``INVOCATION_ID`` and of a command line. This module owns how one file of a
process is read and what a vanished process looks like (``VANISHED``): procfs and procdevices
build every walk on it. Each parser is total and linear in its input.
"""

from __future__ import annotations

import os
import pwd
import re
from dataclasses import dataclass
from functools import lru_cache

PF_KTHREAD = 0x00200000  # include/linux/sched.h: "I am a kernel thread"
VANISHED = (FileNotFoundError, ProcessLookupError)  # ENOENT, ESRCH: the process exited
READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC
CHUNK = 1 << 16
_INVOCATION_ID = re.compile(rb"[0-9a-f]{32}")
_INVOCATION_KEY = b"INVOCATION_ID="


@dataclass(frozen=True, slots=True)
class StatFields:
    """The fields of ``/proc/PID/stat`` gpuguard uses."""

    pid: int
    comm: str
    state: str
    ppid: int
    flags: int
    start_time: int

    @property
    def kernel_thread(self) -> bool:
        """Whether the kernel marks this task as one of its own threads (PF_KTHREAD)."""
        return bool(self.flags & PF_KTHREAD)


def parse_stat(data: bytes) -> StatFields | None:
    """Parse ``/proc/PID/stat``; None when it is not in the kernel's format.

    The command name sits between the first ``(`` and the *last* ``)`` and may contain
    anything, ``)`` and newlines included (``foo) Z 1 2 (``), so the numeric fields are read
    after the last ``)`` only. Fields (proc(5)): 3 state, 4 ppid, 9 flags, 22 starttime.
    """
    opening = data.find(b"(")
    closing = data.rfind(b")")
    if opening < 0 or closing < opening:
        return None
    fields = data[closing + 1 :].split()
    if len(fields) < 20:
        return None
    try:
        pid = int(data[:opening])
        ppid, flags, start_time = int(fields[1]), int(fields[6]), int(fields[19])
    except ValueError:
        return None
    return StatFields(
        pid=pid,
        comm=data[opening + 1 : closing].decode("utf-8", "backslashreplace"),
        state=fields[0].decode("ascii", "backslashreplace"),
        ppid=ppid,
        flags=flags,
        start_time=start_time,
    )


def read_file(path: str, limit: int | None = None) -> bytes:
    """Read a /proc file to EOF (short reads happen), or its first ``limit`` bytes."""
    fd = os.open(path, READ_FLAGS)
    try:
        chunk = os.read(fd, CHUNK if limit is None else min(CHUNK, limit))
        if not chunk:
            return chunk
        chunks = [chunk]
        size = len(chunk)
        while limit is None or size < limit:
            want = CHUNK if limit is None else min(CHUNK, limit - size)
            chunk = os.read(fd, want)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


@lru_cache(maxsize=1024)
def user_name(uid: int) -> str:
    """Return the login name of ``uid``, or the number when it has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def parse_uids(status: bytes) -> tuple[int, ...]:
    """Return the real, effective, saved and filesystem uids from ``/proc/PID/status``.

    The last ``Uid:`` line is used: only the ``Name:`` line before it is process-controlled.
    Empty when the line is missing or malformed.
    """
    at = status.rfind(b"\nUid:")
    if at < 0:
        return ()
    fields = status[at + 5 :].split(b"\n", 1)[0].split()
    if len(fields) != 4 or not all(field.isdigit() for field in fields):
        return ()
    return tuple(int(field) for field in fields)


def parse_fd_size(status: bytes) -> int:
    """Return ``FDSize:`` of ``/proc/PID/status``: the slots of the descriptor table; 0 if absent.

    At least as many as are open (the table grows to fit the highest descriptor, and never
    shrinks): an upper bound on the count where the kernel gives no count. The last such line
    is used: only the ``Name:`` line before it is process-controlled.
    """
    at = status.rfind(b"\nFDSize:")
    if at < 0:
        return 0
    value = status[at + 8 :].split(b"\n", 1)[0].strip()
    return int(value) if value.isdigit() and len(value) <= 12 else 0


def parse_invocation_id(environ: bytes) -> str | None:
    """Return ``INVOCATION_ID`` from a NUL-separated environment block, if it is unambiguous.

    It counts only as a systemd id (32 lower-case hex digits) named exactly once: a block with
    two (``getenv`` and a shell disagree on which wins), a malformed value, or the variable cut
    off by the read limit gives None. Linear in the size of the block.
    """
    items = environ.split(b"\0")
    if not environ.endswith(b"\0"):
        items.pop()  # cut off by the read limit (or the kernel's view of a rewritten block)
    found = [item[len(_INVOCATION_KEY) :] for item in items if item.startswith(_INVOCATION_KEY)]
    if len(found) != 1 or not _INVOCATION_ID.fullmatch(found[0]):
        return None
    return found[0].decode("ascii")


def split_cmdline(data: bytes) -> tuple[str, ...]:
    """Split ``/proc/PID/cmdline``; trailing NULs (setproctitle padding) are dropped."""
    data = data.rstrip(b"\0")
    if not data:
        return ()
    return tuple(arg.decode("utf-8", "backslashreplace") for arg in data.split(b"\0"))


def stat_at(base: str) -> StatFields | None:
    """Read and parse ``base/stat``; None when the process is gone or hidden from us."""
    try:
        return parse_stat(read_file(base + "/stat"))
    except OSError:
        return None


def read_optional(path: str, limit: int | None = None) -> bytes | None:
    """Read a file that may be unreadable for us; a missing file (the process is gone) raises.

    ESRCH is not vanishing here: the kernel answers it for ``environ`` of a process without an
    address space (a zombie, kernel >= 6.x), which still exists; the caller's second ``stat``
    read tells whether the process is gone.
    """
    try:
        return read_file(path, limit)
    except FileNotFoundError:
        raise
    except OSError:
        return None
