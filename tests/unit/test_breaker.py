"""The host-wide breaker: its rule, its file, and what status, the metrics and its command say."""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

from gpuguard.adapters import breakerfile, releaselog
from gpuguard.commands import breaker as breaker_command
from gpuguard.config import Settings
from gpuguard.core import metrics
from gpuguard.core.breaker import (
    BreakerLimits,
    BreakerState,
    Recovery,
    admit,
    close,
    in_window,
    parse,
)
from gpuguard.core.exits import EX_NOPERM
from gpuguard.core.inventory import build_inventory
from gpuguard.core.levels import Level
from gpuguard.core.status.judge import assess
from gpuguard.core.status.report import StatusContext
from gpuguard.core.tally import Tally
from gpuguard.core.values import NvmlHealth, NvmlReading, ProcScan
from gpuguard.daemonsettings import DaemonSettings

if TYPE_CHECKING:
    from pathlib import Path

LIMITS = BreakerLimits(max_recoveries=3, window_s=600.0)
BOOT = "d" * 32


def asked(at_s: float, unit: str = "a.service") -> Recovery:
    """One recovery asked at ``at_s``."""
    return Recovery(at_s, f"t+{at_s:g}", unit, "recovery")


def opened_after_three() -> BreakerState:
    """Three recoveries in 10 min, then a fourth asked: open."""
    state = BreakerState(boot_id=BOOT)
    for at_s in (0.0, 100.0, 200.0):
        allowed, state = admit(state, LIMITS, asked(at_s))
        assert allowed
    allowed, state = admit(state, LIMITS, asked(300.0, "c.service"))
    assert not allowed
    return state


def test_the_limit_opens_the_breaker_and_only_a_person_closes_it() -> None:
    """N pass in the window, the next opens it; it never closes by itself, close starts afresh."""
    state = opened_after_three()
    assert state.is_open
    assert (state.open_since, state.opened_after, state.refused) == ("t+300", 3, 1)
    allowed, later = admit(state, LIMITS, asked(100_000.0))
    assert not allowed
    assert later.refused == 2
    closed = close(later, at="t+100001", by="test")
    assert not closed.is_open
    assert closed.recoveries == ()
    allowed, _ = admit(closed, LIMITS, asked(100_002.0))
    assert allowed


def test_the_window_slides() -> None:
    """Recoveries older than the window no longer count: a slow trickle never opens it."""
    state = BreakerState(boot_id=BOOT)
    for at_s in range(0, 6000, 250):  # one every 250 s: at most 3 in any 600 s
        allowed, state = admit(state, LIMITS, asked(float(at_s)))
        assert allowed, at_s
    assert len(in_window(state, LIMITS, 5750.0)) == 3


def test_the_file_is_read_back_only_in_its_boot_and_totally(tmp_path: Path) -> None:
    """Same boot: the state; another boot, a malformed or foreign document: none."""
    state = opened_after_three()
    breakerfile.save(tmp_path, state)
    assert breakerfile.load(tmp_path, BOOT) == state
    assert breakerfile.load(tmp_path, "e" * 32) is None
    documents: tuple[object, ...] = (
        None,
        [],
        {"schema_version": 2, "boot_id": BOOT},
        state.to_json() | {"recoveries": [{"at_monotonic_s": "x"}]},
        state.to_json() | {"opened_after": -1},
        state.to_json() | {"open_since": 7},
    )
    for document in documents:
        assert parse(document, boot_id=BOOT) is None


def test_status_is_critical_with_when_and_after_how_many() -> None:
    """An open breaker is status's CRITICAL headline: since T after N recoveries."""
    inventory = build_inventory(NvmlReading(NvmlHealth.OK), ProcScan(()), 0)
    context = StatusContext(
        watched_units={},
        protected_names=(),
        idle_threshold_bytes=0,
        as_root=True,
        breaker=opened_after_three(),
        breaker_limits=LIMITS,
    )
    report = assess(inventory, context, datetime.now(timezone.utc))
    assert report.level is Level.CRITICAL
    assert report.headline == "breaker open since t+300 after 3 recoveries in 10 min"
    assert "gpuguard breaker --close" in report.findings[0].message
    closed = assess(inventory, StatusContext({}, (), 0, as_root=True), datetime.now(timezone.utc))
    assert closed.level is Level.OK


def test_the_metrics_say_open_and_how_many_in_the_window() -> None:
    """gpuguard_breaker_open 1, its window's count and its limit."""
    observed = metrics.Observed(
        inventory=None,
        inventory_age_s=None,
        watched_units=[],
        live_invocations={},
        protected_names=(),
        idle_threshold_bytes=0,
        snapshot=None,
        daemon_running=True,
        gate_refused={},
        tally=Tally(),
        now_wall=0.0,
        breaker=opened_after_three(),
        breaker_limits=LIMITS,
        now_monotonic=350.0,
    )
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(
            metrics.exposition(metrics.families(observed)).decode()
        )
        for s in family.samples
    }
    assert samples["gpuguard_breaker_open"] == 1
    assert samples["gpuguard_breaker_recoveries"] == 3
    assert samples["gpuguard_breaker_max_recoveries"] == 3


def test_the_command_says_the_state_and_closes_only_as_root(tmp_path: Path) -> None:
    """Open: exit 2 with the way out; --close: root closes it, anyone else gets 77."""
    settings = Settings(
        runtime_dir=tmp_path, daemon=DaemonSettings(breaker_max_recoveries=3, breaker_window_s=600)
    )
    boot = releaselog.boot_id()
    breakerfile.save(tmp_path, replace(opened_after_three(), boot_id=boot))
    said = breaker_command.run(settings, close_it=False)
    assert said.exit_status == int(Level.CRITICAL)
    assert said.lines[0].startswith("breaker open since t+300 after 3 recoveries in 10 min")
    closing = breaker_command.run(settings, close_it=True)
    if os.geteuid() != 0:
        assert closing.exit_status == EX_NOPERM
        assert breakerfile.load(tmp_path, boot) is not None
        return
    assert closing.exit_status == 0
    found = breakerfile.load(tmp_path, boot)
    assert found is not None
    assert not found.is_open
    assert breaker_command.run(settings, close_it=False).exit_status == 0
