"""Read who holds GPU device files from /proc: the walks, and the facts of each process.

``scan_device_holders`` visits every process, like ``fuser -v /dev/nvidia*`` (a worker left
behind by a dead parent holds the device but NVML may name nobody); ``read_listed`` then reads
the PIDs NVML named that the walk missed. (The ledger's walk of a unit's process tree is
runtree's.)

Processes come and go while we read: a process that vanishes mid-read is simply absent from the
result, never an error, and a PID reused during the read is detected by reading the start time
again at the end (that second read, not an ESRCH, decides: a zombie answers ESRCH for its
environment and is still read, with state Z). Anything else we may not read (another user's fds
without root) is counted in ``ProcScan.unreadable`` so the caller can say the answer is
incomplete. A process whose main thread exited before its other threads shows no files under
its PID: they are read through a live thread (docs/facts.md §3.6).

Why the facts are read here and not through psutil (docs/facts.md §3.5): the start time that
identifies a process is compared as the kernel's exact tick count from the same ``stat`` read
that gives its name, state, parent and kernel-thread flag, where psutil offers a float built on
the wall clock; psutil has no cgroup, no kernel-thread flag, no filesystem uid, reads a foreign
environment whole with the last repeated name winning, decodes command lines into strings that
cannot be printed, and walks every process to find one's children. It gives the boot time.

The device files of one process, and the budgets of every walk, are procdevices'; reading one
file and parsing it, procread's. This module owns the walks and the facts of a process.
``proc_root`` is a parameter everywhere so tests can point it at a fake tree.
"""

# The /proc walk is the hot path (benchmarked against fuser over 40,000 fds): it uses str paths
# and os.* calls because building a pathlib object per fd and file costs more than the syscall.
# ruff: noqa: PTH116, PTH208

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from gpuguard.adapters.procdevices import (
    DEFAULT_BUDGET,
    DeviceMatcher,
    ScanBudget,
    Spend,
    device_files,
    kernel_counts_fds,
    live_thread,
)
from gpuguard.adapters.procread import (
    VANISHED,
    StatFields,
    parse_fd_size,
    parse_invocation_id,
    parse_uids,
    read_file,
    read_optional,
    split_cmdline,
    stat_at,
    user_name,
)
from gpuguard.core.cgroup import parse_cgroup
from gpuguard.core.values import ProcessFacts, ProcessIdentity, ProcScan

if TYPE_CHECKING:
    from collections.abc import Iterable

PROC = Path("/proc")
# The environment is the process's to write and may be large (up to a quarter of its stack
# limit): only this much is read. An INVOCATION_ID beyond it is not found, which only ever
# spares a process.
ENVIRON_LIMIT = 1 << 20


def _named(pid: int, base: str, partial: str) -> ProcessFacts | None:
    """Who a process a budget cut short is (stat and status only), to name it; None if gone.

    Its part read showed no device file, so nothing is decided about it: its command line and
    environment (up to 2 MiB and 1 MiB, the process's to choose) are not read, so that a flood
    of such processes costs a few small reads each. One NVML lists is read in full afterwards
    (read_listed).
    """
    stat = stat_at(base)
    try:
        uids = parse_uids(read_optional(base + "/status") or b"")
        uid = uids[0] if uids else os.stat(base).st_uid
    except VANISHED:
        return None
    again = stat_at(base)
    if stat is None or again is None or again.start_time != stat.start_time:
        return None
    return ProcessFacts(
        identity=ProcessIdentity(pid=pid, start_time=stat.start_time),
        ppid=stat.ppid,
        state=stat.state,
        comm=stat.comm,
        cmdline=(),
        uid=uid,
        uids=uids,
        user=user_name(uid),
        cgroup=None,
        kernel_thread=stat.kernel_thread,
        partial=partial,
    )


def _facts(pid: int, base: str, devices: frozenset[str]) -> ProcessFacts | None:
    """Build the full facts of one process; None when it vanished or its PID was reused."""
    stat = stat_at(base)
    if stat is None:
        return None
    # The command line and environment live in the address space, which a zombie leader no
    # longer has: a live thread's view shows them (the same for every thread of a process).
    memory = (live_thread(base) or base) if stat.state == "Z" else base
    try:
        cmdline = read_optional(memory + "/cmdline") or b""
        status = read_optional(base + "/status") or b""
        cgroup = read_optional(base + "/cgroup") or b""
        environ = read_optional(memory + "/environ", ENVIRON_LIMIT) or b""
        uids = parse_uids(status)
        uid = uids[0] if uids else os.stat(base).st_uid
    except VANISHED:
        return None
    again = stat_at(base)
    if again is None or again.start_time != stat.start_time:
        return None  # exited, or exited and the PID was reused, while we read
    return ProcessFacts(
        identity=ProcessIdentity(pid=pid, start_time=stat.start_time),
        ppid=stat.ppid,
        state=stat.state,
        comm=stat.comm,
        cmdline=_redacted(split_cmdline(cmdline)),
        uid=uid,
        uids=uids,
        user=user_name(uid),
        cgroup=parse_cgroup(cgroup.decode("utf-8", "backslashreplace")),
        invocation_id=parse_invocation_id(environ),
        device_files=devices,
        kernel_thread=stat.kernel_thread,
        kernel_wait=_kernel_wait(base) if stat.state == "D" else (),
    )


_STACK_FRAMES = 64
_FRAME_CHARS = 200


def _kernel_wait(base: str) -> tuple[str, ...]:
    """Where a process in state D sleeps: its wchan symbol, then its kernel stack's frames.

    ``stack`` lines read ``[<0>] uvm_spin_loop+0x8c/0x190 [nvidia_uvm]``: the frame, with the
    module in brackets, is kept. Root alone may read ``stack``; without root the kernel shows
    ``wchan`` as "0", so the answer may be empty (unknown). Bounded: a kernel stack is short,
    but nothing read here is trusted to be.
    """
    frames: list[str] = []
    with contextlib.suppress(OSError):
        wchan = (
            read_file(base + "/wchan")[:_FRAME_CHARS].decode("ascii", "backslashreplace").strip()
        )
        if wchan not in {"", "0"}:
            frames.append(wchan)
    with contextlib.suppress(OSError):
        for line in read_file(base + "/stack").split(b"\n", _STACK_FRAMES)[:_STACK_FRAMES]:
            frame = line.partition(b"] ")[2][:_FRAME_CHARS].decode("ascii", "backslashreplace")
            if frame.strip():
                frames.append(frame.strip())
    return tuple(frames)


def _is_kernel_thread(base: str) -> bool:
    """Whether ``base`` is a kernel thread (whose fds are unreadable but hold nothing)."""
    stat = stat_at(base)
    return stat is not None and stat.kernel_thread


def _read_process(
    pid: int, root: str, matcher: DeviceMatcher, spend: Spend
) -> tuple[ProcessFacts | None, bool]:
    """Read one process with its device files; also say whether its fds and maps were readable."""
    base = f"{root}/{pid}"
    files = device_files(base, matcher, spend)
    facts = _facts(pid, base, frozenset(files.devices))
    if facts is not None and files.partial is not None:
        facts = replace(facts, partial=files.partial)
    return facts, files.readable or (facts is not None and facts.kernel_thread)


def _fd_count(root: str, pid: int) -> int:
    """How many descriptors ``pid`` has open, from one ``stat`` (Linux >= 6.2)."""
    try:
        return os.stat(f"{root}/{pid}/fd").st_size
    except OSError:
        return 0


def _fd_slots(root: str, pid: int) -> int:
    """How many descriptors ``pid`` may have open, at most: its table's size (older kernels)."""
    try:
        return parse_fd_size(read_file(f"{root}/{pid}/status"))
    except OSError:
        return 0


def scan_device_holders(
    device_glob: str, *, proc_root: Path = PROC, budget: ScanBudget = DEFAULT_BUDGET
) -> ProcScan:
    """Walk every process and return those holding a file that matches ``device_glob``.

    ``unreadable`` counts processes (not kernel threads) whose fds or maps we may not read. A
    process a budget cut short is returned whether or not the part read shows a device file,
    with ``partial`` saying why (one that shows none is only named: see ``_named``); the
    processes past the budget's count or time are counted in ``not_visited``. Fewest
    descriptors first: a flood is read last, with what is left. Where the kernel does not count
    them, by the size of each table (``FDSize:``, one more small read a process): a table that
    once grew sorts late, which costs it only its place.
    """
    matcher = DeviceMatcher(device_glob)
    root = os.fspath(proc_root)
    counts = kernel_counts_fds(root)
    spend = Spend(budget, counts=counts)
    pids = [int(name) for name in os.listdir(root) if name.isdecimal()]
    size = _fd_count if counts else _fd_slots
    visit = sorted(pids[: budget.processes], key=lambda pid: (size(root, pid), pid))
    not_visited = len(pids) - len(visit)
    found: list[ProcessFacts] = []
    unreadable = 0
    for index, pid in enumerate(visit):
        if spend.expired():
            not_visited += len(visit) - index
            break
        base = f"{root}/{pid}"
        files = device_files(base, matcher, spend)
        if not files.readable and not _is_kernel_thread(base):
            unreadable += 1
        if files.devices:
            facts = _facts(pid, base, frozenset(files.devices))
            if facts is not None:
                found.append(replace(facts, partial=files.partial))
        elif files.partial is not None and (named := _named(pid, base, files.partial)):
            found.append(named)
    found.sort(key=lambda facts: facts.identity.pid)
    return ProcScan(
        processes=tuple(found), unreadable=unreadable, method="full", not_visited=not_visited
    )


def read_listed(
    pids: Iterable[int],
    device_glob: str,
    *,
    proc_root: Path = PROC,
    budget: ScanBudget = DEFAULT_BUDGET,
) -> ProcScan:
    """Read PIDs NVML named that the device walk did not find, to tell "gone" from "hidden".

    Without root another user's fds cannot be read, so a live GPU job is missing from the walk.
    Such a process is returned with ``files_readable`` False; one whose /proc entry exists but
    cannot be read at all is listed in ``hidden``. A process whose fds we can read and that holds
    no device file is returned too, so the merge can say NVML's PID names an unrelated process
    here (another PID namespace's, or a reused one) rather than none. NVML named each of them,
    so each is read with a budget of its own (they are few: one per GPU process).
    """
    matcher = DeviceMatcher(device_glob)
    root = os.fspath(proc_root)
    found: list[ProcessFacts] = []
    hidden: set[int] = set()
    for pid in sorted(set(pids)):
        if pid <= 0:
            continue
        facts, readable = _read_process(pid, root, matcher, Spend(budget))
        if facts is not None:
            found.append(facts if readable else replace(facts, files_readable=False))
        elif facts is None and Path(f"{root}/{pid}").exists():
            hidden.add(pid)
    return ProcScan(processes=tuple(found), method="listed", hidden=frozenset(hidden))


def read_stat(pid: int, *, proc_root: Path = PROC) -> StatFields | None:
    """Return the parsed ``/proc/PID/stat`` of ``pid`` (state letter, start time…); None if gone."""
    return stat_at(f"{os.fspath(proc_root)}/{pid}")


def read_identity(pid: int, *, proc_root: Path = PROC) -> ProcessIdentity | None:
    """Return the identity (pid, start time) of ``pid`` now; None when no such process.

    The start time is ``stat``'s integer tick count since boot, compared exactly by the reaper
    and the gate server: psutil's ``create_time()`` divides it into a float and adds a boot
    time that moves with the wall clock, so two reads of one process could differ.
    """
    stat = stat_at(f"{os.fspath(proc_root)}/{pid}")
    return None if stat is None else ProcessIdentity(pid=pid, start_time=stat.start_time)


def read_kernel_wait(pid: int, *, proc_root: Path = PROC) -> tuple[str, ...]:
    """Where ``pid`` sleeps in the kernel: its wchan, then its stack's frames (root reads those).

    Empty when it runs, is gone, or the kernel hides both (core.driverwait judges the answer).
    """
    return _kernel_wait(f"{os.fspath(proc_root)}/{pid}")


def read_wchan(pid: int, *, proc_root: Path = PROC) -> str | None:
    """Return the kernel function ``pid`` sleeps in (telling a driver hang apart), if known.

    None when it is running, gone, or the kernel hides the symbol from us (it then says "0").
    """
    try:
        text = read_file(f"{os.fspath(proc_root)}/{pid}/wchan").decode("ascii", "backslashreplace")
    except OSError:
        return None
    text = text.strip()
    return None if text in {"", "0"} else text


def ancestor_pids(pid: int, *, proc_root: Path = PROC) -> tuple[int, ...]:
    """Return the parent, grandparent, … of ``pid`` up to PID 1 (the gate must spare them)."""
    root = os.fspath(proc_root)
    chain: list[int] = []
    current = pid
    while current > 1 and len(chain) < 4096:
        stat = stat_at(f"{root}/{current}")
        if stat is None or stat.ppid in chain or stat.ppid == current:
            break
        current = stat.ppid
        if current <= 0:
            break
        chain.append(current)
    return tuple(chain)


def lineage(*pids: int) -> frozenset[int]:
    """Each of ``pids`` and all its ancestors: gpuguard itself, and who asked it, are spared."""
    return frozenset(p for pid in pids for p in (pid, *ancestor_pids(pid)))


def boot_time() -> float:
    """When this host booted (Unix time): turns a start time in clock ticks into a date."""
    import psutil  # noqa: PLC0415 - only status needs it; keep the gate's imports light

    return float(psutil.boot_time())


def clock_ticks_per_second() -> int:
    """The unit of ``ProcessIdentity.start_time`` (USER_HZ, almost always 100)."""
    return os.sysconf("SC_CLK_TCK")


def _redacted(argv: tuple[str, ...]) -> tuple[str, ...]:
    """Secrets removed before a command line leaves this module.

    Imported on first use: the gate's fast path imports procfs only to learn its own cgroup,
    and must not pay for compiling the redaction patterns.
    """
    from gpuguard.core.redaction import redact_cmdline  # noqa: PLC0415 - see docstring

    return redact_cmdline(argv)


def read_cgroup(pid: int, *, proc_root: Path = PROC) -> str | None:
    """The cgroup path of ``pid`` (as parse_cgroup reads /proc/PID/cgroup); None if it is gone."""
    try:
        data = Path(f"{os.fspath(proc_root)}/{pid}/cgroup").read_bytes()
    except OSError:
        return None
    return parse_cgroup(data.decode("utf-8", "backslashreplace"))
