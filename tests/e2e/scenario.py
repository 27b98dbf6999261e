"""What the incident scenarios share (test_incident.py, test_incident_daemon.py; docs/e2e.md).

Every scenario starts the same way: the fake SGLang (`sglang.service`, tests/e2e/fakesglang)
serves on four fake H200s; its TP3 worker ignores SIGTERM and sits in another cgroup (moved into
a scope, as a worker started outside the unit would be). Then an operator runs
`systemctl restart sglang.service` while 12 requests are pending: the server drains for 30 s,
`TimeoutStopSec=3` expires, systemd SIGKILLs what is in the cgroup, and TP3 survives, holding
about 119 GiB of GPU 3. That restart is `t0` of every measurement (`incident`). `finish` reads
the numbers back from the journal (measure.py), prints the timeline and saves the result.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from e2e.gpubox import DAEMON, UNIT, daemon_events
from e2e.measure import ScenarioResult, Timeline, measure, runs, save

if TYPE_CHECKING:
    from e2e.container import JournalEntry
    from e2e.gpubox import GpuBox
    from e2e.measure import Measurement

WINDOW_S = float(os.environ.get("GPUGUARD_E2E_WINDOW_S", "45"))
SETTLE_S = 3.0  # after a healthy start: time for a late failure to show (none should)
WORKER_MIB = 122205  # TP3's share of GPU 3: 0.85 of an H200
SERVING_MIB = WORKER_MIB + 512  # per GPU while the server runs (worker + main context)
STOPPING = "de5b426a63be47a7b6ac3eaac82e2f6f"
RESTART_SCHEDULED = "5eb03494b6584870a536b337290809b3"
FAILURE_RESULT = "d9b373ed55a64feb8242e02dbe79a49c"
PROCESS_EXIT = "98e322203f7a4ed290d09fe03c09fe15"

#: The fault: TP3 ignores SIGTERM (the test then moves it out of the unit's cgroup).
STUBBORN_TP3 = "[Service]\nEnvironment=FAKE_SGLANG_STUBBORN_WORKER=3\n"
#: For (b): the unit's 3 s stop timeout, pinned in a drop-in that sorts last, so the stop ends in
#: SIGKILL mid-drain exactly as in (a) whatever else is installed.
SAME_STOP_TIMEOUT = "[Service]\nTimeoutStopSec=3\n"


def incident(gpubox: GpuBox, timeline: Timeline, *, enable: bool = True) -> tuple[float, str, int]:
    """Serve, let TP3 escape, restart during the drain; returns (t0, old invocation, TP3's PID).

    The unit is enabled (`systemctl enable`), as a production server is.
    """
    if enable:
        gpubox.systemctl("enable", UNIT)
    gpubox.drop_in(UNIT, "e2e-fault.conf", STUBBORN_TP3)
    serving = gpubox.start_server()
    [tp3] = gpubox.pids("sglang::scheduler_TP3")
    scope = gpubox.escape_to_scope(tp3)
    assert gpubox.allocated() == [SERVING_MIB] * 4
    timeline.mark(f"serving (run {serving[:8]}), 4 x {SERVING_MIB} MiB")
    timeline.mark(f"TP3 (PID {tp3}) ignores SIGTERM and was moved to {scope}")
    t0 = time.time()
    timeline.t0 = t0
    gpubox.systemctl("--no-block", "restart", UNIT)
    timeline.mark("systemctl restart sglang.service (drain 30 s > TimeoutStopSec=3)", t0)
    return t0, serving, tp3


def unit_journal(gpubox: GpuBox, since_s: float) -> list[JournalEntry]:
    """PID 1 about sglang.service, its own output, and gpuguard.service's lines."""
    matches = [
        "_PID=1",
        f"UNIT={UNIT}",
        "+",
        f"_SYSTEMD_UNIT={UNIT}",
        "+",
        f"_SYSTEMD_UNIT={DAEMON}",
    ]
    return gpubox.box.journal([*matches, f"--since=@{int(since_s)}"])


def finish(
    gpubox: GpuBox,
    timeline: Timeline,
    *,
    scenario: str,
    title: str,
    gpuguard: str,
    window_s: float,
    exclude: set[str],
    actions: str,
    notes: list[str],
    healthy_note: str | None = None,
    since_s: float | None = None,
) -> Measurement:
    """Measure from the journal, print the timeline, save the result; the measurement.

    The journal is read from `since_s` on (to the microsecond), by default from 10 s before
    the trigger.
    """
    until = time.time()
    if since_s is None:
        entries = unit_journal(gpubox, timeline.t0 - 10)
    else:
        entries = [
            entry
            for entry in unit_journal(gpubox, since_s)
            if int(str(entry.get("__REALTIME_TIMESTAMP"))) / 1e6 >= since_s
        ]
    measurement = measure(runs(entries, exclude=exclude), timeline.t0, until)
    timeline.add_journal(entries, UNIT)
    result = ScenarioResult(
        scenario=scenario,
        title=title,
        release=gpubox.box.rootfs.name.split("-")[0],
        systemd=gpubox.box.systemd_version(),
        gpuguard=gpuguard,
        window_s=window_s,
        measurement=measurement,
        actions=actions,
        notes=[*notes, *measurement.failures[:3]],
        timeline=timeline.lines(),
        healthy_note=healthy_note,
    )
    save(result)
    print(f"\n({scenario}) {title}")  # noqa: T201 - the timeline is the test's output
    print("\n".join(timeline.lines()))  # noqa: T201
    print(measurement)  # noqa: T201
    return measurement


START_FAILED = "be02cf6855d2428ba40df7e9d022f03d"
"""systemd's MESSAGE_ID for "Failed to start …" (a start that failed: each one a wasted load)."""


def failed_starts(gpubox: GpuBox, since_s: float) -> list[str]:
    """PID 1's "Failed to start" messages of sglang.service since ``since_s``."""
    return pid1_messages(gpubox, since_s, START_FAILED)


def recovered_to_a_new_run(gpubox: GpuBox, died: float, serving: str) -> str:
    """The daemon's recovery after the engine died at ``died``: its new healthy run's id.

    Waits for the unit's next healthy run and the daemon's "recovery finished"; asserts the
    recovery restarted the unit into a run other than ``serving`` and no start failed since.
    """
    healthy = gpubox.wait_fired_up(after_s=died, timeout=120)
    _, finished = gpubox.wait_daemon_said(died - 1, "recovery finished", timeout=30)
    assert finished["result"] == "restarted", finished
    assert healthy != serving
    assert failed_starts(gpubox, died) == []
    return healthy


def pid1_messages(gpubox: GpuBox, since_s: float, message_id: str | None = None) -> list[str]:
    """PID 1's messages about sglang.service since `since_s` (optionally of one MESSAGE_ID)."""
    matches = ["_PID=1", f"UNIT={UNIT}", f"--since=@{int(since_s)}"]
    if message_id is not None:
        matches.append(f"MESSAGE_ID={message_id}")
    return [str(e.get("MESSAGE")) for e in gpubox.box.journal(matches)]


def after_the_sweep(gpubox: GpuBox, t0: float, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The daemon's log since ``t0`` once its sweep or its recovery of the restart is in it.

    A sweep that reaped TP3 but found the new run holding the GPUs before they were ever idle
    (the new run's model load won the race by a poll) logs only after the daemon's release
    wait of 5 s, later than the healthy start plus SETTLE_S: read until it is there.
    """
    deadline = time.monotonic() + timeout
    while True:
        events = gpubox.daemon_log(t0)
        done = daemon_events(events, "survivors of an ended run") or daemon_events(
            events, "recovery finished"
        )
        if done or time.monotonic() > deadline:
            return events
        time.sleep(0.5)


def alive(gpubox: GpuBox, pid: int) -> bool:
    """Whether PID `pid` (inside) exists and is not a zombie."""
    done = gpubox.box.run(["ps", "-o", "stat=", "-p", str(pid)], check=False)
    return done.returncode == 0 and not done.stdout.strip().startswith("Z")


def story_line(line: str) -> bool:
    """The lines of `gpuguard status` that tell the daemon's story."""
    return line.startswith(
        ("Daemon:", "Unit ", "    daemon:", "    recovery", "    survivors", "gpuguard status")
    )
