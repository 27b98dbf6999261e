"""Who may ask the gate server for what: decided from the caller's kernel facts alone."""

from __future__ import annotations

from gpuguard.core.cgroup import attribute
from gpuguard.core.gateauth import Caller, may_ask, refusal
from gpuguard.core.gateproto import Request


def caller(cgroup: str, uid: int = 1000) -> Caller:
    """A caller in ``cgroup`` as ``uid``."""
    return Caller(pid=4242, uid=uid, attribution=attribute(cgroup), environment={})


GATE_A = Request("gate", "sglang-a.service")


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


def test_root_outside_any_service_is_the_operator() -> None:
    """A root shell, sudo, a transient scope: any unit, any scope."""
    for cgroup in ("/", "/user.slice/user-0.slice/session-3.scope", "/init.scope"):
        wide = Request("reap", "sglang-a.service", scope="all")
        assert refusal(wide, caller(cgroup, uid=0)) is None, cgroup


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
        assert f"(scope {scope} only from root outside any service)" in reason


def test_a_forged_cgroup_name_is_escaped() -> None:
    """A delegated cgroup's name is foreign text: no newline reaches the line."""
    reason = refusal(GATE_A, caller("/system.slice/x\nforged.service"))
    assert reason is not None
    assert "\n" not in reason


def test_only_operators_and_system_services_may_ask_at_all() -> None:
    """A login session or a user's own unit is hung up on before a byte is read from it."""
    assert may_ask(caller("/system.slice/sglang-a.service"))
    assert may_ask(caller("/user.slice/user-0.slice/session-3.scope", uid=0))
    assert not may_ask(caller("/user.slice/user-1000.slice/session-3.scope"))
    user_unit = "/user.slice/user-1000.slice/user@1000.service/app.slice/x.service"
    assert not may_ask(caller(user_unit))
    assert not may_ask(caller("/system.slice/docker-0123456789abcdef0123.scope", uid=0))
