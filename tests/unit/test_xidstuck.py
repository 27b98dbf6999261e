"""An application Xid's PID is a claim: it names a process only if that one started before."""

from __future__ import annotations

import snapshots

from gpuguard.core.xid.events import XidEvent
from gpuguard.core.xid.stuck import XidClaim, claims, claims_from_snapshot, named_by, stuck_phrase


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


def test_snapshot_claims_are_application_xids_naming_a_pid_with_a_stamp() -> None:
    """No PID, no stamp, a negative PID or another class of Xid is no claim (shapes: parse's)."""
    records = [
        snapshots.xid(31, "0000:19:00", pid=7, monotonic_s=5, time="T"),
        snapshots.xid(31, "0000:19:00", pid=None, monotonic_s=5),
        snapshots.xid(31, "0000:19:00", pid=-1, monotonic_s=5),
        snapshots.xid(31, "0000:19:00", pid=7, monotonic_s=None),
        snapshots.xid(79, "0000:19:00", pid=7, monotonic_s=5),
    ]
    assert claims_from_snapshot(records) == [XidClaim(31, 7, 5.0, "T")]
    assert claims_from_snapshot([]) == []
    assert stuck_phrase(XidClaim(31, 7, 5.0, "T")) == (
        "stuck in the driver after Xid 31 (GPU memory page fault) at T"
    )
