#!/usr/bin/env python3
"""Hardware check: hold what the fake NVML assumes against what a GPU answers, in one command.

Every test of gpuguard runs on the C fake ``libnvidia-ml.so.1`` (tests/fakenvml). This script
says, field by field, whether a host's GPU answers what the fake assumes:

1. reads every NVML call gpuguard makes, through gpuguard's own adapter (adapters/nvml.py),
   and compares each field with what the fake answers for the same GPU (a fake state built
   from the reading: same name, UUID, PCI id, minor, total, idle baseline, reserve);
2. starts holders - processes with a CUDA context and an allocation of each size, one of them
   in a PID namespace where ``unshare`` works, one holding only the GPU's device file - and
   checks that ``gpuguard status --json``, the gate and ``gpuguard reap --dry-run`` name each
   one exactly;
3. SIGKILLs context holders one at a time and measures how long the driver takes to release
   their memory and to drop them from NVML's process lists (median and max per size);
4. prints one table (assumption, fake, real, agree?) and writes a JSON report.

It exits 1 on a disagreement that would change one of gpuguard's decisions, 2 when it cannot
run at all. It never changes a GPU setting: no reset, no MIG, clock or persistence change; it
only reads NVML and allocates memory in its own child processes, all SIGKILLed at the end.

Holder backends run the same checks: ``real`` allocates through ``libcuda.so.1`` with ctypes
(``cuInit``, ``cuCtxCreate``, ``cuMemAlloc``; nothing to install); ``fake`` uses the fake NVML's
own holders (tests/fakenvml/gpu_hold.py); ``fake-cuda`` runs the real backend's holders over a
fake libcuda.so.1 (tests/fakenvml/fakecuda.c). ``make check`` runs the two fakes, so the script
cannot rot. ``--backend auto`` takes the real one when libcuda.so.1 loads and NVML answers with
a GPU. Run: ``make hardware-check`` (docs/hardware-check.md).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import pickle
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "fakenvml"))

from fakestate import (  # noqa: E402 - found through the path set just above
    GPU_HOLD,
    MIB,
    FakeGpu,
    fake_library,
    nvml_environ,
    write_state,
)

from gpuguard.adapters import nvml, nvmllibrary  # noqa: E402
from gpuguard.config import Settings  # noqa: E402
from gpuguard.core.values import GpuReading, MemoryApi, NvmlHealth, NvmlReading  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Sequence

UNIT = "gpuguard-hwcheck.service"
"""A unit name nothing runs as: every holder here is foreign to it, so nothing is reaped."""
NVML_TIMEOUT_S = 20.0
POLL_S = 0.002
RELEASE_DEADLINE_S = 60.0
START_TIMEOUT_S = 60.0
PCI_BUS_ID = re.compile(r"[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.[0-9A-F]")
UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")

# A CUDA holder for the real backend: a context and one allocation, then it waits to be killed.
# Its first line says its PID as the host sees it (/proc/self is the host's procfs here even in
# a new PID namespace: unshare runs without --mount-proc) or why CUDA refused.
CUDA_HOLDER = r"""
import ctypes, json, os, sys, time
def say(answer):
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
def check(name, rc):
    if rc != 0:
        say({"error": f"{name} returned CUresult {rc}"})
        sys.exit(1)
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as err:
    say({"error": f"cannot load libcuda.so.1: {err}"})
    sys.exit(1)
check("cuInit", cuda.cuInit(0))
device = ctypes.c_int()
check("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(device), 0))
context = ctypes.c_void_p()
try:
    create = cuda.cuCtxCreate_v2
    create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint, ctypes.c_int]
    rc = create(ctypes.byref(context), 0, device)
except AttributeError:
    rc = -1
if rc != 0:  # a driver without the _v2 symbol: the primary context is always there
    check("cuDevicePrimaryCtxRetain", cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device))
    check("cuCtxSetCurrent", cuda.cuCtxSetCurrent(context))
pointer = ctypes.c_uint64()
cuda.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
check("cuMemAlloc_v2", cuda.cuMemAlloc_v2(ctypes.byref(pointer), int(sys.argv[1])))
say({"pid": int(os.readlink("/proc/self")), "ns_pid": os.getpid()})
while True:
    time.sleep(3600)
"""

# A process that only opens the GPU's device file, as nvidia-smi, exporters and DCGM do.
DEVICE_FILE_HOLDER = r"""
import json, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
sys.stdout.write(json.dumps({"pid": int(os.readlink("/proc/self")), "ns_pid": os.getpid()}) + "\n")
sys.stdout.flush()
while True:
    time.sleep(3600)
"""


class CheckError(Exception):
    """The check cannot run on this host (no GPU, no idle GPU, a holder that cannot start)."""


@dataclass(frozen=True)
class Row:
    """One line of the table: what the fake assumes, what it and the GPU answered."""

    check: str
    assumption: str
    fake: str
    real: str
    agree: bool
    decisive: bool
    """A disagreement here would change a gpuguard decision (the exit status counts it)."""


@dataclass
class Held:
    """A holder this script started; ``pid`` is the PID NVML names it by (the host's)."""

    pid: int
    mode: str
    mib: int
    process: subprocess.Popen[bytes]


class HolderBackend(Protocol):
    """What differs between a real GPU and the fake: how NVML is found, how memory is held."""

    name: str

    def library(self) -> Path | None:
        """The libnvidia-ml.so.1 gpuguard is to load (None: the driver's, as it finds it)."""

    def cli_env(self) -> dict[str, str]:
        """The environment for gpuguard subprocesses."""

    def config_text(self, workdir: Path) -> str:
        """The gpuguard configuration for this backend (private state and runtime dirs)."""

    def device_file(self, minor: int) -> Path:
        """The file standing for /dev/nvidiaN."""

    def start(self, gpu: GpuReading, mib: int, mode: str) -> Held:
        """Start a holder of ``mib`` MiB on ``gpu`` (mode: context, namespace, device-file)."""


def _read_answer(process: subprocess.Popen[bytes], timeout_s: float) -> dict[str, Any]:
    """The holder's first line as JSON; its error or a timeout as CheckError."""
    if process.stdout is None:  # never: started with a PIPE
        raise CheckError("a holder without a stdout pipe")
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    line = process.stdout.readline() if ready else b""
    process.stdout.close()  # one line is all a holder says
    try:
        answer = json.loads(line)
    except ValueError:
        _kill_group(process)
        raise CheckError(f"a holder did not start within {timeout_s:g} s: {line!r}") from None
    if not isinstance(answer, dict) or "error" in answer:
        _kill_group(process)
        raise CheckError(f"a holder could not allocate: {answer}")
    return answer


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL a holder's whole session (its namespace wrapper included) and reap it."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def _in_namespace(argv: list[str]) -> list[str]:
    """Run ``argv`` in a new PID namespace, not as its PID 1.

    Not PID 1, so that killing the holder does not take the namespace's other processes (the
    fake holder's watcher) down before they see it die; procfs stays the host's, so the holder
    knows its host PID.
    """
    return ["unshare", "--pid", "--fork", "--kill-child", "sh", "-c", '"$@"; sleep 1', "sh", *argv]


def namespaces_work() -> bool:
    """Whether this host lets us start a process in a new PID namespace."""
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "true"], capture_output=True, timeout=10, check=False
    )
    return done.returncode == 0


class RealBackend:
    """A host with an NVIDIA GPU: CUDA contexts through libcuda.so.1, the driver's NVML."""

    name = "real"

    def library(self) -> Path | None:
        """The driver's library, as gpuguard finds it."""
        return None

    def cli_env(self) -> dict[str, str]:
        """Our environment, less LD_LIBRARY_PATH (gpuguard never reads it anyway)."""
        env = dict(os.environ)
        env.pop("LD_LIBRARY_PATH", None)
        return env

    def config_text(self, workdir: Path) -> str:
        """Defaults, with private state so the host's gpuguard is not disturbed."""
        return f'runtime_dir = "{workdir}/run"\nstate_dir = "{workdir}/lib"\n'

    def device_file(self, minor: int) -> Path:
        """The real device node."""
        return Path(f"/dev/nvidia{minor}")

    def holder_env(self, gpu: GpuReading) -> dict[str, str]:
        """A holder's environment: CUDA device 0 is ``gpu``, named by its UUID."""
        return self.cli_env() | {"CUDA_VISIBLE_DEVICES": gpu.uuid or str(gpu.index)}

    def start(self, gpu: GpuReading, mib: int, mode: str) -> Held:
        """A CUDA holder on ``gpu`` chosen by UUID, or a process holding its device file."""
        if mode == "device-file":
            argv = [sys.executable, "-c", DEVICE_FILE_HOLDER, str(self.device_file(gpu.minor or 0))]
        else:
            argv = [sys.executable, "-c", CUDA_HOLDER, str(mib * MIB)]
            if mode == "namespace":
                argv = _in_namespace(argv)
        env = self.holder_env(gpu)
        process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL if mode == "namespace" else None,  # sh's "Killed"
            env=env,
            start_new_session=True,
        )
        answer = _read_answer(process, START_TIMEOUT_S)
        return Held(int(answer["pid"]), mode, mib, process)


class FakeBackend:
    """The C fake NVML and its holders (tests/fakenvml), in a private state directory."""

    name = "fake"

    def __init__(self, workdir: Path, gpus: int = 2) -> None:
        """Fake H200s, idle, with the fake's defaults; the host's procfs as ``host-proc``."""
        self.state = workdir / "nvml-state"
        write_state(self.state, [FakeGpu() for _ in range(gpus)])
        # A holder in a PID namespace names itself by its host PID through this (gpu_hold.py).
        (self.state / "host-proc").symlink_to("/proc")
        os.environ["FAKENVML_STATE"] = str(self.state)  # for the adapter's forked workers

    def library(self) -> Path | None:
        """The fake library, by absolute path."""
        return fake_library()

    def cli_env(self) -> dict[str, str]:
        """Our environment with the fake's state."""
        return nvml_environ(self.state)

    def config_text(self, workdir: Path) -> str:
        """The fake library and its plain files standing for the device nodes."""
        return (
            "allow_plain_device_files = true\n"
            f'nvml_library = "{fake_library()}"\n'
            f'device_glob = "{self.state}/dev/nvidia*"\n'
            f'runtime_dir = "{workdir}/run"\nstate_dir = "{workdir}/lib"\n'
        )

    def device_file(self, minor: int) -> Path:
        """The plain file the fake's holders open."""
        return self.state / "dev" / f"nvidia{minor}"

    def start(self, gpu: GpuReading, mib: int, mode: str) -> Held:
        """gpu_hold.py (its allocation file names the host PID), or a device-file opener."""
        minor = gpu.minor or 0
        if mode == "device-file":
            argv = [sys.executable, "-c", DEVICE_FILE_HOLDER, str(self.device_file(minor))]
        else:
            argv = [sys.executable, str(GPU_HOLD), "--state", str(self.state)]
            argv += ["--gpus", str(minor), "--mib", str(mib), "--name", "hwcheck-holder"]
            if mode == "namespace":
                argv = _in_namespace(argv)
        process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL if mode == "namespace" else None,  # sh's "Killed"
            env=self.cli_env(),
            start_new_session=True,
        )
        answer = _read_answer(process, START_TIMEOUT_S)
        if mode == "device-file":
            return Held(int(answer["pid"]), mode, mib, process)
        alloc = Path(answer["allocs"][0]).read_text()
        pid = int(re.search(r"^pid=(\d+)$", alloc, re.MULTILINE).group(1))  # type: ignore[union-attr]
        return Held(pid, mode, mib, process)


class FakeCudaBackend(RealBackend):
    """The real backend's holders over a fake libcuda.so.1 and the fake NVML (fakecuda.c).

    The ctypes code a GPU host runs, run where there is no GPU: it cannot rot unseen.
    """

    name = "fake-cuda"

    def __init__(self, workdir: Path) -> None:
        """The fake's state, as FakeBackend makes it, and the fake libcuda built."""
        self._fake = FakeBackend(workdir)
        self._cuda_dir = _fake_cuda_dir()

    def library(self) -> Path | None:
        """The fake NVML."""
        return self._fake.library()

    def cli_env(self) -> dict[str, str]:
        """The fake's environment."""
        return self._fake.cli_env()

    def config_text(self, workdir: Path) -> str:
        """The fake's configuration."""
        return self._fake.config_text(workdir)

    def device_file(self, minor: int) -> Path:
        """The fake's device files."""
        return self._fake.device_file(minor)

    def holder_env(self, gpu: GpuReading) -> dict[str, str]:
        """The fake libcuda first on the holder's search path, told its GPU's minor."""
        return super().holder_env(gpu) | {
            "LD_LIBRARY_PATH": str(self._cuda_dir),
            "FAKECUDA_MINOR": str(gpu.minor or 0),
        }


def _fake_cuda_dir() -> Path:
    """The directory of the fake libcuda.so.1, built (make) when missing or older than its C."""
    source = ROOT / "tests" / "fakenvml" / "fakecuda.c"
    lib = ROOT / "tests" / "fakenvml" / "build" / "cuda" / "libcuda.so.1"
    if not lib.exists() or lib.stat().st_mtime < source.stat().st_mtime:
        subprocess.run(["make", "-C", str(source.parent)], capture_output=True, check=False)
    if not lib.exists():
        raise CheckError(f"the fake libcuda.so.1 could not be built ({lib})")
    return lib.parent


# -- NVML in a child process -------------------------------------------------------------------


def in_child(work: Callable[[], Any], timeout_s: float) -> Any:  # noqa: ANN401 - any picklable
    """Run ``work`` in a forked child (NVML is loaded there only) and return its result.

    Each child loads its own library: this process never does, so the fake and the driver's
    never meet in one address space, and a wedged driver only costs the child.
    """
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        os.close(read_end)
        try:
            payload = pickle.dumps(("ok", work()))
        except BaseException as err:  # noqa: BLE001 - everything goes back as an answer
            payload = pickle.dumps(("error", f"{type(err).__name__}: {err}"))
        with os.fdopen(write_end, "wb") as out:
            out.write(payload)
        os._exit(0)
    os.close(write_end)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    with os.fdopen(read_end, "rb", buffering=0) as source:
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([source], [], [], left)[0]:
                break
            chunk = source.read(65536)
            if not chunk:
                break
            chunks.append(chunk)
    if time.monotonic() >= deadline:
        os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    try:
        status, value = pickle.loads(b"".join(chunks))  # noqa: S301 - our own child's bytes
    except (pickle.UnpicklingError, EOFError, ValueError):
        raise CheckError(f"NVML child gave no answer within {timeout_s:g} s") from None
    if status != "ok":
        raise CheckError(f"NVML child failed: {value}")
    return value


def _pynvml(library: Path | None) -> Any:  # noqa: ANN401 - pynvml is untyped
    """The pynvml module over the chosen library, initialised (call in a child only)."""
    candidates = nvmllibrary.library_candidates(None if library is None else str(library))
    problem = nvmllibrary.load_library(candidates)
    if problem is not None:
        raise CheckError(f"NVML unavailable: {problem}")
    # The adapter has no v1 read and no millisecond poll; this bench needs both.
    import pynvml  # noqa: PLC0415, TID251 - in the child, after the library is loaded

    pynvml.nvmlInit()
    return pynvml


def raw_memory(library: Path | None, index: int) -> dict[str, int | None]:
    """v1 and v2 memory of one GPU, straight from pynvml: the adapter reads v2 only."""

    def work() -> dict[str, int | None]:
        pynvml = _pynvml(library)
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        v1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
        answer: dict[str, int | None] = {"v1_used": int(v1.used), "v1_total": int(v1.total)}
        try:
            v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            answer |= {"v2_used": int(v2.used), "v2_reserved": int(v2.reserved)}
        except pynvml.NVMLError:
            answer |= {"v2_used": None, "v2_reserved": None}
        return answer

    result: dict[str, int | None] = in_child(work, NVML_TIMEOUT_S)
    return result


def kill_and_time(library: Path | None, index: int, held: Held, idle_bytes: int) -> dict[str, Any]:
    """SIGKILL the holder, then poll NVML: when its PID leaves the lists, when memory is free.

    The kill is sent from the polling child once NVML is initialised there, so the clock starts
    at the signal. "Free" means v2 ``used`` back within ``idle_bytes`` (the baseline plus
    gpuguard's idle threshold), as the gate judges it.
    """

    def work() -> dict[str, Any]:
        pynvml = _pynvml(library)
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)

        def listed() -> bool:
            try:
                pids = {int(p.pid) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
                pids |= {int(p.pid) for p in pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle)}
            except pynvml.NVMLError_InsufficientSize:  # the list grew between pynvml's two calls
                return True  # still unknown: asked again at the next poll
            return held.pid in pids

        def used() -> int:
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2).used)

        listed_before = listed()
        started = time.monotonic()
        os.kill(held.pid, signal.SIGKILL)
        dropped = released = None
        while time.monotonic() - started < RELEASE_DEADLINE_S and None in (dropped, released):
            now = time.monotonic() - started
            if dropped is None and not listed():
                dropped = now
            if released is None and used() <= idle_bytes:
                released = now
            time.sleep(POLL_S)
        return {"listed_before": listed_before, "dropped_s": dropped, "released_s": released}

    answer: dict[str, Any] = in_child(work, RELEASE_DEADLINE_S + NVML_TIMEOUT_S)
    return answer


# -- gpuguard itself --------------------------------------------------------------------------


@dataclass
class Gpuguard:
    """Runs the gpuguard CLI as an operator would, with this backend's configuration."""

    config: Path
    env: dict[str, str]

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """One command, its output captured."""
        argv = [sys.executable, "-m", "gpuguard", "--config", str(self.config), *args]
        return subprocess.run(
            argv, capture_output=True, text=True, env=self.env, timeout=timeout, check=False
        )


def read(backend: HolderBackend) -> NvmlReading:
    """A snapshot through gpuguard's adapter, as the gate and status take it."""
    return nvml.read_gpus(NVML_TIMEOUT_S, backend.library())


def mirror(reading: GpuReading, workdir: Path) -> GpuReading:
    """What the fake answers for this GPU: a fake state built from it, read the same way."""
    memory = reading.memory
    gpu = FakeGpu(
        name=reading.name or "NVIDIA H200",
        uuid=reading.uuid,
        pci_bus_id=reading.pci_bus_id,
        minor=reading.minor,
        total_mib=memory.total_bytes // MIB if memory else 143771,
        used_mib=memory.used_bytes // MIB if memory else 0,
        reserved_mib=(memory.reserved_bytes or 0) // MIB if memory else 0,
    )
    state = workdir / f"mirror-{reading.index}"
    write_state(state, [gpu])
    with _fake_state(state):
        fake = nvml.read_gpus(NVML_TIMEOUT_S, fake_library())
    if fake.health is not NvmlHealth.OK or not fake.gpus:
        raise CheckError(f"the fake mirror did not answer: {fake.reason}")
    return fake.gpus[0]


def _mib(value: int | None) -> str:
    return "unknown" if value is None else f"{value // MIB} MiB"


def _fact(value: object) -> str:
    return "NOT_SUPPORTED/unknown" if value is None else str(value)


def static_rows(
    reading: NvmlReading, gpu: GpuReading, fake: GpuReading, threshold: int
) -> list[Row]:
    """Every field of the adapter's reading against the fake's answer for the same GPU."""
    rows = [
        Row(
            "NVML health",
            "ok (nvmlInit, _v3 process lists, v2 memory)",
            "ok",
            reading.health.value,
            reading.health is NvmlHealth.OK,
            decisive=True,
        ),
        Row(
            "driver version",
            ">= 515 (v2 memory, _v3 lists); fake 550.54.15",
            "550.54.15",
            reading.driver_version or "unknown",
            _driver_at_least(reading.driver_version, 515),
            decisive=True,
        ),
        Row(
            "name",
            "a model name (fake: NVIDIA H200)",
            fake.name or "-",
            gpu.name or "unknown",
            gpu.name is not None,
            decisive=False,
        ),
        Row(
            "UUID",
            "GPU-8-4-4-4-12 hex (config and CUDA_VISIBLE_DEVICES match it)",
            fake.uuid or "-",
            gpu.uuid or "unknown",
            gpu.uuid is not None and UUID.fullmatch(gpu.uuid) is not None,
            decisive=True,
        ),
        Row(
            "PCI bus id",
            "%08X:%02X:%02X.%X (Xid lines are matched on it)",
            fake.pci_bus_id or "-",
            gpu.pci_bus_id or "unknown",
            gpu.pci_bus_id is not None and PCI_BUS_ID.fullmatch(gpu.pci_bus_id) is not None,
            decisive=True,
        ),
        Row(
            "minor number",
            "/dev/nvidia<minor> exists (holders are mapped by it)",
            str(fake.minor),
            str(gpu.minor),
            gpu.minor is not None,
            decisive=True,
        ),
    ]
    memory, fake_memory = gpu.memory, fake.memory
    rows.append(
        Row(
            "memory API",
            "v2 (used without the reserve)",
            fake_memory.api.value if fake_memory else "-",
            memory.api.value if memory else "unreadable",
            memory is not None and memory.api is MemoryApi.V2,
            decisive=True,
        )
    )
    idle = memory is not None and not gpu.processes
    rows.append(
        Row(
            "idle v2 used",
            f"<= idle threshold {threshold // MIB} MiB with no process (fake 0)",
            _mib(fake_memory.used_bytes if fake_memory else None),
            _mib(memory.used_bytes if memory else None) + ("" if idle else " (GPU busy)"),
            memory is not None and (not idle or memory.used_bytes <= threshold),
            decisive=True,
        )
    )
    rows.append(
        Row(
            "v2 reserved",
            "reported apart from used (fake: reserved_mib)",
            _mib(fake_memory.reserved_bytes if fake_memory else None),
            _mib(memory.reserved_bytes if memory else None),
            memory is not None and memory.reserved_bytes is not None,
            decisive=False,
        )
    )
    rows.append(
        Row(
            "persistence mode",
            "answered (fake: off)",
            _fact(fake.persistence_mode),
            _fact(gpu.persistence_mode),
            gpu.persistence_mode is not None,
            decisive=False,
        )
    )
    fake_mig = "off" if fake.mig is not None and not fake.mig.current else _fact(fake.mig)
    real_mig = _fact(None if gpu.mig is None else asdict(gpu.mig))
    rows.append(
        Row(
            "MIG mode",
            "answered, or NOT_SUPPORTED read as off (fake: off)",
            fake_mig,
            real_mig,
            gpu.mig is not None,
            decisive=True,
        )
    )
    health, fake_health = gpu.health, fake.health
    for label, ours, theirs in (
        ("retired pages pending", health.retired_pages_pending, fake_health.retired_pages_pending),
        ("remapped rows pending", health.remapped_rows_pending, fake_health.remapped_rows_pending),
        ("remapped rows failed", health.remapped_rows_failed, fake_health.remapped_rows_failed),
        ("volatile uncorrectable ECC", health.volatile_uncorrectable_ecc,
         fake_health.volatile_uncorrectable_ecc),
        ("recovery action field", health.recovery_action, fake_health.recovery_action),
    ):  # fmt: skip
        supported = "supported" if theirs is not None else "NOT_SUPPORTED"
        rows.append(
            Row(
                f"health: {label}",
                f"{supported} on an H200 (unknown is never healthy)",
                _fact(theirs),
                _fact(ours),
                (ours is None) == (theirs is None),
                decisive=False,
            )
        )
    rows.append(
        Row(
            "health: reset required",
            "no (fake: reset_required false)",
            "False",
            str(health.reset_required),
            not health.reset_required,
            decisive=False,
        )
    )
    return rows  # fmt: skip


def _driver_at_least(version: str | None, major: int) -> bool:
    if version is None:
        return False
    head = version.split(".", 1)[0]
    return head.isdecimal() and int(head) >= major


def raw_rows(raw: dict[str, int | None], fake_raw: dict[str, int | None]) -> list[Row]:
    """v1 against v2: the fake's arithmetic is v1 used = v2 used + reserved."""

    def gap(numbers: dict[str, int | None]) -> int | None:
        v1, v2, reserved = numbers["v1_used"], numbers["v2_used"], numbers["v2_reserved"]
        if v1 is None or v2 is None or reserved is None:
            return None
        return v1 - v2 - reserved

    ours, theirs = gap(raw), gap(fake_raw)
    return [
        Row("v1 used - v2 used - reserved", "0 MiB (v1 lumps the reserve into used, R510+)",
            _mib(theirs), _mib(ours), ours is not None and abs(ours) <= 16 * MIB, decisive=False),
        Row("v1 used (idle)", "v2 used + reserved", _mib(fake_raw["v1_used"]),
            _mib(raw["v1_used"]), raw["v1_used"] is not None, decisive=False),
    ]  # fmt: skip


# -- holders ---------------------------------------------------------------------------------


def holder_rows(
    held: Sequence[Held], status: dict[str, Any], gate: subprocess.CompletedProcess[str],
    reap: subprocess.CompletedProcess[str], gpu_index: int,
) -> list[Row]:  # fmt: skip
    """Whether status (right GPU, listed or not), the gate and the reap plan name each holder."""
    by_pid = {h["pid"]: h for h in status.get("holders", [])}
    gate_line = (gate.stderr.strip().splitlines() or [""])[-1]
    rows = []
    for one in held:
        entry = by_pid.get(one.pid)
        use = next((u for u in (entry or {}).get("gpus", []) if u["index"] == gpu_index), None)
        context = one.mode != "device-file"
        if context:
            expected = f"listed by NVML as PID {one.pid}, >= {one.mib} MiB"
            fake = f"listed, {one.mib} MiB"
            ok = use is not None and use["listed_by_nvml"] and (use["used_mib"] or 0) >= one.mib
        else:
            expected = "holds the device file, not listed, no memory"
            fake = "device file only"
            ok = use is not None and use["holds_device_file"] and not use["listed_by_nvml"]
        real = (
            "absent from status"
            if use is None
            else f"listed={use['listed_by_nvml']}, device file={use['holds_device_file']}, "
            f"{use['used_mib']} MiB"
        )
        rows.append(Row(f"status: {one.mode} holder", expected, fake, real, ok, decisive=True))
        if context:
            named = f"PID {one.pid} (" in gate_line
            rows.append(
                Row(f"gate: {one.mode} holder", "named as a blocker, start refused", "named",
                    f"exit {gate.returncode}, {'named' if named else 'not named'}",
                    gate.returncode != 0 and named, decisive=True)
            )  # fmt: skip
        planned = re.search(rf"^\s*(\w+)\s+pid {one.pid}\b", reap.stdout, re.MULTILINE)
        verdict = planned.group(1) if planned else "absent"
        rows.append(
            Row(f"reap --dry-run: {one.mode} holder", "in the plan, spared (not the unit's)",
                "spare", verdict, verdict == "spare", decisive=True)
        )  # fmt: skip
    return rows


def timing_rows(release: dict[int, list[dict[str, Any]]], backend: str) -> list[Row]:
    """Release and list-drop times per size, with what the fake assumes (its release delay)."""
    rows = []
    for mib, runs in sorted(release.items()):
        released = [r["released_s"] for r in runs if r["released_s"] is not None]
        dropped = [r["dropped_s"] for r in runs if r["dropped_s"] is not None]
        few = "" if len(runs) >= 10 else f"; {len(runs)} runs < 10"
        mark = f" ({backend}{few})"
        rows.append(
            Row(f"release after SIGKILL, {mib} MiB",
                "within the gate's wait; fake: release_delay_ms (0 by default)",
                "0.000 s", _spread(released, len(runs)) + mark,
                len(released) == len(runs), decisive=True)
        )  # fmt: skip
        rows.append(
            Row(f"NVML list drop, {mib} MiB", "the PID leaves the lists when memory is freed",
                "with the release", _spread(dropped, len(runs)) + mark,
                len(dropped) == len(runs), decisive=True)
        )  # fmt: skip
        rows.append(
            Row(f"listed before the kill, {mib} MiB", "at once after the allocation", "yes",
                f"{sum(r['listed_before'] for r in runs)}/{len(runs)}",
                all(r["listed_before"] for r in runs), decisive=True)
        )  # fmt: skip
    return rows


def _spread(values: Sequence[float], runs: int) -> str:
    if not values:
        return f"never within {RELEASE_DEADLINE_S:g} s ({runs} runs)"
    return f"median {statistics.median(values):.3f} s, max {max(values):.3f} s"


# -- the run ---------------------------------------------------------------------------------


@dataclass
class Report:
    """Everything the run found, as written to the JSON report."""

    backend: str
    started_at: str
    gpu: int | None = None
    driver_version: str | None = None
    rows: list[Row] = field(default_factory=list)
    release: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    namespace: str = "not tried"
    status_json: dict[str, Any] | None = None
    gate: dict[str, Any] | None = None
    reap: dict[str, Any] | None = None
    error: str | None = None
    elapsed_s: float = 0.0

    def decisive_disagreements(self) -> list[Row]:
        """The rows that fail the check."""
        return [r for r in self.rows if r.decisive and not r.agree]


def choose_backend(name: str, workdir: Path) -> HolderBackend:
    """``auto``: the real GPU when libcuda.so.1 loads and NVML names a GPU; else the fake."""
    if name == "fake":
        return FakeBackend(workdir)
    if name == "fake-cuda":
        return FakeCudaBackend(workdir)
    real = RealBackend()
    if name == "real":
        return real
    try:  # in a child: this process never loads the CUDA driver
        in_child(lambda: bool(ctypes.CDLL("libcuda.so.1")), NVML_TIMEOUT_S)
    except CheckError:
        return FakeBackend(workdir)
    reading = read(real)
    return real if reading.health is NvmlHealth.OK and reading.gpus else FakeBackend(workdir)


def wait_idle(backend: HolderBackend, index: int, idle_bytes: int) -> None:
    """Until the GPU is back to its baseline with no process listed (CheckError past 60 s)."""
    deadline = time.monotonic() + RELEASE_DEADLINE_S
    while time.monotonic() < deadline:
        gpu = next((g for g in read(backend).gpus if g.index == index), None)
        memory = None if gpu is None or gpu.processes else gpu.memory
        if memory is not None and memory.used_bytes <= idle_bytes:
            return
        time.sleep(0.05)
    raise CheckError(f"GPU {index} did not return to idle within {RELEASE_DEADLINE_S:g} s")


def pick_gpu(reading: NvmlReading, wanted: int | None, threshold: int) -> GpuReading:
    """The GPU to check: the one asked for, else the first idle one (nothing else is touched)."""
    if reading.health is not NvmlHealth.OK or not reading.gpus:
        raise CheckError(f"NVML gives no GPU: {reading.reason or reading.health.value}")
    for gpu in reading.gpus:
        if wanted is not None and gpu.index != wanted:
            continue
        if wanted is not None or (
            gpu.memory is not None and not gpu.processes and gpu.memory.used_bytes <= threshold
        ):
            return gpu
    raise CheckError(
        "no idle GPU to check (every GPU lists processes or uses memory); name one with --gpu"
    )


def run(args: argparse.Namespace, workdir: Path) -> Report:
    """The whole check; holders are always killed, whatever fails."""
    started = time.monotonic()
    backend = choose_backend(args.backend, workdir)
    report = Report(backend.name, datetime.now(timezone.utc).isoformat(timespec="seconds"))
    threshold = Settings().idle_threshold_mib * MIB
    config = workdir / "gpuguard.toml"
    cli = Gpuguard(config, backend.cli_env())
    held: list[Held] = []
    try:
        reading = read(backend)
        gpu = pick_gpu(reading, args.gpu, threshold)
        report.gpu, report.driver_version = gpu.index, reading.driver_version
        # The unit owns the checked GPU only: the host's other GPUs may be at work.
        config.write_text(
            backend.config_text(workdir) + f'[units."{UNIT}"]\ngpus = [{gpu.index}]\n'
        )
        report.rows += static_rows(reading, gpu, mirror(gpu, workdir), threshold)
        node = backend.device_file(gpu.minor) if gpu.minor is not None else None
        report.rows.append(
            Row("device file", "/dev/nvidia<minor> exists (fake: STATE/dev/nvidia<minor>)",
                "exists", str(node) + ("" if node and node.exists() else " missing"),
                node is not None and node.exists(), decisive=True)
        )  # fmt: skip
        with _fake_state(workdir / f"mirror-{gpu.index}"):
            fake_raw = raw_memory(fake_library(), 0)
        report.rows += raw_rows(raw_memory(backend.library(), gpu.index), fake_raw)
        idle_bytes = (gpu.memory.used_bytes if gpu.memory else 0) + threshold
        faked = backend.name != "real"
        sizes = args.sizes or ([256, 4096] if faked else [1024, 16384])
        repeats = args.repeats or (3 if faked else 10)
        attribution(
            backend, cli, gpu, mib=sizes[0], idle_bytes=idle_bytes, report=report, held=held
        )
        for mib in sizes:
            runs = report.release.setdefault(mib, [])
            while len(runs) < repeats:
                one = backend.start(gpu, mib, "context")
                held.append(one)
                runs.append(kill_and_time(backend.library(), gpu.index, one, idle_bytes))
        report.rows += timing_rows(report.release, backend.name)
    except CheckError as err:
        report.error = str(err)
    finally:
        for one in held:
            _kill_group(one.process)
        report.elapsed_s = round(time.monotonic() - started, 2)
    return report


def attribution(  # noqa: PLR0913 - one phase of the run, with the run's state
    backend: HolderBackend,
    cli: Gpuguard,
    gpu: GpuReading,
    *,
    mib: int,
    idle_bytes: int,
    report: Report,
    held: list[Held],
) -> None:
    """Holders of every kind at once: status, the gate and reap must name each one exactly.

    Then the context holders go, and the gate must let a start through past the one that
    only holds the device file.
    """
    held.append(backend.start(gpu, mib, "context"))
    if namespaces_work():
        held.append(backend.start(gpu, mib, "namespace"))
        report.namespace = "unshare --pid works"
    else:
        report.namespace = "skipped: unshare --pid does not work here"
    files_only = backend.start(gpu, 0, "device-file")
    held.append(files_only)
    status = cli("status", "--json")
    report.status_json = json.loads(status.stdout) if status.stdout.strip() else None
    gate = cli("gate", "--unit", UNIT, "--timeout", "1", "--grace", "0.1")
    report.gate = {"exit": gate.returncode, "stderr": gate.stderr[-4000:]}
    reap = cli("reap", "--dry-run", "--unit", UNIT)
    report.reap = {"exit": reap.returncode, "stdout": reap.stdout[-8000:]}
    report.rows += holder_rows(held, report.status_json or {}, gate, reap, gpu.index)
    # Untimed: with two holders on the GPU neither kill alone frees it. The holder itself,
    # not its namespace's wrapper: the fake's watcher there must see it die.
    for one in [h for h in held if h.mode != "device-file"]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(one.pid, signal.SIGKILL)
    wait_idle(backend, gpu.index, idle_bytes)
    alone = cli("gate", "--unit", UNIT, "--timeout", "10", "--grace", "0.1")
    report.rows.append(
        Row("gate: device-file holder alone", "start allowed (memory decides)", "allowed",
            f"exit {alone.returncode}", alone.returncode == 0, decisive=True)
    )  # fmt: skip
    _kill_group(files_only.process)


@contextlib.contextmanager
def _fake_state(state: Path) -> Iterator[None]:
    """Point the fake library (in the adapter's forked workers) at ``state`` for a while."""
    saved = os.environ.get("FAKENVML_STATE")
    os.environ["FAKENVML_STATE"] = str(state)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["FAKENVML_STATE"]
        else:
            os.environ["FAKENVML_STATE"] = saved


def table(rows: Iterable[Row]) -> str:
    """The one table: check, assumption, fake, real, and whether they agree."""
    header = ("check", "assumption", "fake", "real", "agree?")
    lines = [
        (r.check, r.assumption, r.fake, r.real,
         "yes" if r.agree else ("NO" if r.decisive else "differs (info)"))
        for r in rows
    ]  # fmt: skip
    widths = [min(max(len(x[i]) for x in [header, *lines]), 60) for i in range(5)]

    def fmt(cells: Sequence[str]) -> str:
        return " | ".join(c[:60].ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return "\n".join([fmt(header), "-+-".join("-" * w for w in widths), *map(fmt, lines)])


def main(argv: list[str] | None = None) -> int:
    """Parse, run, print the table, write the report; the exit status says what it found."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--backend",
        choices=("auto", "real", "fake", "fake-cuda"),
        default="auto",
        help="fake-cuda: the real backend's holders over a fake libcuda.so.1 (tests)",
    )
    parser.add_argument("--gpu", type=int, help="NVML index to check (default: first idle GPU)")
    parser.add_argument(
        "--sizes", type=lambda s: [int(x) for x in s.split(",")],
        help="MiB per holder, comma-separated (default: real 1024,16384; fake 256,4096)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, help="kills per size (default: real 10, fake 3)")
    parser.add_argument("--report", type=Path, default=Path("hardware-check.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpuguard-hwcheck-") as tmp:
        report = run(args, Path(tmp))
    document = asdict(report)
    document["disagreements"] = [asdict(r) for r in report.decisive_disagreements()]
    args.report.write_text(json.dumps(document, indent=2) + "\n")
    print(table(report.rows))
    print(
        f"\nbackend {report.backend}, GPU {report.gpu}, driver {report.driver_version}, "
        f"PID namespace: {report.namespace}, {report.elapsed_s:.1f} s; report: {args.report}"
    )
    if report.error is not None:
        print(f"hardware check could not finish: {report.error}", file=sys.stderr)
        return 2
    failed = report.decisive_disagreements()
    if failed:
        print(f"{len(failed)} disagreement(s) that change a decision:", file=sys.stderr)
        for row in failed:
            print(f"  {row.check}: assumed {row.assumption}; got {row.real}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
