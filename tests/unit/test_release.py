"""Which NVML readings make a kill-to-release time, and how the histogram keeps them."""

from __future__ import annotations

from gpuguard.core.release import WATCH_S, Release, ReleaseWatch
from gpuguard.core.releasetimes import BUCKETS_S, ReleaseTimes
from gpuguard.core.tally import Tally
from gpuguard.core.values import (
    GpuReading,
    MigMode,
    NvmlHealth,
    NvmlProcess,
    NvmlReading,
    ProcessIdentity,
    ProcessListKind,
    ReapOutcome,
    ReapResult,
    ReapTarget,
)

UUID = "GPU-68b68185-2b74-c34f-ec63-aa1cb3d76dd0"


def reading(*pids: int, health: NvmlHealth = NvmlHealth.OK, **gpu: object) -> NvmlReading:
    """One H200 listing ``pids``."""
    processes = tuple(NvmlProcess(pid, 1 << 30, ProcessListKind.COMPUTE) for pid in pids)
    one = GpuReading(0, "NVIDIA H200", UUID, processes=processes, **gpu)  # type: ignore[arg-type]
    return NvmlReading(health, driver_version="550.54.15", gpus=(one,))


def reaped(pid: int, at_s: float | None, outcome: ReapOutcome = ReapOutcome.KILLED) -> ReapResult:
    """The reaper's result for ``pid``, its last signal at ``at_s``."""
    target = ReapTarget(ProcessIdentity(pid, 1), 1, "python", None, "test")
    return ReapResult(target, outcome, ("SIGTERM", "SIGKILL"), None, at_s)


def test_the_first_reading_without_the_reaped_holders_ends_the_time() -> None:
    """Two holders on one GPU: timed from the later signal to the reading listing neither."""
    watch = ReleaseWatch()
    watch.reaped([reaped(10, 100.0), reaped(11, 101.0)], reading(10, 11, 12))
    assert watch.observe(reading(11, 12), 102.0) == ()
    assert watch.observe(reading(12), 104.5) == (Release(0, UUID, "NVIDIA H200", "550.54.15", 3.5),)
    assert watch.observe(reading(), 106.0) == ()  # counted once


def test_a_release_is_timed_when_nvml_answered_the_gpus_process_list() -> None:
    """The GPU's own stamp, not the gather's start: a worker that started late is not a fast GPU.

    A list answered before the last signal says nothing of the release, whatever the gather's
    start; the list answered after it ends the time.
    """
    watch = ReleaseWatch()
    watch.reaped([reaped(10, 100.0)], reading(10))
    assert watch.observe(reading(processes_read_s=99.9), 100.1) == ()
    assert watch.observe(reading(processes_read_s=101.25), 101.0) == (
        Release(0, UUID, "NVIDIA H200", "550.54.15", 1.25),
    )


def test_no_evidence_no_time() -> None:
    """Not listed before, gone before any signal, unreadable or MIG GPUs are never timed."""
    watch = ReleaseWatch()
    watch.reaped([reaped(10, 100.0)], reading(99))
    watch.reaped([reaped(11, None, ReapOutcome.GONE)], reading(11))
    watch.reaped([reaped(12, 100.0)], reading(12, mig=MigMode(current=True, pending=True)))
    assert watch.observe(reading(), 101.0) == ()
    watch.reaped([reaped(13, 100.0, ReapOutcome.UNKILLABLE)], reading(13))
    assert watch.observe(reading(), 101.0) == ()


def test_a_reading_that_cannot_say_waits_and_a_release_never_seen_is_dropped() -> None:
    """NVML failing or the GPU lost says nothing; still listed past WATCH_S: dropped, uncounted."""
    watch = ReleaseWatch()
    watch.reaped([reaped(10, 100.0)], reading(10))
    assert watch.observe(reading(health=NvmlHealth.TIMED_OUT), 101.0) == ()
    assert watch.observe(reading(lost=True), 102.0) == ()
    assert watch.observe(reading(10), 100.0 + WATCH_S - 1) == ()
    assert watch.observe(reading(10), 100.0 + WATCH_S + 1) == ()
    assert watch.observe(reading(), 100.0 + WATCH_S + 2) == ()


def test_the_histogram_buckets_and_survives_its_json() -> None:
    """Counts land in the first bucket that holds them; to_json and from_json agree."""
    times = ReleaseTimes()
    for seconds in (0.1, 1.7, 1.9, 900.0):
        times.add(Release(0, UUID, "NVIDIA H200", "550.54.15", seconds))
    ((counts, total),) = times.series.values()
    assert counts[BUCKETS_S.index(0.25)] == 1
    assert counts[BUCKETS_S.index(2.0)] == 2
    assert counts[-1] == 1  # +Inf
    assert total == 903.7
    assert ReleaseTimes.from_json(times.to_json()).series == times.series
    assert ReleaseTimes.from_json([["0", UUID, "x", "y", [1, 2], 1.0], "junk"]).series == {}


def test_the_gates_recorded_releases_are_counted_once_and_foreign_shapes_are_not() -> None:
    """A new gate decision's releases reach the histogram; a malformed entry is left out."""
    tally = Tally()
    tally.baseline("gate/a.service", [])
    good = Release(1, UUID, "NVIDIA H200", "550.54.15", 2.5).to_json()
    decision = {"result": "passed", "released": [good, {"gpu": "1"}, {**good, "seconds": -1}]}
    tally.count_gate("a.service", [decision])
    tally.count_gate("a.service", [decision])
    ((counts, total),) = tally.releases.series.values()
    assert (sum(counts), total) == (1, 2.5)
