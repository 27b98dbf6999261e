"""The daemon's side of the provenance ledger: record each watched run while it lives.

When a run comes up, when systemd announces its stop (``Stopping …``, before any signal), when
it ends, and while it runs - 1, 2, 4, 8 … s after it came up (a server's workers appear after
its model load), then every ``daemon.ledger_every_s`` - the unit's processes are read
(runtree: its cgroup and the descendants of every process in it or recorded before) and added
to the ledger (core.ledger), each under the run its own evidence names at the moment of the
walk (core.liverun), never under the run the daemon believes live: a daemon that reads a run's
end after systemd started the next run files the next run's processes under the next run.
Processes that exited are forgotten at each record, runs left empty with them; the file is
rewritten only when what it proves changed.

A periodic record with nothing new to see is skipped: when no process or thread was created
in the PID namespace since the run's last full record (its last allocated PID, the 5th field of
/proc/loadavg, proc(5), has not moved), the run cannot have gained a descendant, and a PID the
ledger holds cannot have been reused. What a record would still notice without a fork changes
no decision: exits are forgotten at the next full record (an entry names a PID *and* its start
time, which no later process shares); a recorded process's cgroup, uids and name are kept as
first seen, and the kill policy reads the live uids and cgroup at kill time; a process moved
into the unit's cgroup without a fork (an attach by root) is still the run's by that cgroup
then, and recorded at the next full record. Whenever the counter cannot be read or trusted
(runtree.last_pid: another PID namespace), while the ledger's caps cut some of what a record
saw (an exit may make room for one), after a walk its own budgets cut short (runtree: its
processes, its threads; the wiring logs what was cut), and at least every ``_FULL_EVERY`` intervals
(a counter that wrapped round to the same value), the run is read in full; the start, the
stop's announcement and the end always are. So an idle host costs two small reads per
interval, and no write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuguard.core.liverun import Walk, file_walk

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from gpuguard.core.ledger import Ledger, UnitLedger
    from gpuguard.core.liverun import Walked
    from gpuguard.core.values import ProcessIdentity


@dataclass(frozen=True, slots=True)
class LedgerPorts:
    """What the keeper reads and writes through (runtree, ledgerstore; twins in tests)."""

    run_processes: Callable[[str | None, Mapping[ProcessIdentity, str]], tuple[Walked, ...]]
    alive: Callable[[ProcessIdentity], bool]
    save: Callable[[Ledger], Ledger | None]
    """Write the ledger; what was written when the file held more (the gate server's records)."""
    every_s: float
    last_pid: Callable[[], int | None] = lambda: None
    """The PID namespace's last allocated PID (runtree.last_pid); None: unknown, read in full."""


_FIRST_STEP_S = 1.0
_FULL_EVERY = 10
"""A run is read in full at least every this many intervals, forks or not (fail safe)."""


@dataclass(slots=True)
class _Live:
    invocation_id: str
    control_group: str | None
    due_s: float
    step_s: float = _FIRST_STEP_S
    settled: bool = False
    """The next record is a periodic one (every ``every_s``), not one of the first steps."""
    last_pid: int | None = None
    """The namespace's last allocated PID before the run's last full record (None: unknown)."""
    skipped: int = 0
    """Periodic records skipped in a row since then (nothing created in between)."""


class LedgerKeeper:
    """The ledger of every watched unit's runs, and which runs are live now."""

    def __init__(
        self, ports: LedgerPorts | None, initial: Ledger, wall: Callable[[], float]
    ) -> None:
        """Start from the ledger on disk (a restarted daemon keeps its evidence)."""
        self._ports = ports
        self._ledger = initial
        self._wall = wall
        self._live: dict[str, _Live] = {}
        self._saved = initial.to_json()["runs"]
        self._unsaved = False
        """The last write failed: the next record is a full one, and writes again."""

    @property
    def ledger(self) -> Ledger:
        """The ledger as recorded so far."""
        return self._ledger

    def claims(self, unit: str) -> frozenset[tuple[ProcessIdentity, str]]:
        """What the ledger recorded of ``unit``'s runs (PlanRequest.provenance.ledger)."""
        return self._ledger.claims(unit)

    def evidence(self, unit: str) -> UnitLedger:
        """The unit's claims and other units' recorded processes, for a plan's provenance."""
        return self._ledger.for_unit(unit)

    def run_up(self, unit: str, invocation_id: str, control_group: str | None, now: float) -> None:
        """A run of ``unit`` is live: record it now and from now on."""
        self._live[unit] = _Live(invocation_id, control_group, now)
        self.record(unit, now)

    def run_over(self, unit: str, invocation_id: str, now: float) -> None:
        """A run ended: one last record (moved workers' own children), then no more."""
        live = self._live.get(unit)
        if live is not None and live.invocation_id == invocation_id:
            self.record(unit, now)
            del self._live[unit]

    def record(self, unit: str, now: float, *, periodic: bool = False) -> None:
        """Read the live run of ``unit`` now (nothing when none is live), then forget the dead.

        A ``periodic`` record is skipped while nothing was created since the run's last full
        record (the module's docstring says why that is safe).
        """
        ports, live = self._ports, self._live.get(unit)
        if ports is None or live is None:
            return
        live.due_s = now + min(live.step_s, ports.every_s)
        live.settled = live.step_s >= ports.every_s
        live.step_s = min(live.step_s * 2, ports.every_s)
        last_pid = ports.last_pid()  # before the walk: a fork during it moves it for next time
        unchanged = last_pid is not None and last_pid == live.last_pid and not self._unsaved
        if periodic and unchanged and live.skipped + 1 < _FULL_EVERY:
            live.skipped += 1
            return
        live.last_pid, live.skipped = last_pid, 0
        walked = ports.run_processes(live.control_group, dict(self._ledger.claims(unit)))
        ledger, at = self._ledger, self._wall()
        filed = file_walk(walked)
        for invocation_id, seen in filed.items():
            ledger = ledger.record(unit, invocation_id, seen, at)
        kept = {p.identity for run in ledger.runs for p in run.processes}
        if any(p.identity not in kept for seen in filed.values() for p in seen):
            live.last_pid = None  # some cut by the caps: an exit may make room, read each time
        if isinstance(walked, Walk) and walked.cut is not None:
            live.last_pid = None  # the walk was cut short: never skipped as if read whole
        keep = frozenset(v.invocation_id for v in self._live.values())
        self._ledger = ledger.forget(ports.alive, keep)
        self._save()

    def due_in(self, now: float, *, slack_s: float = 0.0) -> float | None:
        """Seconds until the next record, None when no run is live.

        A settled run's periodic record may wait up to ``slack_s`` (at most ``every_s``) for a
        wake the loop makes anyway (its watchdog's); a run's first steps after it came up,
        when its workers appear, never wait.
        """
        ports = self._ports
        if ports is None or not self._live:
            return None
        slack = min(slack_s, ports.every_s)
        due = min(live.due_s + (slack if live.settled else 0.0) for live in self._live.values())
        return max(0.0, due - now)

    def tick(self, now: float, *, early_s: float = 0.0) -> None:
        """Record every live run whose interval is over; a settled run's also within ``early_s``."""
        for unit, live in list(self._live.items()):
            if now + (early_s if live.settled else 0.0) >= live.due_s:
                self.record(unit, now, periodic=True)

    def _save(self) -> None:
        """Write the file when what it proves changed (the times of a record alone do not)."""
        ports = self._ports
        runs = self._ledger.to_json()["runs"]
        proves = [(r["unit"], r["invocation_id"], r["processes"]) for r in runs]
        if ports is None or proves == [
            (r["unit"], r["invocation_id"], r["processes"]) for r in self._saved
        ]:
            return
        merged = ports.save(self._ledger)
        self._unsaved = merged is None
        if merged is None:
            return  # not written (the lock was held, the disk refused): the next record retries
        self._ledger = merged
        self._saved = self._ledger.to_json()["runs"]
