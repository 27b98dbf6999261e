"""``gpuguard explain``: read one unit's incident from the journal and tell it (the adapter).

Four ``journalctl`` runs (through ``gpuguard.programs``: absolute path, fixed environment), each
filtered by journalctl so that Python parses only what can become a row: PID 1 about the unit;
the unit's output matching a start-failure signature or the gate's verdict (``--grep``, so a
chatty server's request log never reaches Python); gpuguard's own units; kernel Xid lines. Trust
is judged by ``gpuguard.timeline`` from journald's fields, never from these filters. Each run is
bounded in time and in entries (the newest ``MAX_ENTRIES``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import TYPE_CHECKING, Final

from gpuguard import programs, timeline
from gpuguard.detector import LoopSettings
from gpuguard.escaping import escape
from gpuguard.events import FIELDS_READ, GPU_OOM_REGEX
from gpuguard.recovery import RecoveryLimits
from gpuguard.xidevents import MARKER

if TYPE_CHECKING:
    from gpuguard.config import Settings

MAX_ENTRIES: Final = 20_000
"""Entries read per journalctl run: the newest ones when there are more."""
_TIMEOUT_S: Final = 60.0
_UNIT_NAME = re.compile(r"[A-Za-z0-9:_.\\@-]{1,255}")
# What journalctl accepts for --since ("2026-12-01 05:27", "-1h", "today", "@1764567000"),
# and nothing that could read as another option.
_SINCE = re.compile(r"[0-9A-Za-z@:. +-]{1,64}")
_FIELDS: Final = ",".join(FIELDS_READ)
EX_USAGE: Final = 64
EX_UNAVAILABLE: Final = 69


def queries(unit: str, since: str | None) -> list[list[str]]:
    """The journalctl command lines, one per source (pure; tested as such)."""
    base = [
        "journalctl",
        "--output=json",
        "--all",
        "--no-pager",
        "--quiet",
        f"--output-fields={_FIELDS}",
        f"--lines={MAX_ENTRIES}",
    ]
    base.append(f"--since={since}" if since else "--boot")
    units = [f"UNIT={unit}"]
    grep_unit = f"{GPU_OOM_REGEX}|(?:{re.escape(timeline.GATE_LINE_PREFIX)})"
    return [
        [*base, "_PID=1", *units, "+", "_SYSTEMD_CGROUP=/init.scope", *units],
        [*base, f"--grep={grep_unit}", "--case-sensitive=yes", f"_SYSTEMD_UNIT={unit}"],
        [*base, f"--unit={timeline.DAEMON_UNIT}", f"--unit={timeline.GATE_SERVER_PREFIX}*.service"],
        [*base, f"--grep={re.escape(MARKER)}", "--case-sensitive=yes", "_TRANSPORT=kernel"],
    ]


def parse_lines(out: bytes) -> list[dict[str, object]]:
    """The JSON lines journalctl printed, as objects; what is not a JSON object is skipped."""
    entries: list[dict[str, object]] = []
    for line in out.splitlines():
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(value, dict):
            entries.append(value)
    return entries


def read(unit: str, since: str | None) -> tuple[list[dict[str, object]], list[str]]:
    """Every entry the queries find, and a problem line for each journalctl that failed."""
    entries: list[dict[str, object]] = []
    problems: list[str] = []
    for command in queries(unit, since):
        try:
            done = programs.run(command, capture_output=True, timeout=_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as err:
            problems.append(f"journalctl: {escape(str(err), 300)}")
            continue
        grep = any(arg.startswith("--grep=") for arg in command)
        # With --grep, journalctl exits 1 when nothing matched, as grep does.
        if done.returncode != 0 and not (grep and done.returncode == 1 and not done.stdout):
            last = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:]
            problems.append(
                f"journalctl exited {done.returncode}: {escape(last[0], 300) if last else ''}"
            )
        entries += parse_lines(done.stdout)
    return entries, problems


def main(settings: Settings, unit: str | None, since: str | None, *, as_json: bool) -> int:
    """Print the timeline; 0 when something was found, 1 when the journal had nothing."""
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
    entries, problems = read(unit, since)
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
