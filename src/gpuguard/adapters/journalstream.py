"""One journalctl stream's bookkeeping, and the parse of what that journalctl prints.

``Stream`` is the follower's mutable record of one journalctl: its process, phase (history,
then live), position and counters. ``feed`` splits its output into lines and each line into a
``JournalRecord``: malformed JSON, non-objects, entries without ``__CURSOR``, lines cut at exit
and lines over ``MAX_LINE_BYTES`` are counted and skipped with a reason, never raised; partial
lines wait for the rest, and the one entry an inclusive ``--cursor=`` repeats is dropped.
``drain_stderr`` keeps journalctl's last words for the restart's reason. This module owns that
parse; journal.py decides when each journalctl runs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, cast

from gpuguard.adapters.journalcursor import Position, realtime_us
from gpuguard.adapters.journalrecords import Entry, JournalRecord, State

if TYPE_CHECKING:
    import subprocess
    from collections import deque

MAX_LINE_BYTES = 16 << 20
"""A JSON line longer than this is dropped (a MESSAGE that size is no lifecycle event)."""
READ_CHUNK = 1 << 16
_EXCERPT = 120


@dataclass(eq=False)
class Stream:
    """Mutable bookkeeping for one journalctl; only the follower (journal.py) keeps one."""

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
    position: Position | None = None  # the last record handed out, or where to resume
    committed: Position | None = None
    since_s: float = 0.0  # wall-clock start of the history when there is no position
    drop_cursor: str | None = None
    failures: int = 0
    spawned_at: float = 0.0
    next_attempt: float | None = None
    reason: str | None = None
    untold: str | None = None  # a problem said only when the restart comes (a SIGTERM's)
    restarts: int = 0
    delivered: int = 0
    run_delivered: int = 0  # by the current journalctl
    malformed: int = 0

    def drain_stderr(self, problems: deque[str]) -> None:
        """Read what journalctl wrote to stderr; each whole line is a problem, the last is kept."""
        proc = self.proc
        assert proc is not None  # noqa: S101 - callers check
        assert proc.stderr is not None  # noqa: S101 - stderr=PIPE
        while True:
            try:
                data = os.read(proc.stderr.fileno(), READ_CHUNK)
            except BlockingIOError:
                break
            if not data:
                self.err_closed = True
                break
            self.err_buffer += data
        *lines, rest = bytes(self.err_buffer).split(b"\n")
        self.err_buffer[:] = rest[-READ_CHUNK:]
        for raw in lines:
            line = raw.decode("utf-8", "replace").strip()
            if line:
                self.last_stderr = line[:500]
                problems.append(f"journal {self.name}: journalctl says: {line[:500]}")

    def feed(self, data: bytes, records: list[JournalRecord], problems: deque[str]) -> None:
        """Split journalctl's output into lines; a record for each entry, a problem for the rest."""
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            piece = data[start:end]
            start = end + 1
            if self.discarding:
                self.discarding = False
                self.buffer.clear()
                continue
            if self.buffer:
                self.buffer += piece
                line = bytes(self.buffer)
                self.buffer.clear()
            else:
                line = piece
            self._line(line, records, problems)
        if not self.discarding:
            self.buffer += data[start:]
            if len(self.buffer) > MAX_LINE_BYTES:
                self.skip(f"line over {MAX_LINE_BYTES} bytes", bytes(self.buffer), problems)
                self.buffer.clear()
                self.discarding = True

    def _line(self, line: bytes, records: list[JournalRecord], problems: deque[str]) -> None:
        if not line.strip():
            return
        try:
            value = json.loads(line)
        except (ValueError, RecursionError) as err:
            self.skip(f"not JSON: {err}", line, problems)
            return
        if not isinstance(value, dict):
            self.skip("not a JSON object", line, problems)
            return
        entry = cast("Entry", value)
        cursor = entry.get("__CURSOR")
        if not isinstance(cursor, str) or not cursor:
            self.skip("no __CURSOR", line, problems)
            return
        if self.drop_cursor is not None:
            drop, self.drop_cursor = self.drop_cursor, None
            if cursor == drop:
                return  # --cursor= is inclusive: this one was handed out (or committed) already
        self.position = Position(cursor, realtime_us(entry))
        self.delivered += 1
        self.run_delivered += 1
        records.append(JournalRecord(entry, self.name, live=self.phase == "follow"))

    def skip(self, reason: str, line: bytes, problems: deque[str]) -> None:
        """Count a line not handed out and say why, with an excerpt."""
        self.malformed += 1
        excerpt = line[:_EXCERPT]
        more = f" (+{len(line) - _EXCERPT} bytes)" if len(line) > _EXCERPT else ""
        problems.append(
            f"journal {self.name}: skipped a line from journalctl ({reason}): {excerpt!r}{more}"
        )
