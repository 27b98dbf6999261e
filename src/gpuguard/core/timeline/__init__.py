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

from dataclasses import replace
from typing import TYPE_CHECKING

from gpuguard.core.escaping import escape
from gpuguard.core.releaselog import row_text, summarize
from gpuguard.core.timeline.model import (
    DAEMON_UNIT,
    GATE_LINE_PREFIX,
    GATE_SERVER_PREFIX,
    GATE_SERVER_UNIT,
    GPUGUARD,
    KERNEL,
    SYSTEMD,
    TEXT_LIMIT,
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
from gpuguard.core.timeline.story import prevented_in, tell

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from gpuguard.core.detector import LoopSettings
    from gpuguard.core.recovery import RecoveryLimits
    from gpuguard.core.releaselog import Logged


def build(  # noqa: PLR0913 - the journal, and what the configuration says of it
    entries: Iterable[Mapping[str, object]],
    unit: str,
    *,
    loop: LoopSettings | None = None,
    limits: RecoveryLimits | None = None,
    releases: Iterable[Logged] = (),
    server: str | None = None,
) -> Timeline:
    """The timeline of ``unit`` from journal entries in any order (journalctl's JSON objects).

    ``loop`` and ``limits`` are the daemon's settings, used only to say what gpuguard would
    have done when it left no line itself. ``releases``: the release log (core.releaselog);
    the unit's releases within the journal read join the rows where the memory went.
    ``server``: the unit's configured server; its ready line tells a run that came up and then
    failed (a crash) from a failed start.
    """
    acc = Acc(server=server)
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
    story = tell(rows, events, tuple(text for _, text in would), replayed, holders, ready=acc.ready)
    shown = _releases_within(releases, unit, rows)
    if shown:
        rows += [
            Row(
                r.released_monotonic_s or 0.0,
                r.released_wall_s,
                r.boot_id,
                GPUGUARD,
                "gpu-released",
                escape(row_text(r), TEXT_LIMIT),
            )
            for r in shown
        ]
        rows.sort(key=chronological(rows))
        told = tuple(escape(g.in_words(), TEXT_LIMIT) for g in summarize(shown))
        story = replace(story, released=told)
    return Timeline(unit, tuple(rows), story, gpuguard_seen)


def _releases_within(releases: Iterable[Logged], unit: str, rows: list[Row]) -> list[Logged]:
    """The unit's logged releases at a moment the journal read covers (its boot, not before).

    The log keeps its newest records whatever ``--since`` says: a release before the first row
    of its boot, or of a boot the journal read has no row of, is not this incident's.
    """
    first: dict[str | None, float] = {}
    for row in rows:
        first[row.boot_id] = min(first.get(row.boot_id, row.monotonic_s), row.monotonic_s)
    return [
        r
        for r in releases
        if r.unit == unit
        and r.boot_id is not None
        and r.released_monotonic_s is not None
        and r.boot_id in first
        and r.released_monotonic_s >= first[r.boot_id]
    ]


def with_prevented(found: Timeline, each_s: float | None) -> Timeline:
    """The timeline with what gpuguard saved in it (``each_s``: one start's loading, or None)."""
    return replace(
        found, story=replace(found.story, prevented=prevented_in(list(found.rows), each_s))
    )


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
    "with_prevented",
]
