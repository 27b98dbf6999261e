"""The provenance ledger: what it records, what it forgets, what it proves to the kill policy."""

from __future__ import annotations

import fnmatch
import time
from dataclasses import replace

from builders import gpu, inventory, nvml, plan_request, process
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.core.adopt import glob_match
from gpuguard.core.cgroup import Attribution
from gpuguard.core.containment import Containment
from gpuguard.core.gate.run import GateSettings, run_gate
from gpuguard.core.inventory import GpuUse, Holder, build_inventory
from gpuguard.core.ledger import (
    CGROUP_CHARS,
    MAX_PROCESSES,
    MAX_RUNS,
    MAX_RUNS_PER_UNIT,
    Ledger,
    SeenProcess,
)
from gpuguard.core.liverun import Walk, Walked, file_walk, live_reason
from gpuguard.core.policy import PlanRequest, Scope, Verdict, decide, plan
from gpuguard.core.recovery import unfreeable
from gpuguard.core.unitfacts import unit_facts
from gpuguard.core.unitstate import UnitState
from gpuguard.core.values import ProcessIdentity, ProcScan, UnitProvenance
from gpuguard.daemon.ledgerkeeper import LedgerKeeper, LedgerPorts

UNIT = "sglang.service"
LIVE = "a" * 32
OLD = "b" * 32
ROOT = (0, 0, 0, 0)
TENANT = (1000, 1000, 1000, 1000)
SCOPE = "tp-worker-0.scope"
SCOPE_ID = "d" * 32  # the transient scope's own INVOCATION_ID


def holder(
    pid: int = 100,
    *,
    unit: str = UNIT,
    invocation: str | None = OLD,
    uids: tuple[int, ...] = ROOT,
) -> Holder:
    """A holder of GPU 0 by its device file, in ``unit``'s cgroup."""
    return Holder(
        identity=ProcessIdentity(pid, 5000 + pid),
        ppid=1,
        state="S",
        user="root",
        comm="python3",
        cmdline=("python3", "-m", "sglang.launch_server"),
        attribution=Attribution(unit=unit),
        invocation_id=invocation,
        gpus=(GpuUse(0, None, listed_by_nvml=False, holds_device_file=True),),
        device_files=frozenset({"/dev/nvidia0"}),
        kernel_thread=False,
        uids=uids,
    )


def request(*, live: str | None = None, provenance: UnitProvenance | None = None) -> PlanRequest:
    """The gate's request for the unit (scope unit, GPUs 0-3)."""
    return PlanRequest(
        unit=UNIT,
        scope=Scope.UNIT,
        patterns=("sglang",),
        gpu_set=frozenset({0, 1, 2, 3}),
        protected_names=("nvidia-persistenced",),
        untouchable_pids=frozenset({4242}),
        provenance=provenance or UnitProvenance(None, frozenset({OLD}), uid=0),
        live_invocation=live,
    )


def seen(pid: int, cgroup: str = f"/system.slice/{UNIT}") -> SeenProcess:
    """A process as the ledger saw it (start times as test_policy's holders have them)."""
    return SeenProcess(pid, 5000 + pid, ROOT, "python3", cgroup)


def walked(pid: int, run: str | None = OLD, parent: int | None = None) -> Walked:
    """``seen(pid)`` as the ledger's walk reads it: its own INVOCATION_ID ``run``."""
    of = None if parent is None else ProcessIdentity(parent, 5000 + parent)
    return Walked(seen(pid), run, of)


def recorded(*pids: int, run: str = OLD) -> UnitProvenance:
    """The provenance systemd gives, with the ledger having seen ``pids`` descend from ``run``."""
    ledger = Ledger().record(UNIT, run, [seen(pid) for pid in pids], 1.0)
    return UnitProvenance(None, frozenset({OLD}), uid=0, ledger=ledger.claims(UNIT))


def moved(pid: int = 100, uids: tuple[int, ...] = ROOT) -> Holder:
    """A TP worker that moved into its own scope, with that scope's INVOCATION_ID."""
    return holder(pid, unit=SCOPE, invocation=SCOPE_ID, uids=uids)


def test_a_process_keeps_the_first_run_it_was_seen_in() -> None:
    """A left-over of run A still in the cgroup when run B starts stays A's."""
    ledger = Ledger().record(UNIT, OLD, [seen(1)], 1.0).record(UNIT, LIVE, [seen(1), seen(2)], 2.0)
    assert dict(ledger.claims(UNIT)) == {
        ProcessIdentity(1, 5001): OLD,
        ProcessIdentity(2, 5002): LIVE,
    }


def test_gone_processes_and_their_empty_runs_are_forgotten() -> None:
    """Forgetting keeps the live run even when empty; a PID reused later is a new process."""
    ledger = Ledger().record(UNIT, OLD, [seen(1)], 1.0).record(UNIT, LIVE, [], 2.0)
    forgotten = ledger.forget(lambda _identity: False, keep=frozenset({LIVE}))
    assert [run.invocation_id for run in forgotten.runs] == [LIVE]
    assert not forgotten.claims(UNIT)


def test_the_ledger_is_bounded_in_runs_and_processes() -> None:
    """The oldest runs go first, per unit and in all; a run keeps at most MAX_PROCESSES."""
    ledger = Ledger()
    for run in range(MAX_RUNS_PER_UNIT + 5):
        ledger = ledger.record(UNIT, f"{run:032x}", [], float(run))
    assert len(ledger.runs) == MAX_RUNS_PER_UNIT
    assert ledger.runs[0].invocation_id == f"{5:032x}"
    for run in range(MAX_RUNS + 5):
        ledger = ledger.record(f"u{run % 40}.service", f"{run + 100:032x}", [], float(run))
    assert len(ledger.runs) == MAX_RUNS
    big = Ledger().record(UNIT, OLD, [seen(pid) for pid in range(1, MAX_PROCESSES + 10)], 1.0)
    assert len(big.runs[0].processes) == MAX_PROCESSES


def test_the_file_document_round_trips() -> None:
    """What is written is read back as the same ledger, with no problem."""
    ledger = Ledger().record(UNIT, OLD, [seen(1), seen(2, "/system.slice/x.scope")], 1.5)
    assert Ledger.parse(ledger.to_json()) == (ledger, ())


@given(
    st.recursive(
        st.none() | st.integers() | st.text(), lambda c: st.lists(c) | st.dictionaries(st.text(), c)
    )
)
def test_the_parser_is_total(document: object) -> None:
    """Any JSON value parses to a ledger (maybe empty) and reasons, never an exception."""
    ledger, problems = Ledger.parse(document)
    assert isinstance(ledger, Ledger)
    assert isinstance(problems, tuple)


def test_malformed_runs_and_processes_are_dropped() -> None:
    """A bad id, a negative PID, a bool or too many uids only removes evidence."""
    good = Ledger().record(UNIT, OLD, [seen(1)], 1.0).to_json()
    run = good["runs"][0]
    document = {
        "schema": 1,
        "runs": [
            run | {"invocation_id": "../../etc"},
            run | {"processes": [[-1, 5, [0], "x", "/"], [True, 5, [0], "x", "/"]]},
            run | {"processes": [[1, 5001, [0, 0, 0, 0, 0], "x", "/"]]},
            run,
        ],
    }
    ledger, problems = Ledger.parse(document)
    assert problems == ("a malformed run was skipped",)
    assert [len(r.processes) for r in ledger.runs] == [0, 0, 1]


def test_a_recorded_worker_of_an_ended_run_is_reaped_in_its_own_scope() -> None:
    """The ledger saw it descend from the ended run: reaped whatever its scope's INVOCATION_ID."""
    decision = decide(moved(), request(provenance=recorded(100)))
    assert decision.verdict is Verdict.REAP
    assert "the ledger saw it descend from run" in decision.reason
    assert f" {UNIT} " in decision.reason  # how explain finds the reaper's line of the unit


def test_without_the_ledger_the_moved_worker_is_kept() -> None:
    """Today's evidence alone: the scope's own INVOCATION_ID names no run of the unit."""
    decision = decide(moved(), request(provenance=replace(recorded(100), ledger=frozenset())))
    assert decision.verdict is Verdict.KEEP


def test_a_recorded_process_of_another_uid_is_never_the_units() -> None:
    """The ledger is no evidence against the uid rule: a tenant's process stays."""
    decision = decide(moved(uids=TENANT), request(provenance=recorded(100)))
    assert decision.verdict is Verdict.KEEP
    assert "uid 1000" in decision.reason


def test_a_recorded_process_of_the_live_run_is_kept() -> None:
    """A worker the ledger saw in the running invocation is live."""
    decision = decide(moved(), request(live=LIVE, provenance=recorded(100, run=LIVE)))
    assert decision.verdict is Verdict.KEEP
    assert "live process" in decision.reason


def test_a_process_whose_own_invocation_is_the_live_run_is_kept_whatever_the_ledger_says() -> None:
    """A late record filed a live worker under the ended run: its own INVOCATION_ID keeps it."""
    worker = replace(moved(), invocation_id=LIVE)
    sweep = replace(request(live=LIVE, provenance=recorded(100)), only_invocation=OLD)
    decision = decide(worker, sweep)
    assert decision.verdict is Verdict.KEEP
    assert decision.reason == f"live process of the running {UNIT}"
    assert decide(worker, request(live=LIVE, provenance=recorded(100))).verdict is Verdict.KEEP
    assert live_reason(UNIT, LIVE, OLD, LIVE) == f"live process of the running {UNIT}"
    assert live_reason(UNIT, SCOPE_ID, LIVE, LIVE) == f"live process of the running {UNIT} (ledger)"
    assert live_reason(UNIT, OLD, OLD, LIVE) is None
    assert live_reason(UNIT, LIVE, LIVE, None) is None


def test_a_walk_files_the_cgroups_processes_under_their_own_run_not_the_believed_one() -> None:
    """Systemd already runs the next run: its server, worker and a moved worker are its own.

    The cgroup holds the next run's server (own INVOCATION_ID LIVE) and a left-over of the
    ended run (OLD); the server's worker moved to a scope (the scope's own id): it is the
    server's run. A process the ledger recorded keeps its run; its new child is its run's.
    """
    gone = Walked(seen(9), OLD, None, OLD)
    server, left = walked(1, LIVE), walked(2, OLD)
    worker = walked(3, SCOPE_ID, parent=1)
    grandchild = walked(4, SCOPE_ID, parent=3)
    recorded_child = walked(5, SCOPE_ID, parent=9)
    filed = file_walk([server, left, gone, worker, grandchild, recorded_child])
    assert {run: [p.pid for p in procs] for run, procs in filed.items()} == {
        LIVE: [1, 3, 4],
        OLD: [2, 9, 5],
    }


def test_a_walk_files_nothing_it_cannot_tell() -> None:
    """A cgroup member without a readable INVOCATION_ID, and its children, are filed nowhere.

    Unless the caller knows which run alone can be in the cgroup (a stop-reap being served).
    """
    mute, child = walked(1, None), walked(2, SCOPE_ID, parent=1)
    assert file_walk([mute, child]) == {}
    filed = file_walk([mute, child], members_run=OLD)
    assert [p.pid for p in filed[OLD]] == [1, 2]


def test_a_child_of_a_recorded_process_claiming_the_present_run_is_that_runs() -> None:
    """Its own INVOCATION_ID names the run now in the cgroup: filed there (the live side)."""
    server, gone = walked(1, LIVE), Walked(seen(9), OLD, None, OLD)
    child = walked(5, LIVE, parent=9)
    stray = walked(6, "e" * 32, parent=9)
    filed = file_walk([server, gone, child, stray])
    assert [p.pid for p in filed[LIVE]] == [1, 5]
    assert [p.pid for p in filed[OLD]] == [9, 6]


def test_a_reused_pid_is_not_the_recorded_process() -> None:
    """Same PID, other start time: no evidence."""
    worker = replace(moved(), identity=ProcessIdentity(100, 1))
    assert decide(worker, request(provenance=recorded(100))).verdict is Verdict.KEEP


def test_the_sweep_of_an_ended_run_takes_its_recorded_workers() -> None:
    """only_invocation matches the ledger's run as well as an inherited INVOCATION_ID."""
    sweep = replace(request(provenance=recorded(100)), only_invocation=OLD)
    assert decide(moved(), sweep).verdict is Verdict.REAP
    other = replace(request(provenance=recorded(100, run="e" * 32)), only_invocation=OLD)
    assert decide(moved(), other).verdict is Verdict.KEEP


def test_an_adopted_scope_is_the_units_only_while_nothing_of_it_is_live() -> None:
    """An adopted scope's holder with the unit's uid is reaped only while the unit is down."""
    adopting = replace(request(), adopt=("tp-worker-*.scope",))
    assert decide(moved(), adopting).verdict is Verdict.REAP
    assert decide(moved(uids=TENANT), adopting).verdict is Verdict.KEEP
    running = replace(adopting, live_invocation=LIVE)
    kept = decide(moved(), running)
    assert kept.verdict is Verdict.KEEP
    assert "INVOCATION_ID dddddddddddd names no ended run" in kept.reason
    old_run = decide(holder(100, unit=SCOPE, invocation=OLD), running)
    assert old_run.verdict is Verdict.REAP  # its INVOCATION_ID still names the ended run
    assert decide(moved(), replace(adopting, adopt=("tp-other-*.scope",))).verdict is Verdict.KEEP


def test_adopt_never_takes_another_watched_units_live_worker() -> None:
    """Another unit's live worker in an adopted scope, by its INVOCATION_ID, is never adopted.

    Same user, its INVOCATION_ID that unit's running invocation; the ledger never recorded the
    worker itself, only the other unit's run.
    """
    other_live = "e" * 32
    ledger = Ledger().record("b.service", other_live, [seen(300, "/system.slice/b.service")], 1.0)
    facts = unit_facts(
        UnitState(UNIT),
        UnitProvenance(None, frozenset({OLD}), uid=0),
        ledger.for_unit(UNIT),
        environment={},
    )
    adopting = replace(request(provenance=facts.provenance), adopt=("tp-worker-*.scope",))
    theirs = holder(301, unit="tp-worker-1.scope", invocation=other_live)
    kept = decide(theirs, adopting)
    assert kept.verdict is Verdict.KEEP
    assert "INVOCATION_ID eeeeeeeeeeee names a run of another watched unit" in kept.reason
    assert decide(moved(), adopting).verdict is Verdict.REAP  # the scope's own id: still adopted


def test_adopt_never_takes_a_login_session_or_a_run_scope() -> None:
    """Whatever glob a configuration holds, session-* and run-* scopes are never adopted."""
    for scope in ("session-3.scope", "session-c1.scope", "run-r3f2a.scope", "run-u7.scope"):
        adopting = replace(request(), adopt=("*-*.scope", "*.scope"))
        kept = decide(holder(100, unit=scope, invocation=None), adopting)
        assert kept.verdict is Verdict.KEEP, scope


@given(st.text("ab*", max_size=8), st.text("ab", max_size=10))
def test_glob_match_agrees_with_fnmatch_on_stars(pattern: str, name: str) -> None:
    """Only * is special, and it means what fnmatch means by it."""
    assert glob_match(pattern, name) == fnmatch.fnmatchcase(name, pattern)


def test_glob_match_is_linear_on_a_pathological_pattern() -> None:
    """A pattern that makes a backtracking matcher exponential costs a scan here."""
    started = time.process_time()
    assert not glob_match("*a" * 50 + "*b", "a" * 100_000)
    assert time.process_time() - started < 1.0


def test_holders_the_plan_cannot_free_block_a_recovery() -> None:
    """A stranger holding the unit's GPU is a blocker; the unit's own cgroup is not."""
    stranger = replace(holder(200, unit="run-r1.scope", invocation=None), gpus=listed(0))
    own = replace(holder(100), gpus=listed(0))
    found = inventory(nvml(gpu(0, (100, 30000), (200, 30000))))
    blockers = unfreeable(plan([own, stranger], request(live=LIVE)), found, 16 * 2**20)
    assert len(blockers) == 1
    assert blockers[0].startswith("PID 200 (python3) on GPU 0: not in sglang.service's cgroup")


def test_another_users_job_in_the_units_own_cgroup_blocks_a_recovery() -> None:
    """A shared service's tenant job (KillMode=process) survives the stop, no plan reaps it."""
    tenant = replace(holder(300, invocation=OLD, uids=TENANT), gpus=listed(0))
    found = inventory(nvml(gpu(0, (300, 30000))))
    [blocker] = unfreeable(plan([tenant], request()), found, 16 * 2**20)
    assert blocker.startswith("PID 300 (python3) on GPU 0: runs as uid 1000/1000/1000/1000")


def test_what_a_stop_frees_in_the_units_cgroup_follows_its_kill_mode() -> None:
    """Spared in the unit's cgroup: freed by a control-group or mixed stop, not by process/none.

    systemd.kill(5): control-group signals every process of the cgroup, mixed SIGKILLs all the
    main process leaves, process signals the main process alone, none nothing. A KillMode= not
    known counts as none. The tenant's job and a protected process of the unit's uid alike.
    """
    tenant = replace(holder(300, invocation=OLD, uids=TENANT), gpus=listed(0))
    protected = replace(holder(301, invocation=OLD), comm="nv-hostengine", gpus=listed(0))
    found = inventory(nvml(gpu(0, (300, 30000), (301, 30000))))
    asked = replace(request(), protected_names=("nv-hostengine",))
    spared = plan([tenant, protected], asked)
    assert [d.holder.pid for d in spared.spared] == [300, 301]

    def blocking(kill_mode: str | None, main: ProcessIdentity | None = None) -> list[str]:
        found_now = unfreeable(spared, found, 16 * 2**20, kill_mode=kill_mode, main=main)
        return [line.split(" ", 2)[1] for line in found_now]

    main = protected.identity
    assert blocking("control-group") == []
    assert blocking("mixed") == []
    assert blocking("process") == ["300", "301"]
    assert blocking("process", main=main) == ["300"]  # the stop signals the main process
    assert blocking("none", main=main) == ["300", "301"]
    assert blocking(None) == ["300", "301"]


def test_a_pid_the_main_process_was_given_later_is_not_freed_by_a_process_stop() -> None:
    """KillMode=process: a spared holder with the main process's PID but another start blocks.

    Its PID was reused between the two reads: it is not the process systemd's stop signals.
    """
    protected = replace(holder(301, invocation=OLD), comm="nv-hostengine", gpus=listed(0))
    found = inventory(nvml(gpu(0, (301, 30000))))
    spared = plan([protected], replace(request(), protected_names=("nv-hostengine",)))
    reused = ProcessIdentity(301, protected.identity.start_time + 1)
    [blocker] = unfreeable(spared, found, 16 * 2**20, kill_mode="process", main=reused)
    assert blocker.startswith("PID 301 (nv-hostengine) on GPU 0")


def listed(*gpus: int) -> tuple[GpuUse, ...]:
    """GPU uses NVML lists with 30 GB each."""
    return tuple(GpuUse(g, 30 * 2**30, listed_by_nvml=True, holds_device_file=True) for g in gpus)


def test_adopt_takes_scope_globs_only() -> None:
    """A scope glob is taken; every scope, a path or another unit type is refused."""
    import pytest  # noqa: PLC0415 - only this test raises
    from pydantic import ValidationError  # noqa: PLC0415

    from gpuguard.unitsettings import UnitSettings  # noqa: PLC0415

    assert UnitSettings(adopt=("tp-worker-*.scope",)).adopt == ("tp-worker-*.scope",)
    assert UnitSettings(adopt=("runner-*.scope",)).adopt == ("runner-*.scope",)
    for bad in ("*.scope", "**.scope", "a/b.scope", "x.service", "tp-worker-[0].scope"):
        with pytest.raises(ValidationError):
            UnitSettings(adopt=(bad,))


def test_adopt_refuses_globs_that_can_match_sessions_or_run_scopes() -> None:
    """A glob whose literal prefix a session-* or run-* name can begin with is refused."""
    import pytest  # noqa: PLC0415 - only these tests raise
    from pydantic import ValidationError  # noqa: PLC0415

    from gpuguard.unitsettings import UnitSettings  # noqa: PLC0415

    for bad in ("session-*.scope", "run-*.scope", "*-*.scope", "s*.scope", "r*.scope", "*w.scope"):
        with pytest.raises(ValidationError, match="can match"):
            UnitSettings(adopt=(bad,))


def test_the_gates_refusal_names_what_it_cannot_prove_and_the_command() -> None:
    """A worker in its own scope without a ledger record: refused, with the operator's command."""
    worker = replace(
        process(300, 0, cgroup=f"/system.slice/{SCOPE}", invocation_id=SCOPE_ID),
        uids=ROOT,
    )
    found = inventory(nvml(gpu(0, (300, 30000))), worker)
    asked = plan_request(gpu_set=frozenset({0}), provenance=UnitProvenance(None, uid=0))
    clock = [0.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    def reap(targets: object) -> tuple[()]:
        raise AssertionError(f"nothing here is provably the unit's: {targets}")

    gate = GateSettings(asked, 16 * 2**20, timeout_s=2.0, poll_s=0.5)
    refused = run_gate(gate, lambda: found, reap, lambda: clock[0], sleep)
    assert not refused.passed
    assert "held by PID 300 (python3, tp-worker-0.scope) - not touched" in refused.message
    assert "after checking them, `gpuguard reap --unit sglang.service --scope patterns`" in (
        refused.message
    )
    recorded_run = Ledger().record(UNIT, OLD, [SeenProcess(300, 1300, ROOT, "python3", "/")], 1.0)
    proven = replace(asked, provenance=replace(asked.provenance, ledger=recorded_run.claims(UNIT)))
    assert [d.holder.pid for d in plan(found.holders, proven).to_reap] == [300]


def test_the_keeper_records_soon_after_a_start_then_at_its_interval_and_stops_at_the_end() -> None:
    """Records at +1, +2, +4 … s up to every_s; an ended run is read once more, then never."""
    reads: list[float] = []
    clock = [0.0]

    def read(_group: str | None, _recorded: object) -> tuple[Walked, ...]:
        reads.append(clock[0])
        return (walked(1),)

    saved: list[Ledger] = []

    def save(ledger: Ledger) -> Ledger:
        saved.append(ledger)
        return ledger

    ports = LedgerPorts(run_processes=read, alive=lambda _i: True, save=save, every_s=5.0)
    keeper = LedgerKeeper(ports, Ledger(), lambda: clock[0])
    keeper.run_up(UNIT, OLD, f"/system.slice/{UNIT}", 0.0)
    while clock[0] < 20.0:
        due = keeper.due_in(clock[0])
        assert due is not None
        clock[0] += due
        keeper.tick(clock[0])
    assert reads == [0.0, 1.0, 3.0, 7.0, 12.0, 17.0, 22.0]
    assert len(saved) == 1  # one process, recorded once: nothing new to write after that
    keeper.run_over(UNIT, OLD, 23.0)
    assert keeper.due_in(23.0) is None
    assert dict(keeper.claims(UNIT)) == {ProcessIdentity(1, 5001): OLD}


def test_a_write_that_failed_is_tried_again_at_the_next_record() -> None:
    """The file's lock held, the disk refusing: what the keeper saw is written next time."""
    attempts: list[Ledger] = []
    refuse = [True]

    def save(ledger: Ledger) -> Ledger | None:
        attempts.append(ledger)
        return None if refuse[0] else ledger

    ports = LedgerPorts(
        run_processes=lambda _g, _r: (walked(1),), alive=lambda _i: True, save=save, every_s=5.0
    )
    keeper = LedgerKeeper(ports, Ledger(), lambda: 0.0)
    keeper.run_up(UNIT, OLD, f"/system.slice/{UNIT}", 0.0)
    assert len(attempts) == 1
    refuse[0] = False
    keeper.tick(1.0)
    assert len(attempts) == 2  # the same content, tried again
    keeper.tick(3.0)
    assert len(attempts) == 2  # written: nothing new to write


def test_a_periodic_record_is_skipped_while_no_process_was_created_since_the_last_full_one() -> (
    None
):
    """The namespace's last PID unmoved: no re-read; moved, unknown or 10 intervals on: read."""
    reads: list[float] = []
    clock = [0.0]
    last_pid: list[int | None] = [700]

    def read(_group: str | None, _recorded: object) -> tuple[Walked, ...]:
        reads.append(clock[0])
        return (walked(1),)

    ports = LedgerPorts(
        run_processes=read,
        alive=lambda _i: True,
        save=lambda ledger: ledger,
        every_s=5.0,
        last_pid=lambda: last_pid[0],
    )
    keeper = LedgerKeeper(ports, Ledger(), lambda: clock[0])

    def tick_to(moment: float) -> None:
        while True:
            due = keeper.due_in(clock[0])
            assert due is not None
            if clock[0] + due > moment:
                return
            clock[0] += due
            keeper.tick(clock[0])

    def record(moment: float, *, periodic: bool = True) -> None:
        clock[0] = moment
        keeper.record(UNIT, moment, periodic=periodic)

    keeper.run_up(UNIT, OLD, f"/system.slice/{UNIT}", 0.0)
    tick_to(12.0)
    assert reads == [0.0]  # the first steps (1, 3, 7 s) and the first period: nothing created
    last_pid[0] = 701  # a fork (or a thread) anywhere in the namespace
    tick_to(17.0)
    assert reads == [0.0, 17.0]
    record(18.0, periodic=False)  # a stop announced: always read
    record(19.0)  # nothing since then
    assert reads == [0.0, 17.0, 18.0]
    last_pid[0] = None  # the counter unreadable or not this namespace's: unsure, read
    record(20.0)
    record(21.0)
    assert reads == [0.0, 17.0, 18.0, 20.0, 21.0]
    last_pid[0] = 701
    record(22.0)  # stamped now
    for moment in range(23, 33):
        record(float(moment))
    assert reads[-2:] == [22.0, 32.0]  # read in full at least every 10th interval anyway


def test_a_run_the_caps_cut_or_whose_write_failed_is_read_in_full_each_time() -> None:
    """An exit may make room for a process that was cut; a failed write is retried at once."""
    reads: list[float] = []
    refuse = [True]
    gone: set[int] = set()

    def read(_group: str | None, _recorded: object) -> tuple[Walked, ...]:
        reads.append(0.0)
        return tuple(walked(pid) for pid in range(1, MAX_PROCESSES + 2) if pid not in gone)

    ports = LedgerPorts(
        run_processes=read,
        alive=lambda identity: identity.pid not in gone,
        save=lambda ledger: None if refuse[0] else ledger,
        every_s=5.0,
        last_pid=lambda: 700,
    )
    keeper = LedgerKeeper(ports, Ledger(), lambda: 0.0)
    keeper.run_up(UNIT, OLD, f"/system.slice/{UNIT}", 0.0)  # one more than the cap: one cut
    refuse[0] = False
    keeper.record(UNIT, 1.0, periodic=True)  # the first write failed: read and written again
    gone.add(2)
    keeper.record(UNIT, 2.0, periodic=True)  # still one cut (PID 2 is forgotten after it)
    keeper.record(UNIT, 3.0, periodic=True)  # room for the one cut: recorded
    assert MAX_PROCESSES + 1 in {p.pid for p in keeper.ledger.runs[0].processes}
    keeper.record(UNIT, 4.0, periodic=True)  # all recorded, written, nothing created: skipped
    keeper.record(UNIT, 5.0, periodic=True)
    assert len(reads) == 4


def test_a_walk_cut_short_is_never_skipped_as_if_read_whole() -> None:
    """After a walk its budgets cut, the next periodic record reads again, forks or not."""
    reads: list[float] = []
    cut: list[str | None] = ["the children of 100 threads not read"]

    def read(_group: str | None, _recorded: object) -> Walk:
        reads.append(0.0)
        return Walk((walked(1),), cut[0])

    ports = LedgerPorts(
        run_processes=read,
        alive=lambda _i: True,
        save=lambda ledger: ledger,
        every_s=5.0,
        last_pid=lambda: 700,
    )
    keeper = LedgerKeeper(ports, Ledger(), lambda: 0.0)
    keeper.run_up(UNIT, OLD, f"/system.slice/{UNIT}", 0.0)  # cut
    keeper.record(UNIT, 1.0, periodic=True)  # read again: the last one was cut
    cut[0] = None
    keeper.record(UNIT, 2.0, periodic=True)  # read again: the last one was cut
    keeper.record(UNIT, 3.0, periodic=True)  # read whole, nothing created since: skipped
    assert len(reads) == 3


def test_inside_a_pid_namespace_a_spared_device_holder_of_a_used_gpu_blocks() -> None:
    """NVML names host PIDs there: the memory is its device-file holders', and blocks a stop."""
    worker = replace(
        process(300, 0, cgroup=f"/system.slice/{SCOPE}", invocation_id=SCOPE_ID), uids=ROOT
    )
    reading = nvml(gpu(0, (987654, 30000)))  # the driver's host PID, nobody here
    found = build_inventory(
        reading, ProcScan((worker,)), 16 * 2**20, Containment(container=None, foreign_pids=True)
    )
    asked = plan_request(gpu_set=frozenset({0}), provenance=UnitProvenance(None, uid=0))
    [blocker] = unfreeable(plan(found.holders, asked), found, 16 * 2**20)
    assert blocker.startswith("PID 300 (python3) on GPU 0: not in sglang.service's cgroup")
    on_host = build_inventory(reading, ProcScan((worker,)), 16 * 2**20)
    # On the host NVML would list it: a device file alone (an exporter's) blocks nothing.
    assert unfreeable(plan(on_host.holders, asked), on_host, 16 * 2**20) == ()


def test_one_units_runs_never_push_another_units_evidence_out() -> None:
    """A unit whose every run leaves survivors drops only its own oldest runs."""
    ledger = Ledger().record("victim.service", OLD, [seen(1)], 0.0)
    for run in range(MAX_RUNS + 10):
        ledger = ledger.record(UNIT, f"{run + 1:032x}", [seen(1000 + run)], float(run + 1))
    assert dict(ledger.claims("victim.service")) == {ProcessIdentity(1, 5001): OLD}


def test_names_are_cut_when_recorded_so_no_entry_is_large() -> None:
    """A cgroup name of thousands of hostile bytes is kept only to CGROUP_CHARS."""
    hostile = "/system.slice/" + "\\xff" * 1000
    ledger = Ledger().record(UNIT, OLD, [seen(1, cgroup=hostile)], 1.0)
    assert len(ledger.runs[0].processes[0].cgroup) == CGROUP_CHARS


def test_another_units_recorded_process_is_never_adopted() -> None:
    """Unit B's live worker in a scope A adopts, with A's uid: kept, the ledger says it is B's."""
    other = Ledger().record("b.service", LIVE, [SeenProcess(100, 5100, ROOT, "python3", "/")], 1.0)
    adopting = replace(
        request(),
        adopt=("tp-worker-*.scope",),
        provenance=UnitProvenance(
            None, frozenset({OLD}), uid=0, elsewhere=other.for_unit(UNIT).elsewhere
        ),
    )
    decision = decide(moved(), adopting)
    assert decision.verdict is Verdict.KEEP
    assert "recorded it in a run of another unit" in decision.reason


def test_merging_two_writers_ledgers_loses_neither() -> None:
    """The daemon's runs and the gate server's are all kept; a shared run holds both lists."""
    worker, escaped, other = seen(10), seen(11), seen(12)
    daemon = Ledger().record(UNIT, OLD, [worker], at=1.0).record("b.service", LIVE, [other], at=2.0)
    gate = Ledger().record(UNIT, OLD, [escaped], at=3.0)
    merged = daemon.merge(gate)
    assert merged.merge(Ledger()) == merged
    assert merged.claims(UNIT) == {(worker.identity, OLD), (escaped.identity, OLD)}
    assert merged.claims("b.service") == {(other.identity, LIVE)}
    run = merged.run_of(UNIT, OLD)
    assert run is not None
    assert (run.first_seen, run.last_seen) == (1.0, 3.0)
    assert gate.merge(daemon).claims(UNIT) == merged.claims(UNIT)


def test_a_merged_process_stays_in_the_run_it_was_first_seen_in() -> None:
    """Recorded in an old run by one writer and a later one by the other: it is the old run's."""
    leftover = seen(20)
    first = Ledger().record(UNIT, OLD, [leftover], at=1.0)
    later = Ledger().record(UNIT, LIVE, [leftover], at=5.0)
    for merged in (first.merge(later), later.merge(first)):
        assert merged.claims(UNIT) == {(leftover.identity, OLD)}


def test_a_merge_keeps_the_caps() -> None:
    """Each unit keeps its newest runs, the whole its newest MAX_RUNS."""
    mine = Ledger()
    theirs = Ledger()
    for index in range(MAX_RUNS_PER_UNIT + 3):
        mine = mine.record(UNIT, f"{index:032x}", [seen(100 + index)], at=float(index))
    for index in range(MAX_RUNS + 5):
        theirs = theirs.record(f"u{index}.service", LIVE, [seen(1000 + index)], at=100.0 + index)
    merged = mine.merge(theirs)
    assert len(merged.runs) == MAX_RUNS
    assert len(mine.merge(Ledger()).runs) == MAX_RUNS_PER_UNIT
    assert mine.merge(Ledger()).runs[-1].invocation_id == f"{MAX_RUNS_PER_UNIT + 2:032x}"


def member(pid: int, run: str | None, ppid: int, start: int | None = None) -> Walked:
    """A process read from the unit's cgroup (a root of the walk), its PPID as ``stat`` says."""
    process = seen(pid) if start is None else replace(seen(pid), start_time=start)
    return Walked(process, run, None, None, ppid=ppid)


def test_cgroup_members_with_a_blank_environment_are_their_parent_members_run() -> None:
    """The EngineCore and Worker of vLLM show no INVOCATION_ID: each is its parent member's run.

    setproctitle zeroes what /proc/PID/environ shows (issue 34's real vLLM): the API server
    (own id LIVE) → EngineCore → Worker, all in the cgroup, are LIVE's; a left-over tree of OLD
    stays OLD's. A member whose PPID is a younger process (a reused PID), or no member, and a
    chain of blanks with no named end, file nothing.
    """
    walk = [
        member(10, OLD, 1),
        member(11, None, 10),  # the old run's EngineCore
        member(12, None, 11),  # its Worker
        member(20, LIVE, 1),
        member(21, None, 20),
        member(22, None, 21),
        member(30, None, 20, start=1000),  # its PPID 20 is younger than it: not its parent
        member(31, None, 99),  # PPID not in the cgroup
        member(40, None, 41),  # blanks all the way
        member(41, None, 40),
    ]
    filed = file_walk(walk)
    assert {run: [p.pid for p in procs] for run, procs in filed.items()} == {
        OLD: [10, 11, 12],
        LIVE: [20, 21, 22],
    }
    # Before: only the members that named their run were filed.
    assert file_walk([member(20, LIVE, 1), member(21, None, 20)]) == {LIVE: [seen(20), seen(21)]}
    # After the crash: the API server is gone, the EngineCore (recorded before, reparented) is a
    # root of the walk with its recorded run, and the Worker in the cgroup is its child.
    core = Walked(seen(11), None, None, OLD)
    assert file_walk([core, member(12, None, 11)]) == {OLD: [seen(11), seen(12)]}


def test_a_blank_environment_in_the_cgroup_is_judged_by_the_ledger_while_the_unit_runs() -> None:
    """While the next run runs, an unreadable member the ledger filed under an ended run is stale.

    The crash of a real vLLM under KillMode=process (issue 34): the old Worker, its environment
    blank, still holds the GPU in the cgroup while the next run loads. Filed under the ended
    run it is reaped (the daemon's sweep narrows to that run too); filed under the live run it
    is kept; with no record it is kept as before.
    """
    blank = holder(100, invocation=None)
    stale = decide(blank, request(live=LIVE, provenance=recorded(100, run=OLD)))
    assert stale.verdict is Verdict.REAP, stale.reason
    sweep = replace(request(live=LIVE, provenance=recorded(100, run=OLD)), only_invocation=OLD)
    assert decide(blank, sweep).verdict is Verdict.REAP
    live = decide(blank, request(live=LIVE, provenance=recorded(100, run=LIVE)))
    assert live.verdict is Verdict.KEEP
    assert live.reason == f"live process of the running {UNIT} (ledger)"
    unknown = decide(blank, request(live=LIVE))
    assert unknown.verdict is Verdict.KEEP
    assert "cannot be read" in unknown.reason
