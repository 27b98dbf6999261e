"""The kill-to-release times as a Prometheus histogram: counts per GPU, kept across restarts.

``core.release`` measures each release; this keeps them as bucket counts per label set (GPU
index, UUID, model, driver: bounded by the host's GPUs), carried in the daemon's snapshot so
that ``gpuguard status --prometheus`` prints the daemon's, and draws the metric family
``core.metrics`` exports. Nothing here keeps a sample or a foreign string beyond 128 characters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from prometheus_client.core import HistogramMetricFamily

from gpuguard.core.release import labels_ok

if TYPE_CHECKING:
    from gpuguard.core.release import Release

BUCKETS_S: Final = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Upper bounds of the histogram's buckets: a context torn down at once up to a driver stuck
for minutes (then ``+Inf``)."""
_KEPT_SERIES: Final = 64
"""Label sets kept: one per GPU, and a GPU keeps its UUID, model and driver."""


class ReleaseTimes:
    """The histogram of release times per GPU, as the metrics export it (counts, no samples)."""

    def __init__(self) -> None:
        """No release seen."""
        self.series: dict[tuple[str, str, str, str], tuple[list[int], float]] = {}
        """Per label set: the count in each bucket (not cumulative, ``+Inf`` last) and the sum."""

    def add(self, release: Release) -> None:
        """Count one release (a label set beyond ``_KEPT_SERIES`` is not counted)."""
        key = release.labels
        if key not in self.series and len(self.series) >= _KEPT_SERIES:
            return
        counts, total = self.series.get(key, ([0] * (len(BUCKETS_S) + 1), 0.0))
        at = next((i for i, bound in enumerate(BUCKETS_S) if release.seconds <= bound), -1)
        counts[at] += 1
        self.series[key] = (counts, total + release.seconds)

    def to_json(self) -> list[list[Any]]:
        """Rows of the four labels, the bucket counts and the sum."""
        return [[*key, counts, round(total, 3)] for key, (counts, total) in self.series.items()]

    @classmethod
    def from_json(cls, rows: object) -> ReleaseTimes:
        """Back from ``to_json``; a malformed row is left out."""
        times = cls()
        for row in rows if isinstance(rows, list) else ():
            if not (isinstance(row, list) and len(row) == 6 and labels_ok(row[:4])):
                continue
            counts, total = row[4], row[5]
            if (
                isinstance(counts, list)
                and len(counts) == len(BUCKETS_S) + 1
                and all(type(n) is int and n >= 0 for n in counts)
                and isinstance(total, (int, float))
                and not isinstance(total, bool)
                and total >= 0
                and len(times.series) < _KEPT_SERIES
            ):
                times.series[row[0], row[1], row[2], row[3]] = (list(counts), float(total))
        return times


def release_family(times: ReleaseTimes) -> HistogramMetricFamily:
    """The histogram as ``core.metrics`` exports it: dcgm-exporter's GPU labels and the driver."""
    family = HistogramMetricFamily(
        "gpuguard_holder_release_seconds",
        "From the last signal to a reaped holder until NVML no longer lists it on the GPU.",
        labels=["gpu", "UUID", "modelName", "driver"],
    )
    bounds = [*(f"{b:g}" for b in BUCKETS_S), "+Inf"]
    for labels, (counts, total) in sorted(times.series.items()):
        cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
        family.add_metric(list(labels), list(zip(bounds, cumulative, strict=True)), total)
    return family
