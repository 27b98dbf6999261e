"""The incident with the real vLLM: its API server crashes, its engine lives on holding the GPU.

vllm.service (real_engine.py) with an operator's drop-in `KillMode=process`, `Restart=always`,
`RestartSec=1`, named to sort after gpuguard's gate drop-in so it outlasts the gate's
`KillMode=mixed`. The API server (the main process) is SIGKILLed; systemd kills nothing else, so
vLLM's `VLLM::EngineCore` and `VLLM::Worker` stay in the unit's cgroup, the Worker holding 0.9 of
GPU 0 (issue 34: they survive 30 s and more). Without gpuguard every next start fails with vLLM's
own free-memory line; with the gate drop-in as shipped the start passes once the survivors are
reaped, and serves. Failed starts and the time to "Application startup complete." are counted
from PID 1's and the unit's journal entries after the crash.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest

from e2e.gpubox import GATE_DROPIN
from e2e.measure import SESSION_NOTES
from e2e.real_engine import (
    FREE_MEMORY,
    READY,
    REQUESTED_MIB,
    START_TIMEOUT_S,
    UNIT,
    VLLM_CONFIG,
    Readings,
    read_the_tools,
    unit_entries,
    vllm_pids,
    wait_unit_line,
)

if TYPE_CHECKING:
    from e2e.container import Container
    from e2e.gpubox import GpuBox

pytestmark = pytest.mark.slow

OPERATOR = "[Service]\nKillMode=process\nRestart=always\nRestartSec=1\n"
#: How long the unguarded loop is watched after the crash: room for two or three failed starts.
WINDOW_S = 120.0


def _exits_after(box: Container, t0: float) -> list[str]:
    """PID 1's "Main process exited" lines for the unit after `t0` (journald's trusted _PID)."""
    entries = box.journal(["_PID=1", f"UNIT={UNIT}", f"--since=@{int(t0)}"])
    return [
        str(e.get("MESSAGE"))
        for e in entries
        if int(str(e["__REALTIME_TIMESTAMP"])) / 1e6 >= t0
        and "Main process exited" in str(e.get("MESSAGE"))
    ]


def _alive(box: Container, pid: int) -> bool:
    return box.run(["test", "-d", f"/proc/{pid}"], check=False).returncode == 0


@pytest.mark.parametrize("mode", ["without-gpuguard", "with-gate", "daemon-alone"])
def test_real_vllm_crash_with_survivors(vllm_box: GpuBox, mode: str) -> None:
    """Without gpuguard the starts after the crash fail on the held GPU; guarded, none fails."""
    box = vllm_box.box
    guarded = mode != "without-gpuguard"
    if guarded:
        box.write_file("/etc/gpuguard/gpuguard.toml", VLLM_CONFIG)
    if mode == "with-gate":
        box.write_file(f"/etc/systemd/system/{UNIT}.d/gpuguard-gate.conf", GATE_DROPIN.read_text())
    if mode == "daemon-alone":
        vllm_box.start_daemon()
    vllm_box.drop_in(UNIT, "zz-operator.conf", OPERATOR)
    assert vllm_box.show(UNIT, "KillMode") == "process"
    began = time.time()
    vllm_box.systemctl("start", UNIT)
    ready_at, serving = wait_unit_line(box, READY, after_s=began, timeout=START_TIMEOUT_S)
    procs = vllm_pids(box)
    [worker] = procs["VLLM::Worker"]
    [core] = procs["VLLM::EngineCor"]
    assert vllm_box.allocated() == [REQUESTED_MIB, 0, 0, 0]
    t0 = time.time()
    vllm_box.systemctl("kill", "--kill-whom=main", "--signal=SIGKILL", UNIT)
    healthy: list[tuple[float, str]] = []

    def served_again() -> bool:
        entries = unit_entries(box, after_s=t0)
        healthy.extend((t, i) for t, i, m in entries if READY in m and i != serving)
        return bool(healthy)

    deadline = t0 + (START_TIMEOUT_S if guarded else WINDOW_S)
    while not served_again() and time.time() < deadline:
        time.sleep(1.0)
    exits = _exits_after(box, t0)
    failed = [line for line in exits if "code=exited" in line and "status=0/" not in line]
    oom = [m for m in (FREE_MEMORY.search(x) for x in unit_entries_text(box, t0)) if m]
    label = {"with-gate": "with the gate", "daemon-alone": "daemon alone"}.get(
        mode, "without gpuguard"
    )
    after = f"healthy {healthy[0][0] - t0:.1f} s after the crash" if healthy else "never healthy"
    SESSION_NOTES.append(
        f"real vLLM crash, KillMode=process, {label}: serving {ready_at - began:.1f} s after its "
        f"start; after the crash {len(failed)} failed starts ({len(oom)} free-memory lines), "
        f"{after} (watched {time.time() - t0:.0f} s)"
    )
    if guarded:
        readings = read_the_tools(vllm_box, label)
        assert failed == [], (failed, readings.explain, vllm_box.daemon_log(t0))
        _assert_recovered(vllm_box, readings, healthy[0][1] if healthy else None, (worker, core))
        # The crashed run had served: a crash, not a failed start.
        crashes = readings.explain_doc["story"]["crashes"]
        assert [line[:12] for line in crashes] == [f"run {serving[:8]}"], crashes
        if mode == "daemon-alone":  # its metrics: no loop, the sweep's reap counted
            metrics = readings.metrics
            assert metrics[f"gpuguard_unit_restart_loop,unit={UNIT}"] == 0, metrics
            reaped = {
                k: v
                for k, v in metrics.items()
                if k.startswith("gpuguard_reaped_processes_total,") and "reaper=daemon" in k
            }
            assert sum(reaped.values()) >= 1, metrics
    else:
        assert healthy == [], healthy
        assert failed, exits
        assert oom, unit_entries_text(box, t0)[-40:]
        assert _alive(box, worker)
        assert _alive(box, core)


def _assert_recovered(
    vllm_box: GpuBox, readings: Readings, invocation: str | None, old: tuple[int, int]
) -> None:
    """A new run serves, the old engine is gone, and status, explain and doctor say so."""
    box = vllm_box.box
    assert invocation is not None, "never healthy"
    assert not _alive(box, old[0])
    assert not _alive(box, old[1])
    [new_worker] = vllm_pids(box)["VLLM::Worker"]
    assert new_worker != old[0]
    assert vllm_box.allocated() == [REQUESTED_MIB, 0, 0, 0]
    # One crash and one restart that served: no loop, and the tools say so from the journal.
    assert readings.status_rc == 0, readings.status
    assert readings.status_doc["status"] == "OK", readings.status
    story = readings.explain_doc["story"]
    assert "restart loop" not in story["verdict"], readings.explain
    assert story["verdict"].startswith("no loop"), readings.explain
    assert story["disagreements"] == [], story["disagreements"]
    assert story["healthy"].startswith(f"run {invocation[:8]}"), story["healthy"]
    # The operator's KillMode=process left the engine behind: doctor names it.
    codes = {f["code"] for u in readings.doctor_doc["units"] for f in u["findings"]}
    assert "kill-mode" in codes, readings.doctor
    assert story["failed_starts"] == [], story["failed_starts"]


def unit_entries_text(box: Container, t0: float) -> list[str]:
    """The unit's own lines after `t0`."""
    return [m for _, _, m in unit_entries(box, after_s=t0)]
