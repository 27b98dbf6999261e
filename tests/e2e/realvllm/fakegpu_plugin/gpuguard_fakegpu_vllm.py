"""A vLLM general plugin for gpuguard's e2e tests: the real Worker holds fake GPU memory.

vLLM (0.32) loads the entry points of group ``vllm.general_plugins`` once in each of its
processes (vllm/plugins/__init__.py: "process0, engine core process and worker processes"): the
API server (``AsyncEngineArgs.add_cli_args`` and ``EngineArgs.__post_init__``), the EngineCore
(``EngineCore.__init__``) and each Worker (``WorkerWrapperBase.init_worker``; the CPU platform
starts them with multiprocessing's ``spawn``, so each imports afresh), and calls each loaded
function; an exception from the function itself is not caught there. Each process logs
"gpuguard-fakegpu: loaded in NAME" (the API server: ``MainProcess``).

This plugin acts in the Worker only (multiprocessing's process name ``VllmWorker-<rank>``, which
vLLM's multiproc executor gives it) and does there what vLLM's GPU worker does on a GPU, against
the e2e tree's fake GPUs:

* it reads its GPU's free and total memory through NVML (the system's ``libnvidia-ml.so.1``,
  which in the tree is gpuguard's fake, reading ``$FAKENVML_STATE``), the GPU being
  ``CUDA_VISIBLE_DEVICES[local_rank]``;
* it hands them to vLLM's own ``request_memory`` (vllm/v1/worker/utils.py) with the worker's
  cache config: where free memory is short, vLLM's own ``ValueError`` ("Free memory on device
  cuda:N (X/Y GiB) on startup is less than desired GPU memory utilization (U, Z GiB). Decrease
  GPU memory utilization or reduce GPU memory used by other processes.") fails the worker's
  start, as on a GPU; nothing of vLLM's text is copied here;
* otherwise it opens the device stand-ins (``STATE/dev/nvidiactl``, ``nvidia-uvm``,
  ``nvidia<minor>``) and makes a context with the fake GPU driver (``/run/fakegpu/driver.sock``,
  tests/e2e/fakesglang/fakegpu_driver.py) holding the requested memory, kept open for the life
  of the process: NVML lists the Worker (by its host PID) as the holder, /proc shows its device
  files, and the driver frees the memory when the Worker is gone.

No patch of vLLM: it only reads the worker's ``vllm_config`` and ``kwargs`` from the frame of
``init_worker`` that called the plugin loader (the plugin function gets no arguments). Anything
missing (no ``FAKENVML_STATE``, no driver, a vLLM whose loader no longer runs in
``init_worker``) raises: a test must never run against a worker that silently holds nothing.
"""

from __future__ import annotations

import ctypes
import math
import multiprocessing
import os
import socket
import sys
from pathlib import Path
from types import FrameType, SimpleNamespace
from typing import Any

WORKER_PREFIX = "VllmWorker-"
DRIVER_ENV = "FAKEGPU_DRIVER"
DEFAULT_DRIVER = "/run/fakegpu/driver.sock"
MIB = 1 << 20

#: What the Worker holds for as long as it lives: device fds and the driver's context socket.
_HELD: list[Any] = []


class _Memory(ctypes.Structure):
    _fields_ = (
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    )


def _nvml_gpu(index: int) -> tuple[int, int, int]:
    """(minor, total bytes, free bytes) of NVML device ``index``, as torch's CUDA would see it."""
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    handle = ctypes.c_void_p()
    memory = _Memory()
    minor = ctypes.c_uint()
    for call, args in (
        ("nvmlInit_v2", ()),
        ("nvmlDeviceGetHandleByIndex_v2", (ctypes.c_uint(index), ctypes.byref(handle))),
        ("nvmlDeviceGetMemoryInfo", (handle, ctypes.byref(memory))),
        ("nvmlDeviceGetMinorNumber", (handle, ctypes.byref(minor))),
    ):
        code = getattr(nvml, call)(*args)
        if code != 0:
            raise RuntimeError(f"gpuguard-fakegpu: {call} failed with NVML error {code}")
    return minor.value, memory.total, memory.free


def _worker_frame() -> tuple[Any, int]:
    """The worker's ``vllm_config`` and local rank, from the ``init_worker`` frame above us."""
    frame: FrameType | None = sys._getframe(1)  # the plugin function gets no arguments
    while frame is not None:
        names = frame.f_locals
        if frame.f_code.co_name == "init_worker" and "vllm_config" in names:
            kwargs = names.get("kwargs") or {}
            return names["vllm_config"], int(kwargs.get("local_rank", 0))
        frame = frame.f_back
    raise RuntimeError("gpuguard-fakegpu: not called from vLLM's init_worker; vLLM changed?")


def _open_devices(state: Path, minor: int) -> None:
    for name in ("nvidiactl", "nvidia-uvm", f"nvidia{minor}"):
        fd = os.open(state / "dev" / name, os.O_RDWR)
        os.set_inheritable(fd, True)  # noqa: FBT003 - positional-only in os
        _HELD.append(fd)


def _allocate(minor: int, mib: int) -> None:
    context = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    context.connect(os.environ.get(DRIVER_ENV, DEFAULT_DRIVER))
    context.sendall(f"alloc {minor} {mib}\n".encode())
    reply = context.makefile("r", encoding="utf-8").readline().strip()
    if not reply.startswith("ok "):
        raise RuntimeError(f"gpuguard-fakegpu: the fake driver refused {mib} MiB: {reply}")
    _HELD.append(context)


def register() -> None:
    """The general-plugin hook vLLM calls: in a Worker, check and take its fake GPU's memory."""
    name = multiprocessing.current_process().name
    if not name.startswith(WORKER_PREFIX) or _HELD:
        print(f"gpuguard-fakegpu: loaded in {name} (pid {os.getpid()})", flush=True)  # noqa: T201
        return
    state = os.environ.get("FAKENVML_STATE")
    if not state:
        raise RuntimeError("gpuguard-fakegpu: FAKENVML_STATE is not set; no fake GPUs here")
    vllm_config, local_rank = _worker_frame()
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",") if v.strip()]
    index = int(visible[local_rank])
    minor, total, free = _nvml_gpu(index)

    from vllm.v1.worker.utils import request_memory  # noqa: PLC0415 - vLLM only in the Worker

    snapshot = SimpleNamespace(total_memory=total, free_memory=free, device_=f"cuda:{local_rank}")
    requested = request_memory(snapshot, vllm_config.cache_config)  # vLLM's own check and text
    _open_devices(Path(state), minor)
    _allocate(minor, math.ceil(requested / MIB))
    print(  # noqa: T201 - the worker's stdout is the unit's journal
        f"gpuguard-fakegpu: {name} (pid {os.getpid()}) holds {math.ceil(requested / MIB)} MiB "
        f"of fake GPU {index} (minor {minor}) for cuda:{local_rank}",
        flush=True,
    )
