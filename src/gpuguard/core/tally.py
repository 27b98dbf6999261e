"""The daemon's counters: what happened while this daemon process ran (pure).

``core.metrics`` draws them as Prometheus counters and the release histogram; the snapshot
carries them (``to_json``) so that ``gpuguard status --prometheus`` prints the daemon's. Gate
decisions, recoveries and releases are learned from histories that keep only their newest
entries, so ``Tally.news`` says which entries are new since the last look.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

from gpuguard.core.prevented import BY_DAEMON, BY_GATE, ended_loop, healed_start
from gpuguard.core.release import Release
from gpuguard.core.releaselog import Logged, per_unit
from gpuguard.core.releasetimes import ReleaseTimes
from gpuguard.core.values import NvmlHealth, ReapOutcome

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence

RECOVERY_RESULTS = ("restarted", "failed", "dry-run", "abandoned")
GATE_RESULTS = ("passed", "refused")
REAPERS = ("daemon", "gate")
REAP_OUTCOMES = tuple(outcome.value for outcome in ReapOutcome)
HISTORY_KEPT = 64
"""Entries remembered per history (gate log, recoveries): more than either keeps (20, 10)."""


class Tally:
    """The counters: what happened while this daemon process ran.

    Gate decisions and recoveries are learned from histories that keep only their newest
    entries (the gate's log, the snapshot's recoveries): ``news`` says which entries of a
    history appeared since the last look. What was there when the daemon started is its
    ``baseline``, never counted.
    """

    def __init__(self) -> None:
        """All counters at 0; no history seen yet."""
        self.recoveries: Counter[tuple[str, str]] = Counter()
        self.gate_decisions: Counter[tuple[str, str]] = Counter()
        self.reaped: Counter[tuple[str, str]] = Counter()
        self.nvml_errors: Counter[str] = Counter()
        self.prevented: Counter[tuple[str, str]] = Counter()
        """Failed starts prevented, per unit and by whom (core.prevented's rule)."""
        self.prevented_load_s: dict[tuple[str, str], float] = defaultdict(float)
        """The loading they would have cost: each at the unit's shortest learned start."""
        self.releases = ReleaseTimes()
        """Seconds from a holder's last signal to its GPU's release (core.release)."""
        self._seen: dict[str, list[str]] = {}

    def baseline(self, history: str, entries: Sequence[Mapping[str, Any]]) -> None:
        """What ``history`` held before this process: the first look that counts nothing."""
        self.news(history, entries)

    def news(self, history: str, entries: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """The entries appended to ``history`` since the last look (all, without one).

        The newest remembered entries are matched against the oldest given ones (the longest
        overlap wins); without any overlap every entry is new (the history moved on by more
        than it keeps). Two identical entries in a row (same second, same everything) can
        hide one decision when the history is full: an undercount, never a double count.
        """
        current = [json.dumps(entry, sort_keys=True, default=str) for entry in entries]
        previous = self._seen.get(history, [])
        self._seen[history] = current[-HISTORY_KEPT:]
        for overlap in range(min(len(previous), len(current)), 0, -1):
            if previous[-overlap:] == current[:overlap]:
                return list(entries[overlap:])
        return list(entries)

    def count_recoveries(
        self, unit: str, records: Sequence[Mapping[str, Any]], each_s: float | None = None
    ) -> None:
        """Count the unit's recoveries that finished since the last look.

        ``each_s``: the loading one prevented start would have cost (None: not learned).
        """
        for record in self.news(f"recoveries/{unit}", records):
            result = record.get("result") if isinstance(record, dict) else None
            if isinstance(result, str) and result in RECOVERY_RESULTS:
                self.recoveries[unit, result] += 1
            if isinstance(record, dict) and ended_loop(record):
                self._prevent(unit, BY_DAEMON, each_s)

    def _prevent(self, unit: str, by: str, each_s: float | None) -> None:
        self.prevented[unit, by] += 1
        if each_s is not None:
            self.prevented_load_s[unit, by] += round(each_s, 3)

    def count_gate(
        self, unit: str, decisions: Sequence[Mapping[str, Any]], each_s: float | None = None
    ) -> None:
        """Count the gate's decisions for ``unit`` recorded since the last look, and its reaps."""
        for decision in self.news(f"gate/{unit}", decisions):
            if isinstance(decision, dict) and healed_start(decision):
                self._prevent(unit, BY_GATE, each_s)
            result = decision.get("result")
            if isinstance(result, str) and result in GATE_RESULTS:
                self.gate_decisions[unit, result] += 1
            reaped = decision.get("reaped")
            for entry in reaped if isinstance(reaped, list) else ():
                self.count_reaped("gate", entry.get("outcome") if isinstance(entry, dict) else None)
            released = decision.get("released")
            for item in released if isinstance(released, list) else ():
                if (release := Release.from_json(item)) is not None:
                    self.releases.add(release)

    def count_logged(self, records: Sequence[Logged]) -> None:
        """Count the operator's ``reap`` releases appended to the release log since the last look.

        The daemon counts its own as it measures them and the gate's from its decisions; the
        ``reap`` command leaves them only in the log (core.releaselog).
        """
        for history, entries in _logged_histories(records):
            for entry in self.news(history, entries):
                logged = Logged.from_json(entry)
                if logged is not None and logged.by == "reap":
                    self.releases.add(logged.release)

    def baseline_logged(self, records: Sequence[Logged]) -> None:
        """What the release log held before this process: its records counted as seen."""
        for history, entries in _logged_histories(records):
            self.baseline(history, entries)

    def count_reaped(self, reaper: str, outcome: object) -> None:
        """One process the daemon or the gate reaped, by how it ended."""
        if isinstance(outcome, str) and outcome in REAP_OUTCOMES:
            self.reaped[reaper, outcome] += 1

    def count_nvml(self, health: NvmlHealth) -> None:
        """One NVML reading; anything but OK is an error of that kind."""
        if health is not NvmlHealth.OK:
            self.nvml_errors[health.value] += 1

    def to_json(self) -> dict[str, Any]:
        """The counters as plain JSON (the snapshot carries them to ``status --prometheus``)."""
        return {
            "recoveries": [[*key, n] for key, n in sorted(self.recoveries.items())],
            "gate_decisions": [[*key, n] for key, n in sorted(self.gate_decisions.items())],
            "reaped": [[*key, n] for key, n in sorted(self.reaped.items())],
            "nvml_errors": [[key, n] for key, n in sorted(self.nvml_errors.items())],
            "prevented": [[*key, n] for key, n in sorted(self.prevented.items())],
            "prevented_load_s": [[*key, n] for key, n in sorted(self.prevented_load_s.items())],
            "releases": self.releases.to_json(),
        }

    @classmethod
    def from_json(cls, document: object) -> Tally:
        """Counters back from ``to_json``; anything malformed is left at 0."""
        tally = cls()
        if not isinstance(document, dict):
            return tally
        for name, width in (
            ("recoveries", 2),
            ("gate_decisions", 2),
            ("reaped", 2),
            ("prevented", 2),
        ):
            target: Counter[tuple[str, str]] = getattr(tally, name)
            for row in _rows(document.get(name), width):
                target[row[0], row[1]] = row[-1]
        for row in _rows(document.get("nvml_errors"), 1):
            tally.nvml_errors[row[0]] = row[-1]
        for row in _rows(document.get("prevented_load_s"), 2, seconds=True):
            tally.prevented_load_s[row[0], row[1]] = row[-1]
        tally.releases = ReleaseTimes.from_json(document.get("releases"))
        return tally


def _logged_histories(records: Sequence[Logged]) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """The release log as one history per unit: the log keeps each unit's newest, not all's."""
    for unit, group in per_unit(records).items():
        yield f"releases/{unit or '-'}", [record.to_json() for record in group]


def _rows(value: object, width: int, *, seconds: bool = False) -> Iterator[list[Any]]:
    """Rows of ``width`` strings and a count >= 0 (``seconds``: a number); others are skipped."""
    kinds = (int, float) if seconds else (int,)
    for row in value if isinstance(value, list) else ():
        if (
            isinstance(row, list)
            and len(row) == width + 1
            and all(isinstance(cell, str) for cell in row[:width])
            and type(row[width]) in kinds
            and row[width] >= 0
        ):
            yield row
