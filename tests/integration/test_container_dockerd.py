"""A real dockerd: the unit's left-over container is stopped, a tenant's is not; status names it.

Runs where Debian's ``docker.io`` is installed (``dockerd`` and ``docker`` in the system
directories), as root, with ``gcc`` able to link statically; skips otherwise, and fails under
GPUGUARD_REQUIRE_DOCKERD=1 (CI: ``make deps`` installs docker.io). The test starts its own
dockerd (vfs storage, no bridge, no iptables) on a socket in a private directory, imports an
image of one static program that opens the fake GPU file and sleeps, and stops the daemon and
removes its state afterwards. The gate's test uses the NVML stand-in of test_container_engine.py;
``reap`` and ``status`` run as commands over the fake NVML, the container's init registered as
holding fake GPU memory, with ``systemctl``/``journalctl`` doubles (clirunner) and, in their
private mount namespace, the test's dockerd directory over /run, so that root's engine socket
``/run/docker.sock`` is the test's dockerd.
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
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from containergate import UNIT, Log, gate
from fakeholder import process_gone
from fakestate import add_alloc, release_alloc

from gpuguard.adapters import programs
from gpuguard.adapters.containerstop import ContainerStopper
from gpuguard.adapters.engineapi import EngineClient
from gpuguard.core.unitcontainers import Engine, claim_from_exec, parse_inspect

if TYPE_CHECKING:
    from collections.abc import Iterator

    from clirunner import Cli, CliResult, FakeSystemd

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

    def run_argv(self, name: str, gpu: Path | None = None) -> list[str]:
        """A unit's ExecStart= for a container named ``name`` holding the fake GPU ``gpu``."""
        held = self.gpu if gpu is None else gpu
        gpus = str(held.parent)
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
            str(held),
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
        if os.environ.get("GPUGUARD_REQUIRE_DOCKERD") == "1":
            pytest.fail(f"GPUGUARD_REQUIRE_DOCKERD=1: {why}")
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
                # A system containerd (docker.io's, where systemd runs it) is shared: a
                # namespace of the test's own keeps the system dockerd's containers apart.
                f"--containerd-namespace=gpuguard-test-{os.getpid()}",
                f"--containerd-plugins-namespace=gpuguard-test-plugins-{os.getpid()}",
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


def with_engine(daemon: Dockerd, argv: list[str]) -> list[str]:
    """``argv`` in a private mount namespace whose /run is the test dockerd's directory."""
    script = 'mount --bind "$0" /run || exit 97; exec "$@"'
    unshare = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script]
    return [*unshare, str(daemon.root), *argv]


def run_cli(daemon: Dockerd, cli: Cli, *args: str) -> CliResult:
    """One gpuguard command that reaches the test's dockerd as root's engine."""
    from clirunner import CliResult  # noqa: PLC0415 - a test helper, imported where used

    done = subprocess.run(
        with_engine(daemon, cli.command(*args)),
        capture_output=True,
        text=True,
        env=cli.env,
        timeout=60,
        check=False,
    )
    return CliResult(done.returncode, done.stdout, done.stderr)


def holding_memory(daemon: Dockerd, name: str, state: Path, mib: int) -> int:
    """Register container ``name``'s init as holding ``mib`` on fake GPU 0; its PID.

    The allocation is released once that process is gone, as the driver frees a dead
    process's memory.
    """
    pid = int(daemon.docker("inspect", "--format", "{{.State.Pid}}", name))
    alloc = add_alloc(state, pid=pid, minor=0, mib=mib)

    def release() -> None:
        deadline = time.monotonic() + 60
        while not process_gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        release_alloc(alloc)

    threading.Thread(target=release, daemon=True).start()
    return pid


def test_reap_and_status_name_and_stop_the_units_left_over_container(
    dockerd: Dockerd, cli: Cli, fake_state: Path, fake_systemd: FakeSystemd
) -> None:
    """Status says whose the container is; reap --dry-run would stop it; reap stops it only.

    The tenant's container on the same GPU is shown as docker:<id12>, spared and left running.
    """
    gpu = fake_state / "dev" / "nvidia0"
    ours_id = dockerd.docker(*dockerd.run_argv("gg-sglang", gpu)[1:])
    theirs_id = dockerd.docker(*dockerd.run_argv("gg-tenant", gpu)[1:])
    try:
        ours_pid = holding_memory(dockerd, "gg-sglang", fake_state, 20000)
        cli.configure(f'[units."{UNIT}"]\ngpus = [0]\ncontainer = "gg-sglang"\n')
        ours = f"{UNIT} (container gg-sglang, docker {ours_id[:12]}"

        fake_systemd(UNIT, state="active")  # live, its run's start unknown: whose, not stale
        shown = run_cli(dockerd, cli, "status")
        assert f"{ours})" in shown.out, shown.out + shown.err
        assert f"docker:{theirs_id[:12]}" in shown.out

        fake_systemd(UNIT)  # inactive: the container is left over
        report = run_cli(dockerd, cli, "status", "--json")
        holders = {h["pid"]: h for h in report.json()["holders"]}
        assert holders[ours_pid]["unit_container"] == {
            "unit": UNIT,
            "name": "gg-sglang",
            "engine": "docker",
            "id": ours_id,
            "left_over": True,
        }
        assert [h["unit_container"] for p, h in holders.items() if p != ours_pid] == [None]
        assert report.code == 1  # WARNING: the left-over container
        assert any("gg-sglang" in f["message"] for f in report.json()["findings"])

        dry = run_cli(dockerd, cli, "reap", "--unit", UNIT, "--dry-run", "--json")
        assert dry.code == 0, dry.err
        planned = {c["container"]: c for c in dry.json()["containers"]}
        assert planned[f"docker:{ours_id[:12]}"]["outcome"] == "would stop"
        assert planned[f"docker:{theirs_id[:12]}"]["stop"] is False
        assert parse_inspect(EngineClient(Engine.DOCKER, dockerd.socket).inspect("gg-sglang"))

        reaped = run_cli(dockerd, cli, "reap", "--unit", UNIT, "--yes", "--grace", "1")
        assert reaped.code == 0, reaped.out + reaped.err
        assert f"  stop  container docker:{ours_id[:12]} (gg-sglang, " in reaped.out
        assert f"  spare container docker:{theirs_id[:12]}" in reaped.out
        assert f"container docker:{ours_id[:12]} (gg-sglang): stopped" in reaped.out
        assert "GPU 0: 0 MiB used" in reaped.out
        client = EngineClient(Engine.DOCKER, dockerd.socket)
        assert client.inspect("gg-sglang") is None  # stopped, and removed by --rm
        tenant = parse_inspect(client.inspect("gg-tenant"))
        assert tenant is not None
        assert tenant.running
    finally:
        with contextlib.suppress(AssertionError):
            dockerd.docker("rm", "-f", "gg-sglang", "gg-tenant")
