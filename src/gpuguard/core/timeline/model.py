"""The timeline's records (rows, the story, the timeline) and the small rules its modules share.

A row says when (the journal's monotonic and wall-clock stamps, its boot), who wrote it (one of
the sources below, or ``would``: gpuguard's replayed decision, not a journal line), what kind of
thing it is, and its text, already escaped and cut; ``DaemonSaid`` is a verdict the daemon logged,
kept for the replay to compare with. ``chronological`` orders rows of several boots boot by boot
(by each boot's first wall-clock stamp), each by its monotonic clock.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Final

from gpuguard.core.escaping import escape

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from gpuguard.core.events import (
        UnitEvent,
    )

SYSTEMD: Final = "systemd"
UNIT: Final = "unit"
GPUGUARD: Final = "gpuguard"
KERNEL: Final = "kernel"
WOULD: Final = "would"
"""Sources of a row: who wrote it (``would``: gpuguard's replayed decision, not a journal line)."""

DAEMON_UNIT: Final = "gpuguard.service"
GATE_SERVER_UNIT: Final = "gpuguard-gate.service"
#: The per-connection instances that served requests before 0.1.0-3 (an older journal).
GATE_SERVER_PREFIX: Final = "gpuguard-gate@"
GATE_LINE_PREFIX: Final = "gpuguard gate: "
TEXT_LIMIT: Final = 300
_SHORT_ID: Final = 8


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the story: when, who said it, what kind of thing, and the escaped text."""

    monotonic_s: float
    realtime_s: float | None
    boot_id: str | None
    source: str
    kind: str
    text: str
    run: str | None = None
    """The invocation ID the row belongs to, when the entry names one."""


@dataclass(frozen=True, slots=True)
class Story:
    """The incident in a few sentences, built from the rows: what people ask first."""

    stop_timeouts: tuple[str, ...]
    sigkilled: tuple[str, ...]
    survivors: tuple[str, ...]
    """One line per distinct PID systemd or gpuguard saw outlive a run (a PID systemd names
    three times is one line), then gpuguard's sweep summaries, which name no PID."""
    failed_starts: tuple[str, ...]
    gpuguard: tuple[str, ...]
    would: tuple[str, ...]
    healthy: str | None
    start_limit: tuple[str, ...] = ()
    """Each start-limit hit: a loop systemd ended, and what to do."""
    operator: tuple[str, ...] = ()
    """Stop jobs (an operator's ``stop`` or ``restart``, a conflict, gpuguard): never a loop."""
    findings: tuple[str, ...] = ()
    """What is no loop but worth a look: left-overs found at a start."""
    survivor_pids: int = 0
    """How many distinct PIDs systemd or gpuguard named in ``survivors`` (not its PID-less
    lines, nor the PIDs only the server's own out-of-memory lines name: its word)."""
    verdict: str = ""
    """The detector's verdict on the newest entries, replayed (the daemon's own code)."""
    disagreements: tuple[str, ...] = ()
    """Where a verdict the daemon logged differs from the replay at the same moment, and why."""
    released: tuple[str, ...] = ()
    """Per GPU, how long it took to release the memory of the holders reaped for the unit
    (the release log's records on the timeline; core.releaselog, as status says it)."""
    prevented: str | None = None
    """The failed starts gpuguard prevented in these entries, by core.prevented's rule: each
    gate request that exited 0 after its reaper ended a holder, each recovery that restarted."""
    crashes: tuple[str, ...] = ()
    """Runs that failed after their server printed its ready line: they came up and served,
    so no failed start (the detector counts them as failed runs all the same)."""


@dataclass(frozen=True, slots=True)
class Timeline:
    """The rows of one unit, oldest first, and the story they tell."""

    unit: str
    rows: tuple[Row, ...]
    story: Story
    gpuguard_seen: bool
    """Whether gpuguard itself left a trusted line (else ``story.would`` is the replay)."""


@dataclass(frozen=True, slots=True)
class DaemonSaid:
    """A daemon line the replay compares with (``looping``) or follows (a recovery's reset)."""

    monotonic_s: float
    realtime_s: float | None
    boot_id: str | None
    looping: bool | None
    """None: a finished recovery that restarted the unit (the daemon then resets its count)."""
    reason: str
    read_through_s: float | None = None
    """The newest journal moment the daemon had read when it judged (its line's
    ``read_through_s``); None in lines of older versions, then the line's own moment counts."""

    @property
    def judged_s(self) -> float:
        """The moment up to which the replay feeds entries before comparing."""
        return self.monotonic_s if self.read_through_s is None else self.read_through_s


#: The PID in systemd's "process N (comm)" lines and in the daemon's ``pid=N`` fields.
SURVIVOR_PID = re.compile(r"(?:process|Process) (\d{1,10}) \(|\bpid=(\d{1,10})\b")


def chronological(
    items: Sequence[Row | UnitEvent | DaemonSaid],
) -> Callable[[Row | UnitEvent | DaemonSaid], tuple[float, str, float]]:
    """A sort key: boots in the order of their first wall-clock stamp, then monotonic time."""
    first: dict[str | None, float] = {}
    for item in items:
        stamp = item.realtime_s if item.realtime_s is not None else float("inf")
        first[item.boot_id] = min(first.get(item.boot_id, stamp), stamp)

    def key(item: Row | UnitEvent | DaemonSaid) -> tuple[float, str, float]:
        return (first.get(item.boot_id, float("inf")), item.boot_id or "", item.monotonic_s)

    return key


def short_run(run: str | None) -> str:
    """An invocation ID as the story names a run: its first characters, escaped."""
    return "?" if run is None else escape(run[:_SHORT_ID])


def clock(realtime_s: float | None) -> str:
    """A wall-clock stamp as the table shows it (UTC, milliseconds); ``?`` when there is none."""
    if realtime_s is None:
        return "?"
    try:
        return datetime.fromtimestamp(realtime_s, timezone.utc).strftime("%H:%M:%S.%f")[:12]
    except (OverflowError, OSError, ValueError):
        return "?"
