"""(k), (l): a `docker run` unit whose container outlived the stop (issue 17 item 4, docs/e2e.md).

`sglang.service` runs the fake SGLang in a docker container of Debian's engine (`docker.io`),
started inside the booted container: `ExecStart=/usr/bin/docker run --rm --name sglang-srv …`.
A restart during the 30 s drain ends in systemd's SIGKILL after `TimeoutStopSec=3`, but that
kills only the `docker` client: the container (in the engine's `docker-<id>.scope`, not the
unit's cgroup) drains on, holding the four fake GPUs and the name.

* (k) without gpuguard: every start after the stop fails at once (docker: the name is in use by
  the left-over container), until systemd's start limit ends the loop; the left-over still holds
  the GPUs.
* (l) with the shipped gate drop-in: the gate finds the GPUs held by a docker container, the
  engine confirms it is the unit's `sglang-srv` started before the unit's running invocation,
  the gate stops it through the engine API (journal line), and the start succeeds.

The docker container's processes hold the fake `/dev/nvidia*` files (bound in), and the fake
driver writes their **host** PIDs, two PID namespaces up, as NVIDIA's driver would.

What the engine needs in the systemd-nspawn container, and nothing else gets: cgroup v2 inside
(`SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1`; on this cgroup v1/hybrid host nspawn mounts the v1
controllers read-only and runc cannot create its cgroups there), `CAP_NET_ADMIN` (runc's
container init fails with EPERM without it, even with `--network host`) and the system calls
nspawn's filter leaves out: `@keyring` (runc's session keyring) and `bpf` (runc's device
filter on cgroup v2). The image is a tree of empty directories and `usr` links, imported
offline (`docker import`); the programs come from the container's `/usr` and `/opt`, bound in.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import TYPE_CHECKING

import pytest
from fakestate import counted_allocations

from e2e.container import Container, ContainerError
from e2e.gpubox import STATE, UNIT, GpuBox, install
from e2e.measure import SESSION_NOTES, Timeline
from e2e.scenario import SAME_STOP_TIMEOUT, SERVING_MIB, SETTLE_S, finish, pid1_messages

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from e2e.gpubox import Artifacts

pytestmark = pytest.mark.slow

NSPAWN_ARGS = ("--capability=CAP_NET_ADMIN", "--system-call-filter=@keyring bpf")
NSPAWN_ENV = {"SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"}
IMAGE = "fakesglang:e2e"
NAME = "sglang-srv"
START_LIMIT = "Start request repeated too quickly."
IDLE_AFTER = re.compile(r"idle after ([0-9.]+) s")
START_LIMIT_S = 30.0  # systemd's default start limit ends (k) 13-15 s after the restart here

#: The image: directories and the merged-/usr links, nothing else (binds bring the programs).
IMPORT_IMAGE = f"""\
set -eu
tree=$(mktemp -d)
cd "$tree"
mkdir -p usr opt etc tmp proc sys dev run var/lib
for name in bin lib lib64 sbin; do ln -s "usr/$name" "$name"; done
tar -c . | docker import - {IMAGE} >/dev/null
rm -rf "$tree"
"""

#: The unit runs its server in docker: the fake SGLang of the unit file, same arguments.
DOCKER_EXEC = f"""\
[Service]
ExecStart=
ExecStart=/usr/bin/docker run --rm --name {NAME} --network host \\
    -e CUDA_VISIBLE_DEVICES -e FAKENVML_STATE \\
    -v /usr:/usr:ro -v /opt/sglang:/opt/sglang:ro -v /opt/fakesglang:/opt/fakesglang:ro \\
    -v {STATE}:{STATE} -v /run/fakegpu:/run/fakegpu \\
    {IMAGE} /opt/sglang/bin/python -u /opt/fakesglang/fake_sglang.py \\
    --model-path /models/Llama-3.1-70B-Instruct --tp-size 4 --mem-fraction-static 0.85 \\
    --port 30000 --fake-load-s 2 --fake-drain-s 30
"""


@pytest.fixture
def dockerbox(docker_rootfs: Path, e2e_artifacts: Artifacts) -> Iterator[GpuBox]:
    """A booted docker-variant container with gpuguard installed, dockerd running, the image."""
    booted = Container(
        docker_rootfs,
        binds=e2e_artifacts.binds(),
        mode="copy" if os.environ.get("GPUGUARD_E2E_MODE") == "copy" else "overlay",
        nspawn_args=NSPAWN_ARGS,
        nspawn_env=NSPAWN_ENV,
    )
    with booted:
        box = GpuBox(booted, install_s=install(booted))
        start_docker(booted)
        booted.run(["sh", "-c", IMPORT_IMAGE], timeout=60)
        box.drop_in(UNIT, "docker.conf", DOCKER_EXEC)
        yield box
        box.kill_server()
        booted.run(["docker", "rm", "--force", NAME], check=False, timeout=30)


# dockerd, started on a loaded machine, has needed more than one start (it gives up on
# containerd, and docker.service's start job fails before its own Restart= would bring it up).
DOCKER_START_TRIES = 4
_START_DOCKER = (
    "systemctl reset-failed containerd.service docker.socket docker.service 2>/dev/null; "
    "systemctl start containerd.service && systemctl start docker.service && "
    "docker info --format '{{.ServerVersion}}'"
)


def start_docker(booted: Container) -> None:
    """Start containerd, then dockerd, until `docker info` answers; retries are in the notes."""
    failures: list[str] = []
    for _ in range(DOCKER_START_TRIES):
        done = booted.run(["sh", "-c", _START_DOCKER], check=False, timeout=180)
        if done.returncode == 0:
            break
        failures.append((done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1])
    else:
        journal = booted.run(["journalctl", "--no-pager", "-n", "40", "-u", "docker"], check=False)
        raise ContainerError(f"dockerd did not start: {failures}\n{journal.stdout}")
    if failures:
        note = f"docker.service needed {len(failures) + 1} starts: {failures}"
        sys.stderr.write(f"e2e: {note}\n")
        SESSION_NOTES.append(note)


def _container(box: GpuBox) -> dict[str, object] | None:
    """`docker inspect sglang-srv` (Id, State), None when there is no such container."""
    done = box.box.run(["docker", "inspect", NAME], check=False)
    if done.returncode != 0:
        return None
    [found] = json.loads(done.stdout)
    return {"id": found["Id"], "running": found["State"]["Running"]}


def _serving_container(box: GpuBox) -> str:
    """The full id of the running container."""
    found = _container(box)
    assert found is not None
    assert found["running"], found
    return str(found["id"])


def _docker_pids(box: GpuBox, container_id: str) -> set[int]:
    """PIDs (in the booted container) of every process of the docker container."""
    path = f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope/cgroup.procs"
    return {int(pid) for pid in box.box.read_file(path).split()}


def _nvml_pids(box: GpuBox) -> set[int]:
    """The PIDs the fake driver reports on the four GPUs (what NVML lists)."""
    state = box.state_on_host
    return {alloc.pid for minor in range(4) for alloc in counted_allocations(state, minor)}


def _unit_lines(box: GpuBox, since_s: float) -> list[str]:
    """The unit's own output since `since_s` (docker's errors, the server, the gate's story)."""
    entries = box.box.journal([f"_SYSTEMD_UNIT={UNIT}", f"--since=@{int(since_s)}"])
    return [str(entry.get("MESSAGE")) for entry in entries]


def _serve(box: GpuBox, timeline: Timeline) -> tuple[str, str]:
    """Start the docker unit and check who holds the GPUs; (invocation, container id)."""
    box.systemctl("enable", UNIT)
    serving = box.start_server(timeout=60)
    container_id = _serving_container(box)
    inside = _docker_pids(box, container_id)
    assert box.allocated() == [SERVING_MIB] * 4
    # NVML lists host PIDs: each is a process of the docker container, two namespaces down.
    assert _nvml_pids(box) == {box.box.host_pid(pid) for pid in inside}
    timeline.mark(
        f"serving (run {serving[:8]}) in docker container {container_id[:12]} ({len(inside)} "
        f"processes), 4 x {SERVING_MIB} MiB, NVML lists their host PIDs"
    )
    return serving, container_id


def _restart(box: GpuBox, timeline: Timeline) -> float:
    t0 = time.time()
    timeline.t0 = t0
    box.systemctl("--no-block", "restart", UNIT)
    timeline.mark("systemctl restart sglang.service (drain 30 s > TimeoutStopSec=3)", t0)
    return t0


def test_k_l_left_over_docker_container(dockerbox: GpuBox) -> None:
    """Without gpuguard the name and the GPUs stay taken; the gate stops the left-over."""
    box = dockerbox
    # (k) without gpuguard.
    timeline = Timeline(time.time())
    serving, old = _serve(box, timeline)
    t0 = _restart(box, timeline)
    box.box.wait_for(
        "systemd's start limit ends the loop",
        lambda: any(START_LIMIT in line for line in pid1_messages(box, t0)),
        timeout=START_LIMIT_S,
    )
    m = finish(
        box,
        timeline,
        scenario="k",
        title="docker run unit, left-over container, no gpuguard",
        gpuguard="none",
        window_s=round(time.time() - t0, 1),
        exclude={serving},
        actions="—",
        notes=["observed until systemd's start limit ended the loop"],
    )
    assert any("State 'stop-sigterm' timed out. Killing." in t for t in pid1_messages(box, t0))
    conflicts = [line for line in _unit_lines(box, t0) if "is already in use by container" in line]
    assert m.failed_starts >= 3, m
    assert len(conflicts) == m.failed_starts, conflicts
    assert m.healthy_s is None
    left_over = _container(box)
    assert left_over is not None
    assert left_over["id"] == old
    assert left_over["running"]
    assert box.allocated() == [SERVING_MIB] * 4

    # Clean up for (l): the left-over goes, the unit's failure is forgotten.
    box.box.run(["docker", "rm", "--force", NAME], timeout=30)
    box.systemctl("reset-failed", UNIT)
    box.box.wait_for("GPUs idle", lambda: box.allocated() == [0] * 4, timeout=10)

    # (l) the shipped gate drop-in; its timeline leaves (k)'s lines out.
    began = time.time()
    box.install_gate(extra=SAME_STOP_TIMEOUT)
    timeline = Timeline(began)
    timeline.mark("installed systemd/gpuguard-gate.conf as sglang.service.d/ drop-in")
    serving, old = _serve(box, timeline)
    t0 = _restart(box, timeline)
    healthy = box.wait_fired_up(after_s=t0, timeout=60)
    time.sleep(SETTLE_S)
    lines = _unit_lines(box, t0)
    proof = f"docker:{old[:12]}"
    stopped = [line for line in lines if "container stopped" in line and proof in line]
    idle = next((found[1] for line in lines if (found := IDLE_AFTER.search(line))), "?")
    m = finish(
        box,
        timeline,
        scenario="l",
        title="docker run unit, left-over container, gate drop-in",
        gpuguard="gate",
        window_s=round(time.time() - t0, 1),
        exclude={serving},
        actions=(
            f"gate stopped the left-over docker:{old[:12]} ({NAME}) through the engine API "
            f"(SIGTERM, 1 s, SIGKILL); GPUs idle after {idle} s"
        ),
        notes=["observed until the healthy start + 3 s", *stopped[:1]],
        since_s=began,
    )
    assert stopped, lines[-30:]
    assert m.failed_starts == 0, m
    assert m.starts == 1, m
    assert m.healthy_s is not None
    assert box.show(UNIT, "ActiveState") == "active"
    assert box.show(UNIT, "InvocationID") == healthy
    new = _serving_container(box)
    assert new != old
    assert box.allocated() == [SERVING_MIB] * 4  # the new container, alone
    assert _nvml_pids(box) == {box.box.host_pid(pid) for pid in _docker_pids(box, new)}
