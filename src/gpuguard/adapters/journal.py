"""The journal follower: the daemon's long-running ``journalctl`` processes, as subprocesses.

It follows, for the watched units, systemd's own messages about them and (when asked) the few
lines of their output that match given patterns, and hands them out as plain dicts, exactly as
``journalctl --output=json --all`` printed them (every field, or only the ``fields`` the owner
names; trust is judged by the parser from ``_PID``/``_UID``/``_SYSTEMD_CGROUP``, never here).
What is at risk: an event seen twice or never (a detector miscounts a restart loop), history
mistaken for news (an action on a loop that is long over), a follower that dies quietly, and
request-log noise parsed in Python. Its parts: the values it hands out (journalrecords.py), one
stream's parse (journalstream.py), the cursor file (journalcursor.py), one journalctl process
(journalproc.py); this module decides when each journalctl runs and what it is asked. The
one-shot reads of history are not the follower's: journalquery.py (``explain``), systemd.py (the
invocations PID 1 logged for a unit) and doctorio.py (``doctor``) run their own ``journalctl``.

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
  caller ``commit()``s records after processing them; journalcursor.py writes one ``__CURSOR`` per
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
  exit and lines over ``journalstream.MAX_LINE_BYTES`` are counted and skipped with a reason
  (``take_problems()``), never raised; partial lines wait for the rest; journalctl's stderr is
  drained (a full pipe would stall it) and its last line becomes the reason when it exits. A
  missing journalctl is a ``restarting`` state with a reason, not an exception.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections import deque
from typing import TYPE_CHECKING

from typing_extensions import Self

from gpuguard.adapters import journalcursor, programs
from gpuguard.adapters.journalcursor import Position, realtime_us
from gpuguard.adapters.journalproc import describe_exit, die_with_parent, end_group, spawn_error
from gpuguard.adapters.journalrecords import (
    KERNEL,
    LIFECYCLE,
    OUTPUT,
    JournalHealth,
    JournalRecord,
    State,
    StreamHealth,
)
from gpuguard.adapters.journalstream import READ_CHUNK, Stream
from gpuguard.core.unitname import UNIT_NAME

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path
    from types import TracebackType

__all__ = [
    "KERNEL",
    "LIFECYCLE",
    "OUTPUT",
    "JournalFollower",
    "JournalHealth",
    "JournalRecord",
    "StreamHealth",
]

DEFAULT_BACKOFF: tuple[float, ...] = (1, 2, 5, 10, 30)

_READ_BUDGET = 4 << 20  # bytes per stream per read_available(), so one stream cannot starve a loop
_PROBLEMS_KEPT = 100
_BOOT_ID = re.compile(r"[0-9a-f]{32}")


class JournalFollower:
    """Follows systemd's messages about ``units`` (and, if asked, their matching output).

    Single-threaded and non-blocking: ``start()``, then in the owner's loop wait for ``fds()``
    (ask again each time: they change when journalctl is restarted) with a timeout of
    ``wake_in()``, then ``read_available()``; ``commit()`` what was processed; ``close()``.

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
            if not UNIT_NAME.fullmatch(unit):
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
        self._streams = [Stream(LIFECYCLE, ())]
        if self.output_patterns:
            grep = "|".join(f"(?:{pattern})" for pattern in self.output_patterns)
            self._streams.append(Stream(OUTPUT, (f"--grep={grep}", "--case-sensitive=yes")))
        if kernel_patterns:
            grep = "|".join(f"(?:{pattern})" for pattern in kernel_patterns)
            self._streams.append(Stream(KERNEL, (f"--grep={grep}", "--case-sensitive=yes")))
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
        saved = journalcursor.load(self.cursor_path, self.replay_s, self._problems.append)
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
                if stream.untold is not None:
                    self._problems.append(stream.untold)
                    stream.untold = None
                stream.restarts += 1
                self._spawn(stream)
            if stream.proc is not None:
                self._read(stream, records)
        return records

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
            position = Position(record.cursor, realtime_us(record.entry))
            if stream.committed != position:
                stream.committed = position
                changed = True
        if changed:
            self._save_cursors()

    def _save_cursors(self) -> None:
        positions = {s.name: s.committed for s in self._streams if s.committed is not None}
        self._cursor_error = journalcursor.save(self.cursor_path, positions, self.replay_s)
        if self._cursor_error is not None:
            self._problems.append(self._cursor_error)

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

    def _argv(self, stream: Stream) -> tuple[str, ...]:
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

    def _spawn(self, stream: Stream) -> None:
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
                preexec_fn=die_with_parent(),
            )
        except OSError as err:
            self._failed(stream, spawn_error(stream.argv[0], err))
            return
        assert stream.proc.stdout is not None  # noqa: S101 - guaranteed by stdout=PIPE
        assert stream.proc.stderr is not None  # noqa: S101 - guaranteed by stderr=PIPE
        os.set_blocking(stream.proc.stdout.fileno(), False)
        os.set_blocking(stream.proc.stderr.fileno(), False)
        stream.state = "replaying" if stream.phase == "replay" else "attached"
        stream.reason = None

    def _failed(self, stream: Stream, reason: str, *, tell: bool = True) -> None:
        """Schedule the next attempt on the backoff ladder; ``tell``: say it now, else then."""
        if self._clock() - stream.spawned_at >= max(self._backoff):
            stream.failures = 0  # it ran long enough: this is a new incident, not a loop
        delay = self._backoff[min(stream.failures, len(self._backoff) - 1)]
        stream.failures += 1
        stream.state = "restarting"
        stream.next_attempt = self._clock() + delay
        stream.reason = reason
        problem = f"journal {stream.name}: {reason}; next attempt in {delay:g} s"
        if tell:
            self._problems.append(problem)
        else:
            stream.untold = problem

    def _read(self, stream: Stream, records: list[JournalRecord]) -> None:
        proc = stream.proc
        assert proc is not None  # noqa: S101 - callers check
        assert proc.stdout is not None  # noqa: S101 - stdout=PIPE
        stream.drain_stderr(self._problems)
        budget = _READ_BUDGET
        while budget > 0:
            try:
                data = os.read(proc.stdout.fileno(), READ_CHUNK)
            except BlockingIOError:
                return
            if not data:
                self._exited(stream)
                return
            budget -= len(data)
            stream.feed(data, records, self._problems)

    def _exited(self, stream: Stream) -> None:
        """The process closed its output: reap it, then follow on or schedule a restart."""
        if stream.buffer and not stream.discarding:
            stream.skip("cut off when journalctl exited", bytes(stream.buffer), self._problems)
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
        # SIGTERM is what systemd sends the whole cgroup when gpuguard.service stops: journalctl
        # may die of it a moment before the daemon hears its own. Said when the restart comes,
        # so a stop says nothing; a SIGTERM from anyone else is still said, a backoff later.
        self._failed(
            stream,
            f"journalctl {describe_exit(returncode)}{self._last_words(stream)}",
            tell=returncode != -signal.SIGTERM,
        )

    @staticmethod
    def _last_words(stream: Stream) -> str:
        return f": {stream.last_stderr}" if stream.last_stderr else ""

    def _end_process(self, stream: Stream) -> int | None:
        """End journalctl's process group, reap the leader and close the pipes; its exit status."""
        proc = stream.proc
        if proc is None:
            return None
        returncode = end_group(proc)
        stream.drain_stderr(self._problems)  # what it said before it went
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
