"""The provenance ledger: which processes descended from each run of a watched unit (pure).

The evidence that a process came from a unit's run is easy to see while the run lives (it sits
in the unit's cgroup, or descends from a process that does) and gone once the run is over: a TP
worker that moved into a transient scope (``systemd-run --scope``) carries that scope's
``INVOCATION_ID`` and cgroup, and after the server's death its parent is PID 1. So the daemon
records each run's descendants while it lives, and the kill policy later takes a recorded
(PID, start time) of an *ended* run as positive evidence, still only with the unit's uid.

A process belongs to the first run it was seen in (a left-over from run A that is still in the
cgroup when run B starts stays A's), so a late record can only make a process look live, never
stale. A run is forgotten once none of its processes exists any more; the ledger is bounded in
runs and processes, and what is cut is the oldest, which only ever means "no evidence".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeGuard

from gpuguard.core.values import ProcessIdentity

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

LEDGER_SCHEMA = 1
MAX_RUNS = 64
"""Runs kept across all units; the oldest record is dropped first."""
MAX_RUNS_PER_UNIT = 8
"""Runs kept per unit, its own oldest dropped first: one unit whose runs all leave survivors
cannot push another unit's evidence out."""
MAX_PROCESSES = 256
"""Processes kept per run (a TP-8 server with its helpers has a few dozen)."""
CGROUP_CHARS = 128
COMM_CHARS = 16
"""Names are kept for people only and cut to these lengths, so a unit's user cannot make an
entry large (a cgroup name may be any bytes but '/' and NUL); with the per-unit caps one unit's
runs take well under a megabyte, and the writer drops the oldest runs if the whole ever
outgrows the state store's read limit (ledgerstore.save)."""
_MAX_TEXT = 512
_INVOCATION_CHARS = frozenset("0123456789abcdef")


@dataclass(frozen=True, slots=True)
class SeenProcess:
    """One process as the ledger saw it descend from a run: identity, uids, name and cgroup."""

    pid: int
    start_time: int
    uids: tuple[int, ...]
    comm: str
    cgroup: str
    """Where it was first seen (``/system.slice/tp-worker-0.scope``), for people."""

    @property
    def identity(self) -> ProcessIdentity:
        """(PID, start time): exactly this process for the life of the boot."""
        return ProcessIdentity(self.pid, self.start_time)


@dataclass(frozen=True, slots=True)
class RunRecord:
    """The processes seen descending from one run (invocation) of one unit."""

    unit: str
    invocation_id: str
    first_seen: float
    """Wall-clock seconds of the first record, for people (and which run is oldest)."""
    last_seen: float
    processes: tuple[SeenProcess, ...] = ()


@dataclass(frozen=True, slots=True)
class UnitLedger:
    """What the ledger says for one unit's plan: its own runs' processes, and other units'."""

    claims: frozenset[tuple[ProcessIdentity, str]] = frozenset()
    elsewhere: frozenset[ProcessIdentity] = frozenset()
    other_runs: frozenset[str] = frozenset()
    """The invocation ids of the runs recorded for other units (live ones included)."""


@dataclass(frozen=True, slots=True)
class Ledger:
    """Every watched unit's recorded runs, oldest first."""

    runs: tuple[RunRecord, ...] = ()

    def record(
        self, unit: str, invocation_id: str, seen: Iterable[SeenProcess], at: float
    ) -> Ledger:
        """Add what was seen of a live run; a process already recorded keeps its first run."""
        known = {p.identity for run in self.runs for p in run.processes}
        fresh: dict[ProcessIdentity, SeenProcess] = {}
        for process in seen:
            if process.identity not in known:
                cut = replace(
                    process, comm=process.comm[:COMM_CHARS], cgroup=process.cgroup[:CGROUP_CHARS]
                )
                fresh.setdefault(process.identity, cut)
        runs = list(self.runs)
        index = next(
            (i for i, r in enumerate(runs) if (r.unit, r.invocation_id) == (unit, invocation_id)),
            None,
        )
        if index is None:
            runs.append(RunRecord(unit, invocation_id, at, at))
            index = len(runs) - 1
        run = runs[index]
        processes = (*run.processes, *fresh.values())[:MAX_PROCESSES]
        runs[index] = replace(run, last_seen=at, processes=processes)
        mine = [i for i, r in enumerate(runs) if r.unit == unit and i != index]
        dropped = set(mine[: max(len(mine) - (MAX_RUNS_PER_UNIT - 1), 0)])
        kept = [r for i, r in enumerate(runs) if i not in dropped]
        return Ledger(tuple(kept[-MAX_RUNS:]))

    def merge(self, other: Ledger) -> Ledger:
        """Both ledgers' runs: what two writers (the daemon, the gate server) recorded, all kept.

        A run both hold keeps both lists of processes, its earliest first and latest last
        record; a process recorded in two runs stays in the one first seen (the first-run
        rule of :meth:`record`, by ``first_seen``); the caps apply as there, the oldest cut.
        """
        merged: dict[tuple[str, str], RunRecord] = {}
        for run in sorted((*self.runs, *other.runs), key=lambda r: r.first_seen):
            key = (run.unit, run.invocation_id)
            have = merged.get(key)
            if have is None:
                merged[key] = run
                continue
            merged[key] = replace(
                have,
                first_seen=min(have.first_seen, run.first_seen),
                last_seen=max(have.last_seen, run.last_seen),
                processes=(*have.processes, *run.processes),
            )
        known: set[ProcessIdentity] = set()
        runs: list[RunRecord] = []
        for run in merged.values():
            fresh: dict[ProcessIdentity, SeenProcess] = {}
            for process in run.processes:
                if process.identity not in known:
                    fresh.setdefault(process.identity, process)
            known.update(fresh)
            runs.append(replace(run, processes=tuple(fresh.values())[:MAX_PROCESSES]))
        per_unit: dict[str, int] = {}
        kept: list[RunRecord] = []
        for run in reversed(runs):  # newest first: each unit's newest runs are kept
            per_unit[run.unit] = per_unit.get(run.unit, 0) + 1
            if per_unit[run.unit] <= MAX_RUNS_PER_UNIT:
                kept.append(run)
        return Ledger(tuple(reversed(kept[:MAX_RUNS])))

    def without_oldest(self, count: int) -> Ledger:
        """The ledger less its ``count`` oldest runs (the writer's last resort against size)."""
        return Ledger(self.runs[max(count, 1) :])

    def forget(self, alive: Callable[[ProcessIdentity], bool], keep: frozenset[str]) -> Ledger:
        """Drop processes that no longer exist, then runs left empty (except ``keep``, live)."""
        runs = []
        for run in self.runs:
            processes = tuple(p for p in run.processes if alive(p.identity))
            if processes or run.invocation_id in keep:
                runs.append(replace(run, processes=processes))
        return Ledger(tuple(runs))

    def run_of(self, unit: str, invocation_id: str) -> RunRecord | None:
        """The record of one run, if any."""
        return next(
            (r for r in self.runs if (r.unit, r.invocation_id) == (unit, invocation_id)), None
        )

    def claims(self, unit: str) -> frozenset[tuple[ProcessIdentity, str]]:
        """Each recorded process of ``unit`` with the invocation it descended from."""
        return frozenset(
            (p.identity, run.invocation_id)
            for run in self.runs
            if run.unit == unit
            for p in run.processes
        )

    def for_unit(self, unit: str) -> UnitLedger:
        """The unit's own claims and every other unit's recorded processes."""
        return UnitLedger(self.claims(unit), self.elsewhere(unit), self.other_runs(unit))

    def other_runs(self, unit: str) -> frozenset[str]:
        """The invocation ids of every run recorded for another unit: never ``unit``'s."""
        return frozenset(run.invocation_id for run in self.runs if run.unit != unit)

    def elsewhere(self, unit: str) -> frozenset[ProcessIdentity]:
        """Every process recorded in a run of another unit: never ``unit``'s by adoption."""
        return frozenset(p.identity for run in self.runs if run.unit != unit for p in run.processes)

    def to_json(self) -> dict[str, Any]:
        """The ledger file's document."""
        return {
            "schema": LEDGER_SCHEMA,
            "runs": [
                {
                    "unit": run.unit,
                    "invocation_id": run.invocation_id,
                    "first_seen": run.first_seen,
                    "last_seen": run.last_seen,
                    "processes": [
                        [p.pid, p.start_time, list(p.uids), p.comm, p.cgroup] for p in run.processes
                    ],
                }
                for run in self.runs
            ],
        }

    @classmethod
    def parse(cls, document: object) -> tuple[Ledger, tuple[str, ...]]:
        """The ledger a document holds, and what was skipped and why (total: never raises).

        Anything malformed is dropped, which only ever removes evidence.
        """
        if not isinstance(document, dict) or document.get("schema") != LEDGER_SCHEMA:
            return cls(), ("not a ledger document of schema 1",)
        raw_runs = document.get("runs")
        if not isinstance(raw_runs, list):
            return cls(), ("runs is not a list",)
        runs: list[RunRecord] = []
        problems: list[str] = []
        for raw in raw_runs[-MAX_RUNS:]:
            run = _parse_run(raw)
            if run is None:
                problems.append("a malformed run was skipped")
            else:
                runs.append(run)
        return cls(tuple(runs)), tuple(problems)


def _parse_run(raw: object) -> RunRecord | None:
    if not isinstance(raw, dict):
        return None
    unit, invocation = raw.get("unit"), raw.get("invocation_id")
    first, last = raw.get("first_seen"), raw.get("last_seen")
    listed = raw.get("processes")
    if not (
        _text(unit)
        and isinstance(invocation, str)
        and is_invocation_id(invocation)
        and _number(first)
        and _number(last)
        and isinstance(listed, list)
    ):
        return None
    processes = tuple(p for item in listed[:MAX_PROCESSES] if (p := _parse_process(item)))
    return RunRecord(unit, invocation, float(first), float(last), processes)


def _parse_process(raw: object) -> SeenProcess | None:
    if not isinstance(raw, list) or len(raw) != 5:
        return None
    pid, start, uids, comm, cgroup = raw
    if not (_count(pid) and _count(start) and _text(comm) and _text(cgroup)):
        return None
    if not isinstance(uids, list) or len(uids) > 4 or not all(_count(u) for u in uids):
        return None
    return SeenProcess(pid, start, tuple(uids), comm, cgroup)


def is_invocation_id(text: str) -> bool:
    """Whether ``text`` is a systemd invocation id (32 lower-case hex digits)."""
    return len(text) == 32 and set(text) <= _INVOCATION_CHARS


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _text(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and 0 < len(value) <= _MAX_TEXT


def ledger_evidence(
    claims: frozenset[tuple[ProcessIdentity, str]], identity: ProcessIdentity
) -> str | None:
    """The run the ledger says ``identity`` descended from, if it recorded it.

    A lookup, not a scan: a plan asks once per holder, and a host may have thousands.
    """
    return _index(claims).get(identity)


@functools.lru_cache(maxsize=16)
def _index(claims: frozenset[tuple[ProcessIdentity, str]]) -> dict[ProcessIdentity, str]:
    return dict(claims)
