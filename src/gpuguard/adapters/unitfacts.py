"""One unit's facts as a gate or a reap needs them, gathered in one call before anything decides.

``gather`` asks systemd once for the unit (its state, user, runs, control process), tells
whether the asker is the unit's own control process, takes the unit's environment (the
caller's own, recorded for the daemon's recoveries when root; else systemd's Environment=), and
reads the provenance: what systemd and its journal say of the unit's runs and user, with the
provenance ledger's evidence (root first records what it sees of the runs now), merged into
core.unitfacts' ``UnitFacts`` by the rule status and the daemon merge theirs by. The command
then decides from this one value (commands/context.unit_plan): the live run, the GPU set, the
policy's request. Nothing here decides who may be killed.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from gpuguard.adapters import ledgerstore, systemd, unitenv
from gpuguard.core.unitfacts import unit_facts

if TYPE_CHECKING:
    from pathlib import Path

    from gpuguard.core.gate.auth import Caller
    from gpuguard.core.ledger import UnitLedger
    from gpuguard.core.unitfacts import UnitFacts
    from gpuguard.core.unitstate import UnitState


def gather(unit: str, who: Caller, runtime_dir: Path, *, trust_unknown: bool) -> UnitFacts:
    """The unit's facts for ``who``; ``trust_unknown``: root runs gpuguard itself (no server).

    When systemd cannot be asked, ``trust_unknown`` decides whether a caller in the unit's
    cgroup counts as its control process (UnitState.is_control_process).
    """
    state = systemd.show_unit(unit)
    inside = who.runs_in(unit) and state.is_control_process(who.pid, trust_unknown=trust_unknown)
    own, problem = own_environment(who, unit, runtime_dir)
    recorded, noted = _ledger_evidence(runtime_dir, unit, state, inside=inside)
    return unit_facts(
        state,
        systemd.provenance(state, inside=inside),
        recorded,
        environment=own,
        inside=inside,
        notices=tuple(line for line in (problem, noted) if line is not None),
    )


def own_environment(
    caller: Caller, unit: str, runtime_dir: Path
) -> tuple[dict[str, str] | None, str | None]:
    """The unit's real environment when the caller is its control process (else None).

    An ExecStartPre=/ExecStopPost= process has the unit's environment, EnvironmentFile= values
    included. Root records its GPU variables for the daemon's recoveries (unitenv); the second
    value says why that failed, for the command's notices. Any other process of the unit (a
    worker, another user's job in a shared service: ``control`` False) never speaks for it;
    ``control`` None is gpuguard itself run in the unit's cgroup, in process.
    """
    if not caller.runs_in(unit) or caller.environment is None or caller.control is False:
        return None, None
    if os.geteuid() == 0:
        try:
            unitenv.record(runtime_dir, unit, caller.environment, caller.pid)
        except OSError as err:
            return caller.environment, f"gpuguard: cannot record {unit}'s GPU variables: {err}"
    return caller.environment, None


def _ledger_evidence(
    runtime_dir: Path, unit: str, unit_state: UnitState, *, inside: bool
) -> tuple[UnitLedger, str | None]:
    """The ledger's evidence for ``unit``, after adding what root sees of its runs now.

    Root (the gate server, an in-process gate or reap) records as the daemon does: the live
    descendants of every recorded process of the unit's runs, and, serving the unit's own
    stop-reap, the ending run's cgroup and what descends from it (ledgerstore.record_seen). So
    the gate alone, with no daemon, still knows a worker that a left-over in the cgroup started
    and that moved into a scope of its own. Not recorded: a notice, and the file as it is.
    """
    if os.geteuid() != 0:
        return ledgerstore.evidence(runtime_dir, unit), None
    ending = unit_state.ending_run() if inside else None
    try:
        seen = ledgerstore.record_seen(
            runtime_dir, unit, ending, unit_state.control_group, time.time()
        )
    except OSError as err:
        problem = f"gpuguard: cannot record {unit}'s processes in the provenance ledger: {err}"
        return ledgerstore.evidence(runtime_dir, unit), problem
    return seen.for_unit(unit), None
