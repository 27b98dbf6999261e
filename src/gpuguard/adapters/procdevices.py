"""Which GPU device files one process holds: its descriptors and its mappings, under budgets.

``device_files`` readlinks each ``/proc/PID/fd/*`` and searches ``/proc/PID/maps`` (a process
may only mmap the device; psutil's ``open_files()`` never lists character devices), through a
live thread when the main thread has exited. Every read has a budget (``ScanBudget``,
docs/security.md "Budgets of the /proc walk"): how many descriptors of one process and of the
whole scan are read, how many bytes of one ``maps``, how many processes and how many seconds
one scan takes. Any user may open millions of descriptors or map 64,000 regions with 4 KiB
paths, and an unbounded walk then takes seconds and hundreds of MB; a process a budget cut short
is returned with ``partial`` naming the budget, never as one that holds nothing. ``device_glob``
is an absolute fnmatch pattern compared with readlink targets and mapped paths (``*`` also
matches ``/``, so ``/dev/nvidia*`` covers ``/dev/nvidia-caps/nvidia-cap1``).
"""

# The /proc walk is the hot path (benchmarked against fuser over 40,000 fds): it uses str paths
# and os.* calls because building a pathlib object per fd and file costs more than the syscall.
# ruff: noqa: PTH208

from __future__ import annotations

import fnmatch
import os
import re
import time
from dataclasses import dataclass

from gpuguard.adapters.procread import CHUNK, READ_FLAGS, VANISHED, stat_at

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_DELETED = " (deleted)"


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


class Spend:
    """What is left of one scan's budget (descriptors, time), charged as the walk reads.

    ``counts``: whether ``stat`` of a ``fd`` directory gives the count of its descriptors here
    (see ``kernel_counts_fds``); where it does not, its size is never taken for one.
    """

    __slots__ = ("budget", "counts", "deadline", "fds_left")

    def __init__(self, budget: ScanBudget, *, counts: bool = True) -> None:
        """All of ``budget`` left; its time runs from now."""
        self.budget = budget
        self.counts = counts
        self.fds_left = budget.fds_per_scan
        self.deadline = time.monotonic() + budget.seconds

    def fds_allowed(self) -> int:
        """How many descriptors the next process may have read."""
        return max(0, min(self.budget.fds_per_process, self.fds_left))

    def expired(self) -> bool:
        """Whether the scan's time is spent: no further process is read."""
        return time.monotonic() >= self.deadline


class DeviceMatcher:
    """A device glob compiled for the hot path: a literal prefix test before the full match."""

    __slots__ = ("_match", "prefix", "prefix_bytes")

    def __init__(self, device_glob: str) -> None:
        """Compile ``device_glob`` (fnmatch) and its literal prefix."""
        cut = next((i for i, ch in enumerate(device_glob) if ch in "*?["), len(device_glob))
        self.prefix = device_glob[:cut]
        self.prefix_bytes = os.fsencode(self.prefix)
        self._match = re.compile(fnmatch.translate(device_glob)).match

    def matches(self, path: str) -> bool:
        """Whether ``path`` (a readlink target or maps path) matches the glob."""
        return path.startswith(self.prefix) and self._match(path) is not None


def _fd_devices(
    base: str, matcher: DeviceMatcher, spend: Spend
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
    except VANISHED:
        return [], None
    except OSError:
        return None, None
    allowed = spend.fds_allowed()
    read = 0
    try:
        # The kernel's count (Linux >= 6.2; 0 before): a table too large is not read at all,
        # which leaves its mappings (read next) as the cheap check for device files.
        count = os.fstat(dir_fd).st_size if spend.counts else 0
        if count > allowed:
            return [], _fds_partial(spend, count)
        found, read, cut = _walk_fds(dir_fd, matcher, allowed)
    except VANISHED:
        return [], None
    except OSError:
        return None, None
    finally:
        spend.fds_left -= read
        os.close(dir_fd)
    return found, _fds_partial(spend, None) if cut else None


def _walk_fds(dir_fd: int, matcher: DeviceMatcher, allowed: int) -> tuple[list[str], int, bool]:
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


def kernel_counts_fds(root: str) -> bool:
    """Whether ``stat`` of ``ROOT/PID/fd`` gives its count of descriptors (Linux >= 6.2).

    Asked of this process's own table, which holds at least the directory just opened: the
    kernel says 0 where it does not count (before 6.2, kernel commit "fs/proc: report open files
    as size in stat() for /proc/pid/fd"; Debian 12 ships 6.1). False for a tree that is not
    procfs (no ``self``), whose sizes are its file system's.
    """
    try:
        dir_fd = os.open(root + "/self/fd", _DIR_FLAGS)
    except OSError:
        return False
    try:
        return os.fstat(dir_fd).st_size > 0
    finally:
        os.close(dir_fd)


def _fds_partial(spend: Spend, count: int | None) -> str:
    """Which descriptor budget stopped the read of a process's fds (``count``: its size)."""
    if spend.fds_left < spend.budget.fds_per_process:
        return f"the scan's budget of {spend.budget.fds_per_scan:,} descriptors was spent"
    if count is None:
        return f"more than {spend.budget.fds_per_process:,} open descriptors"
    return f"{count:,} open descriptors, more than the {spend.budget.fds_per_process:,} read"


def _mapped_devices(
    base: str, matcher: DeviceMatcher, limit: int
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
        fd = os.open(base + "/maps", READ_FLAGS)
    except VANISHED:
        return [], None, True
    except OSError:
        return None, None, False
    prefix = matcher.prefix_bytes
    found: list[str] = []
    carry = b""
    size = 0
    try:
        while True:
            chunk = os.read(fd, CHUNK)
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
    except VANISHED:
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


def _device_lines(lines: bytes, prefix: bytes, matcher: DeviceMatcher) -> list[str]:
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


def live_thread(base: str) -> str | None:
    """The ``task/TID`` directory of a live thread of a process whose main thread has exited.

    Such a process shows state Z under its PID, and no fds and no mappings there (the leader
    gave up its own references), while its other threads still hold the shared fd table and
    address space: the GPU is held all the same. None for a kernel thread, a process that is
    not a zombie, or a zombie with no live thread left (one that merely awaits its parent).
    """
    stat = stat_at(base)
    if stat is None or stat.state != "Z" or stat.kernel_thread:
        return None
    try:
        tids = os.listdir(base + "/task")
    except OSError:
        return None
    for tid in tids:
        thread = f"{base}/task/{tid}"
        if tid != str(stat.pid) and (seen := stat_at(thread)) and seen.state not in {"Z", "X"}:
            return thread
    return None


@dataclass(frozen=True, slots=True)
class DeviceFiles:
    """What the fd and maps reads of one process found."""

    devices: list[str]
    readable: bool
    partial: str | None


def device_files(base: str, matcher: DeviceMatcher, spend: Spend) -> DeviceFiles:
    """The device files a process holds (fds, then mappings), and how complete that answer is.

    A process without an address space (empty ``maps``) is a kernel thread, a zombie, or a
    process whose main thread exited before the others: for the last its files are read through
    a live thread. The extra look costs one ``stat`` for each process without an address space.
    """
    fds, fds_partial = _fd_devices(base, matcher, spend)
    maps, maps_partial, empty = _mapped_devices(base, matcher, spend.budget.maps_bytes)
    if empty and not fds and (thread := live_thread(base)) is not None:
        fds, fds_partial = _fd_devices(thread, matcher, spend)
        maps, maps_partial, _empty = _mapped_devices(thread, matcher, spend.budget.maps_bytes)
    reasons = [reason for reason in (fds_partial, maps_partial) if reason is not None]
    return DeviceFiles(
        devices=(fds or []) + (maps or []),
        readable=fds is not None and maps is not None,
        partial="; ".join(reasons) if reasons else None,
    )
