"""Each watched unit as every check sees it: systemd's state, its GPU set, its live run (adapter).

``status`` and the metrics judge left-overs and blockers from the same facts the gate uses,
merged by the same rule (core.unitfacts): the GPU set from the configuration, else the unit's
CUDA_VISIBLE_DEVICES as the gate recorded it (EnvironmentFile= included), else systemd's
Environment=; the running invocation; the unit's user and ended runs, with the ledger's
evidence. One builder, so two views of one host cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuguard.adapters import ledgerstore, systemd, unitenv
from gpuguard.core.gpuset import resolve_gpu_set
from gpuguard.core.leftovers import WatchedUnit, needs_history
from gpuguard.core.unitfacts import unit_facts

if TYPE_CHECKING:
    from collections.abc import Callable

    from gpuguard.config import Settings
    from gpuguard.core.gpuset import GpuSet
    from gpuguard.core.inventory import Inventory
    from gpuguard.core.unitfacts import UnitFacts
    from gpuguard.core.unitstate import UnitState


@dataclass(frozen=True, slots=True)
class UnitLook:
    """One watched unit: its facts, its resolved GPU set, and the judged view."""

    facts: UnitFacts
    gpu_set: GpuSet
    unit: WatchedUnit


def look(
    settings: Settings,
    found: Inventory,
    show_unit: Callable[[str], UnitState] = systemd.show_unit,
) -> tuple[UnitLook, ...]:
    """Ask systemd about each watched unit, after ``found`` was taken; the journal if needed.

    After, never before: a run that started in between must not make its processes look stale.
    """
    history = needs_history(found, settings.units)
    ledger = ledgerstore.load(settings.runtime_dir)[0]  # unreadable (not root): no evidence
    looks = []
    for name, unit in settings.units.items():
        state = show_unit(name)
        recorded = unitenv.recorded(settings.runtime_dir, name)
        facts = unit_facts(
            state,
            systemd.provenance(state, history=history),
            ledger.for_unit(name),
            environment=recorded,
        )
        gpu_set = resolve_gpu_set(unit.gpus, facts.environment, found.nvml.gpus)
        watched = WatchedUnit(
            name, unit.patterns, gpu_set.indices, facts.live, facts.provenance, gpu_set.describe()
        )
        looks.append(UnitLook(facts, gpu_set, watched))
    return tuple(looks)
