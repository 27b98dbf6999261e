"""The journal follower's cursor file: where each stream resumes after a restart.

252's ``--cursor-file`` is never written under ``--follow``, and 252's ``--after-cursor`` skips
one entry when the cursor's entry does not match the filter. So the follower's owner
``commit()``s records after processing them, and ``save`` writes one ``__CURSOR`` per stream
(JSON, temp file + rename); ``load`` reads them back, and a cursor not in journalctl's syntax is
never passed on. This module owns that file's format and a position's realtime stamp.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuguard.adapters.state import read_json, write_json

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from gpuguard.adapters.journalrecords import Entry

CURSOR_FILE_FORMAT = 1
# A journal cursor: `s=…;i=…;b=…;m=…;t=…;x=…` (lower-case hex values); anything else makes
# journalctl fail with "Failed to seek to cursor", so it is never passed on.
_CURSOR = re.compile(r"[a-z]=[0-9a-f]{1,64}(?:;[a-z]=[0-9a-f]{1,64}){0,15}")


@dataclass(frozen=True, slots=True)
class Position:
    """Where a stream is: an entry's cursor, and its realtime stamp (µs) to judge its age."""

    cursor: str
    realtime_us: int | None


def load(path: Path, replay_s: float, say: Callable[[str], None]) -> dict[str, Position]:
    """The saved position of each stream; what is unreadable is said (``say``) and left out."""
    document = read_json(path)
    if document is None:
        if path.exists():
            say(
                f"journal cursor file {path} is unreadable or not JSON; "
                f"replaying the last {replay_s:g} s instead"
            )
        return {}
    streams = document.get("streams") if isinstance(document, dict) else None
    if not isinstance(streams, dict) or document.get("format") != CURSOR_FILE_FORMAT:
        say(
            f"journal cursor file {path} has an unknown layout; "
            f"replaying the last {replay_s:g} s instead"
        )
        return {}
    positions: dict[str, Position] = {}
    for name, saved in streams.items():
        cursor = saved.get("cursor") if isinstance(saved, dict) else None
        if not isinstance(cursor, str) or not _CURSOR.fullmatch(cursor):
            say(
                f"journal cursor file {path}: stream {name!r} has no valid "
                "cursor; replaying its recent history instead"
            )
            continue
        realtime = saved.get("realtime_us")
        positions[str(name)] = Position(
            cursor,
            realtime if isinstance(realtime, int) else cursor_realtime_us(cursor),
        )
    return positions


def save(path: Path, positions: dict[str, Position], replay_s: float) -> str | None:
    """Write each stream's committed position; the problem, said for people, if it cannot be."""
    streams = {
        name: {"cursor": position.cursor, "realtime_us": position.realtime_us}
        for name, position in positions.items()
    }
    try:
        write_json(path, {"format": CURSOR_FILE_FORMAT, "streams": streams})
    except OSError as err:
        return (
            f"cannot write the journal cursor file {path}: {err.strerror or err}; "
            "after a restart the last "
            f"{replay_s:g} s are replayed instead (check the state directory)"
        )
    return None


def realtime_us(entry: Entry) -> int | None:
    """An entry's ``__REALTIME_TIMESTAMP`` (µs), else its cursor's ``t=``; None if neither."""
    value = entry.get("__REALTIME_TIMESTAMP")
    if isinstance(value, str) and value.isdecimal():
        return int(value)
    cursor = entry.get("__CURSOR")
    return cursor_realtime_us(cursor) if isinstance(cursor, str) else None


def cursor_realtime_us(cursor: str) -> int | None:
    """The ``t=`` (realtime, µs, hex) part of a cursor."""
    for part in cursor.split(";"):
        key, _, value = part.partition("=")
        if key == "t":
            with contextlib.suppress(ValueError):
                return int(value, 16)
    return None
