"""Which kernel Xids stop a unit: class, time since the unit last came up, and its GPU set."""

from __future__ import annotations

import time

from builders import gpu, lost_gpu

from gpuguard.core.events import EventKind, UnitEvent
from gpuguard.core.xid.events import XidEvent
from gpuguard.core.xid.faults import (
    MAX_FAULTS,
    FaultLog,
    LastUp,
    XidFault,
    blockers,
    counting,
    from_records,
    needs_reset,
    to_record,
)


def xid(code: int, at_s: float, pci: str = "0000:1a:00") -> XidEvent:
    """A parsed kernel Xid at journal monotonic time ``at_s``."""
    return XidEvent(pci, code, None, None, "", at_s, 1.7e9 + at_s, "b" * 32, f"c{code}@{at_s}")


def unit_event(
    kind: EventKind, at_s: float, invocation: str, *, job_type: str | None = None
) -> UnitEvent:
    """A trusted PID 1 event of the unit."""
    return UnitEvent(
        kind=kind,
        unit="sglang.service",
        monotonic_s=at_s,
        realtime_s=None,
        cursor=f"{kind}@{at_s}",
        boot_id="b" * 32,
        invocation_id=invocation,
        job_type=job_type,
    )


def test_reset_and_reboot_classes_need_a_reset_application_faults_do_not() -> None:
    """Per the catalogue: 48, 79, 119 yes; 13, 31, 43 (application), 63 (informational) no.

    An unknown code is not assumed to need a reset either: NVML health judges it.
    """
    assert all(needs_reset(code) for code in (48, 62, 64, 79, 95, 119, 120, 140))
    assert not any(needs_reset(code) for code in (13, 31, 43, 45, 63, 94, 74, 99999))


def test_counting_keeps_reset_class_faults_after_the_start() -> None:
    """Before ``since`` or without a monotonic stamp: not counted."""
    unstamped = XidEvent("0000:1a:00", 79, None, None, "", None, None, None, None)
    events = [xid(79, 5.0), xid(119, 15.0), xid(13, 20.0), unstamped]
    assert [e.code for e in counting(events, 10.0)] == [119]
    assert [e.code for e in counting(events, None)] == [79, 119]


def test_an_automatic_restart_keeps_the_faults_a_start_by_hand_ends_them() -> None:
    """Starts after "Scheduled restart job" are PID 1's own; any other start moves ``since``."""
    up = LastUp()
    up.observe(unit_event(EventKind.STARTING, 10.0, "run1"))  # the operator's start
    assert up.since_s == 10.0
    up.observe(unit_event(EventKind.STARTED, 10.5, "run1"))  # same run: nothing new
    assert up.since_s == 10.0
    up.observe(unit_event(EventKind.RESTART_SCHEDULED, 30.0, "run1"))
    up.observe(unit_event(EventKind.STARTED, 31.0, "run2"))  # automatic
    assert up.since_s == 10.0
    up.observe(unit_event(EventKind.STARTED, 90.0, "run3"))  # by hand again
    assert up.since_s == 90.0
    up.stayed_up(50.0)  # an older good run never moves it back
    assert up.since_s == 90.0
    up.stayed_up(None)
    assert up.since_s == 90.0


def test_a_stop_job_or_the_start_limit_cancels_the_scheduled_restart() -> None:
    """The operator stops a looping unit (or the start limit ends it): the next start is theirs."""
    for ending in (
        unit_event(EventKind.STOPPED, 31.0, "run1", job_type="stop"),
        unit_event(EventKind.START_LIMIT_HIT, 31.0, "run1"),
    ):
        up = LastUp()
        up.observe(unit_event(EventKind.RESTART_SCHEDULED, 30.0, "run1"))
        up.observe(ending)
        up.observe(unit_event(EventKind.STARTED, 40.0, "run2"))
        assert up.since_s == 40.0
    up = LastUp()  # a "Stopped" of systemd's own restart does not cancel it
    up.observe(unit_event(EventKind.RESTART_SCHEDULED, 30.0, "run1"))
    up.observe(unit_event(EventKind.STOPPED, 30.5, "run1", job_type="restart"))
    up.observe(unit_event(EventKind.STARTED, 31.0, "run2"))
    assert up.since_s is None


def test_a_storm_of_other_xids_never_evicts_the_reset_class_one() -> None:
    """10,000 application Xids and older faults of the same GPU: the newest fault stays."""
    log = FaultLog()
    log.add(xid(48, 1.0))
    log.add(xid(79, 2.0))
    for n in range(10_000):
        log.add(xid(13, 3.0 + n))
    log.add(xid(119, 0.5))  # older than the kept one: ignored
    assert [e.code for e in log.since(None)] == [79]
    assert log.since(2.0) == []


def test_the_log_stays_bounded_whatever_the_addresses() -> None:
    """Many addresses: at most 64 kept, at most MAX_FAULTS handed out, oldest first."""
    log = FaultLog()
    started = time.perf_counter()
    for n in range(5000):
        log.add(xid(79, float(n), f"0000:{n % 256:02x}:{n // 256:02x}"))
    assert time.perf_counter() - started < 2.0
    assert len(log.newest) <= 64
    kept = log.since(None)
    assert len(kept) == MAX_FAULTS
    assert [e.monotonic_s for e in kept] == sorted(e.monotonic_s or 0.0 for e in kept)
    assert kept[-1].monotonic_s == 4999.0


def test_snapshot_records_round_trip_and_anything_else_is_left_out() -> None:
    """The gate reads back what the daemon wrote; a damaged file gives fewer faults, no error."""
    written = [to_record(xid(79, 1.0), "2026-12-01T06:00:00+00:00")]
    assert from_records(written) == (XidFault("0000:1a:00", 79, "2026-12-01T06:00:00+00:00"),)
    damaged: list[object] = [
        1,
        {"pci_bus_id": "PCI:0000:1A:00", "code": 48, "time": 5},
        {"pci_bus_id": "not an address", "code": 79},
        {"pci_bus_id": "0000:1a:00", "code": "79"},
        {"pci_bus_id": "0000:1a:00", "code": True},
        {"code": 79},
    ]
    assert from_records(damaged) == (XidFault("0000:1a:00", 48, None),)
    assert from_records({"a": 1}) == ()
    assert len(from_records([written[0]] * 1000)) == MAX_FAULTS


def test_blockers_name_each_gpu_of_the_set_once_with_its_newest_fault() -> None:
    """GPU 1 twice (newest wins), GPU 2 outside the set, an unknown address: one phrase."""
    gpus = [
        gpu(0),  # PCI 00000000:19:00.0, then 1A and 1B
        gpu(1),
        gpu(2),
        lost_gpu(3),  # NVML cannot tell a lost GPU's address
    ]
    faults = [
        XidFault("0000:1a:00", 48, "T1"),
        XidFault("0000:1a:00", 119, "T2\x1b[2J"),
        XidFault("0000:1b:00", 79, "T3"),
        XidFault("0000:3b:00", 79, "T4"),
    ]
    (phrase,) = blockers(faults, gpus, frozenset({0, 1, 3}))
    assert phrase.startswith("GPU 1 had Xid 119 (GSP RPC timeout) at T2\\x1b[2J since the unit")
    assert phrase.endswith("it needs a GPU reset (docs/xid.md)")
    assert len(blockers(faults, gpus, None)) == 2  # all GPUs: 1 and 2
