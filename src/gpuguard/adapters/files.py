"""The files adapter: every file gpuguard writes, and every file root reads as its own.

Root must never be steered by someone else's file system entries: a symlink planted where a
state file or its temporary name will be, a directory another user can write, a umask of 0000
inherited from a unit. So a path is walked from ``/`` one component at a time with
``O_NOFOLLOW``, every directory on the way is checked (owned by root or by us, writable by
nobody else unless it is root's sticky directory such as /tmp, where others cannot replace
what they do not own), a symlink is followed only when root owns it, and the file itself is
opened relative to the checked directory's descriptor, so nothing can be swapped in between.
Writes go to a fresh temporary name (``O_CREAT|O_EXCL|O_NOFOLLOW``), get their mode by
``fchmod`` (independent of the umask) and are renamed into place: a reader sees the old file or
the new one, and a name planted in advance is replaced, never written through.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

_MAX_SYMLINKS = 40  # as the kernel's ELOOP limit
_WALK_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FOREIGN_WRITE = stat.S_IWGRP | stat.S_IWOTH


class UnsafePathError(PermissionError):
    """A path root must not use: its message names the path and the reason."""

    def __init__(self, path: Path | str, reason: str) -> None:
        """``path`` cannot be used because of ``reason``."""
        super().__init__(errno.EPERM, reason, str(path))
        self.reason = reason

    def __str__(self) -> str:
        """One line: the path, then the reason."""
        return f"{self.filename}: {self.reason}"


def _trusted_owner(uid: int) -> bool:
    return uid in {0, os.geteuid()}


def _not_trusted(uid: int) -> str:
    euid = os.geteuid()
    return f"owned by uid {uid}, not root" + ("" if euid == 0 else f" or uid {euid}")


def check_directory(info: os.stat_result, shown: str) -> None:
    """Raise UnsafePathError unless a directory is ours (or root's) and only its owner writes it.

    A sticky directory owned by root (/tmp) is accepted: others may add names to it, but cannot
    rename, replace or remove an entry they do not own (see docs/security.md).
    """
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafePathError(shown, "not a directory")
    if not _trusted_owner(info.st_uid):
        raise UnsafePathError(shown, f"directory {_not_trusted(info.st_uid)}")
    sticky_root = info.st_uid == 0 and info.st_mode & stat.S_ISVTX
    if info.st_mode & _FOREIGN_WRITE and not sticky_root:
        raise UnsafePathError(shown, "directory writable by group or others")


def check_file(info: os.stat_result, shown: str) -> None:
    """Raise UnsafePathError unless a file is a regular file of ours (or root's) only it writes."""
    if not stat.S_ISREG(info.st_mode):
        raise UnsafePathError(shown, "not a regular file")
    if not _trusted_owner(info.st_uid):
        raise UnsafePathError(shown, _not_trusted(info.st_uid))
    if info.st_mode & _FOREIGN_WRITE:
        raise UnsafePathError(shown, "writable by group or others")


class _Walk:
    """Resolves a path component by component under checked directories (see module doc)."""

    def __init__(self, path: Path, dir_mode: int | None) -> None:
        self.path = path
        self.dir_mode = dir_mode  # create missing directories with this mode; None: don't
        self.links = 0

    def directory(self, path: Path) -> int:
        """An O_PATH descriptor of the checked directory ``path`` (the caller closes it)."""
        if ".." in path.parts:
            raise UnsafePathError(path, "'..' in the path")
        return self._descend(os.open("/", _WALK_FLAGS), Path("/"), list(path.absolute().parts))

    def _descend(self, fd: int, where: Path, parts: list[str]) -> int:
        """Walk ``parts`` down from ``fd`` (which this takes over: closed on every path out)."""
        try:
            check_directory(os.fstat(fd), str(where))
            while parts:
                name = parts.pop(0)
                if name in {"", ".", "/"}:
                    continue
                target = self._symlink(fd, where / name, name)
                if target is not None:
                    if target.is_absolute():
                        os.close(fd)
                        fd = -1
                        fd = os.open("/", _WALK_FLAGS)
                        where = Path("/")
                    parts[:0] = list(target.parts)
                    continue
                try:
                    child = os.open(name, _WALK_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if self.dir_mode is None:
                        raise
                    child = self._make(fd, name)
                os.close(fd)
                fd = child
                where = where.parent if name == ".." else where / name
                check_directory(os.fstat(fd), str(where))
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        return fd

    def _symlink(self, fd: int, shown: Path, name: str) -> Path | None:
        """The target of ``name`` if it is a symlink root owns; refuse anyone else's."""
        try:
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if not stat.S_ISLNK(info.st_mode):
            return None
        if info.st_uid != 0:
            raise UnsafePathError(shown, f"symlink owned by uid {info.st_uid}, not root")
        self.links += 1
        if self.links > _MAX_SYMLINKS:
            raise UnsafePathError(self.path, "too many levels of symbolic links")
        return Path(os.readlink(name, dir_fd=fd))

    def _make(self, fd: int, name: str) -> int:
        """Create a missing directory with exactly ``dir_mode`` (the umask does not apply)."""
        assert self.dir_mode is not None  # noqa: S101 - checked by the caller
        with contextlib.suppress(FileExistsError):  # a concurrent writer made it: check theirs
            os.mkdir(name, self.dir_mode, dir_fd=fd)
        made = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        try:
            info = os.fstat(made)
            if _trusted_owner(info.st_uid) and stat.S_IMODE(info.st_mode) != self.dir_mode:
                os.fchmod(made, self.dir_mode)
        finally:
            os.close(made)
        return os.open(name, _WALK_FLAGS, dir_fd=fd)

    def file(self, path: Path) -> tuple[int, str]:
        """The checked directory holding ``path`` (root's symlinks followed) and the name in it."""
        where, name = path.absolute().parent, path.name
        directory = self.directory(where)
        try:
            while (target := self._symlink(directory, where / name, name)) is not None:
                start = directory
                directory = -1
                if target.is_absolute():
                    os.close(start)
                    start = os.open("/", _WALK_FLAGS)
                    where = Path("/")
                directory = self._descend(start, where, list(target.parent.parts))
                where = Path(os.path.normpath(where / target.parent))  # for messages only
                name = target.name
        except BaseException:
            if directory >= 0:
                os.close(directory)
            raise
        return directory, name


def open_directory(path: Path, *, create_mode: int | None = None) -> int:
    """An O_PATH descriptor of ``path`` after checking every directory from ``/`` down.

    ``create_mode``: create missing directories with this mode. Raises UnsafePathError,
    FileNotFoundError or another OSError.
    """
    return _Walk(path, create_mode).directory(path)


@contextlib.contextmanager
def exclusive_lock(path: Path, *, wait_s: float) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created 0600 under checked directories) meanwhile.

    For a read-change-replace by two root writers of one file (the provenance ledger: the
    daemon and the gate server). Waits at most ``wait_s``, then raises TimeoutError: a writer
    that holds it for long must not hang a gate. The file found there must be ours (see
    ``_open_lock``), else UnsafePathError.
    """
    directory = open_directory(path.parent, create_mode=0o755)
    try:
        fd = _open_lock(directory, path)
    finally:
        os.close(directory)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{path} stayed locked for {wait_s:g} s") from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # releases the lock


def _open_lock(directory: int, path: Path) -> int:
    """The lock file's descriptor: an existing one only if ours, else created 0600 (O_EXCL).

    Anyone who can open a file can flock it, so a lock file another user planted (in a root
    sticky directory such as /tmp, where others may add names) would let them hold root's
    writers off for good. An existing name is opened without O_CREAT, O_NOFOLLOW (no symlink)
    and O_NONBLOCK (a FIFO does not hang the open), then must be a regular file owned by root
    (or us) with no permission for group or others; a new one is made with O_EXCL.
    """
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for _ in range(8):  # a name removed or made between our two opens: look again
        try:
            fd = os.open(path.name, flags, dir_fd=directory)
        except FileNotFoundError:
            try:
                return os.open(path.name, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=directory)
            except FileExistsError:
                continue
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise UnsafePathError(path, "lock file is a symlink") from None
            raise
        try:
            _check_lock(os.fstat(fd), path)
        except BaseException:
            os.close(fd)
            raise
        return fd
    raise UnsafePathError(path, "lock file keeps appearing and vanishing")


def _check_lock(info: os.stat_result, path: Path) -> None:
    """Raise UnsafePathError unless a lock file is a regular file of ours only we may open."""
    check_file(info, str(path))
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UnsafePathError(
            path, "lock file open to group or others (anyone who opens it can hold it)"
        )


def write_file(
    path: Path, data: bytes, *, mode: int, durable: bool = False, dir_mode: int = 0o755
) -> None:
    """Replace ``path`` with ``data`` atomically, with exactly ``mode``, under checked directories.

    ``durable``: fsync the file and its directory (persistent state; /run needs neither).
    """
    directory = open_directory(path.parent, create_mode=dir_mode)
    try:
        temp, fd = _create_temp(directory, path.name)
        try:
            with os.fdopen(fd, "wb", closefd=True) as out:
                os.fchmod(out.fileno(), mode)
                out.write(data)
                out.flush()
                if durable:
                    os.fsync(out.fileno())
            os.rename(temp, path.name, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=directory)
            raise
        if durable:
            _fsync_directory(directory)
    finally:
        os.close(directory)


def _create_temp(directory: int, name: str) -> tuple[str, int]:
    """A new, empty file beside ``name``: an unpredictable name, never an existing entry."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(8):
        temp = f".{name}.{os.urandom(6).hex()}.tmp"
        try:
            return temp, os.open(temp, flags, 0o600, dir_fd=directory)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", name)


def _fsync_directory(directory: int) -> None:
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=directory)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_file(path: Path) -> int:
    """A read-only descriptor of ``path``, a file only we (or root) can change.

    The file must be regular, ours or root's and not writable by others, under checked
    directories (root's symlinks followed). Raises FileNotFoundError, UnsafePathError or
    another OSError.
    """
    directory, name = _Walk(path, None).file(path)
    try:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
        fd = os.open(name, flags, dir_fd=directory)
    finally:
        os.close(directory)
    try:
        check_file(os.fstat(fd), str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(path: Path, *, max_bytes: int) -> bytes:
    """The bytes of ``path`` (see open_file); OSError EFBIG past ``max_bytes``."""
    with os.fdopen(open_file(path), "rb", closefd=True) as source:
        data = source.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes", str(path))
    return data


def remove_file(path: Path) -> None:
    """Unlink ``path`` (never what a symlink there points at) under checked directories."""
    directory = open_directory(path.parent)
    try:
        os.unlink(path.name, dir_fd=directory)
    finally:
        os.close(directory)


def write_shared_file(path: Path, data: bytes, *, mode: int) -> None:
    """Replace ``path`` atomically in a root directory under another user's (node_exporter's).

    Debian gives /var/lib/prometheus to the prometheus user; its textfile directory inside is
    root's. So the directories above may be anyone's, but none may be a symlink (each is
    opened with ``O_NOFOLLOW`` relative to the one before) and the directory itself must pass
    ``check_directory``: whatever its parent's owner renames or swaps in there, root only ever
    writes into a directory that nobody else can write. It is never created. The write is
    ``write_file``'s: an unpredictable ``O_EXCL|O_NOFOLLOW`` temporary name, ``fchmod``, a
    rename that replaces a name rather than following it.
    """
    parts = [part for part in path.parent.absolute().parts if part != "/"]
    if ".." in parts:
        raise UnsafePathError(path, "'..' in the path")
    directory = os.open("/", _WALK_FLAGS)
    try:
        for part in parts:
            try:
                child = os.open(part, _WALK_FLAGS, dir_fd=directory)
            except OSError as err:
                if err.errno in {errno.ELOOP, errno.ENOTDIR}:
                    raise UnsafePathError(path.parent, f"{part}: not a directory") from None
                raise
            os.close(directory)
            directory = child
        check_directory(os.fstat(directory), str(path.parent))
        temp, fd = _create_temp(directory, path.name)
        try:
            with os.fdopen(fd, "wb", closefd=True) as out:
                os.fchmod(out.fileno(), mode)
                out.write(data)
            os.rename(temp, path.name, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=directory)
            raise
    finally:
        os.close(directory)
