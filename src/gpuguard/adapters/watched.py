"""Each watched unit as every check sees it: systemd's state, its GPU set, its live run (adapter).

``status`` and the metrics judge left-overs and blockers from the same facts the gate uses:
the GPU set from the configuration, else the unit's CUDA_VISIBLE_DEVICES as the gate recorded
it (EnvironmentFile= included), else systemd's Environment=; the running invocation; the
unit's user and ended runs. One builder, so two views of one host cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from gpuguard.adapters import ledgerstore, systemd, unitenv
from gpuguard.core.gpuset import resolve_gpu_set
from gpuguard.core.leftovers import WatchedUnit, needs_history

if TYPE_CHECKING:
    from collections.abc import Callable

    from gpuguard.config import Settings
    from gpuguard.core.gpuset import GpuSet
    from gpuguard.core.inventory import Inventory
    from gpuguard.core.ledger import UnitLedger
    from gpuguard.core.unitstate import UnitState
    from gpuguard.core.values import UnitProvenance


@dataclass(frozen=True, slots=True)
class UnitLook:
    """One watched unit: what systemd said, its resolved GPU set, and the judged view."""

    state: UnitState
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
        environment = state.environment if recorded is None else recorded
        gpu_set = resolve_gpu_set(unit.gpus, environment, found.nvml.gpus)
        watched = WatchedUnit(
            name,
            unit.patterns,
            gpu_set.indices,
            state.invocation_id if state.running else None,
            _with_ledger(systemd.provenance(state, history=history), ledger.for_unit(name)),
            gpu_set.describe(),
        )
        looks.append(UnitLook(state, gpu_set, watched))
    return tuple(looks)


def _with_ledger(provenance: UnitProvenance, recorded: UnitLedger) -> UnitProvenance:
    """Systemd's provenance plus the daemon's ledger, as the gate and the daemon plan with it."""
    return replace(provenance, ledger=recorded.claims, elsewhere=recorded.elsewhere)
