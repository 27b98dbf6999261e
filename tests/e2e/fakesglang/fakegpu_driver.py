#!/usr/bin/env python3
"""The fake GPU *driver* of the end-to-end container: it frees fake GPU memory like the kernel.

With a real GPU, memory belongs to a CUDA context, and the kernel driver frees it when the last
file descriptor of that context is closed - by every process that inherited it, wherever those
processes sit. The fake NVML (``tests/fakenvml``) only reads allocation files; someone must append
``released_at_ms=`` when the holders are gone. ``gpu_hold.py`` does that with a watcher process,
which is fine on a test host but not under systemd: a unit's stop SIGKILLs every process of its
cgroup, the watcher included, and the memory would then stay "used" forever.

So in the container this small service stands in for the driver, in its own unit (outside every
server's cgroup, as the kernel is):

* It listens on a UNIX socket (``--socket``, default ``/run/fakegpu/driver.sock``).
* A process *creates a context* by connecting and sending lines ``alloc MINOR MIB``; the driver
  writes one allocation file per line (``STATE/allocs/<pid>-gpu<minor>-<token>.alloc``, the pid
  from ``SO_PEERCRED``: the kernel's word, not the client's) and answers ``ok PATH``. Like
  NVIDIA's driver, it reports the client's *host* PID (``host_pid``) when the harness has bound
  the host's procfs in as ``STATE/host-proc``.
* The connection *is* the context: the client keeps the socket open (children it forks inherit
  it). When every process holding it has exited, the driver reads EOF and appends
  ``released_at_ms=<now>`` to the context's files; the GPU's ``release_delay_ms`` in
  ``gpus.json`` then models a driver that needs time to tear the context down.

Standard library only (it runs under the container's ``/usr/bin/python3``); Type=notify.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import select
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

_LINE_LIMIT = 4096
_TICK_S = 1.0


@dataclass
class _Context:
    """One client connection: who opened it and the allocation files it owns."""

    pid: int
    buffer: bytes = b""
    allocs: list[Path] = field(default_factory=list)


def _peer_pid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, _uid, _gid = struct.unpack("3i", creds)
    return int(pid)


def _nspid(status: str) -> list[str]:
    return next((ln.split()[1:] for ln in status.splitlines() if ln[:6] == "NSpid:"), [])


def host_pid(state: Path, pid: int) -> int:
    """The PID NVIDIA's driver would report for ``pid`` of our PID namespace: the host's.

    ``STATE/host-proc``, where present, is the host's procfs (bound in by the test harness):
    the host process whose ``NSpid:`` ends in the one our procfs shows for ``pid`` (``pid``
    itself, then its numbers in deeper namespaces: a process of a docker container here) and
    whose own PID namespace is the one ``pid`` has here (namespace inodes are the same in every
    view). Without it (no container), or when none matches, ``pid`` itself.
    """
    host_proc = state / "host-proc"
    if not host_proc.is_dir():
        return pid
    try:
        ours = _nspid(Path(f"/proc/{pid}/status").read_text())
        namespace = Path(f"/proc/{pid}/ns/pid").stat().st_ino
    except OSError:
        return pid
    for entry in os.scandir(host_proc):
        if not entry.name.isdecimal():
            continue
        with contextlib.suppress(OSError):
            nspid = _nspid(Path(entry.path, "status").read_text())
            if (
                len(nspid) > len(ours)
                and nspid[-len(ours) :] == ours
                and Path(entry.path, "ns", "pid").stat().st_ino == namespace
            ):
                return int(entry.name)
    return pid


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="ascii")
    tmp.replace(path)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _log(text: str) -> None:
    sys.stdout.write(f"fakegpu-driver: {text}\n")
    sys.stdout.flush()


def _notify(message: str) -> None:
    """sd_notify(3) by hand: one datagram to $NOTIFY_SOCKET (abstract names start with @)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.sendall(message.encode())


class Driver:
    """The select loop: accept contexts, serve their allocation requests, release on EOF."""

    def __init__(self, state: Path, listener: socket.socket) -> None:
        """Serve allocations in ``state`` through ``listener`` (bound and listening)."""
        self.state = state
        self.listener = listener
        self.contexts: dict[socket.socket, _Context] = {}
        self.stop = False

    def run(self) -> None:
        """Loop until SIGTERM; then release nothing (the container is going away)."""
        while not self.stop:
            with contextlib.suppress(InterruptedError):
                readable, _, _ = select.select([self.listener, *self.contexts], [], [], _TICK_S)
                for sock in readable:
                    if sock is self.listener:
                        self._accept()
                    else:
                        self._serve(sock)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        self.contexts[conn] = _Context(_peer_pid(conn))

    def _serve(self, conn: socket.socket) -> None:
        context = self.contexts[conn]
        try:
            data = conn.recv(_LINE_LIMIT)
        except OSError:
            data = b""
        if not data:
            self._release(conn, context)
            return
        context.buffer += data
        while b"\n" in context.buffer:
            line, context.buffer = context.buffer.split(b"\n", 1)
            reply = self._request(context, line.decode(errors="replace").split())
            with contextlib.suppress(OSError):
                conn.sendall(reply.encode() + b"\n")
        if len(context.buffer) > _LINE_LIMIT:
            self._release(conn, context)

    def _request(self, context: _Context, words: list[str]) -> str:
        if len(words) != 3 or words[0] != "alloc" or not all(w.isdecimal() for w in words[1:]):
            return "error: expected 'alloc MINOR MIB'"
        minor, mib = int(words[1]), int(words[2])
        if not (self.state / "dev" / f"nvidia{minor}").exists():
            return f"error: no GPU with minor {minor}"
        path = self.state / "allocs" / f"{context.pid}-gpu{minor}-{secrets.token_hex(4)}.alloc"
        reported = host_pid(self.state, context.pid)
        _write_atomically(path, f"pid={reported}\nminor={minor}\nmib={mib}\nkind=compute\n")
        context.allocs.append(path)
        _log(f"context of PID {context.pid} (host PID {reported}): {mib} MiB on GPU {minor}")
        return f"ok {path}"

    def _release(self, conn: socket.socket, context: _Context) -> None:
        """The last holder of the context is gone: its memory is freed (after release_delay_ms)."""
        del self.contexts[conn]
        conn.close()
        line = f"released_at_ms={_now_ms()}\n".encode()
        for path in context.allocs:
            with contextlib.suppress(OSError):
                fd = os.open(path, os.O_WRONLY | os.O_APPEND)
                try:
                    os.write(fd, line)
                finally:
                    os.close(fd)
        if context.allocs:
            _log(f"context of PID {context.pid} closed: {len(context.allocs)} allocation(s) freed")


def main() -> None:
    """Parse the options, bind the socket, tell systemd we are ready, serve."""
    parser = argparse.ArgumentParser(description="The fake GPU driver (see the module doc).")
    parser.add_argument("--state", type=Path, default=Path("/var/lib/fakenvml"))
    parser.add_argument("--socket", type=Path, default=Path("/run/fakegpu/driver.sock"))
    args = parser.parse_args()
    (args.state / "allocs").mkdir(parents=True, exist_ok=True)
    args.socket.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        args.socket.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(args.socket))
    args.socket.chmod(0o666)  # servers may run as any user, as CUDA processes do
    listener.listen(64)
    driver = Driver(args.state, listener)

    def on_term(_signum: int, _frame: object) -> None:
        driver.stop = True

    signal.signal(signal.SIGTERM, on_term)
    _log(f"serving {args.state} on {args.socket}")
    _notify("READY=1")
    driver.run()


if __name__ == "__main__":
    main()
