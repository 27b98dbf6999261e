"""What operators see of the daemon: its snapshot file and the STATUS= line.

``Publishing.publish`` writes the snapshot (``core.snapshot.Snapshot``: each unit's verdict, action,
recoveries, sweeps, reset-class Xids and liveness, the kernel Xids kept) and the one-line
STATUS= for systemctl, only when what they say changed or the refresh is due. This module owns
how the daemon's state becomes those documents, and the timestamps they carry.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from gpuguard.core.recovery import Action
from gpuguard.core.snapshot import Snapshot, UnitSnapshot, XidRecord
from gpuguard.core.xid.catalogue import lookup
from gpuguard.core.xid.faults import to_record
from gpuguard.daemon.watches import CHORE_EARLY_S, DaemonState

if TYPE_CHECKING:
    from gpuguard.core.recovery import RecoveryDecision
    from gpuguard.core.xid.events import XidEvent
    from gpuguard.daemon.watches import Watch

# The snapshot is rewritten when what it says changes, and at least this often (a sign of life
# for readers; status judges liveness by PID, not by this).
SNAPSHOT_EVERY_S = 60.0


class Publishing(DaemonState):
    """The daemon's snapshot and STATUS= line, written when what they say changes."""

    def _status_line(self) -> str:
        parts = []
        for watch in self._watches.values():
            if _needs_operator(watch):
                parts.append(f"{watch.name}: NEEDS OPERATOR")
            elif watch.diagnosis is not None and watch.diagnosis.looping:
                parts.append(f"{watch.name}: restart loop ({action_of(watch.decision)})")
            elif watch.liveness.dead is not None:
                parts.append(f"{watch.name}: engine dead")
            elif watch.not_found:
                parts.append(f"{watch.name}: unit not found")
            else:
                parts.append(f"{watch.name}: ok")
        journal = self._follower.health()
        return f"watching {', '.join(parts)}; journal {journal.state}"

    def _publish(self, *, running: bool = True) -> None:
        """Write the snapshot and STATUS= when what they say changed (or the refresh is due)."""
        ports = self._ports
        health = self._follower.health()
        document = Snapshot(
            pid=os.getpid(),
            start_time=ports.identity.start_time if ports.identity else None,
            running=running,
            ready=self._ready,
            started_at=iso(self._started_at),
            dry_run=self._settings.daemon.dry_run,
            journal_state=health.state,
            journal_reason=health.reason,
            units={
                name: replace(
                    _unit_snapshot(watch, self._reset_xids(watch)),
                    liveness=watch.liveness.view(ports.monotonic()).to_json(),
                )
                for name, watch in self._watches.items()
            },
            xids=tuple(_xid_snapshot(event) for event in self._xids),
            xids_malformed=self._xids_malformed,
            gpu_hangs=tuple(
                hung.to_json() | {"time": iso_or_none(hung.realtime_s)} for hung in self._hangs
            ),
        ).to_json()
        content = (json.dumps(document, sort_keys=True, default=str), self._status_line())
        refresh_due = ports.monotonic() + CHORE_EARLY_S >= self._published_at + SNAPSHOT_EVERY_S
        if content == self._published and not refresh_due:
            return
        ports.write_snapshot(document | {"updated_at": iso(ports.wall())})
        if content[1] != (self._published or ("", ""))[1]:
            ports.notifier.status(content[1])
        self._published, self._published_at = content, ports.monotonic()

    def _reset_xids(self, watch: Watch) -> list[dict[str, Any]]:
        """The reset-class Xids since the unit last came up, for its gate (xid.faults)."""
        return [
            to_record(event, iso_or_none(event.realtime_s))
            for event in self._faults.since(watch.up.since_s)
        ]


def _unit_snapshot(watch: Watch, reset_xids: list[dict[str, Any]]) -> UnitSnapshot:
    diagnosis = watch.diagnosis
    return UnitSnapshot(
        systemd_state=watch.systemd_state,
        unit_found=not watch.not_found,
        looping=bool(diagnosis and diagnosis.looping),
        verdict=diagnosis.reason if diagnosis else "no lifecycle events seen yet",
        cause=diagnosis.cause.value if diagnosis else None,
        cause_detail=diagnosis.cause_detail if diagnosis else None,
        starts_in_window=diagnosis.starts_in_window if diagnosis else 0,
        failures_in_window=diagnosis.failures_in_window if diagnosis else 0,
        n_restarts=diagnosis.n_restarts if diagnosis else None,
        oom_device=diagnosis.oom_device if diagnosis else None,
        evidence=tuple(diagnosis.evidence) if diagnosis else (),
        action=action_of(watch.decision),
        action_reason=watch.decision.reason if watch.decision else None,
        needs_operator=_needs_operator(watch),
        recoveries=tuple(watch.recoveries),
        recovery_in_progress=watch.in_progress is not None,
        survivors=tuple(watch.sweeps),
        reset_xids=tuple(reset_xids),
    )


def _xid_snapshot(event: XidEvent) -> XidRecord:
    """One kernel Xid as status reads it back (text already escaped by the parser)."""
    return XidRecord(
        code=event.code,
        xid_class=lookup(event.code).xid_class.value,
        pci_bus_id=event.pci_bus_id,
        pid=event.pid,
        name=event.name,
        detail=event.detail,
        time=iso_or_none(event.realtime_s),
        monotonic_s=event.monotonic_s,
        boot_id=event.boot_id,
    )


def _needs_operator(watch: Watch) -> bool:
    """Recoveries gave up, or the last decision was that only an operator can help (a GPU reset)."""
    decision = watch.decision
    return watch.planner.needs_operator or (
        decision is not None and decision.action is Action.NEEDS_OPERATOR
    )


def action_of(decision: RecoveryDecision | None) -> str | None:
    """The decision's action as the snapshot and the logs name it (None: no decision yet)."""
    return decision.action.value if decision is not None else None


def iso_or_none(seconds: float | None) -> str | None:
    """``iso``, or None for a moment not known."""
    return None if seconds is None else iso(seconds)


def iso(seconds: float) -> str:
    """A wall-clock moment as records for people carry it (UTC, to the second)."""
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds")
