"""Issues 22 and 24: two watched units on one host, one incident, on a real systemd.

``sglang.service`` serves on GPUs 0,1 and ``sglang-b.service`` on GPUs 2,3
(``CUDA_VISIBLE_DEVICES``, ``--tp-size 2`` each); both start their TP workers in transient
scopes of their own (``FAKE_SGLANG_SCOPE_WORKERS=1``), both have the gate drop-in, the daemon
runs as shipped. An operator's restart of the first ends in SIGKILL (the 30 s drain against
``TimeoutStopSec=3``) and leaves its escaped workers holding GPUs 0,1; gpuguard recovers it (0
failed starts) while the second keeps serving untouched: its main process and workers are the
same processes (PID and start time), none is ever named by gpuguard's root side, its GPUs are
never gated (no gate or reap request for it, its memory unchanged), and ``status`` names none of
either unit's live processes a left-over. ``gpuguard explain`` on each unit tells only that
unit's incident: the first's survivors are exactly its escaped workers, the second has no stop
timeout, no survivor, no failed start, and names no PID of the first.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from e2e.gpubox import CONFIG, DAEMON, FIRED_UP, GATE_DROPIN, UNIT, GpuBox, install
from e2e.measure import SESSION_NOTES, Timeline
from e2e.scenario import SAME_STOP_TIMEOUT, SETTLE_S, alive, finish

if TYPE_CHECKING:
    from e2e.conftest import ContainerFactory
    from e2e.container import Container
    from e2e.gpubox import Artifacts

pytestmark = pytest.mark.slow

OTHER = "sglang-b.service"
LEDGER = "/run/gpuguard/ledger.json"
TWO_CONFIG = CONFIG + f'\n[units."{OTHER}"]\n# GPUs from its CUDA_VISIBLE_DEVICES (2,3)\n'
SERVER = (
    "/opt/sglang/bin/python -u /opt/fakesglang/fake_sglang.py "
    "--model-path /models/Llama-3.1-8B-Instruct --tp-size 2 --mem-fraction-static 0.85 "
    "--port {port} --fake-load-s 2 --fake-drain-s 30"
)


def serving_dropin(gpus: str, port: int) -> str:
    """A drop-in: this unit's two GPUs, TP 2, each worker in a transient scope of its own."""
    return (
        "[Service]\nEnvironment=FAKE_SGLANG_SCOPE_WORKERS=1\n"
        f"Environment=CUDA_VISIBLE_DEVICES={gpus}\nExecStart=\n"
        f"ExecStart={SERVER.format(port=port)}\n"
    )


@dataclass(frozen=True)
class Served:
    """One unit's serving run: its invocation, main process and workers with start times."""

    unit: str
    invocation: str
    processes: dict[int, int]
    """PID -> start time (clock ticks since boot) of the main process and each TP worker."""
    workers: tuple[int, ...]


def start_time(box: Container, pid: int) -> int | None:
    """Field 22 of /proc/PID/stat, None when the process is gone."""
    done = box.run(["cat", f"/proc/{pid}/stat"], check=False)
    if done.returncode != 0:
        return None
    return int(done.stdout.rsplit(")", 1)[1].split()[19])


def fired_up(gpubox: GpuBox, unit: str, after_s: float, timeout: float = 60.0) -> str:
    """Wait for ``unit``'s "fired up" line logged after ``after_s``; its invocation ID."""
    found: list[str] = []

    def fired() -> bool:
        for entry in gpubox.box.journal([f"_SYSTEMD_UNIT={unit}", f"--since=@{int(after_s)}"]):
            stamp = int(str(entry.get("__REALTIME_TIMESTAMP"))) / 1e6
            if stamp >= after_s and FIRED_UP in str(entry.get("MESSAGE")):
                found.append(str(entry.get("_SYSTEMD_INVOCATION_ID")))
                return True
        return False

    gpubox.box.wait_for(f"{unit} fired up", fired, timeout=timeout)
    return found[0]


def served(gpubox: GpuBox, unit: str, invocation: str) -> Served:
    """The run's main process and its two TP workers, each checked to sit in its own scope."""
    box = gpubox.box
    main = int(gpubox.show(unit, "MainPID"))
    children = [int(p) for p in box.run(["pgrep", "-P", str(main)], check=False).stdout.split()]
    workers = tuple(
        pid for pid in children if box.read_file(f"/proc/{pid}/comm").startswith("sglang::sched")
    )
    assert len(workers) == 2, (unit, children)
    for pid in workers:
        assert "tp-worker-" in box.read_file(f"/proc/{pid}/cgroup")
    processes = {}
    for pid in (main, *workers):
        started = start_time(box, pid)
        assert started is not None
        processes[pid] = started
    return Served(unit, invocation, processes, workers)


def recorded(gpubox: GpuBox) -> dict[int, str]:
    """PIDs in the daemon's ledger file, with the invocation each was recorded under."""
    with contextlib.suppress(Exception):
        document = json.loads(gpubox.box.read_file(LEDGER))
        return {p[0]: run["invocation_id"] for run in document["runs"] for p in run["processes"]}
    return {}


def untouched(gpubox: GpuBox, run: Served) -> list[int]:
    """The run's processes that are no longer the same live process (PID and start time)."""
    return [
        pid
        for pid, started in run.processes.items()
        if not alive(gpubox, pid) or start_time(gpubox.box, pid) != started
    ]


def gpuguard_lines(gpubox: GpuBox, since_s: float) -> list[str]:
    """What gpuguard's root side logged since ``since_s``: the daemon and the gate server."""
    entries = gpubox.box.journal(
        [
            f"_SYSTEMD_UNIT={DAEMON}",
            "+",
            "_SYSTEMD_UNIT=gpuguard-gate.service",
            f"--since=@{int(since_s)}",
        ]
    )
    return [str(e.get("MESSAGE")) for e in entries]


def names_pid(text: str, pid: int) -> bool:
    """Whether ``text`` names ``pid`` as a PID (``pid=N``, ``"pid": N``, ``PID N``, ``[N]``)."""
    return bool(
        re.search(
            rf"(\bpid[=:]\s*|\"pid\": |PID |pids=\[|\"pids\": \[)(?:[0-9, ]*\b)?{pid}\b", text
        )
    )


def two_units(container: ContainerFactory, e2e_artifacts: Artifacts) -> tuple[GpuBox, float]:
    """Both units installed (scoped workers, gate drop-in, 3 s stop timeout), the daemon up."""
    booted: Container = container(binds=e2e_artifacts.binds())
    gpubox = GpuBox(booted, install_s=install(booted, config=TWO_CONFIG))
    box = gpubox.box
    box.write_file(f"/etc/systemd/system/{OTHER}", box.read_file(f"/etc/systemd/system/{UNIT}"))
    for unit, gpus, port in ((UNIT, "0,1", 30000), (OTHER, "2,3", 30001)):
        dropins = f"/etc/systemd/system/{unit}.d"
        box.write_file(f"{dropins}/e2e-serving.conf", serving_dropin(gpus, port))
        box.write_file(f"{dropins}/gpuguard-gate.conf", GATE_DROPIN.read_text())
        box.write_file(f"{dropins}/zz-e2e.conf", SAME_STOP_TIMEOUT)
    gpubox.systemctl("daemon-reload")
    gpubox.start_daemon()
    began = time.time()
    gpubox.systemctl("start", UNIT, OTHER)
    return gpubox, began


def left_over_pids(gpubox: GpuBox) -> set[int]:
    """PIDs ``status --json`` names in a left-over finding (of any watched unit)."""
    document = json.loads(gpubox.gpuguard("status", "--json").stdout)
    return {
        int(pid)
        for finding in document["findings"]
        if "left-over" in finding["message"]
        for pid in re.findall(r"PID ([0-9]+) ", finding["message"])
    }


def explained(gpubox: GpuBox, a: Served, new_a: Served) -> None:
    """``explain`` on each unit: A's survivors are its escaped workers; B has no incident."""
    stories = {unit: _explain(gpubox, unit) for unit in (UNIT, OTHER)}
    survivors_a = stories[UNIT]["story"]["survivors"]
    named = {int(pid) for line in survivors_a for pid in re.findall(r"^PID ([0-9]+):", line)}
    assert named == set(a.workers), survivors_a
    story_b = stories[OTHER]["story"]
    assert story_b["survivors"] == [], story_b
    assert story_b["stop_timeouts"] == [], story_b
    assert story_b["failed_starts"] == [], story_b
    text_b = json.dumps(stories[OTHER])
    assert not [pid for pid in (*a.processes, *new_a.processes) if names_pid(text_b, pid)]
    for unit, story in stories.items():
        assert story["story"]["disagreements"] == [], (unit, story["story"]["disagreements"])


def test_p_second_unit_keeps_serving_while_the_first_is_recovered(
    container: ContainerFactory, e2e_artifacts: Artifacts
) -> None:
    """A's escaped workers recovered (0 failed starts); B untouched; explain tells each its own."""
    gpubox, began = two_units(container, e2e_artifacts)
    a = served(gpubox, UNIT, fired_up(gpubox, UNIT, began - 1))
    b = served(gpubox, OTHER, fired_up(gpubox, OTHER, began - 1))
    gpubox.box.wait_for(
        "the ledger records both units' workers",
        lambda: all(
            recorded(gpubox).get(pid) == run.invocation for run in (a, b) for pid in run.workers
        ),
        timeout=30,
    )
    b_memory = [gpubox.allocated_mib(minor) for minor in (2, 3)]

    timeline = Timeline(time.time())
    timeline.mark(f"{UNIT} serves (workers {list(a.workers)}), {OTHER} too ({list(b.workers)})")
    t0 = time.time()
    timeline.t0 = t0
    gpubox.systemctl("--no-block", "restart", UNIT)
    timeline.mark(f"systemctl restart {UNIT} (drain 30 s > TimeoutStopSec=3)", t0)
    again = fired_up(gpubox, UNIT, t0)
    time.sleep(SETTLE_S)  # a late failure would show (none should)
    m = finish(
        gpubox,
        timeline,
        scenario="p",
        title="two units, escaped workers of one, restart, daemon + gate",
        gpuguard="both",
        window_s=round(time.time() - t0, 1),
        exclude={a.invocation},
        actions=f"{OTHER} untouched",
        notes=["workers in their own transient scopes (systemd-run --scope)"],
        since_s=t0 - 1,
    )
    assert m.failed_starts == 0, m
    assert m.healthy_s is not None, m
    assert not any(alive(gpubox, pid) for pid in a.workers)

    # B: the same processes, never named by gpuguard, its GPUs never gated, its memory as it was.
    assert untouched(gpubox, b) == [], b
    assert gpubox.show(OTHER, "InvocationID") == b.invocation
    lines = gpuguard_lines(gpubox, began - 1)
    assert [line for line in lines for pid in b.processes if names_pid(line, pid)] == []
    assert all(any(names_pid(line, pid) for line in lines) for pid in a.workers)  # the control
    asked = (f"gate for {OTHER} from PID", f"reap for {OTHER} from PID")
    assert [line for line in gpuguard_lines(gpubox, t0 - 1) if line.startswith(asked)] == []
    assert [gpubox.allocated_mib(minor) for minor in (2, 3)] == b_memory

    new_a = served(gpubox, UNIT, again)
    left = left_over_pids(gpubox)
    assert not left & {*b.processes, *new_a.processes}, left
    explained(gpubox, a, new_a)
    SESSION_NOTES.append(
        f"(p) two units: {UNIT} healthy {m.healthy_s} s after its restart, {OTHER} untouched"
    )


def _explain(gpubox: GpuBox, unit: str) -> dict[str, Any]:
    """``gpuguard explain --unit UNIT --json``, parsed."""
    done = gpubox.gpuguard("explain", "--unit", unit, "--json")
    assert done.returncode == 0, done.stderr
    document: dict[str, Any] = json.loads(done.stdout)
    return document
