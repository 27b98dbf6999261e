"""The starts a unit was seen to come up, and the budgets they teach (pure).

A fixed start timeout is wrong at one end: it kills a healthy slow load or waits forever on a
hang. So each start that reached its ready line is kept phase by phase in the unit's saved
state (the newest ``STARTS_KEPT``), and a phase's budget is learned from them, never guessed:
with fewer than ``MIN_STARTS`` there is none. ``core.liveness`` judges a start against these
budgets; ``gpuguard doctor`` proposes its TimeoutStartSec= by the same rule. The saved starts
are read back totally: a malformed one is left out and named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from gpuguard.core.enginelines import Phase

if TYPE_CHECKING:
    from collections.abc import Mapping

MIN_STARTS: Final = 3
"""Starts that came up before a phase has a budget: fewer teach nothing about a slow disk."""
STARTS_KEPT: Final = 20
"""Starts remembered per unit (the newest): the budget follows the host as it changes."""
BUDGET_FACTOR: Final = 1.5
BUDGET_SLACK_S: Final = 60.0
"""A phase's budget: the longest it took in the remembered starts times 1.5, and at least 60 s more
than that longest (a 4 s phase that takes 7 s once is not stuck)."""


@dataclass(frozen=True, slots=True)
class StartRecord:
    """One start that came up: seconds to ready, and in each phase it went through."""

    invocation_id: str
    ready_s: float
    phases: tuple[tuple[Phase, float], ...]

    def to_json(self) -> dict[str, Any]:
        """As the unit's saved state keeps it."""
        return {
            "invocation_id": self.invocation_id,
            "ready_s": round(self.ready_s, 3),
            "phases": {phase.value: round(seconds, 3) for phase, seconds in self.phases},
        }


@dataclass(frozen=True, slots=True)
class PhaseTimes:
    """How long one phase took in the remembered starts: typical and longest, and the budget."""

    usual_s: float
    longest_s: float
    starts: int

    @property
    def budget_s(self) -> float | None:
        """Past this, a start in the phase is stuck; None until MIN_STARTS taught it."""
        if self.starts < MIN_STARTS:
            return None
        return budget_for(self.longest_s)


def budget_for(longest_s: float) -> float:
    """The budget the longest of the remembered times teaches (a phase's, or a whole start's)."""
    return max(longest_s * BUDGET_FACTOR, longest_s + BUDGET_SLACK_S)


def parse_starts(saved: Mapping[str, Any]) -> tuple[tuple[StartRecord, ...], list[str]]:
    """The newest STARTS_KEPT starts of a saved ``liveness`` object; each malformed one named.

    The daemon takes them back with ``restore``; ``gpuguard doctor`` reads the same file.
    """
    starts = saved.get("starts")
    if not isinstance(starts, list):
        return (), [] if starts is None else ["liveness starts is not a list"]
    kept: list[StartRecord] = []
    problems: list[str] = []
    for item in starts[-STARTS_KEPT:]:
        start = _start_from_json(item)
        if start is None:
            problems.append("a remembered start is malformed")
        else:
            kept.append(start)
    return tuple(kept), problems


def _start_from_json(item: object) -> StartRecord | None:
    if not isinstance(item, dict):
        return None
    invocation, ready, phases = item.get("invocation_id"), item.get("ready_s"), item.get("phases")
    if not isinstance(invocation, str) or not isinstance(phases, dict):
        return None
    if not isinstance(ready, (int, float)) or not _is_seconds(ready):
        return None
    kept: list[tuple[Phase, float]] = []
    for name, seconds in phases.items():
        if name not in Phase.__members__.values() or not _is_seconds(seconds):
            return None
        kept.append((Phase(name), float(seconds)))
    return StartRecord(invocation, float(ready), tuple(kept))


def _is_seconds(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and 0 <= value < 10**7  # about four months: no start takes longer
    )
