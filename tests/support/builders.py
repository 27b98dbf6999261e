"""Hand-made NVML readings, /proc facts, inventories and requests for tests of the core.

One place for the defaults the tests share, so a test names only what it is about: a GPU is an
H200 as NVML describes it (143771 MiB read through the v2 API, nothing reserved, minor = index,
a UUID and the PCI address of bus 0x19 + index); a process is root's ``python3 -m
sglang.launch_server`` sleeping in sglang.service's cgroup, started at tick 1000 + PID.
"""

from __future__ import annotations

from dataclasses import replace

from fakestate import H200_TOTAL_MIB

from gpuguard.core.inventory import Inventory, build_inventory
from gpuguard.core.policy import PlanRequest, Scope
from gpuguard.core.status.report import StatusContext
from gpuguard.core.values import (
    MIB,
    GpuHealth,
    GpuMemory,
    GpuReading,
    MemoryApi,
    NvmlHealth,
    NvmlProcess,
    NvmlReading,
    ProcessFacts,
    ProcessIdentity,
    ProcessListKind,
    ProcScan,
    UnitProvenance,
)

DRIVER = "550.54.15"
UNIT = "sglang.service"
UNIT_CGROUP = f"/system.slice/{UNIT}"
SERVER_CMDLINE = ("python3", "-m", "sglang.launch_server")
TRAINING_CGROUP = "/system.slice/training.service"
IDLE_MIB = 16
"""gpuguard's default idle threshold."""

STATUS_CONTEXT = StatusContext(
    watched_units={UNIT: ("sglang",)},
    protected_names=("nvidia-persistenced",),
    idle_threshold_bytes=IDLE_MIB * MIB,
    as_root=True,
)
"""Status as root, watching sglang.service (pattern "sglang"), nvidia-persistenced protected."""


def pci_bus_id(index: int) -> str:
    """The PCI address these GPUs have: bus 0x19 + index (GPU 1 is ``00000000:1A:00.0``)."""
    return f"00000000:{0x19 + index:02X}:00.0"


def gpu(
    index: int,
    *listed: tuple[int, int],
    used_mib: int | None = None,
    total_mib: int = H200_TOTAL_MIB,
    name: str = "NVIDIA H200",
    minor: int | None = None,
    health: GpuHealth | None = None,
) -> GpuReading:
    """A v2 GPU whose NVML process list names ``(pid, MiB)`` pairs (compute processes).

    ``used_mib`` is what NVML says is used: by default exactly what the listed processes hold,
    so memory no process explains is always spelled out by the test.
    """
    used = sum(mib for _, mib in listed) if used_mib is None else used_mib
    return GpuReading(
        index=index,
        name=name,
        uuid=f"GPU-{index:08x}-aaaa-bbbb-cccc-dddddddddddd",
        pci_bus_id=pci_bus_id(index),
        minor=index if minor is None else minor,
        memory=GpuMemory(total_mib * MIB, used * MIB, 0, MemoryApi.V2),
        processes=tuple(
            NvmlProcess(pid, mib * MIB, ProcessListKind.COMPUTE) for pid, mib in listed
        ),
        health=GpuHealth() if health is None else health,
    )


def v1_gpu(
    index: int, used_mib: int, *, total_mib: int = H200_TOTAL_MIB, name: str = "NVIDIA H200"
) -> GpuReading:
    """A GPU read through the v1 API: ``used_mib`` includes a reserve nobody has estimated yet."""
    reading = gpu(index, total_mib=total_mib, name=name)
    return replace(reading, memory=GpuMemory(total_mib * MIB, used_mib * MIB, None, MemoryApi.V1))


def lost_gpu(index: int) -> GpuReading:
    """A GPU that fell off the bus: NVML tells nothing of it but its index."""
    return GpuReading(index=index, problem="GPU is lost (fallen off the bus)", lost=True)


def nvml(
    *gpus: GpuReading, health: NvmlHealth = NvmlHealth.OK, reason: str | None = None
) -> NvmlReading:
    """A reading of these GPUs from driver 550.54.15 (one that succeeded unless told)."""
    return NvmlReading(health, reason, DRIVER, gpus)


def process(
    pid: int,
    *minors: int,
    cgroup: str = UNIT_CGROUP,
    comm: str = "python3",
    cmdline: tuple[str, ...] = SERVER_CMDLINE,
    state: str = "S",
    invocation_id: str | None = None,
    kernel_wait: tuple[str, ...] = (),
) -> ProcessFacts:
    """A root process as /proc describes it, holding ``/dev/nvidiaN`` for each minor.

    No minors: a process that holds no GPU (one NVML may still name, by a colliding PID).
    """
    return ProcessFacts(
        identity=ProcessIdentity(pid, 1000 + pid),
        ppid=1,
        state=state,
        comm=comm,
        cmdline=cmdline,
        uid=0,
        uids=(0, 0, 0, 0),
        user="root",
        cgroup=cgroup,
        invocation_id=invocation_id,
        device_files=frozenset(f"/dev/nvidia{minor}" for minor in minors),
        kernel_wait=kernel_wait,
    )


def training_job(pid: int, *minors: int, comm: str = "python3", state: str = "S") -> ProcessFacts:
    """Another tenant's live job (alice's ``python3 train.py`` in training.service)."""
    job = process(
        pid,
        *minors,
        cgroup=TRAINING_CGROUP,
        comm=comm,
        cmdline=("python3", "train.py"),
        state=state,
    )
    return replace(job, uid=1000, uids=(1000,) * 4, user="alice")


def inventory(reading: NvmlReading, *processes: ProcessFacts) -> Inventory:
    """The reading and these processes merged as gpuguard merges them (default idle threshold)."""
    return build_inventory(reading, ProcScan(processes), IDLE_MIB * MIB)


def plan_request(
    *,
    gpu_set: frozenset[int] | None,
    protected_names: tuple[str, ...] = (),
    provenance: UnitProvenance | None = None,
    live_invocation: str | None = None,
) -> PlanRequest:
    """sglang.service's request (unit scope, pattern "sglang"), as the gate's before its start.

    Nothing of the unit is live unless ``live_invocation`` says so; systemd's view is known and
    names no ended run unless ``provenance`` does, and the unit runs as root (User= unset); no
    PID is untouchable.
    """
    return PlanRequest(
        unit=UNIT,
        scope=Scope.UNIT,
        patterns=("sglang",),
        gpu_set=gpu_set,
        protected_names=protected_names,
        untouchable_pids=frozenset(),
        provenance=UnitProvenance(None, uid=0) if provenance is None else provenance,
        live_invocation=live_invocation,
    )
