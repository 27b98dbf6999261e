"""Cgroup text and paths are attributed to the right unit or container."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.core.cgroup import Attribution, attribute, parse_cgroup
from gpuguard.core.unitcontainers import Engine, container_of

DOCKER_ID = "3f4e5d6c7b8a" + "9" * 52
KUBE_ID = "a1b2c3d4e5f6" + "0" * 52
POD_UID = "8d7c6b5a-1234-4abc-9def-0123456789ab"
POD_UID_SYSTEMD = POD_UID.replace("-", "_")


def attribute_text(text: str) -> Attribution:
    """The owner of raw ``/proc/PID/cgroup`` text, as inventory and the gate server judge it."""
    return attribute(parse_cgroup(text))


def test_cgroup_v2_single_line() -> None:
    """A cgroup v2 file gives its only path."""
    assert parse_cgroup("0::/system.slice/sglang.service\n") == "/system.slice/sglang.service"


def test_hybrid_prefers_the_unified_path() -> None:
    """On a hybrid host the non-root 0:: path wins over the v1 name=systemd one."""
    text = (
        "12:memory:/system.slice/sglang.service\n"
        "1:name=systemd:/system.slice/sglang.service\n"
        "0::/system.slice/sglang.service\n"
    )
    assert parse_cgroup(text) == "/system.slice/sglang.service"


def test_hybrid_with_root_unified_path_uses_name_systemd() -> None:
    """When 0:: says only '/', the name=systemd hierarchy's path is used."""
    text = "4:memory:/x\n1:name=systemd:/user.slice/user-1000.slice/session-3.scope\n0::/\n"
    assert parse_cgroup(text) == "/user.slice/user-1000.slice/session-3.scope"


def test_legacy_v1_uses_name_systemd() -> None:
    """A pure v1 host without a 0:: line is read from name=systemd."""
    text = "5:cpu,cpuacct:/docker/abc\n1:name=systemd:/system.slice/foo.service\n"
    assert parse_cgroup(text) == "/system.slice/foo.service"


def test_root_only_paths_give_root() -> None:
    """A process in the root cgroup on every hierarchy is at '/'."""
    assert parse_cgroup("9:name=systemd:/\n4:memory:/x\n0::/\n") == "/"


def test_deleted_suffix_is_dropped() -> None:
    """A removed v2 cgroup's ' (deleted)' marker is not part of the path."""
    assert parse_cgroup("0::/system.slice/old.service (deleted)\n") == "/system.slice/old.service"


@pytest.mark.parametrize(
    "text", ["", "garbage", "::::", "\n\n", "0:", "x:y", "\x00\xff", "0::relative\n", "a::/x\n"]
)
def test_garbage_cgroup_text_is_unknown(text: str) -> None:
    """Unparseable text gives no path at all (the owner is unknown), without raising."""
    assert parse_cgroup(text) is None
    assert attribute_text(text) == Attribution(unknown=True)


def test_carriage_return_in_a_cgroup_name_forges_no_line() -> None:
    r"""Attack: a delegated cgroup named ``x\r0::sglang.service`` was read as a line of its own.

    On main ``str.splitlines`` split at the ``\r`` and the process was attributed to the system
    unit; split on ``\n`` only, the name stays one path component inside the user's manager.
    """
    path = "/user.slice/user-1000.slice/user@1000.service/app.slice/x\r0::sglang.service"
    attribution = attribute_text(f"0::{path}\n")
    assert attribution.unit != "sglang.service" or attribution.user_unit
    assert attribution.user_unit
    for breaker in ("\r", "\x0b", "\x0c", "\x1c", "\x85", "\u2028"):
        session = "/user.slice/user-1000.slice/session-3.scope"
        text = f"0::{session}/x{breaker}0::/system.slice/sglang.service\n"
        assert attribute_text(text).unit == "session-3.scope", repr(breaker)


def test_newline_in_a_cgroup_name_makes_the_owner_unknown() -> None:
    """A name with a real newline writes a second hierarchy line: the text is a forgery."""
    forged = "0::/user.slice/user-1000.slice/session-3.scope/x\n0::/system.slice/sglang.service\n"
    assert parse_cgroup(forged) is None
    hybrid = (
        "1:name=systemd:/user.slice/user-1000.slice/session-3.scope\n"
        "0::/user.slice/user-1000.slice/session-3.scope/x\n"
        "7:name=systemd:/system.slice/sglang.service\n"
    )
    assert parse_cgroup(hybrid) is None


def test_a_delegated_subtree_cannot_name_the_unit() -> None:
    """Below a unit everything is that unit's: a sub-cgroup called sglang.service is not ours."""
    attribution = attribute("/system.slice/tenant-runner.service/sglang.service")
    assert attribution.unit == "tenant-runner.service"
    assert attribute("/system.slice/sglang.service/worker").unit == "sglang.service"


@given(st.text(alphabet=st.characters(blacklist_characters="/\x00\n"), min_size=1, max_size=40))
def test_no_name_in_a_user_session_reaches_the_system_unit(name: str) -> None:
    """Whatever a user names a cgroup in their session, the owner is never the system unit."""
    text = f"0::/user.slice/user-1000.slice/session-3.scope/{name}\n"
    attribution = attribute_text(text)
    assert attribution.unit != "sglang.service" or attribution.unknown or attribution.user_unit
    assert attribution.unit in {"session-3.scope", None}


def _a(
    unit: str | None,
    *,
    user: bool = False,
    slice_: str | None = None,
    container: str | None = None,
) -> Attribution:
    """Build an expected attribution with keywords."""
    return Attribution(unit=unit, user_unit=user, slice=slice_, container=container)


CASES: list[tuple[str, Attribution]] = [
    ("/system.slice/sglang.service", _a("sglang.service", slice_="system.slice")),
    (
        "/system.slice/system-sglang.slice/sglang@0.service",
        _a("sglang@0.service", slice_="system-sglang.slice"),
    ),
    ("/system.slice/sglang.service/workers", _a("sglang.service", slice_="system.slice")),
    ("/init.scope", _a("init.scope")),
    ("/", _a(None)),
    ("", _a(None)),
    ("/system.slice", _a(None, slice_="system.slice")),
    (
        "/user.slice/user-1000.slice/session-3.scope",
        _a("session-3.scope", slice_="user-1000.slice"),
    ),
    (
        "/user.slice/user-1000.slice/user@1000.service/app.slice/foo.service",
        _a("foo.service", user=True, slice_="app.slice"),
    ),
    (
        "/user.slice/user-1000.slice/user@1000.service/init.scope",
        _a("init.scope", user=True, slice_="user-1000.slice"),
    ),
    (
        "/user.slice/user-1000.slice/user@1000.service/app.slice/app-gnome-x-12.scope",
        _a("app-gnome-x-12.scope", user=True, slice_="app.slice"),
    ),
    (
        "/user.slice/user-1000.slice/user@1000.service",
        _a("user@1000.service", slice_="user-1000.slice"),
    ),
    (
        "/system.slice/systemd-nspawn@box.service/supervisor",
        _a("systemd-nspawn@box.service", slice_="system.slice"),
    ),
    (
        "/system.slice/containerd.service",
        _a("containerd.service", slice_="system.slice"),
    ),
    # Containers.
    (f"/docker/{DOCKER_ID}", _a(None, container="docker:3f4e5d6c7b8a")),
    (
        f"/system.slice/docker-{DOCKER_ID}.scope",
        _a(None, slice_="system.slice", container="docker:3f4e5d6c7b8a"),
    ),
    (
        f"/system.slice/docker-{DOCKER_ID}.scope/system.slice/sglang.service",
        _a(None, slice_="system.slice", container="docker:3f4e5d6c7b8a"),
    ),
    (
        f"/docker/{DOCKER_ID}/docker/{KUBE_ID}",
        _a(None, container="docker:3f4e5d6c7b8a"),
    ),
    ("/docker/buildkit", _a(None)),
    ("/lxc/web1", _a(None, container="lxc:web1")),
    ("/lxc.payload.web1", _a(None, container="lxc:web1")),
    (
        "/lxc.payload.web1/system.slice/sglang.service",
        _a(None, container="lxc:web1"),
    ),
    ("/lxc.payload/web1/init.scope", _a(None, container="lxc:web1")),
    ("/lxc.monitor.web1", _a(None)),
    ("/lxc.monitor/web1", _a(None)),
    (
        f"/kubepods/burstable/pod{POD_UID}/{KUBE_ID}",
        _a(None, container=f"kubepods:{POD_UID}/a1b2c3d4e5f6"),
    ),
    (
        f"/kubepods/besteffort/pod{POD_UID}/{KUBE_ID}",
        _a(None, container=f"kubepods:{POD_UID}/a1b2c3d4e5f6"),
    ),
    (
        f"/kubepods/pod{POD_UID}/{KUBE_ID}",
        _a(None, container=f"kubepods:{POD_UID}/a1b2c3d4e5f6"),
    ),
    (
        f"/kubepods/burstable/pod{POD_UID}/crio-{KUBE_ID}",
        _a(None, container=f"kubepods:{POD_UID}/a1b2c3d4e5f6"),
    ),
    (
        (
            "/kubepods.slice/kubepods-burstable.slice/"
            f"kubepods-burstable-pod{POD_UID_SYSTEMD}.slice/cri-containerd-{KUBE_ID}.scope"
        ),
        _a(None, slice_="kubepods-burstable.slice", container=f"kubepods:{POD_UID}/a1b2c3d4e5f6"),
    ),
    (
        (
            "/kubepods.slice/kubepods-besteffort.slice/"
            f"kubepods-besteffort-pod{POD_UID_SYSTEMD}.slice/crio-{KUBE_ID}.scope"
        ),
        _a(None, slice_="kubepods-besteffort.slice", container=f"kubepods:{POD_UID}/a1b2c3d4e5f6"),
    ),
    (
        f"/kubepods.slice/kubepods-pod{POD_UID_SYSTEMD}.slice/docker-{KUBE_ID}.scope",
        _a(None, slice_="kubepods.slice", container=f"kubepods:{POD_UID}/a1b2c3d4e5f6"),
    ),
    (
        (
            "/kubepods.slice/kubepods-burstable.slice/"
            f"kubepods-burstable-pod{POD_UID_SYSTEMD}.slice/crio-conmon-{KUBE_ID}.scope"
        ),
        _a(None, slice_="kubepods-burstable.slice", container=f"kubepods:{POD_UID}"),
    ),
    (
        (
            f"/docker/{DOCKER_ID}/kubelet.slice/kubelet-kubepods.slice/"
            f"kubelet-kubepods-pod{POD_UID_SYSTEMD}.slice/cri-containerd-{KUBE_ID}.scope"
        ),
        _a(None, container="docker:3f4e5d6c7b8a"),
    ),
    (
        f"/machine.slice/libpod-{KUBE_ID}.scope",
        _a(None, slice_="machine.slice", container="podman:a1b2c3d4e5f6"),
    ),
    (
        f"/machine.slice/libpod-{KUBE_ID}.scope/container",
        _a(None, slice_="machine.slice", container="podman:a1b2c3d4e5f6"),
    ),
    (f"/libpod_parent/libpod-{KUBE_ID}", _a(None, container="podman:a1b2c3d4e5f6")),
    (
        f"/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{KUBE_ID}.scope",
        _a(
            None,
            user=True,
            slice_="user.slice",
            container="user@1000.service/podman:a1b2c3d4e5f6",
        ),
    ),
    (
        f"/machine.slice/libpod-conmon-{KUBE_ID}.scope",
        _a(f"libpod-conmon-{KUBE_ID}.scope", slice_="machine.slice"),
    ),
    (
        "/machine.slice/machine-my\\x2dbox.scope/payload/system.slice/a.service",
        _a(None, slice_="machine.slice", container="machine:my-box"),
    ),
    (
        "/system.slice/systemd-nspawn@box.service/payload/system.slice/sglang.service",
        _a(None, slice_="system.slice", container="machine:box"),
    ),
    # Paths seen from inside a cgroup namespace start with '..'.
    ("/../../system.slice/sglang.service", _a("sglang.service", slice_="system.slice")),
]


@pytest.mark.parametrize(("path", "expected"), CASES)
def test_real_world_paths_are_attributed(path: str, expected: Attribution) -> None:
    """Each recorded cgroup path form gets the expected unit, slice and container."""
    assert attribute(path) == expected


def test_container_wins_over_a_unit_name_inside_it() -> None:
    """An LXC guest's sglang.service is not the host's: the process belongs to the container."""
    attribution = attribute("/lxc.payload.guest/system.slice/sglang.service")
    assert attribution.unit is None
    assert attribution.container == "lxc:guest"


def test_unit_process_cgroup_text_names_the_unit() -> None:
    """The raw /proc/PID/cgroup text of a unit process names the unit."""
    text = "1:name=systemd:/system.slice/sglang.service\n0::/system.slice/sglang.service\n"
    assert attribute_text(text) == _a("sglang.service", slice_="system.slice")


@given(st.text())
def test_arbitrary_text_never_raises(text: str) -> None:
    """Any text at all is attributed without raising."""
    assert isinstance(attribute_text(text), Attribution)


@given(
    st.lists(
        st.sampled_from(
            [
                "system.slice",
                "docker",
                "lxc",
                "lxc.payload",
                "kubepods",
                "pod12345678",
                "user@1000.service",
                "a.service",
                "b.scope",
                "",
                "..",
                DOCKER_ID,
                f"docker-{DOCKER_ID}.scope",
            ]
        )
        | st.text(max_size=12),
        max_size=8,
    )
)
def test_arbitrary_component_mixes_never_raise(components: list[str]) -> None:
    """Paths built from real component names in any order never raise."""
    attribution = attribute("/" + "/".join(components))
    assert attribution.unit is None or attribution.container is None


def test_a_users_scope_named_like_a_container_is_never_the_system_engines() -> None:
    """A user's `systemd-run --user --scope --unit=docker-<ID>` names no system container."""
    full = "1a2b3c4d5e6f" + "0" * 52
    system = attribute(f"/system.slice/docker-{full}.scope")
    assert container_of(system.container) == (Engine.DOCKER, "1a2b3c4d5e6f")
    mine = attribute(f"/user.slice/user-1000.slice/user@1000.service/app.slice/docker-{full}.scope")
    assert mine.container == "user@1000.service/docker:1a2b3c4d5e6f"
    assert mine.user_unit
    assert container_of(mine.container) is None
    assert mine.container != system.container
