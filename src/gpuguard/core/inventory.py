"""Who holds which GPU: NVML's view and the /proc view merged into one list (pure).

NVML knows memory per process but can name PIDs that are gone and misses forked children that
only inherited the device fds; /proc knows every open device file but not how much memory stands
behind it. Neither is guessed from the other: memory that no visible process explains is reported
as unattributed, a PID that NVML names but /proc lacks is reported as vanished, and one that /proc
has but will not show this user (not root) as uninspectable - it exists, so it did not vanish.

NVML's PID is a claim, /proc is the proof: the driver names processes by host PID whatever the
PID namespace, so an NVML PID is credited to a process here only when that process holds the
same GPU's device file (fd or mapping). A process of that number that does not is an unrelated
one, and the PID is one from another PID namespace (``foreign``): never shown as this
namespace's process, so never reaped on NVML's word. Inside a PID namespace (containment.py) the
driver's per-process figures name nobody here, so a GPU's memory is credited to the processes
here that hold its device files as a whole, or, when none does, reported as used from outside.

A process whose files a budget of the /proc walk cut short (``partial``) is never read as one
that holds nothing: it is listed in ``Inventory.partial`` with the GPUs it could hold, and no
GPU among them counts as idle (idle.py). It could hold a GPU when NVML lists it there or the part
read shows that GPU's device file; when the part read shows only a control node (nvidiactl,
nvidia-uvm) it could hold any. One whose part read shows no NVIDIA file at all and that NVML does
not list holds no GPU memory (NVML would list it or the memory would be unexplained): it is named,
and blocks nothing, so that opening many descriptors does not let a user refuse every start.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePath
from typing import TYPE_CHECKING

from gpuguard.core.cgroup import Attribution, attribute
from gpuguard.core.containment import HOST
from gpuguard.core.escaping import escape
from gpuguard.core.redaction import display_command
from gpuguard.core.values import NvmlHealth

if TYPE_CHECKING:
    from collections.abc import Mapping

    from gpuguard.core.containment import Containment
    from gpuguard.core.values import (
        GpuReading,
        NvmlReading,
        ProcessFacts,
        ProcessIdentity,
        ProcScan,
    )

_GPU_NODE = re.compile(r"nvidia(\d+)")
# The command line shown to people, in records and in logs: a process may have 2 MiB of it
# (status --json keeps the whole, redacted ``cmdline``).
COMMAND_LIMIT = 4096


@dataclass(frozen=True, slots=True)
class GpuUse:
    """One holder's use of one GPU; ``used_bytes`` is None when NVML did not list or size it."""

    gpu_index: int
    used_bytes: int | None
    listed_by_nvml: bool
    holds_device_file: bool


@dataclass(frozen=True, slots=True)
class Holder:
    """A live process that holds GPU memory or an NVIDIA device file, attributed to its owner."""

    identity: ProcessIdentity
    ppid: int
    state: str
    user: str
    comm: str
    cmdline: tuple[str, ...]
    attribution: Attribution
    invocation_id: str | None
    gpus: tuple[GpuUse, ...]
    device_files: frozenset[str]
    kernel_thread: bool
    files_readable: bool = True
    kernel_wait: tuple[str, ...] = ()
    uids: tuple[int, ...] = ()
    """Real, effective, saved and filesystem uid; empty when /proc did not say."""
    partial: str | None = None
    """Why its files were not read in full (a budget ran out); None when they were."""

    @property
    def pid(self) -> int:
        """The holder's PID (identity.pid), for readability at call sites."""
        return self.identity.pid

    @property
    def owner(self) -> str:
        """Who the process belongs to, for humans: container, else unit, else "no unit".

        Escaped: a user names its own cgroups and containers.
        """
        attribution = self.attribution
        if attribution.unknown:
            return "unknown cgroup"
        if attribution.container:
            return escape(attribution.container)
        if attribution.unit:
            unit = escape(attribution.unit)
            return f"{unit} (user)" if attribution.user_unit else unit
        return "no unit"

    @property
    def command(self) -> str:
        """The command line for humans: redacted, escaped, at most COMMAND_LIMIT characters."""
        return self.command_within(COMMAND_LIMIT)

    def command_within(self, limit: int) -> str:
        """The command line for humans in at most ``limit`` characters.

        Cut from the whole command line, never from ``command``: a second cut would count only
        what it cut of the first one (``[+4012 chars]`` where 20,075 were left out).
        """
        return display_command(self.cmdline, limit) or escape(f"[{self.comm}]", limit)


@dataclass(frozen=True, slots=True)
class VanishedProcess:
    """A PID that NVML lists on a GPU but that /proc does not have (gone, or another namespace)."""

    pid: int
    gpu_index: int
    used_bytes: int | None


@dataclass(frozen=True, slots=True)
class ForeignProcess:
    """A PID NVML lists on a GPU whose process here holds no device file of that GPU.

    The number belongs to an unrelated process of this PID namespace; NVML's is one of another
    namespace (the driver reports host PIDs), or the process it meant is gone and the PID reused.
    """

    pid: int
    gpu_index: int
    used_bytes: int | None


@dataclass(frozen=True, slots=True)
class UninspectableProcess:
    """A PID that NVML lists and /proc has, but whose details this user may not read."""

    pid: int
    gpu_index: int
    used_bytes: int | None


@dataclass(frozen=True, slots=True)
class PartialProcess:
    """A process whose files a budget of the /proc walk cut short: not fully inspected."""

    pid: int
    user: str
    comm: str
    reason: str
    gpus: tuple[int, ...]
    """The GPUs it could hold, on which no idle verdict is given (see the module's docstring)."""


@dataclass(frozen=True, slots=True)
class GpuOccupancy:
    """One GPU with the evidence about who uses it."""

    reading: GpuReading
    holder_pids: tuple[int, ...]
    unattributed_bytes: int | None
    container_bytes: int | None = None
    """Inside a PID namespace: memory credited to the processes here that hold this GPU's
    device files, as a whole (the driver's per-process figures name host PIDs)."""
    outside_bytes: int | None = None
    """Inside a PID namespace: memory used while no process here holds this GPU."""


@dataclass(frozen=True, slots=True)
class Inventory:
    """Everything known about GPU use at one moment."""

    nvml: NvmlReading
    scan: ProcScan
    gpus: tuple[GpuOccupancy, ...]
    holders: tuple[Holder, ...]
    vanished: tuple[VanishedProcess, ...]
    uninspectable: tuple[UninspectableProcess, ...] = ()
    foreign: tuple[ForeignProcess, ...] = ()
    containment: Containment = HOST
    partial: tuple[PartialProcess, ...] = ()

    def holder(self, pid: int) -> Holder | None:
        """The holder with this PID, if any."""
        return next((h for h in self.holders if h.pid == pid), None)

    def partial_on(self, gpu_index: int) -> tuple[PartialProcess, ...]:
        """The processes not fully inspected that could hold this GPU: it is not idle."""
        return tuple(p for p in self.partial if gpu_index in p.gpus)


def gpu_minor_of(path: str) -> int | None:
    """The minor number a device path names (``/dev/nvidia3`` → 3); None for control nodes."""
    match = _GPU_NODE.fullmatch(PurePath(path).name)
    return int(match.group(1)) if match else None


def build_inventory(
    nvml: NvmlReading,
    scan: ProcScan,
    idle_threshold_bytes: int,
    containment: Containment = HOST,
) -> Inventory:
    """Merge an NVML reading and a /proc scan into attributed holders and per-GPU evidence."""
    index_of_minor = {g.minor: g.index for g in nvml.gpus if g.minor is not None}
    facts_by_pid = {p.identity.pid: p for p in scan.processes}
    listed: dict[int, dict[int, int | None]] = {}
    vanished: list[VanishedProcess] = []
    hidden: list[UninspectableProcess] = []
    foreign: list[ForeignProcess] = []
    for gpu in nvml.gpus:
        for process in gpu.processes:
            facts = facts_by_pid.get(process.pid)
            if facts is not None and _backs_claim(facts, gpu, index_of_minor):
                listed.setdefault(process.pid, {})[gpu.index] = process.used_bytes
            elif facts is not None:
                foreign.append(ForeignProcess(process.pid, gpu.index, process.used_bytes))
            elif process.pid in scan.hidden:
                hidden.append(UninspectableProcess(process.pid, gpu.index, process.used_bytes))
            else:
                vanished.append(VanishedProcess(process.pid, gpu.index, process.used_bytes))
    holders = tuple(
        holder
        for facts in sorted(facts_by_pid.values(), key=lambda f: f.identity.pid)
        if (holder := _holder(facts, listed.get(facts.identity.pid, {}), index_of_minor))
    )
    lists_known = nvml.health is not NvmlHealth.DRIVER_TOO_OLD
    gpus = tuple(
        _occupancy(
            gpu,
            holders,
            idle_threshold_bytes,
            lists_known=lists_known,
            in_namespace=containment.foreign_pids,
        )
        for gpu in nvml.gpus
    )
    partial = tuple(
        _partial(facts, listed.get(facts.identity.pid, {}), nvml, index_of_minor)
        for facts in sorted(facts_by_pid.values(), key=lambda f: f.identity.pid)
        if facts.partial is not None
    )
    return Inventory(
        nvml,
        scan,
        gpus,
        holders,
        tuple(vanished),
        tuple(hidden),
        tuple(foreign),
        containment,
        partial,
    )


def _partial(
    facts: ProcessFacts,
    listed_on: Mapping[int, int | None],
    nvml: NvmlReading,
    index_of_minor: Mapping[int, int],
) -> PartialProcess:
    """A process not fully inspected, with the GPUs it could hold (the module's docstring)."""
    minors = {gpu_minor_of(path) for path in facts.device_files}
    gpus = set(listed_on) | {index for minor, index in index_of_minor.items() if minor in minors}
    if None in minors:
        gpus |= {gpu.index for gpu in nvml.gpus}
    return PartialProcess(
        pid=facts.identity.pid,
        user=facts.user,
        comm=facts.comm,
        reason=facts.partial or "",
        gpus=tuple(sorted(gpus)),
    )


def _backs_claim(facts: ProcessFacts, gpu: GpuReading, index_of_minor: Mapping[int, int]) -> bool:
    """Whether a process here is the one NVML lists on ``gpu``: it holds that GPU's device file.

    Whose open files cannot be read (not root) cannot be checked and is taken at NVML's word:
    only root reaps, and root reads every process's files. So is one whose files a budget cut
    short: the device file may be among those not read. A GPU whose minor NVML did not give is
    backed by any GPU device file that is not another known GPU's.
    """
    if not facts.files_readable or facts.partial is not None:
        return True
    minors = {gpu_minor_of(path) for path in facts.device_files} - {None}
    if gpu.minor is not None:
        return gpu.minor in minors
    return bool(minors - set(index_of_minor))


def _holder(
    facts: ProcessFacts,
    listed_on: Mapping[int, int | None],
    index_of_minor: Mapping[int, int],
) -> Holder | None:
    """The holder a process is, or None when it holds nothing of ours (read_listed's extras)."""
    # A device node NVML did not describe (NVML unavailable, or a minor it did not report) is
    # still evidence, shown through ``device_files``; it is never guessed onto a GPU index.
    minors = {gpu_minor_of(path) for path in facts.device_files}
    file_gpus = {index for minor, index in index_of_minor.items() if minor in minors}
    uses = tuple(
        GpuUse(
            gpu_index=index,
            used_bytes=listed_on.get(index),
            listed_by_nvml=index in listed_on,
            holds_device_file=index in file_gpus,
        )
        for index in sorted(set(listed_on) | file_gpus)
    )
    if not uses and not facts.device_files:
        return None
    return Holder(
        identity=facts.identity,
        ppid=facts.ppid,
        state=facts.state,
        user=facts.user,
        comm=facts.comm,
        cmdline=facts.cmdline,
        attribution=attribute(facts.cgroup),
        invocation_id=facts.invocation_id,
        gpus=uses,
        device_files=facts.device_files,
        kernel_thread=facts.kernel_thread,
        files_readable=facts.files_readable,
        kernel_wait=facts.kernel_wait,
        uids=facts.uids,
        partial=facts.partial,
    )


def _occupancy(
    gpu: GpuReading,
    holders: tuple[Holder, ...],
    idle_threshold_bytes: int,
    *,
    lists_known: bool,
    in_namespace: bool,
) -> GpuOccupancy:
    pids = tuple(h.pid for h in holders if any(u.gpu_index == gpu.index for u in h.gpus))
    if in_namespace:
        rest = _beyond_backed(gpu, holders, idle_threshold_bytes)
        held = any(
            u.gpu_index == gpu.index and u.holds_device_file for h in holders for u in h.gpus
        )
        return GpuOccupancy(
            reading=gpu,
            holder_pids=pids,
            unattributed_bytes=0,
            container_bytes=rest if held else 0,
            outside_bytes=0 if held else rest,
        )
    return GpuOccupancy(
        reading=gpu,
        holder_pids=pids,
        unattributed_bytes=_unattributed(
            gpu, idle_threshold_bytes, lists_known=lists_known, held=bool(pids)
        ),
    )


def _beyond_backed(
    gpu: GpuReading, holders: tuple[Holder, ...], idle_threshold_bytes: int
) -> int | None:
    """Used memory beyond what processes here are credited with, past the idle allowance.

    None when it cannot be known: no memory reading, the v1 reserve not estimated, or a
    credited process whose usage the driver does not report.
    """
    memory = gpu.memory
    if memory is None or memory.reserved_bytes is None:
        return None
    sizes = [
        u.used_bytes
        for h in holders
        for u in h.gpus
        if u.gpu_index == gpu.index and u.listed_by_nvml
    ]
    if any(size is None for size in sizes):
        return None
    rest = memory.used_bytes - sum(size for size in sizes if size is not None)
    return rest if rest > idle_threshold_bytes else 0


def _unattributed(
    gpu: GpuReading, idle_threshold_bytes: int, *, lists_known: bool, held: bool
) -> int | None:
    """Used memory that the listed processes do not explain, beyond the idle allowance.

    None when it cannot be known: no memory reading, a process whose usage the driver does not
    report, the v1 API whose reserved carve-out is not estimated (baseline.py), or a driver
    that cannot list processes while /proc shows one holding the GPU. With no process list and
    no holder at all, everything above the reserve is unexplained.
    """
    memory = gpu.memory
    if memory is None or memory.reserved_bytes is None or (held and not lists_known):
        return None
    sizes = [p.used_bytes for p in gpu.processes]
    if any(size is None for size in sizes):
        return None
    unexplained = memory.used_bytes - sum(size for size in sizes if size is not None)
    return unexplained if unexplained > idle_threshold_bytes else 0
