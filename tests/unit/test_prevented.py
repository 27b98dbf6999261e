"""What gpuguard saved: its conservative count of prevented failed starts, and their loading."""

from __future__ import annotations

from datetime import datetime, timezone

from prometheus_client.parser import text_string_to_metric_families

from gpuguard.core import metrics
from gpuguard.core.inventory import build_inventory
from gpuguard.core.levels import Level
from gpuguard.core.prevented import Prevented, healed_start, prevented
from gpuguard.core.status.judge import assess
from gpuguard.core.status.report import StatusContext, UnitView
from gpuguard.core.tally import Tally
from gpuguard.core.values import NvmlHealth, NvmlReading, ProcScan

UNIT = "vllm.service"


def decision(result: str, *outcomes: str) -> dict[str, object]:
    """A gate decision as the gate records it, with its reaped holders' outcomes."""
    return {
        "result": result,
        "reaped": [{"pid": 100 + i, "outcome": o} for i, o in enumerate(outcomes)],
    }


def test_only_a_start_the_gates_signal_healed_counts() -> None:
    """Passed after a holder exited or was killed: 1; already gone, refused, fast pass: 0."""
    assert healed_start(decision("passed", "exited"))
    assert healed_start(decision("passed", "killed", "exited"))
    assert not healed_start(decision("passed", "gone"))
    assert not healed_start(decision("passed"))
    assert not healed_start(decision("refused", "killed"))
    assert not healed_start({"result": "passed", "reaped": "killed"})


def test_each_heal_and_ended_loop_counts_one_at_the_shortest_learned_start() -> None:
    """Two heals and one restart: 3 starts; loading 3 x the shortest start; none learned: None."""
    decisions = [decision("passed", "killed"), decision("passed", "exited"), decision("refused")]
    recoveries = [{"result": "restarted"}, {"result": "failed"}, {"result": "dry-run"}]
    saved = prevented(decisions, recoveries, (240.0, 210.0, 300.0))
    assert (saved.by_gate, saved.by_daemon, saved.starts) == (2, 1, 3)
    assert saved.load_s == 630.0
    unlearned = prevented(decisions, recoveries, ())
    assert unlearned.starts == 3
    assert unlearned.load_s is None


def test_the_daemon_counts_new_heals_once_and_exports_them() -> None:
    """Decisions seen at start are history; new ones count once, with their loading, exported."""
    tally = Tally()
    old = [decision("passed", "killed")]
    tally.baseline(f"gate/{UNIT}", old)
    new = [*old, decision("passed", "killed"), decision("passed", "gone")]
    tally.count_gate(UNIT, new, 210.0)
    tally.count_gate(UNIT, new, 210.0)
    tally.baseline(f"recoveries/{UNIT}", [])
    tally.count_recoveries(UNIT, [{"result": "restarted"}], None)
    assert tally.prevented[UNIT, "gate"] == 1
    assert tally.prevented[UNIT, "daemon"] == 1
    assert tally.prevented_load_s[UNIT, "gate"] == 210.0
    back = Tally.from_json(tally.to_json())
    assert back.prevented == tally.prevented
    assert dict(back.prevented_load_s) == {(UNIT, "gate"): 210.0}
    observed = metrics.Observed(
        inventory=None,
        inventory_age_s=None,
        watched_units=[UNIT],
        live_invocations={},
        protected_names=(),
        idle_threshold_bytes=0,
        snapshot=None,
        daemon_running=True,
        gate_refused={},
        tally=back,
        now_wall=0.0,
    )
    samples = {
        (s.name, s.labels.get("reaper")): s.value
        for family in text_string_to_metric_families(
            metrics.exposition(metrics.families(observed)).decode()
        )
        for s in family.samples
        if s.name.startswith("gpuguard_prevented")
    }
    assert samples[("gpuguard_prevented_failed_starts_total", "gate")] == 1
    assert samples[("gpuguard_prevented_failed_starts_total", "daemon")] == 1
    assert samples[("gpuguard_prevented_load_seconds_total", "gate")] == 210.0
    assert samples[("gpuguard_prevented_load_seconds_total", "daemon")] == 0


def test_status_says_what_was_saved_as_good_news() -> None:
    """An OK line per unit: how many, by whom, and the loading at its shortest start."""
    inventory = build_inventory(NvmlReading(NvmlHealth.OK), ProcScan(()), 0)
    unit = UnitView(UNIT, "active (running)", "all GPUs", prevented=Prevented(2, 1, 210.0))
    report = assess(
        inventory,
        StatusContext({UNIT: ()}, (), 0, as_root=True, units=(unit,)),
        datetime.now(timezone.utc),
    )
    assert report.level is Level.OK
    said = [f.message for f in report.findings if "prevented" in f.message]
    assert said == [
        (
            "vllm.service: gpuguard prevented 3 failed starts (2 healed by the gate, 1 loop "
            "ended by the daemon), 10 min 30 s of loading at its shortest learned start "
            "(3 min 30 s each)"
        )
    ]
