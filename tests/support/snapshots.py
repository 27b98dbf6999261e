"""The daemon's snapshot for tests of its readers, built with the daemon's own types.

A test names only the fields it is about; the rest are those of a quiet daemon (one unit, no
loop, no Xid). What a reader gets is always the written document read back through
``core.snapshot.parse``, as ``gpuguard status`` reads ``daemon.json``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from gpuguard.core.snapshot import DaemonView, Snapshot, UnitSnapshot, XidRecord, parse

if TYPE_CHECKING:
    from collections.abc import Mapping

QUIET_UNIT = UnitSnapshot(
    systemd_state="active (running)",
    unit_found=True,
    looping=False,
    verdict="no lifecycle events seen yet",
    cause=None,
    cause_detail=None,
    starts_in_window=0,
    failures_in_window=0,
    n_restarts=None,
    oom_device=None,
    evidence=(),
    action=None,
    action_reason=None,
    needs_operator=False,
    recoveries=(),
    recovery_in_progress=False,
    survivors=(),
    reset_xids=(),
)
QUIET = Snapshot(
    pid=4242,
    start_time=1000,
    running=True,
    ready=True,
    started_at="2026-01-01T00:00:00+00:00",
    dry_run=False,
    journal_state="attached",
    journal_reason=None,
    units={},
    xids=(),
    xids_malformed=0,
    updated_at="2026-01-01T00:00:05+00:00",
)


def unit(**fields: Any) -> UnitSnapshot:
    """A watched unit as the snapshot shows it: quiet but for ``fields``."""
    return replace(QUIET_UNIT, **fields)


def xid(code: int, pci_bus_id: str, **fields: Any) -> XidRecord:
    """A kernel Xid as the daemon keeps it (class and detail as the daemon writes them)."""
    from gpuguard.core.xid.catalogue import lookup  # noqa: PLC0415 - only this helper needs it

    defaults: dict[str, Any] = {
        "xid_class": lookup(code).xid_class.value,
        "pid": None,
        "name": None,
        "detail": "",
        "time": None,
        "monotonic_s": None,
        "boot_id": None,
    }
    return XidRecord(code=code, pci_bus_id=pci_bus_id, **(defaults | fields))


def written(
    units: Mapping[str, UnitSnapshot] | None = None,
    **fields: Any,
) -> Snapshot:
    """The snapshot a daemon with these ``units`` (and ``fields``) writes, read back from JSON."""
    return read_back(replace(QUIET, units=dict(units or {}), **fields).to_json())


def read_back(document: Mapping[str, Any]) -> Snapshot:
    """A document the daemon wrote (to its snapshot port), read as status reads daemon.json."""
    found = parse(json.dumps(document, indent=1, sort_keys=True))
    assert isinstance(found, Snapshot), found
    return found


def running(snapshot: Snapshot) -> DaemonView:
    """The view of a live daemon that wrote ``snapshot``."""
    return DaemonView.of(snapshot, alive=True)
