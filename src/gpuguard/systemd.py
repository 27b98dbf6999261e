"""The systemd adapter: unit state through ``systemctl`` as a subprocess (no D-Bus library)."""

from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass, field

_PROPERTIES = (
    "LoadState",
    "ActiveState",
    "SubState",
    "MainPID",
    "InvocationID",
    "Environment",
    "NRestarts",
)
_TIMEOUT_S = 10


@dataclass(frozen=True, slots=True)
class UnitState:
    """What systemd says about a unit; ``error`` is set when it could not be asked."""

    unit: str
    active_state: str | None = None
    sub_state: str | None = None
    main_pid: int | None = None
    invocation_id: str | None = None
    environment: dict[str, str] = field(default_factory=dict)
    n_restarts: int | None = None
    error: str | None = None
    load_state: str | None = None

    @property
    def not_found(self) -> bool:
        """Whether systemd has no such unit (a typo, a package not installed).

        ``ActiveState=inactive`` says nothing here: systemctl answers ``LoadState=not-found``
        with ``ActiveState=inactive`` for any name.
        """
        return self.load_state == "not-found"

    @property
    def running(self) -> bool:
        """Active, reloading or still starting: its current invocation's processes are live."""
        return self.active_state in {"active", "reloading", "activating", "deactivating"}


def show_unit(unit: str) -> UnitState:
    """Ask systemd for the unit's state; failures become ``error``, never exceptions."""
    try:
        result = subprocess.run(
            ["systemctl", "show", unit, *(f"--property={p}" for p in _PROPERTIES)],
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return UnitState(unit, error=f"systemctl failed: {err}")
    if result.returncode != 0:
        reason = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "no output"
        return UnitState(unit, error=f"systemctl show {unit}: {reason}")
    return parse_show(unit, result.stdout)


def parse_show(unit: str, text: str) -> UnitState:
    """Parse ``systemctl show`` KEY=VALUE output."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key] = value
    main_pid = values.get("MainPID", "")
    restarts = values.get("NRestarts", "")
    return UnitState(
        unit=unit,
        active_state=values.get("ActiveState") or None,
        sub_state=values.get("SubState") or None,
        main_pid=int(main_pid) if main_pid.isdecimal() and main_pid != "0" else None,
        invocation_id=values.get("InvocationID") or None,
        environment=parse_environment(values.get("Environment", "")),
        n_restarts=int(restarts) if restarts.isdecimal() else None,
        load_state=values.get("LoadState") or None,
    )


def parse_environment(value: str) -> dict[str, str]:
    """Split the Environment= property, which systemctl prints as shell-quoted words."""
    try:
        words = shlex.split(value)
    except ValueError:
        words = value.split()
    env: dict[str, str] = {}
    for word in words:
        name, sep, text = word.partition("=")
        if sep and name:
            env[name] = text
    return env


def control(verb: str, unit: str) -> str | None:
    """Run ``systemctl --no-block VERB UNIT`` (stop, start, reset-failed); None or the error.

    --no-block: the daemon polls the unit's state itself, so its watchdog keeps ticking while a
    server drains or loads a model.
    """
    if verb not in {"stop", "start", "reset-failed"}:
        raise ValueError(f"unsupported systemctl verb {verb!r}")
    try:
        result = subprocess.run(
            ["systemctl", "--no-block", verb, unit],
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"systemctl {verb} {unit} failed: {err}"
    if result.returncode != 0:
        return f"systemctl {verb} {unit}: {result.stderr.strip() or f'exit {result.returncode}'}"
    return None
