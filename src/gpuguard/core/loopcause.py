"""Why a unit's runs fail, as far as the evidence goes: the cause of a restart loop (pure).

``judge_cause`` weighs the current series of failed runs (core/loopruns.py) against what an
inventory of the unit's GPUs showed (``GpuEvidence``, gathered by the caller: the detector never
looks itself): a GPU that needs a reset first, because no kill can help then; stale holders or
a failed run's GPU out-of-memory line; a server that does not fit as configured; "not GPU
related" only when the GPUs are idle and two or more failures ended the same way; otherwise
unknown. This module owns the ``Cause`` and its one-line detail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from gpuguard.core.loopruns import abbrev, cut
from gpuguard.core.oomdevice import describe_device
from gpuguard.core.startfailure import FailureClass, judge
from gpuguard.core.values import StrEnum

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gpuguard.core.loopruns import Run

_SHOWN_HOLDERS: Final = 3
# One failure says nothing about the next: "not GPU related" needs the same failure repeated.
_PATTERN_MIN_FAILURES: Final = 2


class Cause(StrEnum):
    """Why a unit's runs fail, as far as the evidence goes."""

    GPU_NEEDS_RESET = "gpu-needs-reset"
    """A GPU of the unit's set needs a reset or reboot: no kill or restart can free it."""
    STALE_GPU_HOLDERS = "stale-gpu-holders"
    """Processes from earlier runs hold the GPUs, or the server said GPU memory was taken."""
    NOT_GPU_RELATED = "not-gpu-related"
    """Every failure looks the same and the GPUs are idle: a config or code problem."""
    DOES_NOT_FIT = "does-not-fit"
    """The runs ran out of GPU memory with nothing else on the unit's GPUs: the server does not
    fit as configured (the detail names the setting); no reap or restart helps."""
    UNKNOWN = "unknown"
    """Not enough evidence either way."""


@dataclass(frozen=True, slots=True)
class GpuEvidence:
    """What an inventory of the unit's GPUs showed when judging; the detector never looks itself.

    ``stale_holders``: one phrase per holder attributed to an earlier invocation (or left over
    outside it), e.g. "PID 123 (sglang::scheduler_TP0) from an earlier invocation holds GPU 0,
    20480 MiB". ``gpus_busy``: some GPU of the unit's set is not idle (any holder, stale or not,
    or memory still in use without a process: a driver still tearing down). ``needs_reset``: one
    phrase per GPU of the set that needs a reset, e.g. "GPU 1: a memory row remap is pending".
    """

    stale_holders: tuple[str, ...] = ()
    gpus_busy: bool = False
    needs_reset: tuple[str, ...] = ()
    cuda_devices: tuple[str, ...] | None = None
    """What each CUDA device the unit sees is (oomdevice.device_phrases): device k is entry k;
    None when the numbering cannot be told, with the reason in ``cuda_note``."""
    cuda_note: str | None = None
    holder_pids: frozenset[int] = frozenset()
    """The PIDs that hold a GPU of the unit's set now (any owner): a left-over named at a start
    that is not among them holds nothing the next start needs."""
    gate_refused: tuple[str, ...] = ()
    """What holds the unit's GPUs now, one phrase each, when its gate refused the last start
    (core.gate.refusal): the gate's refusals are GPU evidence, the server never ran to say so.
    Empty when the gate did not refuse, or the GPUs are free now."""
    unreadable: str | None = None
    """Why the GPUs cannot be read at all (NVML missing, timed out, refused: its reason); None
    when they can. Busy or idle is then unknown, and the cause says so rather than guess."""


def judge_cause(failed: Sequence[Run], gpu: GpuEvidence | None) -> tuple[Cause, str]:
    """The cause and one line on it, from the current series of failures and the inventory."""
    if gpu is not None and gpu.needs_reset:
        return Cause.GPU_NEEDS_RESET, "; ".join(gpu.needs_reset)
    gpu_cause = _gpu_cause(failed, gpu)
    if gpu_cause is not None:
        return gpu_cause
    doubt = _doubt(failed, gpu)
    if doubt is not None:
        return Cause.UNKNOWN, doubt
    return Cause.NOT_GPU_RELATED, (
        f"every failed run ended the same way, {failed[-1].describe_failure()}, with the "
        f"GPUs idle and no GPU out-of-memory output"
    )


def _doubt(failed: Sequence[Run], gpu: GpuEvidence | None) -> str | None:
    """Why the failures cannot be called "not GPU related", or None when they can."""
    if not failed:
        return "no failed run to explain"
    unseen = _unseen(gpu)
    if unseen is not None:
        return unseen
    if len(failed) < _PATTERN_MIN_FAILURES:
        return f"one failure, {failed[0].describe_failure()}, is not a pattern yet"
    if len({run.way() for run in failed}) > 1:
        ways = ", ".join(sorted({run.describe_failure() for run in failed}))
        return f"the failed runs ended in different ways: {ways}"
    return None


def _unseen(gpu: GpuEvidence | None) -> str | None:
    """What the inventory cannot rule out: none taken, GPUs unreadable, or busy; else None."""
    if gpu is None:
        return "no GPU inventory to rule out stale holders"
    if gpu.unreadable is not None:
        return f"the GPUs cannot be read ({gpu.unreadable}): whether anything holds them is unknown"
    if gpu.gpus_busy:
        return "the GPUs are busy, but no holder is from an earlier run"
    return None


def _gpu_cause(failed: Sequence[Run], gpu: GpuEvidence | None) -> tuple[Cause, str] | None:
    """Stale holders named by the inventory, else GPU OOM output of a failed run, else None."""
    if gpu is not None and gpu.stale_holders:
        shown = "; ".join(gpu.stale_holders[:_SHOWN_HOLDERS])
        more = len(gpu.stale_holders) - _SHOWN_HOLDERS
        return Cause.STALE_GPU_HOLDERS, shown + (f"; and {more} more" if more > 0 else "")
    if gpu is not None and gpu.gate_refused and gpu.unreadable is None:
        shown = "; ".join(gpu.gate_refused[:_SHOWN_HOLDERS])
        more = len(gpu.gate_refused) - _SHOWN_HOLDERS
        return Cause.STALE_GPU_HOLDERS, (
            f"the gate refused the last start and the GPUs are still held: {shown}"
            + (f"; and {more} more" if more > 0 else "")
        )
    oom_runs = [run for run in failed if run.oom]
    if not oom_runs:
        return None
    run = oom_runs[-1]
    detail = f"run {abbrev(run)} printed: {cut(run.oom[0].message)}"
    device = run.oom[0].device
    if device is not None and gpu is None:
        detail += f" (CUDA device {device} as the server numbers its GPUs)"
    elif device is not None and gpu is not None:
        detail += f"; {describe_device(device, gpu.cuda_devices, gpu.cuda_note)}"
    if gpu is None:
        return Cause.STALE_GPU_HOLDERS, detail
    return _judged_cause(oom_runs, gpu, detail)


def _judged_cause(oom_runs: Sequence[Run], gpu: GpuEvidence, detail: str) -> tuple[Cause, str]:
    """What the start-failure lines of the runs mean, with the inventory to decide memory.

    One out-of-memory run with idle GPUs now may have met a holder that has gone since: it takes
    two to say the server does not fit.
    """
    failure, knob = _failure_of(oom_runs[-1])
    judged = judge(failure, knob, foreign_holders=gpu.gpus_busy)
    if judged.failure is FailureClass.HARDWARE:
        return Cause.GPU_NEEDS_RESET, f"{detail}: {judged.advice}"
    enough = failure is not FailureClass.MEMORY or len(oom_runs) >= _PATTERN_MIN_FAILURES
    if judged.failure is FailureClass.DOES_NOT_FIT and enough:
        return Cause.DOES_NOT_FIT, f"{detail}: {judged.advice}"
    return Cause.STALE_GPU_HOLDERS, detail + " (no stale holder found now)"


def _failure_of(run: Run) -> tuple[FailureClass, str | None]:
    """The gravest class a run's start-failure lines show, and the knob they name.

    Hardware first, then a line naming the server's own sizing, then memory taken by others.
    """
    order = (
        FailureClass.HARDWARE,
        FailureClass.DOES_NOT_FIT,
        FailureClass.HELD_BY_OTHERS,
        FailureClass.MEMORY,
    )
    failures = [event.failure or FailureClass.MEMORY for event in run.oom]
    worst = min(failures, key=order.index)
    knob = next((e.knob for e in run.oom if e.knob and e.failure is worst), None)
    knob = knob or next((e.knob for e in run.oom if e.knob), None)
    return worst, knob
