"""The systemd adapter: unit state through ``systemctl`` as a subprocess (no D-Bus library).

Also what ties a process to one of a unit's runs (:func:`provenance`): the invocation ids PID 1
logged for the unit, read with ``journalctl`` from entries only PID 1 can write (journald stamps
``_PID`` itself), and the uid of the unit's ``User=``.
"""

from __future__ import annotations

import json
import pwd
import re
import subprocess
from dataclasses import replace

from gpuguard.adapters import procfs, programs
from gpuguard.core.unitstate import UnitState, parse_show, properties
from gpuguard.core.values import UnitProvenance

_PROPERTIES = (
    "LoadState",
    "ActiveState",
    "SubState",
    "MainPID",
    "ControlPID",
    "ControlGroup",
    "InvocationID",
    "Environment",
    "NRestarts",
    "User",
    "DynamicUser",
    "KillMode",
    "TimeoutStopUSec",
)
_TIMEOUT_S = 10
_INVOCATION_ID = re.compile(r"[0-9a-f]{32}")
# PID 1 logs a handful of entries per run (starting, started, stopped, consumed…): this many of
# the newest cover hundreds of runs; each line is a few hundred bytes.
_JOURNAL_ENTRIES = 4096
_JOURNAL_LINE_LIMIT = 16384


def systemctl(*args: str, timeout: float = _TIMEOUT_S) -> tuple[str | None, str | None]:
    """Run ``systemctl ARGS`` (programs: absolute path, fixed environment): stdout, or why not.

    The one place gpuguard runs systemctl; a failure is a short reason, never an exception.
    """
    verb = " ".join(a for a in args if not a.startswith("--"))
    try:
        result = programs.run(["systemctl", *args], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, f"systemctl {verb} failed: {err}"
    if result.returncode != 0:
        last = result.stderr.strip().splitlines()[-1:] or [f"exit {result.returncode}"]
        return None, f"systemctl {verb}: {last[0][:300]}"
    return result.stdout, None


def show_unit(unit: str) -> UnitState:
    """Ask systemd for the unit's state; failures become ``error``, never exceptions."""
    out, problem = systemctl("show", unit, *(f"--property={p}" for p in _PROPERTIES))
    if out is None:
        return UnitState(unit, error=problem)
    state = parse_show(unit, out)
    if state.main_pid is None:
        return state
    return replace(state, main=procfs.read_identity(state.main_pid))


def show_properties(unit: str, names: tuple[str, ...]) -> dict[str, str] | str:
    """The named properties of ``unit`` as `systemctl show` prints them, or why not."""
    out, problem = systemctl("show", unit, *(f"--property={p}" for p in names))
    if out is None:
        return problem or "systemctl show failed"
    return properties(out)


def control(verb: str, unit: str) -> str | None:
    """Run ``systemctl --no-block VERB UNIT`` (stop, start, reset-failed); None or the error.

    --no-block: the daemon polls the unit's state itself, so its watchdog keeps ticking while a
    server drains or loads a model.
    """
    if verb not in {"stop", "start", "reset-failed"}:
        raise ValueError(f"unsupported systemctl verb {verb!r}")
    return systemctl("--no-block", verb, unit)[1]


#: A line of ``systemctl list-units``/``list-unit-files`` output that long is not a unit's.
_LIST_LINE_LIMIT = 1024


def known_units() -> tuple[str, ...]:
    """The units systemd knows (loaded, or with a unit file); empty when it cannot be asked.

    Only for a "did you mean": each line's first word, as ``--plain --no-legend`` prints it.
    """
    names: list[str] = []
    for verb in ("list-units", "list-unit-files"):
        out, _ = systemctl(verb, "--all", "--plain", "--no-legend", "--no-pager")
        for line in (out or "").split("\n"):
            word = line[:_LIST_LINE_LIMIT].split(maxsplit=1)
            if word and "." in word[0]:
                names.append(word[0])
    return tuple(dict.fromkeys(names))


def unit_uid(state: UnitState) -> int | None:
    """The uid the unit's processes run as: ``User=`` resolved, root when unset; None if unknown.

    A ``DynamicUser=`` unit's user exists only while it runs (and is named after the unit when
    ``User=`` is unset); when the name does not resolve the uid is unknown.
    """
    name = state.user
    if name is None:
        if not state.dynamic_user:
            return 0
        name = state.unit.rsplit(".", 1)[0]
    if name.isdecimal():
        return int(name)
    try:
        return pwd.getpwnam(name).pw_uid
    except (KeyError, ValueError):
        return None


def parse_invocations(text: str, unit: str) -> frozenset[str]:
    """The invocation ids in ``journalctl -o json`` output that PID 1 logged for ``unit``.

    Total and linear: an over-long line, a line that is not a JSON object, an entry not stamped
    ``_PID=1``, naming another unit or a malformed id is skipped.
    """
    found: set[str] = set()
    for line in text.split("\n"):
        if not line or len(line) > _JOURNAL_LINE_LIMIT:
            continue
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(entry, dict) or entry.get("_PID") != "1" or entry.get("UNIT") != unit:
            continue
        invocation = entry.get("INVOCATION_ID")
        if isinstance(invocation, str) and _INVOCATION_ID.fullmatch(invocation):
            found.add(invocation)
    return frozenset(found)


def logged_invocations(unit: str) -> frozenset[str]:
    """The invocation ids PID 1 logged for ``unit``; empty when the journal is silent.

    Only the journal's newest entries are read (bounded), and only PID 1's: ``journalctl -u``
    would also match the unit's own chatty output. No ``--boot``: a sandboxed service in a
    container sees the host's boot ID and would match nothing, and an id from an earlier boot
    is harmless (no process survives a reboot; one carrying such an id forged it as the unit's
    own user, who could signal it anyway).
    """
    try:
        result = programs.run(
            [
                "journalctl",
                "--quiet",
                "--no-pager",
                "--output=json",
                "--output-fields=INVOCATION_ID,UNIT,_PID",
                f"--lines={_JOURNAL_ENTRIES}",
                "_PID=1",
                f"UNIT={unit}",
            ],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    return parse_invocations(result.stdout, unit) if result.returncode == 0 else frozenset()


def provenance(state: UnitState, *, inside: bool = False, history: bool = True) -> UnitProvenance:
    """What ties a process to an ended run of the unit, from systemd's answer and its journal.

    ``inside``: gpuguard runs in the unit's own cgroup (its ExecStartPre= or ExecStopPost=), so
    no other run of the unit is live whatever systemctl says; its cgroup may be reaped even when
    systemd cannot be asked (the caller's uid then stands for the unit's user, see
    commands/context.py), but nothing outside it is, for want of the unit's runs.
    ``history`` False: the journal is not read (no holder outside a cgroup names a run), only
    the last run systemd names counts.
    """
    if state.error is not None:
        return UnitProvenance(None if inside else state.error)
    if state.running and state.invocation_id is None and not inside:
        return UnitProvenance(f"{state.unit} is running but systemd names no invocation id")
    runs = set(logged_invocations(state.unit)) if history else set()
    if state.invocation_id is not None:
        runs.add(state.invocation_id)  # a stopped unit still names its last, ended run
    if state.running and not inside:
        runs.discard(state.invocation_id or "")  # the live run is not a left-over
    return UnitProvenance(None, frozenset(runs), unit_uid(state))
