"""One request of the gate server, in the process forked for it (adapter).

``serve`` answers one connection: it identifies the caller from the kernel (peer.py), refuses
what the caller may not ask (core/gate/auth.py), reads the one request line under one deadline, runs
the gate or reap work with its output sent back as frames (``_Frames``), copies the verdict's
lines, bounded and escaped, into the server's own journal (``_JournalCopy``: only these carry
gpuguard-gate.service's trusted fields, which ``explain`` trusts), ends the work when the client
has gone, and closes the connection without losing the answer. The parent that accepts,
counts and forks is ``gateserver``.
"""

from __future__ import annotations

import contextlib
import io
import os
import select
import signal
import socket
import threading
import time
import traceback
from dataclasses import replace
from typing import TYPE_CHECKING

from gpuguard.adapters import systemd
from gpuguard.adapters.peer import PROC, PeerError, identify
from gpuguard.core.escaping import escape
from gpuguard.core.exits import EX_USAGE
from gpuguard.core.gate.auth import Caller, admission, refusal
from gpuguard.core.gate.proto import (
    CLIENT_GONE,
    MAX_REQUEST_BYTES,
    frame_exit,
    frame_text,
    parse_request,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path
    from typing import TextIO

    from _typeshed import ReadableBuffer

    from gpuguard.core.gate.proto import Request

#: A caller gets this long to send its request line; then the instance ends.
REQUEST_TIMEOUT_S = 10.0
#: Everything before a request is accepted - reading the caller's /proc files (which a caller
#: could make block, e.g. environment strings in a FUSE-backed mapping), its request line, the
#: refusal and its drain - ends within this many seconds: SIGALRM, whose default action ends the
#: request's process, so an unauthorized caller cannot hold a slot longer.
UNAUTHORIZED_LIMIT_S = 25
#: A client that reads nothing for this long is treated as gone (the work goes on).
SEND_TIMEOUT_S = 30.0
#: What the server copies into its own journal of the lines a request sends the client's
#: standard error (the gate's verdict, the reaper's signals): per request, and per line.
JOURNAL_LINES = 200
JOURNAL_LINE_CHARS = 2048


class _Frames(io.RawIOBase):
    """Bytes written here go to the client as one frame per line, for its ``fd``.

    A client that has gone (systemd stopped the start) is not an error: the work finishes and
    is recorded, the output is dropped.
    """

    def __init__(
        self, conn: socket.socket, fd: int, copy: Callable[[str], None] | None = None
    ) -> None:
        super().__init__()
        self._conn = conn
        self._fd = fd
        self._copy = copy
        self._pending = b""
        self._gone = False

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer) -> int:
        chunk = bytes(data)
        self._pending += chunk
        *lines, self._pending = self._pending.split(b"\n")
        for line in lines:
            self._send(line)
        return len(chunk)

    def finish(self) -> None:
        """Send a last line that had no newline."""
        if self._pending:
            self._send(self._pending)
            self._pending = b""

    def _send(self, line: bytes) -> None:
        text = line.decode("utf-8", "backslashreplace")
        if self._copy is not None:
            self._copy(text)  # the journal gets it even when the client has gone
        if self._gone:
            return
        try:
            self._conn.sendall(frame_text(self._fd, text))
        except OSError:
            self._gone = True


@contextlib.contextmanager
def _stream(
    conn: socket.socket, fd: int, copy: Callable[[str], None] | None = None
) -> Iterator[TextIO]:
    """A text stream over _Frames, flushed line by line and finished at the end."""
    frames = _Frames(conn, fd, copy)
    text = io.TextIOWrapper(
        io.BufferedWriter(frames), encoding="utf-8", errors="backslashreplace", line_buffering=True
    )
    try:
        yield text
    finally:
        text.flush()
        frames.finish()


def serve(  # noqa: PLR0913 - one request's connection, its work and its caller's pin
    conn: socket.socket,
    handle: Callable[[Request, Caller, TextIO, TextIO], int],
    log: TextIO,
    *,
    watched: Callable[[str], bool],
    proc_root: Path = PROC,
    pinned: int | None = None,
) -> int:
    """Answer the one request on ``conn``; log what it decided to ``log`` (the journal).

    ``handle`` does the work, writing to the two streams it is given; its return value is the
    verdict. Returns the verdict too (the instance's own exit status). Every line ``handle``
    sends the client's standard error (the gate's verdict, the reaper's signals) is also
    written to ``log``, behind "<command> for <unit> from PID <pid>: ", and the exit status
    last: the unit's own output can print the same words, but only these lines carry the
    journal's trusted fields of gpuguard-gate.service as root (``explain`` shows only them).
    ``watched`` says whether gpuguard watches a unit: only a watched unit's own processes (and
    operators) are served. ``pinned``: the caller's pidfd, taken as the parent accepted
    ``conn`` (peer.identify).
    """
    signal.alarm(UNAUTHORIZED_LIMIT_S)
    try:
        admitted = _admit(conn, log, proc_root, watched, pinned)
    finally:
        signal.alarm(0)
    if isinstance(admitted, int):
        return admitted
    request, caller = admitted
    log.write(
        f"{request.command} for {request.unit} from PID {caller.pid} (uid {caller.uid}, "
        f"{caller.describe()}): accepted\n"
    )
    log.flush()
    conn.settimeout(SEND_TIMEOUT_S)  # a client that stops reading does not hold us
    answered = threading.Event()
    said = _JournalCopy(log, f"{request.command} for {request.unit} from PID {caller.pid}: ")
    watcher = threading.Thread(
        target=_end_with_the_client, args=(conn, said, answered), daemon=True
    )
    watcher.start()
    with _stream(conn, 1) as out, _stream(conn, 2, said.line) as errors:
        try:
            code = handle(request, caller, out, errors)
        except Exception:  # noqa: BLE001 - the client must get a verdict, the journal the trace
            traceback.print_exc(file=log)
            errors.write(f"gpuguard {request.command}: the gate server failed (see its journal)\n")
            code = 1
    said.line(f"exit {code}", last=True)
    answered.set()
    with contextlib.suppress(OSError):
        conn.sendall(frame_exit(code))
    _close(conn)
    return code


def _admit(
    conn: socket.socket,
    log: TextIO,
    proc_root: Path,
    watched: Callable[[str], bool],
    pinned: int | None,
) -> tuple[Request, Caller] | int:
    """The caller and its request once both pass; else the refusal's exit status, answered."""
    try:
        caller = identify(conn, proc_root=proc_root, pinned=pinned)
    except PeerError as err:
        return _answer(conn, log, f"gpuguard: request refused: {err}", 1)
    service = caller.system_service
    refused = admission(caller, watched=service is not None and watched(service))
    if refused is not None:
        return _answer(conn, log, f"gpuguard: {refused}", 1)
    line = _read_request(conn)
    request = parse_request(line) if line is not None else "no request line"
    if isinstance(request, str):
        problem = f"gpuguard: bad request from PID {caller.pid}: {request}"
        return _answer(conn, log, problem, EX_USAGE)
    if not caller.is_operator and caller.runs_in(request.unit):
        # systemd's word, now: the parent decided the slot on an answer asked a moment ago.
        state = systemd.show_unit(request.unit)
        caller = replace(caller, control=state.is_control_process(caller.pid, trust_unknown=False))
    refused = refusal(request, caller)
    if refused is not None:
        return _answer(conn, log, f"gpuguard {request.command}: {refused}", 1)
    return request, caller


class _JournalCopy:
    """The root side's own record of a request's verdict: its lines, bounded, into the journal."""

    def __init__(self, log: TextIO, prefix: str) -> None:
        self._log = log
        self._prefix = prefix
        self._left = JOURNAL_LINES
        self._lock = threading.Lock()  # the work and the client's watcher both write lines

    def line(self, text: str, *, last: bool = False) -> None:
        """Log one line (escaped and cut); past JOURNAL_LINES, one note and then only the last."""
        if not last:
            if self._left <= 0:
                return
            self._left -= 1
            if self._left == 0:
                text = f"(further lines not logged, at most {JOURNAL_LINES}) {text}"
        with self._lock:
            self._log.write(self._prefix + escape(text, JOURNAL_LINE_CHARS) + "\n")
            self._log.flush()


def _end_with_the_client(conn: socket.socket, said: _JournalCopy, done: threading.Event) -> None:
    """Exit as soon as the client has gone, unless the answer is complete.

    The client is the unit's ExecStartPre=/ExecStopPost=: when systemd kills it (the start was
    cancelled, a timeout) the work must end too, as it did when the gate ran in the unit's
    cgroup - a gate left waiting would otherwise see the unit's next run as left over. poll()
    reports POLLHUP only once the client has closed both directions (it shut down only its
    sending side after the request). The end is the request's last journal line, under its
    own prefix and in place of its exit status (CLIENT_GONE): a stop-reap cut short is told as
    one whose outcome is unknown, never as one that finished.
    """
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLHUP)
    while not done.is_set():
        if poller.poll(500) and not done.is_set():
            said.line(CLIENT_GONE, last=True)
            os._exit(1)  # as systemd's SIGTERM/SIGKILL ended the in-cgroup gate


def _answer(conn: socket.socket, log: TextIO, line: str, code: int) -> int:
    """Refuse with one line to both the client and the journal."""
    log.write(line + "\n")
    log.flush()
    with contextlib.suppress(OSError):
        conn.sendall(frame_text(2, line) + frame_exit(code))
    _close(conn)
    return code


def _close(conn: socket.socket) -> None:
    """End the answer, then drop what the client still sends (bounded).

    Closing with unread bytes makes the kernel reset the connection, losing the answer.
    """
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
        for _ in range(16):
            if not _set_deadline(conn, deadline) or not conn.recv(MAX_REQUEST_BYTES):
                break


def _set_deadline(conn: socket.socket, deadline: float) -> bool:
    """Let the next recv wait only until ``deadline`` (one budget for all of them); False: past."""
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    conn.settimeout(left)
    return True


def _read_request(conn: socket.socket) -> bytes | None:
    """The first line the client sends, at most MAX_REQUEST_BYTES; None if none came in time.

    One deadline for the whole line: a client dripping a byte at a time cannot hold the slot.
    """
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    data = b""
    while b"\n" not in data and len(data) <= MAX_REQUEST_BYTES:
        if not _set_deadline(conn, deadline):
            return None
        try:
            chunk = conn.recv(MAX_REQUEST_BYTES + 1 - len(data))
        except OSError:
            return None
        if not chunk:
            break
        data += chunk
    line, newline, _ = data.partition(b"\n")
    return (line if newline else data) or None
