"""The provenance ledger's file: ``runtime_dir/ledger.json``, root's, through the safe writer.

The daemon writes it (core.ledger says what it holds), and so does the root gate server (and
``reap``) for what it sees of a unit's runs when it serves the unit (:func:`record_seen`); all
of them read it for their plans. Two writers change it by read, merge, replace, under an
exclusive flock of ``ledger.lock`` beside it (:func:`update`), so neither loses what the other
recorded. It lives in /run: processes do not outlive a boot, and neither does it. Mode 0600:
it names processes of every watched unit, and only root acts on it. A file that is missing,
not safely ours (files.read_file) or malformed reads as an empty ledger: no evidence.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from gpuguard.adapters import files, runtree, state
from gpuguard.core.ledger import Ledger, UnitLedger
from gpuguard.core.liverun import file_walk

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path


#: How long a writer waits for the other's read-merge-replace (a few milliseconds each).
LOCK_WAIT_S = 2.0


def ledger_path(runtime_dir: Path) -> Path:
    """Where the ledger lives."""
    return runtime_dir / "ledger.json"


def load(runtime_dir: Path) -> tuple[Ledger, tuple[str, ...]]:
    """The ledger on disk and what of it was skipped (empty and no problem when there is none)."""
    path = ledger_path(runtime_dir)
    if not path.exists():
        return Ledger(), ()
    return Ledger.parse(state.read_json(path))


def save(runtime_dir: Path, ledger: Ledger) -> None:
    """Replace the file atomically (root-only: 0600), compact and within the read limit.

    Should the whole outgrow what a reader accepts, the oldest runs go first: a file too large
    to read would lose every unit's evidence at once.
    """
    while len(encoded := json.dumps(ledger.to_json(), separators=(",", ":"))) >= state.READ_MAX:
        # Runs are of a size, near enough: drop the share that is too much, and one more.
        ledger = ledger.without_oldest(
            len(ledger.runs) * (len(encoded) - state.READ_MAX) // len(encoded) + 1
        )
    files.write_file(ledger_path(runtime_dir), encoded.encode(), mode=0o600)


def update(runtime_dir: Path, change: Callable[[Ledger], Ledger]) -> Ledger:
    """Read the file, apply ``change``, and replace it when that changed anything, locked.

    Returns the ledger as written (or as read, when unchanged). Raises OSError (TimeoutError
    when the other writer held the lock for LOCK_WAIT_S): the caller decides what that costs.
    """
    with files.exclusive_lock(runtime_dir / "ledger.lock", wait_s=LOCK_WAIT_S):
        disk, _ = load(runtime_dir)
        changed = change(disk)
        if changed.to_json() != disk.to_json():
            save(runtime_dir, changed)
        return changed


def save_merged(runtime_dir: Path, ledger: Ledger) -> Ledger:
    """The daemon's write: its ledger merged with the file's (the gate server's records kept).

    A run only the file holds whose processes have all gone is forgotten, as the daemon forgets
    its own; the daemon's own runs are its to forget. Returns what was written.
    """
    mine = frozenset(run.invocation_id for run in ledger.runs)
    return update(runtime_dir, lambda disk: disk.merge(ledger).forget(runtree.alive, mine))


def record_seen(
    runtime_dir: Path, unit: str, ending: str | None, control_group: str | None, now: float
) -> Ledger:
    """Add what can be seen now of ``unit``'s runs (the gate server's record); what was written.

    Every recorded run of the unit gains the live descendants of its recorded processes (a
    moved worker's children, found after its parent died). ``ending`` names the run whose
    stop-reap is being served: the unit's cgroup (``control_group``) is walked too, each of its
    processes filed under its own ``INVOCATION_ID``, or ``ending`` without one, and their
    descendants under theirs (core.liverun). Only then: systemd waits for the stop-reap to
    end, so no later run can have started in the cgroup meanwhile; the running run of a unit
    is the daemon's to record. Processes that have gone are forgotten, as the daemon forgets
    them. The /proc walk runs before the lock is taken (:func:`update` holds it for a read,
    merge and replace only).
    """
    # The walk is the caller's to size (its processes and threads): done before the lock,
    # which is held only to re-read, merge and replace, so no caller holds up the daemon.
    before, _ = load(runtime_dir)
    gone = {
        p.identity for run in before.runs for p in run.processes if not runtree.alive(p.identity)
    }
    walked = runtree.run_processes(
        control_group if ending is not None else None, dict(before.claims(unit))
    )
    filed = file_walk(walked, members_run=ending)

    def change(disk: Ledger) -> Ledger:
        ledger = disk.forget(lambda identity: identity not in gone, frozenset())
        for invocation, seen in filed.items():
            known = {p.identity for run in ledger.runs for p in run.processes}
            if any(p.identity not in known for p in seen):  # else the file stays as it is
                ledger = ledger.record(unit, invocation, seen, now)
        return ledger

    return update(runtime_dir, change)


def evidence(runtime_dir: Path, unit: str) -> UnitLedger:
    """What the ledger recorded of ``unit``'s runs, and of every other unit's, for a plan."""
    return load(runtime_dir)[0].for_unit(unit)
