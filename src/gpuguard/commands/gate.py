"""``gpuguard gate``: the fast path on idle GPUs, else reap the unit's stale holders and wait."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from gpuguard.adapters import configfile, daemonsnapshot, nvml, procfs, state, unitfacts
from gpuguard.commands.context import (
    asker,
    result_json,
    unit_plan,
    unit_settings,
    unknown_unit,
    viewer_uid,
)
from gpuguard.core.escaping import escape
from gpuguard.core.gate import run as gaterun
from gpuguard.core.gpuset import cuda_view, resolve_gpu_set
from gpuguard.core.health import reset_reasons
from gpuguard.core.idle import is_idle
from gpuguard.core.values import MIB, NvmlHealth

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from gpuguard.commands.arguments import GateArgs
    from gpuguard.commands.output import Said
    from gpuguard.config import Settings
    from gpuguard.core.gate.auth import Caller
    from gpuguard.core.gate.run import GateOutcome
    from gpuguard.core.gpuset import GpuSet
    from gpuguard.core.inventory import Inventory
    from gpuguard.core.logger import Logger
    from gpuguard.core.release import Release
    from gpuguard.core.values import NvmlReading, ReapResult, ReapTarget

# The gate's verdict is one journal entry; journald splits lines longer than LineMax (48K).
_GATE_LINE_LIMIT = 8192


@dataclass(frozen=True, slots=True)
class GateVerdict:
    """The gate's decision as recorded for ``gpuguard status`` and told to the unit's journal."""

    outcome: GateOutcome
    gpu_set: GpuSet
    problems: tuple[str, ...]
    """What could not be recorded (the unit's GPU variables, the decision); the start is
    decided all the same."""

    @property
    def exit_status(self) -> int:
        """0 allows the start; 1 refuses it (systemd fails the start, Restart= may try again)."""
        return 0 if self.outcome.passed else 1

    @property
    def notices(self) -> tuple[str, ...]:
        """The problems, then the verdict in one line (escaped, cut below journald's LineMax)."""
        line = escape(f"{self.outcome.message} [{self.gpu_set.describe()}]", _GATE_LINE_LIMIT)
        return (*self.problems, f"gpuguard gate: {line}")

    def to_text(self) -> str:
        """Nothing on standard output: the verdict goes to standard error, the journal."""
        return ""

    def to_json(self) -> None:
        """The gate has no --json."""
        return


def fast_path(
    config: Path | None, args: GateArgs, caller: Caller | None
) -> tuple[GateVerdict | None, NvmlReading | None]:
    """Exit 0 at once when the unit's GPUs are idle, without pydantic, structlog or /proc.

    Uses the validated configuration cached by an earlier full load (configfile) and NVML alone
    (idle is a matter of memory, see idle.is_idle). Returns None whenever anything needs
    the full path: no cache, run outside the unit, NVML not healthy, a GPU not idle or needing
    a reset; the NVML reading taken on the way is handed on so the full path does not read it
    again.
    """
    started = time.monotonic()
    cached = configfile.load_validated(config)
    if cached is None:
        return None, None
    runtime_dir = Path(cached["runtime_dir"])
    who = asker(caller)
    environment, problem = unitfacts.own_environment(who, args.unit, runtime_dir)
    if environment is None:
        return None, None
    unit = cached["units"].get(args.unit) or {}
    library = cached["nvml_library"]
    reading = nvml.read_gpus(float(cached["nvml_timeout_s"]), library and Path(library))
    if reading.health not in (NvmlHealth.OK, NvmlHealth.DRIVER_TOO_OLD):
        return None, reading
    gpu_set = resolve_gpu_set(unit.get("gpus"), environment, reading.gpus)
    present = {gpu.index for gpu in reading.gpus}
    missing = gpu_set.indices is not None and not gpu_set.indices <= present
    if missing or daemonsnapshot.lists_reset_xids(
        runtime_dir, args.unit
    ):  # the full path weighs them
        return None, reading
    threshold = int(cached["idle_threshold_mib"]) * MIB
    for gpu in reading.gpus:
        wanted = gpu_set.indices is None or gpu.index in gpu_set.indices
        # Idle but needing a reset is no start either: the full path refuses it at once.
        if wanted and (not is_idle(gpu, threshold) or reset_reasons(gpu)):
            return None, reading
    outcome = gaterun.outcome(args.unit, time.monotonic() - started, fast_path=True)
    problems = () if problem is None else (problem,)
    return _finish_gate(runtime_dir, who, outcome, gpu_set, problems), reading


def run(
    settings: Settings,
    args: GateArgs,
    reading: NvmlReading | None,
    caller: Caller | None,
    say: Callable[[str], None],
) -> GateVerdict | Said:
    """Reap the unit's stale holders and wait until its GPUs are idle; the verdict says if.

    While it waits, ``say`` gets a line per blocker every 10 s (the unit's journal reads them).
    """
    # The full path's modules, imported only here: the in-process fast path pays ~20 ms less.
    from gpuguard.adapters import containerstop, inventory, logs, reaper  # noqa: PLC0415
    from gpuguard.core.release import ReleaseWatch  # noqa: PLC0415

    unknown = unknown_unit(settings, args.unit, "gate", force=args.force)
    if unknown is not None:
        return unknown
    first = inventory.gather(settings, reading)
    planned = unit_plan(settings, args.unit, args.scope, caller, first.nvml.gpus)
    timeout = args.timeout if args.timeout is not None else settings.gate_timeout_s
    if caller is not None and not caller.is_operator:
        timeout = min(timeout, settings.gate_timeout_s)  # a unit may not hold a slot for longer
    grace = args.grace if args.grace is not None else settings.reap_grace_s
    pending = [first]
    latest = [first]
    watch = ReleaseWatch()
    released: list[tuple[Release, float]] = []

    def gather() -> Inventory:
        """The next inventory; the GPUs it shows released (ReleaseWatch.observe times them)."""
        begun = time.monotonic()
        latest[0] = pending.pop() if pending else inventory.gather(settings)
        released.extend((release, begun) for release in watch.observe(latest[0].nvml, begun))
        return latest[0]

    def logger() -> Logger:
        logs.configure_logging(json=False)  # structlog loads only when something is logged
        return logs.get_logger().bind(unit=args.unit, command="gate")

    def reap(targets: Sequence[ReapTarget]) -> tuple[ReapResult, ...]:
        results = reaper.reap(targets, grace_s=grace, logger=logger())
        watch.reaped(results, latest[0].nvml)  # planned on the latest inventory
        return results

    def report(line: str) -> None:
        say(f"gpuguard gate: {args.unit}: {escape(line, _GATE_LINE_LIMIT)}")

    runtime_dir = settings.runtime_dir
    outcome = gaterun.run_gate(
        gaterun.GateSettings(
            planned.request,
            settings.idle_threshold_mib * 1024 * 1024,
            timeout,
            viewer_uid=viewer_uid(caller),
            xid_faults=daemonsnapshot.reset_xids(runtime_dir, args.unit)
            if planned.automatic
            else (),
            xid_claims=daemonsnapshot.xid_claims(runtime_dir),
            clock_ticks=procfs.clock_ticks_per_second(),
            oom=oom_gpu(
                daemonsnapshot.oom_device(runtime_dir, args.unit), planned.environment, first
            )
            if planned.automatic
            else None,
        ),
        gather,
        reap,
        time.monotonic,
        time.sleep,
        report=report,
        containers=containerstop.for_unit(
            planned.request,
            unit_settings(settings, args.unit).container,
            grace_s=grace,
            dry_run=False,
            logger=logger,
        ),
    )
    logged = _log_releases(runtime_dir, args.unit, released)
    return _finish_gate(
        runtime_dir,
        asker(caller),
        outcome,
        planned.gpu_set,
        (*planned.notices, *logged),
        tuple(release for release, _ in released),
    )


def _log_releases(
    runtime_dir: Path, unit: str, released: Sequence[tuple[Release, float]]
) -> tuple[str, ...]:
    """Append the gate's measured releases to the release log; a notice when that fails."""
    from gpuguard.adapters import releaselog  # noqa: PLC0415 - see the package doc

    try:
        releaselog.record(runtime_dir, releaselog.logged(released, by="gate", unit=unit))
    except OSError as err:
        return (f"gpuguard gate: cannot record the release times in {runtime_dir}: {err}",)
    return ()


def oom_gpu(
    device: int | None, environment: dict[str, str], found: Inventory
) -> tuple[int, int] | None:
    """The GPU the unit's last failed run ran out of memory on: (CUDA device, NVML index).

    The device comes from the unit's output (the running daemon read it); the unit's own
    CUDA_VISIBLE_DEVICES maps it, and a number past the unit's GPUs maps to nothing.
    """
    if device is None:
        return None
    indices = cuda_view(environment, found.nvml.gpus).indices
    if indices is None or device >= len(indices):
        return None
    return device, indices[device]


def _finish_gate(  # noqa: PLR0913, PLR0917 - the decision, who asked, and what it found
    runtime_dir: Path,
    who: Caller,
    outcome: GateOutcome,
    gpu_set: GpuSet,
    problems: tuple[str, ...],
    released: tuple[Release, ...] = (),
) -> GateVerdict:
    """Record the decision for `gpuguard status`; the verdict, saying if that failed.

    The record says who asked: its PID, UID, and whether systemd named it the unit's control
    process (None: gpuguard run in process, not asked; the server serves only the control
    process of a unit, and operators: ``operator``).
    """
    record = {
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "unit": outcome.unit,
        "caller": {
            "pid": who.pid,
            "uid": who.uid,
            "control_process": who.control,
            "operator": who.is_operator,
        },
        "gpu_set": gpu_set.describe(),
        "result": "passed" if outcome.passed else "refused",
        "fast_path": outcome.fast_path,
        "waited_s": round(outcome.waited_s, 2),
        "reaped": [result_json(r) for r in outcome.reaped],
        "spared": [
            {"pid": d.holder.pid, "command": d.holder.command, "reason": d.reason}
            for d in outcome.spared
        ],
        "blockers": list(outcome.blockers),
        "released": [release.to_json() for release in released],
    }
    try:
        state.record_gate_decision(runtime_dir, outcome.unit, record)
    except OSError as err:
        unrecorded = f"gpuguard gate: cannot record the decision in {runtime_dir}: {err}"
        return GateVerdict(outcome, gpu_set, (*problems, unrecorded))
    return GateVerdict(outcome, gpu_set, problems)
