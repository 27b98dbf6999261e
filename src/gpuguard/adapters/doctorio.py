"""Gathers what ``gpuguard doctor`` judges: systemctl show, the unit's journal, files, /proc.

The thin adapter in front of ``gpuguard.core.doctor``: every failure becomes a ``problems`` line,
never an exception, so doctor always answers (UNKNOWN for what it could not see). What is at
risk here is root reading files the service user controls: an EnvironmentFile= may be a FIFO (a
read that never ends), a huge file, or a symlink swapped under us. Files are opened with
``O_NONBLOCK|O_NOFOLLOW``, must be regular, and are read up to ``ENV_FILE_MAX_BYTES``; the
journal read is bounded in entries (``JOURNAL_MAX_ENTRIES``), age (``JOURNAL_MAX_AGE_S``) and
time (``_TIMEOUT_S``). ``journalctl`` runs through ``_run`` only, ``systemctl`` through
``adapters.systemd``, both by absolute path in a fixed environment (``adapters.programs``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import stat
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Final

from gpuguard.adapters import programs, state, systemd
from gpuguard.core.doctor import (
    DAEMON_UNIT,
    SWEEP_EVENT,
    AuditedUnit,
    GateWaits,
    GpuUseFacts,
    History,
    HostFacts,
    LearnedStarts,
    PathFact,
    build_history,
)
from gpuguard.core.events import FIELDS_READ
from gpuguard.core.gpuset import resolve_gpu_set
from gpuguard.core.mig import mig_indices
from gpuguard.core.startbudgets import parse_starts
from gpuguard.core.unitconfig import (
    ENV_FILE_MAX_BYTES,
    PROPERTIES,
    UnitConfig,
    parse_environment_file,
    parse_show,
)
from gpuguard.core.values import NvmlHealth

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gpuguard.config import Settings
    from gpuguard.core.inventory import Inventory

JOURNAL_MAX_ENTRIES: Final = 20_000
"""The newest PID-1 entries about the unit that are read: weeks of a busy server's history."""
JOURNAL_MAX_AGE_S: Final = 30 * 86400.0
_TIMEOUT_S: Final = 30
_MAX_PATH_ENTRIES: Final = 32  # PATH/LD_LIBRARY_PATH entries checked per variable
_PROC = Path("/proc")


def _run(command: Sequence[str]) -> tuple[str | None, str | None]:
    """Run a program; its stdout, or None and why it failed."""
    try:
        done = programs.run(
            command, timeout=_TIMEOUT_S, capture_output=True, text=True, errors="replace"
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, f"{command[0]} failed: {err}"
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        return None, f"{command[0]} {command[1]}: {last[0][:300]}"
    return done.stdout, None


def unit_config(unit: str) -> tuple[UnitConfig, str | None]:
    """The unit's effective settings (every drop-in applied), or why systemd could not say."""
    out, problem = systemd.systemctl("show", unit, *(f"--property={p}" for p in PROPERTIES))
    if out is None:
        return UnitConfig(unit), problem
    return parse_show(unit, out), None


def history(unit: str) -> tuple[History, str | None]:
    """PID 1's messages about the unit: the newest JOURNAL_MAX_ENTRIES of the last 30 days."""
    since = time.time() - JOURNAL_MAX_AGE_S
    query = [
        "journalctl",
        "--output=json",
        "--no-pager",
        "--quiet",
        f"--output-fields={','.join(FIELDS_READ)}",
        f"--since=@{since:.0f}",
        f"--lines={JOURNAL_MAX_ENTRIES}",
    ]
    units = [f"UNIT={unit}"]
    out, problem = _run([*query, "_PID=1", *units, "+", "_SYSTEMD_CGROUP=/init.scope", *units])
    if out is None:
        return History(), problem
    # The daemon's sweeps of an ended run's survivors: the workers that left the unit's cgroup,
    # which systemd never names (trust is judged again on _SYSTEMD_UNIT and _UID).
    swept, _ = _run(
        [
            *query,
            f"--grep={SWEEP_EVENT}",
            "--case-sensitive=yes",
            f"_SYSTEMD_UNIT={DAEMON_UNIT}",
            "_UID=0",
        ]
    )
    entries: list[dict[str, object]] = []
    cursors: set[str] = set()
    for line in [*out.splitlines(), *(swept or "").splitlines()]:
        with contextlib.suppress(ValueError, RecursionError):
            entry = json.loads(line)
            if not isinstance(entry, dict):
                continue
            cursor = entry.get("__CURSOR")
            if isinstance(cursor, str):
                if cursor in cursors:
                    continue  # an entry both queries match counts once
                cursors.add(cursor)
            entries.append(entry)
    return build_history(entries, unit), None


def read_environment_file(path: str) -> tuple[dict[str, str], str | None]:
    """An EnvironmentFile='s variables; a FIFO, a symlink or a non-regular file is not read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        return {}, f"EnvironmentFile {path!r}: {err.strerror}"
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}, f"EnvironmentFile {path!r}: not a regular file, not read"
        return parse_environment_file(file.read(ENV_FILE_MAX_BYTES)), None


def path_chain(path: str) -> tuple[PathFact, ...]:
    """``lstat`` of ``path`` and each existing ancestor up to ``/`` (only absolute paths)."""
    if not path.startswith("/"):
        return ()
    facts: list[PathFact] = []
    current = Path(path)
    for candidate in (current, *current.parents):
        try:
            info = os.lstat(candidate)
        except OSError:
            continue
        facts.append(
            PathFact(
                str(candidate), info.st_uid, info.st_gid, info.st_mode, stat.S_ISDIR(info.st_mode)
            )
        )
    return tuple(facts)


def gather_unit(unit: str, settings: Settings, now: Inventory | None = None) -> AuditedUnit:
    """Everything doctor needs about one watched unit; ``now``: the host's GPU holders."""
    problems: list[str] = []
    config, problem = unit_config(unit)
    if problem:
        problems.append(problem)
    found, problem = history(unit) if problem is None else (History(), None)
    if problem:
        problems.append(problem)
    elif config.load_state and not found.entries and os.geteuid() != 0:
        # journalctl --quiet says nothing when it may not read the system journal.
        problems.append(
            f"the journal showed nothing about {unit}: run as root (or as a member of "
            "systemd-journal) to read systemd's messages"
        )
    environment = dict(config.environment)
    for path, ignore_errors in config.environment_files:
        values, problem = read_environment_file(path)
        environment.update(values)
        if problem and not ignore_errors:
            problems.append(problem)
    paths = {path: path_chain(path) for path, _ in config.environment_files}
    for name in ("PATH", "LD_LIBRARY_PATH"):
        for entry in environment.get(name, "").split(":")[:_MAX_PATH_ENTRIES]:
            if entry:
                paths[entry] = path_chain(entry)
    watched = settings.units.get(unit)
    return AuditedUnit(
        config=config,
        history=found,
        environment=environment,
        gpus=watched.gpus if watched else None,
        user_uid=_uid(config.user),
        paths=paths,
        problems=tuple(problems),
        use=gpu_use(now, unit, watched.gpus if watched else None, environment),
        learned=learned_starts(settings.state_dir, unit) if watched else None,
        gate_waits=gate_waits(settings.runtime_dir, unit),
        health_url=watched.health_url if watched else None,
        on_engine_dead=watched.on_engine_dead if watched else None,
        clean_exit_is_death=settings.daemon.clean_exit_is_death,
    )


def learned_starts(state_dir: Path, unit: str) -> LearnedStarts:
    """The starts the daemon saw come up, from the unit's saved state (``liveness.starts``)."""
    path = state.unit_state_path(state_dir, unit)
    saved = state.read_json(path)
    if saved is None:
        return LearnedStarts(str(path), problems=_unread(path))
    liveness = saved.get("liveness") if isinstance(saved, dict) else None
    if not isinstance(liveness, dict):
        return LearnedStarts(str(path))
    starts, problems = parse_starts(liveness)
    return LearnedStarts(str(path), tuple(s.ready_s for s in starts), tuple(problems))


def _unread(path: Path) -> tuple[str, ...]:
    """Why a state file read as nothing: missing is no problem (nothing learned yet)."""
    try:
        path.stat()
    except FileNotFoundError:
        return ()
    except OSError as err:
        return (f"cannot be read: {err.strerror}",)
    return ("not readable as gpuguard's unit state",)


def gate_waits(runtime_dir: Path, unit: str) -> GateWaits | None:
    """The gate's recorded decisions for the unit (since boot: runtime_dir is /run), if any."""
    decisions = state.gate_decisions(runtime_dir, unit)
    if not decisions:
        return None
    waited = tuple(
        float(d["waited_s"])
        for d in decisions
        if d.get("result") == "passed"
        and not d.get("fast_path")
        and isinstance(d.get("waited_s"), (int, float))
        and not isinstance(d.get("waited_s"), bool)
        and 0 < d["waited_s"] < 10**6
    )
    refused = sum(d.get("result") == "refused" for d in decisions)
    return GateWaits(str(state.gate_log_path(runtime_dir, unit)), waited, refused)


def gpu_use(
    found: Inventory | None,
    unit: str,
    configured: tuple[int | str, ...] | None,
    environment: dict[str, str],
) -> GpuUseFacts | None:
    """The unit's GPU set (as the gate resolves it) and the GPUs its processes hold now."""
    if found is None or found.nvml.health is not NvmlHealth.OK:
        return None
    gpus = found.nvml.gpus
    held = frozenset(
        use.gpu_index
        for holder in found.holders
        if holder.attribution.unit == unit and not holder.attribution.user_unit
        for use in holder.gpus
    )
    # The set as configured: a MIG GPU it leaves out (core/mig.py) is not "outside the set".
    unmasked = [replace(gpu, mig=None) for gpu in gpus]
    indices = resolve_gpu_set(configured, environment, unmasked).indices
    return GpuUseFacts(set_indices=indices, held=held, gpu_count=len(gpus))


def _uid(user: str | None) -> int | None:
    """The uid of User= (a name or a number): 0 when unset (root), None when unknown."""
    if not user:
        return 0
    if user.isdecimal():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None


def host_facts(settings: Settings, now: Inventory | None = None) -> HostFacts:
    """GPUs present, persistence mode per GPU (NVML) or nvidia-persistenced, the gate's timeout."""
    off: tuple[int, ...] | None = None
    mig: tuple[int, ...] = ()
    if now is not None:
        mig = tuple(sorted(mig_indices(now.nvml.gpus)))
    if now is not None and now.nvml.health is NvmlHealth.OK:
        modes = {gpu.index: gpu.persistence_mode for gpu in now.nvml.gpus}
        if modes and None not in modes.values():
            off = tuple(sorted(index for index, on in modes.items() if not on))
    return HostFacts(
        gate_timeout_s=settings.gate_timeout_s,
        nvidia_devices=Path("/dev/nvidiactl").exists(),
        persistenced_running=_process_running("nvidia-persiste"),  # comm is cut to 15 chars
        persistence_off=off,
        mig_on=mig,
        daemon_sandbox=_daemon_sandbox(settings),
    )


def _daemon_sandbox(settings: Settings) -> dict[str, str] | None:
    """gpuguard.service's network sandbox, asked only when a unit has a health check."""
    if not any(u.health is not None for u in settings.units.values()):
        return None
    found = systemd.show_properties(
        "gpuguard.service", ("LoadState", "PrivateNetwork", "RestrictAddressFamilies")
    )
    return found if isinstance(found, dict) else None


def _process_running(comm: str) -> bool:
    for entry in _PROC.iterdir():
        if not entry.name.isdecimal():
            continue
        with contextlib.suppress(OSError):
            if (entry / "comm").read_bytes()[:16].rstrip(b"\n").decode(errors="replace") == comm:
                return True
    return False
