"""Issue 36: status says one story, true now, in words an operator reads (no internal values)."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone

import snapshots
from builders import STATUS_CONTEXT, UNIT, gpu, nvml

from gpuguard.core.inventory import build_inventory
from gpuguard.core.levels import Level
from gpuguard.core.status.document import to_json
from gpuguard.core.status.judge import assess
from gpuguard.core.status.report import UnitView
from gpuguard.core.status.text import render_text
from gpuguard.core.values import MIB, NvmlHealth, ProcScan

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
MISSING = nvml(health=NvmlHealth.UNAVAILABLE, reason="NVML unavailable: Driver Not Loaded")


def test_a_refusal_while_nvml_is_missing_exits_critical() -> None:
    """The gate refused because NVML is missing: status prints CRITICAL and exits 2, not 3."""
    refused = UnitView(
        UNIT,
        "failed (failed)",
        "GPUs 0 (from config)",
        ({"time": "t2", "result": "refused", "blockers": ["NVML unavailable: Driver Not Loaded"]},),
    )
    context = replace(STATUS_CONTEXT, units=(refused,))
    report = assess(build_inventory(MISSING, ProcScan(()), 16 * MIB), context, NOW)
    text = render_text(report)
    assert "CRITICAL: the gate refused the last start" in text
    assert report.level is Level.CRITICAL
    assert to_json(report)["exit_code"] == 2
    assert text.startswith(f"gpuguard status: CRITICAL - the gate refused the last start of {UNIT}")


def test_no_python_none_reaches_the_screen() -> None:
    """Every optional field of the daemon's record left empty: status prints words, never None."""
    watch = snapshots.unit(
        looping=True,
        verdict="3 failed runs in 600 s",
        cause=None,
        cause_detail=None,
        n_restarts=None,
        action=None,
        recoveries=({"started_at": None, "result": None},),
        survivors=({"at": None, "summary": "1 left"},),
    )
    snapshot = snapshots.written({UNIT: watch})
    unit = UnitView(
        UNIT,
        "activating (auto-restart)",
        "GPUs 0 (from config)",
        ({"time": None, "result": "refused", "waited_s": None, "blockers": None},),
    )
    context = replace(STATUS_CONTEXT, daemon=snapshots.running(snapshot), units=(unit,))
    report = assess(build_inventory(nvml(gpu(0)), ProcScan(()), 16 * MIB), context, NOW)
    text = render_text(report)
    assert f"Unit {UNIT}" in text
    assert "restart loop" in text
    assert "None" not in text
