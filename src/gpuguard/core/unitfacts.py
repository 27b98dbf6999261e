"""One unit's facts, gathered before anything decides, and the one rule that merges them (pure).

Three places read a unit: the gate and reap (adapters/unitfacts.gather), status and the
metrics (adapters/watched.look), and the daemon, through its ports (daemon/watches). Each asks
systemd for the unit's state and provenance, looks for a better copy of the unit's environment
than systemd's ``Environment=``, and reads the provenance ledger; ``unit_facts`` merges what
they read into one ``UnitFacts``, so no two views of one unit plan with a different GPU set
or different evidence for its left-overs. The decisions then take that value.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuguard.core.ledger import UnitLedger
    from gpuguard.core.unitstate import UnitState
    from gpuguard.core.values import UnitProvenance


@dataclass(frozen=True, slots=True)
class UnitFacts:
    """What systemd, the asker and the provenance ledger say of one unit, read once."""

    state: UnitState
    inside: bool
    """The asker is the unit's own ExecStartPre=/ExecStopPost= process: its run is over."""
    environment: dict[str, str]
    """The unit's environment: the asker's own when it runs in the unit (the gate and reap);
    for status, the metrics and the daemon, the gate's record of it (EnvironmentFile= values
    included); else systemd's ``Environment=``. The gate and reap never read the record: an
    operator's reap plans with systemd's."""
    provenance: UnitProvenance
    """What ties a process to an ended run: systemd's runs and user, the ledger's claims."""
    notices: tuple[str, ...] = ()
    """What could not be recorded on the way (the unit's GPU variables, the ledger)."""

    @property
    def live(self) -> str | None:
        """The run whose processes are kept: systemd's running one, unless the asker ends it.

        What a gate, a reap, status and the daemon's GPU evidence plan with. The daemon's
        sweep of an ended run and its recoveries name their own live run instead (the sweep
        drops the run that ended even while systemd still says ``deactivating``; a recovery
        of a stuck or dead run keeps none of it): never replace theirs with this.
        """
        return self.state.invocation_id if self.state.running and not self.inside else None


def unit_facts(  # noqa: PLR0913 - what each gatherer read, each named
    state: UnitState,
    provenance: UnitProvenance,
    ledger: UnitLedger,
    *,
    environment: dict[str, str] | None,
    inside: bool = False,
    notices: tuple[str, ...] = (),
) -> UnitFacts:
    """One gatherer's reads as ``UnitFacts``, by the two rules every gatherer shares.

    The environment: ``environment`` when the gatherer found the unit's own (the asker runs in
    the unit, or the gate recorded it), None: systemd's ``Environment=``. The provenance:
    systemd's, with the ledger's evidence (the unit's claims, other units' processes) added.
    """
    return UnitFacts(
        state,
        inside,
        state.environment if environment is None else environment,
        replace(
            provenance,
            ledger=ledger.claims,
            elsewhere=ledger.elsewhere,
            other_runs=ledger.other_runs,
        ),
        notices,
    )
