"""The root side of the gate: a warm server that forks one child per request (adapter).

``gpuguard serve-gate`` runs as ``gpuguard-gate.service``, started by ``gpuguard-gate.socket``
(``Accept=no``), which hands it the listening socket (sd_listen_fds(3): ``LISTEN_PID``,
``LISTEN_FDS``, fd 3). Root, with the clean environment and sandbox systemd gives it, never a
child of the watched unit. The parent imports the request path once and then only accepts,
counts and forks (``serve_forever``): it never parses what a client sends (it only drops,
unread, what a turned-away one sent), initialises no NVML and starts no thread, so every child
begins from the same clean state. Each child answers one connection (``gaterequest.serve``):
it identifies the caller from the kernel (peer.py), refuses what the caller may not ask
(core/gate/auth.py), runs the same gate or reap code the in-process command runs,
with its output sent back as frames, and exits. A crash ends one request; no child sees
another's. The parent enforces what systemd enforced per instance when each connection started
a service of its own: at most MAX_REQUESTS at once, MAX_REQUESTS_PER_UID from one user, and
REQUEST_LIMIT_S of wall time per request. Before it forks it classifies the peer from the
kernel alone (``SO_PEERCRED`` and a bounded read of ``/proc/PID/cgroup``, :func:`classify`):
only an operator or a process of a watched unit gets a slot, and of a unit's processes only its
control process, as systemd names it (controlasks.py: asked without waiting; any other is told
so in one line, nothing forked), one request per unit at a time (a second one waits for it),
and OPERATOR_SLOTS of them are kept for operators. The caller is
pinned by a pidfd as its connection is taken (peer.pin), and its request's process accepts
only that process as the caller, however long the connection waited. A request's
process group is killed before the request is reaped, so nothing it started outlives it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import socket
import struct
import sys
import time
import traceback
from typing import TYPE_CHECKING, NamedTuple, NoReturn

from gpuguard.adapters import signals
from gpuguard.adapters.controlasks import ControlAsks
from gpuguard.adapters.peer import PROC, pin
from gpuguard.core.cgroup import attribute, parse_cgroup
from gpuguard.core.escaping import escape
from gpuguard.core.gate.auth import NOT_CONTROL, Caller, admission
from gpuguard.core.gate.proto import MAX_REQUEST_BYTES, frame_exit, frame_text

if TYPE_CHECKING:
    from collections.abc import Callable, MutableMapping
    from pathlib import Path
    from typing import TextIO


#: Requests served at once (gpuguard-gate.socket's MaxConnections= before); more are turned away.
MAX_REQUESTS = 64
#: Requests served at once for one peer UID (MaxConnectionsPerSource= before): one user's flood
#: leaves the other slots to the other units.
MAX_REQUESTS_PER_UID = 16
#: Slots only operators may take: a flood of watched units' requests never locks root out.
OPERATOR_SLOTS = 8
#: A request's process is killed after this long (RuntimeMaxSec= before): a gate waits at most
#: gate_timeout_s (at most 3600 s; a unit's own request cannot ask for more).
REQUEST_LIMIT_S = 3700.0
#: accept() failing for want of resources (EMFILE, ENFILE, ENOBUFS, ENOMEM) pauses accepting
#: this long, doubling to the maximum: the connection stays queued, the parent does not spin.
ACCEPT_BACKOFF_S = (0.05, 2.0)
#: Connections taken per turn of the loop before ended requests are reaped again (the rest
#: stay queued; poll() returns at once for them).
ACCEPT_BATCH = 64
#: /proc/PID/cgroup is one line on cgroup v2; more than this is no cgroup path to trust.
MAX_CGROUP_BYTES = 8192
#: sd_listen_fds(3): the first passed descriptor.
LISTEN_FDS_START = 3
#: At most one line a second about turned-away connections: a flood must not flood the journal
#: (or block the parent on a slow one).
_TURNED_AWAY_LOG_INTERVAL_S = 1.0
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


class ActivationError(Exception):
    """The process was not given a listening socket the sd_listen_fds(3) way; says why."""


class Limits(NamedTuple):
    """What the parent enforces; the defaults are the unit's, tests pass smaller ones."""

    requests: int = MAX_REQUESTS
    per_uid: int = MAX_REQUESTS_PER_UID
    seconds: float = REQUEST_LIMIT_S
    operator_slots: int = OPERATOR_SLOTS


#: classify()'s answer for an operator (root in a login session, see gate.auth).
OPERATOR = ""


class Refused(NamedTuple):
    """classify()'s answer for a peer that gets no slot: the one line it is told."""

    line: str


class _Request(NamedTuple):
    """A child serving one connection, as the parent counts it."""

    uid: int
    deadline: float  # monotonic
    unit: str  # the watched unit it serves, OPERATOR for an operator's


class _Waiting(NamedTuple):
    """A watched unit's connection waiting for that unit's request in progress to end."""

    conn: socket.socket
    uid: int
    pidfd: int
    """The caller, pinned as it was accepted: a PID reused while it waits is not it."""
    pid: int
    unit: str  # the watched unit it asks for, OPERATOR for an operator

    def close(self) -> None:
        """Hang up and let go of the pinned caller."""
        self.conn.close()
        os.close(self.pidfd)


def classify(
    pid: int, uid: int, watched: Callable[[str], bool], proc_root: Path = PROC
) -> str | Refused:
    """Who a peer is, before anything is forked for it: OPERATOR, its watched unit, or Refused.

    From the kernel only: ``SO_PEERCRED``'s PID and UID and at most MAX_CGROUP_BYTES of
    ``/proc/PID/cgroup`` (kernel text, never blocking on a file system). The request's own
    process checks the caller again, pinned by a pidfd (peer.py): this only decides the slot.
    """
    try:
        with (proc_root / str(pid) / "cgroup").open("rb") as handle:
            data = handle.read(MAX_CGROUP_BYTES + 1)
    except OSError:
        return Refused("gpuguard: request refused: the caller has gone")
    text = data.decode("utf-8", "backslashreplace") if len(data) <= MAX_CGROUP_BYTES else ""
    path = parse_cgroup(text)
    caller = Caller(pid=pid, uid=uid, attribution=attribute(path), environment=None, cgroup=path)
    if caller.is_operator:
        return OPERATOR
    service = caller.system_service
    refused = admission(caller, watched=service is not None and watched(service))
    if refused is not None or service is None:
        return Refused(f"gpuguard: {refused or 'request refused'}")
    return service


def take_listener(environ: MutableMapping[str, str]) -> socket.socket:
    """The listening socket systemd passed as fd 3, checked, and the variables that named it gone.

    ``LISTEN_PID`` must be this process (the variables may have been inherited by a process they
    were not meant for), ``LISTEN_FDS`` exactly 1, and fd 3 a listening UNIX stream socket.
    """
    pid, count = environ.get("LISTEN_PID"), environ.get("LISTEN_FDS")
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        environ.pop(name, None)  # never handed on to a child or systemctl
    if pid != str(os.getpid()):
        raise ActivationError("no socket passed to this process (LISTEN_PID is not its PID)")
    if count != "1":
        raise ActivationError(f"expected one passed socket, LISTEN_FDS is {count!r}")
    try:
        listener = socket.socket(fileno=LISTEN_FDS_START)
    except OSError as err:
        raise ActivationError(f"fd {LISTEN_FDS_START} is not a socket ({err.strerror})") from None
    listening = listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    if listener.family != socket.AF_UNIX or listener.type != socket.SOCK_STREAM or not listening:
        listener.detach()
        raise ActivationError(f"fd {LISTEN_FDS_START} is not a listening UNIX stream socket")
    os.set_inheritable(LISTEN_FDS_START, False)  # noqa: FBT003 - positional only
    return listener


def serve_forever(  # noqa: PLR0913 - the socket, the work, the log, and who may ask
    listener: socket.socket,
    serve_one: Callable[[socket.socket, int], int],
    log: TextIO,
    limits: Limits = Limits(),  # noqa: B008 - an immutable NamedTuple
    *,
    who: Callable[[int, int], str | Refused],
    controls: ControlAsks[_Waiting] | None = None,
) -> int:
    """Accept connections until SIGTERM, each served by ``serve_one`` in a forked child.

    ``serve_one`` gets the connection and a pidfd of its caller, pinned as it was accepted.

    ``who`` classifies a peer by its PID and UID (:func:`classify`); ``controls`` tells a
    watched unit's control process from its other processes (systemd's ControlPID=, asked by
    default). After SIGTERM it stops
    accepting (systemd queues new connections for the next start), turns away the ones waiting
    and lets the requests in progress finish: gpuguard-gate.service's TimeoutStopSec= is above
    REQUEST_LIMIT_S, so a restart never kills a gate in the middle of a reap.
    """
    listener.settimeout(0.0)  # non-blocking: accept() until EAGAIN
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    stopping: list[int] = []  # the signal that asked, once one has
    signal.signal(signal.SIGTERM, lambda signum, _: stopping.append(signum))
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake poll() through the pipe
    signal.set_wakeup_fd(wake_write)
    poller = select.poll()
    poller.register(wake_read, select.POLLIN)
    poller.register(listener, select.POLLIN)
    asks = ControlAsks[_Waiting]() if controls is None else controls
    asks.poller = poller
    server = _Parent(listener, serve_one, log, limits, (wake_read, wake_write), who=who)
    server.controls = asks  # the parent's own, with the poller it reports on
    try:
        _loop(server, poller, stopping)
    finally:
        signal.set_wakeup_fd(-1)
        os.close(wake_read)
        os.close(wake_write)
    return 0


def _loop(server: _Parent, poller: select.poll, stopping: list[int]) -> None:
    listener, wake_read = server.listener, server.wake[0]
    polled = True  # whether the listener is registered with the poller
    while True:
        server.reap()
        if stopping:
            if server.listening:
                if polled:
                    poller.unregister(listener)
                server.stop()
            if not server.requests and not server.controls.unreaped:
                return
        paused = server.listening and time.monotonic() < server.paused_until
        if server.listening and paused and polled:  # accepting paused: the listener is not polled
            poller.unregister(listener)
            polled = False
        elif server.listening and not paused and not polled:
            poller.register(listener, select.POLLIN)
            polled = True
            server.paused_until = 0.0  # the pause is over: poll() waits for the listener again
        # A signal (SIGCHLD, SIGTERM) arriving from here on writes to wake_read: no lost wakeup.
        ready = poller.poll(server.wait_ms())
        with contextlib.suppress(BlockingIOError):
            while os.read(wake_read, 512):
                pass
        server.answered(ready)
        if server.listening and polled and any(fd == listener.fileno() for fd, _ in ready):
            server.accept()


class _Parent:
    """The accepting parent's bookkeeping: its children, their owners and deadlines."""

    def __init__(  # noqa: PLR0913 - what serve_forever was given, kept together
        self,
        listener: socket.socket,
        serve_one: Callable[[socket.socket, int], int],
        log: TextIO,
        limits: Limits,
        wake: tuple[int, int],
        *,
        who: Callable[[int, int], str | Refused],
    ) -> None:
        self.listener = listener
        self.listening = True
        self.serve_one = serve_one
        self.log = log
        self.limits = limits
        self.wake = wake
        self.who = who
        self.controls: ControlAsks[_Waiting] = ControlAsks()
        self.requests: dict[int, _Request] = {}
        self.waiting: dict[str, _Waiting] = {}
        self.turned_away = 0
        self.turned_away_logged = -_TURNED_AWAY_LOG_INTERVAL_S
        self.paused_until = 0.0
        self.backoff_s = ACCEPT_BACKOFF_S[0]

    def wait_ms(self) -> int | None:
        """How long poll() may wait: until the next deadline or the end of a pause, or for ever."""
        deadlines = [request.deadline for request in self.requests.values()]
        asked = self.controls.deadline()
        if asked is not None:
            deadlines.append(asked)
        if self.listening and self.paused_until:
            deadlines.append(self.paused_until)
        if not deadlines:
            return None
        return max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)

    def accept(self) -> None:
        """Take the waiting connections: turn each away, queue it behind its unit's, or fork.

        At most ACCEPT_BATCH at a time: a flood that keeps the queue full must not keep the
        parent from reaping an ended request and serving the connection that waits for it.
        """
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                self._accept_failed(err)
                return
            self.paused_until, self.backoff_s = 0.0, ACCEPT_BACKOFF_S[0]
            self._admit(conn)

    def _accept_failed(self, err: OSError) -> None:
        """ECONNABORTED ends one connection; a lack of resources pauses accepting (no spin)."""
        if err.errno not in {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}:
            self.note(f"accept failed: {err.strerror or err}")
            return
        self.note(f"accept failed: {err.strerror or err}: backing off {self.backoff_s:g} s")
        self.paused_until = time.monotonic() + self.backoff_s
        self.backoff_s = min(self.backoff_s * 2, ACCEPT_BACKOFF_S[1])

    def _admit(self, conn: socket.socket) -> None:
        """Classify the peer and give it a slot, a place in its unit's queue, or one line."""
        credentials = _peer_credentials(conn)
        if credentials is None:
            self.turn_away(conn, "no credentials")
            return
        pid, uid = credentials
        try:
            unit = self.who(pid, uid)
        except Exception:  # noqa: BLE001 - one peer's oddity must never end the server
            traceback.print_exc(file=self.log)
            unit = Refused("gpuguard: request refused: the caller could not be classified")
        if isinstance(unit, Refused):
            self.turn_away(conn, unit.line, refusal=True)
            return
        # Pinned once classified: alive now, so it was the PID's owner when its cgroup was read.
        pidfd = pin(conn, pid)
        if pidfd is None:
            self.turn_away(conn, "gpuguard: request refused: the caller has gone", refusal=True)
            return
        peer = _Waiting(conn, uid, pidfd, pid, unit)
        if unit == OPERATOR:
            self._place(peer)
            return
        started = self.controls.started(pid, pidfd)
        if started is None:
            os.close(pidfd)
            self.turn_away(conn, "gpuguard: request refused: the caller has gone", refusal=True)
            return
        control = self.controls.decide(unit, pid, started)
        if control is None:
            if not self.controls.pend(unit, peer, pid, started):
                os.close(pidfd)
                self.turn_away(conn, f"{escape(unit)}'s callers wait for systemd's answer")
            return
        self.decided([(peer, control)])

    def stop(self) -> None:
        """Stop accepting: close the listener, turn away every connection not yet served."""
        self.listener.close()
        self.listening = False
        self.drop_waiting("the gate server is stopping")
        for pending in self.controls.drop():
            os.close(pending.pidfd)
            self.turn_away(pending.conn, "the gate server is stopping")
        self.note(f"stopping: waiting for {len(self.requests)} request(s) in progress")

    def answered(self, ready: list[tuple[int, int]]) -> None:
        """Read systemd's answers poll() reported, and end the overdue asks; act on them."""
        for fd, _ in ready:
            if self.controls.owns(fd):
                self.decided(self.controls.read(fd))
        self.decided(self.controls.expire(time.monotonic()))

    def decided(self, peers: list[tuple[_Waiting, bool]]) -> None:
        """A unit's control process gets its unit's slot or place; any other process one line."""
        for peer, control in peers:
            if control:
                self._place(peer)
                continue
            os.close(peer.pidfd)
            line = f"gpuguard: request from PID {peer.pid} of {escape(peer.unit)}: refused"
            line += f" ({NOT_CONTROL})"
            self.turn_away(peer.conn, line, refusal=True)

    def _place(self, peer: _Waiting) -> None:
        """The caller's slot, or a place behind its unit's request in progress, or one line."""
        unit = peer.unit
        if unit != OPERATOR and any(r.unit == unit for r in self.requests.values()):
            self._queue(peer, unit)  # no slot: it runs in its unit's
            return
        busy = self._over_limits(peer.uid, unit)
        if busy is not None:
            os.close(peer.pidfd)
            self.turn_away(peer.conn, busy)
        else:
            self._fork(peer, unit)

    def _queue(self, waiting: _Waiting, unit: str) -> None:
        """One connection per unit waits for the unit's request in progress; a third is told."""
        earlier = self.waiting.get(unit)
        if earlier is not None and not _hung_up(earlier.conn):
            os.close(waiting.pidfd)
            line = f"a request of {escape(unit)} is in progress and another waits"
            self.turn_away(waiting.conn, line)
            return
        if earlier is not None:
            earlier.close()
        self.waiting[unit] = waiting

    def drop_waiting(self, why: str) -> None:
        """Turn away every waiting connection (the server is stopping)."""
        for waiting in self.waiting.values():
            os.close(waiting.pidfd)
            self.turn_away(waiting.conn, why)
        self.waiting.clear()

    def _over_limits(self, uid: int, unit: str) -> str | None:
        limits = self.limits
        if len(self.requests) >= limits.requests:
            return f"{limits.requests} requests in progress"
        if unit == OPERATOR:
            return None
        others = sum(1 for request in self.requests.values() if request.unit != OPERATOR)
        if others >= limits.requests - limits.operator_slots:
            return f"{others} units' requests in progress; the other slots are the operator's"
        mine = sum(1 for request in self.requests.values() if request.uid == uid)
        if mine >= limits.per_uid:
            return f"{limits.per_uid} requests of uid {uid} in progress"
        return None

    def _fork(self, peer: _Waiting, unit: str) -> None:
        """Fork the request's process for ``peer``; the parent's copies are closed here."""
        try:
            self._fork_open(peer.conn, peer.pidfd, peer.uid, unit)
        finally:
            peer.close()

    def _fork_open(self, conn: socket.socket, pidfd: int, uid: int, unit: str) -> None:
        sys.stdout.flush()
        self.log.flush()  # nothing buffered is written twice
        try:
            pid = os.fork()
        except OSError as err:
            self.turn_away(conn, f"cannot fork ({err.strerror})")
            return
        if pid == 0:  # pragma: no cover - the child; its answers are what the tests check
            self._child(conn, pidfd)
        with contextlib.suppress(OSError):  # the child does it too: whichever runs first
            os.setpgid(pid, pid)
        self.requests[pid] = _Request(uid, time.monotonic() + self.limits.seconds, unit)

    def _child(self, conn: socket.socket, pidfd: int) -> NoReturn:
        """Serve ``conn`` and exit; never returns into the parent's loop."""
        code = 70  # EX_SOFTWARE, should serve_one itself fail
        try:
            os.setpgid(0, 0)  # its own group: the parent's kill takes its helpers too
            signal.set_wakeup_fd(-1)
            for signum in (signal.SIGTERM, signal.SIGCHLD):
                signal.signal(signum, signal.SIG_DFL)
            for fd in self.wake:
                os.close(fd)
            self.listener.close()
            code = self.serve_one(conn, pidfd)
        except BaseException:  # noqa: BLE001 - a child never returns into the parent's loop
            traceback.print_exc(file=self.log)
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                self.log.flush()
            os._exit(code)

    def reap(self) -> None:
        """Collect ended children (no zombies); kill those past the time limit.

        An ended child's process group is killed before the child is reaped: while it is a
        zombie its PID, the group's id, cannot be reused, so the signal reaches only what the
        request started (an abandoned NVML worker, a systemctl), never a stranger.
        """
        while self.requests or self.controls.unreaped:
            try:
                ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                self.requests.clear()
                self.controls.unreaped.clear()
                return
            if ended is None or not ended.si_pid:
                break
            pid = ended.si_pid
            signals.signal_own_group(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            request = self.requests.pop(pid, None)
            self.controls.reaped(pid)
            if os.WIFSIGNALED(status) and os.WTERMSIG(status) != signal.SIGKILL:
                self.note(f"request PID {pid} ended by signal {os.WTERMSIG(status)}")
            if request is not None:
                self._next_of(request.unit)
        now = time.monotonic()
        for pid, request in self.requests.items():
            if now >= request.deadline:
                self.note(f"request PID {pid} ran {self.limits.seconds:g} s: killed")
                signals.signal_own_group(pid, signal.SIGKILL)
                self.requests[pid] = request._replace(deadline=now + self.limits.seconds)

    def _next_of(self, unit: str) -> None:
        """Serve the connection waiting for ``unit``'s request that just ended, if any."""
        waiting = self.waiting.pop(unit, None) if unit != OPERATOR else None
        if waiting is None:
            return
        if _hung_up(waiting.conn):
            waiting.close()
            return
        busy = self._over_limits(waiting.uid, unit)
        if busy is not None:
            os.close(waiting.pidfd)
            self.turn_away(waiting.conn, busy)
        else:
            self._fork(waiting, unit)

    def turn_away(self, conn: socket.socket, why: str, *, refusal: bool = False) -> None:
        """One line and a verdict of 1, sent without waiting; the connection closed.

        ``why`` is why the server is busy, or with ``refusal`` the whole line. What the client
        already sent is dropped unread first (a bounded, non-blocking drain): closing over
        unread bytes would reset the connection and lose the line.
        """
        line = why if refusal else f"gpuguard: the gate server is busy ({why}): request refused"
        with conn, contextlib.suppress(OSError):
            conn.send(frame_text(2, line) + frame_exit(1), socket.MSG_DONTWAIT)
            conn.shutdown(socket.SHUT_WR)
            for _ in range(4):
                if not conn.recv(MAX_REQUEST_BYTES + 1, socket.MSG_DONTWAIT):
                    break
        self.turned_away += 1
        now = time.monotonic()
        if now - self.turned_away_logged >= _TURNED_AWAY_LOG_INTERVAL_S:
            self.note(f"turned away {self.turned_away} connection(s), the last: {why}")
            self.turned_away, self.turned_away_logged = 0, now

    def note(self, line: str) -> None:
        self.log.write(line + "\n")
        self.log.flush()


def _peer_credentials(conn: socket.socket) -> tuple[int, int] | None:
    """The connecting process's PID and UID as the kernel recorded them at connect()."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    except OSError:
        return None
    pid, uid, _gid = _CREDENTIALS.unpack(raw)
    return (pid, uid) if pid > 0 else None


def _hung_up(conn: socket.socket) -> bool:
    """Whether the client has closed its end (POLLHUP: both directions shut)."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLHUP)
    return bool(poller.poll(0))
