"""An application Xid's PID is a claim: it names a process only if that one started before."""

from __future__ import annotations

from gpuguard.core.xidevents import XidEvent
from gpuguard.core.xidstuck import XidClaim, claims, claims_from_snapshot, named_by, stuck_phrase


def event(code: int, pid: int | None, at_s: float | None) -> XidEvent:
    """A parsed kernel Xid naming ``pid``."""
    return XidEvent("0000:19:00", code, pid, "python3", "", at_s, None, None, None)


def test_only_application_xids_with_a_pid_and_a_stamp_are_claims() -> None:
    """Xid 79 (reboot), a line without PID, one without a stamp: no claim."""
    found = claims([event(31, 7, 5.0), event(79, 7, 6.0), event(13, None, 7.0), event(43, 7, None)])
    assert found == [XidClaim(31, 7, 5.0)]


def test_named_by_needs_the_same_pid_and_a_process_older_than_the_xid() -> None:
    """The newest matching claim wins; a process started after the Xid is another one."""
    xid_claims = [XidClaim(31, 7, 5.0), XidClaim(13, 7, 9.0), XidClaim(43, 8, 9.5)]
    assert named_by(7, 4.0, xid_claims) == XidClaim(13, 7, 9.0)
    assert named_by(7, 6.0, xid_claims) == XidClaim(13, 7, 9.0)
    assert named_by(7, 9.1, xid_claims) is None
    assert named_by(9, 1.0, xid_claims) is None


def test_snapshot_claims_of_the_wrong_shape_are_left_out() -> None:
    """Written by the daemon, read back from disk: anything odd is skipped, never raised."""
    records: list[object] = [
        {"code": 31, "pid": 7, "monotonic_s": 5, "time": "T"},
        {"code": 31, "pid": True, "monotonic_s": 5},
        {"code": 31, "pid": -1, "monotonic_s": 5},
        {"code": "31", "pid": 7, "monotonic_s": 5},
        {"code": 31, "pid": 7, "monotonic_s": "5"},
        {"code": 79, "pid": 7, "monotonic_s": 5},
        "x",
    ]
    assert claims_from_snapshot(records) == [XidClaim(31, 7, 5.0, "T")]
    assert claims_from_snapshot({"code": 31}) == []
    assert stuck_phrase(XidClaim(31, 7, 5.0, "T")) == (
        "stuck in the driver after Xid 31 (GPU memory page fault) at T"
    )
