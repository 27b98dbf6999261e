"""The gate against a real dockerd: the unit's left-over container is stopped, a tenant's is not.

Runs where Debian's ``docker.io`` is installed (``dockerd`` and ``docker`` in the system
directories), as root, with ``gcc`` able to link statically; skips otherwise (CI does not
install docker.io: the stand-in engine of test_container_engine.py covers the same gate there).
The test starts its own dockerd (vfs storage, no bridge, no iptables) on a socket in a private
directory, imports an image of one static program that opens the fake GPU file and sleeps, and
stops the daemon and removes its state afterwards. NVML is the same stand-in as there.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from containergate import UNIT, Log, gate

from gpuguard.adapters import programs
from gpuguard.adapters.containerstop import ContainerStopper
from gpuguard.adapters.engineapi import EngineClient
from gpuguard.core.unitcontainers import Engine, claim_from_exec, parse_inspect

if TYPE_CHECKING:
    from collections.abc import Iterator

_HOLD_C = b"""
#include <fcntl.h>
#include <unistd.h>
int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) open(argv[i], O_RDONLY);
    for (;;) pause();
}
"""
IMAGE = "gpuguard-test-hold:1"
_PLUGINS = Path("/run/docker/plugins")


@dataclass
class Dockerd:
    """A private dockerd and the directory holding its socket, state and the fake GPU."""

    root: Path
    process: subprocess.Popen[bytes]

    @property
    def socket(self) -> Path:
        """The daemon's API socket."""
        return self.root / "docker.sock"

    @property
    def gpu(self) -> Path:
        """The fake GPU file, bound into containers at the same path."""
        return self.root / "gpus" / "nvidia0"

    def docker(self, *args: str) -> str:
        """Run the docker client against this daemon; its stdout."""
        done = programs.run(
            ["docker", "-H", f"unix://{self.socket}", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return str(done.stdout).strip()

    def run_argv(self, name: str) -> list[str]:
        """A unit's ExecStart= for a container named ``name`` holding the fake GPU."""
        gpus = str(self.gpu.parent)
        return [
            programs.resolve("docker"),
            "run",
            "-d",
            "--rm",
            "--name",
            name,
            "-v",
            f"{gpus}:{gpus}",
            IMAGE,
            "/hold",
            str(self.gpu),
        ]


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root to run dockerd"
    for name in ("dockerd", "docker", "gcc"):
        try:
            programs.resolve(name)
        except FileNotFoundError:
            return f"needs {name} (apt-get install docker.io gcc)"
    return None


@pytest.fixture(scope="module")
def dockerd() -> Iterator[Dockerd]:
    """A dockerd of this test's own; stopped, and its state removed, afterwards."""
    if (why := _missing()) is not None:
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="gpuguard-dockerd-"))
    cgroups_before = set(Path("/sys/fs/cgroup").glob("*/docker"))
    plugins_made = not _PLUGINS.exists()  # dockerd makes it whatever --exec-root says
    with (root / "dockerd.log").open("wb") as daemon_log:
        process = subprocess.Popen(
            [
                programs.resolve("dockerd"),
                "--storage-driver=vfs",
                "--bridge=none",
                "--iptables=false",
                "--ip-masq=false",
                f"--data-root={root}/data",
                f"--exec-root={root}/exec",
                f"--pidfile={root}/dockerd.pid",
                f"--host=unix://{root}/docker.sock",
            ],
            stdout=subprocess.DEVNULL,
            stderr=daemon_log,
            env=programs.ENVIRONMENT,
        )
    daemon = Dockerd(root, process)
    try:
        _wait_ready(daemon)
        _import_image(daemon)
        daemon.gpu.parent.mkdir()
        daemon.gpu.touch()
        yield daemon
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(root, ignore_errors=True)
        # dockerd (cgroupfs driver) leaves its empty parent cgroups behind; ours only.
        for cgroup in set(Path("/sys/fs/cgroup").glob("*/docker")) - cgroups_before:
            with contextlib.suppress(OSError):
                cgroup.rmdir()
        if plugins_made:
            with contextlib.suppress(OSError):
                _PLUGINS.rmdir()
                _PLUGINS.parent.rmdir()


def _wait_ready(daemon: Dockerd) -> None:
    client = EngineClient(Engine.DOCKER, daemon.socket)
    deadline = time.monotonic() + 60
    while True:
        assert daemon.process.poll() is None, (daemon.root / "dockerd.log").read_text()[-2000:]
        with contextlib.suppress(Exception):
            client.inspect("nonesuch")
            return
        assert time.monotonic() < deadline, "dockerd did not answer within 60 s"
        time.sleep(0.2)


def _import_image(daemon: Dockerd) -> None:
    """An image of one static program, built offline (``docker import`` of a tar)."""
    source = daemon.root / "hold.c"
    source.write_bytes(_HOLD_C)
    binary = daemon.root / "hold"
    built = programs.run(
        ["gcc", "-static", "-Os", "-o", str(binary), str(source)], capture_output=True, timeout=120
    )
    assert built.returncode == 0, built.stderr
    tar = daemon.root / "image.tar"
    with tarfile.open(tar, "w") as archive:
        archive.add(binary, arcname="hold")
        directory = tarfile.TarInfo("tmp")
        directory.type = tarfile.DIRTYPE
        directory.mode = 0o1777
        archive.addfile(directory, io.BytesIO())
    daemon.docker("import", str(tar), IMAGE)


def test_the_units_left_over_container_is_stopped_and_a_tenants_is_kept(
    dockerd: Dockerd,
) -> None:
    """Real engine, real cgroups: the gate stops exactly the container the unit names."""
    ours = dockerd.run_argv("gg-sglang")
    theirs = dockerd.run_argv("gg-tenant")
    ours_id = dockerd.docker(*ours[1:])
    theirs_id = dockerd.docker(*theirs[1:])
    claim = claim_from_exec(ours)
    assert claim is not None
    log = Log()
    stopper = ContainerStopper(
        UNIT,
        frozenset({0}),
        lambda: (claim,),
        live=False,
        live_since_s=lambda: None,
        grace_s=1.0,
        dry_run=False,
        logger=lambda: log,
        client=lambda kind: EngineClient(kind, dockerd.socket),
    )
    try:
        outcome = gate(f"{dockerd.gpu.parent}/nvidia*", stopper, 3.0)
        client = EngineClient(Engine.DOCKER, dockerd.socket)
        assert client.inspect("gg-sglang") is None  # stopped, and removed by --rm
        tenant = parse_inspect(client.inspect("gg-tenant"))
        assert tenant is not None
        assert tenant.running
        assert not outcome.passed  # the tenant's container still holds GPU 0
        by_container = {str(fields["container"]): event for event, fields in log.lines}
        assert by_container == {
            f"docker:{ours_id[:12]}": "container stopped",
            f"docker:{theirs_id[:12]}": "container not stopped",
        }
    finally:
        with contextlib.suppress(AssertionError):
            dockerd.docker("rm", "-f", "gg-sglang", "gg-tenant")
