"""``gpuguard explain``: read one unit's incident from the journal and tell it.

The journal is read by ``adapters.journalquery``; the timeline is built and shown by the pure
``core.timeline``, with the daemon's own loop and recovery settings for the replay.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import TYPE_CHECKING, Final

from gpuguard.commands.exits import EX_USAGE

if TYPE_CHECKING:
    from gpuguard.config import Settings

EX_UNAVAILABLE: Final = 69
_UNIT_NAME = re.compile(r"[A-Za-z0-9:_.\\@-]{1,255}")
# What journalctl accepts for --since ("2026-12-01 05:27", "-1h", "today", "@1764567000"),
# and nothing else: the value is one argument (--since=…), never a shell word.
_SINCE = re.compile(r"[0-9A-Za-z@:. +-]{1,64}")


def run(settings: Settings, unit: str | None, since: str | None, *, as_json: bool) -> int:
    """Print the timeline; 0 when something was found, 1 when the journal had nothing."""
    from gpuguard.adapters import journalquery  # noqa: PLC0415 - see the package doc
    from gpuguard.core import timeline  # noqa: PLC0415
    from gpuguard.core.detector import LoopSettings  # noqa: PLC0415
    from gpuguard.core.escaping import escape  # noqa: PLC0415
    from gpuguard.core.recovery import RecoveryLimits  # noqa: PLC0415

    if unit is None:
        if len(settings.units) != 1:
            sys.stderr.write(
                "gpuguard explain: name the unit with --unit (the configuration watches "
                f"{len(settings.units)} units)\n"
            )
            return EX_USAGE
        unit = next(iter(settings.units))
    if not _UNIT_NAME.fullmatch(unit) or unit.startswith("-"):
        sys.stderr.write(f"gpuguard explain: not a unit name: {escape(unit, 300)}\n")
        return EX_USAGE
    if since is not None and not _SINCE.fullmatch(since):
        sys.stderr.write(
            f"gpuguard explain: --since {escape(since, 80)}: use journalctl's forms "
            "('2026-12-01 05:00', 'today', --since=-2h, '@1764567000')\n"
        )
        return EX_USAGE
    entries, problems = journalquery.read(unit, since)
    for problem in problems:
        sys.stderr.write(f"gpuguard explain: {problem}\n")
    if problems and not entries:
        return EX_UNAVAILABLE
    daemon = settings.daemon
    found = timeline.build(
        entries,
        unit,
        loop=LoopSettings(
            min_starts=daemon.loop_min_starts,
            window_s=daemon.loop_window_s,
            restart_counter_threshold=daemon.restart_counter_threshold,
            stable_s=daemon.stable_s,
        ),
        limits=RecoveryLimits(
            max_attempts=daemon.recovery_max_attempts,
            backoff_s=daemon.recovery_backoff_s,
            stable_s=daemon.stable_s,
        ),
    )
    if not found.rows and os.geteuid() != 0:
        # journalctl --quiet says nothing when it may not read the system journal.
        sys.stderr.write(
            "gpuguard explain: nothing found; run as root (or in group systemd-journal) to "
            "read systemd's messages\n"
        )
    if as_json:
        sys.stdout.write(json.dumps(timeline.to_json(found, since=since), indent=2) + "\n")
    else:
        sys.stdout.write(timeline.render_text(found, since=since))
    return 0 if found.rows else 1
