"""Reap, look again, until idle: the one loop the gate, ``reap``'s wait and the daemon's sweep run.

Each round reaps the holders the plan picks that were not signalled before (a process is
signalled once however long it takes to go), looks again, and asks the caller whether it is
done; if not, it pauses and looks again. What differs between the three is a parameter: the
gate stops its unit's containers first and gives up when a reap is stuck, ``reap``'s wait
reaps nothing (its plan was confirmed before), the daemon's sweep stops once the ended run's
holders are gone. The loop never signals, sleeps or reads the clock itself: all is injected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from gpuguard.core.policy import Decision, plan

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from gpuguard.core.inventory import Inventory
    from gpuguard.core.policy import PlanRequest
    from gpuguard.core.values import ProcessIdentity, ReapResult

Done = TypeVar("Done")


@dataclass(slots=True)
class ReapUntilIdle(Generic[Done]):
    """One loop's world and what it did: whom it reaped and whom the plan spared."""

    request: PlanRequest
    gather: Callable[[], Inventory]
    pause: Callable[[], None]
    done: Callable[[Inventory], Done | None]
    """After each look: the loop's result, or None to pause and look again."""
    reap: Callable[[Sequence[Decision]], tuple[ReapResult, ...]] | None = None
    """Signal the holders these decisions chose, with the results; None: only wait."""
    first: Callable[[Inventory], Inventory] | None = None
    """Each round's first step (the gate stops the unit's containers); the inventory after it."""
    after_reap: Callable[[tuple[ReapResult, ...]], Done | None] | None = None
    """Right after a reap, before looking again: a result ends the loop (a stuck reap)."""
    reaped: list[ReapResult] = field(default_factory=list)
    spared: dict[int, Decision] = field(default_factory=dict)
    _signalled: set[ProcessIdentity] = field(default_factory=set)

    def run(self, inventory: Inventory) -> Done:
        """Loop from ``inventory`` until ``done`` (or ``after_reap``) gives a result."""
        while True:
            if self.first is not None:
                inventory = self.first(inventory)
            if self.reap is not None:
                current = plan(inventory.holders, self.request)
                self.spared.update({d.holder.pid: d for d in current.spared})
                fresh = [d for d in current.to_reap if d.holder.identity not in self._signalled]
                if fresh:
                    results = self.reap(fresh)
                    self.reaped.extend(results)
                    self._signalled.update(d.holder.identity for d in fresh)
                    end = None if self.after_reap is None else self.after_reap(results)
                    if end is not None:
                        return end
                    inventory = self.gather()
            if (result := self.done(inventory)) is not None:
                return result
            self.pause()
            inventory = self.gather()
