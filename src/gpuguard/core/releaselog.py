"""The release log: each measured kill-to-release time, and what status, explain, metrics say.

``core.release`` measures a release wherever a reap happens (the daemon, the gate, the
operator's ``reap``); each one is kept here as a ``Logged`` record (who reaped, for which unit,
when on which boot) in one log that keeps the newest ``KEPT`` of each unit (of the ``UNITS``
last reaped for), so a busy unit's reaps never push a quiet unit's history out. ``summarize``
is the one computation of the numbers an operator deciding whether to wait reads: per GPU (the
label set of the histogram), the last release and the typical one (the median of those kept).
``status`` shows them for a unit's GPUs, the metrics export them as gauges, and ``explain`` puts
each record of the unit on its incident's timeline at the moment the memory went: the same
records, the same numbers.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Final

from gpuguard.core.release import Release, labels_ok
from gpuguard.core.unitname import UNIT_NAME

if TYPE_CHECKING:
    from collections.abc import Collection, Iterable

KEPT: Final = 64
"""Records kept per unit (a reap of 8 GPUs writes 8). At most the metrics' remembered history
(``tally.HISTORY_KEPT``), so the daemon's counter tells a unit's new record from an old one."""
UNITS: Final = 32
"""Units the log keeps records of: past that, the unit whose newest record is the oldest goes
whole (a bound on the file, which every reaper rewrites: 32 x 64 records, under 1 MB)."""
REAPERS: Final = ("daemon", "gate", "reap")
"""Who reaped: the daemon's recovery or sweep, the gate before a start, the ``reap`` command."""


@dataclass(frozen=True, slots=True)
class Logged:
    """One release as the log keeps it: the measurement, who reaped, and when it happened."""

    release: Release
    by: str
    """One of ``REAPERS``."""
    unit: str | None
    """The watched unit whose holders were reaped; None in a record an older gpuguard's daemon
    wrote when it could not tell."""
    released_wall_s: float
    """When the reading showed the memory gone (the wall clock, seconds since the epoch)."""
    boot_id: str | None
    released_monotonic_s: float | None
    """The same moment on the boot's monotonic clock (the journal's ``__MONOTONIC_TIMESTAMP``):
    where ``explain`` puts it among the journal's rows. None when the boot is unknown."""

    def to_json(self) -> dict[str, Any]:
        """The log's record (docs/metrics.md, "The release log")."""
        return {
            **self.release.to_json(),
            "by": self.by,
            "unit": self.unit,
            "time": datetime.fromtimestamp(self.released_wall_s, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "boot_id": self.boot_id,
            "monotonic_s": None
            if self.released_monotonic_s is None
            else round(self.released_monotonic_s, 3),
        }

    @classmethod
    def from_json(cls, item: object) -> Logged | None:
        """Back from ``to_json``; None for anything else (the file is root's, but checked)."""
        release = Release.from_json(item)
        if release is None or not isinstance(item, dict):
            return None
        by, unit = item.get("by"), item.get("unit")
        boot, mono = item.get("boot_id"), item.get("monotonic_s")
        if by not in REAPERS or not (
            unit is None or (isinstance(unit, str) and UNIT_NAME.fullmatch(unit))
        ):
            return None
        if not (boot is None or labels_ok([boot])):
            return None
        if mono is not None and (
            not isinstance(mono, (int, float)) or isinstance(mono, bool) or mono < 0
        ):
            return None
        wall = _wall(item.get("time"))
        if wall is None:
            return None
        return cls(release, str(by), unit, wall, boot, None if mono is None else float(mono))


# A record's wall time lies in this range, or the record is left out: a stamp that is valid
# ISO but lands before year 1 or after 9999 in UTC would make every later print of it raise.
_WALL_RANGE_S: Final = (0.0, 2.0**37)


def _wall(text: object) -> float | None:
    if not isinstance(text, str) or len(text) > 40:
        return None
    try:
        stamp = datetime.fromisoformat(text)
    except ValueError:
        return None
    if stamp.tzinfo is None:
        return None
    try:
        wall = stamp.timestamp()
    except (OverflowError, ValueError):
        return None
    low, high = _WALL_RANGE_S
    return wall if low <= wall <= high else None


def parse(document: object) -> tuple[Logged, ...]:
    """The log's records, oldest first; a malformed one is left out, a non-list is empty."""
    items = document if isinstance(document, list) else []
    found = (Logged.from_json(item) for item in items[-KEPT * UNITS :])
    return _kept([r for r in found if r is not None])


def appended(document: object, new: Iterable[Logged]) -> list[dict[str, Any]]:
    """The log's document with ``new`` appended, the newest ``KEPT`` of each unit kept."""
    return [record.to_json() for record in _kept([*parse(document), *new])]


def per_unit(records: Iterable[Logged]) -> dict[str | None, list[Logged]]:
    """The records of each unit, in the log's order (None: an older daemon's, unit unknown)."""
    grouped: dict[str | None, list[Logged]] = {}
    for record in records:
        grouped.setdefault(record.unit, []).append(record)
    return grouped


def _kept(records: list[Logged]) -> tuple[Logged, ...]:
    """The newest ``KEPT`` of each unit, of the ``UNITS`` units reaped for last, in order.

    Each unit's records stay a window that only grows at its end and loses its oldest, as
    ``tally.Tally.news`` needs to tell a new record from an old one.
    """
    newest: dict[str | None, int] = {}
    for index, record in enumerate(records):
        newest[record.unit] = index
    units = set(sorted(newest, key=newest.__getitem__)[-UNITS:])
    counts = dict.fromkeys(units, 0)
    kept: list[Logged] = []
    for record in reversed(records):
        if record.unit in units and counts[record.unit] < KEPT:
            counts[record.unit] += 1
            kept.append(record)
    return tuple(reversed(kept))


@dataclass(frozen=True, slots=True)
class GpuReleases:
    """What the log says of one GPU (one label set): the last release, the typical one."""

    last: Logged
    """The GPU's newest record: its labels (``Release``), seconds, who reaped and when."""
    typical_s: float
    """The median of the kept releases of this GPU."""
    count: int

    @property
    def gpu(self) -> int:
        """The GPU's NVML index."""
        return self.last.release.gpu

    @property
    def labels(self) -> tuple[str, str, str, str]:
        """The histogram's labels (``Release.labels``)."""
        return self.last.release.labels

    def in_words(self) -> str:
        """One line for status: how long a wait for this GPU's memory has taken."""
        last = self.last
        at = datetime.fromtimestamp(last.released_wall_s, timezone.utc)
        return (
            f"GPU {self.gpu} released reaped memory after {seconds(last.release.seconds)} last "
            f"time ({last.by}, {at:%Y-%m-%d %H:%M:%S} UTC), typically {seconds(self.typical_s)} "
            f"({self.count} release{'s' if self.count != 1 else ''} logged)"
        )

    def to_json(self) -> dict[str, Any]:
        """For ``status --json``: the release's labels, then the summary."""
        shown = self.last.release.to_json()
        last_s = shown.pop("seconds")
        return {
            **shown,
            "last_s": last_s,
            "last_time": datetime.fromtimestamp(self.last.released_wall_s, timezone.utc).isoformat(
                timespec="seconds"
            ),
            "last_by": self.last.by,
            "typical_s": round(self.typical_s, 3),
            "count": self.count,
        }


def summarize(
    records: Iterable[Logged], gpus: Collection[int] | None = None
) -> tuple[GpuReleases, ...]:
    """Per GPU (``gpus``: these indices; None: all), its last and typical release, by index."""
    grouped: dict[tuple[str, str, str, str], list[Logged]] = {}
    for record in records:
        if gpus is None or record.release.gpu in gpus:
            grouped.setdefault(record.release.labels, []).append(record)
    found = []
    for group in grouped.values():
        last = max(group, key=lambda r: r.released_wall_s)
        found.append(
            GpuReleases(last, statistics.median(r.release.seconds for r in group), len(group))
        )
    return tuple(sorted(found, key=lambda g: (g.gpu, g.labels)))


def seconds(value: float) -> str:
    """A release time as status, explain and reap print it: to the millisecond, as logged."""
    return f"{value:.3f} s"


def row_text(record: Logged) -> str:
    """The release as a row of ``explain``'s timeline."""
    release = record.release
    return (
        f"GPU {release.gpu} ({release.model}, driver {release.driver}): memory of the holders "
        f"reaped by {record.by} released {seconds(release.seconds)} after the last signal"
    )
