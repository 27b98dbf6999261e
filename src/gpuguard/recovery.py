"""When the daemon may break a restart loop, and when it must stop trying (pure, clock passed in).

A recovery stops the unit, reaps its stale GPU holders and starts it again. It is worth doing
only for a loop with a GPU cause; it is spaced out by a growing backoff; and after a few that
did not help, the unit is marked *needs operator* and left alone — repeating a recovery that
does not work would only hide the real problem behind more model loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from gpuguard.detector import Cause

if TYPE_CHECKING:
    from gpuguard.detector import Diagnosis


class Action(StrEnum):
    """What to do about a diagnosis."""

    NONE = "none"
    RECOVER = "recover"
    REPORT = "report"
    WAIT = "wait"
    NEEDS_OPERATOR = "needs-operator"


@dataclass(frozen=True, slots=True)
class RecoveryLimits:
    """How often recoveries may happen."""

    max_attempts: int = 3
    backoff_s: float = 120.0
    stable_s: float = 300.0


@dataclass(frozen=True, slots=True)
class Decision:
    """The action with its reason; ``not_before_s`` says when a WAIT ends."""

    action: Action
    reason: str
    not_before_s: float | None = None


class RecoveryPlanner:
    """Tracks one unit's recoveries and decides the next action."""

    def __init__(self, limits: RecoveryLimits) -> None:
        """Start with no recoveries behind us."""
        self._limits = limits
        self._unhelped = 0
        self._last_s: float | None = None
        self.needs_operator = False

    @property
    def attempts_without_help(self) -> int:
        """Recoveries since the unit last ran stably."""
        return self._unhelped

    def decide(self, diagnosis: Diagnosis, now: float) -> Decision:
        """The action for a fresh diagnosis at ``now``."""
        if not diagnosis.looping:
            return Decision(Action.NONE, diagnosis.reason)
        if diagnosis.cause is not Cause.STALE_GPU_HOLDERS:
            return Decision(
                Action.REPORT,
                f"restart loop without a GPU cause ({diagnosis.cause.value}: "
                f"{diagnosis.cause_detail}); gpuguard does not act on it",
            )
        if self.needs_operator or self._unhelped >= self._limits.max_attempts:
            self.needs_operator = True
            return Decision(
                Action.NEEDS_OPERATOR,
                f"{self._unhelped} recoveries did not help; needs an operator "
                "(see `gpuguard status` and the runbook)",
            )
        if self._last_s is not None:
            wait = self._limits.backoff_s * 2 ** max(self._unhelped - 1, 0)
            if now < self._last_s + wait:
                return Decision(
                    Action.WAIT,
                    f"last recovery {now - self._last_s:.0f} s ago; next not before {wait:.0f} s",
                    self._last_s + wait,
                )
        return Decision(
            Action.RECOVER, f"restart loop caused by stale GPU holders: {diagnosis.reason}"
        )

    def recovered(self, now: float) -> None:
        """A recovery was carried out at ``now`` (whatever its outcome)."""
        self._last_s = now
        self._unhelped += 1

    def healthy(self, now: float) -> None:
        """The unit is not looping at ``now``: a recovery long enough ago has helped."""
        if self._last_s is not None and now - self._last_s >= self._limits.stable_s:
            self._unhelped = 0
            self.needs_operator = False

    def export(self) -> dict[str, object]:
        """The bookkeeping that must survive a daemon restart (times are wall-clock seconds)."""
        return {
            "attempts_without_help": self._unhelped,
            "last_recovery_s": self._last_s,
            "needs_operator": self.needs_operator,
        }

    def restore(self, saved: dict[str, object]) -> None:
        """Take back what ``export`` saved; unknown or malformed values are ignored."""
        attempts = saved.get("attempts_without_help")
        last = saved.get("last_recovery_s")
        if isinstance(attempts, int) and attempts >= 0:
            self._unhelped = attempts
        if isinstance(last, (int, float)):
            self._last_s = float(last)
        self.needs_operator = saved.get("needs_operator") is True
