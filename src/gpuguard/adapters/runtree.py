"""Which processes descend from a unit's live run: its cgroup's, and theirs wherever they went.

A unit's cgroup (systemd's ``ControlGroup``, below ``/sys/fs/cgroup``) lists its processes in
``cgroup.procs``, sub-cgroups (``Delegate=``) included; their descendants are found through
/proc (:func:`descendants`), so a worker that moved into a transient scope is still seen while
its parent is in the run. Processes the ledger already recorded are roots too: a moved worker's
own children are found after its parent died.

Each process is read with its own ``INVOCATION_ID``, how it was found (the cgroup, a recorded
process, a parent) and, for a recorded one, its run: core.liverun files it under a run from that
evidence alone, never under the run the daemon believed live.

``last_pid`` tells the ledger keeper when a re-read cannot find anything new (no process or
thread created since the last one).
"""

# The walk reads a few files per process with str paths and os.* calls, as procfs's walks do
# (a pathlib object per file costs more than the read).
# ruff: noqa: PTH112, PTH208

from __future__ import annotations

import os
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from gpuguard.adapters import procfs
from gpuguard.adapters.procread import (
    VANISHED,
    parse_invocation_id,
    parse_uids,
    read_file,
    read_optional,
    stat_at,
)
from gpuguard.core.cgroup import parse_cgroup
from gpuguard.core.ledger import SeenProcess
from gpuguard.core.liverun import Walk, Walked
from gpuguard.core.values import ProcessIdentity

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Where a systemd cgroup path is found: cgroup v2, else a hybrid host's unified hierarchy, else
# its named systemd hierarchy (v1); the first that has the unit's directory is read.
_HIERARCHIES = ("", "unified", "systemd")
_MAX_CGROUPS = 256
_PROCS_LIMIT = 1 << 20
_STATUS_LIMIT = 1 << 16
_LOADAVG_LIMIT = 256
_LOADAVG_FIELDS = 5
ENVIRON_LIMIT = 1 << 15
"""Bytes of a walked process's environment read for its ``INVOCATION_ID``. systemd puts its own
variables (``INVOCATION_ID`` among them) before the unit's ``Environment=``, so it sits in the
first few hundred bytes of a run's processes; one not found within this files the process by
its parent, or not at all (core.liverun), and a walk of DESCENDANTS_MAX processes reads at most
128 MiB of environments."""


def cgroup_pids(control_group: str, *, cgroup_root: Path = CGROUP_ROOT) -> list[int]:
    """The PIDs in the cgroup and its sub-cgroups (at most _MAX_CGROUPS), empty when none."""
    relative = control_group.strip("/")
    if not relative or ".." in relative.split("/"):
        return []
    tops = [cgroup_root / hierarchy / relative for hierarchy in _HIERARCHIES]
    found = next((top for top in tops if (top / "cgroup.procs").is_file()), None)
    if found is None:
        return []
    top = os.fspath(found)
    pids: list[int] = []
    visited = 0
    for directory, subdirectories, _files in os.walk(top, followlinks=False):
        visited += 1
        if visited > _MAX_CGROUPS:
            subdirectories.clear()
            break
        try:
            with open(os.path.join(directory, "cgroup.procs"), "rb") as procs:  # noqa: PTH118, PTH123 - hot path, plain os calls
                data = procs.read(_PROCS_LIMIT)
        except OSError:
            continue
        pids.extend(int(word) for word in data.split() if word.isdigit())
    return pids


def run_processes(
    control_group: str | None,
    recorded: Mapping[ProcessIdentity, str],
    *,
    cgroup_root: Path = CGROUP_ROOT,
    proc_root: Path = procfs.PROC,
) -> Walk:
    """A unit's processes now: its cgroup's, the ``recorded`` ones still alive, descendants.

    ``recorded``: each process the ledger holds of the unit, with its run. Each is pinned as it
    is read (:func:`descendants`): a recorded process by its start time, a PID of
    ``cgroup.procs`` by its cgroup, so a PID reused since it was listed or recorded is never
    recorded in the old one's place.
    """
    roots: list[int | ProcessIdentity] = []
    if control_group:
        roots.extend(cgroup_pids(control_group, cgroup_root=cgroup_root))
    roots.extend(recorded)
    return descendants(roots, within=control_group, runs=recorded, proc_root=proc_root)


def alive(identity: ProcessIdentity, *, proc_root: Path = procfs.PROC) -> bool:
    """Whether this very process (PID and start time) still exists."""
    return procfs.read_identity(identity.pid, proc_root=proc_root) == identity


def last_pid(*, proc_root: Path = procfs.PROC) -> int | None:
    """The PID namespace's last allocated PID (/proc/loadavg, 5th field; proc(5)), or None.

    It moves on every fork and clone, threads included, and on every one in a nested namespace
    (whose processes get a PID in ours too). The kernel reports the *reader's* namespace, so
    this answers only while that is also the namespace /proc shows (``NSpid`` of
    /proc/self/status has one entry; proc(5)): were the daemon in a namespace nested below
    /proc's, processes it sees could fork without moving its counter. None whenever unsure
    (unreadable, unparsable, another namespace): the caller then reads the run again.
    """
    root = os.fspath(proc_root)
    try:
        with open(f"{root}/self/status", "rb") as status:  # noqa: PTH123 - hot path, plain os calls
            own = status.read(_STATUS_LIMIT)
        with open(f"{root}/loadavg", "rb") as loadavg:  # noqa: PTH123 - hot path, plain os calls
            fields = loadavg.read(_LOADAVG_LIMIT).split()
    except OSError:
        return None
    namespaces = next(
        (line.split()[1:] for line in own.splitlines() if line.startswith(b"NSpid:")), []
    )
    if len(namespaces) != 1 or len(fields) < _LOADAVG_FIELDS or not fields[4].isdigit():
        return None
    return int(fields[4])


DESCENDANTS_MAX = 4096
"""The most processes one ledger walk reads: a fork bomb in a unit costs a bounded walk."""
THREADS_MAX = 8192
"""The most threads' ``children`` lists one ledger walk reads. A process's children are listed
per thread (``task/TID/children``), so a walk costs a read per *thread*: one process with
20,000 threads cost 0.2-0.34 s under the process cap alone. An inference server's processes
have tens to a few hundred threads each; past this the walk stops and says so (``cut``)."""


def descendants(
    roots: Iterable[int | ProcessIdentity],
    *,
    within: str | None = None,
    runs: Mapping[ProcessIdentity, str] | None = None,
    proc_root: Path = procfs.PROC,
) -> Walk:
    """``roots`` and every process descending from them, parents first, as the ledger reads them.

    Each comes with its own ``INVOCATION_ID``, the walked parent it was found under, and for a
    root given as an identity its run in ``runs`` (core.liverun.Walked).

    Children come from ``task/*/children`` (cheap: no walk over every process); on a kernel
    without it, from every ``stat``. Each process costs a ``stat``, ``status`` and ``cgroup``
    read and a second ``stat`` (an exit or a PID reuse mid-read leaves it out). Every process
    is pinned to who it was found as, so a PID that died and was given to another process on
    the way is never recorded as the old one: a root given as an identity (a recorded process)
    only while its ``stat`` shows that start time; a root given as a PID (read from the cgroup
    ``within``) only while its cgroup is ``within`` or below it; a child only while its
    ``stat`` names the parent it was listed under and that parent's PID, read again after the
    child's, still has the parent's start time. Bounded by DESCENDANTS_MAX leads read (found or
    not, so children that all fail their checks cannot make it long) and by THREADS_MAX
    threads whose children were read; what either leaves unread is said in the result's
    ``cut``, never passed off as the whole tree. A process whose cgroup cannot be parsed is
    recorded as ``?``.
    """
    root = os.fspath(proc_root)
    recorded_runs = runs or {}
    queue: deque[_Lead] = deque(
        sorted(
            {
                _Lead(r.pid, r.start_time) if isinstance(r, ProcessIdentity) else _Lead(r)
                for r in roots
            },
            key=lambda lead: (lead.pid, lead.start is None),
        )
    )
    seen: set[int] = set()
    by_ppid: dict[int, list[int]] | None = None
    found: list[Walked] = []
    threads = _Threads(THREADS_MAX)
    reads = 0  # every lead read counts, found or not: a parent that exits right after its
    # children are listed (each child then fails its parent check) must not make the walk endless
    while queue and reads < DESCENDANTS_MAX:
        lead = queue.popleft()
        if lead.pid <= 0 or lead.pid in seen:
            continue
        reads += 1
        read = _seen(lead, root, within)
        if read is None:
            continue
        process, thread_count, ppid = read
        seen.add(lead.pid)
        parent = ProcessIdentity(process.pid, process.start_time)
        run = recorded_runs.get(parent) if lead.parent is None and lead.start is not None else None
        member_ppid = ppid if lead.parent is None and lead.start is None else None
        found.append(
            Walked(process, _invocation_id(lead.pid, root), lead.parent, run, ppid=member_ppid)
        )
        if by_ppid is None:
            try:
                children = _children_of(root, lead.pid, thread_count, threads)
                queue.extend(_Lead(child, parent=parent) for child in children)
                continue
            except _ChildrenUnsupportedError:
                by_ppid = _children_by_ppid(root)
        queue.extend(_Lead(child, parent=parent) for child in by_ppid.get(lead.pid, ()))
    cuts = []
    if queue and reads >= DESCENDANTS_MAX:
        cuts.append(f"stopped at {DESCENDANTS_MAX} processes read, {len(queue)} more listed")
    if threads.unread:
        cuts.append(
            f"the children of {threads.unread} threads of {threads.cut_processes} "
            f"process{'es' if threads.cut_processes != 1 else ''} not read past {THREADS_MAX} "
            "threads"
        )
    return Walk(found, "; ".join(cuts) or None)


class _Threads:
    """What is left of one walk's thread budget, and what it left unread."""

    def __init__(self, budget: int) -> None:
        self.left = budget
        self.unread = 0
        self.cut_processes = 0

    def take(self, tids: list[str], *, threads: int) -> list[str]:
        """The threads to read of ``tids``, the first (the main thread) always.

        What is not read of the process's ``threads`` is counted as left unread.
        """
        taken = tids[: max(self.left, 1)]
        self.left = max(self.left - len(taken), 0)
        if len(taken) < threads:
            self.unread += threads - len(taken)
            self.cut_processes += 1
        return taken


class _Lead(NamedTuple):
    """A PID the walk is to read, and who it must still be when read."""

    pid: int
    start: int | None = None
    """A recorded process's start time: only that process counts."""
    parent: ProcessIdentity | None = None
    """The process it was listed as a child of; None for a root."""


def _seen(lead: _Lead, root: str, within: str | None) -> tuple[SeenProcess, int | None, int] | None:
    """One process's identity, uids, name and cgroup, its number of threads and its PPID; or None.

    None when it vanished, is a kernel thread, or is no longer who ``lead`` says it was. The
    number of threads is None when its ``status`` does not say.
    """
    pid, base = lead.pid, f"{root}/{lead.pid}"
    stat = stat_at(base)
    if stat is None or stat.kernel_thread or lead.start not in {None, stat.start_time}:
        return None
    if lead.parent is not None and stat.ppid != lead.parent.pid:
        return None
    try:
        status = read_optional(base + "/status") or b""
        cgroup = read_optional(base + "/cgroup") or b""
    except VANISHED:
        return None
    again = stat_at(base)
    if again is None or again.start_time != stat.start_time:
        return None
    path = parse_cgroup(cgroup.decode("utf-8", "backslashreplace"))
    if not _still_who(lead, root, path, within):
        return None
    seen = SeenProcess(pid, stat.start_time, parse_uids(status), stat.comm or "?", path or "?")
    return seen, _thread_count(status), stat.ppid


def _thread_count(status: bytes) -> int | None:
    """The ``Threads:`` of ``/proc/PID/status``, or None.

    The last such line: only ``Name:`` before it is the process's to write.
    """
    at = status.rfind(b"\nThreads:")
    if at < 0:
        return None
    field = status[at + 9 :].split(b"\n", 1)[0].strip()
    return int(field) if field.isdigit() and len(field) < 10 else None


def _invocation_id(pid: int, root: str) -> str | None:
    """The process's own ``INVOCATION_ID`` from the first ENVIRON_LIMIT bytes of it, or None."""
    try:
        environ = read_optional(f"{root}/{pid}/environ", ENVIRON_LIMIT)
    except VANISHED:
        return None
    return None if environ is None else parse_invocation_id(environ)


def _still_who(lead: _Lead, root: str, path: str | None, within: str | None) -> bool:
    """Whether a process read whole (its cgroup ``path``) is where ``lead`` found it.

    A PID of the cgroup's list must still be in the cgroup; a child's parent must still be the
    parent found: its stat named the parent's PID, and that PID having the parent's start time
    after the read proves it was not given to another process meanwhile.
    """
    if lead.parent is not None:
        parent = stat_at(f"{root}/{lead.parent.pid}")
        return parent is not None and parent.start_time == lead.parent.start_time
    if lead.start is None and within is not None:
        return path is not None and _inside(path, within)
    return True


def _inside(path: str, group: str) -> bool:
    """Whether cgroup ``path`` is ``group`` or below it."""
    top = group.rstrip("/")
    return path == top or path.startswith(top + "/")


class _ChildrenUnsupportedError(Exception):
    """The kernel has no ``/proc/PID/task/TID/children`` (CONFIG_PROC_CHILDREN is off)."""


def _children_of(root: str, pid: int, count: int | None, threads: _Threads) -> list[int]:
    """Return the children of ``pid``'s threads from ``task/*/children``, within ``threads``.

    The main thread (TID = PID) is read first, where a server's workers are forked, then the
    others by TID (the kernel lists them so; sorted, a cut is the same on any file system). A
    process with more threads (``count``, from its ``status``) than the budget has left gets
    its main thread read alone: not even its ``task`` directory is listed, which for 20,000
    threads costs as much as reading a third of them.
    """
    task_dir = f"{root}/{pid}/task"
    main = str(pid)
    if count is not None and count > max(threads.left, 1):
        tids = threads.take([main], threads=count)  # the others counted, never listed
    else:
        try:
            listed = os.listdir(task_dir)
        except OSError:
            return []
        ordered = sorted((tid for tid in listed if tid.isdecimal() and tid != main), key=int)
        tids = threads.take([main, *ordered] if main in listed else ordered, threads=len(listed))
    children: list[int] = []
    for tid in tids:
        try:
            data = read_file(f"{task_dir}/{tid}/children")
        except FileNotFoundError:
            if os.path.isdir(f"{task_dir}/{tid}"):
                raise _ChildrenUnsupportedError from None
            continue  # the thread exited
        except OSError:
            continue
        children.extend(int(child) for child in data.split() if child.isdigit())
    return children


def _children_by_ppid(root: str) -> dict[int, list[int]]:
    """Map every process to its children by reading every ``stat`` (the slow fallback)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir(root):
        if name.isdecimal():
            stat = stat_at(f"{root}/{name}")
            if stat is not None:
                children.setdefault(stat.ppid, []).append(int(name))
    return children
