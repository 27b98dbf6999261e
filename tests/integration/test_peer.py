"""Who is on the other end of a socket: real processes, real SO_PEERCRED, real /proc."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest

from gpuguard.adapters import unitenv
from gpuguard.adapters.peer import (
    MAX_ENVIRON_BYTES,
    PeerError,
    identify,
    parse_environ,
    pidfd_pid,
    pin,
)

if TYPE_CHECKING:
    from pathlib import Path

CONNECT = """
import socket, sys
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.connect(sys.argv[1])
print("connected", flush=True)
sys.stdin.readline()
"""


IDENTIFY = """
import json, socket
from gpuguard.adapters.peer import PeerError, identify
try:
    caller = identify(socket.socket(fileno=0))
except PeerError as err:
    print(json.dumps(str(err)))
else:
    print(json.dumps({"pid": caller.pid, "uid": caller.uid, "environment": caller.environment}))
"""


def _identify_in_a_server(conn: socket.socket) -> Any:
    """identify() in a process started after the connection, as systemd's Accept=yes does."""
    done = subprocess.run(
        [sys.executable, "-c", IDENTIFY], stdin=conn.fileno(), capture_output=True, check=True
    )
    return json.loads(done.stdout)


def _listener(tmp_path: Path) -> tuple[socket.socket, str]:
    path = str(tmp_path / "peer.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    return listener, path


def test_the_caller_is_who_the_kernel_says_with_its_real_environment(tmp_path: Path) -> None:
    """PID and UID from SO_PEERCRED; the environment is the caller's, not ours."""
    listener, path = _listener(tmp_path)
    child = subprocess.Popen(
        [sys.executable, "-c", CONNECT, path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "GPU-1234,3", "ONLY_IN_CHILD": "1"},
        text=True,
    )
    conn, _ = listener.accept()
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "connected\n"
        caller = _identify_in_a_server(conn)
        assert caller["pid"] == child.pid
        assert caller["uid"] == os.getuid()
        assert caller["environment"]["CUDA_VISIBLE_DEVICES"] == "GPU-1234,3"
        assert caller["environment"]["ONLY_IN_CHILD"] == "1"
        assert "ONLY_IN_CHILD" not in os.environ
    finally:
        child.communicate("\n", timeout=10)
        conn.close()
        listener.close()


def test_a_caller_that_has_gone_is_refused(tmp_path: Path) -> None:
    """Connected, then exited and reaped: its PID names nobody (or somebody else) now."""
    listener, path = _listener(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", CONNECT, path], stdin=subprocess.DEVNULL)
    conn, _ = listener.accept()
    child.wait(timeout=10)
    with conn, listener:
        assert _identify_in_a_server(conn) == "the caller has gone"


def test_a_server_older_than_its_caller_cannot_pin_it(tmp_path: Path) -> None:
    """A process that started after the server cannot be the one that connected before it."""
    listener, path = _listener(tmp_path)
    child = subprocess.Popen(
        [sys.executable, "-c", CONNECT, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    conn, _ = listener.accept()
    try:
        with pytest.raises(PeerError, match="its PID now names a later process"):
            identify(conn)  # this test process is older than the child
    finally:
        child.communicate(b"\n", timeout=10)
        conn.close()
        listener.close()


def test_environ_parsing_is_total_and_getenv_like() -> None:
    """Entries without '=', empty names and bad UTF-8 are skipped or escaped, never raised."""
    data = b"A=1\0A=2\0=x\0noequals\0B=\xff\xfe\0C=a=b\0"
    assert parse_environ(data) == {"A": "1", "B": "\\xff\\xfe", "C": "a=b"}
    assert MAX_ENVIRON_BYTES >= 64 * 1024


def test_the_recorded_gpu_variables_are_trusted_only_from_root(tmp_path: Path) -> None:
    """The daemon reads back what the gate recorded; a file others can write is ignored."""
    if os.geteuid() != 0:
        pytest.skip("records are root's (the test writes and checks uid 0 files)")
    environment = {"CUDA_VISIBLE_DEVICES": "2,3", "PATH": "/home/u/bin", "SECRET": "x"}
    unitenv.record(tmp_path, "sglang.service", environment, 42)
    assert unitenv.recorded(tmp_path, "sglang.service") == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert unitenv.recorded(tmp_path, "other.service") is None
    path = unitenv.record_path(tmp_path, "sglang.service")
    path.chmod(0o666)
    assert unitenv.recorded(tmp_path, "sglang.service") is None
    path.chmod(0o644)
    os.chown(path, 65534, 65534)
    assert unitenv.recorded(tmp_path, "sglang.service") is None


def test_the_parent_pins_the_very_process_that_connected(tmp_path: Path) -> None:
    """pin() names the connected process while it lives; after it exited, nothing is pinned."""
    listener, path = _listener(tmp_path)
    child = subprocess.Popen(
        [sys.executable, "-c", CONNECT, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    conn, _ = listener.accept()
    with conn, listener:
        assert child.stdout is not None
        assert child.stdout.readline() == b"connected\n"
        pidfd = pin(conn, child.pid)
        assert pidfd is not None
        try:
            assert pidfd_pid(pidfd) == child.pid
            child.communicate(b"\n", timeout=10)
            assert pidfd_pid(pidfd) is None  # exited: the pin names no later owner of the PID
            assert pin(conn, child.pid) is None
        finally:
            os.close(pidfd)


class _KernelAnswers:
    """A socket stand-in (a mock) whose SO_PEERPIDFD fails with ``code``.

    The kernels that answer so (6.5 to 6.x give EINVAL for a reaped peer) are not this
    machine's, so the answer is made up; the PID handed to pin() is a live process (this one),
    which a fallback would pin.
    """

    def __init__(self, code: int) -> None:
        self.code = code

    def getsockopt(self, *_args: object) -> int:
        raise OSError(self.code, os.strerror(self.code))


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ESRCH, errno.ENODATA])
def test_a_gone_peer_is_not_taken_for_an_old_kernel(code: int) -> None:
    """Only ENOPROTOOPT (no such option) falls back to pidfd_open: a gone peer pins nothing."""
    assert pin(_KernelAnswers(code), os.getpid()) is None  # type: ignore[arg-type]


def test_a_kernel_without_the_option_falls_back_to_the_pid() -> None:
    """Before Linux 6.5 (ENOPROTOOPT) the live process with that PID is pinned."""
    pidfd = pin(_KernelAnswers(errno.ENOPROTOOPT), os.getpid())  # type: ignore[arg-type]
    assert pidfd is not None
    try:
        assert pidfd_pid(pidfd) == os.getpid()
    finally:
        os.close(pidfd)
