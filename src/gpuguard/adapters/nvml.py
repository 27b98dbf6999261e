"""The NVML adapter: the only module that imports pynvml, and what it reads of each GPU.

Every snapshot runs in a forked child that the caller can abandon on a deadline (nvmlworker),
over the library nvmllibrary found and loaded: after an Xid 45 class fault the driver can leave
an NVML call blocked in the kernel forever (docs/facts.md §2.4), and neither the gate nor the
daemon may hang with it. Failures come back as an ``NvmlHealth`` with a reason an operator can
act on, never as a traceback.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from gpuguard.adapters.nvmllibrary import library_candidates, load_library
from gpuguard.adapters.nvmlworker import run_abandonable
from gpuguard.core.values import (
    GpuHealth,
    GpuMemory,
    GpuReading,
    MemoryApi,
    MigMode,
    NvmlHealth,
    NvmlProcess,
    NvmlReading,
    ProcessListKind,
    RecoveryAction,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path
    from types import ModuleType

# pynvml raises INSUFFICIENT_SIZE when the process list grows between its two calls; a few
# retries always settle on a real host.
_PROCESS_LIST_RETRIES = 5

# Drivers 535.43 ≤ v < 535.86 wrote a 32-byte process struct into the 24-byte _v3 layout, so the
# PIDs read back scrambled (gpustat #161, nvitop #79). These values are what that looks like.
_SCRAMBLED_PIDS = frozenset({0, 0xFFFFFFFF})

# NVML codes (nvml.h) that say the library cannot be used on this host at all.
_UNAVAILABLE_CODES = frozenset({9, 12, 18})  # DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND, RM_MISMATCH
_NO_PERMISSION = 4
_NOT_SUPPORTED = 3
_GPU_IS_LOST = 15
_RESET_REQUIRED = 16
_FUNCTION_NOT_FOUND = 13
_INSUFFICIENT_SIZE = 7

# nvml.h: NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
# (a field of drivers >= 565; older ones answer NOT_SUPPORTED in the field's own slot).
_UNCORRECTED = 1
_VOLATILE = 0
_FI_GPU_RECOVERY_ACTION = 230
_MIG_ENABLE = 1  # nvml.h NVML_DEVICE_MIG_ENABLE
_RECOVERY_ACTIONS = (
    RecoveryAction.NONE,
    RecoveryAction.GPU_RESET,
    RecoveryAction.NODE_REBOOT,
    RecoveryAction.DRAIN_P2P,
    RecoveryAction.DRAIN_AND_RESET,
    RecoveryAction.RECOVER_IMEX_DOMAIN,
    RecoveryAction.BUS_RESET,
    RecoveryAction.SYSTEM_REBOOT,
)


def read_gpus(timeout_s: float, library: Path | None = None) -> NvmlReading:
    """Snapshot every GPU, giving up (and saying so) when NVML does not answer in time.

    ``library``: the driver's libnvidia-ml.so.1 (the ``nvml_library`` setting); None: found as
    library_candidates says.
    """
    try:
        # Imported here, before the fork, so repeated snapshots do not re-import it and so that
        # commands which never need NVML do not pay for it.
        import pynvml  # noqa: PLC0415 - lazy by design, see above
    except ImportError as err:
        return NvmlReading(NvmlHealth.UNAVAILABLE, f"NVML unavailable: pynvml missing ({err})")
    candidates = library_candidates(None if library is None else str(library))

    def work() -> NvmlReading:
        problem = load_library(candidates)
        if problem is not None:
            return NvmlReading(NvmlHealth.UNAVAILABLE, f"NVML unavailable: {problem}")
        return snapshot(pynvml)

    return run_abandonable(work, timeout_s, _timed_out)


@functools.cache
def import_bindings() -> None:
    """Import pynvml without calling it: a forking server's children then find it loaded.

    Importing loads no library and talks to no driver (that is nvmlInit, in read_gpus's worker).
    """
    with contextlib.suppress(ImportError):
        import pynvml  # noqa: F401, PLC0415 - imported for its side effect, see above


def _timed_out(timeout_s: float) -> NvmlReading:
    return NvmlReading(
        NvmlHealth.TIMED_OUT,
        f"NVML did not answer within {timeout_s:g} s: the driver may be wedged "
        "(check `dmesg` for Xid errors; a GPU reset or reboot may be needed)",
    )


def snapshot(nvml: ModuleType) -> NvmlReading:
    """Read all GPUs through pynvml in this process (call it via run_abandonable)."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as err:
        return _init_failure(err)
    try:
        return _read_all(nvml)
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _init_failure(err: Any) -> NvmlReading:  # noqa: ANN401 - pynvml's exception classes are untyped
    code = getattr(err, "value", None)
    if code in _UNAVAILABLE_CODES:
        return NvmlReading(NvmlHealth.UNAVAILABLE, f"NVML unavailable: {err}")
    if code == _NO_PERMISSION:
        return NvmlReading(
            NvmlHealth.NO_PERMISSION,
            f"NVML refused access ({err}): run as root or allow access to /dev/nvidiactl",
        )
    return NvmlReading(NvmlHealth.ERROR, f"NVML failed to initialise: {err}")


def _read_all(nvml: ModuleType) -> NvmlReading:
    driver = _optional(nvml, nvml.nvmlSystemGetDriverVersion)
    count = nvml.nvmlDeviceGetCount()
    gpus: list[GpuReading] = []
    too_old: str | None = None
    for index in range(count):
        gpu, missing_symbol = _read_gpu(nvml, index)
        gpus.append(gpu)
        too_old = too_old or missing_symbol
    if too_old:
        return NvmlReading(
            NvmlHealth.DRIVER_TOO_OLD,
            f"driver too old: {too_old}; per-process GPU memory is unknown, "
            "the /proc scan is the only evidence (upgrade to driver >= 510.39)",
            driver,
            tuple(gpus),
        )
    return NvmlReading(NvmlHealth.OK, None, driver, tuple(gpus))


def _read_gpu(nvml: ModuleType, index: int) -> tuple[GpuReading, str | None]:
    """One GPU; returns the reading and the name of a missing versioned symbol, if any."""
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except nvml.NVMLError as err:
        return _unreachable_gpu(index, err), None
    problems: list[str] = []
    lost = False
    reset_required = False
    memory: GpuMemory | None = None
    try:
        memory = _read_memory(nvml, handle)
    except nvml.NVMLError as err:
        lost = err.value == _GPU_IS_LOST
        reset_required = err.value == _RESET_REQUIRED
        if err.value == _NOT_SUPPORTED:
            problems.append("memory info not supported on this GPU (integrated/unified memory)")
        else:
            problems.append(f"memory unreadable: {err}")
    processes: tuple[NvmlProcess, ...] = ()
    processes_read_s: float | None = None
    missing_symbol: str | None = None
    try:
        processes, scrambled = _read_processes(nvml, handle)
        processes_read_s = time.monotonic()
        if scrambled:
            problems.append(
                "driver reported corrupt PIDs (a 535.43-535.85 driver?); upgrade the driver"
            )
    except nvml.NVMLError as err:
        lost = lost or err.value == _GPU_IS_LOST
        reset_required = reset_required or err.value == _RESET_REQUIRED
        problems.append(f"process list unreadable: {err}")
    except nvml.NVMLLibraryMismatchError:
        missing_symbol = "no nvmlDeviceGetComputeRunningProcesses_v3"
    health = _read_health(nvml, handle)
    if reset_required:
        health = replace(health, reset_required=True)
    reading = GpuReading(
        index=index,
        name=_optional(nvml, nvml.nvmlDeviceGetName, handle),
        uuid=_optional(nvml, nvml.nvmlDeviceGetUUID, handle),
        pci_bus_id=_pci_bus_id(nvml, handle),
        minor=_optional(nvml, nvml.nvmlDeviceGetMinorNumber, handle),
        memory=memory,
        processes=processes,
        problem="; ".join(problems) or None,
        lost=lost,
        health=health,
        persistence_mode=_enabled(_optional(nvml, nvml.nvmlDeviceGetPersistenceMode, handle)),
        mig=_mig_mode(nvml, handle),
        processes_read_s=processes_read_s,
    )
    if lost:
        reading = _mark_lost(reading)
    return reading, missing_symbol


def _unreachable_gpu(index: int, err: Any) -> GpuReading:  # noqa: ANN401 - untyped pynvml error
    code = getattr(err, "value", None)
    if code == _GPU_IS_LOST:
        return _mark_lost(GpuReading(index=index, lost=True))
    if code == _NO_PERMISSION:
        return GpuReading(index=index, problem="no permission to open this GPU (run as root)")
    if code == _RESET_REQUIRED:
        return GpuReading(
            index=index,
            problem=f"cannot open GPU: {err}",
            health=GpuHealth(reset_required=True),
        )
    return GpuReading(index=index, problem=f"cannot open GPU: {err}")


def _mark_lost(reading: GpuReading) -> GpuReading:
    return replace(
        reading,
        problem="GPU is lost (fallen off the bus); its memory will not be released without a "
        "GPU reset or reboot",
        lost=True,
    )


def _read_health(nvml: ModuleType, handle: object) -> GpuHealth:
    """Each health fact on its own: one the driver does not support stays None (unknown).

    RESET_REQUIRED from any of them is itself the strongest fact there is.
    """
    answers: dict[str, Any] = {}
    reset_required = False
    calls: dict[str, Callable[[], Any]] = {
        "retired": lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle),
        "remapped": lambda: nvml.nvmlDeviceGetRemappedRows(handle),
        "ecc": lambda: nvml.nvmlDeviceGetTotalEccErrors(handle, _UNCORRECTED, _VOLATILE),
        "action": lambda: _recovery_action(nvml, handle),
    }
    for key, call in calls.items():
        try:
            answers[key] = call()
        except nvml.NVMLError as err:
            reset_required = reset_required or err.value == _RESET_REQUIRED
    remapped = answers.get("remapped")
    retired = answers.get("retired")
    ecc = answers.get("ecc")
    return GpuHealth(
        reset_required=reset_required,
        retired_pages_pending=None if retired is None else bool(retired),
        remapped_rows_pending=None if remapped is None else bool(remapped[2]),
        remapped_rows_failed=None if remapped is None else bool(remapped[3]),
        volatile_uncorrectable_ecc=None if ecc is None else int(ecc),
        recovery_action=answers.get("action"),
    )


def _recovery_action(nvml: ModuleType, handle: object) -> RecoveryAction | None:
    """The driver's recovery action field; None when this driver does not have it."""
    (value,) = nvml.nvmlDeviceGetFieldValues(handle, [_FI_GPU_RECOVERY_ACTION])
    if value.nvmlReturn != 0:
        if value.nvmlReturn == _RESET_REQUIRED:
            raise nvml.NVMLError(_RESET_REQUIRED)
        return None
    code = int(value.value.uiVal)
    return _RECOVERY_ACTIONS[code] if code < len(_RECOVERY_ACTIONS) else RecoveryAction.OTHER


def _read_memory(nvml: ModuleType, handle: object) -> GpuMemory:
    """Prefer the v2 call (``used`` without the reserved carve-out); fall back to v1 (< 515)."""
    try:
        info = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
    except nvml.NVMLError as err:
        if err.value != _FUNCTION_NOT_FOUND:
            raise
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
        return GpuMemory(int(info.total), int(info.used), None, MemoryApi.V1)
    return GpuMemory(int(info.total), int(info.used), int(info.reserved), MemoryApi.V2)


def _read_processes(nvml: ModuleType, handle: object) -> tuple[tuple[NvmlProcess, ...], bool]:
    """Compute and graphics lists merged by PID; also whether scrambled PIDs were dropped."""
    merged: dict[int, NvmlProcess] = {}
    scrambled = False
    lists = (
        (ProcessListKind.COMPUTE, nvml.nvmlDeviceGetComputeRunningProcesses),
        (ProcessListKind.GRAPHICS, nvml.nvmlDeviceGetGraphicsRunningProcesses),
    )
    for kind, call in lists:
        for entry in _with_retries(nvml, call, handle):
            pid = int(entry.pid)
            if pid in _SCRAMBLED_PIDS:
                scrambled = True
                continue
            used = None if entry.usedGpuMemory is None else int(entry.usedGpuMemory)
            seen = merged.get(pid)
            # A process with both a compute and a graphics context is listed twice with the same
            # total ("all of the memory used by the application", nvml.h): keep one entry.
            if seen is None or (used or 0) > (seen.used_bytes or 0):
                merged[pid] = NvmlProcess(pid, used, seen.kind if seen else kind)
    return tuple(merged[pid] for pid in sorted(merged)), scrambled


def _with_retries(
    nvml: ModuleType, call: Callable[[object], list[Any]], handle: object
) -> list[Any]:
    for _ in range(_PROCESS_LIST_RETRIES - 1):
        try:
            return call(handle)
        except nvml.NVMLError as err:
            if err.value != _INSUFFICIENT_SIZE:
                raise
    return call(handle)


def _mig_mode(nvml: ModuleType, handle: object) -> MigMode | None:
    """MIG mode, current and pending; off on a GPU or driver without MIG; None when unknown.

    nvml.h: NOT_SUPPORTED "if device doesn't support MIG mode" (every GPU before Ampere, and
    the Ampere-or-later ones without MIG); a driver older than MIG lacks the symbol.
    """
    try:
        current, pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError as err:
        if err.value in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND):
            return MigMode(current=False, pending=False)
        return None
    return MigMode(current=int(current) == _MIG_ENABLE, pending=int(pending) == _MIG_ENABLE)


def _pci_bus_id(nvml: ModuleType, handle: object) -> str | None:
    info = _optional(nvml, nvml.nvmlDeviceGetPciInfo, handle)
    if info is None:
        return None
    return str(info.busId)


def _enabled(state: object) -> bool | None:
    """An nvmlEnableState_t answer as a bool; None when there was no answer."""
    return None if state is None else bool(state)


def _optional(nvml: ModuleType, call: Callable[..., Any], *args: object) -> Any:  # noqa: ANN401
    """A descriptive field that may be unsupported; its absence must not lose the GPU."""
    try:
        return call(*args)
    except nvml.NVMLError:
        return None
