"""Whether gpuguard runs inside a container, and whether NVML's PIDs are this /proc's (pure).

The NVIDIA driver does not support PID namespaces: NVML always names processes by their PIDs
in the initial (host) namespace. Where /proc speaks for another PID namespace, an NVML PID is
only a claim about some process elsewhere; a process of the same number here is most likely an
unrelated one. The kernel gives the initial PID namespace a fixed inode number
(PROC_PID_INIT_INO, include/linux/proc_ns.h), so the namespace alone settles the question; the
container managers' own markers (``/run/systemd/container``, ``systemd-detect-virt``) only name
the container for people, since a container may share the host's PID namespace (docker
``--pid=host``) and then NVML's PIDs are this /proc's after all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The inode of the initial PID namespace (PROC_PID_INIT_INO, fixed since Linux 3.8).
INIT_PID_NAMESPACE_INODE = 0xEFFFFFFC

# What a container manager writes: systemd's container= names ("lxc", "docker",
# "systemd-nspawn", "podman" ...). Anything else is shown as "unknown", never echoed.
_MANAGER = re.compile(r"[a-z0-9][a-z0-9_.-]{0,31}")


@dataclass(frozen=True, slots=True)
class Containment:
    """Where gpuguard runs: the container's kind (None: none found) and /proc's PID namespace.

    ``foreign_pids`` is True when /proc speaks for a PID namespace other than the initial one:
    NVML's PIDs are then host PIDs, which name no process here. ``evidence`` says what told.
    """

    container: str | None
    foreign_pids: bool
    evidence: tuple[str, ...] = ()

    @property
    def summary(self) -> str:
        """One line for status: where gpuguard runs and what that means for NVML's PIDs."""
        if self.container is None and not self.foreign_pids:
            return "host (initial PID namespace): NVML's PIDs are this /proc's"
        where = f"inside a container ({self.container or 'unknown kind'})"
        pids = (
            "in its own PID namespace: NVML's PIDs are host PIDs, checked against device files"
            if self.foreign_pids
            else "sharing the host's PID namespace: NVML's PIDs are this /proc's"
        )
        return f"{where}, {pids}" + (f" [{'; '.join(self.evidence)}]" if self.evidence else "")


HOST = Containment(container=None, foreign_pids=False)


def manager_name(text: str) -> str | None:
    """The container manager a marker names (first line, trimmed); None for "none" or empty.

    A name outside the expected shape is "unknown": the marker says there is a container, but
    its text is not shown.
    """
    line = text.split("\n", 1)[0].strip()
    if not line or line == "none":
        return None
    return line if _MANAGER.fullmatch(line) else "unknown"


def judge(
    *,
    marker: str | None,
    detect_virt: str | None,
    proc_namespace: int | None,
    own_namespace: int | None,
) -> Containment:
    """Combine the evidence: systemd's marker file, systemd-detect-virt, namespace inodes.

    ``proc_namespace`` is the PID namespace of /proc/1 (the one /proc speaks for), None when
    not visible; ``own_namespace`` is gpuguard's own. Either differing from the initial
    namespace makes NVML's PIDs foreign (a nested namespace under a visible PID 1 too).
    """
    evidence: list[str] = []
    container = None
    for source, text in (("/run/systemd/container", marker), ("systemd-detect-virt", detect_virt)):
        name = None if text is None else manager_name(text)
        if name is not None:
            evidence.append(f"{source}: {name}")
            container = container or name
    foreign = False
    for what, inode in (("/proc/1", proc_namespace), ("gpuguard", own_namespace)):
        if inode is not None and inode != INIT_PID_NAMESPACE_INODE:
            evidence.append(f"PID namespace of {what}: {inode}, not the initial one")
            foreign = True
    if proc_namespace is not None and own_namespace is not None and proc_namespace != own_namespace:
        evidence.append("gpuguard's PID namespace is not /proc/1's")
        foreign = True
    return Containment(container=container, foreign_pids=foreign, evidence=tuple(evidence))
