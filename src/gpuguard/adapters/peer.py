"""Who is on the other end of the gate socket, from the kernel alone (adapter).

``SO_PEERCRED`` gives the PID and UID the caller had when it connected. The PID is pinned with
a pidfd before anything is read from ``/proc/PID``. The server's parent pins it as it accepts
the connection (:func:`pin`): with ``SO_PEERPIDFD`` (Linux 6.5) the kernel hands a pidfd of the
very process that connected, else ``pidfd_open`` of its PID then; a connection that waits for
its unit's request in progress keeps that pidfd, so a PID reused while it waits names a process
that is not the pinned one. A caller that has exited by the time its cgroup and environment are
read is refused, and (pinned here, not by the parent) one that started after this server did
cannot be the one that connected. So every fact below belongs to the process that asked.
Nothing the caller sends is used to decide who it is.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
from pathlib import Path

from gpuguard.adapters.procfs import read_stat
from gpuguard.core.cgroup import attribute, parse_cgroup
from gpuguard.core.gate.auth import Caller

PROC = Path("/proc")
#: An environment larger than this is not read (a unit's is a few KiB; ARG_MAX allows MiBs).
MAX_ENVIRON_BYTES = 1024 * 1024
_CREDENTIALS = struct.Struct("3i")
#: getsockopt(2) for a pidfd of the peer (Linux 6.5; asm-generic's number, Python 3.11 has no name).
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)


class PeerError(Exception):
    """The caller cannot be identified; the message says why (safe to print)."""


def pin(conn: socket.socket, pid: int) -> int | None:
    """A pidfd of the process that connected on ``conn`` (SO_PEERCRED's ``pid``); None: gone.

    The kernel's own (``SO_PEERPIDFD``, Linux 6.5: exactly the connecting process, whatever
    happened to its PID since) where it has one, else ``pidfd_open(pid)`` now.
    """
    try:
        pidfd = conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as err:
        # Only an unknown option (before Linux 6.5) falls back to the PID. Any other error means
        # the option is known and the peer has gone: 6.5 and later answer EINVAL for a reaped
        # peer (ESRCH mapped for dbus-broker), never to be taken for "unsupported", or its PID's
        # next owner would be pinned.
        if err.errno != errno.ENOPROTOOPT:
            return None
    else:
        os.set_inheritable(pidfd, False)  # noqa: FBT003 - positional only
        if pidfd_pid(pidfd) == pid:
            return pidfd
        os.close(pidfd)
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def pidfd_pid(pidfd: int) -> int | None:
    """The PID a pidfd pins, from its fdinfo (Linux 5.10); None once the process has exited."""
    try:
        with open(f"/proc/self/fdinfo/{pidfd}", "rb") as info:  # noqa: PTH123 - a small kernel file
            for line in info.read(4096).splitlines():
                if line.startswith(b"Pid:"):
                    value = int(line.split()[1])
                    return value if value > 0 else None
    except (OSError, ValueError, IndexError):
        return None
    return None


def identify(conn: socket.socket, *, proc_root: Path = PROC, pinned: int | None = None) -> Caller:
    """The caller on ``conn``: its PID, UID, unit and environment, pinned by a pidfd.

    ``pinned``: the pidfd the server's parent took as it accepted ``conn`` (:func:`pin`; still
    the caller's to close); the caller must be that very process, alive after the reads. None:
    a pidfd is opened now, and the caller must have started before this process did.
    """
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    pid, uid, _gid = _CREDENTIALS.unpack(raw)
    if pid <= 0:
        raise PeerError("the caller's PID is not visible here")
    if pinned is not None:
        if pidfd_pid(pinned) != pid:
            raise PeerError("the caller has gone")
        return _read_pinned(pid, uid, pinned, proc_root, since_pin=True)
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as err:
        raise PeerError("the caller has gone") from err
    try:
        return _read_pinned(pid, uid, pidfd, proc_root, since_pin=False)
    finally:
        os.close(pidfd)


def own_caller() -> Caller:
    """The running process as a caller: the in-process gate (no server) asks on its own behalf."""
    cgroup = _read_cgroup(Path(f"/proc/{os.getpid()}"))
    return Caller(
        pid=os.getpid(),
        uid=os.geteuid(),
        attribution=attribute(cgroup or ""),
        environment=dict(os.environ),
        cgroup=cgroup,
    )


def _read_pinned(pid: int, uid: int, pidfd: int, proc_root: Path, *, since_pin: bool) -> Caller:
    """The caller's facts; ``since_pin``: the pidfd was taken at accept, no age check needed."""
    base = proc_root / str(pid)
    started = _start_time(pid, proc_root)
    own = _start_time(os.getpid(), proc_root)
    if started is None or own is None or (started > own and not since_pin):
        raise PeerError("the caller has gone (its PID now names a later process)")
    cgroup = _read_cgroup(base)
    environment = _read_environ(base)
    if _exited(pidfd) or _start_time(pid, proc_root) != started or cgroup is None:
        raise PeerError("the caller has gone")
    return Caller(
        pid=pid, uid=uid, attribution=attribute(cgroup), environment=environment, cgroup=cgroup
    )


def _start_time(pid: int, proc_root: Path) -> int | None:
    stat = read_stat(pid, proc_root=proc_root)
    return None if stat is None else stat.start_time


def _exited(pidfd: int) -> bool:
    """A pidfd polls readable once its process has exited."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def _read_cgroup(base: Path) -> str | None:
    try:
        data = (base / "cgroup").read_bytes()
    except OSError:
        return None
    return parse_cgroup(data.decode("utf-8", "backslashreplace"))


def _read_environ(base: Path) -> dict[str, str] | None:
    """``/proc/PID/environ`` as a dict (root reads any process's), None if unreadable."""
    try:
        with (base / "environ").open("rb") as handle:
            data = handle.read(MAX_ENVIRON_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_ENVIRON_BYTES:
        return None
    return parse_environ(data)


def parse_environ(data: bytes) -> dict[str, str]:
    """NUL-separated NAME=value entries; the first of a repeated name wins, as getenv() does."""
    environment: dict[str, str] = {}
    for entry in data.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep and name:
            key = name.decode("utf-8", "backslashreplace")
            environment.setdefault(key, value.decode("utf-8", "backslashreplace"))
    return environment
