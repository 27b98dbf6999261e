"""The gate drop-in for a watched unit: its text, and installing or removing it on request.

gpuguard never changes another package's unit by itself; `gpuguard install-gate` writes this
one file into the unit's drop-in directory when an operator asks, and `remove-gate` deletes
only a file that is still byte for byte what gpuguard wrote. `systemd/gpuguard-gate.conf` in
the source tree is this text rendered for the packaged binary (a test keeps the two identical).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from gpuguard.adapters import files, systemd
from gpuguard.core.stopbudget import DROP_IN
from gpuguard.core.unitname import UNIT_NAME

SYSTEMD_DIR = Path("/etc/systemd/system")
FILE_NAME = "gpuguard-gate.conf"
_MAX_BYTES = 64 * 1024
MARKER = "# gpuguard drop-in for a GPU inference unit (SGLang, vLLM)."

# The stop reap's waits, from their one home; it fits them into the unit's TimeoutStopSec=.
_STOP_REAP = f"--yes --grace {DROP_IN.grace_s:g} --timeout {DROP_IN.timeout_s:g}"

_TEMPLATE = f"""\
{MARKER}
# Install:  gpuguard install-gate --unit sglang.service
# Undo:     gpuguard remove-gate --unit sglang.service
# (or copy this file to /etc/systemd/system/UNIT.d/ and run systemctl daemon-reload)
[Service]
# Before every start, manual or automatic (Restart=), wait until this unit's GPUs are idle,
# reaping processes left over from an earlier run first; exit 1 after gate_timeout_s (300 s by
# default) so systemd's start limits take over instead of a model load that cannot allocate.
# No "+": this runs as the unit's user, in its environment, and only asks the root gate server
# (gpuguard-gate.socket, /run/gpuguard/gate.sock), which learns from the kernel which unit is
# asking, does the work and sends its story back for this unit's journal. If the server cannot
# be reached the start is refused (gate_unreachable in /etc/gpuguard/gpuguard.toml).
ExecStartPre={{gpuguard}} gate --unit %n
# After every stop (clean, failed, or after systemd's SIGKILL), reap what is left in the unit's
# cgroup or was orphaned from it, so the GPUs are free before anything else wants them; asked of
# the same server. "-" keeps a failed reap from marking the stop as failed; the next gate will
# try again.
ExecStopPost=-{{gpuguard}} reap --unit %n {_STOP_REAP}
# Each ExecStartPre= gets its own TimeoutStartSec=: keep it above the gate's timeout (300 s)
# plus a margin, or systemd kills the gate before it can explain itself. For Type=notify
# servers ExecStart= then gets a fresh TimeoutStartSec= for the model load.
TimeoutStartSec=600
# TimeoutStopSec= (the drain budget) is the unit's own: `gpuguard doctor` proposes one from the
# drains the journal recorded. ExecStopPost= above also runs within it.
# This replaces the unit's own KillMode= (install-gate says so). mixed: SIGTERM only to the
# main process (SGLang shuts its TP workers down itself), then SIGKILL to every process left in
# the cgroup. Never "process": it leaves workers holding GPU memory after a stop, which is
# exactly the incident gpuguard exists for.
KillMode=mixed
"""


#: What `systemctl show` must tell about a unit to know whether its gate can reach the socket.
SANDBOX_PROPERTIES = (
    "RestrictAddressFamilies",
    "SystemCallFilter",
    "InaccessiblePaths",
    "TemporaryFileSystem",
    "RootDirectory",
    "RootImage",
)


def sandbox_problems(properties: dict[str, str], socket_path: str) -> list[str]:
    """Why the unit's own sandbox would keep its unprivileged gate from the gate socket.

    Reads `systemctl show` values: RestrictAddressFamilies= is "~" when unset, "" for "none",
    "~AF_..." for a deny list, else an allow list; SystemCallFilter= likewise. PrivateNetwork=
    and IPAddressDeny= do not matter: a socket in the file system is reached across network
    namespaces.
    """
    problems: list[str] = []
    families = properties.get("RestrictAddressFamilies", "~")
    if not _permits(families, "AF_UNIX"):
        problems.append(
            f"RestrictAddressFamilies={families or 'none'} forbids AF_UNIX sockets: add AF_UNIX"
        )
    calls = properties.get("SystemCallFilter", "~")
    blocked = [c for c in ("socket", "connect") if not _permits(calls, c)]
    if blocked:
        problems.append(
            f"SystemCallFilter= forbids {' and '.join(blocked)}(): allow @network-io or those calls"
        )
    for key in ("InaccessiblePaths", "TemporaryFileSystem"):
        for word in properties.get(key, "").split():
            path = word.lstrip("-+").split(":", 1)[0].rstrip("/") or "/"
            if socket_path == path or socket_path.startswith(path.rstrip("/") + "/"):
                problems.append(f"{key}={word} hides {socket_path}")
    problems.extend(
        f"{key}={properties[key]} runs the gate in another root, without /usr/bin/gpuguard "
        f"and {socket_path}: bind both in (BindReadOnlyPaths=)"
        for key in ("RootDirectory", "RootImage")
        if properties.get(key)
    )
    return problems


def _permits(value: str, item: str) -> bool:
    """Whether a systemd allow/deny list as `systemctl show` prints it lets ``item`` through."""
    if value.startswith("~"):
        return item not in value[1:].split()
    return item in value.split()


def render(gpuguard: str = "/usr/bin/gpuguard") -> str:
    """The drop-in text, calling gpuguard at ``gpuguard`` (an absolute path)."""
    return _TEMPLATE.replace("{gpuguard}", gpuguard)


@dataclass(frozen=True, slots=True)
class Change:
    """What install/remove did (or would do): the file, the action, and why if refused."""

    path: Path
    action: str
    refused: str | None = None


def drop_in_path(unit: str, systemd_dir: Path = SYSTEMD_DIR) -> Path:
    """Where the drop-in for ``unit`` lives."""
    return systemd_dir / f"{unit}.d" / FILE_NAME


def install(unit: str, gpuguard: str, *, systemd_dir: Path = SYSTEMD_DIR) -> Change:
    """Write the drop-in; refuse to overwrite a file an operator changed."""
    path = drop_in_path(unit, systemd_dir)
    try:
        return _install(path, render(gpuguard))
    except files.UnsafePathError as err:
        return Change(path, "refused", str(err))


def _install(path: Path, text: str) -> Change:
    current = _current(path)
    if current == text.encode("utf-8"):
        return Change(path, "unchanged")
    if current is not None and not current.startswith(MARKER.encode("utf-8")):
        return Change(path, "refused", f"{path} exists and was not written by gpuguard")
    if current is not None:
        return Change(
            path,
            "refused",
            f"{path} was changed since gpuguard wrote it; remove it first "
            "(gpuguard remove-gate) or edit it by hand",
        )
    files.write_file(path, text.encode("utf-8"), mode=0o644, durable=True)
    return Change(path, "installed")


def remove(unit: str, *, systemd_dir: Path = SYSTEMD_DIR) -> Change:
    """Delete the drop-in only if it is byte for byte what install wrote; never anything else.

    An operator's edit (a longer TimeoutStopSec=, an extra line) is theirs: the file is kept and
    the answer says so, rather than silently undoing a change nobody asked gpuguard to undo.
    """
    path = drop_in_path(unit, systemd_dir)
    try:
        return _remove(path)
    except files.UnsafePathError as err:
        return Change(path, "refused", str(err))


def _remove(path: Path) -> Change:
    current = _current(path)
    if current is None:
        return Change(path, "absent")
    if not as_installed(current):
        return Change(
            path,
            "kept",
            f"kept {path}: it is not what install-gate wrote (edited since, or another "
            "file); delete it by hand if the gate should go",
        )
    files.remove_file(path)
    with contextlib.suppress(OSError):
        path.parent.rmdir()  # only if now empty: other drop-ins stay
    return Change(path, "removed")


#: A unit name as systemd spells one (unit_name_is_valid(): at most 255 characters of these).


def installed(unit: str, *, systemd_dir: Path = SYSTEMD_DIR) -> bool:
    """Whether gpuguard's gate drop-in is installed for ``unit``, as install-gate wrote it.

    An operator's edits keep it gpuguard's (its first line is the marker); a file anybody but
    root could have written is not (files.py checks the file and every directory above it).
    The gate server asks this of the unit a caller runs in, so the name is checked first.
    """
    if not UNIT_NAME.fullmatch(unit) or unit in {".", ".."}:
        return False
    try:
        current = _current(drop_in_path(unit, systemd_dir))
    except OSError:  # files.UnsafePathError too
        return False
    return current is not None and current.startswith(MARKER.encode("utf-8"))


def _current(path: Path) -> bytes | None:
    """The drop-in's bytes, None when absent; its directories must be root's (files.py)."""
    try:
        return files.read_file(path, max_bytes=_MAX_BYTES)
    except FileNotFoundError:
        return None


def as_installed(data: bytes) -> bool:
    """Whether ``data`` is exactly the text install writes, for the gpuguard path it names."""
    for line in data.split(b"\n"):
        if line.startswith(_EXEC_PREFIX) and line.endswith(_EXEC_SUFFIX):
            gpuguard = line[len(_EXEC_PREFIX) : -len(_EXEC_SUFFIX)].decode("utf-8", "replace")
            return data == render(gpuguard).encode("utf-8")
    return False


_EXEC_PREFIX = b"ExecStartPre="
_EXEC_SUFFIX = b" gate --unit %n"


def daemon_reload() -> str | None:
    """Make systemd read the change; None, or why it could not."""
    return systemd.systemctl("daemon-reload", timeout=60)[1]
