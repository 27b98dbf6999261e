"""The real vLLM (0.32, CPU build) under the container's systemd, on the fake GPUs (issue 34).

`vllm_box` (conftest.py) is a gpubox with the cached venv of the real engine at /opt/vllm, the
tiny Llama at /opt/tiny-llama, the gpuguard-fakegpu plugin and vllm.service (real_engine.py,
docs/e2e.md "A real vLLM"). These tests check the harness itself: the real Worker holds GPU 0's
memory as NVML and /proc see it, and a Worker that finds the GPU held fails its start with
vLLM's own message.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from fakestate import allocations

from e2e.gpubox import STATE
from e2e.measure import SESSION_NOTES
from e2e.real_engine import (
    FREE_MEMORY,
    READY,
    REQUESTED_MIB,
    START_TIMEOUT_S,
    TOTAL_MIB,
    UNIT,
    unit_messages,
    vllm_pids,
    wait_unit_line,
)

if TYPE_CHECKING:
    from e2e.gpubox import GpuBox


def test_real_vllm_worker_holds_its_gpu(vllm_box: GpuBox) -> None:
    """The real vLLM serves, and its Worker alone holds GPU 0's memory, seen by NVML and /proc."""
    began = time.time()
    vllm_box.systemctl("start", UNIT)
    ready_at, _ = wait_unit_line(vllm_box.box, READY, after_s=began, timeout=START_TIMEOUT_S)
    SESSION_NOTES.append(f"real vLLM: '{READY}' {ready_at - began:.1f} s after its start")
    procs = vllm_pids(vllm_box.box)
    [worker] = procs["VLLM::Worker"]
    [core] = procs["VLLM::EngineCor"]  # the kernel cuts comm to 15 bytes
    main = int(vllm_box.show(UNIT, "MainPID"))
    host = {pid: vllm_box.box.host_pid(pid) for pid in (worker, core, main)}
    on_gpu0 = [a for a in allocations(vllm_box.state_on_host) if a.minor == 0]
    assert [(a.pid, a.mib) for a in on_gpu0] == [(host[worker], REQUESTED_MIB)]
    assert vllm_box.allocated() == [REQUESTED_MIB, 0, 0, 0]
    fds = vllm_box.box.run(["sh", "-c", f"readlink /proc/{worker}/fd/*"]).stdout.split()
    assert f"{STATE}/dev/nvidia0" in fds
    status = vllm_box.status_json()
    holders = {h["pid"] for h in status["holders"]}
    assert worker in holders
    assert core not in holders
    assert main not in holders


def test_real_vllm_start_fails_on_a_held_gpu(vllm_box: GpuBox) -> None:
    """A Worker that finds GPU 0 held fails its start with vLLM's own free-memory message."""
    vllm_box.box.run(
        [
            "systemd-run", "--unit=holder", f"--setenv=FAKENVML_STATE={STATE}",
            "/usr/local/bin/gpu_hold.py", "--state", STATE, "--gpus", "0", "--mib", "100000",
            "--name", "other-job",
        ]
    )  # fmt: skip
    vllm_box.box.wait_for(
        "the holder on GPU 0", lambda: vllm_box.allocated_mib(0) == 100000, timeout=15
    )
    vllm_box.drop_in(UNIT, "zz-once.conf", "[Service]\nRestart=no\n")
    began = time.time()
    vllm_box.systemctl("start", UNIT)
    vllm_box.box.wait_for(
        "vllm.service failed",
        lambda: vllm_box.show(UNIT, "ActiveState") == "failed",
        timeout=START_TIMEOUT_S,
    )
    SESSION_NOTES.append(f"real vLLM on a held GPU: failed {time.time() - began:.1f} s after start")
    messages = unit_messages(vllm_box.box, after_s=began)
    found = [m for line in messages for m in [FREE_MEMORY.search(line)] if m]
    assert found, "\n".join(messages[-40:])
    assert abs(float(found[0]["free"]) - (TOTAL_MIB - 100000) / 1024) < 0.01
    assert vllm_box.show(UNIT, "Result") == "exit-code"
    assert vllm_box.allocated_mib(0) == 100000  # the failed Worker took nothing
