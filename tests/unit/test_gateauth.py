"""Who may ask the gate server for what: decided from the caller's kernel facts alone."""

from __future__ import annotations

from gpuguard.core.cgroup import attribute, parse_cgroup
from gpuguard.core.gate.auth import Caller, admission, refusal
from gpuguard.core.gate.proto import Request


def caller(cgroup: str, uid: int = 1000, *, control: bool | None = True) -> Caller:
    """A caller in ``cgroup`` as ``uid``; ``control``: systemd names it its unit's ControlPID=."""
    return Caller(
        pid=4242,
        uid=uid,
        attribution=attribute(cgroup),
        environment={},
        cgroup=cgroup,
        control=control,
    )


SESSIONS = (
    "/user.slice/user-0.slice/session-3.scope",  # ssh root@host, a console login
    "/user.slice/user-1000.slice/session-c2.scope",  # sudo from alice's session keeps its scope
)
NOT_OPERATORS = (
    "/init.scope",
    "/system.slice/run-r0123456789abcdef.scope",  # systemd-run --scope
    "/system.slice/nerdctl-0123456789abcdef0123.scope",
    "/system.slice/cri-containerd-0123456789abcdef0123.scope",
    "/system.slice/runc-0123456789abcdef0123.scope",
    "/system.slice/crun-0123456789abcdef0123.scope",
    "/system.slice/apptainer-4242.scope",
    "/default/0123456789abcdef0123",  # containerd with the cgroupfs driver
    "/user.slice/user-0.slice/user@0.service/app.slice/app-x.scope",  # root's own user units
    "/user.slice/session-3.scope",  # not in a user's slice
    "/system.slice/sshd.service/user.slice/user-0.slice/session-3.scope",  # a delegated copy
    "/system.slice/cron.service",
)


GATE_A = Request("gate", "sglang-a.service")


def test_only_the_units_control_process_asks_for_it() -> None:
    """Another process of sglang-a (a worker, another user's job) is refused, saying why."""
    for control in (False, None):
        reason = refusal(GATE_A, caller("/system.slice/sglang-a.service", control=control))
        assert reason is not None
        assert "only the unit's control process" in reason, reason


def test_a_unit_may_ask_for_itself() -> None:
    """ExecStartPre= of sglang-a asks for sglang-a, as any user."""
    assert refusal(GATE_A, caller("/system.slice/sglang-a.service")) is None
    assert refusal(GATE_A, caller("/system.slice/sglang-a.service", uid=0)) is None


def test_a_unit_asking_for_another_is_refused_in_one_line() -> None:
    """The issue's own example line."""
    reason = refusal(GATE_A, caller("/system.slice/sglang-b.service"))
    assert reason == "gate request for sglang-a.service from a process of sglang-b.service: refused"


def test_root_inside_another_service_is_no_operator() -> None:
    """Uid 0 alone is not enough: a root service is still a service."""
    reason = refusal(GATE_A, caller("/system.slice/cron.service", uid=0))
    assert reason == "gate request for sglang-a.service from a process of cron.service: refused"


def test_root_in_a_login_session_or_the_root_cgroup_is_the_operator() -> None:
    """Root by ssh, by sudo from anyone's session, or in / itself: any unit, any scope."""
    for cgroup in ("/", *SESSIONS):
        assert caller(cgroup, uid=0).is_operator, cgroup
        wide = Request("reap", "sglang-a.service", scope="all")
        assert refusal(wide, caller(cgroup, uid=0)) is None, cgroup
        assert admission(caller(cgroup, uid=0), watched=False) is None, cgroup


def test_root_in_a_scope_that_is_no_session_is_no_operator() -> None:
    """A transient scope or a container runtime's scope gpuguard does not recognise: refused."""
    for cgroup in NOT_OPERATORS:
        root = caller(cgroup, uid=0)
        assert not root.is_operator, cgroup
        wide = Request("reap", "sglang-a.service", scope="all")
        assert refusal(wide, root) is not None, cgroup
        if root.system_service is None:
            said = admission(root, watched=True)
            assert said is not None, cgroup
            assert said.endswith(
                "(root is an operator only as root in a login session (ssh, or sudo from one))"
            ), said
    unknown = Caller(pid=1, uid=0, attribution=attribute(parse_cgroup("garbage")), environment={})
    assert not unknown.is_operator
    assert not caller("/user.slice/user-0.slice/session-3.scope", uid=1000).is_operator


def test_other_users_outside_services_containers_and_user_units_are_refused() -> None:
    """A tenant's shell, a container, a user manager's unit of the same name."""
    cases = {
        "/user.slice/user-1000.slice/session-3.scope": "a process of session-3.scope",
        "/": "a process outside any service (uid 1000)",
        "/system.slice/docker-0123456789abcdef0123.scope": "a process in container docker:",
        "/user.slice/user-1000.slice/user@1000.service/app.slice/sglang-a.service": (
            "a process of user unit sglang-a.service"
        ),
    }
    for cgroup, said in cases.items():
        reason = refusal(GATE_A, caller(cgroup))
        assert reason is not None, cgroup
        assert said in reason, reason
    root_in_container = caller("/system.slice/docker-0123456789abcdef0123.scope", uid=0)
    assert refusal(GATE_A, root_in_container) is not None


def test_a_unit_may_not_widen_the_scope() -> None:
    """Scope patterns/all reach other users' processes: not for the unit to ask."""
    for scope in ("patterns", "all"):
        reason = refusal(
            Request("reap", "sglang-a.service", scope=scope),
            caller("/system.slice/sglang-a.service", uid=0),
        )
        assert reason is not None
        assert f"(scope {scope} only from root in a login session (ssh, or sudo from one))" in (
            reason
        )


def test_a_forged_cgroup_name_is_escaped() -> None:
    """A delegated cgroup's name is foreign text: no newline reaches the line."""
    reason = refusal(GATE_A, caller("/system.slice/x\nforged.service"))
    assert reason is not None
    assert "\n" not in reason


def test_only_operators_and_watched_system_services_may_ask_at_all() -> None:
    """A login session, a user's own unit or an unwatched service is hung up on at once."""
    assert admission(caller("/system.slice/sglang-a.service"), watched=True) is None
    assert (
        admission(caller("/user.slice/user-0.slice/session-3.scope", uid=0), watched=False) is None
    )
    assert admission(caller("/user.slice/user-1000.slice/session-3.scope"), watched=True) == (
        "request from a process of session-3.scope: refused"
    )
    user_unit = "/user.slice/user-1000.slice/user@1000.service/app.slice/x.service"
    assert admission(caller(user_unit), watched=True) is not None
    container = caller("/system.slice/docker-0123456789abcdef0123.scope", uid=0)
    assert admission(container, watched=True) is not None


def test_an_unwatched_service_gets_one_refusal_line() -> None:
    """cron.service is neither configured nor gated: its jobs, root's or a tenant's, are refused."""
    for uid in (0, 1000):
        said = admission(caller("/system.slice/cron.service", uid=uid), watched=False)
        assert said == (
            "request from a process of cron.service: refused (cron.service is not watched by "
            "gpuguard: neither configured nor with its gate drop-in installed)"
        )
