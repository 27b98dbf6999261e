"""Read who holds GPU device files from /proc: the only module that looks at /proc.

Two walks. ``scan_device_holders`` visits every process, like ``fuser -v /dev/nvidia*``: it
readlinks each ``/proc/PID/fd/*`` and searches ``/proc/PID/maps`` (a process may only mmap the
device; psutil's ``open_files()`` never lists character devices, so fds are read here).
``scan_pids`` is the NVML-first path: it reads only the PIDs NVML named and their descendants,
which may have inherited the device fds through fork.

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

Every read has a budget (``ScanBudget``, docs/security.md "Budgets of the /proc walk"): how
many descriptors of one process and of the whole scan are read, how many bytes of one ``maps``,
how many processes and how many seconds one scan takes. Any user may open millions of
descriptors or map 64,000 regions with 4 KiB paths, and an unbounded walk then takes seconds
and hundreds of MB. A process a budget cut short is returned with ``partial`` naming the budget,
never as one that holds nothing; processes a scan did not reach are counted in
``ProcScan.not_visited``. The full walk reads processes in order of their descriptor count
(``stat`` of ``/proc/PID/fd`` gives it in one call since Linux 6.2, 0 before), so a flood
spends only what is left after every ordinary process was read.

``device_glob`` is an absolute fnmatch pattern compared with readlink targets and mapped paths
(``*`` also matches ``/``, so ``/dev/nvidia*`` covers ``/dev/nvidia-caps/nvidia-cap1``).
``proc_root`` is a parameter everywhere so tests can point it at a fake tree.
"""

# The /proc walk is the hot path (benchmarked against fuser over 40,000 fds): it uses str paths
# and os.* calls because building a pathlib object per fd and file costs more than the syscall.
# ruff: noqa: PTH112, PTH116, PTH208

from __future__ import annotations

import contextlib
import fnmatch
import os
import pwd
import re
import time
from collections import deque
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from gpuguard.core.cgroup import parse_cgroup
from gpuguard.core.ledger import SeenProcess
from gpuguard.core.values import ProcessFacts, ProcessIdentity, ProcScan

if TYPE_CHECKING:
    from collections.abc import Iterable

PROC = Path("/proc")
PF_KTHREAD = 0x00200000  # include/linux/sched.h: "I am a kernel thread"
_VANISHED = (FileNotFoundError, ProcessLookupError)  # ENOENT, ESRCH: the process exited
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_CHUNK = 1 << 16
_DELETED = " (deleted)"
_INVOCATION_ID = re.compile(rb"[0-9a-f]{32}")
_INVOCATION_KEY = b"INVOCATION_ID="
# The environment is the process's to write and may be large (up to a quarter of its stack
# limit): only this much is read. An INVOCATION_ID beyond it is not found, which only ever
# spares a process.
ENVIRON_LIMIT = 1 << 20


@dataclass(frozen=True, slots=True)
class ScanBudget:
    """How much of /proc one walk may read (docs/security.md, "Budgets of the /proc walk").

    Defaults: 16,384 descriptors of one process and 32,768 in all (at 1.1 to 6 us a descriptor,
    0.04 to 0.2 s: every descriptor of an ordinary host), 8 MiB of one ``maps`` (65,530 mappings,
    the kernel's default ``vm.max_map_count``, at 128 bytes a line), 65,536 processes and 2 s
    per scan.
    """

    fds_per_process: int = 16_384
    fds_per_scan: int = 32_768
    maps_bytes: int = 8 << 20
    processes: int = 65_536
    seconds: float = 2.0


DEFAULT_BUDGET = ScanBudget()


class _Spend:
    """What is left of one scan's budget (descriptors, time), charged as the walk reads."""

    __slots__ = ("budget", "deadline", "fds_left")

    def __init__(self, budget: ScanBudget) -> None:
        self.budget = budget
        self.fds_left = budget.fds_per_scan
        self.deadline = time.monotonic() + budget.seconds

    def fds_allowed(self) -> int:
        """How many descriptors the next process may have read."""
        return max(0, min(self.budget.fds_per_process, self.fds_left))

    def expired(self) -> bool:
        """Whether the scan's time is spent: no further process is read."""
        return time.monotonic() >= self.deadline


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


class _DeviceMatcher:
    """A device glob compiled for the hot path: a literal prefix test before the full match."""

    __slots__ = ("_match", "prefix", "prefix_bytes")

    def __init__(self, device_glob: str) -> None:
        cut = next((i for i, ch in enumerate(device_glob) if ch in "*?["), len(device_glob))
        self.prefix = device_glob[:cut]
        self.prefix_bytes = os.fsencode(self.prefix)
        self._match = re.compile(fnmatch.translate(device_glob)).match

    def matches(self, path: str) -> bool:
        """Whether ``path`` (a readlink target or maps path) matches the glob."""
        return path.startswith(self.prefix) and self._match(path) is not None


def _read(path: str, limit: int | None = None) -> bytes:
    """Read a /proc file to EOF (short reads happen), or its first ``limit`` bytes."""
    fd = os.open(path, _READ_FLAGS)
    try:
        chunk = os.read(fd, _CHUNK if limit is None else min(_CHUNK, limit))
        if not chunk:
            return chunk
        chunks = [chunk]
        size = len(chunk)
        while limit is None or size < limit:
            want = _CHUNK if limit is None else min(_CHUNK, limit - size)
            chunk = os.read(fd, want)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _fd_devices(
    base: str, matcher: _DeviceMatcher, spend: _Spend
) -> tuple[list[str] | None, str | None]:
    """The device files among a process's open fds, and why the list is partial.

    The list is None when the fds cannot be read; the reason None when every one was read.
    The fd directory is opened once and each link read relative to it (readlinkat), which
    spares the kernel a full path walk per fd: about 15% of the whole scan. It is read lazily
    (``scandir``): a listing of 10 M entries would itself cost 600 MB. At most
    ``spend.fds_allowed()`` links are read; the rest of a larger table stays unknown.
    """
    try:
        dir_fd = os.open(base + "/fd", _DIR_FLAGS)
    except _VANISHED:
        return [], None
    except OSError:
        return None, None
    allowed = spend.fds_allowed()
    read = 0
    try:
        # The kernel's count (Linux >= 6.2; 0 before): a table too large is not read at all,
        # which leaves its mappings (read next) as the cheap check for device files.
        count = os.fstat(dir_fd).st_size
        if count > allowed:
            return [], _fds_partial(spend, count)
        found, read, cut = _walk_fds(dir_fd, matcher, allowed)
    except _VANISHED:
        return [], None
    except OSError:
        return None, None
    finally:
        spend.fds_left -= read
        os.close(dir_fd)
    return found, _fds_partial(spend, None) if cut else None


def _walk_fds(dir_fd: int, matcher: _DeviceMatcher, allowed: int) -> tuple[list[str], int, bool]:
    """Readlink at most ``allowed`` fds: the device files, how many were read, whether cut."""
    prefix = matcher.prefix
    found: list[str] = []
    readlink = os.readlink
    read = 0
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            if read >= allowed:
                return found, read, True
            read += 1
            try:
                target = readlink(entry.name, dir_fd=dir_fd)
            except OSError:
                continue  # closed since it was listed (ENOENT) or the process exited
            if target.startswith(prefix):
                target = target.removesuffix(_DELETED)
                if matcher.matches(target):
                    found.append(target)
    return found, read, False


def _fds_partial(spend: _Spend, count: int | None) -> str:
    """Which descriptor budget stopped the read of a process's fds (``count``: its size)."""
    if spend.fds_left < spend.budget.fds_per_process:
        return f"the scan's budget of {spend.budget.fds_per_scan:,} descriptors was spent"
    if count is None:
        return f"more than {spend.budget.fds_per_process:,} open descriptors"
    return f"{count:,} open descriptors, more than the {spend.budget.fds_per_process:,} read"


def _mapped_devices(
    base: str, matcher: _DeviceMatcher, limit: int
) -> tuple[list[str] | None, str | None, bool]:
    """The device files named in ``base/maps``, why the list is partial, whether maps was empty.

    The list is None when we may not read it, the reason None when the whole file was read;
    empty means no address space, or the process vanished. Read in chunks and searched as it
    arrives, at most ``limit`` bytes: a process decides the
    size of its maps (64,000 mappings of a file with a 4 KiB path make 262 MB), and a huge one
    is itself worth naming. Each line is ``address perms offset dev inode pathname``; the path
    is the 6th column and may hold spaces. Linear: each byte is looked at a bounded number of
    times, and a line cut by a chunk's end is carried into the next.
    """
    try:
        fd = os.open(base + "/maps", _READ_FLAGS)
    except _VANISHED:
        return [], None, True
    except OSError:
        return None, None, False
    prefix = matcher.prefix_bytes
    found: list[str] = []
    carry = b""
    size = 0
    try:
        while True:
            chunk = os.read(fd, _CHUNK)
            if not chunk:
                break
            size += len(chunk)
            if size > limit:
                return found, f"a maps file larger than {_kib(limit)}", False
            data = carry + chunk
            cut = data.rfind(b"\n") + 1
            carry = data[cut:]
            if prefix in data[:cut]:
                found.extend(_device_lines(data[:cut], prefix, matcher))
    except _VANISHED:
        return [], None, True
    except OSError:
        return None, None, False
    finally:
        os.close(fd)
    if carry and prefix in carry:
        found.extend(_device_lines(carry, prefix, matcher))
    return found, None, size == 0


def _kib(size: int) -> str:
    """A budget in bytes for people: MiB when whole, else KiB."""
    return f"{size >> 20} MiB" if size % (1 << 20) == 0 else f"{size >> 10} KiB"


def _device_lines(lines: bytes, prefix: bytes, matcher: _DeviceMatcher) -> list[str]:
    """The device paths of whole ``maps`` lines that contain ``prefix``."""
    found: list[str] = []
    for line in lines.split(b"\n"):
        if prefix not in line:
            continue
        columns = line.split(None, 5)
        if len(columns) == 6:
            path = os.fsdecode(columns[5]).removesuffix(_DELETED)
            if matcher.matches(path):
                found.append(path)
    return found


def _live_thread(base: str) -> str | None:
    """The ``task/TID`` directory of a live thread of a process whose main thread has exited.

    Such a process shows state Z under its PID, and no fds and no mappings there (the leader
    gave up its own references), while its other threads still hold the shared fd table and
    address space: the GPU is held all the same. None for a kernel thread, a process that is
    not a zombie, or a zombie with no live thread left (one that merely awaits its parent).
    """
    stat = _read_stat(base)
    if stat is None or stat.state != "Z" or stat.kernel_thread:
        return None
    try:
        tids = os.listdir(base + "/task")
    except OSError:
        return None
    for tid in tids:
        thread = f"{base}/task/{tid}"
        if tid != str(stat.pid) and (seen := _read_stat(thread)) and seen.state not in {"Z", "X"}:
            return thread
    return None


@dataclass(frozen=True, slots=True)
class _Files:
    """What the fd and maps reads of one process found."""

    devices: list[str]
    readable: bool
    partial: str | None


def _device_files(base: str, matcher: _DeviceMatcher, spend: _Spend) -> _Files:
    """The device files a process holds (fds, then mappings), and how complete that answer is.

    A process without an address space (empty ``maps``) is a kernel thread, a zombie, or a
    process whose main thread exited before the others: for the last its files are read through
    a live thread. The extra look costs one ``stat`` for each process without an address space.
    """
    fds, fds_partial = _fd_devices(base, matcher, spend)
    maps, maps_partial, empty = _mapped_devices(base, matcher, spend.budget.maps_bytes)
    if empty and not fds and (thread := _live_thread(base)) is not None:
        fds, fds_partial = _fd_devices(thread, matcher, spend)
        maps, maps_partial, _empty = _mapped_devices(thread, matcher, spend.budget.maps_bytes)
    reasons = [reason for reason in (fds_partial, maps_partial) if reason is not None]
    return _Files(
        devices=(fds or []) + (maps or []),
        readable=fds is not None and maps is not None,
        partial="; ".join(reasons) if reasons else None,
    )


@lru_cache(maxsize=1024)
def _user_name(uid: int) -> str:
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


def _split_cmdline(data: bytes) -> tuple[str, ...]:
    """Split ``/proc/PID/cmdline``; trailing NULs (setproctitle padding) are dropped."""
    data = data.rstrip(b"\0")
    if not data:
        return ()
    return tuple(arg.decode("utf-8", "backslashreplace") for arg in data.split(b"\0"))


def _read_stat(base: str) -> StatFields | None:
    """Read and parse ``base/stat``; None when the process is gone or hidden from us."""
    try:
        return parse_stat(_read(base + "/stat"))
    except OSError:
        return None


def _read_optional(path: str, limit: int | None = None) -> bytes | None:
    """Read a file that may be unreadable for us; a missing file (the process is gone) raises.

    ESRCH is not vanishing here: the kernel answers it for ``environ`` of a process without an
    address space (a zombie, kernel >= 6.x), which still exists; the caller's second ``stat``
    read tells whether the process is gone.
    """
    try:
        return _read(path, limit)
    except FileNotFoundError:
        raise
    except OSError:
        return None


def _named(pid: int, base: str, partial: str) -> ProcessFacts | None:
    """Who a process a budget cut short is (stat and status only), to name it; None if gone.

    Its part read showed no device file, so nothing is decided about it: its command line and
    environment (up to 2 MiB and 1 MiB, the process's to choose) are not read, so that a flood
    of such processes costs a few small reads each. One NVML lists is read in full afterwards
    (read_listed).
    """
    stat = _read_stat(base)
    try:
        uids = parse_uids(_read_optional(base + "/status") or b"")
        uid = uids[0] if uids else os.stat(base).st_uid
    except _VANISHED:
        return None
    again = _read_stat(base)
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
        user=_user_name(uid),
        cgroup=None,
        kernel_thread=stat.kernel_thread,
        partial=partial,
    )


def _facts(pid: int, base: str, devices: frozenset[str]) -> ProcessFacts | None:
    """Build the full facts of one process; None when it vanished or its PID was reused."""
    stat = _read_stat(base)
    if stat is None:
        return None
    # The command line and environment live in the address space, which a zombie leader no
    # longer has: a live thread's view shows them (the same for every thread of a process).
    memory = (_live_thread(base) or base) if stat.state == "Z" else base
    try:
        cmdline = _read_optional(memory + "/cmdline") or b""
        status = _read_optional(base + "/status") or b""
        cgroup = _read_optional(base + "/cgroup") or b""
        environ = _read_optional(memory + "/environ", ENVIRON_LIMIT) or b""
        uids = parse_uids(status)
        uid = uids[0] if uids else os.stat(base).st_uid
    except _VANISHED:
        return None
    again = _read_stat(base)
    if again is None or again.start_time != stat.start_time:
        return None  # exited, or exited and the PID was reused, while we read
    return ProcessFacts(
        identity=ProcessIdentity(pid=pid, start_time=stat.start_time),
        ppid=stat.ppid,
        state=stat.state,
        comm=stat.comm,
        cmdline=_redacted(_split_cmdline(cmdline)),
        uid=uid,
        uids=uids,
        user=_user_name(uid),
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
        wchan = _read(base + "/wchan")[:_FRAME_CHARS].decode("ascii", "backslashreplace").strip()
        if wchan not in {"", "0"}:
            frames.append(wchan)
    with contextlib.suppress(OSError):
        for line in _read(base + "/stack").split(b"\n", _STACK_FRAMES)[:_STACK_FRAMES]:
            frame = line.partition(b"] ")[2][:_FRAME_CHARS].decode("ascii", "backslashreplace")
            if frame.strip():
                frames.append(frame.strip())
    return tuple(frames)


def _is_kernel_thread(base: str) -> bool:
    """Whether ``base`` is a kernel thread (whose fds are unreadable but hold nothing)."""
    stat = _read_stat(base)
    return stat is not None and stat.kernel_thread


def _read_process(
    pid: int, root: str, matcher: _DeviceMatcher, spend: _Spend
) -> tuple[ProcessFacts | None, bool]:
    """Read one process with its device files; also say whether its fds and maps were readable."""
    base = f"{root}/{pid}"
    files = _device_files(base, matcher, spend)
    facts = _facts(pid, base, frozenset(files.devices))
    if facts is not None and files.partial is not None:
        facts = replace(facts, partial=files.partial)
    return facts, files.readable or (facts is not None and facts.kernel_thread)


def read_process(
    pid: int, device_glob: str, *, proc_root: Path = PROC, budget: ScanBudget = DEFAULT_BUDGET
) -> ProcessFacts | None:
    """Return what /proc says about ``pid`` and which ``device_glob`` files it holds.

    None when the process does not exist (or vanished while we read it). Device files that
    could not be read (another user's process, without root) are simply missing.
    """
    matcher = _DeviceMatcher(device_glob)
    facts, _readable = _read_process(pid, os.fspath(proc_root), matcher, _Spend(budget))
    return facts


def _fd_count(root: str, pid: int) -> int:
    """How many descriptors ``pid`` has open, from one ``stat`` (0 when the kernel does not say)."""
    try:
        return os.stat(f"{root}/{pid}/fd").st_size
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
    descriptors first: a flood is read last, with what is left.
    """
    matcher = _DeviceMatcher(device_glob)
    root = os.fspath(proc_root)
    spend = _Spend(budget)
    pids = [int(name) for name in os.listdir(root) if name.isdecimal()]
    visit = sorted(pids[: budget.processes], key=lambda pid: (_fd_count(root, pid), pid))
    not_visited = len(pids) - len(visit)
    found: list[ProcessFacts] = []
    unreadable = 0
    for index, pid in enumerate(visit):
        if spend.expired():
            not_visited += len(visit) - index
            break
        base = f"{root}/{pid}"
        files = _device_files(base, matcher, spend)
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


class _ChildrenUnsupportedError(Exception):
    """The kernel has no ``/proc/PID/task/TID/children`` (CONFIG_PROC_CHILDREN is off)."""


def _children_of(root: str, pid: int) -> list[int]:
    """Return the children of every thread of ``pid`` from ``task/*/children``."""
    task_dir = f"{root}/{pid}/task"
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return []
    children: list[int] = []
    for tid in tids:
        try:
            data = _read(f"{task_dir}/{tid}/children")
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
            stat = _read_stat(f"{root}/{name}")
            if stat is not None:
                children.setdefault(stat.ppid, []).append(int(name))
    return children


def scan_pids(
    pids: Iterable[int],
    device_glob: str,
    *,
    proc_root: Path = PROC,
    budget: ScanBudget = DEFAULT_BUDGET,
) -> ProcScan:
    """Read the processes NVML named and all their descendants (fork inherits device fds).

    Every listed PID that exists is returned, with or without device files (NVML named it);
    a descendant only when it holds a file matching ``device_glob``. PIDs that do not exist
    here (gone, or from another PID namespace) are left out. A descendant a budget cut short
    is returned too (``partial``).
    """
    matcher = _DeviceMatcher(device_glob)
    root = os.fspath(proc_root)
    spend = _Spend(budget)
    listed = {pid for pid in pids if pid > 0}
    queue = deque(sorted(listed))
    seen: set[int] = set()
    by_ppid: dict[int, list[int]] | None = None
    found: list[ProcessFacts] = []
    unreadable = 0
    while queue:
        pid = queue.popleft()
        if pid in seen:
            continue
        seen.add(pid)
        facts, readable = _read_process(pid, root, matcher, spend)
        if facts is None:
            continue
        unreadable += not readable
        if pid in listed or facts.device_files or facts.partial is not None:
            found.append(facts)
        if by_ppid is None:
            try:
                queue.extend(_children_of(root, pid))
                continue
            except _ChildrenUnsupportedError:
                by_ppid = _children_by_ppid(root)
        queue.extend(by_ppid.get(pid, ()))
    found.sort(key=lambda facts: facts.identity.pid)
    return ProcScan(processes=tuple(found), unreadable=unreadable, method="nvml-first")


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
    matcher = _DeviceMatcher(device_glob)
    root = os.fspath(proc_root)
    found: list[ProcessFacts] = []
    hidden: set[int] = set()
    for pid in sorted(set(pids)):
        if pid <= 0:
            continue
        facts, readable = _read_process(pid, root, matcher, _Spend(budget))
        if facts is not None:
            found.append(facts if readable else replace(facts, files_readable=False))
        elif facts is None and Path(f"{root}/{pid}").exists():
            hidden.add(pid)
    return ProcScan(processes=tuple(found), method="listed", hidden=frozenset(hidden))


def read_stat(pid: int, *, proc_root: Path = PROC) -> StatFields | None:
    """Return the parsed ``/proc/PID/stat`` of ``pid`` (state letter, start time…); None if gone."""
    return _read_stat(f"{os.fspath(proc_root)}/{pid}")


def read_identity(pid: int, *, proc_root: Path = PROC) -> ProcessIdentity | None:
    """Return the identity (pid, start time) of ``pid`` now; None when no such process.

    The start time is ``stat``'s integer tick count since boot, compared exactly by the reaper
    and the gate server: psutil's ``create_time()`` divides it into a float and adds a boot
    time that moves with the wall clock, so two reads of one process could differ.
    """
    stat = _read_stat(f"{os.fspath(proc_root)}/{pid}")
    return None if stat is None else ProcessIdentity(pid=pid, start_time=stat.start_time)


def read_wchan(pid: int, *, proc_root: Path = PROC) -> str | None:
    """Return the kernel function ``pid`` sleeps in (telling a driver hang apart), if known.

    None when it is running, gone, or the kernel hides the symbol from us (it then says "0").
    """
    try:
        text = _read(f"{os.fspath(proc_root)}/{pid}/wchan").decode("ascii", "backslashreplace")
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
        stat = _read_stat(f"{root}/{current}")
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


DESCENDANTS_MAX = 4096
"""The most processes one ledger walk reads: a fork bomb in a unit costs a bounded walk."""


def descendants(roots: Iterable[int], *, proc_root: Path = PROC) -> tuple[SeenProcess, ...]:
    """``roots`` and every process descending from them, as the ledger records them.

    Children come from ``task/*/children`` (cheap: no walk over every process); on a kernel
    without it, from every ``stat``. Each process costs a ``stat``, ``status`` and ``cgroup``
    read and a second ``stat`` (an exit or a PID reuse mid-read leaves it out). A child counts
    only while its ``stat`` still names the parent it was listed under: a PID that died and was
    reused between the listing and the read is somebody else's. Bounded by DESCENDANTS_MAX; a
    process whose cgroup cannot be parsed is recorded as ``?``.
    """
    root = os.fspath(proc_root)
    queue: deque[tuple[int, int | None]] = deque(
        (pid, None) for pid in sorted({pid for pid in roots if pid > 0})
    )
    seen: set[int] = set()
    by_ppid: dict[int, list[int]] | None = None
    found: list[SeenProcess] = []
    while queue and len(seen) < DESCENDANTS_MAX:
        pid, parent = queue.popleft()
        if pid in seen:
            continue
        seen.add(pid)
        process = _seen(pid, f"{root}/{pid}", parent)
        if process is None:
            continue
        found.append(process)
        if by_ppid is None:
            try:
                queue.extend((child, pid) for child in _children_of(root, pid))
                continue
            except _ChildrenUnsupportedError:
                by_ppid = _children_by_ppid(root)
        queue.extend((child, pid) for child in by_ppid.get(pid, ()))
    return tuple(found)


def _seen(pid: int, base: str, parent: int | None) -> SeenProcess | None:
    """One process's identity, uids, name and cgroup, or None.

    None when it vanished, is a kernel thread, or is no longer the child of ``parent``.
    """
    stat = _read_stat(base)
    if stat is None or stat.kernel_thread or (parent is not None and stat.ppid != parent):
        return None
    try:
        status = _read_optional(base + "/status") or b""
        cgroup = _read_optional(base + "/cgroup") or b""
    except _VANISHED:
        return None
    again = _read_stat(base)
    if again is None or again.start_time != stat.start_time:
        return None
    path = parse_cgroup(cgroup.decode("utf-8", "backslashreplace"))
    return SeenProcess(pid, stat.start_time, parse_uids(status), stat.comm or "?", path or "?")
