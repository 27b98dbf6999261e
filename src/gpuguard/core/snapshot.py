"""The daemon's snapshot (``runtime_dir/daemon.json``): its types, its writer and its one reader.

The daemon rewrites the snapshot while it runs; ``gpuguard status``, ``status --prometheus``,
the gate and the metrics exporter read it back. Every one of them reads it through ``parse``,
which is total: bytes in, a ``Snapshot`` or an ``Unreadable`` out, never an exception. A field
that is missing, renamed or of the wrong type makes the whole document unreadable, named with
the field, so a reader never takes "nothing there" for a daemon that says nothing. A
``schema_version`` this gpuguard does not know is reported as a daemon older or newer than
itself. Recoveries, sweeps and reset-class Xids stay plain JSON objects inside the typed frame:
history for people (``core.records`` bounds them) and their own modules' records; liveness
(core.liveness's object) too, checked in every field status and the metrics read of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Final, NoReturn, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

SNAPSHOT_FILE: Final = "daemon.json"
"""The snapshot's name in ``runtime_dir``."""
SNAPSHOT_SCHEMA: Final = 1
"""Bumped only when a snapshot field changes meaning or disappears; fields may be added."""
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class UnitSnapshot:
    """One watched unit as the snapshot shows it."""

    systemd_state: str
    unit_found: bool
    looping: bool
    verdict: str
    cause: str | None
    cause_detail: str | None
    starts_in_window: int
    failures_in_window: int
    n_restarts: int | None
    oom_device: int | None
    """The last OOM line's CUDA device (the unit's view; core.oomdevice maps it to a GPU)."""
    evidence: tuple[str, ...]
    action: str | None
    action_reason: str | None
    needs_operator: bool
    recoveries: tuple[dict[str, Any], ...]
    recovery_in_progress: bool
    survivors: tuple[dict[str, Any], ...]
    reset_xids: tuple[dict[str, Any], ...]
    """Reset-class Xids since the unit last came up: its gate refuses (core.xid.faults)."""
    liveness: dict[str, Any] | None = None
    """The engine's liveness and start phase (core.livenessview.LivenessView, docs/liveness.md)."""

    def to_json(self) -> dict[str, Any]:
        """The unit's object in the snapshot."""
        return {
            "systemd_state": self.systemd_state,
            "unit_found": self.unit_found,
            "looping": self.looping,
            "verdict": self.verdict,
            "cause": self.cause,
            "cause_detail": self.cause_detail,
            "starts_in_window": self.starts_in_window,
            "failures_in_window": self.failures_in_window,
            "n_restarts": self.n_restarts,
            "oom_device": self.oom_device,
            "evidence": list(self.evidence),
            "action": self.action,
            "action_reason": self.action_reason,
            "needs_operator": self.needs_operator,
            "recoveries": list(self.recoveries),
            "recovery_in_progress": self.recovery_in_progress,
            "survivors": list(self.survivors),
            "reset_xids": list(self.reset_xids),
            "liveness": self.liveness,
        }


@dataclass(frozen=True, slots=True)
class XidRecord:
    """One kernel Xid as the daemon read it (its text already escaped by core.xid.events)."""

    code: int
    xid_class: str
    pci_bus_id: str
    pid: int | None
    name: str | None
    detail: str
    time: str | None
    """The wall-clock time (ISO 8601), for people."""
    monotonic_s: float | None
    """Seconds since boot: comparable to a process's start (core.xid.stuck)."""
    boot_id: str | None

    def to_json(self) -> dict[str, Any]:
        """The Xid's object in the snapshot's ``xid.recent``."""
        return {
            "code": self.code,
            "xid_class": self.xid_class,
            "pci_bus_id": self.pci_bus_id,
            "pid": self.pid,
            "name": self.name,
            "detail": self.detail,
            "time": self.time,
            "monotonic_s": self.monotonic_s,
            "boot_id": self.boot_id,
        }


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The whole daemon as ``gpuguard status`` sees it.

    ``updated_at`` is stamped by the loop as it writes, ``metrics`` (the exporter's counters,
    core.tally.Tally) by the writer when metrics are drawn: None until then.
    """

    pid: int
    start_time: int | None
    running: bool
    ready: bool
    started_at: str
    dry_run: bool
    journal_state: str
    journal_reason: str | None
    units: Mapping[str, UnitSnapshot]
    xids: tuple[XidRecord, ...]
    xids_malformed: int
    updated_at: str | None = None
    metrics: dict[str, Any] | None = None
    gpu_hangs: tuple[dict[str, Any], ...] = ()
    """Kernel lines that say a GPU hangs (core.xid.hung: ``said``, ``gpu``, ``text``, ``time``,
    ``boot_id``), newest last; in the document's ``xid.hung``, absent from older daemons'."""

    def to_json(self) -> dict[str, Any]:
        """The snapshot document, ``schema_version`` SNAPSHOT_SCHEMA."""
        document: dict[str, Any] = {
            "schema_version": SNAPSHOT_SCHEMA,
            "pid": self.pid,
            "start_time": self.start_time,
            "running": self.running,
            "ready": self.ready,
            "started_at": self.started_at,
            "dry_run": self.dry_run,
            "journal": {"state": self.journal_state, "reason": self.journal_reason},
            "units": {name: unit.to_json() for name, unit in self.units.items()},
            "xid": {
                "recent": [xid.to_json() for xid in self.xids],
                "malformed": self.xids_malformed,
                "hung": list(self.gpu_hangs),
            },
            "updated_at": self.updated_at,
        }
        if self.metrics is not None:
            document["metrics"] = self.metrics
        return document


class Problem(Enum):
    """Why a snapshot cannot be read."""

    MALFORMED = "unreadable"
    """Not JSON, not the daemon's document, or a field missing or of the wrong type."""
    TOO_OLD = "too-old"
    """Written by a daemon older than this gpuguard (a schema_version below ours)."""
    TOO_NEW = "too-new"
    """Written by a daemon newer than this gpuguard (a schema_version above ours)."""


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A snapshot that is there but cannot be read, and why (a sentence for people)."""

    problem: Problem
    reason: str


@dataclass(frozen=True, slots=True)
class DaemonView:
    """The watchdog daemon as its snapshot shows it, and whether that process is still alive.

    ``state``: "running", "stopped" (shut down cleanly), "dead" (the snapshot says running but
    its process is gone), "absent" (no snapshot: the daemon is not installed or never ran) or
    "unreadable" (``unreadable`` says why; ``snapshot`` is None).
    """

    state: str
    snapshot: Snapshot | None
    unreadable: Unreadable | None = None

    @classmethod
    def of(cls, read: Snapshot | Unreadable | None, *, alive: bool = True) -> DaemonView:
        """The view of what ``read`` gave; ``alive``: whether the writer's process still lives."""
        if read is None:
            return cls("absent", None)
        if isinstance(read, Unreadable):
            return cls("unreadable", None, read)
        if not read.running:
            return cls("stopped", read)
        return cls("running" if alive else "dead", read)


def parse(data: bytes | str) -> Snapshot | Unreadable:
    """The snapshot in ``data``, or why it cannot be read: never an exception."""
    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        return Unreadable(Problem.MALFORMED, f"not JSON ({_clip(str(err))})")
    return from_json(document)


def from_json(document: object) -> Snapshot | Unreadable:
    """The snapshot in a document already loaded from JSON, or why it cannot be read."""
    try:
        return _snapshot(document)
    except _BadFieldError as err:
        return Unreadable(err.problem, err.reason)


class _BadFieldError(Exception):
    """Inside the parser only: the first field that does not fit (parse returns it)."""

    def __init__(self, reason: str, problem: Problem = Problem.MALFORMED) -> None:
        super().__init__(reason)
        self.reason = reason
        self.problem = problem


def _snapshot(document: object) -> Snapshot:
    top = _object(document, "the document")
    version = top.get("schema_version")
    if type(version) is not int:
        _bad("schema_version", "is missing or not an integer")
    if version < SNAPSHOT_SCHEMA:
        raise _BadFieldError(
            f"written by an older gpuguard daemon (schema_version {version}; this gpuguard "
            f"reads {SNAPSHOT_SCHEMA}): restart the daemon (systemctl restart gpuguard.service)",
            Problem.TOO_OLD,
        )
    if version > SNAPSHOT_SCHEMA:
        raise _BadFieldError(
            f"written by a newer gpuguard daemon (schema_version {version}; this gpuguard "
            f"reads {SNAPSHOT_SCHEMA}): run the gpuguard the daemon runs, or upgrade this one",
            Problem.TOO_NEW,
        )
    journal = _get(top, "journal", _object)
    xid = _get(top, "xid", _object)
    units = _get(top, "units", _object)
    return Snapshot(
        pid=_get(top, "pid", _int),
        start_time=_get(top, "start_time", _optional(_int)),
        running=_get(top, "running", _bool),
        ready=_get(top, "ready", _bool),
        started_at=_get(top, "started_at", _str),
        dry_run=_get(top, "dry_run", _bool),
        journal_state=_get(journal, "state", _str, "journal."),
        journal_reason=_get(journal, "reason", _optional(_str), "journal."),
        units={
            _str(name, "units key"): _unit(value, f"units[{json.dumps(name)}]")
            for name, value in units.items()
        },
        xids=tuple(
            _xid(item, f"xid.recent[{index}]")
            for index, item in enumerate(_get(xid, "recent", _list, "xid."))
        ),
        xids_malformed=_get(xid, "malformed", _int, "xid."),
        updated_at=_get(top, "updated_at", _optional(_str)),
        metrics=_get(top, "metrics", _object) if "metrics" in top else None,
        gpu_hangs=_hangs(xid) if "hung" in xid else (),
    )


def _hangs(xid: Mapping[str, object]) -> tuple[dict[str, Any], ...]:
    """``xid.hung``: each an object with the text status shows (a string)."""
    hangs = _get(xid, "hung", _objects, "xid.")
    for index, hang in enumerate(hangs):
        _get(hang, "text", _str, f"xid.hung[{index}].")
        _get(hang, "said", _str, f"xid.hung[{index}].")
    return hangs


def _unit(value: object, where: str) -> UnitSnapshot:
    unit = _object(value, where)
    prefix = f"{where}."
    liveness = _get(unit, "liveness", _optional(_liveness), prefix) if "liveness" in unit else None
    return UnitSnapshot(
        systemd_state=_get(unit, "systemd_state", _str, prefix),
        unit_found=_get(unit, "unit_found", _bool, prefix),
        looping=_get(unit, "looping", _bool, prefix),
        verdict=_get(unit, "verdict", _str, prefix),
        cause=_get(unit, "cause", _optional(_str), prefix),
        cause_detail=_get(unit, "cause_detail", _optional(_str), prefix),
        starts_in_window=_get(unit, "starts_in_window", _int, prefix),
        failures_in_window=_get(unit, "failures_in_window", _int, prefix),
        n_restarts=_get(unit, "n_restarts", _optional(_int), prefix),
        oom_device=_get(unit, "oom_device", _optional(_int), prefix),
        evidence=tuple(
            _str(line, f"{prefix}evidence[{index}]")
            for index, line in enumerate(_get(unit, "evidence", _list, prefix))
        ),
        action=_get(unit, "action", _optional(_str), prefix),
        action_reason=_get(unit, "action_reason", _optional(_str), prefix),
        needs_operator=_get(unit, "needs_operator", _bool, prefix),
        recoveries=_get(unit, "recoveries", _objects, prefix),
        recovery_in_progress=_get(unit, "recovery_in_progress", _bool, prefix),
        survivors=_get(unit, "survivors", _objects, prefix),
        reset_xids=_get(unit, "reset_xids", _objects, prefix),
        liveness=liveness,
    )


def _liveness(value: object, where: str) -> dict[str, Any]:
    """core.liveness's object, checked in the fields status and the metrics read; kept whole."""
    liveness = _object(value, where)
    prefix = f"{where}."
    for key, check in (
        ("state", _str),
        ("summary", _str),
        ("level", _optional(_str)),
        ("engine_deaths", _int),
        ("stuck_starts", _int),
    ):
        _get(liveness, key, check, prefix)
    start = _get(liveness, "last_start", _optional(_object), prefix)
    if start is not None:
        _get(start, "ready_s", _number, f"{prefix}last_start.")
        phases = _get(start, "phases", _object, f"{prefix}last_start.")
        for phase, seconds in phases.items():
            _number(seconds, f"{prefix}last_start.phases[{json.dumps(phase)}]")
    return liveness


def _xid(value: object, where: str) -> XidRecord:
    record = _object(value, where)
    prefix = f"{where}."
    return XidRecord(
        code=_get(record, "code", _int, prefix),
        xid_class=_get(record, "xid_class", _str, prefix),
        pci_bus_id=_get(record, "pci_bus_id", _str, prefix),
        pid=_get(record, "pid", _optional(_int), prefix),
        name=_get(record, "name", _optional(_str), prefix),
        detail=_get(record, "detail", _str, prefix),
        time=_get(record, "time", _optional(_str), prefix),
        monotonic_s=_get(record, "monotonic_s", _optional(_number), prefix),
        boot_id=_get(record, "boot_id", _optional(_str), prefix),
    )


def _get(
    document: Mapping[str, object],
    key: str,
    check: Callable[[object, str], _T],
    prefix: str = "",
) -> _T:
    """``document[key]`` as ``check`` wants it; a missing key is named as missing."""
    if key not in document:
        _bad(f"{prefix}{key}", "is missing")
    return check(document[key], f"{prefix}{key}")


def _optional(check: Callable[[object, str], _T]) -> Callable[[object, str], _T | None]:
    def optional(value: object, where: str) -> _T | None:
        return None if value is None else check(value, where)

    return optional


def _object(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        _bad(where, "is not an object")
    return value


def _list(value: object, where: str) -> list[object]:
    if not isinstance(value, list):
        _bad(where, "is not a list")
    return value


def _objects(value: object, where: str) -> tuple[dict[str, Any], ...]:
    items = _list(value, where)
    for index, item in enumerate(items):
        _object(item, f"{where}[{index}]")
    return tuple(items)  # type: ignore[arg-type] # each checked above


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        _bad(where, "is not a string")
    return value


def _int(value: object, where: str) -> int:
    if type(value) is not int:
        _bad(where, "is not an integer")
    return value


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        _bad(where, "is not true or false")
    return value


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        _bad(where, "is not a number")
    return value


def _bad(where: str, what: str) -> NoReturn:
    raise _BadFieldError(f"not the daemon's snapshot: {_clip(where)} {what}")


def _clip(text: str) -> str:
    """A unit's name or a parser's message, kept to a line's length (status escapes it)."""
    return text if len(text) <= 120 else f"{text[:120]}…"
