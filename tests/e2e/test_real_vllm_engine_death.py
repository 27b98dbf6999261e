"""The real vLLM's engine dies in a live unit: its API server exits 0, systemd restarts nothing.

vllm.service (real_engine.py) with the operator's `Restart=on-failure`, gpuguard's daemon as
shipped watching it (`server = "vllm"`, `on_engine_dead` left at `report`). Once it serves,
`VLLM::EngineCore` is SIGKILLed. Issue 34 found what vLLM 0.32 does then: the API server exits
with status 0 ("Deactivated successfully", vLLM #48966), so `Restart=on-failure` never fires and
the unit stays dead while systemd calls it a success. docs/liveness.md: a clean exit nobody asked
for is a dead engine at once; `gpuguard status` must say so (CRITICAL, exit 2) as soon as the
daemon has read that line.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest

from e2e.measure import SESSION_NOTES
from e2e.real_engine import (
    READY,
    START_TIMEOUT_S,
    UNIT,
    VLLM_CONFIG,
    read_the_tools,
    vllm_pids,
    wait_unit_line,
)

if TYPE_CHECKING:
    from e2e.gpubox import GpuBox

pytestmark = pytest.mark.slow

OPERATOR = "[Service]\nRestart=on-failure\nRestartSec=1\n"
#: docs/liveness.md ("Detected within"): an exit 0 nobody asked for is dead as soon as the daemon
#: reads PID 1's line; it follows the journal live (0.3 s measured here).
BOUND_S = 5.0


def test_real_vllm_engine_death_exits_0_and_status_reports_it(vllm_box: GpuBox) -> None:
    """SIGKILL of EngineCore: exit 0, no restart; status CRITICAL names the dead engine in time."""
    box = vllm_box.box
    box.write_file("/etc/gpuguard/gpuguard.toml", VLLM_CONFIG)
    vllm_box.start_daemon()
    vllm_box.drop_in(UNIT, "zz-operator.conf", OPERATOR)
    began = time.time()
    vllm_box.systemctl("start", UNIT)
    _, serving = wait_unit_line(box, READY, after_s=began, timeout=START_TIMEOUT_S)
    [core] = vllm_pids(box)["VLLM::EngineCor"]
    t0 = time.time()
    box.run(["kill", "-KILL", str(core)])
    box.wait_for(
        "vllm.service inactive",
        lambda: vllm_box.show(UNIT, "ActiveState") in {"inactive", "failed"},
        timeout=120,
    )
    ended = time.time()
    result = vllm_box.show(UNIT, "Result")
    reported: list[float] = []

    def critical() -> bool:
        done = vllm_box.gpuguard("status")
        if done.returncode == 2 and "engine dead" in done.stdout:
            reported.append(time.time())
            return True
        return False

    box.wait_for("status CRITICAL: engine dead", critical, timeout=60)
    seen, dead = vllm_box.wait_daemon_said(t0 - 1, "engine dead", timeout=10)
    readings = read_the_tools(vllm_box, "engine death")
    survivors = {name: pids for name, pids in vllm_pids(box).items() if pids}
    SESSION_NOTES.append(
        f"real vLLM engine death (SIGKILL of EngineCore), Restart=on-failure: unit inactive "
        f"{ended - t0:.1f} s after the kill (Result={result}, NRestarts="
        f"{vllm_box.show(UNIT, 'NRestarts')}); daemon's 'engine dead' {seen - t0:.1f} s after, "
        f"cause {dead.get('cause')!r}; status CRITICAL {reported[0] - t0:.1f} s after the kill; "
        f"survivors {survivors or 'none'}; GPU 0 {vllm_box.allocated_mib(0)} MiB"
    )
    assert result == "success", result  # vLLM's API server exits 0 (issue 34)
    assert vllm_box.show(UNIT, "NRestarts") == "0"
    assert vllm_box.show(UNIT, "ActiveState") == "inactive"  # Restart=on-failure: stays dead
    assert dead["invocation_id"] == serving
    assert dead["action"] == "report"
    assert seen - ended <= BOUND_S, (seen, ended)
    assert "engine dead since" in readings.status, readings.status
    assert readings.status_doc["exit_code"] == 2
    assert readings.metrics[f"gpuguard_unit_engine_dead,unit={UNIT}"] == 1, readings.metrics
    assert readings.metrics[f"gpuguard_unit_engine_deaths_total,unit={UNIT}"] == 1
    assert survivors == {}, survivors
    assert vllm_box.allocated() == [0, 0, 0, 0]
