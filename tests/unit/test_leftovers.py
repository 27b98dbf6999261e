"""One rule for left-overs and blockers: status, the metrics and the gate say the same (pure).

Two servers on disjoint GPUs, an escaped worker that only its command line ties to a unit, a
restart loop whose memory gpuguard will not reap: each judged by status, counted by the metrics
and, for the gate, named with the operator's command.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING

import snapshots
from builders import (
    STATUS_CONTEXT,
    UNIT_CGROUP,
    gpu,
    inventory,
    nvml,
    plan_request,
    process,
    training_job,
)
from prometheus_client.parser import text_string_to_metric_families

from gpuguard.config import parse_settings, warnings
from gpuguard.core.gate.run import GateSettings, run_gate
from gpuguard.core.leftovers import Kind, WatchedUnit, left_overs, live_owner
from gpuguard.core.metrics import Observed, exposition, families
from gpuguard.core.status.judge import assess
from gpuguard.core.status.report import StatusContext, UnitView
from gpuguard.core.status.text import render_text
from gpuguard.core.tally import Tally
from gpuguard.core.values import MIB, UnitProvenance

if TYPE_CHECKING:
    from pathlib import Path

    from gpuguard.core.inventory import Inventory
    from gpuguard.core.snapshot import DaemonView

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
A, B = "sglang-a.service", "sglang-b.service"
LIVE_A, LIVE_B = "a" * 32, "b" * 32
KNOWN = UnitProvenance(None, frozenset(), 0)
ESCAPED_SCOPE = "/system.slice/run-u42.scope"
"""Where ``systemd-run --scope`` puts a worker: its own transient unit and INVOCATION_ID."""


def two_units(
    *, live_a: str | None = LIVE_A, live_b: str | None = LIVE_B
) -> tuple[WatchedUnit, ...]:
    """A on GPUs 0,1 and B on GPUs 2,3, both from CUDA_VISIBLE_DEVICES, both running."""
    return (
        WatchedUnit(A, ("sglang",), frozenset({0, 1}), live_a, KNOWN, "CUDA_VISIBLE_DEVICES=0,1"),
        WatchedUnit(B, ("sglang",), frozenset({2, 3}), live_b, KNOWN, "CUDA_VISIBLE_DEVICES=2,3"),
    )


def b_serving() -> Inventory:
    """B's live server on GPUs 2,3 (one worker escaped into its own scope), A's GPUs idle."""
    return inventory(
        nvml(gpu(0), gpu(1), gpu(2, (20, 70000)), gpu(3, (21, 70000))),
        process(20, 2, cgroup=f"/system.slice/{B}", invocation_id=LIVE_B),
        process(21, 3, cgroup=ESCAPED_SCOPE, invocation_id=LIVE_B, cmdline=("sglang::tp1",)),
    )


def status_of(
    found: Inventory,
    watched: tuple[WatchedUnit, ...],
    *,
    daemon: DaemonView | None = None,
    units: tuple[UnitView, ...] = (),
) -> str:
    """Status's exit status and text for these watched units."""
    judged: StatusContext = replace(
        STATUS_CONTEXT,
        watched_units={u.name: u.patterns for u in watched},
        watched=watched,
        daemon=daemon,
        units=units,
    )
    report = assess(found, judged, NOW)
    return f"{int(report.level)}\n{render_text(report)}"


def metrics_of(found: Inventory, units: tuple[WatchedUnit, ...]) -> dict[str, float]:
    """The per-GPU left-over gauges the daemon would export for the same facts."""
    observed = Observed(
        inventory=found,
        inventory_age_s=0.0,
        watched_units=[u.name for u in units],
        live_invocations={u.name: u.live_invocation for u in units},
        protected_names=("nvidia-persistenced",),
        idle_threshold_bytes=16 * MIB,
        snapshot=None,
        daemon_running=True,
        gate_refused={},
        tally=Tally(),
        now_wall=0.0,
        watched=units,
    )
    return {
        f"{sample.name}{{{sample.labels.get('gpu')}}}": sample.value
        for family in text_string_to_metric_families(exposition(families(observed)).decode())
        for sample in family.samples
        if "stale_holders" in sample.name
    }


def test_another_units_live_workers_are_no_units_left_over() -> None:
    """B's running workers, one escaped into a scope, are a left-over of neither A nor B."""
    units = two_units()
    assert left_overs(b_serving(), units, ("nvidia-persistenced",)) == ()
    text = status_of(b_serving(), units)
    assert text.startswith("0\n"), text
    assert "left-over" not in text
    assert "share GPUs" not in text
    assert metrics_of(b_serving(), units)["gpuguard_gpu_stale_holders{3}"] == 0


def test_two_units_with_cuda_visible_devices_are_not_warned_as_setting_no_gpus(
    tmp_path: Path,
) -> None:
    """Neither unit lists gpus (both set CUDA_VISIBLE_DEVICES): no "set no gpus" warning.

    Status warns only when the sets it resolves overlap.
    """
    settings = parse_settings(
        f'[units."{A}"]\npatterns = ["sglang"]\n[units."{B}"]\npatterns = ["sglang"]\n'.encode(),
        tmp_path / "gpuguard.toml",
    )
    assert warnings(settings) == ()
    a, b = two_units()
    overlapping = (a, replace(b, gpu_set=frozenset({1, 2}), gpu_source="CUDA_VISIBLE_DEVICES=1,2"))
    text = status_of(b_serving(), overlapping)
    assert f"units {A} and {B} share GPUs: both use GPU 1" in text
    everywhere = (a, replace(b, gpu_set=None, gpu_source="no GPUs configured and no CUDA_VIS…"))
    assert f"{B} may use every GPU" in status_of(b_serving(), everywhere)


def test_an_escaped_worker_of_an_ended_run_is_suspected_and_counted_alike() -> None:
    """A's old worker in its own scope: suspected by status, counted alike by the metrics.

    It has its own INVOCATION_ID (systemd-run --scope); B's live run stays untouched.
    """
    found = inventory(
        nvml(gpu(0, (30, 100000)), gpu(1), gpu(2, (20, 70000)), gpu(3)),
        process(30, 0, cgroup=ESCAPED_SCOPE, invocation_id="c" * 32, cmdline=("sglang::tp0",)),
        process(20, 2, cgroup=f"/system.slice/{B}", invocation_id=LIVE_B),
    )
    units = two_units(live_a=None)
    (left,) = left_overs(found, units, ())
    assert (left.holder.pid, left.unit, left.kind) == (30, A, Kind.SUSPECTED)
    text = status_of(found, units)
    assert f"PID 30 (python3) holding GPU 0 looks like a left-over of {A}" in text
    assert f"`gpuguard reap --unit {A} --scope patterns`" in text
    counted = metrics_of(found, units)
    assert counted["gpuguard_gpu_stale_holders{0}"] == 1
    assert counted["gpuguard_gpu_suspected_stale_holders{0}"] == 1
    assert counted["gpuguard_gpu_stale_holders{2}"] == 0


def test_an_old_run_in_the_units_cgroup_is_proven_and_counted() -> None:
    """A process of an ended run in the unit's own cgroup: proven, counted, not suspected."""
    found = inventory(
        nvml(gpu(0, (30, 100000)), gpu(1), gpu(2), gpu(3)),
        process(30, 0, cgroup=f"/system.slice/{A}", invocation_id="c" * 32),
    )
    units = two_units()
    (left,) = left_overs(found, units, ())
    assert left.kind is Kind.PROVEN
    assert f"is a left-over of {A}" in status_of(found, units)
    counted = metrics_of(found, units)
    assert counted["gpuguard_gpu_stale_holders{0}"] == 1
    assert counted["gpuguard_gpu_suspected_stale_holders{0}"] == 0


def loop_snapshot() -> DaemonView:
    """The daemon's snapshot: A loops on CUDA OOM, cause stale GPU holders."""
    unit = snapshots.unit(
        looping=True,
        cause="stale-gpu-holders",
        verdict="restart loop: 26 failed starts in 600 s",
        action="none",
    )
    return snapshots.running(snapshots.written({A: unit}))


def test_a_gpu_loop_gpuguard_cannot_reap_is_critical_with_blockers_and_the_command() -> None:
    """A loops on a GPU held by a worker no evidence ties to it: CRITICAL, PID and command named.

    Exit 2: nothing but an operator ends such a loop.
    """
    found = inventory(
        nvml(gpu(0, (30, 100000)), gpu(1), gpu(2), gpu(3)),
        process(30, 0, cgroup=ESCAPED_SCOPE, invocation_id="c" * 32, cmdline=("sglang::tp0",)),
    )
    text = status_of(found, two_units(live_a=None), daemon=loop_snapshot())
    headline = next(line for line in text.splitlines() if line.startswith("CRITICAL: "))
    assert text.startswith("2\n"), text
    assert f"{A} is in a restart loop caused by its GPUs that gpuguard cannot end" in headline
    assert "PID 30 (python3, run-u42.scope) on GPU 0" in headline
    assert f"run `gpuguard reap --unit {A} --scope patterns`" in headline


def test_a_gpu_loop_gpuguard_frees_itself_stays_a_warning() -> None:
    """The holders are proven left-overs the daemon reaps: a loop in hand, WARNING (1)."""
    found = inventory(
        nvml(gpu(0, (30, 100000)), gpu(1), gpu(2), gpu(3)),
        process(30, 0, cgroup=f"/system.slice/{A}", invocation_id="c" * 32),
    )
    text = status_of(found, two_units(live_a=None), daemon=loop_snapshot())
    assert text.startswith("1\n"), text


def test_a_refusal_ages_out_of_the_headline_once_the_gpus_are_idle() -> None:
    """The gate refused A's last start; A's GPUs are idle now: history (OK), said so."""
    refused = UnitView(
        A,
        "failed (failed)",
        "GPUs 0,1",
        ({"time": "t2", "result": "refused", "blockers": ["GPU 0: 500 MiB used, held by X"]},),
    )
    idle = inventory(nvml(gpu(0), gpu(1), gpu(2), gpu(3)))
    text = status_of(idle, two_units(live_a=None), units=(refused,))
    assert text.startswith("0\n"), text
    assert "its cause is gone: its GPUs are idle now" in text
    busy = inventory(nvml(gpu(0, used_mib=500), gpu(1), gpu(2), gpu(3)))
    assert status_of(busy, two_units(live_a=None), units=(refused,)).startswith("2\n")


def test_the_gates_refusal_names_the_patterns_command() -> None:
    """The gate keeps an escaped worker and times out: its line names the command first."""
    found = inventory(
        nvml(gpu(0, (30, 100000))),
        process(30, 0, cgroup=ESCAPED_SCOPE, invocation_id="c" * 32, cmdline=("sglang::tp0",)),
    )
    settings = GateSettings(plan_request(gpu_set=frozenset({0})), 16 * MIB, timeout_s=0.0)
    outcome = run_gate(settings, lambda: found, lambda _: (), lambda: 0.0, lambda _: None)
    assert not outcome.passed
    assert outcome.message.startswith(
        "GPUs of sglang.service still busy after 0.0 s (gpuguard keeps holders that only "
        "sglang.service's patterns tie to it: after checking them, "
        "`gpuguard reap --unit sglang.service --scope patterns` frees them): GPU 0:"
    )


def test_the_gates_refusal_names_no_command_for_another_users_job_in_the_units_cgroup() -> None:
    """A shared service's other user's job (in its cgroup, matching its patterns): no command.

    ``--scope patterns`` never reaps another uid in the unit's own cgroup, so naming it as the
    way out would send the operator to a command that frees nothing.
    """
    bobs = replace(
        process(31, 0, cgroup=UNIT_CGROUP, cmdline=("sglang::tp0",)), uid=1001, uids=(1001,) * 4
    )
    found = inventory(nvml(gpu(0, (31, 100000))), bobs)
    settings = GateSettings(plan_request(gpu_set=frozenset({0})), 16 * MIB, timeout_s=0.0)
    outcome = run_gate(settings, lambda: found, lambda _: (), lambda: 0.0, lambda _: None)
    assert not outcome.passed
    assert outcome.way_out is None
    assert "gpuguard reap" not in outcome.message, outcome.message
    assert "not as sglang.service's user (uid 0): never its" in outcome.message


def test_a_loop_that_does_not_fit_says_the_knob() -> None:
    """The daemon found a loop out of memory on GPUs nothing holds: status names the setting."""
    detail = (
        "run 1234abcd… printed: RuntimeError: Not enough memory. Please try to increase "
        "--mem-fraction-static.: no process holds the unit's GPUs: the server does not fit as "
        "configured and every restart fails the same way; change --mem-fraction-static"
    )
    unit = snapshots.unit(looping=True, cause="does-not-fit", cause_detail=detail, action="report")
    idle = inventory(nvml(gpu(0), gpu(1), gpu(2), gpu(3)))
    text = status_of(
        idle, two_units(live_a=None), daemon=snapshots.running(snapshots.written({A: unit}))
    )
    assert text.startswith("1\n"), text
    assert f"{A} is in a restart loop that no reap can end" in text
    assert "change --mem-fraction-static" in text


def test_a_gpu_loop_held_by_a_tenants_job_names_no_reap_command() -> None:
    """A loops while alice's training job holds its GPU 0: CRITICAL, but no command ends her job."""
    found = inventory(
        nvml(gpu(0, (40, 100000)), gpu(1), gpu(2), gpu(3)),
        replace(training_job(40, 0), invocation_id="d" * 32),
    )
    text = status_of(found, two_units(live_a=None), daemon=loop_snapshot())
    headline = next(line for line in text.splitlines() if line.startswith("CRITICAL: "))
    assert text.startswith("2\n"), text
    assert f"not {A}'s by any evidence, which gpuguard never reaps: PID 40" in headline
    assert "gpuguard reap" not in headline


def test_a_tenant_naming_another_units_live_run_does_not_pose_as_it() -> None:
    """Uid 1001 holding A's GPU with B's INVOCATION_ID (anyone can read it) is no live B process."""
    tenant = replace(
        process(30, 0, cgroup="/user.slice/user-1001.slice/session-3.scope", invocation_id=LIVE_B),
        uid=1001,
        uids=(1001,) * 4,
    )
    found = inventory(nvml(gpu(0, (30, 70000)), gpu(1), gpu(2), gpu(3)), tenant)
    units = two_units()
    assert live_owner(found.holders[0], units) is None
    escaped_b = b_serving().holders[1]  # B's own worker, B's uid, outside its cgroup: B's
    assert live_owner(escaped_b, units) == B


def test_another_users_server_is_no_left_over_and_its_owners_to_stop() -> None:
    """A tenant's own `python -m sglang` (uid 1000) beside A's escaped worker on GPU 0.

    Not a suspected left-over of A (status and the metrics count only the worker); among the
    blockers it is named as its owner's to stop, and the command is still the patterns reap,
    which spares it (policy: another uid is never the unit's).
    """
    tenant = replace(process(31, 0, cgroup="/user.slice/user-1000.slice/session-4.scope"),
                     uids=(1000, 1000, 1000, 1000), uid=1000, user="tenant")  # fmt: skip
    found = inventory(
        nvml(gpu(0, (30, 60000), (31, 20000)), gpu(1), gpu(2), gpu(3)),
        process(30, 0, cgroup=ESCAPED_SCOPE, invocation_id="c" * 32, cmdline=("sglang::tp0",)),
        tenant,
    )
    units = two_units(live_a=None)
    assert [left.holder.pid for left in left_overs(found, units, ())] == [30]
    counted = metrics_of(found, units)
    assert counted["gpuguard_gpu_stale_holders{0}"] == 1
    text = status_of(found, units, daemon=loop_snapshot())
    headline = next(line for line in text.splitlines() if line.startswith("CRITICAL: "))
    assert "PID 31 (python3, session-4.scope) on GPU 0: runs as uid 1000/1000/1000/1000" in headline
    assert "its owner's to stop" in headline
    assert f"run `gpuguard reap --unit {A} --scope patterns`" in headline
