"""Kill policy: refusals first, the unit's GPU set, then the scope; every verdict has a reason."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.core.cgroup import Attribution
from gpuguard.core.inventory import GpuUse, Holder
from gpuguard.core.policy import PlanRequest, Scope, Verdict, decide, name_shows, plan
from gpuguard.core.values import ProcessIdentity, UnitProvenance

UNIT = "sglang.service"
PROTECTED = ("nvidia-persistenced", "Xorg", "gpuguard")
LIVE = "a" * 32
OLD = "b" * 32
OTHER = "c" * 32  # a run of another unit
ROOT = (0, 0, 0, 0)
TENANT = (1000, 1000, 1000, 1000)
PROVEN = UnitProvenance(None, frozenset({OLD}), uid=0)


def holder(
    pid: int = 100,
    *,
    unit: str | None = UNIT,
    container: str | None = None,
    user_unit: bool = False,
    gpus: tuple[int, ...] = (0,),
    comm: str = "python3",
    cmdline: tuple[str, ...] = ("python3", "-m", "sglang.launch_server"),
    ppid: int = 50,
    invocation: str | None = OLD,
    kernel_thread: bool = False,
    uids: tuple[int, ...] = ROOT,
    unknown: bool = False,
) -> Holder:
    """A GPU holder with the attributes the policy looks at."""
    return Holder(
        identity=ProcessIdentity(pid, 5000 + pid),
        ppid=ppid,
        state="S",
        user="root",
        comm=comm,
        cmdline=cmdline,
        attribution=Attribution(
            unit=unit, user_unit=user_unit, container=container, unknown=unknown
        ),
        invocation_id=invocation,
        gpus=tuple(GpuUse(g, None, listed_by_nvml=False, holds_device_file=True) for g in gpus),
        device_files=frozenset(f"/dev/nvidia{g}" for g in gpus),
        kernel_thread=kernel_thread,
        uids=uids,
    )


def request(
    scope: Scope = Scope.UNIT,
    *,
    gpu_set: frozenset[int] | None = frozenset({0, 1, 2, 3}),
    untouchable: frozenset[int] = frozenset({4242}),
    live: str | None = None,
    provenance: UnitProvenance = PROVEN,
    unit: str = UNIT,
) -> PlanRequest:
    """A plan request for the watched unit."""
    return PlanRequest(
        unit=unit,
        scope=scope,
        patterns=("sglang",),
        gpu_set=gpu_set,
        protected_names=PROTECTED,
        untouchable_pids=untouchable,
        provenance=provenance,
        live_invocation=live,
    )


def test_left_over_in_unit_cgroup_is_reaped() -> None:
    """At gate time every process in the unit's cgroup is left over from an earlier run."""
    decision = decide(holder(), request())
    assert decision.verdict is Verdict.REAP
    assert "left over from an earlier run of sglang.service" in decision.reason


def test_live_invocation_is_kept() -> None:
    """While the unit runs, its current invocation's processes are live and kept."""
    assert decide(holder(invocation=LIVE), request(live=LIVE)).verdict is Verdict.KEEP
    assert decide(holder(invocation=OLD), request(live=LIVE)).verdict is Verdict.REAP
    unknown = decide(holder(invocation=None), request(live=LIVE))
    assert unknown.verdict is Verdict.KEEP
    assert "cannot be read" in unknown.reason


def test_gate_and_its_ancestors_are_refused() -> None:
    """The gate runs inside the unit's cgroup: it and its ancestors are never reaped."""
    decision = decide(holder(4242), request())
    assert decision.verdict is Verdict.REFUSE
    assert "ancestors" in decision.reason


def test_protected_process_is_refused_even_in_scope_all() -> None:
    """nvidia-persistenced is never signalled, whatever the scope."""
    persistenced = holder(comm="nvidia-persistenced", cmdline=("/usr/bin/nvidia-persistenced",))
    decision = decide(persistenced, request(Scope.ALL))
    assert decision.verdict is Verdict.REFUSE
    assert "protected" in decision.reason


def test_other_units_gpus_are_kept() -> None:
    """A holder only of GPUs outside the unit's set is kept, even in scope all."""
    other = holder(unit="sglang-b.service", gpus=(4, 5))
    decision = decide(other, request(Scope.ALL))
    assert decision.verdict is Verdict.KEEP
    assert "outside sglang.service's GPUs 0,1,2,3" in decision.reason


def test_other_unit_on_our_gpus_is_kept_in_unit_scope() -> None:
    """Another service's process on our GPUs is kept unless the scope reaches it."""
    other = holder(unit="training.service", cmdline=("python3", "train.py"))
    assert decide(other, request()).verdict is Verdict.KEEP
    assert decide(other, request(Scope.PATTERNS)).verdict is Verdict.KEEP
    assert decide(other, request(Scope.ALL)).verdict is Verdict.REAP


def test_orphan_from_an_ended_run_is_reaped() -> None:
    """Outside the cgroup, an ended run's INVOCATION_ID and the unit's uid prove a left-over."""
    orphan = holder(unit=None, ppid=1, cmdline=("sglang::scheduler_TP0",))
    decision = decide(orphan, request())
    assert decision.verdict is Verdict.REAP
    assert "left over from an earlier run of sglang.service (invocation bbbbbbbbbbbb" in (
        decision.reason
    )


def test_tenants_own_server_matching_the_pattern_is_spared() -> None:
    """Attack: another user's `nohup python -m sglang.launch_server` (PPID 1, in their session).

    Main SIGTERMed it as "orphan matching 'sglang'"; a pattern is no evidence of provenance,
    and even the operator's ``--scope patterns`` (the command status names) asks for the unit's
    processes, never another user's: only ``--scope all`` reaches it.
    """
    tenant = holder(unit="session-7.scope", ppid=1, invocation=None, uids=TENANT)
    decision = decide(tenant, request())
    assert decision.verdict is Verdict.KEEP
    assert "matching 'sglang' is no evidence" in decision.reason
    assert "its environment names no INVOCATION_ID" in decision.reason
    by_pattern = decide(tenant, request(Scope.PATTERNS))
    assert by_pattern.verdict is Verdict.KEEP
    assert "runs as uid 1000/1000/1000/1000, not as sglang.service's user (uid 0)" in (
        by_pattern.reason
    )
    assert decide(tenant, request(Scope.ALL)).verdict is Verdict.REAP  # explicit choice


def test_a_borrowed_invocation_id_does_not_make_another_users_process_killable() -> None:
    """INVOCATION_ID is only an environment variable: without the unit's uid it proves nothing."""
    forged = holder(unit="session-7.scope", ppid=1, invocation=OLD, uids=TENANT)
    decision = decide(forged, request())
    assert decision.verdict is Verdict.KEEP
    assert "runs as uid 1000/1000/1000/1000, not as sglang.service's user (uid 0)" in (
        decision.reason
    )
    setuid = holder(unit=None, ppid=1, invocation=OLD, uids=(1000, 0, 0, 0))
    assert decide(setuid, request()).verdict is Verdict.KEEP
    unresolved = UnitProvenance(None, frozenset({OLD}), uid=None)
    decision = decide(holder(unit=None, ppid=1), request(provenance=unresolved))
    assert decision.verdict is Verdict.KEEP
    assert "User= could not be resolved" in decision.reason


def test_two_gates_never_claim_one_process() -> None:
    """An invocation id belongs to one unit: of two units' gates only its own reaps an orphan."""
    orphan = holder(unit=None, ppid=1, invocation=OTHER)
    mine = decide(orphan, request())
    theirs = decide(
        orphan,
        request(unit="sglang-b.service", provenance=UnitProvenance(None, frozenset({OTHER}), 0)),
    )
    assert mine.verdict is Verdict.KEEP
    assert "names no ended run of sglang.service" in mine.reason
    assert theirs.verdict is Verdict.REAP


def test_the_live_run_outside_its_cgroup_is_kept() -> None:
    """A process carrying the running invocation's id is live, inside the cgroup or not."""
    decision = decide(holder(unit=None, ppid=1, invocation=LIVE), request(live=LIVE))
    assert decision.verdict is Verdict.KEEP
    assert decision.reason == "live process of the running sglang.service"


def test_unknown_cgroup_is_never_reaped_by_unit_scope() -> None:
    """Attack: forged or unparseable cgroup text makes the owner unknown, and unknown is kept."""
    decision = decide(holder(unit=None, ppid=1, unknown=True), request())
    assert decision.verdict is Verdict.KEEP
    assert "owner unknown" in decision.reason


def test_nothing_in_the_cgroup_is_reaped_when_systemd_cannot_be_asked() -> None:
    """Attack: with systemctl failing, `reap --unit` took every cgroup member for a left-over."""
    blind = UnitProvenance("systemctl show sglang.service: Failed to connect to bus")
    decision = decide(holder(invocation=LIVE), request(provenance=blind))
    assert decision.verdict is Verdict.KEEP
    assert "systemd's view of sglang.service is unknown (systemctl show" in decision.reason
    assert "nothing in its cgroup is reaped" in decision.reason
    assert decide(holder(unit=None, ppid=1), request(provenance=blind)).verdict is Verdict.KEEP


def test_session_process_without_provenance_is_kept() -> None:
    """An operator's sglang in a shell session is kept in unit scope: nothing ties it to us."""
    manual = holder(
        unit="session-4.scope", ppid=3000, cmdline=("python3", "-m", "sglang"), invocation=None
    )
    assert decide(manual, request()).verdict is Verdict.KEEP
    assert decide(manual, request(Scope.PATTERNS)).verdict is Verdict.REAP


def test_patterns_reap_nothing_outside_the_cgroup_when_the_units_user_is_unknown() -> None:
    """A User= that resolves to no uid: a matching name outside the cgroup is kept, with why.

    A stopped DynamicUser= unit, say: no uid can prove a process is the unit's, and a name is
    no proof; ``--scope all`` stays the operator's explicit choice.
    """
    manual = holder(
        unit="session-4.scope", ppid=3000, cmdline=("python3", "-m", "sglang"), invocation=None
    )
    unknown = replace(PROVEN, uid=None)
    decision = decide(manual, request(Scope.PATTERNS, provenance=unknown))
    assert decision.verdict is Verdict.KEEP
    assert "sglang.service's User= could not be resolved to a uid" in decision.reason
    assert decide(manual, request(Scope.ALL, provenance=unknown)).verdict is Verdict.REAP


def test_children_of_a_reaped_orphan_are_reaped() -> None:
    """TP workers forked by a stale orphan inherit its staleness, transitively."""
    parent = holder(10, unit=None, ppid=1, cmdline=("sglang::scheduler_TP0",))
    child = holder(11, unit=None, ppid=10, cmdline=("python3", "worker.py"), invocation=None)
    grandchild = holder(12, unit=None, ppid=11, cmdline=("python3", "worker.py"), invocation=None)
    foreign = holder(13, unit="other.service", ppid=10, cmdline=("python3", "worker.py"))
    other_user = holder(14, unit=None, ppid=10, invocation=None, uids=TENANT)
    result = plan([grandchild, child, parent, foreign, other_user], request())
    assert {d.holder.pid for d in result.to_reap} == {10, 11, 12}
    assert "child of reaped PID 11" in next(d.reason for d in result.to_reap if d.holder.pid == 12)


def test_container_is_kept_in_unit_scope() -> None:
    """A container's process matching the patterns is not ours in unit scope."""
    boxed = holder(unit=None, container="docker:0123456789ab", ppid=1)
    decision = decide(boxed, request())
    assert decision.verdict is Verdict.KEEP
    assert "docker:0123456789ab" in decision.reason


def test_plan_splits_reaped_and_spared() -> None:
    """A plan lists every holder once, split into reaped and spared."""
    holders = [holder(10), holder(11, comm="Xorg", cmdline=("Xorg",)), holder(12, unit="x.service")]
    result = plan(holders, request())
    assert [d.holder.pid for d in result.to_reap] == [10]
    assert [d.holder.pid for d in result.spared] == [11, 12]


holders_strategy = st.builds(
    holder,
    pid=st.integers(min_value=1, max_value=5000),
    unit=st.sampled_from([UNIT, "other.service", "session-1.scope", "init.scope", None]),
    container=st.sampled_from([None, None, "docker:0123456789ab", "lxc:box"]),
    user_unit=st.booleans(),
    gpus=st.lists(st.integers(0, 7), max_size=3, unique=True).map(tuple),
    comm=st.sampled_from(["python3", "nvidia-persistenced", "Xorg", "gpuguard", "sglang::sched"]),
    cmdline=st.sampled_from([("python3", "-m", "sglang"), ("train.py",), ()]),
    ppid=st.sampled_from([0, 1, 2, 77]),
    invocation=st.sampled_from([LIVE, OLD, OTHER, None]),
    kernel_thread=st.booleans(),
    uids=st.sampled_from([ROOT, TENANT, (0, 1000, 0, 0), ()]),
    unknown=st.booleans(),
)
requests_strategy = st.builds(
    request,
    scope=st.sampled_from(list(Scope)),
    gpu_set=st.sampled_from([None, frozenset({0, 1, 2, 3}), frozenset({4, 5, 6, 7})]),
    untouchable=st.frozensets(st.integers(1, 5000), max_size=5),
    live=st.sampled_from([None, LIVE]),
    provenance=st.sampled_from(
        [PROVEN, UnitProvenance("no bus"), UnitProvenance(None, frozenset({OLD, LIVE}), None)]
    ),
)


@given(
    st.lists(holders_strategy, max_size=8),
    requests_strategy,
    st.sampled_from([None, OLD, OTHER]),
)
def test_invariants_hold_for_any_holders(
    holders: list[Holder], req: PlanRequest, only: str | None
) -> None:
    """No refused kind of process is ever reaped, and every holder gets one reasoned verdict.

    A sweep of one ended run (``only_invocation``) reaps nothing but that run's processes.
    """
    req = replace(req, only_invocation=only)
    result = plan(holders, req)
    assert len(result.decisions) == len({h.pid for h in holders})
    verdicts = {d.holder.pid: d for d in result.decisions}
    for decision in result.decisions:
        assert decision.reason
        if decision.verdict is not Verdict.REAP:
            continue
        h = decision.holder
        assert only is None or h.invocation_id == only
        assert h.pid not in (1, 2)
        assert not h.kernel_thread
        assert h.pid not in req.untouchable_pids
        assert h.comm not in PROTECTED
        if req.gpu_set is not None and h.gpus:
            assert {u.gpu_index for u in h.gpus} & req.gpu_set
        in_unit = h.attribution.unit == UNIT and not h.attribution.user_unit
        in_unit = in_unit and h.attribution.container is None and not h.attribution.unknown
        if in_unit and req.live_invocation is not None:
            assert h.invocation_id not in (req.live_invocation, None)
        if in_unit:
            assert set(h.uids) == {req.provenance.uid}, "another uid is never the unit's"
        if req.scope is Scope.UNIT:
            assert req.provenance.problem is None
            assert not h.attribution.unknown
        if req.scope is Scope.UNIT and not in_unit:
            parent = verdicts.get(h.ppid)
            inherited = parent is not None and parent.verdict is Verdict.REAP
            proven = h.invocation_id in req.provenance.invocations
            assert inherited or (proven and set(h.uids) == {req.provenance.uid})
            assert h.invocation_id != req.live_invocation or inherited
            assert h.attribution.container is None
            assert not (h.attribution.unit or "").endswith(".service")


def test_a_sweep_of_one_ended_run_takes_exactly_its_processes() -> None:
    """only_invocation: the ended run's processes, in the cgroup or out; nothing else stale."""
    proven = UnitProvenance(None, frozenset({OLD, OTHER}), uid=0)
    sweep = replace(request(live=LIVE, provenance=proven), only_invocation=OLD)
    in_cgroup = holder(10, invocation=OLD)
    escaped = holder(11, unit=None, ppid=1, invocation=OLD)
    earlier = holder(12, unit=None, ppid=1, invocation=OTHER)  # stale, but another run's
    unreadable = holder(13, invocation=None)  # in the cgroup, its run unknown
    live = holder(14, invocation=LIVE)
    child = holder(15, unit=None, ppid=12, invocation=None)  # would inherit from a reaped 12
    result = plan([in_cgroup, escaped, earlier, unreadable, live, child], sweep)
    assert {d.holder.pid for d in result.to_reap} == {10, 11}
    reasons = {d.holder.pid: d.reason for d in result.spared}
    assert f"not of the ended run {OLD[:12]}" in reasons[12]
    assert "invocation unknown" in reasons[13]
    assert "invocation unknown" in reasons[15]
    # Without the narrowing, the other ended run and its child would go too.
    wide = plan([earlier, child], request(live=LIVE, provenance=proven))
    assert {d.holder.pid for d in wide.to_reap} == {12, 15}


def test_another_users_process_in_the_units_cgroup_is_never_the_units() -> None:
    """A shared KillMode=process service (cron.service): another uid's job is kept, in any scope.

    The unit runs as root (User= unset); its own stale process goes, a tenant's job and a
    setuid program started by the tenant stay, whatever the scope and whether the unit runs.
    """
    cron = "cron.service"
    own = holder(10, unit=cron, invocation=OLD, uids=ROOT)
    tenant = holder(11, unit=cron, invocation=OLD, uids=TENANT)
    setuid = holder(12, unit=cron, invocation=OLD, uids=(1000, 0, 0, 0))
    for scope in Scope:
        for live in (None, LIVE):
            result = plan([own, tenant, setuid], request(scope, unit=cron, live=live))
            assert {d.holder.pid for d in result.to_reap} == {10}, (scope, live)
            reasons = {d.holder.pid: d.reason for d in result.spared}
            assert (
                "runs as uid 1000/1000/1000/1000, not as cron.service's user (uid 0)"
                in (reasons[11])
            )
            assert "runs as uid 1000/0/0/0" in reasons[12]


def test_a_unit_whose_user_cannot_be_resolved_reaps_nothing_in_its_cgroup() -> None:
    """No uid to compare with: nothing in the cgroup is the unit's for certain."""
    unresolved = UnitProvenance(None, frozenset({OLD}), uid=None)
    decision = decide(holder(10), request(provenance=unresolved))
    assert decision.verdict is Verdict.KEEP
    assert "User= could not be resolved to a uid" in decision.reason


@pytest.mark.parametrize(
    ("comm", "pattern", "shows"),
    [
        ("VLLM::EngineCor", "VLLM::EngineCore", True),  # real vLLM 0.32.0's engine (issue 34)
        ("VLLM::EngineCor", "EngineCore", True),
        ("VLLM::Worker_TP", "VLLM::Worker", True),
        ("sglang::schedul", "sglang::scheduler", True),
        ("sglang::detoken", "sglang::detokenizer", True),
        ("VLLM::EngineCo", "VLLM::EngineCore", False),  # 14 bytes: not cut, so not the engine
        ("python3-my-sgla", "sglang", False),  # 4 bytes of it shown: too little to say
        ("abcdefghVLLM::E", "VLLM::EngineCore", False),  # 7 bytes shown
        ("abcdefgVLLM::En", "VLLM::EngineCore", True),  # 8 bytes shown
        ("VLLM::EngineCor", "VLLM::Worker", False),
    ],
)
def test_a_pattern_is_seen_in_a_name_the_kernel_cut(comm: str, pattern: str, shows: bool) -> None:
    """A 15-byte name may be cut: it shows a pattern whose start (8 bytes or more) ends it."""
    assert name_shows(comm, pattern) is shows
