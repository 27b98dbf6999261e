"""What doctor judges a unit on: its settings, its history, its environment, the host.

The adapter (``adapters/doctorio.py``) gathers these values and nothing in them does I/O, so
every check is a pure function of them. Strings in them are foreign (they came from the unit
or its processes) and stay raw here: they are escaped where they are rendered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    from gpuguard.core.unitconfig import UnitConfig


@dataclass(frozen=True, slots=True)
class Stop:
    """One stop of the unit: how long from "Stopping" until the main process exited.

    ``killed``: systemd's stop timeout fired (SIGKILL); ``drain_s`` is then only a lower bound.
    """

    invocation_id: str | None
    drain_s: float
    killed: bool


@dataclass(frozen=True, slots=True)
class History:
    """What the journal says about the unit's recent runs (trusted PID-1 entries only)."""

    entries: int = 0
    stops: tuple[Stop, ...] = ()
    load_times_s: tuple[float, ...] = ()
    """"Starting" → "Started" of one run: the gate's wait plus, for Type=notify, the model load."""
    failed_runs_s: tuple[float, ...] = ()
    """"Started" → main process exit of runs that failed without being stopped."""
    survivors: tuple[tuple[int, str], ...] = ()
    """Distinct (PID, name) of processes that stayed after a stop or were left over at a start."""
    swept: tuple[tuple[tuple[int, ...], str], ...] = ()
    """The daemon's sweeps of an ended run's survivors (its PIDs, its summary): the workers that
    left the unit's cgroup, which systemd never names, are seen only here."""
    restarts: int = 0
    start_limit_hits: int = 0
    named: tuple[int, ...] = ()
    """PIDs the unit's out-of-memory lines name as holding GPU memory (the server's word) that
    systemd never saw in the cgroup: perhaps a worker that left it. Shown, never counted: any
    process of the unit can print such a line."""


@dataclass(frozen=True, slots=True)
class PathFact:
    """One file-system object on the way to a path the unit uses, as ``lstat`` saw it."""

    path: str
    uid: int
    gid: int
    mode: int
    is_dir: bool


@dataclass(frozen=True, slots=True)
class AuditedUnit:
    """Everything doctor judges one unit on; the adapter gathers it, nothing here does I/O.

    ``paths`` maps each PATH/LD_LIBRARY_PATH entry and EnvironmentFile= to the ``lstat`` of it
    and each of its existing ancestors (the object first, ``/`` last; missing ones left out).
    """

    config: UnitConfig
    history: History
    environment: dict[str, str]
    """Environment= with every readable EnvironmentFile= applied (files win, as in systemd)."""
    gpus: tuple[int | str, ...] | None
    """The unit's ``gpus`` from gpuguard's configuration."""
    user_uid: int | None
    paths: Mapping[str, tuple[PathFact, ...]] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    """What could not be gathered (systemctl or journalctl failed, an unreadable file)."""
    use: GpuUseFacts | None = None
    """The GPUs the unit's live processes hold against its GPU set; None: NVML could not say."""
    learned: LearnedStarts | None = None
    """The starts gpuguard's daemon saw come up; None: the daemon does not watch the unit."""
    gate_waits: GateWaits | None = None
    """The gate's recorded decisions; None: none recorded (no gate, or none since boot)."""
    health_url: str | None = None
    """The unit's ``health_url`` from gpuguard's configuration."""
    on_engine_dead: str | None = None
    """The unit's ``on_engine_dead`` from gpuguard's configuration; None: not watched."""
    clean_exit_is_death: bool = True
    """``[daemon] clean_exit_is_death``: an exit 0 no stop asked for is a dead engine."""


@dataclass(frozen=True, slots=True)
class LearnedStarts:
    """The starts that came up, as the daemon saved them (core.liveness), and where they are.

    ``ready_s``: seconds from systemd's "Starting" (before the gate's ExecStartPre=) to the
    server's ready line, oldest first; ``problems``: saved starts that could not be read.
    """

    source: str
    ready_s: tuple[float, ...] = ()
    problems: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class GateWaits:
    """How long the gate waited for idle GPUs before it let a start through, and where from.

    ``waited_s``: the decisions that passed after waiting (a fast pass waits for nothing);
    ``refused``: the decisions that refused a start.
    """

    source: str
    waited_s: tuple[float, ...] = ()
    refused: int = 0


@dataclass(frozen=True, slots=True)
class GpuUseFacts:
    """NVML indices: the unit's GPU set as gpuguard resolves it, and what its processes hold."""

    set_indices: frozenset[int] | None
    """None: all GPUs (no config, no CUDA_VISIBLE_DEVICES)."""
    held: frozenset[int]
    gpu_count: int


@dataclass(frozen=True, slots=True)
class HostFacts:
    """What is true of the host rather than one unit."""

    gate_timeout_s: float
    nvidia_devices: bool
    persistenced_running: bool
    persistence_off: tuple[int, ...] | None = None
    """GPUs whose persistence mode NVML reports disabled; None: NVML did not say."""
    mig_on: tuple[int, ...] = ()
    """GPUs with MIG mode on (core/mig.py): gpuguard does not judge them."""
    daemon_sandbox: Mapping[str, str] | None = None
    """gpuguard.service's LoadState, PrivateNetwork and RestrictAddressFamilies as systemd
    loaded them; None: not asked (no unit has a TCP health_url) or systemctl failed."""
