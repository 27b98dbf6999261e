"""What the daemon keeps on disk, as typed, versioned documents.

Two files. The snapshot ``runtime_dir/daemon.json`` is rewritten while the daemon runs and read
by ``gpuguard status`` (docs/status.md lists its fields): its types, writer and parser are
``core.snapshot``, where its readers find them (``daemon/publishing.py`` writes it). Each
unit's saved state ``state_dir/units/UNIT.json`` is taken back by a restarted daemon: the
planner's bookkeeping, the recent recoveries, and a recovery our own death interrupted.
Recoveries and sweeps stay plain records (size-bounded JSON objects, ``core.records``): they
are history for people.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping

UNIT_STATE_SCHEMA = 1
"""The saved unit state's version; a file without one was written before versions (the same)."""


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
