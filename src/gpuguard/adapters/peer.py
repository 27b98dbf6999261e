"""Who is on the other end of the gate socket, from the kernel alone (adapter).

``SO_PEERCRED`` gives the PID and UID the caller had when it connected. The PID is pinned with
a pidfd before anything is read from ``/proc/PID``: a caller that started after this server did
cannot be the one that connected (the PID was reused), and a caller that has exited by the time
its cgroup and environment are read is refused, so every fact below belongs to the process that
asked. Nothing the caller sends is used to decide who it is.
"""

from __future__ import annotations

import os
import select
import socket
import struct
from pathlib import Path

from gpuguard.adapters.procfs import read_stat
from gpuguard.core.cgroup import attribute, parse_cgroup
from gpuguard.core.gateauth import Caller

PROC = Path("/proc")
#: An environment larger than this is not read (a unit's is a few KiB; ARG_MAX allows MiBs).
MAX_ENVIRON_BYTES = 1024 * 1024
_CREDENTIALS = struct.Struct("3i")


class PeerError(Exception):
    """The caller cannot be identified; the message says why (safe to print)."""


def identify(conn: socket.socket, *, proc_root: Path = PROC) -> Caller:
    """The caller on ``conn``: its PID, UID, unit and environment, pinned by a pidfd."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    pid, uid, _gid = _CREDENTIALS.unpack(raw)
    if pid <= 0:
        raise PeerError("the caller's PID is not visible here")
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as err:
        raise PeerError("the caller has gone") from err
    try:
        return _read_pinned(pid, uid, pidfd, proc_root)
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


def _read_pinned(pid: int, uid: int, pidfd: int, proc_root: Path) -> Caller:
    base = proc_root / str(pid)
    started = _start_time(pid, proc_root)
    own = _start_time(os.getpid(), proc_root)
    if started is None or own is None or started > own:
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
