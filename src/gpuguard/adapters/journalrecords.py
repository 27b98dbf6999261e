"""What the journal follower hands out: its streams' records, and how each stream is doing.

A ``JournalRecord`` is one entry exactly as ``journalctl --output=json --all`` printed it, the
stream it came from (``LIFECYCLE``, ``OUTPUT``, ``KERNEL``) and whether it is live or history;
``JournalHealth`` and ``StreamHealth`` say whether each journalctl is attached, replaying or
restarting, and why. This module owns those values (journal.py re-exports them), so a reader of
records needs nothing of the follower itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

LIFECYCLE = "lifecycle"
"""PID 1's messages about the watched units."""
OUTPUT = "output"
"""The watched units' own output lines that match ``output_patterns``."""
KERNEL = "kernel"
"""Kernel messages (``_TRANSPORT=kernel``, set by journald only) that match ``kernel_patterns``."""

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
