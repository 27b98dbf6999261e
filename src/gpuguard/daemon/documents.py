"""What the daemon keeps on disk, as typed, versioned documents.

Two files. The snapshot ``runtime_dir/daemon.json`` is rewritten while the daemon runs and read
by ``gpuguard status`` (docs/status.md lists its fields). Each unit's saved state
``state_dir/units/UNIT.json`` is taken back by a restarted daemon: the planner's bookkeeping,
the recent recoveries, and a recovery our own death interrupted. Recoveries and sweeps stay
plain records (size-bounded JSON objects, ``core.records``): they are history for people.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping

SNAPSHOT_SCHEMA = 1
"""Bumped only when a snapshot field changes meaning or disappears; fields may be added."""
UNIT_STATE_SCHEMA = 1
"""The saved unit state's version; a file without one was written before versions (the same)."""


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
    """Reset-class Xids since the unit last came up: its gate refuses (core.xidfaults)."""
    liveness: dict[str, Any] | None = None
    """The engine's liveness and start phase (core.liveness.LivenessView, docs/liveness.md)."""

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
class Snapshot:
    """The whole daemon as ``gpuguard status`` sees it (``updated_at`` is added on writing)."""

    pid: int
    start_time: int | None
    running: bool
    ready: bool
    started_at: str
    dry_run: bool
    journal_state: str
    journal_reason: str | None
    units: Mapping[str, UnitSnapshot]
    xids: tuple[dict[str, object], ...]
    xids_malformed: int

    def to_json(self) -> dict[str, Any]:
        """The snapshot document, ``schema_version`` SNAPSHOT_SCHEMA."""
        return {
            "schema_version": SNAPSHOT_SCHEMA,
            "pid": self.pid,
            "start_time": self.start_time,
            "running": self.running,
            "ready": self.ready,
            "started_at": self.started_at,
            "dry_run": self.dry_run,
            "journal": {"state": self.journal_state, "reason": self.journal_reason},
            "units": {name: unit.to_json() for name, unit in self.units.items()},
            "xid": {"recent": list(self.xids), "malformed": self.xids_malformed},
        }


@dataclass(frozen=True, slots=True)
class UnitStateDocument:
    """One unit's state that outlives the daemon process."""

    boot_id: str | None
    planner: Mapping[str, object] | None
    recoveries: tuple[dict[str, Any], ...]
    in_progress: dict[str, Any] | None
    liveness: dict[str, Any] | None = None
    """The starts that came up, phase by phase (core.liveness export/restore)."""

    def to_json(self) -> dict[str, Any]:
        """The saved document, ``schema_version`` UNIT_STATE_SCHEMA."""
        return {
            "schema_version": UNIT_STATE_SCHEMA,
            "boot_id": self.boot_id,
            "planner": dict(self.planner) if self.planner is not None else None,
            "recoveries": list(self.recoveries),
            "in_progress": self.in_progress,
            "liveness": self.liveness,
        }

    @classmethod
    def parse(cls, saved: Mapping[str, Any]) -> tuple[UnitStateDocument, list[str]]:
        """Take a saved document back field by field; a wrong type is named and left out.

        The file is root's, but a crash, an editor or an older version can leave anything valid
        JSON in it; a field of the wrong type starts that part fresh, it never stops the daemon.
        A version this gpuguard does not know is left out whole.
        """
        version = saved.get("schema_version", UNIT_STATE_SCHEMA)
        if version != UNIT_STATE_SCHEMA:
            empty = cls(None, None, (), None)
            return empty, [f"schema_version {version!r} is not {UNIT_STATE_SCHEMA}"]
        problems: list[str] = []
        planner = saved.get("planner")
        if planner is not None and not isinstance(planner, dict):
            problems.append("planner is not an object")
            planner = None
        recoveries = saved.get("recoveries")
        kept: tuple[dict[str, Any], ...] = ()
        if isinstance(recoveries, list):
            kept = tuple(record for record in recoveries if isinstance(record, dict))
            if len(kept) < len(recoveries):
                problems.append(f"{len(recoveries) - len(kept)} recoveries are not objects")
        elif recoveries is not None:
            problems.append("recoveries is not a list")
        in_progress = saved.get("in_progress")
        if in_progress is not None and not isinstance(in_progress, dict):
            problems.append("in_progress is not an object")
            in_progress = None
        liveness = saved.get("liveness")
        if liveness is not None and not isinstance(liveness, dict):
            problems.append("liveness is not an object")
            liveness = None
        boot_id = saved.get("boot_id")
        document = cls(
            boot_id if isinstance(boot_id, str) else None, planner, kept, in_progress, liveness
        )
        return document, problems
