"""``gpuguard install-gate`` and ``remove-gate``: the gate drop-in, then daemon-reload."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gpuguard.adapters import dropin, files, systemd
from gpuguard.commands.output import Said
from gpuguard.core.exits import EX_NOPERM, EX_USAGE
from gpuguard.core.gate.proto import SOCKET_PATH as GATE_SOCKET
from gpuguard.core.unitstate import no_such_unit

if TYPE_CHECKING:
    from gpuguard.core.unitstate import UnitState

# What an ExecStartPre= path may hold as written: systemd splits at white space and quotes,
# expands % specifiers and $ variables, and a newline would start another directive.
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9/._+-]*")


def run(unit: str, *, install: bool, force: bool = False) -> Said:
    """Install or remove the gate drop-in, then make systemd read it."""
    command = "install-gate" if install else "remove-gate"
    refused = _gate_change_refused(command, unit, check_unit=install and not force)
    if refused is None and install:
        refused = _sandbox_refused(unit, force=force)
    if refused is not None:
        return refused
    executable = own_executable() if install else None
    if isinstance(executable, Said):
        return executable
    try:
        change = dropin.remove(unit) if executable is None else dropin.install(unit, executable)
    except OSError as err:
        return Said(1, notices=(f"gpuguard {command}: {err.filename}: {err.strerror}",))
    if change.refused:
        return Said(1, notices=(f"gpuguard: {change.refused}",))
    lines = [f"{change.path}: {change.action}"]
    if change.action in {"installed", "removed"}:
        problem = dropin.daemon_reload()
        if problem:
            return Said(1, tuple(lines), (f"gpuguard: {problem}",))
    if install:
        # Said out loud: these replace the unit's own values (docs/gate.md, "What it overrides").
        overrides = " and ".join(
            line
            for line in dropin.render().splitlines()
            if line and not line.startswith(("#", "[", "Exec"))
        )
        lines += [
            (
                f"it sets {overrides} for {unit}, replacing the unit's own; the stop timeout stays "
                f"the unit's: check it with gpuguard doctor --unit {unit}"
            ),
            f"undo with: gpuguard remove-gate --unit {unit}",
        ]
    return Said(0, tuple(lines))


def own_executable() -> str | Said:
    """The gpuguard the drop-in will run: this one, in a file only root can change.

    The drop-in runs it as the unit's user before every start and after every stop, so a file
    another user could replace would hand them the unit. This gpuguard is ``argv[0]`` when it
    was started as ``gpuguard`` (the package's /usr/bin/gpuguard, a virtualenv's script), else
    the script beside this interpreter (``python -m gpuguard``). PATH is not searched: it may
    name another gpuguard than the one running. Refused (exit 1, saying why) when that file is
    missing, or it or a directory above it is not root's alone (adapters.files' rule), or its
    path holds a character the drop-in line could not carry as it is.
    """
    argv0 = Path(sys.argv[0])
    script = Path(sys.executable).parent / "gpuguard"
    candidate = argv0.absolute() if argv0.name == "gpuguard" else script
    if not _PLAIN_PATH.fullmatch(str(candidate)):
        problem = f"{str(candidate)!r}, a path systemd would split or expand"
        return Said(1, notices=(_not_installed(problem),))
    try:
        os.close(files.open_file(candidate))
    except FileNotFoundError:
        problem = f"{candidate}: no such file"
    except OSError as err:
        unsafe = isinstance(err, files.UnsafePathError)
        problem = str(err) if unsafe else f"{candidate}: {err.strerror}"
    else:
        if os.access(candidate, os.X_OK):
            return str(candidate)
        problem = f"{candidate}: not executable"
    return Said(1, notices=(_not_installed(problem),))


def _not_installed(problem: str) -> str:
    return (
        f"gpuguard install-gate: not installed: the drop-in would run {problem}; run "
        "install-gate as the gpuguard it should call, by a path only root can change "
        "(the package's: /usr/bin/gpuguard install-gate)"
    )


def _sandbox_refused(unit: str, *, force: bool) -> Said | None:
    """Exit 1, saying why, when the unit's own sandbox would keep its gate from the socket."""
    properties = systemd.show_properties(unit, dropin.SANDBOX_PROPERTIES)
    if isinstance(properties, str):
        if force:
            return None
        problems = [f"cannot check its sandbox: {properties}"]
    else:
        problems = dropin.sandbox_problems(properties, GATE_SOCKET)
    if not problems:
        return None
    return Said(
        1,
        notices=(
            (
                f"gpuguard install-gate: not installed: {unit}'s own sandbox would keep its gate "
                f"from the gate server ({GATE_SOCKET}), and every start would be refused:"
            ),
            *(f"  {problem}" for problem in problems),
            "Change the unit (a drop-in of your own), then run install-gate again.",
        ),
    )


def _gate_change_refused(command: str, unit: str, *, check_unit: bool) -> Said | None:
    """Why the change must not be tried at all, with its exit status; None to go ahead."""
    if not unit.endswith(".service"):
        return Said(
            EX_USAGE,
            notices=(f"gpuguard: {unit!r} is not a service unit name such as sglang.service",),
        )
    if os.geteuid() != 0:
        return Said(
            EX_NOPERM,
            notices=(
                (
                    f"gpuguard {command}: needs root (it changes {dropin.SYSTEMD_DIR} and runs "
                    "systemctl daemon-reload)"
                ),
            ),
        )
    problem = _unit_missing(systemd.show_unit(unit)) if check_unit else None
    if problem:
        return Said(1, notices=(f"gpuguard {command}: {problem}; --force installs it anyway",))
    return None


def _unit_missing(unit_state: UnitState) -> str | None:
    """Why a drop-in for this unit would guard nothing: systemd has no such unit, or cannot say."""
    if unit_state.error:
        return f"cannot ask systemd whether {unit_state.unit} exists ({unit_state.error})"
    if unit_state.not_found:
        return no_such_unit(unit_state.unit)
    return None
