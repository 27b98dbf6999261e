"""``gpuguard install-gate`` and ``remove-gate``: the gate drop-in, then daemon-reload."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gpuguard.commands.exits import EX_NOPERM, EX_USAGE
from gpuguard.core.gateproto import SOCKET_PATH as GATE_SOCKET

if TYPE_CHECKING:
    from gpuguard.adapters.systemd import UnitState


def run(unit: str, *, install: bool, force: bool = False) -> int:
    """Install or remove the gate drop-in, then make systemd read it."""
    from gpuguard.adapters import dropin  # noqa: PLC0415 - see the package doc

    command = "install-gate" if install else "remove-gate"
    refused = _gate_change_refused(command, unit, check_unit=install and not force)
    if refused is not None:
        return refused
    if install:
        refused = _sandbox_refused(unit, force=force)
        if refused is not None:
            return refused
    try:
        change = dropin.install(unit, _own_executable()) if install else dropin.remove(unit)
    except OSError as err:
        sys.stderr.write(f"gpuguard {command}: {err.filename}: {err.strerror}\n")
        return 1
    if change.refused:
        sys.stderr.write(f"gpuguard: {change.refused}\n")
        return 1
    sys.stdout.write(f"{change.path}: {change.action}\n")
    if change.action in {"installed", "removed"}:
        problem = dropin.daemon_reload()
        if problem:
            sys.stderr.write(f"gpuguard: {problem}\n")
            return 1
    if install:
        # Said out loud: these replace the unit's own values (docs/gate.md, "What it overrides").
        overrides = " and ".join(
            line
            for line in dropin.render().splitlines()
            if line and not line.startswith(("#", "[", "Exec"))
        )
        sys.stdout.write(
            f"it sets {overrides} for {unit}, replacing the unit's own; the stop timeout stays "
            f"the unit's: check it with gpuguard doctor --unit {unit}\n"
            f"undo with: gpuguard remove-gate --unit {unit}\n"
        )
    return 0


def _sandbox_refused(unit: str, *, force: bool) -> int | None:
    """Exit 1, saying why, when the unit's own sandbox would keep its gate from the socket."""
    from gpuguard.adapters import dropin, systemd  # noqa: PLC0415 - see the package doc

    properties = systemd.show_properties(unit, dropin.SANDBOX_PROPERTIES)
    if isinstance(properties, str):
        if force:
            return None
        problems = [f"cannot check its sandbox: {properties}"]
    else:
        problems = dropin.sandbox_problems(properties, GATE_SOCKET)
    if not problems:
        return None
    sys.stderr.write(
        f"gpuguard install-gate: not installed: {unit}'s own sandbox would keep its gate from "
        f"the gate server ({GATE_SOCKET}), and every start would be refused:\n"
        + "".join(f"  {problem}\n" for problem in problems)
        + "Change the unit (a drop-in of your own), then run install-gate again.\n"
    )
    return 1


def _gate_change_refused(command: str, unit: str, *, check_unit: bool) -> int | None:
    """The exit status when the change must not be tried at all; None to go ahead."""
    from gpuguard.adapters import dropin, systemd  # noqa: PLC0415 - see the package doc

    if not unit.endswith(".service"):
        sys.stderr.write(f"gpuguard: {unit!r} is not a service unit name such as sglang.service\n")
        return EX_USAGE
    if os.geteuid() != 0:
        sys.stderr.write(
            f"gpuguard {command}: needs root (it changes {dropin.SYSTEMD_DIR} and runs "
            "systemctl daemon-reload)\n"
        )
        return EX_NOPERM
    problem = _unit_missing(systemd.show_unit(unit)) if check_unit else None
    if problem:
        sys.stderr.write(f"gpuguard {command}: {problem}; --force installs it anyway\n")
        return 1
    return None


def _unit_missing(unit_state: UnitState) -> str | None:
    """Why a drop-in for this unit would guard nothing: systemd has no such unit, or cannot say."""
    if unit_state.error:
        return f"cannot ask systemd whether {unit_state.unit} exists ({unit_state.error})"
    if unit_state.not_found:
        return f"systemd has no unit {unit_state.unit} (LoadState=not-found; a typo?)"
    return None


def _own_executable() -> str:
    """The absolute path the drop-in should call: this gpuguard, else the packaged one."""
    argv0 = Path(sys.argv[0])
    if argv0.name == "gpuguard":
        return str(argv0.absolute())
    found = shutil.which("gpuguard")
    return str(Path(found).resolve()) if found else "/usr/bin/gpuguard"
