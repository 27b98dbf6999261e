"""What gpuguard saved: the failed starts it prevented, and the loading they would have cost (pure).

The rule is conservative, and the same for status, the metrics and their docs:

- A start the gate let through only after it **signalled a holder that then exited** (SIGTERM or
  SIGKILL: ``exited``/``killed``) counts **1** failed start prevented: without the gate that
  start would have met the holder's memory. A holder that had exited before the signal, a
  wait for a release, a refusal: nothing.
- A recovery the daemon finished with the unit **restarted** counts **1**: the loop's next
  start would have met the same holders. A recovery that failed, a dry run: nothing.
- Never more than 1 each. Without gpuguard systemd would have retried until its start limit,
  or forever (a loop under Docker's ``unless-stopped`` ran about 35 times before a host needed a
  reset, spark-vllm-docker #257); how many it would have is a guess, so it is not counted.

The loading each prevented start would have cost is the unit's **shortest learned start**
(systemd's "Starting" to the server's ready line, ``core.startbudgets``): what a start that
loads its model costs on that host. A start that fails before its load ends costs less, so the
figure is what the prevented starts would have cost had they loaded; with no learned start it is
not counted at all (the count still stands), never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

HEALED_OUTCOMES: Final = frozenset({"exited", "killed"})
"""A reaped holder's outcomes that mean the gate's signal ended it (core.values.ReapOutcome)."""
BY_GATE: Final = "gate"
BY_DAEMON: Final = "daemon"
PREVENTERS: Final = (BY_GATE, BY_DAEMON)


def healed_start(decision: Mapping[str, Any]) -> bool:
    """Whether a gate decision let a start through only after its signal ended a holder."""
    if decision.get("result") != "passed":
        return False
    reaped = decision.get("reaped")
    return any(
        isinstance(entry, dict) and entry.get("outcome") in HEALED_OUTCOMES
        for entry in (reaped if isinstance(reaped, list) else ())
    )


def ended_loop(record: Mapping[str, Any]) -> bool:
    """Whether a daemon's recovery record restarted the unit."""
    return record.get("result") == "restarted"


def in_words(saved: Prevented) -> str | None:
    """What was saved, as status and explain say it; None when nothing was."""
    if not saved.starts:
        return None
    each = saved.each_s
    loading = (
        f", {minutes(saved.load_s)} of loading at its shortest learned start ({minutes(each)} each)"
        if saved.load_s is not None and each is not None
        else "; no learned start says what one would have cost"
    )
    return (
        f"gpuguard prevented {saved.starts} failed start{'' if saved.starts == 1 else 's'} "
        f"({saved.by_gate} healed by the gate, {saved.by_daemon} "
        f"loop{'' if saved.by_daemon == 1 else 's'} ended by the daemon){loading}"
    )


def minutes(seconds: float) -> str:
    """Seconds as people read a load time: "3 min 30 s", "45 s"."""
    whole = round(seconds)
    mins, rest = divmod(whole, 60)
    if not mins:
        return f"{rest} s"
    return f"{mins} min" + (f" {rest} s" if rest else "")


def load_cost_s(learned_ready_s: Sequence[float]) -> float | None:
    """What one prevented start would have cost in loading: the shortest learned start."""
    return min(learned_ready_s) if learned_ready_s else None


@dataclass(frozen=True, slots=True)
class Prevented:
    """One unit's prevented failed starts, by who prevented them, and their loading."""

    by_gate: int = 0
    by_daemon: int = 0
    each_s: float | None = None
    """The loading one prevented start would have cost; None: no learned start."""

    @property
    def starts(self) -> int:
        """All prevented failed starts."""
        return self.by_gate + self.by_daemon

    @property
    def load_s(self) -> float | None:
        """Their loading, None when no learned start says what one costs."""
        return None if self.each_s is None else self.starts * self.each_s


def prevented(
    decisions: Iterable[Mapping[str, Any]],
    recoveries: Iterable[Mapping[str, Any]],
    learned_ready_s: Sequence[float],
) -> Prevented:
    """The unit's prevented failed starts in the given gate decisions and daemon recoveries."""
    return Prevented(
        by_gate=sum(1 for d in decisions if isinstance(d, dict) and healed_start(d)),
        by_daemon=sum(1 for r in recoveries if isinstance(r, dict) and ended_loop(r)),
        each_s=load_cost_s(learned_ready_s),
    )
