"""gpuguard inside a PID namespace, with the fake NVML reporting host PIDs as the driver does.

A real PID namespace (``unshare --pid --fork --mount-proc``-style, root only): gpu_hold.py
inside reports its host PID (read from the host's procfs, bound in as ``STATE/host-proc``), so
NVML names no process of the namespace. An allocation whose host PID equals the PID of an
unrelated ``sleep`` inside stands for another container's process: the collision.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from fakestate import allocations

if TYPE_CHECKING:
    from clirunner import Cli

GPU_HOLD = Path(__file__).resolve().parents[1] / "fakenvml" / "gpu_hold.py"

# Runs as PID 1 of the new PID namespace, in a private mount namespace: binds the host's procfs
# for the fake driver, mounts the namespace's own /proc, starts a holder and an unrelated
# process, plants the colliding allocation, then runs gpuguard and prints what happened.
INSIDE = r"""
import json, os, subprocess, sys, time
state, gpu_hold, *gpuguard = sys.argv[1:]
subprocess.run(["mount", "--bind", "/proc", f"{state}/host-proc"], check=True)
subprocess.run(["mount", "-t", "proc", "proc", "/proc"], check=True)
holder = subprocess.Popen(
    [sys.executable, gpu_hold, "--state", state, "--gpus", "0", "--mib", "2000",
     "--name", "sglang::scheduler_TP0"], stdout=subprocess.PIPE)
info = json.loads(holder.stdout.readline())
unrelated = subprocess.Popen(["sleep", "600"])
with open(f"{state}/allocs/other-container.alloc", "w") as alloc:
    alloc.write(f"pid={unrelated.pid}\nminor=1\nmib=3000\nkind=compute\n")
def run(*args):
    done = subprocess.run([*gpuguard, *args], capture_output=True, text=True, timeout=60)
    return {"code": done.returncode, "out": done.stdout, "err": done.stderr}
report = {"holder": info["pid"], "unrelated": unrelated.pid,
          "text": run("status"), "json": run("status", "--json"),
          "reap": run("reap", "--scope", "all", "--yes", "--json", "--grace", "1",
                      "--timeout", "3")}
report["gate"] = run("gate", "--unit", "sglang.service", "--scope", "all", "--timeout", "1",
                     "--socket", "/nonexistent")
report["unrelated_alive"] = unrelated.poll() is None
report["holder_exited"] = holder.wait(timeout=10) is not None
print(json.dumps(report))
"""


@pytest.fixture
def inside(cli: Cli) -> dict[str, object]:
    """Run the scene in a fresh PID and mount namespace; what it printed."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a PID namespace needs root and unshare(1)")
    (cli.state / "host-proc").mkdir()
    done = subprocess.run(
        [
            "unshare", "--pid", "--fork", "--mount", "--propagation", "private", "--",
            sys.executable, "-c", INSIDE, str(cli.state), str(GPU_HOLD),
            *cli.command(),
        ],
        capture_output=True, text=True, env=cli.env, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report: dict[str, object] = json.loads(done.stdout)
    return report


def test_inside_a_pid_namespace_the_server_is_healthy_and_the_collision_untouched(
    cli: Cli, inside: dict[str, object]
) -> None:
    """NVML names host PIDs: the holder's memory is the container's, nothing is CRITICAL.

    The host PID equal to an unrelated process here is foreign: never credited, never
    signalled, while the real holder is still found through its device file and reaped.
    """
    holder, unrelated = inside["holder"], inside["unrelated"]
    [ours] = [a for a in allocations(cli.state) if a.minor == 0]
    assert ours.pid != holder  # the host PID, as the driver reports it
    text = inside["text"]
    assert isinstance(text, dict)
    assert text["code"] == 1, text  # WARNING: GPU 1 is used from outside; nothing CRITICAL
    assert "CRITICAL" not in text["out"]
    assert "in its own PID namespace: NVML's PIDs are host PIDs" in text["out"]
    assert (
        "GPU 0: 2000 MiB held by processes of this container (per-process amounts not "
        "available: the driver reports host PIDs)" in text["out"]
    )
    assert (
        f"Foreign: PID {unrelated} listed by NVML on GPU 1 is not this namespace's" in text["out"]
    )
    assert "GPU 1: 3000 MiB used from outside this container" in text["out"]
    status = inside["json"]
    assert isinstance(status, dict)
    document = json.loads(status["out"])
    assert document["containment"]["foreign_pids"] is True
    assert [h["pid"] for h in document["holders"]] == [holder]
    assert document["foreign"] == [{"pid": unrelated, "gpu": 1, "used_mib": 3000}]
    assert [(g["container_mib"], g["outside_mib"]) for g in document["gpus"][:2]] == [
        (2000, 0),
        (0, 3000),
    ]
    reap = inside["reap"]
    assert isinstance(reap, dict)
    plan = json.loads(reap["out"])
    assert [r["pid"] for r in plan["results"]] == [holder]
    assert unrelated not in [p["pid"] for p in plan["plan"]]
    gate = inside["gate"]
    assert isinstance(gate, dict)
    assert gate["code"] == 1
    assert (
        "GPU 1: 3000 MiB used from outside this container (another container or the host), "
        "which gpuguard cannot reap" in gate["out"] + gate["err"]
    )
    assert inside["unrelated_alive"] is True
    assert inside["holder_exited"] is True
