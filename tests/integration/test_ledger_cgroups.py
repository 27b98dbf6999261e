"""The provenance ledger over real processes that move between real cgroups (root).

A server in the unit's cgroup forks a TP worker that moves into its own transient scope and
carries that scope's INVOCATION_ID, the shape ``systemd-run --scope`` gives it. The daemon's
keeper, with the real cgroup and /proc readers, records both while the run lives; after the
server died the worker is named by nothing but the ledger, and the plan reaps it by that record.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from typing import TYPE_CHECKING

import pytest
from clirunner import CGROUP2
from fakeholder import process_gone
from fakestate import fake_library

from gpuguard.adapters import inventory, ledgerstore, procfs, runtree, state
from gpuguard.config import Settings
from gpuguard.core.ledger import (
    MAX_PROCESSES,
    MAX_RUNS,
    MAX_RUNS_PER_UNIT,
    Ledger,
    SeenProcess,
)
from gpuguard.core.policy import PlanRequest, Scope, Verdict, plan
from gpuguard.core.values import ProcessIdentity, UnitProvenance
from gpuguard.daemon.ledgerkeeper import LedgerKeeper, LedgerPorts
from gpuguard.unitsettings import UnitSettings

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

    from clirunner import UnitCgroups
    from fakeholder import Holder, HolderSpawner

    from gpuguard.core.liverun import Walked


RUN = "1" * 32  # the unit's run the worker descended from
SCOPE_ID = "d" * 32  # what its own environment says: the transient scope's INVOCATION_ID


def procfs_identity() -> ProcessIdentity:
    """The identity (PID and start time) of the test process, alive for the whole test."""
    identity = procfs.read_identity(os.getpid())
    assert identity is not None
    return identity


def keeper(saved: list[Ledger]) -> LedgerKeeper:
    """The daemon's keeper with the real readers, over the test's cgroup v2 mount."""

    def read(group: str | None, recorded: Mapping[ProcessIdentity, str]) -> tuple[Walked, ...]:
        return runtree.run_processes(group, recorded, cgroup_root=CGROUP2)

    def save(ledger: Ledger) -> Ledger:
        saved.append(ledger)
        return ledger

    ports = LedgerPorts(run_processes=read, alive=runtree.alive, save=save, every_s=30.0)
    return LedgerKeeper(ports, Ledger(), lambda: 1.0)


def escaped_worker(
    spawn_holder: HolderSpawner,
    state: Path,
    cgroups: UnitCgroups,
    unit: str,
    scope: str,
    monkeypatch: pytest.MonkeyPatch,
) -> Holder:
    """A server of run RUN in ``unit``'s cgroup whose one worker (GPU 0) moved into ``scope``.

    The worker carries the scope's own INVOCATION_ID, as `systemd-run --scope` gives it.
    """
    monkeypatch.setenv("INVOCATION_ID", RUN)
    server = spawn_holder(
        state,
        gpus=(0,),
        mib=30000,
        children=1,
        leave_child=True,
        child_invocation=SCOPE_ID,
        name="sglang::server",
    )
    monkeypatch.delenv("INVOCATION_ID")
    cgroups.move(server.pid, unit)
    cgroups.move(server.children[0], scope)
    return server


def recorded_at(kept: LedgerKeeper) -> dict[int, str]:
    """The first run's recorded PIDs with the cgroup each was first seen in (none: empty)."""
    runs = kept.ledger.runs
    return {p.pid: p.cgroup for p in runs[0].processes} if runs else {}


def request(unit: str, provenance: UnitProvenance) -> PlanRequest:
    """The gate's request for ``unit`` before its next start (nothing of it is live)."""
    return PlanRequest(
        unit=unit,
        scope=Scope.UNIT,
        patterns=("sglang",),
        gpu_set=None,
        protected_names=(),
        untouchable_pids=frozenset({os.getpid()}),
        provenance=provenance,
    )


def test_a_worker_that_moved_to_its_own_scope_is_recorded_and_reaped_after_its_server_died(
    tmp_path: Path,
    fake_state: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Recorded while the run lived, the orphaned worker is the unit's; without it, nobody's."""
    if os.geteuid() != 0:
        pytest.skip("reads every process's status and writes root's ledger file (root)")
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    scope = f"tp-worker-{uuid.uuid4().hex[:8]}.scope"
    server = escaped_worker(spawn_holder, fake_state, unit_cgroups, unit, scope, monkeypatch)
    worker = server.children[0]
    saved: list[Ledger] = []
    kept = keeper(saved)

    kept.run_up(unit, RUN, f"/system.slice/{unit}", 0.0)

    [run] = kept.ledger.runs
    where = {p.pid: p.cgroup for p in run.processes}
    assert where[server.pid] == f"/system.slice/{unit}"
    assert where[worker] == f"/system.slice/{scope}"
    server.terminate()  # the server dies; its worker stays (leave_child)
    server.wait()
    kept.run_over(unit, RUN, 1.0)
    assert {p.pid for p in kept.ledger.runs[0].processes} == {worker}  # the server forgotten
    ledgerstore.save(tmp_path, saved[-1])
    assert (ledgerstore.ledger_path(tmp_path).stat().st_mode & 0o777) == 0o600

    settings = Settings(
        units={unit: UnitSettings()},
        allow_plain_device_files=True,
        nvml_library=fake_library(),
        device_glob=f"{fake_state}/dev/nvidia*",
    )
    monkeypatch.setenv("FAKENVML_STATE", str(fake_state))
    found = inventory.gather(settings)
    systemd_says = UnitProvenance(None, frozenset({RUN}), uid=0)
    with_ledger = UnitProvenance(
        None, frozenset({RUN}), uid=0, ledger=ledgerstore.evidence(tmp_path, unit).claims
    )
    [decision] = [
        d
        for d in plan(found.holders, request(unit, with_ledger)).decisions
        if d.holder.pid == worker
    ]
    assert decision.verdict is Verdict.REAP, decision.reason
    assert "the ledger saw it descend from run 111111111111" in decision.reason
    [before] = [
        d
        for d in plan(found.holders, request(unit, systemd_says)).decisions
        if d.holder.pid == worker
    ]
    assert before.verdict is Verdict.KEEP
    assert not process_gone(worker)


def test_descendants_outside_the_cgroup_are_recorded_and_a_repeat_record_writes_nothing(
    fake_state: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A child never in the cgroup is the run's by descent; nothing new to prove, no write."""
    if os.geteuid() != 0:
        pytest.skip("reads every process's status (root)")
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    scope = f"tp-worker-{uuid.uuid4().hex[:8]}.scope"
    saved: list[Ledger] = []
    kept = keeper(saved)
    kept.run_up(unit, RUN, f"/system.slice/{unit}", 0.0)
    assert not recorded_at(kept)
    # The worker came up in the cgroup between records, then moved out with its child.
    monkeypatch.setenv("INVOCATION_ID", RUN)
    worker = spawn_holder(fake_state, gpus=(0,), children=1, name="sglang::worker")
    monkeypatch.delenv("INVOCATION_ID")
    unit_cgroups.move(worker.pid, unit)
    kept.record(unit, 1.0)
    unit_cgroups.move(worker.pid, scope)
    assert set(recorded_at(kept)) == {worker.pid, *worker.children}
    writes = len(saved)
    kept.record(unit, 2.0)
    assert recorded_at(kept)[worker.pid] == f"/system.slice/{unit}"  # where it was first seen
    assert len(saved) == writes  # nothing new to prove: the file is not rewritten


def test_a_full_ledger_of_hostile_names_is_written_within_what_readers_accept(
    tmp_path: Path,
) -> None:
    """Every unit at its caps, every name hostile: the file stays readable, newest runs kept."""
    ledger = Ledger()
    hostile = "/system.slice/" + '\\x\u00ff"' * 200
    for unit in range(MAX_RUNS // MAX_RUNS_PER_UNIT):
        for run in range(MAX_RUNS_PER_UNIT):
            seen = [
                SeenProcess(pid, pid, (0, 0, 0, 0), "\u00ff" * 16, hostile)
                for pid in range(1 + run * MAX_PROCESSES, 1 + (run + 1) * MAX_PROCESSES)
            ]
            ledger = ledger.record(f"u{unit}.service", f"{unit:016x}{run:016x}", seen, 1.0)
    ledgerstore.save(tmp_path, ledger)
    assert ledgerstore.ledger_path(tmp_path).stat().st_size < state.READ_MAX
    loaded, problems = ledgerstore.load(tmp_path)
    assert problems == ()
    assert loaded.runs
    assert loaded.runs[-1] == ledger.runs[-1]


_WRITER = """
import sys
from pathlib import Path
from gpuguard.adapters import ledgerstore
from gpuguard.core.ledger import SeenProcess
runtime, first, pid, start = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
for index in range(first, first + 20):
    seen = [SeenProcess(pid, start, (0,), "w", "/")] if index == first else []
    ledgerstore.update(
        runtime, lambda disk: disk.record(f"u{index}.service", "1" * 32, seen, float(index))
    )
"""


def test_two_writers_at_once_lose_none_of_each_others_runs(tmp_path: Path) -> None:
    """Two processes each add 20 runs by read-merge-replace at the same time: all 40 are kept."""
    me = procfs_identity()
    writers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WRITER,
                str(tmp_path),
                str(first),
                str(me.pid),
                str(me.start_time),
            ]
        )
        for first in (0, 20)
    ]
    assert [writer.wait(timeout=120) for writer in writers] == [0, 0]
    ledger, problems = ledgerstore.load(tmp_path)
    assert problems == ()
    assert sorted(run.unit for run in ledger.runs) == sorted(f"u{i}.service" for i in range(40))


def test_the_daemons_write_keeps_what_the_gate_server_recorded(tmp_path: Path) -> None:
    """The daemon's ledger merged with the file: the gate's live run kept, a dead one forgotten."""
    me = procfs_identity()
    alive = SeenProcess(me.pid, me.start_time, (0,), "pytest", "/")
    gone = SeenProcess(me.pid, me.start_time + 1, (0,), "gone", "/")  # no such process
    ledgerstore.save(
        tmp_path,
        Ledger().record("gated.service", RUN, [alive], 1.0).record("old.service", RUN, [gone], 1.0),
    )
    daemons = Ledger().record("watched.service", "2" * 32, [], 2.0)  # live, nothing yet
    written = ledgerstore.save_merged(tmp_path, daemons)
    assert {run.unit for run in written.runs} == {"gated.service", "watched.service"}
    assert ledgerstore.load(tmp_path)[0] == written
