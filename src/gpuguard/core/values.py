"""Plain, frozen values that adapters produce and the core consumes.

Nothing here does I/O; every adapter translates the world into these types so the core can be
tested with hand-made values instead of a GPU, a /proc tree or a journal.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:
    from enum import Enum

    class StrEnum(str, Enum):
        """Python 3.11's enum.StrEnum for 3.10 (Ubuntu 22.04): a member is its value, as text too.

        Every enumeration of gpuguard derives from this one, from here, so str(), format() and
        JSON give the value on every supported Python.
        """

        def __str__(self) -> str:
            """The value, as 3.11's StrEnum gives it (a mixed-in Enum gives 'Class.NAME')."""
            return str.__str__(self)


MIB = 1024 * 1024


@dataclass(frozen=True, slots=True, order=True)
class ProcessIdentity:
    """A process as it can be told apart from a later one that reuses its PID.

    ``start_time`` is field 22 of ``/proc/PID/stat`` (clock ticks since boot): together with the
    PID it names exactly one process for the life of the boot.
    """

    pid: int
    start_time: int


class MemoryApi(StrEnum):
    """Which NVML memory call produced a reading; v1 ``used`` includes the reserved carve-out."""

    V2 = "v2"
    V1 = "v1"


class ReservedSource(StrEnum):
    """Where an estimate of the v1 API's reserved memory came from (see baseline.py)."""

    CONFIGURED = "configured"
    LEARNED = "learned"
    UNCONFIRMED = "unconfirmed"
    """Learned on one occasion only: shown, but the GPU is not called idle on its strength."""


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """Framebuffer memory of one GPU in bytes, as NVML reported it.

    With the v1 API ``reserved_bytes`` is None until estimated; ``reserved_source`` then says how
    it was, and ``used_bytes`` no longer includes it (as with v2).
    """

    total_bytes: int
    used_bytes: int
    reserved_bytes: int | None
    api: MemoryApi
    reserved_source: ReservedSource | None = None


class ProcessListKind(StrEnum):
    """Which NVML process list named a process."""

    COMPUTE = "compute"
    GRAPHICS = "graphics"


@dataclass(frozen=True, slots=True)
class NvmlProcess:
    """A process NVML lists on a GPU; ``used_bytes`` is None when the driver does not say."""

    pid: int
    used_bytes: int | None
    kind: ProcessListKind


class RecoveryAction(StrEnum):
    """The driver's own verdict on what a GPU needs (nvmlDeviceGpuRecoveryAction_t, nvml.h)."""

    NONE = "none"
    GPU_RESET = "gpu-reset"
    NODE_REBOOT = "node-reboot"
    DRAIN_P2P = "drain-p2p"
    DRAIN_AND_RESET = "drain-and-reset"
    RECOVER_IMEX_DOMAIN = "recover-imex-domain"
    BUS_RESET = "bus-reset"
    SYSTEM_REBOOT = "system-reboot"
    OTHER = "other"
    """A value this gpuguard does not know (a newer driver)."""


@dataclass(frozen=True, slots=True)
class GpuHealth:
    """What NVML says about a GPU's health; None is "unknown" (unsupported or unreadable).

    Unknown is never read as healthy: a driver that cannot report pending row remaps has not
    said there are none.
    """

    reset_required: bool = False
    """The driver answered RESET_REQUIRED ("GPU requires restart") to a call on this GPU."""
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failed: bool | None = None
    volatile_uncorrectable_ecc: int | None = None
    """Uncorrectable ECC errors since the last driver load or GPU reset."""
    recovery_action: RecoveryAction | None = None


@dataclass(frozen=True, slots=True)
class MigMode:
    """A GPU's MIG mode as nvmlDeviceGetMigMode answers it (docs/facts.md §2.5).

    ``current`` is in effect now; ``pending`` takes effect at the next GPU reset. A GPU that
    cannot do MIG answers NOT_SUPPORTED, read as off.
    """

    current: bool
    pending: bool


@dataclass(frozen=True, slots=True)
class GpuReading:
    """Everything NVML told us about one GPU; ``problem`` says what could not be read and why."""

    index: int
    name: str | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    minor: int | None = None
    memory: GpuMemory | None = None
    processes: tuple[NvmlProcess, ...] = ()
    problem: str | None = None
    lost: bool = False
    health: GpuHealth = field(default_factory=GpuHealth)
    persistence_mode: bool | None = None
    """Whether the driver keeps the GPU initialised without clients; None: unknown."""
    mig: MigMode | None = None
    """MIG mode; None: unknown (the call failed). With MIG on, the whole-GPU memory and
    process lists sum every MIG instance, other tenants' too (core/mig.py)."""
    processes_read_s: float | None = None
    """When NVML answered ``processes`` (the host's monotonic clock, which the forked NVML
    worker shares); None when the list could not be read. A release is timed to it: a reading
    stamped when its gather began could predate the answer by the worker's start."""


class NvmlHealth(StrEnum):
    """How far NVML could be used at all; anything but OK means readings are incomplete."""

    OK = "ok"
    UNAVAILABLE = "unavailable"
    NO_PERMISSION = "no-permission"
    DRIVER_TOO_OLD = "driver-too-old"
    TIMED_OUT = "timed-out"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class NvmlReading:
    """One snapshot of all GPUs; a failure is a health state with a reason, never an exception."""

    health: NvmlHealth
    reason: str | None = None
    driver_version: str | None = None
    gpus: tuple[GpuReading, ...] = ()


def nvml_usable(reading: NvmlReading) -> bool:
    """Whether NVML gave GPU readings at all (a driver too old for some calls still does)."""
    return reading.health in (NvmlHealth.OK, NvmlHealth.DRIVER_TOO_OLD)


@dataclass(frozen=True, slots=True)
class ProcessFacts:
    """What /proc says about one process, with secrets already removed from its command line.

    ``cgroup`` is None when ``/proc/PID/cgroup`` could not be read or parsed (owner unknown);
    ``invocation_id`` is the ``INVOCATION_ID`` of its environment (readable by root only);
    ``uids`` are its real, effective, saved and filesystem uids (empty when unknown).
    """

    identity: ProcessIdentity
    ppid: int
    state: str
    comm: str
    cmdline: tuple[str, ...]
    uid: int
    user: str
    cgroup: str | None
    invocation_id: str | None = None
    uids: tuple[int, ...] = ()
    device_files: frozenset[str] = field(default_factory=frozenset)
    kernel_thread: bool = False
    files_readable: bool = True
    """False when its fds and maps could not be read (another user's process, without root):
    ``device_files`` is then what could be seen, not what it holds."""
    kernel_wait: tuple[str, ...] = ()
    """In state D only: where the kernel says it sleeps (wchan, then the stack frames root may
    read), which tells a wait in the NVIDIA driver from ordinary I/O or a vfork() parent."""
    partial: str | None = None
    """Why its files were not read in full (a budget of the /proc walk ran out: millions of
    descriptors, a huge ``maps``); None when they were. ``device_files`` is then what the part
    read shows, never proof that it holds nothing more."""


@dataclass(frozen=True, slots=True)
class UnitProvenance:
    """What marks a process as coming from one of a unit's runs, as systemd told it.

    ``problem`` says why systemd's view of the unit is unknown (systemctl failed); then nothing
    in the unit's cgroup is reaped, since its live run cannot be told from a stale one.
    ``invocations`` are the unit's ended runs: the invocation ids PID 1 logged for it and the
    last one systemd names, never the running one. ``uid`` is the uid the unit runs as
    (``User=`` resolved, root when unset), None when it cannot be resolved: a process outside
    the cgroup is the unit's left-over only if its environment names one of ``invocations``
    and it runs as ``uid``. ``ledger`` is what the daemon recorded while the unit's runs lived
    (core.ledger): each process seen descending from a run, with that run's invocation id; one
    of an ended run that runs as ``uid`` is a left-over wherever it moved.
    """

    problem: str | None
    invocations: frozenset[str] = frozenset()
    uid: int | None = None
    ledger: frozenset[tuple[ProcessIdentity, str]] = frozenset()
    elsewhere: frozenset[ProcessIdentity] = frozenset()
    """Processes the ledger recorded in runs of other watched units: never this unit's by
    adoption (``adopt``), whatever cgroup they sit in."""
    other_runs: frozenset[str] = frozenset()
    """Invocation ids of other watched units' runs (the ledger's, the running ones included):
    a process whose INVOCATION_ID names one is never this unit's by adoption."""


@dataclass(frozen=True, slots=True)
class ProcScan:
    """The result of a /proc walk: processes holding device files plus what could not be read."""

    processes: tuple[ProcessFacts, ...]
    unreadable: int = 0
    method: str = "full"
    hidden: frozenset[int] = frozenset()
    """PIDs that exist in /proc but whose details this user may not read (hidepid=)."""
    not_visited: int = 0
    """Processes the walk did not read at all: its budget of processes or time ran out."""


@dataclass(frozen=True, slots=True)
class ReapTarget:
    """A process the kill policy chose, with what an operator needs to recognise it."""

    identity: ProcessIdentity
    ppid: int
    command: str  # display text, secrets already redacted
    unit: str | None
    reason: str  # why the policy chose it


class ReapOutcome(StrEnum):
    """How reaping one target ended."""

    EXITED = "exited"  # exited after SIGTERM
    KILLED = "killed"  # exited after SIGKILL
    GONE = "gone"  # had already exited before we signalled it
    PID_REUSED = "pid-reused"  # the PID now names another process, which was never signalled
    UNKILLABLE = "unkillable"  # alive after SIGKILL and the wait (state D in the driver, …)
    PERMISSION_DENIED = "permission-denied"  # EPERM: reported once, never retried
    ERROR = "error"  # the kernel refused the pidfd or the signal for another reason

    @property
    def gone(self) -> bool:
        """Whether the process is gone: only then was it reaped (exited, killed, or before)."""
        return self in {ReapOutcome.EXITED, ReapOutcome.KILLED, ReapOutcome.GONE}


@dataclass(frozen=True, slots=True)
class ReapResult:
    """The outcome for one target, the signals it was sent, and the why when it did not die."""

    target: ReapTarget
    outcome: ReapOutcome
    signals: tuple[str, ...] = ()
    detail: str | None = None
    last_signal_s: float | None = None
    """When the last of ``signals`` was sent (``time.monotonic``): where the driver's release of
    the process's GPU memory is timed from (core.release); None when none was sent."""
