"""The metrics core: what each metric says about hand-made inventories and snapshots (pure).

Rendered through the official prometheus_client and read back with its own parser, so a name,
a label or a type that Prometheus would not take fails here.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import snapshots
from builders import TRAINING_CGROUP, gpu, inventory, lost_gpu, nvml, process, training_job
from prometheus_client.parser import text_string_to_metric_families

from gpuguard.core.leftovers import WatchedUnit
from gpuguard.core.metrics import (
    HEALTH_STATES,
    Observed,
    Rendered,
    exposition,
    families,
)
from gpuguard.core.snapshot import Unreadable, from_json
from gpuguard.core.tally import GATE_RESULTS, Tally
from gpuguard.core.values import MIB, GpuHealth, NvmlHealth, RecoveryAction, UnitProvenance

if TYPE_CHECKING:
    from gpuguard.core.snapshot import Snapshot
    from gpuguard.core.values import GpuReading, ProcessFacts

UNIT = "sglang.service"
OLD = "0" * 32
LIVE = "a" * 32
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def observed(
    readings: tuple[GpuReading, ...] = (),
    processes: tuple[ProcessFacts, ...] = (),
    *,
    live: dict[str, str | None] | None = None,
    snapshot: Snapshot | None = None,
    tally: Tally | None = None,
    running: bool = True,
    health: NvmlHealth = NvmlHealth.OK,
) -> Observed:
    """Metrics input for one watched unit, systemd saying it runs ``LIVE`` unless told.

    The unit runs as root (the builders' processes are root's), as status's watched units say.
    """
    live_invocations = {UNIT: LIVE} if live is None else live
    unit = WatchedUnit(
        UNIT,
        (),
        live_invocation=live_invocations.get(UNIT),
        provenance=UnitProvenance(None, uid=0)
        if UNIT in live_invocations
        else UnitProvenance("systemd did not answer"),
    )
    return Observed(
        inventory=inventory(nvml(*readings, health=health), *processes),
        inventory_age_s=12.5,
        watched_units=[UNIT],
        live_invocations=live_invocations,
        protected_names=("nvidia-persistenced",),
        idle_threshold_bytes=16 * MIB,
        snapshot=snapshot,
        daemon_running=running,
        gate_refused={UNIT: False},
        tally=tally or Tally(),
        now_wall=1_700_000_000.0,
        watched=[unit],
    )


def scrape(inputs: Observed) -> Samples:
    """Render, then read back with prometheus_client's own parser."""
    text = exposition(families(inputs)).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_stale_holders_are_an_ended_runs_processes_with_their_memory() -> None:
    """Old invocation in the unit's cgroup: stale; the live run and another unit's job: not."""
    inputs = observed(
        (gpu(0, (10, 30000), (11, 1000), (12, 500)),),
        (
            process(10, 0, invocation_id=OLD),
            process(11, 0, invocation_id=LIVE),
            process(12, 0, invocation_id=OLD, cgroup=TRAINING_CGROUP),
        ),
    )
    found = scrape(inputs)
    assert found["gpuguard_gpu_stale_holders", (("gpu", "0"),)] == 1
    assert found["gpuguard_gpu_stale_holder_memory_bytes", (("gpu", "0"),)] == 30000 * MIB
    assert found["gpuguard_gpu_memory_used_bytes", (("gpu", "0"),)] == 31500 * MIB
    assert found["gpuguard_gpu_memory_total_bytes", (("gpu", "0"),)] == 143771 * MIB
    assert found["gpuguard_gpu_idle", (("gpu", "0"),)] == 0


@pytest.mark.parametrize(
    ("live", "invocation"),
    [({}, OLD), ({UNIT: LIVE}, None)],
    ids=["systemd-not-answering", "invocation-unknown"],
)
def test_no_evidence_no_stale_holder(live: dict[str, str | None], invocation: str | None) -> None:
    """Without systemd's answer or the process's INVOCATION_ID nothing is called stale."""
    found = scrape(
        observed((gpu(0, (10, 30000)),), (process(10, 0, invocation_id=invocation),), live=live)
    )
    assert found["gpuguard_gpu_stale_holders", (("gpu", "0"),)] == 0


def test_a_stopped_units_holders_are_all_stale() -> None:
    """The unit is not running: every process of it that holds a GPU is left over."""
    found = scrape(
        observed((gpu(0, (10, 100)),), (process(10, 0, invocation_id=LIVE),), live={UNIT: None})
    )
    assert found["gpuguard_gpu_stale_holders", (("gpu", "0"),)] == 1


def test_unattributed_memory_and_idle() -> None:
    """Memory no process explains is exported; an unheld GPU within the threshold is idle."""
    found = scrape(observed((gpu(0, used_mib=9000), gpu(1, used_mib=2))))
    assert found["gpuguard_gpu_unattributed_memory_bytes", (("gpu", "0"),)] == 9000 * MIB
    assert found["gpuguard_gpu_unattributed_memory_bytes", (("gpu", "1"),)] == 0
    assert found["gpuguard_gpu_idle", (("gpu", "0"),)] == 0
    assert found["gpuguard_gpu_idle", (("gpu", "1"),)] == 1


@pytest.mark.parametrize(
    ("reading", "state"),
    [
        (gpu(0), "ok"),
        (gpu(0, health=GpuHealth(volatile_uncorrectable_ecc=2)), "warning"),
        (gpu(0, health=GpuHealth(remapped_rows_pending=True)), "needs-reset"),
        (
            gpu(0, health=GpuHealth(recovery_action=RecoveryAction.NODE_REBOOT)),
            "needs-reboot",
        ),
        (lost_gpu(0), "needs-reboot"),
    ],
)
def test_health_is_one_state_of_four(reading: GpuReading, state: str) -> None:
    """Exactly one of ok/warning/needs-reset/needs-reboot is 1."""
    found = scrape(observed((reading,)))
    assert {
        s: found["gpuguard_gpu_health", (("gpu", "0"), ("state", s))] for s in HEALTH_STATES
    } == {s: float(s == state) for s in HEALTH_STATES}


def test_unit_loop_state_from_the_snapshot() -> None:
    """Looping with a GPU cause, failures in the window, needs operator: as the daemon said."""
    watch = snapshots.unit(
        looping=True,
        cause="stale-gpu-holders",
        failures_in_window=4,
        needs_operator=True,
        recovery_in_progress=False,
    )
    snapshot = snapshots.written({UNIT: watch})
    found = scrape(observed(snapshot=snapshot))
    unit = (("unit", UNIT),)
    assert found["gpuguard_unit_restart_loop", unit] == 1
    assert found["gpuguard_unit_restart_loop_gpu_cause", unit] == 1
    assert found["gpuguard_unit_failed_runs_in_window", unit] == 4
    assert found["gpuguard_unit_needs_operator", unit] == 1
    assert found["gpuguard_unit_recovery_in_progress", unit] == 0
    assert found["gpuguard_journal_attached", ()] == 1
    assert found["gpuguard_daemon_up", ()] == 1
    other = snapshots.written({UNIT: replace(watch, cause="not-gpu-related")})
    assert scrape(observed(snapshot=other))["gpuguard_unit_restart_loop_gpu_cause", unit] == 0


def test_a_malformed_snapshot_reads_as_nothing_known() -> None:
    """Wrong types in the snapshot: it cannot be read (core.snapshot), so zeros, no exception."""
    document = snapshots.QUIET.to_json()
    document["units"] = {UNIT: snapshots.QUIET_UNIT.to_json()}
    document["units"][UNIT] |= {"failures_in_window": "4", "looping": "yes"}
    assert isinstance(from_json(document), Unreadable)
    found = scrape(observed(snapshot=None, running=False))
    assert found["gpuguard_unit_failed_runs_in_window", (("unit", UNIT),)] == 0
    assert found["gpuguard_unit_restart_loop", (("unit", UNIT),)] == 0
    assert found["gpuguard_daemon_up", ()] == 0
    assert found["gpuguard_journal_attached", ()] == 0


def test_nvml_down_and_inventory_age() -> None:
    """NVML unusable: gpuguard_nvml_up 0; the inventory's age as given."""
    found = scrape(observed(health=NvmlHealth.TIMED_OUT))
    assert found["gpuguard_nvml_up", ()] == 0
    assert found["gpuguard_inventory_age_seconds", ()] == 12.5


def test_drawn_again_only_what_changed_is_rendered_and_the_text_is_a_full_renders() -> None:
    """Each draw reads as a fresh render (timestamps move on); unchanged families are kept."""
    rendered = Rendered()
    first = observed((gpu(0, used_mib=500),))
    assert rendered.exposition(families(first)) == exposition(families(first))
    drawn = len(families(first))
    assert rendered.rendered == drawn
    later = replace(first, now_wall=first.now_wall + 60, inventory_age_s=72.5)
    text = rendered.exposition(families(later))
    assert text == exposition(families(later))
    assert rendered.rendered == 2  # the draw's timestamp and the inventory's age
    assert b"gpuguard_metrics_updated_timestamp_seconds 1.70000006e+09" in text
    moved = observed((gpu(0, used_mib=900),))
    assert rendered.exposition(families(moved)) == exposition(families(moved))
    assert 2 < rendered.rendered < drawn
    assert rendered.exposition(families(moved)) == exposition(families(moved))
    assert rendered.rendered == 0


def test_labels_are_bounded_and_names_follow_the_conventions() -> None:
    """No PID, command line or process name in any label; counters end in _total; units named."""
    tally = Tally()
    tally.count_reaped("daemon", "killed")
    found = scrape(
        observed(
            (gpu(0, (4242, 30000)),),
            (process(4242, 0, invocation_id=OLD),),
            tally=tally,
        )
    )
    allowed = {"gpu", "unit", "state", "result", "reaper", "outcome", "error", "phase"}
    for name, labels in found:
        assert {key for key, _ in labels} <= allowed, name
        assert not any("4242" in value or "sglang.launch" in value for _, value in labels)
        assert re.fullmatch(r"gpuguard_[a-z0-9_]+", name)
    text = exposition(families(observed(tally=tally))).decode()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    assert {name for name, kind in types.items() if kind == "counter"} == {
        "gpuguard_recoveries_total",
        "gpuguard_gate_decisions_total",
        "gpuguard_reaped_processes_total",
        "gpuguard_nvml_errors_total",
        "gpuguard_unit_engine_deaths_total",
        "gpuguard_unit_stuck_starts_total",
        "gpuguard_prevented_failed_starts_total",
        "gpuguard_prevented_load_seconds_total",
    }
    assert 'gpuguard_reaped_processes_total{outcome="killed",reaper="daemon"} 1.0' in text


def test_every_counter_starts_at_zero_for_every_label() -> None:
    """increase() needs a first sample: every result of every unit is there from the start."""
    found = scrape(observed())
    for result in GATE_RESULTS:
        assert found["gpuguard_gate_decisions_total", (("result", result), ("unit", UNIT))] == 0
    assert found["gpuguard_recoveries_total", (("result", "restarted"), ("unit", UNIT))] == 0
    assert found["gpuguard_nvml_errors_total", (("error", "timed-out"),)] == 0


# -- counting from histories that keep only their newest entries ----------------------------------


def entry(n: int, result: str = "passed") -> dict[str, object]:
    """A gate decision: distinct by ``n``."""
    return {"time": f"t{n}", "result": result, "reaped": []}


def test_history_baseline_is_not_counted_then_only_news_are() -> None:
    """At start: nothing counted; later, only what was appended."""
    tally = Tally()
    tally.baseline("gate/u", [entry(1), entry(2)])
    tally.count_gate("u", [entry(1), entry(2)])
    assert sum(tally.gate_decisions.values()) == 0
    tally.count_gate("u", [entry(2), entry(3, "refused"), entry(4)])
    assert tally.gate_decisions == {("u", "refused"): 1, ("u", "passed"): 1}


def test_a_history_that_moved_on_by_more_than_it_keeps_counts_every_entry() -> None:
    """No overlap: all of it is new (the older ones are lost, not double counted)."""
    tally = Tally()
    tally.baseline("gate/u", [entry(1)])
    tally.count_gate("u", [entry(5), entry(6)])
    assert tally.gate_decisions["u", "passed"] == 2


def test_identical_entries_in_a_row_are_each_counted() -> None:
    """Two decisions alike in every field (same second): the overlap is the longest match."""
    tally = Tally()
    tally.baseline("gate/u", [entry(1), entry(2)])
    tally.count_gate("u", [entry(1), entry(2), entry(2)])
    assert tally.gate_decisions["u", "passed"] == 1


def test_the_gates_reaps_are_counted_by_outcome() -> None:
    """A new gate decision's reaped processes count under reaper="gate"; nonsense is skipped."""
    tally = Tally()
    decision = {
        "time": "t",
        "result": "passed",
        "reaped": [{"outcome": "exited"}, {"outcome": "made-up"}, "not an object"],
    }
    tally.count_gate("u", [decision])
    assert tally.reaped == {("gate", "exited"): 1}


def test_counters_survive_the_snapshot_and_malformed_ones_are_dropped() -> None:
    """to_json/from_json round trip; a wrong row is left out, not trusted."""
    tally = Tally()
    tally.count_recoveries("u", [{"result": "restarted"}, {"result": "failed"}])
    tally.count_reaped("daemon", "killed")
    tally.count_nvml(NvmlHealth.TIMED_OUT)
    tally.count_nvml(NvmlHealth.OK)
    back = Tally.from_json(tally.to_json())
    assert back.to_json() == tally.to_json()
    assert back.nvml_errors == {"timed-out": 1}
    broken = Tally.from_json({"recoveries": [["u", "restarted", -1], ["u", 3, 1], "x"]})
    assert not broken.recoveries
    assert not Tally.from_json("not a dict").reaped


def test_every_metric_is_documented_with_its_type() -> None:
    """docs/metrics.md has a row for each metric family, naming its type."""
    doc = (Path(__file__).resolve().parent.parent.parent / "docs" / "metrics.md").read_text()
    for family in families(observed((gpu(0),))):
        name = f"{family.name}_total" if family.type == "counter" else family.name
        assert re.search(rf"^\| `{name}` \| {family.type} \|", doc, re.MULTILINE), name


def test_a_gpu_a_process_not_fully_inspected_could_hold_is_not_idle() -> None:
    """As status judges it: no memory used, but a process the walk cut short may hold GPU 0."""
    flood = replace(training_job(40, 0), partial="more than 65,536 open descriptors")
    found = scrape(observed((gpu(0), gpu(1)), (flood,)))
    assert found["gpuguard_gpu_idle", (("gpu", "0"),)] == 0
    assert found["gpuguard_gpu_idle", (("gpu", "1"),)] == 1
