"""Which processes descend from a unit's live run: its cgroup's, and theirs wherever they went.

A unit's cgroup (systemd's ``ControlGroup``, below ``/sys/fs/cgroup``) lists its processes in
``cgroup.procs``, sub-cgroups (``Delegate=``) included; their descendants are found through
/proc (procfs.descendants), so a worker that moved into a transient scope is still seen while
its parent is in the run. Processes the ledger already recorded are roots too: a moved worker's
own children are found after its parent died.

``last_pid`` tells the ledger keeper when a re-read cannot find anything new (no process or
thread created since the last one).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from gpuguard.adapters import procfs

if TYPE_CHECKING:
    from collections.abc import Iterable

    from gpuguard.core.ledger import SeenProcess
    from gpuguard.core.values import ProcessIdentity

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Where a systemd cgroup path is found: cgroup v2, else a hybrid host's unified hierarchy, else
# its named systemd hierarchy (v1); the first that has the unit's directory is read.
_HIERARCHIES = ("", "unified", "systemd")
_MAX_CGROUPS = 256
_PROCS_LIMIT = 1 << 20
_STATUS_LIMIT = 1 << 16
_LOADAVG_LIMIT = 256
_LOADAVG_FIELDS = 5


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
    recorded: Iterable[ProcessIdentity],
    *,
    cgroup_root: Path = CGROUP_ROOT,
    proc_root: Path = procfs.PROC,
) -> tuple[SeenProcess, ...]:
    """The run's processes now: its cgroup's, the ``recorded`` ones still alive, descendants.

    Each is pinned as it is read (procfs.descendants): a recorded process by its start time, a
    PID of ``cgroup.procs`` by its cgroup, so a PID reused since it was listed or recorded is
    never recorded in the old one's place.
    """
    roots: list[int | ProcessIdentity] = []
    if control_group:
        roots.extend(cgroup_pids(control_group, cgroup_root=cgroup_root))
    roots.extend(recorded)
    return procfs.descendants(roots, within=control_group, proc_root=proc_root)


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
