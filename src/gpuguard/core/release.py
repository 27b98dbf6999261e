"""How long the driver takes to release a killed holder's GPU memory, from NVML's readings (pure).

After gpuguard's last signal to a holder, its process exits at once or within the grace, but
the driver frees its GPU memory only when it has torn the process's contexts down: seconds
that decide when the next start finds its GPUs idle, and that no exporter measures. The time
here is from the last signal the reaper sent (``ReapResult.last_signal_s``, the monotonic
clock, read just before the send) to the first NVML reading of that GPU that no longer lists
any process reaped on it (the moment NVML answered its process list), so it is never shorter
than the driver took.
Only positive evidence counts: a holder NVML listed on the GPU in the reading before the reap,
that the reaper saw die after a signal (exited or killed), and later readings of the same GPU
(UUID) that NVML could read. A GPU whose holders stay listed is never counted (past
``WATCH_S`` it is dropped: memory that is never released is ``xid.stuck``'s to explain). The
readings' own interval bounds the precision: a release is seen at the first reading after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from gpuguard.core.mig import mig_on
from gpuguard.core.values import NvmlHealth, ReapOutcome

if TYPE_CHECKING:
    from collections.abc import Iterable

    from gpuguard.core.values import NvmlReading, ReapResult

WATCH_S: Final = 600.0
"""A GPU whose reaped holders NVML still lists this long after the signal is no longer watched."""
_DIED: Final = frozenset({ReapOutcome.EXITED, ReapOutcome.KILLED})


@dataclass(frozen=True, slots=True)
class Release:
    """One GPU that let go of the memory of the holders reaped on it."""

    gpu: int
    uuid: str
    model: str
    driver: str
    seconds: float
    """From the last signal to the first reading without them."""

    @property
    def labels(self) -> tuple[str, str, str, str]:
        """``gpu``, ``UUID``, ``modelName`` (dcgm-exporter's names) and ``driver``."""
        return (str(self.gpu), self.uuid, self.model, self.driver)

    def to_json(self) -> dict[str, Any]:
        """As the gate's decision records it (the daemon counts it from there)."""
        return {
            "gpu": self.gpu,
            "uuid": self.uuid,
            "model": self.model,
            "driver": self.driver,
            "seconds": round(self.seconds, 3),
        }

    @classmethod
    def from_json(cls, item: object) -> Release | None:
        """Back from ``to_json``; None for anything else."""
        if not isinstance(item, dict):
            return None
        gpu, seconds = item.get("gpu"), item.get("seconds")
        texts = [item.get("uuid"), item.get("model"), item.get("driver")]
        if type(gpu) is not int or not 0 <= gpu < 1024 or not labels_ok(texts):
            return None
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
            return None
        if not 0 <= seconds <= WATCH_S:
            return None
        return cls(gpu, str(texts[0]), str(texts[1]), str(texts[2]), float(seconds))


@dataclass(slots=True)
class _Pending:
    gpu: int
    model: str
    driver: str
    pids: set[int] = field(default_factory=set)
    signal_s: float = float("-inf")


class ReleaseWatch:
    """The GPUs of holders the reaper killed, followed through later NVML readings."""

    def __init__(self) -> None:
        """Nothing reaped yet."""
        self._pending: dict[str, _Pending] = {}

    def reaped(self, results: Iterable[ReapResult], before: NvmlReading | None) -> None:
        """Follow the GPUs ``before`` (the reading the reap was planned on) listed them on."""
        if before is None or before.health is not NvmlHealth.OK:
            return
        driver = before.driver_version or "unknown"
        for result in results:
            signal_s = result.last_signal_s
            if result.outcome not in _DIED or signal_s is None:
                continue
            pid = result.target.identity.pid
            for gpu in before.gpus:
                if not gpu.uuid or mig_on(gpu) or all(p.pid != pid for p in gpu.processes):
                    continue
                pending = self._pending.setdefault(
                    gpu.uuid, _Pending(gpu.index, gpu.name or "unknown", driver)
                )
                pending.pids.add(pid)
                pending.signal_s = max(pending.signal_s, signal_s)

    def observe(self, reading: NvmlReading, at_s: float) -> tuple[Release, ...]:
        """The GPUs that ``reading``, taken at monotonic ``at_s``, shows released.

        Each GPU's release is timed to when NVML answered its process list
        (``GpuReading.processes_read_s``), else to ``at_s``; a list read before the last signal
        is no evidence either way.
        """
        if not self._pending or reading.health is not NvmlHealth.OK:
            return ()
        by_uuid = {gpu.uuid: gpu for gpu in reading.gpus if gpu.uuid}
        found: list[Release] = []
        for uuid, pending in list(self._pending.items()):
            if at_s - pending.signal_s > WATCH_S:
                del self._pending[uuid]
                continue
            gpu = by_uuid.get(uuid)
            if gpu is None or gpu.lost or gpu.problem is not None:
                continue  # no evidence either way: wait for a reading that can say
            seen_s = at_s if gpu.processes_read_s is None else gpu.processes_read_s
            if seen_s < pending.signal_s or any(p.pid in pending.pids for p in gpu.processes):
                continue
            del self._pending[uuid]
            found.append(
                Release(pending.gpu, uuid, pending.model, pending.driver, seen_s - pending.signal_s)
            )
        return tuple(found)


def labels_ok(values: list[Any]) -> bool:
    """Whether ``values`` can be label values: short strings (from our own records)."""
    return all(isinstance(value, str) and len(value) <= 128 for value in values)
