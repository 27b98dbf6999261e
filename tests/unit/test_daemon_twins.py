"""The daemon's loop without root, systemd or GPUs: every port is an in-memory twin.

tests/support/daemontwins.py holds the twins (a replayed journal, a unit's systemctl, a
recorder, and a host whose GPUs are held by processes that exist only in memory). What the
daemon decides is the real code throughout: detector, diagnosis, recovery planner, kill policy.
tests/integration/test_daemon.py runs the same scenarios with real processes and the fake NVML.
"""

from __future__ import annotations

import json
from pathlib import Path

from daemontwins import (
    GpuHost,
    Harness,
    Process,
    ReplayFollower,
    UnitTwin,
    daemon_twin,
    loop_entries,
    newest_invocation,
    twin_settings,
)

from gpuguard.daemonsettings import DaemonSettings
from gpuguard.unitsettings import UnitSettings

UNIT = "sglang.service"
OLD_INVOCATION = "0" * 32


def build(
    tmp_path: Path,
    host: GpuHost,
    *,
    dry_run: bool = False,
    gpus: tuple[int | str, ...] | None = None,
    journal: list[dict[str, object]] | None = None,
) -> Harness:
    """A daemon watching UNIT through a replayed restart loop (or ``journal``), a few turns."""
    entries = [dict(e) for e in (journal or loop_entries(UNIT))]
    settings = twin_settings(
        tmp_path, {UNIT: UnitSettings(gpus=gpus)}, DaemonSettings(dry_run=dry_run)
    )
    twin = UnitTwin(invocation=newest_invocation(entries))
    return daemon_twin(settings, ReplayFollower(entries), host, twin)


def _events(harness: Harness, name: str) -> list[dict[str, object]]:
    return [fields for _, fields in harness.said(name)]


def test_a_loop_on_an_earlier_runs_workers_is_recovered(tmp_path: Path) -> None:
    """Workers of an ended run hold the unit's GPUs: stop, reap exactly them, reset-failed, start.

    A tenant's job on GPU 3, outside the unit's set, is neither signalled nor waited for.
    """
    host = GpuHost()
    cgroup = f"/system.slice/{UNIT}"
    stale = [host.add(Process(pid, (0, 1, 2), 30000, cgroup, OLD_INVOCATION)) for pid in (501, 502)]
    tenant = host.add(Process(900, (3,), 2000, "/user.slice/user-1000.slice/session-3.scope"))
    harness = build(tmp_path, host, gpus=(0, 1, 2))

    assert harness.daemon.run() == 0

    assert harness.unit.calls == [f"stop {UNIT}", f"reset-failed {UNIT}", f"start {UNIT}"]
    assert sorted(t.identity.pid for t in host.reaped) == [p.pid for p in stale]
    assert tenant.pid in host.processes
    loop = _events(harness, "restart loop")[0]
    assert (loop["cause"], loop["action"]) == ("stale-gpu-holders", "recover")
    assert _events(harness, "recovery finished")[0]["result"] == "restarted"
    assert harness.snapshots[-1]["units"][UNIT]["recoveries"][-1]["result"] == "restarted"
    assert harness.saved[UNIT]["in_progress"] is None
    assert harness.log.notes[0].startswith("READY")


def test_a_job_on_the_units_gpus_means_no_stop_and_the_operator_is_told(
    tmp_path: Path,
) -> None:
    """The same workers plus a tenant's job on GPU 3 of the unit's set (all GPUs).

    The job is no left-over of the unit (no evidence), so a recovery could not free the set:
    the unit is not stopped, nothing is reaped, and a CRITICAL line names the job and the
    operator's command (never worse).
    """
    host = GpuHost()
    cgroup = f"/system.slice/{UNIT}"
    host.add(Process(501, (0, 1, 2, 3), 30000, cgroup, OLD_INVOCATION))
    host.add(Process(900, (3,), 2000, "/user.slice/user-1000.slice/session-3.scope"))
    harness = build(tmp_path, host)

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    assert host.reaped == []
    assert 900 in host.processes
    [critical] = [f for level, _e, f in harness.log.lines if level == "critical"]
    assert "PID 900" in str(critical["blockers"])
    assert critical["command"] == f"gpuguard reap --unit {UNIT} --scope patterns"
    assert harness.snapshots[-1]["units"][UNIT]["needs_operator"] is True


def test_another_users_job_in_the_units_cgroup_gets_no_reap_command(tmp_path: Path) -> None:
    """A shared service's tenant job (another uid, the unit's cgroup) blocks the recovery.

    No scope of ``gpuguard reap`` would end it, so the daemon names none: the operator is told
    its owner must end it, as the gate's refusal and ``status`` say.
    """
    host = GpuHost()
    cgroup = f"/system.slice/{UNIT}"
    host.add(Process(501, (0, 1, 2, 3), 30000, cgroup, OLD_INVOCATION))
    host.add(Process(900, (3,), 2000, cgroup, OLD_INVOCATION, uids=(1000, 1000, 1000, 1000)))
    harness = build(tmp_path, host)

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    assert host.reaped == []
    [critical] = [f for level, _e, f in harness.log.lines if level == "critical"]
    assert "PID 900" in str(critical["blockers"])
    assert critical["command"] is None
    reason = harness.snapshots[-1]["units"][UNIT]["action_reason"]
    assert "No gpuguard command frees them: their owners must end them" in reason
    assert "--scope" not in reason


def test_a_loop_on_idle_gpus_is_only_reported(tmp_path: Path) -> None:
    """No holder: the loop has no GPU cause; nothing is stopped, started or signalled."""
    harness = build(tmp_path, GpuHost())

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    assert harness.host.reaped == []
    loop = _events(harness, "restart loop")[0]
    assert (loop["cause"], loop["action"]) == ("not-gpu-related", "report")


def test_stale_workers_on_a_mig_gpu_are_neither_reaped_nor_waited_for(tmp_path: Path) -> None:
    """MIG on the unit's GPUs: no stop, no reap; the loop is reported, with one line on MIG."""
    host = GpuHost(mig=frozenset({0, 1}))
    host.add(Process(501, (0, 1), 30000, f"/system.slice/{UNIT}", OLD_INVOCATION))
    harness = build(tmp_path, host, gpus=(0, 1))

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    assert host.reaped == []
    assert 501 in host.processes
    assert _events(harness, "restart loop")[0]["action"] == "report"
    said = _events(harness, "MIG GPUs not judged")
    assert len(said) == 1
    assert "MIG mode on GPU 0,1: not judged" in str(said[0]["gpu_set"])


def test_a_dry_run_touches_nothing(tmp_path: Path) -> None:
    """The same stale workers under dry_run: the daemon says what it would do, and does not."""
    host = GpuHost()
    host.add(Process(501, (0, 1), 30000, f"/system.slice/{UNIT}", OLD_INVOCATION))
    harness = build(tmp_path, host, dry_run=True)

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    assert host.reaped == []
    assert 501 in host.processes
    assert _events(harness, "restart loop")[0]["cause"] == "stale-gpu-holders"


def test_the_gpu_host_twin_frees_memory_when_a_holder_is_reaped() -> None:
    """A positive control of the twin itself: its inventory follows its processes."""
    host = GpuHost(gpus=2)
    host.add(Process(7, (1,), 1000, f"/system.slice/{UNIT}"))
    before = host.gather()
    assert [h.pid for h in before.holders] == [7]
    assert before.gpus[1].reading.memory is not None
    assert before.gpus[1].reading.memory.used_bytes == 1000 * 1024 * 1024
    host.processes.clear()
    assert host.gather().holders == ()


def test_a_left_over_at_an_operators_start_is_logged_as_a_finding_not_a_loop(
    tmp_path: Path,
) -> None:
    """The recorded left-over at an operator's start: the daemon logs the finding, no loop."""
    sample = Path(__file__).resolve().parents[1] / "journal_samples/bookworm/left-over-at-start"
    journal = [json.loads(line) for line in sample.with_suffix(".jsonl").read_text().splitlines()]
    harness = build(tmp_path, GpuHost(), journal=journal)

    assert harness.daemon.run() == 0

    assert _events(harness, "restart loop") == []
    assert harness.unit.calls == []
    found: list[str] = []
    for fields in _events(harness, "verdict"):
        said = fields.get("findings")
        if isinstance(said, list):
            found += [str(line) for line in said]
    assert found
    assert all("a finding, not a loop" in line for line in found)
