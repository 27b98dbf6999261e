"""One-shot journal queries for ``gpuguard explain``: each source of an incident, read once.

Four ``journalctl`` runs (through ``adapters.programs``: absolute path, fixed environment), each
filtered by journalctl so that Python parses only what can become a row: PID 1 about the unit;
the unit's output matching a start-failure signature or the gate's verdict (``--grep``, so a
chatty server's request log never reaches Python); gpuguard's own units; kernel Xid lines. Trust
is judged by ``core.timeline`` from journald's fields, never from these filters. Each run is
bounded in time and in entries (the newest ``MAX_ENTRIES``). The follower the daemon uses is
``adapters.journal``; this one reads history only.
"""

from __future__ import annotations

import json
import re
import subprocess
from typing import Final

from gpuguard.adapters import programs
from gpuguard.core import timeline
from gpuguard.core.escaping import escape
from gpuguard.core.events import FIELDS_READ, GPU_OOM_REGEX
from gpuguard.core.xidevents import MARKER

MAX_ENTRIES: Final = 20_000
"""Entries read per journalctl run: the newest ones when there are more."""
_TIMEOUT_S: Final = 60.0
_FIELDS: Final = ",".join(FIELDS_READ)


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
