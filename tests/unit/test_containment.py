"""Telling a container from a host: the markers name it, the PID namespace decides (pure)."""

from __future__ import annotations

from gpuguard.core.containment import INIT_PID_NAMESPACE_INODE, judge, manager_name

OTHER_NS = 4026532512


def test_a_host_is_a_host() -> None:
    """No marker, detect-virt says none, both namespaces initial."""
    found = judge(
        marker=None,
        detect_virt="none\n",
        proc_namespace=INIT_PID_NAMESPACE_INODE,
        own_namespace=INIT_PID_NAMESPACE_INODE,
    )
    assert (found.container, found.foreign_pids, found.evidence) == (None, False, ())
    assert found.summary == "host (initial PID namespace): NVML's PIDs are this /proc's"


def test_lxc_with_its_own_pid_namespace_makes_nvml_pids_foreign() -> None:
    """The Proxmox case: the marker says lxc, /proc/1 sits in another PID namespace."""
    found = judge(
        marker="lxc\n", detect_virt="lxc\n", proc_namespace=OTHER_NS, own_namespace=OTHER_NS
    )
    assert found.container == "lxc"
    assert found.foreign_pids
    assert found.summary.startswith(
        "inside a container (lxc), in its own PID namespace: NVML's PIDs are host PIDs"
    )
    assert f"PID namespace of /proc/1: {OTHER_NS}, not the initial one" in found.evidence


def test_a_container_sharing_the_hosts_pid_namespace_keeps_nvml_pids() -> None:
    """With docker --pid=host: a container, but NVML's PIDs are this /proc's."""
    found = judge(
        marker=None,
        detect_virt="docker\n",
        proc_namespace=None,
        own_namespace=INIT_PID_NAMESPACE_INODE,
    )
    assert (found.container, found.foreign_pids) == ("docker", False)
    assert "sharing the host's PID namespace" in found.summary


def test_a_pid_namespace_without_any_marker_still_counts() -> None:
    """Under unshare --pid --mount-proc: no manager wrote a marker, the namespace alone decides."""
    found = judge(marker=None, detect_virt=None, proc_namespace=OTHER_NS, own_namespace=OTHER_NS)
    assert found.foreign_pids
    assert found.summary.startswith("inside a container (unknown kind)")


def test_a_nested_namespace_under_a_visible_pid_1_counts() -> None:
    """The namespace of gpuguard differs from /proc/1's."""
    found = judge(
        marker=None,
        detect_virt="none",
        proc_namespace=INIT_PID_NAMESPACE_INODE,
        own_namespace=OTHER_NS,
    )
    assert found.foreign_pids
    assert "gpuguard's PID namespace is not /proc/1's" in found.evidence


def test_a_marker_is_never_echoed_unless_it_is_a_plain_name() -> None:
    """A marker is root's, but its text still reaches a terminal only as a known shape."""
    assert manager_name("systemd-nspawn\n") == "systemd-nspawn"
    assert manager_name("none\n") is None
    assert manager_name("") is None
    assert manager_name("\x1b[2Jevil\n") == "unknown"
    assert manager_name("a" * 100) == "unknown"
    assert manager_name("podman\ntrailing") == "podman"
