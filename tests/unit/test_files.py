"""The files adapter (checked directories, exclusive temporary names) and the programs adapter."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING

import pytest
from fakestate import fake_library

from gpuguard.adapters import files, programs, state

if TYPE_CHECKING:
    from pathlib import Path

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def test_mode_is_exact_whatever_the_umask(tmp_path: Path) -> None:
    """Files and created directories get the asked mode under umask 0000 and 0077 alike."""
    for umask, name in ((0o000, "a"), (0o077, "b")):
        old = os.umask(umask)
        try:
            files.write_file(tmp_path / name / "deep" / "f.json", b"{}", mode=0o644)
        finally:
            os.umask(old)
        assert stat.S_IMODE((tmp_path / name / "deep" / "f.json").stat().st_mode) == 0o644
        assert stat.S_IMODE((tmp_path / name / "deep").stat().st_mode) == 0o755


def test_a_planted_symlink_is_replaced_not_followed(tmp_path: Path) -> None:
    """A symlink at the target name is replaced by the new file; its target is untouched."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    victim.chmod(0o600)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "state.json").symlink_to(victim)
    files.write_file(tmp_path / "d" / "state.json", b"new", mode=0o644)
    assert victim.read_text() == "keep"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert not (tmp_path / "d" / "state.json").is_symlink()
    assert files.read_file(tmp_path / "d" / "state.json", max_bytes=10) == b"new"


def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    """No write into (or read from) a directory anyone may change, unless sticky and root's."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(files.UnsafePathError, match="writable by group or others"):
        files.write_file(shared / "f", b"x", mode=0o644)
    assert list(shared.iterdir()) == []
    if os.geteuid() == 0:
        shared.chmod(0o1777)
        files.write_file(shared / "f", b"x", mode=0o644)
        assert files.read_file(shared / "f", max_bytes=1) == b"x"


def test_dot_dot_and_oversized_files_are_refused(tmp_path: Path) -> None:
    """'..' in a path is refused; a file larger than the limit is an error, not a long read."""
    (tmp_path / "a").mkdir()
    with pytest.raises(files.UnsafePathError, match=r"'\.\.'"):
        files.write_file(tmp_path / "a" / ".." / "f", b"x", mode=0o644)
    (tmp_path / "big").write_bytes(b"x" * 100)
    with pytest.raises(OSError, match="larger than 10 bytes"):
        files.read_file(tmp_path / "big", max_bytes=10)


@needs_root
def test_another_users_symlink_is_never_followed(tmp_path: Path) -> None:
    """A symlink on the way that root does not own stops the walk; root's own is followed."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f").write_text("data")
    (tmp_path / "roots").symlink_to("real")
    assert files.read_file(tmp_path / "roots" / "f", max_bytes=10) == b"data"
    (tmp_path / "users").symlink_to("real")
    os.chown(tmp_path / "users", 65534, 65534, follow_symlinks=False)
    with pytest.raises(files.UnsafePathError, match="symlink owned by uid 65534"):
        files.read_file(tmp_path / "users" / "f", max_bytes=10)


def test_programs_come_from_system_directories_only(tmp_path: Path) -> None:
    """A bare name is looked up in /usr/sbin, /usr/bin, /sbin, /bin: PATH plays no part."""
    planted = tmp_path / "systemctl"
    planted.write_text("#!/bin/sh\n")
    planted.chmod(0o755)
    os.environ["PATH"] = f"{tmp_path}:{os.environ.get('PATH', '')}"
    try:
        found = programs.resolve("sh")
        assert found.startswith(programs.SYSTEM_DIRS)
        with pytest.raises(FileNotFoundError):
            programs.resolve("no-such-program-anywhere")
        with pytest.raises(FileNotFoundError):
            programs.resolve("bin/sh")
    finally:
        os.environ["PATH"] = os.environ["PATH"].split(":", 1)[1]


def test_programs_run_in_the_fixed_environment() -> None:
    """Nothing of ours is inherited: LD_PRELOAD or a pager setting never reaches the program."""
    os.environ["LD_PRELOAD"] = "/nonexistent/planted.so"
    try:
        done = programs.run(["env"], capture_output=True, text=True, timeout=10)
    finally:
        del os.environ["LD_PRELOAD"]
    assert dict(line.split("=", 1) for line in done.stdout.splitlines()) == programs.ENVIRONMENT


def _load(candidate: Path) -> str:
    """Run load_library in a fresh interpreter; its answer and whether the soname resolves."""
    code = textwrap.dedent(
        f"""
        import ctypes, os
        from gpuguard.adapters import nvmllibrary
        problem = nvmllibrary.load_library(({str(candidate)!r},))
        try:
            ctypes.CDLL("libnvidia-ml.so.1", mode=os.RTLD_NOLOAD)
            print(problem, "soname-loaded")
        except OSError:
            print(problem, "soname-absent")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_library_by_absolute_path_answers_pynvmls_soname_lookup() -> None:
    """After load_library, dlopen("libnvidia-ml.so.1") finds the loaded file without a search."""
    assert _load(fake_library()) == "None soname-loaded"


def test_library_under_a_writable_directory_is_refused(tmp_path: Path) -> None:
    """A library someone else could swap is not loaded, and the reason says why."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    copy = shared / "libnvidia-ml.so.1"
    copy.write_bytes(fake_library().read_bytes())
    answer = _load(copy)
    assert "writable by group or others" in answer
    assert answer.endswith("soname-absent")


def test_state_documents_nested_too_deep_read_as_absent(tmp_path: Path) -> None:
    """JSON nested deeper than Python recurses raises RecursionError: read as no document."""
    path = tmp_path / "daemon.json"
    path.write_text("[" * 100_000)
    assert state.read_json(path) is None


def debian_textfile_directory(tmp_path: Path) -> Path:
    """/var/lib/prometheus as Debian leaves it: the prometheus user's, node-exporter/ root's."""
    theirs = tmp_path / "prometheus"
    (theirs / "node-exporter").mkdir(parents=True, mode=0o755)
    theirs.chmod(0o755)
    os.chown(theirs, 65534, 65534)
    return theirs / "node-exporter"


@needs_root
def test_the_textfile_is_written_under_another_users_directory(tmp_path: Path) -> None:
    """A planted symlink at the target name is replaced; its target and the mode are kept."""
    textfile = debian_textfile_directory(tmp_path) / "gpuguard.prom"
    victim = tmp_path / "victim"
    victim.write_text("keep")
    textfile.symlink_to(victim)
    files.write_shared_file(textfile, b"gpuguard_daemon_up 1\n", mode=0o644)
    written = textfile.lstat()
    assert stat.S_ISREG(written.st_mode)
    assert stat.S_IMODE(written.st_mode) == 0o644
    assert textfile.read_text() == "gpuguard_daemon_up 1\n"
    assert victim.read_text() == "keep"
    assert [p.name for p in textfile.parent.iterdir()] == ["gpuguard.prom"]


@needs_root
def test_the_parents_owner_cannot_steer_the_textfile(tmp_path: Path) -> None:
    """Swapped for their own directory, or a symlink to a root one: refused, nothing written."""
    shared = debian_textfile_directory(tmp_path)
    shared.rename(shared.with_name("moved"))
    shared.mkdir(mode=0o755)
    os.chown(shared, 65534, 65534)
    with pytest.raises(files.UnsafePathError, match="not root"):
        files.write_shared_file(shared / "gpuguard.prom", b"", mode=0o644)
    shared.rmdir()
    roots = tmp_path / "roots"
    roots.mkdir(mode=0o755)
    shared.symlink_to(roots)
    os.lchown(shared, 65534, 65534)
    with pytest.raises(files.UnsafePathError, match="node-exporter: not a directory"):
        files.write_shared_file(shared / "gpuguard.prom", b"", mode=0o644)
    assert not list(roots.iterdir())


@needs_root
def test_a_textfile_directory_others_can_write_or_missing_is_refused(tmp_path: Path) -> None:
    """Group-writable: refused; missing: FileNotFoundError, and it is not created."""
    shared = debian_textfile_directory(tmp_path)
    shared.chmod(0o775)
    with pytest.raises(files.UnsafePathError, match="writable by group or others"):
        files.write_shared_file(shared / "gpuguard.prom", b"", mode=0o644)
    with pytest.raises(FileNotFoundError):
        files.write_shared_file(tmp_path / "missing" / "gpuguard.prom", b"", mode=0o644)
    assert not (tmp_path / "missing").exists()


def _stranger() -> int:
    """The uid of another user: CI's gpuguard-ci where it exists, else nobody."""
    import pwd  # noqa: PLC0415 - only these tests look a user up

    try:
        return pwd.getpwnam("gpuguard-ci").pw_uid
    except KeyError:
        return 65534


@needs_root
def test_a_lock_file_another_user_planted_is_refused(tmp_path: Path) -> None:
    """In a root sticky directory, a lock file of another user's is refused, never locked."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # others may add names here (as in /tmp)
    planted = shared / "ledger.lock"
    planted.touch(mode=0o600)
    os.chown(planted, _stranger(), _stranger())
    with (
        pytest.raises(files.UnsafePathError, match=f"owned by uid {_stranger()}, not root"),
        files.exclusive_lock(planted, wait_s=0.1),
    ):
        pass
    os.chown(planted, 0, 0)
    planted.chmod(0o644)  # root's, but anyone may open it, and so flock it
    with (
        pytest.raises(files.UnsafePathError, match="open to group or others"),
        files.exclusive_lock(planted, wait_s=0.1),
    ):
        pass


def test_a_lock_name_that_is_no_regular_file_of_ours_is_refused(tmp_path: Path) -> None:
    """A FIFO or a symlink at the lock's name is refused (the open never hangs); ours is used."""
    os.mkfifo(tmp_path / "fifo.lock", 0o600)
    with (
        pytest.raises(files.UnsafePathError, match="not a regular file"),
        files.exclusive_lock(tmp_path / "fifo.lock", wait_s=0.1),
    ):
        pass
    (tmp_path / "target").touch(mode=0o600)
    (tmp_path / "link.lock").symlink_to(tmp_path / "target")
    with (
        pytest.raises(files.UnsafePathError, match="symlink"),
        files.exclusive_lock(tmp_path / "link.lock", wait_s=0.1),
    ):
        pass
    with files.exclusive_lock(tmp_path / "new.lock", wait_s=0.1):
        assert stat.S_IMODE((tmp_path / "new.lock").stat().st_mode) == 0o600
    with files.exclusive_lock(tmp_path / "new.lock", wait_s=0.1):  # found again: ours
        pass
