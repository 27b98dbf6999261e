"""The journal follower against a real systemd in a container, journalctl run inside by nsenter."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from journalwait import poll

from gpuguard.adapters.journal import LIFECYCLE, OUTPUT, JournalFollower, JournalRecord

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from e2e.container import Container

UNIT = "flaky.service"
RESTART_SCHEDULED = "5eb03494b6584870a536b337290809b3"
STARTED = "39f53479d3a045ac8e11786248231fbf"
FAILURE_RESULT = "d9b373ed55a64feb8242e02dbe79a49c"
RUNS = 4  # runs 1-3 fail, run 4 stays up

FLAKY = f"""\
#!/bin/sh
# Fails its first {RUNS - 1} runs the way a server on occupied GPUs does, then serves.
n=$(cat /run/flaky-runs 2>/dev/null || echo 0)
n=$((n + 1))
echo "$n" >/run/flaky-runs
echo "flaky: request log line, run $n"
echo "flaky: run $n: CUDA out of memory" >&2
[ "$n" -ge {RUNS} ] && exec sleep 600
exit 1
"""

FLAKY_UNIT = """\
[Unit]
Description=gpuguard e2e flaky unit

[Service]
ExecStart=/usr/local/bin/flaky
Restart=always
RestartSec=1
"""


def collect(
    follower: JournalFollower,
    until: Callable[[list[JournalRecord]], bool],
    *,
    timeout: float = 20.0,
) -> list[JournalRecord]:
    """Poll until ``until(records)`` holds on everything read so far."""
    records: list[JournalRecord] = []
    deadline = time.monotonic() + timeout
    while not until(records):
        assert time.monotonic() < deadline, f"{len(records)} records, {follower.health()}"
        records += poll(follower, 0.1)
    return records


def of(records: list[JournalRecord], stream: str) -> list[dict[str, object]]:
    """The entries of one stream."""
    return [r.entry for r in records if r.stream == stream]


def count(records: list[JournalRecord], message_id: str) -> int:
    """How many lifecycle records carry ``message_id``."""
    return sum(1 for r in records if r.entry.get("MESSAGE_ID") == message_id)


def test_follower_gets_lifecycle_live_and_resumes_without_gaps(
    booted: Container, tmp_path: Path
) -> None:
    """PID 1's entries about a looping unit arrive live; a re-created follower resumes exactly."""
    booted.write_file("/usr/local/bin/flaky", FLAKY, mode=0o755)
    booted.write_file(f"/etc/systemd/system/{UNIT}", FLAKY_UNIT)
    booted.systemctl("daemon-reload")
    inside = ("nsenter", "-t", str(booted.init_pid), "-a", "journalctl")

    def follower() -> JournalFollower:
        return JournalFollower(
            [UNIT],
            tmp_path / "cursor.json",
            output_patterns=("CUDA out of memory",),
            journalctl=inside,
        )

    first = follower()
    with first:
        history = collect(first, lambda _: first.health().state == "attached")
        assert history == []  # the unit never ran: nothing about it in this boot
        booted.systemctl("start", UNIT)
        seen = collect(first, lambda r: count(r, RESTART_SCHEDULED) >= 1)
        first.commit(*seen)
        pids = [s.pid for s in first.health().streams]
    assert all(r.live for r in seen)
    lifecycle = of(seen, LIFECYCLE)
    assert all(e["_PID"] == "1" and e["_UID"] == "0" for e in lifecycle)
    assert {e["UNIT"] for e in lifecycle} == {UNIT}
    assert count(seen, FAILURE_RESULT) >= 1
    # The follower's journalctl (and nsenter) are gone, inside and out. Inside, the kernel may
    # still be finishing journalctl's exit (state D on 257) when close() returns.
    booted.wait_for("journalctl gone", lambda: journalctl_running(booted) == [], timeout=5)
    assert all(pid is not None and not _alive(pid) for pid in pids)

    booted.wait_for(
        "the unit's last run",
        lambda: booted.run(["cat", "/run/flaky-runs"], check=False).stdout.strip() == str(RUNS),
    )
    second = follower()
    with second:

        def complete(records: list[JournalRecord]) -> bool:
            every = [*seen, *records]
            return count(every, STARTED) >= RUNS and len(of(every, OUTPUT)) >= RUNS

        rest = collect(second, complete)
        deadline = time.monotonic() + 1.0  # then nothing more (no duplicates) for a second
        while time.monotonic() < deadline:
            rest += poll(second, 0.1)
        second.commit(*rest)
    booted.wait_for("journalctl gone", lambda: journalctl_running(booted) == [], timeout=5)

    matches = ["_PID=1", f"UNIT={UNIT}", "+", "_SYSTEMD_CGROUP=/init.scope", f"UNIT={UNIT}"]
    truth = [str(e["__CURSOR"]) for e in booted.journal(matches)]
    got = [r.cursor for r in [*seen, *rest] if r.stream == LIFECYCLE]
    assert got == truth  # each entry once, in journal order, none missing
    assert count([*seen, *rest], RESTART_SCHEDULED) == RUNS - 1
    restarts = [r.entry.get("N_RESTARTS") for r in [*seen, *rest]]
    assert [n for n in restarts if n is not None] == ["1", "2", "3"]

    output = [e["MESSAGE"] for e in of([*seen, *rest], OUTPUT)]
    assert output == [f"flaky: run {n}: CUDA out of memory" for n in range(1, RUNS + 1)]


def journalctl_running(booted: Container) -> list[str]:
    """Live journalctl processes in the container.

    Zombies do not count: nsenter's forked journalctl is reparented to the host's init when
    nsenter dies first, and this machine's init (not systemd) is slow to reap.
    """
    lines = booted.run(["ps", "-eo", "pid=,stat=,comm="]).stdout.splitlines()
    return [
        line for line in lines if line.split()[2:] == ["journalctl"] and "Z" not in line.split()[1]
    ]


def _alive(pid: int) -> bool:
    """Whether a host process ``pid`` exists (not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:  # noqa: PTH123 - one read of a /proc file
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
