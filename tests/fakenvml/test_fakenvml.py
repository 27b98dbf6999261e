"""The fake libnvidia-ml.so.1 seen through the real pynvml, and the gpu_hold.py helper.

Every NVML check runs in a subprocess that loads the fake by absolute path before pynvml finds it
by soname (never through ``LD_LIBRARY_PATH``), so these tests never load it into pytest itself.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from fakeholder import HolderSpawner, process_gone, start_time, wait_gone
from fakestate import (
    GPU_HOLD,
    H200_TOTAL_MIB,
    MIB,
    FakeGpu,
    add_alloc,
    allocated_mib,
    fake_pci_bus_id,
    fake_uuid,
    now_ms,
    release_alloc,
    update_gpu,
    update_state,
    write_state,
)

if TYPE_CHECKING:
    from fakestate import NvmlEnv

_PRELUDE = """\
import ctypes, json, os, sys, time
if "FAKENVML_LIBRARY" in os.environ:  # pynvml's dlopen then finds it by soname
    ctypes.CDLL(os.environ["FAKENVML_LIBRARY"])
import pynvml

def out(value):
    print(json.dumps(value))

def error(call, *args, **kwargs):
    try:
        call(*args, **kwargs)
    except Exception as err:
        return type(err).__name__
    return None

def procs(handle, call=pynvml.nvmlDeviceGetComputeRunningProcesses):
    return [[p.pid, None if p.usedGpuMemory is None else p.usedGpuMemory // 1048576]
            for p in call(handle)]
"""


def run_py(env: dict[str, str], body: str, timeout: float = 20.0) -> Any:
    """Run ``body`` (after a prelude importing pynvml) in a subprocess; its last JSON line."""
    result = subprocess.run(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(body)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def cmdline(pid: int) -> list[str]:
    """The process's argv as the kernel shows it."""
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return raw.decode().split("\0")[:-1]


def comm(pid: int) -> str:
    """The process's comm (15 characters at most)."""
    return Path(f"/proc/{pid}/comm").read_text(encoding="utf-8").strip()


def device_fds(pid: int) -> list[str]:
    """Targets of the process's fds that are fake device files."""
    fd_dir = Path(f"/proc/{pid}/fd")
    targets = []
    for fd in fd_dir.iterdir():
        try:
            target = str(fd.readlink())
        except OSError:
            continue
        if "/dev/nvidia" in target:
            targets.append(target)
    return sorted(targets)


# ---------------------------------------------------------------------------------------------
# Build and identity
# ---------------------------------------------------------------------------------------------


def test_libraries_export_the_expected_symbols(
    fake_nvml_dir: Path, fake_nvml_old_dir: Path
) -> None:
    """The new library exports every symbol of docs/facts.md §1.8; the old one lacks >= 510's."""
    body = """
    lib = ctypes.CDLL(sys.argv[1] + "/libnvidia-ml.so.1")
    names = sys.argv[2:]
    out({name: hasattr(lib, name) for name in names})
    """
    names = [
        "nvmlInitWithFlags", "nvmlInit_v2", "nvmlShutdown", "nvmlErrorString",
        "nvmlSystemGetDriverVersion", "nvmlSystemGetProcessName", "nvmlDeviceGetCount_v2",
        "nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByUUID",
        "nvmlDeviceGetHandleByPciBusId_v2", "nvmlDeviceGetName", "nvmlDeviceGetUUID",
        "nvmlDeviceGetIndex", "nvmlDeviceGetMinorNumber", "nvmlDeviceGetPciInfo_v3",
        "nvmlDeviceGetMigMode", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetMPSComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetGraphicsRunningProcesses_v2", "nvmlDeviceGetMPSComputeRunningProcesses_v2",
        "nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetPersistenceMode",
        "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetFieldValues",
    ]  # fmt: skip
    only_new = {
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
    }
    for lib_dir, old in ((fake_nvml_dir, False), (fake_nvml_old_dir, True)):
        code = _PRELUDE + textwrap.dedent(body)
        result = subprocess.run(
            [sys.executable, "-c", code, str(lib_dir), *names],
            capture_output=True,
            text=True,
            check=True,
        )
        exported = json.loads(result.stdout)
        assert exported == {name: not (old and name in only_new) for name in names}


def test_identity_of_each_gpu(fake_state: Path, nvml_env: NvmlEnv) -> None:
    """Count, name, UUID, index, minor, PCI ids and driver version come from gpus.json."""
    gpus = [FakeGpu(), FakeGpu(name='Fake "quoted" GPU \u00e9\U0001f600', minor=7)]
    write_state(fake_state, gpus=gpus, driver_version="555.42.06")
    found = run_py(
        nvml_env(fake_state),
        """
        pynvml.nvmlInit()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            pci = pynvml.nvmlDeviceGetPciInfo(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            by_uuid = pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(uuid))
            by_pci = pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByPciBusId(pci.busId))
            gpus.append([pynvml.nvmlDeviceGetName(h), uuid, pynvml.nvmlDeviceGetIndex(h),
                         pynvml.nvmlDeviceGetMinorNumber(h), pci.busId, pci.busIdLegacy,
                         pci.domain, pci.bus, pci.device, by_uuid, by_pci,
                         pynvml.nvmlDeviceGetMigMode(h)])
        out([pynvml.nvmlSystemGetDriverVersion(), gpus,
             error(pynvml.nvmlDeviceGetHandleByIndex, 2),
             error(pynvml.nvmlDeviceGetHandleByUUID, "GPU-nope")])
        """,
    )
    version, devices, bad_index, bad_uuid = found
    assert version == "555.42.06"
    bus0, bus1 = int(fake_pci_bus_id(0)[9:11], 16), int(fake_pci_bus_id(1)[9:11], 16)
    assert devices == [
        ["NVIDIA H200", fake_uuid(0), 0, 0, fake_pci_bus_id(0), f"0000:{bus0:02X}:00.0",
         0, bus0, 0, 0, 0, [0, 0]],
        [gpus[1].name, fake_uuid(1), 1, 7, fake_pci_bus_id(1), f"0000:{bus1:02X}:00.0",
         0, bus1, 0, 1, 1, [0, 0]],
    ]  # fmt: skip
    assert bad_index == "NVMLError_InvalidArgument"
    assert bad_uuid == "NVMLError_NotFound"


def test_string_buffer_too_small(fake_state: Path, nvml_env: NvmlEnv) -> None:
    """Name, UUID and driver version answer INSUFFICIENT_SIZE (7) when the buffer is too small."""
    codes = run_py(
        nvml_env(fake_state),
        """
        pynvml.nvmlInit()
        lib = pynvml.nvmlLib
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        buf = ctypes.create_string_buffer(96)
        out([lib.nvmlDeviceGetName(h, buf, ctypes.c_uint(11)),
             lib.nvmlDeviceGetName(h, buf, ctypes.c_uint(12)), buf.value.decode(),
             lib.nvmlDeviceGetUUID(h, buf, ctypes.c_uint(8)),
             lib.nvmlSystemGetDriverVersion(buf, ctypes.c_uint(4))])
        """,
    )
    assert codes == [7, 0, "NVIDIA H200", 7, 7]


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------

_MEMORY = """
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("GPU", "0")))
v1 = pynvml.nvmlDeviceGetMemoryInfo(h)
result = {"v1": [v1.total, v1.free, v1.used]}
try:
    v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    result["v2"] = [v2.version, v2.total, v2.reserved, v2.free, v2.used]
except pynvml.NVMLError as err:
    result["v2"] = type(err).__name__
out(result)
"""


def test_memory_arithmetic(fake_state: Path, nvml_env: NvmlEnv) -> None:
    """v2 used = idle + allocations + unattributed; v1 adds reserved; free = total - v1 used."""
    write_state(fake_state, gpus=[FakeGpu(used_mib=4, reserved_mib=500, unattributed_mib=100)])
    add_alloc(fake_state, pid=os.getpid(), minor=0, mib=1000)
    add_alloc(fake_state, pid=os.getpid(), minor=0, mib=24, kind="graphics")
    add_alloc(fake_state, pid=os.getpid(), minor=1, mib=7777)  # no GPU with minor 1
    memory = run_py(nvml_env(fake_state), _MEMORY)
    total = H200_TOTAL_MIB * MIB
    v2_used = (4 + 1000 + 24 + 100) * MIB
    v1_used = v2_used + 500 * MIB
    assert memory["v1"] == [total, total - v1_used, v1_used]
    assert memory["v2"] == [0x02000028, total, 500 * MIB, total - v1_used, v2_used]
    assert allocated_mib(fake_state, 0) == 1024


def test_old_driver_memory_hides_reserved(fake_state: Path, nvml_env: NvmlEnv) -> None:
    """A driver < 510 has no memory v2; its v1 total excludes reserved and used excludes it."""
    write_state(fake_state, gpus=[FakeGpu(used_mib=4, reserved_mib=500)])
    add_alloc(fake_state, pid=os.getpid(), minor=0, mib=1000)
    memory = run_py(nvml_env(fake_state, old=True), _MEMORY)
    total = (H200_TOTAL_MIB - 500) * MIB
    assert memory["v1"] == [total, total - 1004 * MIB, 1004 * MIB]
    assert memory["v2"] == "NVMLError_FunctionNotFound"


def test_memory_version_mismatch(fake_state: Path, nvml_env: NvmlEnv) -> None:
    """Memory v2 with a wrong version field fails with ARGUMENT_VERSION_MISMATCH (25)."""
    answer = run_py(
        nvml_env(fake_state),
        """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        out(error(pynvml.nvmlDeviceGetMemoryInfo, h, version=0x01000028))
        """,
    )
    assert answer == "NVMLError_ArgumentVersionMismatch"


def test_memory_not_supported(fake_state: Path, nvml_env: NvmlEnv) -> None:
    """memory_not_supported makes both memory calls fail with NOT_SUPPORTED (3)."""
    update_gpu(fake_state, 2, memory_not_supported=True)
    answer = run_py(
        nvml_env(fake_state),
        """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(2)
        out([error(pynvml.nvmlDeviceGetMemoryInfo, h),
             error(pynvml.nvmlDeviceGetMemoryInfo, h, version=pynvml.nvmlMemory_v2),
             error(pynvml.nvmlDeviceGetMemoryInfo, pynvml.nvmlDeviceGetHandleByIndex(1))])
        """,
    )
    assert answer == ["NVMLError_NotSupported", "NVMLError_NotSupported", None]


# ---------------------------------------------------------------------------------------------
# Process lists
# ---------------------------------------------------------------------------------------------


def test_two_call_protocol(fake_state: Path, nvml_env: NvmlEnv) -> None:
    """Sizing call answers INSUFFICIENT_SIZE with n; a big enough call fills n and sets n."""
    for pid in (4242, 4243, 4241):
        add_alloc(fake_state, pid=pid, minor=0, mib=10)
    answer = run_py(
        nvml_env(fake_state),
        """
        pynvml.nvmlInit()
        fn = pynvml.nvmlLib.nvmlDeviceGetComputeRunningProcesses_v3
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        count = ctypes.c_uint(0)
        steps = [fn(h, ctypes.byref(count), None), count.value]
        infos = (pynvml.c_nvmlProcessInfo_v3_t * 10)()
        count.value = 2
        steps += [fn(h, ctypes.byref(count), infos), count.value]
        count.value = 10
        steps += [fn(h, ctypes.byref(count), infos), count.value]
        steps.append([[i.pid, i.usedGpuMemory, i.gpuInstanceId, i.computeInstanceId]
                      for i in infos[:4]])
        count.value = 0
        idle = pynvml.nvmlDeviceGetHandleByIndex(1)
        steps += [fn(idle, ctypes.byref(count), None), count.value]
        out(steps)
        """,
    )
    none = 0xFFFFFFFF
    assert answer == [
        7, 3, 7, 3, 0, 3,
        [[4241, 10 * MIB, none, none], [4242, 10 * MIB, none, none],
         [4243, 10 * MIB, none, none], [0, 0, 0, 0]],
        0, 0,
    ]  # fmt: skip


def test_allocation_files_are_read_defensively(fake_state: Path, nvml_env: NvmlEnv) -> None:
    """Malformed, temporary and half-written allocation files are ignored; one PID's are summed."""
    allocs = fake_state / "allocs"
    add_alloc(fake_state, pid=500, minor=0, mib=100)
    add_alloc(fake_state, pid=500, minor=0, mib=23)
    add_alloc(fake_state, pid=501, minor=0, mib=5, released_at_ms=now_ms() - 1000)
    release_alloc(add_alloc(fake_state, pid=506, minor=0, mib=5), at_ms=now_ms() - 1)
    (allocs / "partial").write_text("pid=502\nminor=0\nmib=7")  # last line unterminated
    (allocs / "nopid").write_text("minor=0\nmib=7\n")
    (allocs / "badpid").write_text("pid=abc\nminor=0\nmib=7\n")
    (allocs / "badkind").write_text("pid=503\nminor=0\nmib=7\nkind=opencl\n")
    (allocs / ".hidden").write_text("pid=504\nminor=0\nmib=7\n")
    (allocs / "x.tmp").write_text("pid=505\nminor=0\nmib=7\n")
    (allocs / "plus").write_text("pid=+507\nminor=0\nmib=7\n")
    (allocs / "space").write_text("pid= 508\nminor=0\nmib=7\n")
    (allocs / "kinds").write_text("pid=510\nminor=0\nmib=7\nkind=opencl\nkind=compute\n")
    (allocs / "lastwins").write_text("pid=0\npid=509\nminor=0\nmib=1\n")
    (allocs / "subdir").mkdir()
    answer = run_py(
        nvml_env(fake_state),
        """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        out([procs(h), v2.used // 1048576])
        """,
    )
    assert answer == [[[500, 123], [509, 1]], 124]
    assert allocated_mib(fake_state, 0) == 124  # the Python mirror reads the files alike


def test_report_usage_zero_gives_none(fake_state: Path, nvml_env: NvmlEnv) -> None:
    """report_usage=0 makes pynvml return usedGpuMemory None while the memory still counts."""
    add_alloc(fake_state, pid=600, minor=1, mib=300, report_usage=False)
    answer = run_py(
        nvml_env(fake_state),
        """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(1)
        v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        out([procs(h), v2.used // 1048576])
        """,
    )
    assert answer == [[[600, None]], 300]


def test_process_list_race(fake_state: Path, nvml_env: NvmlEnv) -> None:
    """process_list_race N makes the first N second calls raise NVMLError_InsufficientSize."""
    update_gpu(fake_state, 0, process_list_race=2)
    add_alloc(fake_state, pid=700, minor=0, mib=1)
    add_alloc(fake_state, pid=701, minor=1, mib=1)
    answer = run_py(
        nvml_env(fake_state),
        """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        other = pynvml.nvmlDeviceGetHandleByIndex(1)
        out([error(procs, h), error(procs, h, pynvml.nvmlDeviceGetGraphicsRunningProcesses),
             error(procs, other), error(procs, h), procs(h)])
        """,
    )
    # The empty graphics list needs no second call, so it consumes no race.
    race = "NVMLError_InsufficientSize"
    assert answer == [race, None, None, race, [[700, 1]]]


def test_old_library_process_wrappers(fake_state: Path, nvml_env: NvmlEnv) -> None:
    """With the old library the unversioned wrappers raise NVMLLibraryMismatchError; _v2 works."""
    add_alloc(fake_state, pid=800, minor=0, mib=64)
    answer = run_py(
        nvml_env(fake_state, old=True),
        """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        caught = []
        for call in (pynvml.nvmlDeviceGetComputeRunningProcesses,
                     pynvml.nvmlDeviceGetGraphicsRunningProcesses):
            try:
                call(h)
            except pynvml.NVMLError:
                caught.append("NVMLError")
            except pynvml.NVMLLibraryMismatchError:
                caught.append("NVMLLibraryMismatchError")
        out([caught, procs(h, pynvml.nvmlDeviceGetComputeRunningProcesses_v2),
             pynvml.nvmlSystemGetDriverVersion()])
        """,
    )
    assert answer == [["NVMLLibraryMismatchError"] * 2, [[800, 64]], "470.256.02"]


# ---------------------------------------------------------------------------------------------
# Holders
# ---------------------------------------------------------------------------------------------

_LIST_ALL = """
pynvml.nvmlInit()
gpus = []
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    gpus.append([procs(h), procs(h, pynvml.nvmlDeviceGetGraphicsRunningProcesses),
                 v2.used // 1048576])
out(gpus)
"""

# Polls GPU 0 until its process list is empty; each observation is [t0_ms, t1_ms, pids, used].
_OBSERVE_RELEASE = """
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
seen = []
end = time.monotonic() + 10
while time.monotonic() < end:
    t0 = time.time_ns() // 1000000
    pids = [p[0] for p in procs(h)]
    used = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2).used // 1048576
    seen.append([t0, time.time_ns() // 1000000, pids, used])
    if not pids:
        break
    time.sleep(0.02)
out(seen)
"""


def _released_at(path: Path) -> int:
    for line in path.read_text(encoding="ascii").splitlines():
        if line.startswith("released_at_ms="):
            return int(line.partition("=")[2])
    raise AssertionError(f"{path} has no released_at_ms")


def test_holder_listed_then_released_after_delay(
    fake_state: Path, nvml_env: NvmlEnv, spawn_holder: HolderSpawner
) -> None:
    """A holder is listed with its MiB on each GPU; after it dies it stays for release_delay_ms."""
    update_gpu(fake_state, 0, release_delay_ms=1500)
    holder = spawn_holder(fake_state, gpus=(0, 2), mib=1500)
    env = nvml_env(fake_state)
    assert run_py(env, _LIST_ALL) == [
        [[[holder.pid, 1500]], [], 1500],
        [[], [], 0],
        [[[holder.pid, 1500]], [], 1500],
        [[], [], 0],
    ]
    holder.terminate()
    assert holder.wait() == 0
    holder.wait_released()
    deadline = _released_at(holder.allocs[0]) + 1500
    seen = run_py(env, _OBSERVE_RELEASE)
    for t0, t1, pids, used in seen:
        if t1 < deadline:
            assert (pids, used) == ([holder.pid], 1500)
        if t0 >= deadline:
            assert (pids, used) == ([], 0)
    assert seen[0][1] < deadline, "the first look came after the delay: machine too slow?"
    assert seen[-1][2:] == [[], 0]
    assert run_py(env, _LIST_ALL)[2] == [[], [], 0]  # GPU 2 had no delay


def test_graphics_holder_is_listed_as_graphics(
    fake_state: Path, nvml_env: NvmlEnv, spawn_holder: HolderSpawner
) -> None:
    """A --kind graphics holder appears in the graphics list only, and --no-usage hides MiB."""
    holder = spawn_holder(fake_state, gpus=(1,), mib=256, kind="graphics", no_usage=True)
    assert run_py(nvml_env(fake_state), _LIST_ALL)[1] == [[], [[holder.pid, None]], 256]


def test_left_child_keeps_memory_and_dead_parent_listed(
    fake_state: Path, nvml_env: NvmlEnv, spawn_holder: HolderSpawner
) -> None:
    """With --leave-child the dead parent's PID stays listed until the last child dies."""
    holder = spawn_holder(fake_state, gpus=(0,), mib=2000, children=2, leave_child=True)
    first, left = holder.children
    holder.terminate()
    assert holder.wait() == 0
    assert wait_gone([first])
    assert not process_gone(left)
    assert not holder.released()
    env = nvml_env(fake_state)
    assert run_py(env, _LIST_ALL)[0] == [[[holder.pid, 2000]], [], 2000]
    assert device_fds(left) == sorted(
        str(fake_state.resolve() / "dev" / name) for name in ("nvidia-uvm", "nvidia0", "nvidiactl")
    )
    os.kill(left, signal.SIGKILL)
    holder.wait_released()
    assert run_py(env, _LIST_ALL)[0] == [[], [], 0]


def test_sigkill_leaves_children_holding(
    fake_state: Path, nvml_env: NvmlEnv, spawn_holder: HolderSpawner
) -> None:
    """SIGKILL of the holder leaves its children (and the memory) until they die too."""
    holder = spawn_holder(fake_state, gpus=(3,), mib=100, children=1)
    holder.kill()
    assert holder.wait() == -signal.SIGKILL
    time.sleep(0.2)
    assert not process_gone(holder.children[0])
    assert not holder.released()
    assert run_py(nvml_env(fake_state), _LIST_ALL)[3] == [[[holder.pid, 100]], [], 100]
    os.kill(holder.children[0], signal.SIGKILL)
    holder.wait_released()
    assert allocated_mib(fake_state, 3) == 0


def test_ignore_sigterm(fake_state: Path, spawn_holder: HolderSpawner) -> None:
    """--ignore-sigterm makes the holder and its children survive SIGTERM."""
    holder = spawn_holder(fake_state, children=1, ignore_sigterm=True)
    holder.terminate()
    os.kill(holder.children[0], signal.SIGTERM)
    time.sleep(0.3)
    assert holder.process.poll() is None
    assert not process_gone(holder.children[0])
    assert allocated_mib(fake_state, 0) == 1000


def test_drain_delays_exit(fake_state: Path, spawn_holder: HolderSpawner) -> None:
    """--drain S keeps the holder (and its memory) S seconds after SIGTERM, then it exits."""
    holder = spawn_holder(fake_state, children=1, drain=0.6)
    started = time.monotonic()
    holder.terminate()
    time.sleep(0.3)
    assert holder.process.poll() is None
    assert holder.wait() == 0
    assert time.monotonic() - started >= 0.6
    assert wait_gone(holder.children)
    holder.wait_released()


def test_names_fds_and_watcher(
    fake_state: Path, nvml_env: NvmlEnv, spawn_holder: HolderSpawner
) -> None:
    """--name/--child-name set argv[0] and comm; holders keep device fds, the watcher none."""
    holder = spawn_holder(fake_state, gpus=(0, 1), name="sglang::scheduler", children=2)
    named = spawn_holder(fake_state, gpus=(2,), name="vllm", children=1, child_name="worker-{i}")
    assert cmdline(holder.pid)[0] == "sglang::scheduler"
    assert comm(holder.pid) == "sglang::schedul"
    assert [cmdline(pid)[0] for pid in holder.children] == [
        "sglang::scheduler_TP0",
        "sglang::scheduler_TP1",
    ]
    assert [comm(pid) for pid in holder.children] == ["sglang::schedul"] * 2
    assert cmdline(named.children[0])[0] == "worker-0"
    assert comm(named.children[0]) == "worker-0"
    dev = fake_state.resolve() / "dev"
    expected = sorted(str(dev / name) for name in ("nvidiactl", "nvidia-uvm", "nvidia0", "nvidia1"))
    for pid in (holder.pid, *holder.children):
        assert device_fds(pid) == expected
    assert device_fds(holder.watcher) == []
    assert comm(holder.watcher) == "gpu_hold_watch"
    name = run_py(
        nvml_env(fake_state),
        f"""
        pynvml.nvmlInit()
        out(pynvml.nvmlSystemGetProcessName({holder.children[1]}))
        """,
    )
    assert name == "sglang::scheduler_TP1"


def test_spawner_cleanup_kills_everything(fake_state: Path) -> None:
    """HolderSpawner.cleanup SIGKILLs holders, children, left-behind children and watchers."""
    spawner = HolderSpawner()
    stubborn = spawner(fake_state, children=2, ignore_sigterm=True)
    leaving = spawner(fake_state, gpus=(1,), children=1, leave_child=True)
    leaving.terminate()
    leaving.wait()
    pids = [stubborn.pid, *stubborn.children, stubborn.watcher, *leaving.children, leaving.watcher]
    assert not any(process_gone(pid) for pid in pids[1:])
    spawner.cleanup()
    assert all(process_gone(pid) for pid in pids)
    assert all(start_time(pid) is None or process_gone(pid) for pid in pids)


def test_gpu_hold_refuses_a_missing_gpu(fake_state: Path) -> None:
    """gpu_hold.py exits 1 when a GPU's device file does not exist, 2 on bad options."""
    base = [sys.executable, str(GPU_HOLD), "--state", str(fake_state)]
    missing = subprocess.run([*base, "--gpus", "9"], capture_output=True, text=True, check=False)
    assert missing.returncode == 1
    assert "nvidia9" in missing.stderr
    bad = subprocess.run([*base, "--leave-child"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2
    assert list((fake_state / "allocs").iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Failure knobs
# ---------------------------------------------------------------------------------------------


def test_lost_and_no_permission_gpus(fake_state: Path, nvml_env: NvmlEnv) -> None:
    """A lost GPU gives GPU_IS_LOST, a no_permission one NO_PERMISSION; the count keeps both."""
    env = nvml_env(fake_state)
    update_gpu(fake_state, 1, lost=True)
    update_gpu(fake_state, 3, no_permission=True)
    answer = run_py(
        env,
        """
        pynvml.nvmlInit()
        out([pynvml.nvmlDeviceGetCount(),
             [error(pynvml.nvmlDeviceGetHandleByIndex, i) for i in range(4)]])
        """,
    )
    assert answer == [4, [None, "NVMLError_GpuIsLost", None, "NVMLError_NoPermission"]]


def test_gpu_lost_after_handle_taken(fake_state: Path, nvml_env: NvmlEnv) -> None:
    """A handle taken before the GPU is marked lost answers GPU_IS_LOST afterwards."""
    flag = fake_state / "lost-now"
    body = f"""
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    before = pynvml.nvmlDeviceGetName(h)
    print("ready", flush=True)
    while not os.path.exists({str(flag)!r}):
        time.sleep(0.01)
    out([before, error(pynvml.nvmlDeviceGetName, h), error(procs, h),
         error(pynvml.nvmlDeviceGetMemoryInfo, h)])
    """
    with subprocess.Popen(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(body)],
        env=nvml_env(fake_state),
        stdout=subprocess.PIPE,
        text=True,
    ) as process:
        assert process.stdout is not None
        assert process.stdout.readline() == "ready\n"
        update_gpu(fake_state, 0, lost=True)
        flag.touch()
        answer = json.loads(process.stdout.readline())
    assert answer == ["NVIDIA H200", *["NVMLError_GpuIsLost"] * 3]


_HEALTH = """
pynvml.nvmlInit()
def health(i):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    def field(h):
        (v,) = pynvml.nvmlDeviceGetFieldValues(h, [230])
        return [v.nvmlReturn, v.value.uiVal]
    answers = []
    for call in (
        lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h),
        lambda: pynvml.nvmlDeviceGetPersistenceMode(h),
        lambda: list(pynvml.nvmlDeviceGetRemappedRows(h)),
        lambda: pynvml.nvmlDeviceGetTotalEccErrors(h, 1, 0),
        lambda: field(h),
    ):
        try:
            answers.append(call())
        except pynvml.NVMLError as err:
            answers.append(type(err).__name__)
    return answers
out([health(i) for i in range(3)])
"""


def test_health_calls_answer_the_knobs(fake_state: Path, nvml_env: NvmlEnv) -> None:
    """Defaults look like a healthy H200 (no page retirement); each knob changes one answer."""
    update_gpu(fake_state, 1, remapped_rows_pending=1, ecc_volatile_uncorrected=2)
    update_gpu(fake_state, 1, remapped_rows_failure=1, recovery_action=1)
    update_gpu(fake_state, 2, retired_pages_pending=1, remapped_rows_pending=-1)
    update_gpu(fake_state, 2, ecc_volatile_uncorrected=-1, recovery_action=-1)
    update_gpu(fake_state, 1, persistence_mode=1)
    update_gpu(fake_state, 2, persistence_mode=-1)
    answer = run_py(nvml_env(fake_state), _HEALTH)
    assert answer == [
        ["NVMLError_NotSupported", 0, [0, 0, 0, 0], 0, [0, 0]],
        ["NVMLError_NotSupported", 1, [0, 1, 1, 1], 2, [0, 1]],
        [1, "NVMLError_NotSupported", "NVMLError_NotSupported", "NVMLError_NotSupported", [3, 0]],
    ]


def test_mig_mode_knobs(fake_state: Path, nvml_env: NvmlEnv) -> None:
    """mig_mode/mig_pending answer [current, pending]; -1 is NOT_SUPPORTED, as a GPU without MIG."""
    update_gpu(fake_state, 1, mig_mode=1)
    update_gpu(fake_state, 2, mig_mode=0, mig_pending=1)
    update_gpu(fake_state, 3, mig_mode=-1)
    answer = run_py(
        nvml_env(fake_state),
        """
        pynvml.nvmlInit()
        def mig(i):
            try:
                return pynvml.nvmlDeviceGetMigMode(pynvml.nvmlDeviceGetHandleByIndex(i))
            except pynvml.NVMLError as err:
                return type(err).__name__
        out([mig(i) for i in range(4)])
        """,
    )
    assert answer == [[0, 0], [1, 1], [0, 1], "NVMLError_NotSupported"]


def test_old_driver_has_no_recovery_action_field(fake_state: Path, nvml_env: NvmlEnv) -> None:
    """A driver older than the recovery action field answers NOT_SUPPORTED in its slot."""
    update_gpu(fake_state, 0, recovery_action=2)
    answer = run_py(nvml_env(fake_state, old=True), _HEALTH)
    assert answer[0][4] == [3, 0]


def test_reset_required_gpu(fake_state: Path, nvml_env: NvmlEnv) -> None:
    """reset_required: the handle, and every call on a handle taken before, say so (16)."""
    update_gpu(fake_state, 1, reset_required=True)
    answer = run_py(
        nvml_env(fake_state),
        """
        pynvml.nvmlInit()
        out([error(pynvml.nvmlDeviceGetHandleByIndex, i) for i in range(2)])
        """,
    )
    assert answer == [None, "NVMLError_ResetRequired"]


@pytest.mark.parametrize(
    ("code", "error"),
    [(9, "NVMLError_DriverNotLoaded"), (18, "NVMLError_LibRmVersionMismatch"),
     (4, "NVMLError_NoPermission")],
)  # fmt: skip
def test_init_error(fake_state: Path, nvml_env: NvmlEnv, code: int, error: str) -> None:
    """init_error N makes nvmlInit raise the NVMLError subclass of code N."""
    update_state(fake_state, init_error=code)
    assert run_py(nvml_env(fake_state), "out(error(pynvml.nvmlInit))") == error


def test_no_state_means_driver_not_loaded(tmp_path: Path, nvml_env: NvmlEnv) -> None:
    """No FAKENVML_STATE, a missing gpus.json or a malformed one make nvmlInit fail with 9."""
    env = nvml_env(tmp_path)
    del env["FAKENVML_STATE"]
    assert run_py(env, "out(error(pynvml.nvmlInit))") == "NVMLError_DriverNotLoaded"
    assert run_py(nvml_env(tmp_path), "out(error(pynvml.nvmlInit))") == "NVMLError_DriverNotLoaded"
    (tmp_path / "gpus.json").write_text('{"gpus": [')
    assert run_py(nvml_env(tmp_path), "out(error(pynvml.nvmlInit))") == "NVMLError_DriverNotLoaded"


def test_uninitialized_and_refcount(fake_state: Path, nvml_env: NvmlEnv) -> None:
    """Calls need init; init is refcounted; shutdown past zero answers UNINITIALIZED."""
    answer = run_py(
        nvml_env(fake_state),
        """
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        count = ctypes.c_uint(0)
        steps = [lib.nvmlDeviceGetCount_v2(ctypes.byref(count))]
        pynvml.nvmlInit()
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        steps.append(pynvml.nvmlDeviceGetCount())
        pynvml.nvmlShutdown()
        steps.append(error(pynvml.nvmlDeviceGetCount))
        steps.append(error(pynvml.nvmlShutdown))
        steps.append(lib.nvmlShutdown())
        out(steps)
        """,
    )
    assert answer == [1, 4, "NVMLError_Uninitialized", "NVMLError_Uninitialized", 1]


def test_block_call_blocks(fake_state: Path, nvml_env: NvmlEnv) -> None:
    """block_call with block_ms 0 blocks that call until the knob is cleared; >0 delays it."""
    env = nvml_env(fake_state)
    update_state(fake_state, block_call="nvmlDeviceGetCount_v2", block_ms=0)
    with pytest.raises(subprocess.TimeoutExpired):
        run_py(env, "pynvml.nvmlInit()\nout(pynvml.nvmlDeviceGetCount())", timeout=1.5)
    body = "pynvml.nvmlInit()\nout(pynvml.nvmlDeviceGetCount())"
    with subprocess.Popen(
        [sys.executable, "-c", _PRELUDE + body], env=env, stdout=subprocess.PIPE, text=True
    ) as process:
        time.sleep(0.5)
        assert process.poll() is None
        update_state(fake_state, block_call="")
        output, _ = process.communicate(timeout=5)
    assert json.loads(output) == 4
    update_state(fake_state, block_call="nvmlDeviceGetName", block_ms=400)
    elapsed = run_py(
        env,
        """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        start = time.monotonic()
        pynvml.nvmlDeviceGetName(h)
        out(time.monotonic() - start)
        """,
    )
    assert 0.4 <= elapsed < 3


def test_malformed_gpus_json_never_crashes(tmp_path: Path, nvml_env: NvmlEnv) -> None:
    """Mutated, truncated and hostile gpus.json files never crash the library."""
    valid = json.dumps(
        {
            "driver_version": "550.54.15",
            "gpus": [FakeGpu().to_json(0), {"name": "A\u00e9\U0001f600\x00x", "minor": 3}],
        }
    )
    rng = random.Random(20240611)  # noqa: S311 - reproducible fuzzing, not cryptography
    cases = [
        "",
        "[]",
        "null",
        '{"gpus": 5}',
        '{"gpus": [1, "x", null, [], {"name": 5, "minor": -1, "total_mib": 1.5}]}',
        '{"gpus": [{"name": "' + "n" * 5000 + '", "uuid": "\\ud800"}]}',
        '{"driver_version": "' + "\\u00e9" * 200 + '"}',
        '{"gpus": [{"total_mib": 99999999999999999999999}]}',
        "[" * 100000,
        '{"a": ' * 50 + "1" + "}" * 50,
        '{"gpus": [' + "{}," * 200 + "{}]}",
        valid,
    ]
    for _ in range(300):
        text = list(valid)
        for _ in range(rng.randint(1, 4)):
            position = rng.randrange(len(text))
            action = rng.choice(("drop", "insert", "truncate"))
            if action == "drop":
                del text[position]
            elif action == "insert":
                text.insert(position, rng.choice('{}[]",:\\0123456789eE.-+ ntfu\x00\xff'))
            else:
                del text[position:]
        cases.append("".join(text))
    for index, case in enumerate(cases):
        case_dir = tmp_path / f"case{index}"
        case_dir.mkdir()
        (case_dir / "gpus.json").write_bytes(case.encode("utf-8", errors="surrogateescape"))
    answer = run_py(
        nvml_env(tmp_path),
        f"""
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        summary = []
        for index in range({len(cases)}):
            os.environ["FAKENVML_STATE"] = os.path.join({str(tmp_path)!r}, f"case{{index}}")
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as err:
                summary.append(err.value)
                continue
            count = pynvml.nvmlDeviceGetCount()
            for i in range(count):
                try:
                    h = pynvml.nvmlDeviceGetHandleByIndex(i)
                except pynvml.NVMLError:
                    continue
                for call in (pynvml.nvmlDeviceGetName, pynvml.nvmlDeviceGetUUID,
                             pynvml.nvmlDeviceGetPciInfo, pynvml.nvmlDeviceGetMemoryInfo,
                             pynvml.nvmlDeviceGetComputeRunningProcesses):
                    error(call, h)
            pynvml.nvmlSystemGetDriverVersion()
            pynvml.nvmlShutdown()
            summary.append(count)
        out(summary)
        """,
        timeout=60,
    )
    assert len(answer) == len(cases)
    assert answer[:12] == [9, 9, 9, 0, 5, 1, 0, 1, 9, 0, 64, 2]
