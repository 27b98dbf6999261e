"""Say which systemd unit or container a process belongs to, from its ``/proc/PID/cgroup`` text.

Attribution decides what gpuguard may kill: a process of the watched unit is fair game, one in
somebody else's container never is. So the rules err towards "container": a unit name seen
*inside* a container (an LXC guest running its own ``sglang.service``) is the guest's unit, not
the host's, and must never be mistaken for ours. Everything here is pure and never raises.

Container forms recognised (ids shortened to their first 12 hex digits, lower case):

- ``docker:<id12>``: ``/docker/<id>`` (cgroupfs driver) and ``docker-<id>.scope`` (systemd).
- ``podman:<id12>``: ``libpod-<id>.scope`` (systemd) and ``libpod-<id>`` (cgroupfs).
- ``lxc:<name>``: ``/lxc/<name>``, ``/lxc.payload.<name>``, ``/lxc.payload/<name>``.
- ``kubepods:<pod-uid>/<id12>``: ``kubepods/<qos>/pod<uid>/<id>`` (cgroupfs) and
  ``kubepods-<qos>-pod<uid_with_underscores>.slice/<runtime>-<id>.scope`` (systemd), for the
  runtimes ``cri-containerd``, ``crio`` and ``docker``; the uid is always written with dashes.
- ``machine:<name>``: ``machine-<name>.scope`` and ``systemd-nspawn@<name>.service/payload``.

Monitors are not payloads: ``lxc.monitor*``, ``libpod-conmon-*`` and the nspawn
``supervisor`` are attributed like any host process. A process in a pod but outside any of its
containers (``crio-conmon-*``) gets ``kubepods:<uid>``. A pod is matched before the
``docker-``/``cri-containerd-`` scope inside it, so its containers always carry the pod uid.
Nested containers (docker-in-docker, kind) are named by their outermost container: the only one
the host's runtime knows.

A container form below ``user@UID.service`` is that user's: rootless podman or docker, or any
scope the user names at will (``systemd-run --user --scope --unit=docker-<ID>``). Its name
carries the manager, ``user@1000.service/docker:<id12>``, so it is never the system engine's
container of that id: ``unitcontainers.container_of`` reads no engine in it, and neither
``status`` nor the gate's blocker lines credit it to the unit's container.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNIT_SUFFIXES = (".service", ".scope", ".socket", ".mount", ".swap")
_HEX_ID = re.compile(r"[0-9a-fA-F]{12,}")
_USER_MANAGER = re.compile(r"user@[0-9]+\.service")
_DOCKER_SCOPE = re.compile(r"docker-([0-9a-fA-F]{12,})\.scope")
_LIBPOD = re.compile(r"libpod-([0-9a-fA-F]{12,})(?:\.scope)?")
_KUBE_POD_SLICE = re.compile(r"kubepods(?:-[a-z]+)?-pod([0-9a-fA-F_-]{8,})\.slice")
_KUBE_POD_DIR = re.compile(r"pod([0-9a-fA-F_-]{8,})")
_KUBE_CONTAINER = re.compile(
    r"(?:cri-containerd-|crio-|docker-|containerd-)?([0-9a-fA-F]{12,})(?:\.scope)?"
)
_MACHINE_SCOPE = re.compile(r"machine-(.+)\.scope")
_NSPAWN_SERVICE = re.compile(r"systemd-nspawn@(.+)\.service")
_UNIT_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")
_DELETED = " (deleted)"


@dataclass(frozen=True, slots=True)
class Attribution:
    """Who a cgroup path belongs to.

    ``unit`` is the innermost systemd unit (``sglang.service``, ``session-3.scope``), None
    inside a container or outside any unit. ``user_unit`` says the path lies inside a user
    manager (below ``user@UID.service``), so ``unit`` is one of that user's units.
    ``slice`` is the nearest enclosing ``.slice``; ``container`` is a stable container name.
    ``unknown`` says the cgroup could not be read or parsed: nobody may claim the process.
    """

    unit: str | None = None
    user_unit: bool = False
    slice: str | None = None
    container: str | None = None
    unknown: bool = False


def parse_cgroup(text: str) -> str | None:
    r"""Return the cgroup path systemd uses for a process, from ``/proc/PID/cgroup`` text.

    cgroup v2 has one ``0::/path`` line. Hybrid hosts also list v1 hierarchies: the ``0::``
    path is preferred when it says more than ``/``, else the ``name=systemd`` hierarchy's path.
    A v2 cgroup removed under a process ends in `` (deleted)``, which is dropped.

    A cgroup name may hold any byte but ``/`` and NUL, so a delegated subtree can write what
    looks like a line of its own: lines are split on ``\n`` only (never ``\r`` or the other
    breaks ``str.splitlines`` knows), and text with a malformed line or a hierarchy named twice
    is a forgery or garbage. Returns None when nothing trustworthy is there: the owner is then
    unknown, and an unknown owner is never reaped by unit scope.
    """
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    unified: str | None = None
    named: str | None = None
    seen: set[str] = set()
    for line in lines:
        hierarchy, sep1, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        malformed = not (sep1 and sep2 and hierarchy.isdecimal() and path.startswith("/"))
        if malformed or hierarchy in seen:
            return None
        seen.add(hierarchy)
        path = path.removesuffix(_DELETED)
        if hierarchy == "0" and not controllers:
            unified = path
        elif "name=systemd" in controllers.split(","):
            if named is not None:
                return None
            named = path
    if unified is not None and (unified != "/" or named is None):
        return unified
    return named


def _unescape(name: str) -> str:
    r"""Undo systemd's unit-name escaping (``\x2d`` is ``-``)."""
    return _UNIT_ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), name)


def _short(container_id: str) -> str:
    """Return the stable 12-digit short form of a container id."""
    return container_id[:12].lower()


def _kube(components: list[str], index: int, *, in_kubepods: bool) -> str | None:
    """Name a kubepods container when ``components[index]`` is a pod's cgroup.

    ``in_kubepods``: a ``kubepods`` hierarchy encloses ``components[index]`` (carried by the
    caller's walk, so a path of many components costs linear time, not quadratic).
    """
    here = components[index]
    match = _KUBE_POD_SLICE.fullmatch(here)
    if match is None and in_kubepods:
        match = _KUBE_POD_DIR.fullmatch(here)
    if match is None:
        return None
    uid = match.group(1).replace("_", "-").lower()
    if index + 1 < len(components):
        inner = _KUBE_CONTAINER.fullmatch(components[index + 1])
        if inner is not None:
            return f"kubepods:{uid}/{_short(inner.group(1))}"
    return f"kubepods:{uid}"


def _container_at(components: list[str], index: int, *, in_kubepods: bool) -> str | None:
    """Return the container that ``components[index]`` opens, or None."""
    here = components[index]
    after = components[index + 1] if index + 1 < len(components) else None
    result: str | None = None
    if match := _DOCKER_SCOPE.fullmatch(here):
        result = f"docker:{_short(match.group(1))}"
    elif here == "docker" and after is not None and _HEX_ID.fullmatch(after):
        result = f"docker:{_short(after)}"
    elif match := _LIBPOD.fullmatch(here):
        result = f"podman:{_short(match.group(1))}"
    elif here.startswith("lxc.payload."):
        result = f"lxc:{here.removeprefix('lxc.payload.')}" if len(here) > 12 else None
    elif here in {"lxc", "lxc.payload"} and after is not None:
        result = f"lxc:{after}"
    elif match := _MACHINE_SCOPE.fullmatch(here) or (
        _NSPAWN_SERVICE.fullmatch(here) if after == "payload" else None
    ):
        result = f"machine:{_unescape(match.group(1))}"
    else:
        result = _kube(components, index, in_kubepods=in_kubepods)
    return result


def attribute(path: str | None) -> Attribution:
    """Attribute a cgroup path (as returned by :func:`parse_cgroup`) to a unit or container.

    The unit is the first unit below the slices: whatever lies deeper is inside it (a delegated
    subtree may name its cgroups ``sglang.service`` at will). Only below ``user@UID.service``
    do the names come from a manager again, the user's own, whose units are marked user units.
    """
    if path is None:
        return Attribution(unknown=True)
    components = [c for c in path.split("/") if c and c not in {".", ".."}]
    unit: str | None = None
    slice_: str | None = None
    manager: str | None = None
    in_kubepods = False
    for index, component in enumerate(components):
        container = _container_at(components, index, in_kubepods=in_kubepods)
        in_kubepods = in_kubepods or component.startswith("kubepods")
        if container is not None:
            if manager is not None:  # the user's own: never a system engine's container
                container = f"{manager}/{container}"
            user = manager is not None
            return Attribution(unit=None, user_unit=user, slice=slice_, container=container)
        if unit is not None:
            continue
        if component.endswith(".slice"):
            slice_ = component
        elif component.endswith(_UNIT_SUFFIXES):
            if (
                _USER_MANAGER.fullmatch(component)
                and index + 1 < len(components)
                and manager is None
            ):
                # Below user@UID.service the user's own manager names the units.
                manager = component
                continue
            unit = component
    return Attribution(unit=unit, user_unit=manager is not None, slice=slice_)
