"""The journal adapter: the only module that runs ``journalctl``, and only ever as a subprocess.

It follows, for the watched units, systemd's own messages about them and (when asked) the few
lines of their output that match given patterns, and hands them out as plain dicts, exactly as
``journalctl --output=json --all`` printed them (every field, or only the ``fields`` the owner
names; trust is judged by the parser from ``_PID``/``_UID``/``_SYSTEMD_CGROUP``, never here).
What is at risk: an event seen twice or never (a detector miscounts a restart loop), history
mistaken for news (an action on a loop that is long over), a follower that dies quietly, and
request-log noise parsed in Python.

How each is handled (journalctl(1), systemd.journal-fields(7); docs/daemon.md):

* **Streams.** ``lifecycle``: ``_PID=1 UNIT=<u>… + _SYSTEMD_CGROUP=/init.scope UNIT=<u>…`` (PID 1
  on every version; 257's own ``-u`` matches init.scope, which adds the helpers PID 1 forks).
  ``output`` (only with ``output_patterns``): ``_SYSTEMD_UNIT=<u>…`` with ``--grep`` on the
  alternation of the patterns, so journalctl drops the noise and Python never sees it. Each stream
  is its own journalctl with its own cursor; order is kept within a stream, not across them.
  ``kernel`` (only with ``kernel_patterns``): ``_TRANSPORT=kernel`` with ``--grep`` likewise;
  journald sets that field for what it reads from /dev/kmsg and no client can send it.
* **History, then live.** ``start()`` runs a non-following journalctl over the history (the last
  ``replay_s`` seconds of the current boot, or from the saved cursor if that is newer, as
  fail2ban does); its records carry ``live=False``: rebuild a window from them, do not act. When
  it has printed everything it exits, and a ``--follow`` journalctl continues exactly after the
  last history entry; its records carry ``live=True``.
* **Cursors are ours.** 252's ``--cursor-file`` is never written under ``--follow``, and 252's
  ``--after-cursor`` skips one entry when the cursor's entry does not match the filter. So the
  caller ``commit()``s records after processing them; this module writes one ``__CURSOR`` per
  stream to ``cursor_path`` (JSON, temp file + rename), and resumes with the inclusive
  ``--cursor=`` and drops the one entry whose ``__CURSOR`` equals it: right on 252 and on 257.
  ``--lines=all`` on every ``--follow``: 252 otherwise prints only 10 entries of the backlog
  until new data arrives.
* **Boots.** Both runs name the boot of the journal's newest entry (the current one; not the
  boot ID in /proc, which a sandboxed service in a container sees as the host's), so
  nothing from before a reboot is replayed (that loop ended with the reboot). A saved cursor from
  an earlier boot is still a position in the journal: journalctl seeks to it and the boot match
  skips to the first entry of this boot. Entries of the earlier boot after the saved cursor
  (unprocessed at shutdown) are not delivered; that is the choice, not an accident.
* **Restarts.** A journalctl that exits or dies is started again after a backoff (1, 2, 5, 10,
  30 s by default; reset after a run as long as the longest step), measured on the injected
  clock; nothing here sleeps: the owner's loop calls ``read_available()`` when one of ``fds()``
  is readable or ``wake_in()`` has passed. It resumes right after the last record handed out
  (not the last committed one: a record handed out once is never handed out again in this
  process, so a detector never counts it twice); after a restart of the whole process the
  committed cursor is the resume point (at least once for what was not committed). ``health()``
  says attached / replaying / restarting (reason, next attempt) for status and sd_notify.
* **Hostile output.** Malformed JSON, non-objects, entries without ``__CURSOR``, lines cut at
  exit and lines over ``MAX_LINE_BYTES`` are counted and skipped with a reason
  (``take_problems()``), never raised; partial lines wait for the rest; journalctl's stderr is
  drained (a full pipe would stall it) and its last line becomes the reason when it exits. A
  missing journalctl is a ``restarting`` state with a reason, not an exception.

Each journalctl runs in its own process group, so ``close()`` also ends what a wrapper forked
(``nsenter -t PID -a journalctl`` forks journalctl into the container's pid namespace). It is
also started with ``PR_SET_PDEATHSIG=SIGKILL``: if the follower's process dies without closing
(SIGKILL, a crash), the kernel kills the journalctl it started; none is left running.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import re
import select
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, cast

from typing_extensions import Self

from gpuguard.adapters import programs, signals
from gpuguard.adapters.state import read_json, write_json

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path
    from types import TracebackType

LIFECYCLE = "lifecycle"
"""PID 1's messages about the watched units."""
OUTPUT = "output"
"""The watched units' own output lines that match ``output_patterns``."""
KERNEL = "kernel"
"""Kernel messages (``_TRANSPORT=kernel``, set by journald only) that match ``kernel_patterns``."""

DEFAULT_BACKOFF: tuple[float, ...] = (1, 2, 5, 10, 30)
MAX_LINE_BYTES = 16 << 20
"""A JSON line longer than this is dropped (a MESSAGE that size is no lifecycle event)."""
CURSOR_FILE_FORMAT = 1

_READ_CHUNK = 1 << 16
_READ_BUDGET = 4 << 20  # bytes per stream per read_available(), so one stream cannot starve a loop
_PROBLEMS_KEPT = 100
_EXCERPT = 120
_STOP_GRACE_S = 1.0
_PR_SET_PDEATHSIG = 1
_UNIT_NAME = re.compile(r"[A-Za-z0-9:_.\\@-]{1,255}")
# A journal cursor: `s=…;i=…;b=…;m=…;t=…;x=…` (lower-case hex values); anything else makes
# journalctl fail with "Failed to seek to cursor", so it is never passed on.
_BOOT_ID = re.compile(r"[0-9a-f]{32}")
_CURSOR = re.compile(r"[a-z]=[0-9a-f]{1,64}(?:;[a-z]=[0-9a-f]{1,64}){0,15}")

State = Literal["stopped", "replaying", "attached", "restarting"]
Entry = dict[str, object]


@dataclass(frozen=True, slots=True)
class JournalRecord:
    """One journal entry as journalctl printed it, which stream it came from, and whether it is new.

    ``live=False`` is history replayed at start: rebuild state from it, never act on it.
    """

    entry: Entry
    stream: str
    live: bool

    @property
    def cursor(self) -> str:
        """The entry's ``__CURSOR`` (every record has one; lines without are skipped)."""
        return cast("str", self.entry["__CURSOR"])


@dataclass(frozen=True, slots=True)
class StreamHealth:
    """How one journalctl stream is doing."""

    stream: str
    state: State
    reason: str | None  # why it is restarting (the exit and journalctl's last words), else None
    next_attempt_in_s: float | None  # when restarting
    pid: int | None  # of the running journalctl (or its wrapper)
    argv: tuple[str, ...]  # of the running or last journalctl
    restarts: int  # journalctl started again after an exit or a failed start
    delivered: int  # records handed out
    malformed: int  # lines skipped


@dataclass(frozen=True, slots=True)
class JournalHealth:
    """The follower as a whole: the worst state of its streams, with that stream's reason."""

    state: State
    reason: str | None
    next_attempt_in_s: float | None
    streams: tuple[StreamHealth, ...]
    cursor_error: str | None  # the last failure to write the cursor file, cleared by a success


@dataclass(frozen=True, slots=True)
class _Position:
    cursor: str
    realtime_us: int | None


@dataclass(eq=False)
class _Stream:
    """Mutable bookkeeping for one journalctl; private to the follower."""

    name: str
    filter_args: tuple[str, ...]
    state: State = "stopped"
    phase: Literal["replay", "follow"] = "replay"
    proc: subprocess.Popen[bytes] | None = None
    argv: tuple[str, ...] = ()
    buffer: bytearray = field(default_factory=bytearray)
    discarding: bool = False
    err_buffer: bytearray = field(default_factory=bytearray)
    err_closed: bool = False  # stderr at EOF: no longer waited on (it would poll readable forever)
    last_stderr: str | None = None
    position: _Position | None = None  # the last record handed out, or where to resume
    committed: _Position | None = None
    since_s: float = 0.0  # wall-clock start of the history when there is no position
    drop_cursor: str | None = None
    failures: int = 0
    spawned_at: float = 0.0
    next_attempt: float | None = None
    reason: str | None = None
    restarts: int = 0
    delivered: int = 0
    run_delivered: int = 0  # by the current journalctl
    malformed: int = 0


class JournalFollower:
    """Follows systemd's messages about ``units`` (and, if asked, their matching output).

    Single-threaded and non-blocking: ``start()``, then in the owner's loop wait for ``fds()``
    (ask again each time: they change when journalctl is restarted) with a timeout of
    ``wake_in()``, then ``read_available()``; ``commit()`` what was processed; ``close()``.
    ``poll(timeout_s)`` does the waiting for simple callers.

    ``output_patterns`` are Python ``re`` patterns in the syntax PCRE2 shares (journalctl
    ``--grep``), matched case-sensitively as ``re`` does without flags (write ``(?i:…)`` for
    caseless) against the raw MESSAGE bytes; a phrase interrupted by an ANSI escape sequence is
    therefore not seen. ``journalctl`` is the argv prefix that runs it (``("nsenter", "-t", pid,
    "-a", "journalctl")`` for a container, ``("journalctl", "--directory=…")`` for files).
    """

    def __init__(  # noqa: PLR0913 - every knob is keyword-only with a safe default
        self,
        units: Sequence[str],
        cursor_path: Path,
        *,
        output_patterns: Sequence[str] = (),
        kernel_patterns: Sequence[str] = (),
        replay_s: float = 600,
        journalctl: Sequence[str] = ("journalctl",),
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        backoff: Sequence[float] = DEFAULT_BACKOFF,
        fields: Sequence[str] = (),
    ) -> None:
        """Check the arguments; nothing runs until ``start()``."""
        if isinstance(units, str) or not units:
            raise ValueError("JournalFollower needs a list of one or more unit names")
        for unit in units:
            if not _UNIT_NAME.fullmatch(unit):
                raise ValueError(f"not a systemd unit name: {unit!r}")
        _check_patterns((*output_patterns, *kernel_patterns))
        if not backoff or any(step < 0 for step in backoff):
            raise ValueError("backoff needs one or more non-negative delays in seconds")
        if not journalctl:
            raise ValueError("journalctl needs at least the program to run")
        if replay_s < 0:
            raise ValueError("replay_s cannot be negative")
        self.units = tuple(units)
        self.cursor_path = cursor_path
        self.output_patterns = tuple(output_patterns)
        self.replay_s = replay_s
        self.journalctl = tuple(journalctl)
        self._clock = clock
        self._wall_clock = wall_clock
        self._backoff = tuple(backoff)
        # Only these fields (and journalctl's __CURSOR/timestamps) when given: less to parse.
        self._fields = tuple(fields)
        self._streams = [_Stream(LIFECYCLE, ())]
        if self.output_patterns:
            grep = "|".join(f"(?:{pattern})" for pattern in self.output_patterns)
            self._streams.append(_Stream(OUTPUT, (f"--grep={grep}", "--case-sensitive=yes")))
        if kernel_patterns:
            grep = "|".join(f"(?:{pattern})" for pattern in kernel_patterns)
            self._streams.append(_Stream(KERNEL, (f"--grep={grep}", "--case-sensitive=yes")))
        self._problems: deque[str] = deque(maxlen=_PROBLEMS_KEPT)
        self._cursor_error: str | None = None
        self._started = False
        self._boot: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Self:
        """Start following."""
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop every journalctl this follower started."""
        self.close()

    def start(self) -> None:
        """Load the saved cursors and start the history run of each stream (once; idempotent)."""
        if self._started:
            return
        self._started = True
        self._boot = self._newest_boot()
        saved = self._load_cursors()
        window_start = max(0.0, self._wall_clock() - self.replay_s)
        for stream in self._streams:
            position = saved.get(stream.name)
            newer = position is not None and (
                position.realtime_us is None or position.realtime_us >= window_start * 1e6
            )
            stream.position = position if newer else None
            stream.committed = position
            stream.since_s = window_start
            stream.phase = "replay"
            self._spawn(stream)

    def close(self) -> None:
        """Stop every journalctl (SIGTERM to its group, SIGKILL after a second) and reap it."""
        for stream in self._streams:
            self._end_process(stream)
            stream.state = "stopped"
            stream.next_attempt = None
        self._started = False

    # -- reading -----------------------------------------------------------------------------

    def fds(self) -> list[int]:
        """File descriptors to wait on for reading (journalctl's stdout and stderr)."""
        found: list[int] = []
        for stream in self._streams:
            proc = stream.proc
            if proc is not None and proc.stdout is not None and proc.stderr is not None:
                found.append(proc.stdout.fileno())
                if not stream.err_closed:
                    found.append(proc.stderr.fileno())
        return found

    def wake_in(self) -> float | None:
        """Seconds until ``read_available()`` has a restart to do; None when only fds matter."""
        due = [s.next_attempt for s in self._streams if s.next_attempt is not None]
        if not due:
            return None
        return max(0.0, min(due) - self._clock())

    def read_available(self) -> list[JournalRecord]:
        """Everything journalctl has printed so far, parsed; never blocks on the journal.

        Also starts again, when due, a journalctl that exited; never raises for what journalctl
        prints. Reaping a journalctl that has just closed its output may wait up to a second.
        """
        records: list[JournalRecord] = []
        for stream in self._streams:
            if stream.next_attempt is not None and self._clock() >= stream.next_attempt:
                stream.restarts += 1
                self._spawn(stream)
            if stream.proc is not None:
                self._read(stream, records)
        return records

    def poll(self, timeout_s: float) -> list[JournalRecord]:
        """Wait up to ``timeout_s`` (real time, shortened to ``wake_in()``) for entries; read."""
        wait_s = timeout_s
        wake = self.wake_in()
        if wake is not None:
            wait_s = min(wait_s, wake)
        fds = self.fds()
        if fds:
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            poller.poll(max(0, math.ceil(wait_s * 1000)))
        elif wait_s > 0:
            time.sleep(wait_s)
        return self.read_available()

    def take_problems(self) -> list[str]:
        """What went wrong since the last call, one log-ready line each (the last 100 kept)."""
        problems = list(self._problems)
        self._problems.clear()
        return problems

    # -- cursors -----------------------------------------------------------------------------

    def commit(self, *records: JournalRecord) -> None:
        """Remember ``records`` as processed (in delivery order) and write the cursor file.

        The file is written only when a cursor changed; a failure to write it is reported in
        ``health().cursor_error`` and ``take_problems()``, not raised (following goes on).
        """
        by_name = {stream.name: stream for stream in self._streams}
        changed = False
        for record in records:
            stream = by_name.get(record.stream)
            if stream is None:
                raise ValueError(f"record from stream {record.stream!r}, not from this follower")
            position = _Position(record.cursor, _realtime_us(record.entry))
            if stream.committed != position:
                stream.committed = position
                changed = True
        if changed:
            self._save_cursors()

    def _save_cursors(self) -> None:
        streams = {
            s.name: {"cursor": s.committed.cursor, "realtime_us": s.committed.realtime_us}
            for s in self._streams
            if s.committed is not None
        }
        try:
            write_json(self.cursor_path, {"format": CURSOR_FILE_FORMAT, "streams": streams})
        except OSError as err:
            self._cursor_error = (
                f"cannot write the journal cursor file {self.cursor_path}: {err.strerror or err}; "
                "after a restart the last "
                f"{self.replay_s:g} s are replayed instead (check the state directory)"
            )
            self._problems.append(self._cursor_error)
        else:
            self._cursor_error = None

    def _load_cursors(self) -> dict[str, _Position]:
        document = read_json(self.cursor_path)
        if document is None:
            if self.cursor_path.exists():
                self._problems.append(
                    f"journal cursor file {self.cursor_path} is unreadable or not JSON; "
                    f"replaying the last {self.replay_s:g} s instead"
                )
            return {}
        streams = document.get("streams") if isinstance(document, dict) else None
        if not isinstance(streams, dict) or document.get("format") != CURSOR_FILE_FORMAT:
            self._problems.append(
                f"journal cursor file {self.cursor_path} has an unknown layout; "
                f"replaying the last {self.replay_s:g} s instead"
            )
            return {}
        positions: dict[str, _Position] = {}
        for name, saved in streams.items():
            cursor = saved.get("cursor") if isinstance(saved, dict) else None
            if not isinstance(cursor, str) or not _CURSOR.fullmatch(cursor):
                self._problems.append(
                    f"journal cursor file {self.cursor_path}: stream {name!r} has no valid "
                    "cursor; replaying its recent history instead"
                )
                continue
            realtime = saved.get("realtime_us")
            positions[str(name)] = _Position(
                cursor,
                realtime if isinstance(realtime, int) else _cursor_realtime_us(cursor),
            )
        return positions

    # -- health ------------------------------------------------------------------------------

    def health(self) -> JournalHealth:
        """Attached, replaying, restarting (with the reason and when) or stopped."""
        now = self._clock()
        streams = tuple(
            StreamHealth(
                stream=s.name,
                state=s.state,
                reason=s.reason if s.state == "restarting" else None,
                next_attempt_in_s=(
                    max(0.0, s.next_attempt - now) if s.next_attempt is not None else None
                ),
                pid=s.proc.pid if s.proc is not None else None,
                argv=s.argv,
                restarts=s.restarts,
                delivered=s.delivered,
                malformed=s.malformed,
            )
            for s in self._streams
        )
        rank: dict[State, int] = {"restarting": 3, "replaying": 2, "attached": 1, "stopped": 0}
        worst = max(streams, key=lambda s: rank[s.state])
        return JournalHealth(
            state=worst.state,
            reason=worst.reason,
            next_attempt_in_s=worst.next_attempt_in_s,
            streams=streams,
            cursor_error=self._cursor_error,
        )

    # -- processes ---------------------------------------------------------------------------

    def _newest_boot(self) -> str | None:
        """The _BOOT_ID of the journal's newest entry (the current boot), or None."""
        argv = [*self.journalctl, "--lines=1", "--output=json", "--output-fields=_BOOT_ID"]
        try:
            done = programs.run([*argv, "--no-pager", "--quiet"], capture_output=True, timeout=10)
            boot = json.loads(done.stdout.splitlines()[-1]).get("_BOOT_ID")
        except (
            OSError,
            subprocess.TimeoutExpired,
            ValueError,
            RecursionError,
            IndexError,
            AttributeError,
        ):
            return None
        return boot if isinstance(boot, str) and _BOOT_ID.fullmatch(boot) else None

    def _argv(self, stream: _Stream) -> tuple[str, ...]:
        argv = [*self.journalctl, "--output=json", "--all", "--no-pager", "--quiet"]
        if self._fields:
            argv.append(f"--output-fields={','.join(self._fields)}")
        # The journal's newest boot by its ID, not the boot ID in /proc: a sandboxed service in
        # a container (ProtectKernelTunables= remounts /proc) sees the host's boot ID there, and
        # --boot, --boot=-0 or a bare --follow then match nothing, silently (systemd 252).
        argv.append(f"--boot={self._boot}" if self._boot else "--boot")
        if stream.phase == "follow":
            argv += ["--follow", "--lines=all"]
        stream.drop_cursor = None
        if stream.position is not None:
            argv.append(f"--cursor={stream.position.cursor}")
            stream.drop_cursor = stream.position.cursor
        else:
            argv.append(f"--since=@{stream.since_s:.6f}")
        argv += stream.filter_args
        if stream.name == LIFECYCLE:
            units = [f"UNIT={unit}" for unit in self.units]
            argv += ["_PID=1", *units, "+", "_SYSTEMD_CGROUP=/init.scope", *units]
        elif stream.name == KERNEL:
            argv.append("_TRANSPORT=kernel")
        else:
            argv += [f"_SYSTEMD_UNIT={unit}" for unit in self.units]
        return tuple(argv)

    def _spawn(self, stream: _Stream) -> None:
        stream.next_attempt = None
        stream.buffer.clear()
        stream.err_buffer.clear()
        stream.err_closed = False
        stream.discarding = False
        stream.last_stderr = None
        stream.run_delivered = 0
        stream.argv = self._argv(stream)
        stream.spawned_at = self._clock()
        try:
            stream.proc = programs.popen(
                stream.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                # Its own session, so its own process group: close() ends the group, with
                # whatever a wrapper forked. (Not process_group=0: Python 3.11+ only.)
                start_new_session=True,
                # Only prctl and getppid run in the child, no lock is taken: safe with threads.
                preexec_fn=_die_with_parent(),
            )
        except OSError as err:
            self._failed(stream, _spawn_error(stream.argv[0], err))
            return
        assert stream.proc.stdout is not None  # noqa: S101 - guaranteed by stdout=PIPE
        assert stream.proc.stderr is not None  # noqa: S101 - guaranteed by stderr=PIPE
        os.set_blocking(stream.proc.stdout.fileno(), False)
        os.set_blocking(stream.proc.stderr.fileno(), False)
        stream.state = "replaying" if stream.phase == "replay" else "attached"
        stream.reason = None

    def _failed(self, stream: _Stream, reason: str) -> None:
        """Schedule the next attempt on the backoff ladder."""
        if self._clock() - stream.spawned_at >= max(self._backoff):
            stream.failures = 0  # it ran long enough: this is a new incident, not a loop
        delay = self._backoff[min(stream.failures, len(self._backoff) - 1)]
        stream.failures += 1
        stream.state = "restarting"
        stream.next_attempt = self._clock() + delay
        stream.reason = reason
        self._problems.append(f"journal {stream.name}: {reason}; next attempt in {delay:g} s")

    def _read(self, stream: _Stream, records: list[JournalRecord]) -> None:
        proc = stream.proc
        assert proc is not None  # noqa: S101 - callers check
        assert proc.stdout is not None  # noqa: S101 - stdout=PIPE
        self._drain_stderr(stream)
        budget = _READ_BUDGET
        while budget > 0:
            try:
                data = os.read(proc.stdout.fileno(), _READ_CHUNK)
            except BlockingIOError:
                return
            if not data:
                self._exited(stream)
                return
            budget -= len(data)
            self._feed(stream, data, records)

    def _drain_stderr(self, stream: _Stream) -> None:
        proc = stream.proc
        assert proc is not None  # noqa: S101 - callers check
        assert proc.stderr is not None  # noqa: S101 - stderr=PIPE
        while True:
            try:
                data = os.read(proc.stderr.fileno(), _READ_CHUNK)
            except BlockingIOError:
                break
            if not data:
                stream.err_closed = True
                break
            stream.err_buffer += data
        *lines, rest = bytes(stream.err_buffer).split(b"\n")
        stream.err_buffer[:] = rest[-_READ_CHUNK:]
        for raw in lines:
            line = raw.decode("utf-8", "replace").strip()
            if line:
                stream.last_stderr = line[:500]
                self._problems.append(f"journal {stream.name}: journalctl says: {line[:500]}")

    def _feed(self, stream: _Stream, data: bytes, records: list[JournalRecord]) -> None:
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            piece = data[start:end]
            start = end + 1
            if stream.discarding:
                stream.discarding = False
                stream.buffer.clear()
                continue
            if stream.buffer:
                stream.buffer += piece
                line = bytes(stream.buffer)
                stream.buffer.clear()
            else:
                line = piece
            self._line(stream, line, records)
        if not stream.discarding:
            stream.buffer += data[start:]
            if len(stream.buffer) > MAX_LINE_BYTES:
                self._malformed(stream, f"line over {MAX_LINE_BYTES} bytes", bytes(stream.buffer))
                stream.buffer.clear()
                stream.discarding = True

    def _line(self, stream: _Stream, line: bytes, records: list[JournalRecord]) -> None:
        if not line.strip():
            return
        try:
            value = json.loads(line)
        except (ValueError, RecursionError) as err:
            self._malformed(stream, f"not JSON: {err}", line)
            return
        if not isinstance(value, dict):
            self._malformed(stream, "not a JSON object", line)
            return
        entry = cast("Entry", value)
        cursor = entry.get("__CURSOR")
        if not isinstance(cursor, str) or not cursor:
            self._malformed(stream, "no __CURSOR", line)
            return
        if stream.drop_cursor is not None:
            drop, stream.drop_cursor = stream.drop_cursor, None
            if cursor == drop:
                return  # --cursor= is inclusive: this one was handed out (or committed) already
        stream.position = _Position(cursor, _realtime_us(entry))
        stream.delivered += 1
        stream.run_delivered += 1
        records.append(JournalRecord(entry, stream.name, live=stream.phase == "follow"))

    def _malformed(self, stream: _Stream, reason: str, line: bytes) -> None:
        stream.malformed += 1
        excerpt = line[:_EXCERPT]
        more = f" (+{len(line) - _EXCERPT} bytes)" if len(line) > _EXCERPT else ""
        self._problems.append(
            f"journal {stream.name}: skipped a line from journalctl ({reason}): {excerpt!r}{more}"
        )

    def _exited(self, stream: _Stream) -> None:
        """The process closed its output: reap it, then follow on or schedule a restart."""
        if stream.buffer and not stream.discarding:
            self._malformed(stream, "cut off when journalctl exited", bytes(stream.buffer))
        stream.buffer.clear()
        returncode = self._end_process(stream)
        # With --grep, journalctl exits 1 when nothing matched, like grep. A real error that
        # printed nothing looks the same here; --follow then fails the same way and says so.
        no_match = returncode == 1 and bool(stream.filter_args) and not stream.run_delivered
        if stream.phase == "replay" and (returncode == 0 or no_match):
            stream.phase = "follow"  # history done; --follow continues after the last entry
            stream.failures = 0
            self._spawn(stream)
            return
        self._failed(stream, f"journalctl {_describe_exit(returncode)}{self._last_words(stream)}")

    @staticmethod
    def _last_words(stream: _Stream) -> str:
        return f": {stream.last_stderr}" if stream.last_stderr else ""

    def _end_process(self, stream: _Stream) -> int | None:
        """End journalctl's process group, reap the leader and close the pipes; its exit status."""
        proc = stream.proc
        if proc is None:
            return None
        returncode = _end_group(proc)
        self._drain_stderr(stream)  # what it said before it went
        stream.proc = None
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        return returncode


def _check_patterns(patterns: Sequence[str]) -> None:
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as err:
            raise ValueError(f"output pattern {pattern!r} is not a regex: {err}") from err


def _die_with_parent() -> Callable[[], None]:
    """What the child runs before exec: ask the kernel for SIGKILL when its parent dies.

    libc is loaded and the parent's PID taken here, in the parent: the child only calls
    prctl(2) and getppid(2). A parent already gone before the prctl is caught by comparing PIDs.
    The kernel ties the signal to the *thread* that forked: the follower is driven from one
    long-lived thread (the daemon's main loop).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def child() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return child


def _end_group(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM the group, give it a second, SIGKILL what is left, reap; the leader's status.

    The leader is only reaped at the end: while it is a zombie its pid (the group id) cannot be
    reused, so the SIGKILL cannot reach a stranger's group.
    """
    if proc.returncode is not None:
        return proc.returncode
    signals.signal_own_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE_S
    while not _has_exited(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    signals.signal_own_group(proc.pid, signal.SIGKILL)
    return proc.wait()


def _has_exited(pid: int) -> bool:
    """Whether our child ``pid`` has exited, without reaping it."""
    try:
        result = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return result is not None


def _describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "ended"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


def _spawn_error(program: str, err: OSError) -> str:
    if isinstance(err, FileNotFoundError):
        return (
            f"cannot run {program!r}: not found (journalctl comes with systemd; install it, "
            "or configure the journalctl command)"
        )
    if isinstance(err, PermissionError):
        return f"cannot run {program!r}: permission denied"
    return f"cannot run {program!r}: {err.strerror or err}"


def _realtime_us(entry: Entry) -> int | None:
    value = entry.get("__REALTIME_TIMESTAMP")
    if isinstance(value, str) and value.isdecimal():
        return int(value)
    cursor = entry.get("__CURSOR")
    return _cursor_realtime_us(cursor) if isinstance(cursor, str) else None


def _cursor_realtime_us(cursor: str) -> int | None:
    """The ``t=`` (realtime, µs, hex) part of a cursor."""
    for part in cursor.split(";"):
        key, _, value = part.partition("=")
        if key == "t":
            with contextlib.suppress(ValueError):
                return int(value, 16)
    return None
