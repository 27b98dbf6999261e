"""The release log: its records, the one summary status, explain and the metrics share."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from gpuguard.core import metrics, timeline
from gpuguard.core.release import Release
from gpuguard.core.releaselog import KEPT, UNITS, Logged, appended, parse, summarize
from gpuguard.core.tally import HISTORY_KEPT, Tally

if TYPE_CHECKING:
    from typing import Any

UUID = "GPU-68b68185-2b74-c34f-ec63-aa1cb3d76dd0"
BOOT = "69ee3ba640554a179218f7b9a5f085e1"
UNIT = "sglang.service"


def logged(
    seconds: float,
    *,
    gpu: int = 0,
    at: float = 1_795_000_000.0,
    by: str = "reap",
    unit: str | None = UNIT,
    monotonic_s: float | None = 500.0,
) -> Logged:
    """One record of an H200 released ``seconds`` after the signal, at wall time ``at``."""
    release = Release(gpu, f"{UUID}{gpu}", "NVIDIA H200", "550.54.15", seconds)
    return Logged(release, by, unit, at, BOOT, monotonic_s)


def test_last_is_the_newest_and_typical_the_median_per_gpu() -> None:
    """Per GPU: the newest record is "last", the median of its records "typical"."""
    records = [
        logged(1.0, at=10.0),
        logged(3.0, at=30.0, by="daemon"),
        logged(2.0, at=20.0),
        logged(9.0, gpu=1, at=5.0, by="gate"),
    ]
    zero, one = summarize(records)
    assert (zero.gpu, zero.last.release.seconds, zero.last.by, zero.typical_s, zero.count) == (
        0,
        3.0,
        "daemon",
        2.0,
        3,
    )
    assert (one.gpu, one.last.release.seconds, one.typical_s, one.count) == (1, 9.0, 9.0, 1)
    assert [g.gpu for g in summarize(records, frozenset({1}))] == [1]
    assert summarize(records, frozenset()) == ()
    assert zero.in_words() == (
        "GPU 0 released reaped memory after 3.000 s last time (daemon, 1970-01-01 00:00:30 UTC), "
        "typically 2.000 s (3 releases logged)"
    )


def test_a_record_survives_its_json_and_foreign_shapes_do_not() -> None:
    """Records round-trip; a bad reaper, unit, time or stamp makes a record unreadable.

    A time that parses but that no later print could show would crash the daemon, the gate and
    status on every read of the log, so it is refused here, where the record is read.
    """
    record = logged(1.234, monotonic_s=812.5)
    document = json.loads(json.dumps([record.to_json()]))
    assert parse(document) == (record,)
    good: dict[str, Any] = record.to_json()
    bad = [
        {**good, "by": "someone"},
        {**good, "unit": ["x"]},
        {**good, "unit": "u" * 256},
        {**good, "unit": "a b.service"},
        {**good, "time": "yesterday"},
        {**good, "time": "2026-12-02T03:00:00"},  # no offset: not ours
        {**good, "time": "0001-01-01T00:00:00+01:00"},  # year 0 in UTC: no print could show it
        {**good, "time": "9999-12-31T23:59:59-01:00"},  # year 10000 in UTC
        {**good, "time": "1969-12-31T23:59:59+00:00"},  # before the epoch: none of ours
        {**good, "monotonic_s": -1},
        {**good, "monotonic_s": True},
        {**good, "boot_id": 7},
        {**good, "seconds": "1"},
        "not a record",
    ]
    assert parse(bad) == ()
    long_unit = {**good, "unit": "u" * 247 + ".service"}  # systemd's longest name is a unit
    assert [r.unit for r in parse([long_unit])] == [long_unit["unit"]]
    assert parse({"not": "a list"}) == ()


def test_the_log_keeps_its_newest_records_within_what_the_counters_remember() -> None:
    """Appending past KEPT drops the oldest; KEPT fits the metrics' remembered history."""
    document: list[dict[str, Any]] = []
    for i in range(KEPT + 5):
        document = appended(document, [logged(float(i), at=float(i))])
    kept = parse(document)
    assert len(kept) == KEPT
    assert kept[0].release.seconds == 5.0
    assert KEPT <= HISTORY_KEPT


def test_a_busy_unit_never_pushes_another_units_records_out() -> None:
    """The log keeps the newest KEPT of each unit: a hundred reaps of one leave the other's."""
    document = appended([], [logged(7.0, unit="quiet.service", at=1.0)])
    for i in range(100):
        document = appended(document, [logged(float(i), unit="busy.service", at=2.0 + i)])
    kept = parse(document)
    assert [r.release.seconds for r in kept if r.unit == "quiet.service"] == [7.0]
    busy = [r.release.seconds for r in kept if r.unit == "busy.service"]
    assert busy == [float(i) for i in range(100 - KEPT, 100)]


def test_the_log_keeps_the_units_reaped_for_last() -> None:
    """Past UNITS units, the one whose newest record is the oldest goes whole (a bounded file)."""
    document: list[dict[str, Any]] = []
    for i in range(UNITS):
        document = appended(document, [logged(float(i), unit=f"u{i}.service", at=float(i))])
    document = appended(document, [logged(99.0, unit="u0.service", at=99.0)])
    document = appended(document, [logged(98.0, unit="new.service", at=100.0)])
    kept = parse(document)
    units = {r.unit for r in kept}
    assert len(units) == UNITS
    assert "u1.service" not in units
    assert [r.release.seconds for r in kept if r.unit == "u0.service"] == [0.0, 99.0]


def test_counting_across_units_sees_each_new_record_once() -> None:
    """With a unit at its KEPT and another's records between, each new reap counts once."""
    tally = Tally()
    document: list[dict[str, Any]] = []
    for i in range(KEPT):
        document = appended(document, [logged(1.0, unit="a.service", at=float(i))])
        document = appended(document, [logged(1.0, unit="b.service", at=float(i))])
    tally.baseline_logged(parse(document))
    for i in range(3):
        document = appended(document, [logged(2.0, unit="a.service", at=100.0 + i)])
        tally.count_logged(parse(document))
    [(counts, total)] = tally.releases.series.values()
    assert (sum(counts), total) == (3, 6.0)


def test_the_daemon_counts_only_new_reap_records_into_the_histogram() -> None:
    """Reap's records count once; the daemon's and the gate's are counted where they come from."""
    tally = Tally()
    old = logged(1.0, at=1.0)
    tally.baseline_logged([old])
    records = [old, logged(2.0, at=2.0), logged(3.0, at=3.0, by="daemon"), logged(4.0, by="gate")]
    tally.count_logged(records)
    tally.count_logged(records)
    [(counts, total)] = tally.releases.series.values()
    assert (sum(counts), total) == (1, 2.0)


def _gauges(records: list[Logged]) -> dict[str, dict[tuple[str, ...], float]]:
    drawn = metrics._release_families(records)
    return {
        family.name: {tuple(s.labels[k] for k in ("gpu", "UUID")): s.value for s in family.samples}
        for family in drawn
    }


def test_the_gauges_are_the_summary() -> None:
    """The last and typical gauges per GPU are summarize's numbers, rounded to the millisecond."""
    records = [logged(1.0, at=1.0), logged(2.0, at=2.0), logged(1.2344, at=3.0)]
    [gpu] = summarize(records)
    found = _gauges(records)
    key = ("0", f"{UUID}0")
    assert found["gpuguard_holder_release_last_seconds"] == {
        key: round(gpu.last.release.seconds, 3)
    }
    assert found["gpuguard_holder_release_typical_seconds"] == {key: round(gpu.typical_s, 3)}


def _started(monotonic_s: float, unit: str = UNIT) -> dict[str, object]:
    return {
        "__CURSOR": f"s=1;m={monotonic_s}",
        "__MONOTONIC_TIMESTAMP": str(int(monotonic_s * 1e6)),
        "__REALTIME_TIMESTAMP": str(int((1_795_000_000 + monotonic_s) * 1e6)),
        "_BOOT_ID": BOOT,
        "_PID": "1",
        "_UID": "0",
        "_SYSTEMD_CGROUP": "/init.scope",
        "MESSAGE_ID": "39f53479d3a045ac8e11786248231fbf",
        "MESSAGE": f"Started {unit}.",
        "UNIT": unit,
        "INVOCATION_ID": "61fb7cdcf750460bb7b6a7da661d6d95",
        "_TRANSPORT": "journal",
        "JOB_TYPE": "start",
        "JOB_RESULT": "done",
    }


def test_explain_puts_the_units_releases_on_its_timeline_where_the_memory_went() -> None:
    """Only the unit's releases within the journal read (its boot, from its first row) are rows."""
    shown = logged(1.5, monotonic_s=120.0)
    others = [
        logged(2.0, unit="other.service", monotonic_s=130.0),
        logged(2.0, unit=None, monotonic_s=130.0),
        logged(2.0, monotonic_s=50.0),  # before the journal read
        logged(2.0, monotonic_s=None),  # no boot stamp
    ]
    entries = [_started(100.0), _started(140.0)]
    told = timeline.build(entries, UNIT, releases=[shown, *others])
    assert [row.kind for row in told.rows] == ["started", "gpu-released", "started"]
    row = told.rows[1]
    assert row.monotonic_s == 120.0
    assert row.source == timeline.GPUGUARD
    assert "reaped by reap released 1.500 s after the last signal" in row.text
    [said] = told.story.released
    assert said == summarize([shown])[0].in_words()
    assert not told.gpuguard_seen  # the log is not a line of the journal
    assert timeline.build(entries, UNIT).story.released == ()
