"""One unit's incident, told from its journal: entries in, a timeline out (pure: no I/O, no clock).

``gpuguard explain`` works after the fact, from the journal alone: ``reading`` turns each entry
into a row only as far as who wrote it lets it speak (systemd, the unit, gpuguard, the kernel),
``replay`` runs the daemon's own detector and planner over systemd's events and compares them
with the verdicts the daemon logged, ``story`` sums the rows up in the sentences people ask for
first, ``render`` prints the table or the JSON document, and ``model`` holds the records they
share. ``build`` is the one way in. Time is the journal's per-boot monotonic stamp; rows of
several boots are told boot by boot, each in its own order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuguard.core.timeline.model import (
    DAEMON_UNIT,
    GATE_LINE_PREFIX,
    GATE_SERVER_PREFIX,
    GATE_SERVER_UNIT,
    GPUGUARD,
    KERNEL,
    SYSTEMD,
    UNIT,
    WOULD,
    Row,
    Story,
    Timeline,
    chronological,
)
from gpuguard.core.timeline.reading import Acc, read_entry
from gpuguard.core.timeline.render import JSON_FORMAT, render_text, to_json
from gpuguard.core.timeline.replay import holders_seen, replay_journal
from gpuguard.core.timeline.story import tell

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from gpuguard.core.detector import LoopSettings
    from gpuguard.core.recovery import RecoveryLimits


def build(
    entries: Iterable[Mapping[str, object]],
    unit: str,
    *,
    loop: LoopSettings | None = None,
    limits: RecoveryLimits | None = None,
) -> Timeline:
    """The timeline of ``unit`` from journal entries in any order (journalctl's JSON objects).

    ``loop`` and ``limits`` are the daemon's settings, used only to say what gpuguard would
    have done when it left no line itself.
    """
    acc = Acc()
    cursors: set[str] = set()
    for entry in entries:
        cursor = entry.get("__CURSOR") if isinstance(entry, dict) else None
        if isinstance(cursor, str):
            if cursor in cursors:
                continue  # two queries that both match an entry print it twice
            cursors.add(cursor)
        read_entry(entry, unit, acc)
    rows = sorted(acc.rows, key=chronological(acc.rows))
    events = sorted(acc.events, key=chronological(acc.events))
    gpuguard_seen = any(row.source == GPUGUARD for row in rows)
    holders = holders_seen(rows, events, acc.named)
    replayed = replay_journal(
        events, unit, loop, limits, holders=holders, daemon=acc.daemon, rows=rows
    )
    would = () if gpuguard_seen else replayed.would
    rows += [row for row, _ in would]
    rows.sort(key=chronological(rows))
    story = tell(rows, events, tuple(text for _, text in would), replayed, holders)
    return Timeline(unit, tuple(rows), story, gpuguard_seen)


__all__ = [
    "DAEMON_UNIT",
    "GATE_LINE_PREFIX",
    "GATE_SERVER_PREFIX",
    "GATE_SERVER_UNIT",
    "GPUGUARD",
    "JSON_FORMAT",
    "KERNEL",
    "SYSTEMD",
    "UNIT",
    "WOULD",
    "Row",
    "Story",
    "Timeline",
    "build",
    "render_text",
    "to_json",
]
