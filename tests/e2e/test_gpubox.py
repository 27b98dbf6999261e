"""gpuguard installed in a container over the fake NVML, with the fake GPU driver and fake SGLang.

The scenarios (test_incident.py) stand on this: if the install, the system-wide fake NVML or the
fake server misbehaves, it shows here first, with a plain message.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import pytest
from fakestate import allocations

from e2e.container import Container
from e2e.gpubox import STATE, UNIT, GpuBox, install
from e2e.measure import results_dir

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from e2e.gpubox import Artifacts

WORKER_MIB = 122205  # 0.85 of an H200's 143771 MiB
MAIN_MIB = 512


@pytest.fixture(scope="module")
def gpubox(rootfs: Path, e2e_artifacts: Artifacts) -> Iterator[GpuBox]:
    """One container for this module's checks, which run in file order (the server last)."""
    with Container(rootfs, binds=e2e_artifacts.binds()) as booted:
        box = GpuBox(booted, install_s=install(booted))
        yield box
        box.kill_server()


def test_gpuguard_sees_four_fake_gpus_through_the_system_nvml(gpubox: GpuBox) -> None:
    """The wheel installs into /opt/gpuguard; pynvml finds the fake through ldconfig alone."""
    box = gpubox.box
    assert box.run(["readlink", "/usr/bin/gpuguard"]).stdout.strip() == "/opt/gpuguard/bin/gpuguard"
    assert box.run(["gpuguard", "--version"]).stdout.startswith("gpuguard ")
    assert f"FAKENVML_STATE={STATE}" in box.systemctl("show-environment").stdout
    assert "libnvidia-ml.so.1" in box.run(["ldconfig", "-p"]).stdout
    status = gpubox.status_json()
    assert status["nvml"]["health"] == "ok"
    assert [gpu["name"] for gpu in status["gpus"]] == ["NVIDIA H200"] * 4
    assert all(gpu["idle"] for gpu in status["gpus"])
    assert status["exit_code"] == 0, status["findings"]
    assert box.systemctl("is-active", "fakegpu-driver.service").stdout.strip() == "active"


def test_gpu_hold_inside_is_seen_and_released(gpubox: GpuBox) -> None:
    """gpu_hold.py holds fake memory; NVML names its host PID, as the real driver would.

    gpuguard status finds it through its device file and credits the GPU's memory to this
    container as a whole (healthy, exit 0); killing it frees it.
    """
    hold = f"gpu_hold.py --state {STATE} --gpus 1 --mib 1000 --name foreign-job"
    gpubox.box.run(["sh", "-c", f"{hold} >/tmp/hold.json 2>&1 </dev/null &"])
    gpubox.box.wait_for("gpu_hold ready", lambda: gpubox.allocated_mib(1) == 1000, timeout=10)
    info = json.loads(gpubox.box.read_file("/tmp/hold.json"))
    host = gpubox.box.host_pid(info["pid"])
    assert [a.pid for a in allocations(gpubox.state_on_host)] == [host]
    status = gpubox.status_json()
    assert status["containment"]["foreign_pids"] is True
    [holder] = status["holders"]
    assert holder["pid"] == info["pid"]
    assert holder["gpus"][0]["holds_device_file"] is True
    assert status["vanished"] == [{"pid": host, "gpu": 1, "used_mib": 1000}]
    assert status["gpus"][1]["container_mib"] == 1000
    assert status["exit_code"] == 0, status["findings"]
    gpubox.box.run(["kill", str(info["pid"])])
    gpubox.box.wait_for("released", lambda: gpubox.allocated_mib(1) == 0, timeout=10)


def test_a_host_pid_equal_to_an_unrelated_process_here_touches_nothing(gpubox: GpuBox) -> None:
    """Another container's process on GPU 2 has host PID P; P here is an unrelated service.

    Status names P foreign and the memory as used from outside (WARNING, not CRITICAL); a reap
    of scope all plans nothing for P; P lives on. (The gate's line on outside memory is proven
    in tests/integration/test_pid_namespace.py: a refused gate here would mark the unit.)
    """
    box = gpubox.box
    box.run(["systemd-run", "--quiet", "--unit", "tenant-cron", "sleep", "600"])
    pid = int(gpubox.show("tenant-cron.service", "MainPID"))
    alloc = gpubox.state_on_host / "allocs" / "other-container.alloc"
    alloc.write_text(f"pid={pid}\nminor=2\nmib=3000\nkind=compute\n")
    try:
        status = gpubox.status_json()
        assert status["foreign"] == [{"pid": pid, "gpu": 2, "used_mib": 3000}]
        assert pid not in [h["pid"] for h in status["holders"]]
        assert status["gpus"][2]["outside_mib"] == 3000
        assert status["status"] == "WARNING", status["findings"]
        reap = json.loads(gpubox.gpuguard("reap", "--scope", "all", "--dry-run", "--json").stdout)
        assert pid not in [entry["pid"] for entry in reap["plan"]]
        assert gpubox.show("tenant-cron.service", "MainPID") == str(pid)
    finally:
        alloc.unlink()
        box.systemctl("stop", "tenant-cron.service", check=False)


def test_fake_sglang_serves_on_four_gpus_with_named_tp_workers(gpubox: GpuBox) -> None:
    """The fake server loads, allocates from its main process and four sglang::scheduler_TP*."""
    began = time.monotonic()
    invocation = gpubox.start_server()
    assert time.monotonic() - began >= 2.0  # the model load
    assert gpubox.allocated() == [WORKER_MIB + MAIN_MIB] * 4
    status = gpubox.status_json()
    workers = [h for h in status["holders"] if h["cmdline"][0].startswith("sglang::scheduler_TP")]
    assert sorted(h["cmdline"][0] for h in workers) == [
        f"sglang::scheduler_TP{i}" for i in range(4)
    ]
    assert {h["comm"] for h in workers} == {"sglang::schedul"}
    assert {h["unit"] for h in status["holders"]} == {UNIT}
    assert {h["invocation_id"] for h in status["holders"]} == {invocation}
    assert status["exit_code"] == 0, status["findings"]
    # NVML names only host PIDs here: the memory is the container's, and status says so.
    assert status["containment"]["foreign_pids"] is True
    assert [gpu["container_mib"] for gpu in status["gpus"]] == [WORKER_MIB + MAIN_MIB] * 4
    text = gpubox.gpuguard("status").stdout
    results_dir().mkdir(parents=True, exist_ok=True)
    (results_dir() / "status-in-container.txt").write_text(text)  # kept for docs/e2e.md
