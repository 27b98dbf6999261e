"""Issue 22: a shared multi-user service, on a real systemd: another user's job is never touched.

``jobs.service`` is shaped like Debian's ``cron.service``: one root daemon (``ExecStart=+``)
runs every user's queued job in the unit's own cgroup and keeps ``KillMode=process``, so jobs
outlive a stop, a restart and a crash of the daemon. The unit's ``User=`` is alice; bob's jobs
run there too. Both users' jobs hold fake GPUs of the unit's set (alice GPU 0, bob GPU 1) and
match the unit's pattern (``train``). The unit is watched (configured, gate drop-in installed,
daemon running). Through a restart, a crash with ``Restart=always`` (a refusal loop the daemon
sees) and a stop, every path - the gate, the stop-reap, the daemon's recovery and survivor
sweep, the operator's ``gpuguard reap`` in every scope - handles alice's left-overs by the rules
(reaped once her run ended) and never signals bob's: each bob job is alive with the same PID
and start time until bob ends it himself, and no gpuguard line names its PID as signalled.
Also: a job of an unwatched service asking the gate server for its own unit is refused, and
root in a transient scope (``systemd-run --scope``) is not an operator.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from e2e.gpubox import CONFIG, DAEMON, GATE_DROPIN, STATE, GpuBox, install
from e2e.measure import SESSION_NOTES
from e2e.scenario import alive

if TYPE_CHECKING:
    from e2e.conftest import ContainerFactory
    from e2e.container import Container
    from e2e.gpubox import Artifacts

pytestmark = pytest.mark.slow

JOBS = "jobs.service"
OTHER = "otherjobs.service"
QUEUE = "/run/jobs/queue"
JOB_MIB = 20000
#: A short gate wait: every start while bob's job holds GPU 1 is refused after it.
GATE_S = 5
SHARED_CONFIG = CONFIG.replace("gate_timeout_s = 60.0", f"gate_timeout_s = {GATE_S}.0") + (
    f'\n[units."{JOBS}"]\npatterns = ["train"]\n'
)

#: The cron-like daemon: starts each queued job (a line "USER GPUS NAME") as its user, here.
JOBD = f"""\
#!/bin/sh
# A cron-like shared service (tests/e2e/test_shared_service.py): every user's job runs in this
# unit's cgroup, as its user; KillMode=process lets the jobs outlive the daemon.
mkdir -p {QUEUE}
while :; do
    for job in {QUEUE}/*.job; do
        [ -f "$job" ] || continue
        read -r user gpus name <"$job"
        rm -f "$job"
        setpriv --reuid="$user" --regid="$user" --init-groups \\
            python3 /usr/local/bin/gpu_hold.py --state {STATE} --gpus "$gpus" \\
            --mib {JOB_MIB} --name "$name" >"/run/jobs/$name.json" 2>&1 &
    done
    sleep 0.1
done
"""

JOBS_UNIT = """\
[Unit]
Description=A shared multi-user job service (cron-like, gpuguard e2e)

[Service]
Type=simple
User=alice
Environment=CUDA_VISIBLE_DEVICES=0,1
# The daemon itself runs as root ("+") and starts each job as its user, like cron.
ExecStart=+/usr/local/bin/jobd
Restart=always
RestartSec=1
KillMode=process

[Install]
WantedBy=multi-user.target
"""

#: After the gate drop-in (which sets KillMode=mixed): the shared service keeps its own.
KEEP_KILLMODE = "[Service]\nKillMode=process\n"

OTHER_UNIT = """\
[Service]
Type=simple
ExecStart=/bin/sleep infinity
KillMode=process
"""


@dataclass(frozen=True)
class Job:
    """One queued job: whose, its PID and its exact start time (clock ticks since boot)."""

    user: str
    name: str
    pid: int
    start: int


def start_time(box: Container, pid: int) -> int | None:
    """Field 22 of /proc/PID/stat, None when the process is gone."""
    done = box.run(["cat", f"/proc/{pid}/stat"], check=False)
    if done.returncode != 0:
        return None
    return int(done.stdout.rsplit(")", 1)[1].split()[19])


def queue(gpubox: GpuBox, user: str, gpu: int, name: str) -> Job:
    """Queue a job with jobd and wait until it holds its GPU; it must sit in the unit's cgroup."""
    box = gpubox.box
    box.write_file(f"{QUEUE}/{name}.tmp", f"{user} {gpu} {name}\n")
    box.run(["mv", f"{QUEUE}/{name}.tmp", f"{QUEUE}/{name}.job"])
    report: dict[str, Any] = {}

    def ready() -> bool:
        done = box.run(["cat", f"/run/jobs/{name}.json"], check=False)
        if done.returncode != 0 or not done.stdout.strip():
            return False
        report.update(json.loads(done.stdout.splitlines()[0]))
        return True

    box.wait_for(f"job {name} holds GPU {gpu}", ready, timeout=30)
    pid = int(report["pid"])
    cgroup = box.read_file(f"/proc/{pid}/cgroup")
    assert f"/{JOBS}" in cgroup, cgroup
    uid = box.run(["id", "-u", user]).stdout.strip()
    status = box.read_file(f"/proc/{pid}/status")
    assert re.search(rf"^Uid:\s+{uid}\s+{uid}\s+{uid}\s+{uid}$", status, re.MULTILINE), status
    started = start_time(box, pid)
    assert started is not None
    return Job(user, name, pid, started)


def untouched(gpubox: GpuBox, job: Job) -> bool:
    """Whether the job is the same live process (PID and start time) it was."""
    return alive(gpubox, job.pid) and start_time(gpubox.box, job.pid) == job.start


def gpuguard_lines(gpubox: GpuBox, since_s: float) -> list[str]:
    """Everything gpuguard logged: the daemon, the gate server, and the jobs unit's client lines."""
    entries = gpubox.box.journal(
        [
            f"_SYSTEMD_UNIT={DAEMON}",
            "+",
            "_SYSTEMD_UNIT=gpuguard-gate.service",
            "+",
            f"_SYSTEMD_UNIT={JOBS}",
            f"--since=@{int(since_s)}",
        ]
    )
    return [str(e.get("MESSAGE")) for e in entries]


def signalled(lines: list[str], pid: int) -> list[str]:
    """The gpuguard lines that say it signalled or reaped ``pid`` (decided, sent or swept).

    The daemon logs JSON (``signal`` and ``reap outcome`` events, a sweep's ``pids``); the gate
    server's request processes log the console form (``[info ] signal … pid=N``) and the plan
    (``reap  pid N``).
    """
    found = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            event = None
        if isinstance(event, dict):
            if (
                event.get("pid") == pid and (event.get("event") == "signal" or event.get("signals"))
            ) or pid in (event.get("pids") or []):
                found.append(line)
        elif re.search(rf"\]\s+signal\s.*\bpid={pid}\b|(^|: )\s*reap\s+pid {pid}\b", line):
            found.append(line)
    return found


def journal_says(gpubox: GpuBox, since_s: float, text: str, *matches: str) -> bool:
    """Whether a journal entry since ``since_s`` (of ``matches``) contains ``text``."""
    entries = gpubox.box.journal([*matches, f"--since=@{int(since_s)}"])
    return any(text in str(e.get("MESSAGE")) for e in entries)


def bob_ends(gpubox: GpuBox, job: Job) -> None:
    """Bob ends his own job (it was never gpuguard's to end), after checking it is untouched."""
    assert untouched(gpubox, job), job
    gpubox.box.run_as("bob", ["kill", str(job.pid)])
    gpubox.box.wait_for(f"bob's {job.name} ended", lambda: not alive(gpubox, job.pid))


def running_again(gpubox: GpuBox, after: str) -> str:
    """Wait until jobs.service runs a new invocation (its gate passed); that invocation."""
    found: list[str] = []

    def running() -> bool:
        state = gpubox.show(JOBS, "ActiveState")
        invocation = gpubox.show(JOBS, "InvocationID")
        found[:] = [invocation]
        return state == "active" and invocation != after

    gpubox.box.wait_for(f"{JOBS} running again", running, timeout=40)
    return found[0]


def stop_reap_spared(gpubox: GpuBox, since_s: float, alice: Job, bob: Job) -> None:
    """Wait until the stop-reap (ExecStopPost=) reaped alice's job and spared bob's.

    The stop-reap runs as alice (the unit's User=): bob's job is counted, never named to her.
    """
    spared = "spare 1 process(es) of other users (named to root only)"
    gpubox.box.wait_for(
        "the stop-reap's plan sparing bob's job",
        lambda: journal_says(gpubox, since_s, spared, f"_SYSTEMD_UNIT={JOBS}"),
        timeout=30,
    )
    gpubox.box.wait_for(f"alice's {alice.name} reaped", lambda: not alive(gpubox, alice.pid))
    assert alive(gpubox, bob.pid), "bob's job spared"


def shared_box(container: ContainerFactory, e2e_artifacts: Artifacts) -> GpuBox:
    """A booted box with alice, bob, the watched jobs.service (gate, KillMode=process), daemon."""
    booted: Container = container(binds=e2e_artifacts.binds())
    gpubox = GpuBox(booted, install_s=install(booted, config=SHARED_CONFIG))
    box = gpubox.box
    for user in ("alice", "bob"):
        box.run(["useradd", "--create-home", user])
    # Any user may open the GPUs' device files and allocate, as on a real host (0666).
    box.run(["sh", "-c", f"chmod 0666 {STATE}/dev/* && chmod 1777 {STATE}/allocs"])
    box.write_file("/usr/local/bin/jobd", JOBD, mode=0o755)
    box.write_file(f"/etc/systemd/system/{JOBS}", JOBS_UNIT)
    box.write_file(f"/etc/systemd/system/{JOBS}.d/gpuguard-gate.conf", GATE_DROPIN.read_text())
    box.write_file(f"/etc/systemd/system/{JOBS}.d/zz-e2e.conf", KEEP_KILLMODE)
    box.systemctl("daemon-reload")
    gpubox.start_daemon()
    return gpubox


def operators_and_strangers(gpubox: GpuBox, bob: Job) -> None:
    """The operator's reaps spare bob's job; root in a scope and an unwatched service refused."""
    # The operator (root in a login session) in every scope: alice's job is live, bob's not the
    # unit's; nothing is signalled and the GPUs stay busy (exit 1).
    for scope in ("all", "patterns", "unit"):
        done = operator(gpubox, "reap", "--unit", JOBS, "--scope", scope, "--yes")
        assert done.returncode == 1, done
        assert f"spare pid {bob.pid} " in done.stdout, done.stdout
        assert "never its, even in its cgroup" in done.stdout, done.stdout
    done = gpubox.box.run(
        ["systemd-run", "--scope", "--quiet", "--unit=root-job", "/usr/bin/gpuguard", "reap",
         "--unit", JOBS, "--scope", "all", "--yes"],
        check=False, env={"FAKENVML_STATE": STATE},
    )  # fmt: skip
    assert done.returncode == 1, done
    assert "request from a process of root-job.scope: refused" in done.stderr, done
    for user, command in (("bob", "gate"), ("root", "reap")):
        extra = ["--yes"] if command == "reap" else []
        done = gpubox.box.run(
            ["systemd-run", f"--unit={OTHER.removesuffix('.service')}", f"--uid={user}",
             "--quiet", "--pipe", "--wait", "--collect", "/usr/bin/gpuguard", command,
             "--unit", OTHER, *extra],
            check=False,
        )  # fmt: skip
        assert done.returncode == 1, done
        assert (
            f"request from a process of {OTHER}: refused ({OTHER} is not watched"
            in done.stdout + done.stderr
        ), done


def crash_loop(gpubox: GpuBox, since_s: float, bob: Job) -> None:
    """Wait for the gate's refusal and the daemon's loop verdict; the refusal names no command."""
    box = gpubox.box
    box.wait_for(
        "the gate's refusal",
        lambda: journal_says(gpubox, since_s, "Start refused", f"_SYSTEMD_UNIT={JOBS}"),
        timeout=60,
    )
    box.wait_for(
        "the daemon's verdict on the loop",
        lambda: any(e.get("unit") == JOBS and e.get("looping") for e in gpubox.daemon_log(since_s)),
        timeout=60,
    )
    refusals = [
        str(e.get("MESSAGE"))
        for e in box.journal([f"_SYSTEMD_UNIT={JOBS}", f"--since=@{int(since_s)}"])
        if "Start refused" in str(e.get("MESSAGE"))
    ]
    # The gate runs as alice: bob's job is "another user's process", its PID and name untold.
    assert "held by another user's process" in refusals[0], refusals
    assert f"PID {bob.pid}" not in refusals[0], refusals
    assert bob.name not in refusals[0], refusals
    assert "gpuguard reap" not in refusals[0], refusals  # no scope would free bob's job


def test_a_shared_service_never_signals_another_users_job(
    container: ContainerFactory, e2e_artifacts: Artifacts
) -> None:
    """Restart, crash loop, stop, operator reaps: alice's left-overs reaped, bob's never touched."""
    gpubox = shared_box(container, e2e_artifacts)
    began = time.time()
    gpubox.systemctl("start", JOBS)
    invocation = gpubox.show(JOBS, "InvocationID")
    alices = [queue(gpubox, "alice", 0, "train-alice-1")]
    bobs = [queue(gpubox, "bob", 1, "train-bob-1")]
    operators_and_strangers(gpubox, bobs[0])
    took: list[str] = []

    # (1) An operator's restart: the stop-reap reaps alice's job of the ended run, spares bob's.
    t0 = time.time()
    gpubox.systemctl("--no-block", "restart", JOBS)
    stop_reap_spared(gpubox, t0, alices[0], bobs[0])
    bob_ends(gpubox, bobs[0])  # else his job holds GPU 1 and every gated start waits for it
    invocation = running_again(gpubox, invocation)
    took.append(f"restart {time.time() - t0:.1f} s")

    # (2) A crash with Restart=always: the stop-reap reaps alice's job; bob's keeps GPU 1 busy,
    # every gated start is refused, systemd restarts, the daemon sees the loop (and does not
    # stop the unit: nothing it may reap would free GPU 1).
    alices.append(queue(gpubox, "alice", 0, "train-alice-2"))
    bobs.append(queue(gpubox, "bob", 1, "train-bob-2"))
    t0 = time.time()
    gpubox.systemctl("kill", "--kill-whom=main", "--signal=SIGKILL", JOBS)
    stop_reap_spared(gpubox, t0, alices[1], bobs[1])
    crash_loop(gpubox, t0, bobs[1])
    bob_ends(gpubox, bobs[1])
    running_again(gpubox, invocation)
    took.append(f"crash loop {time.time() - t0:.1f} s")

    # (3) An operator's stop, and the operator's reaps while the stop-reap waits for GPU 1.
    alices.append(queue(gpubox, "alice", 0, "train-alice-3"))
    bobs.append(queue(gpubox, "bob", 1, "train-bob-3"))
    t0 = time.time()
    gpubox.systemctl("--no-block", "stop", JOBS)
    stop_reap_spared(gpubox, t0, alices[2], bobs[2])
    for scope in ("all", "patterns"):
        done = operator(gpubox, "reap", "--unit", JOBS, "--scope", scope, "--yes")
        assert f"spare pid {bobs[2].pid} " in done.stdout, done
    assert untouched(gpubox, bobs[2])
    took.append(f"stop {time.time() - t0:.1f} s")

    lines = gpuguard_lines(gpubox, began - 1)
    for job in alices:  # the detector finds what gpuguard did signal
        assert signalled(lines, job.pid), job
    for job in bobs:
        assert not signalled(lines, job.pid), (job, signalled(lines, job.pid))
    daemon = gpubox.daemon_log(began - 1)
    assert not [e for e in daemon if e.get("event") == "recovery: stopping unit"], daemon
    SESSION_NOTES.append(f"shared service (bob's jobs never signalled): {', '.join(took)}")


_SESSIONS = iter(range(1, 1000))


def operator(gpubox: GpuBox, *args: str) -> Any:
    """``gpuguard ARGS`` as the operator: root in a login session's scope in user-0.slice.

    The root file system has no pam_systemd, so the scope logind would make for ``ssh root@``
    is made by hand, with the same name and slice.
    """
    return gpubox.box.run(
        ["systemd-run", "--scope", "--quiet", "--slice=user-0.slice",
         f"--unit=session-c{next(_SESSIONS)}", "/usr/bin/gpuguard", *args],
        check=False,
        env={"FAKENVML_STATE": STATE},
    )  # fmt: skip
