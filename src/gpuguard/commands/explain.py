"""``gpuguard explain``: read one unit's incident from the journal and tell it.

The journal is read by ``adapters.journalquery``; the timeline is built and shown by the pure
``core.timeline``, with the daemon's own loop and recovery settings for the replay.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuguard.adapters import doctorio, journalquery, releaselog
from gpuguard.commands.output import Said
from gpuguard.core import timeline
from gpuguard.core.escaping import escape
from gpuguard.core.exits import EX_UNAVAILABLE, EX_USAGE
from gpuguard.core.prevented import load_cost_s
from gpuguard.core.unitname import UNIT_NAME

if TYPE_CHECKING:
    from gpuguard.config import Settings
    from gpuguard.core.timeline import Timeline

# What journalctl accepts for --since ("2026-12-01 05:27", "-1h", "today", "@1764567000"),
# and nothing else: the value is one argument (--since=…), never a shell word.
_SINCE = re.compile(r"[0-9A-Za-z@:. +-]{1,64}")


@dataclass(frozen=True, slots=True)
class Explained:
    """One unit's incident as the journal told it, and what stood in the way of reading it."""

    timeline: Timeline
    since: str | None
    notices: tuple[str, ...]
    """journalctl's problems, and the hint to read as root when nothing was found."""

    @property
    def exit_status(self) -> int:
        """0 when the journal had something about the unit, else 1."""
        return 0 if self.timeline.rows else 1

    def to_text(self) -> str:
        """The timeline as ``explain`` prints it."""
        return timeline.render_text(self.timeline, since=self.since)

    def to_json(self) -> dict[str, Any]:
        """``explain --json`` (docs/explain.md)."""
        return timeline.to_json(self.timeline, since=self.since)


def run(settings: Settings, unit: str | None, since: str | None) -> Explained | Said:
    """Read the unit's journal and build its timeline; a usage error or a failed read says so."""
    if unit is None:
        if len(settings.units) != 1:
            return Said(
                EX_USAGE,
                notices=(
                    (
                        "gpuguard explain: name the unit with --unit (the configuration watches "
                        f"{len(settings.units)} units)"
                    ),
                ),
            )
        unit = next(iter(settings.units))
    if not UNIT_NAME.fullmatch(unit) or unit.startswith("-"):
        return Said(EX_USAGE, notices=(f"gpuguard explain: not a unit name: {escape(unit, 300)}",))
    if since is not None and not _SINCE.fullmatch(since):
        return Said(
            EX_USAGE,
            notices=(
                (
                    f"gpuguard explain: --since {escape(since, 80)}: use journalctl's forms "
                    "('2026-12-01 05:00', 'today', --since=-2h, '@1764567000')"
                ),
            ),
        )
    entries, problems = journalquery.read(unit, since)
    notices = [f"gpuguard explain: {problem}" for problem in problems]
    if problems and not entries:
        return Said(EX_UNAVAILABLE, notices=tuple(notices))
    found = timeline.build(
        entries,
        unit,
        loop=settings.daemon.loop(),
        limits=settings.daemon.recovery_limits(),
        releases=releaselog.read(settings.runtime_dir),
        server=settings.units[unit].server if unit in settings.units else None,
    )
    found = timeline.with_prevented(
        found, load_cost_s(doctorio.learned_starts(settings.state_dir, unit).ready_s)
    )
    if not found.rows and os.geteuid() != 0:
        # journalctl --quiet says nothing when it may not read the system journal.
        notices.append(
            "gpuguard explain: nothing found; run as root (or in group systemd-journal) to "
            "read systemd's messages"
        )
    return Explained(found, since, tuple(notices))
