"""A unit's left-over container is stopped through its engine at the gate; nothing else is.

The holders are real processes in real cgroups (``/docker/<id>``, as docker's cgroupfs driver
names them) holding a fake GPU file; gpuguard finds them by its real /proc scan. The engine is
a stand-in: a small HTTP server on a unix socket answering with a ``container inspect`` recorded
from docker 20.10 (tests/engine_samples), its Id and Pid set to the test's container, and
stopping it as the engine would (SIGTERM to its init). It stands in because dockerd cannot be
assumed on a test machine; test_container_dockerd.py runs the same gate against a real dockerd
where there is one. NVML is a stand-in too (tests/support/containergate.py says why).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from clirunner import CGROUP2
from containergate import (
    FULL_ID,
    RECORDED,
    UNIT,
    Containers,
    FakeEngine,
    Log,
    gate,
    plan_request,
)

from gpuguard.adapters.containerstop import ContainerStopper, for_unit
from gpuguard.adapters.engineapi import EngineClient, EngineError
from gpuguard.core.unitcontainers import Claim, Engine, claim_from_exec
from gpuguard.core.values import UnitProvenance

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

SAMPLES = Path(__file__).parents[1] / "engine_samples"


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[FakeEngine]:
    """The stand-in engine on a socket in a root-only directory."""
    fake = FakeEngine(tmp_path / "engine" / "docker.sock")
    fake.path.parent.mkdir(mode=0o700)
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture
def containers(tmp_path: Path) -> Iterator[Containers]:
    """Container stand-ins holding ``nvidia0`` in a fresh fake GPU directory."""
    if not os.access(CGROUP2, os.W_OK):
        pytest.skip(f"needs a writable cgroup v2 hierarchy at {CGROUP2} (root)")
    gpus = tmp_path / "gpus"
    gpus.mkdir()
    (gpus / "nvidia0").touch()
    made = Containers(gpus / "nvidia0")
    yield made
    made.remove()


def stopper(
    engine: FakeEngine,
    log: Log,
    names: tuple[Claim, ...],
    *,
    live: bool = False,
    live_since_s: float | None = None,
    dry_run: bool = False,
) -> ContainerStopper:
    """The stopper for the unit, talking to the stand-in engine, logging into ``log``."""
    return ContainerStopper(
        UNIT,
        frozenset({0}),
        lambda: names,
        live=live,
        live_since_s=lambda: live_since_s,
        grace_s=2.0,
        dry_run=dry_run,
        logger=lambda: log,
        client=lambda kind: EngineClient(kind, engine.path),
    )


KEY = (Claim("sglang", "the unit's container key"),)


def test_the_units_left_over_container_is_stopped_and_the_start_passes(
    engine: FakeEngine, containers: Containers
) -> None:
    """The gate asks the engine to stop it (the reaper's grace), and then the GPU is free."""
    holder = containers.run(FULL_ID)
    engine.containers["sglang"] = (FULL_ID, holder.pid)
    log = Log()
    outcome = gate(f"{containers.gpu.parent}/nvidia*", stopper(engine, log, KEY))
    assert outcome.passed, outcome.blockers
    assert engine.stops == [f"/containers/{FULL_ID}/stop?t=2"]
    assert holder.wait(5) == -signal.SIGTERM
    assert log.events() == ["container stopped"]
    assert log.lines[0][1]["container"] == f"docker:{FULL_ID[:12]}"
    assert outcome.reaped == ()


def test_dry_run_stops_nothing_and_the_gate_refuses(
    engine: FakeEngine, containers: Containers
) -> None:
    """Dry run: one 'would stop' line, nothing sent, the holder lives."""
    holder = containers.run(FULL_ID)
    engine.containers["sglang"] = (FULL_ID, holder.pid)
    log = Log()
    outcome = gate(f"{containers.gpu.parent}/nvidia*", stopper(engine, log, KEY, dry_run=True), 0.3)
    assert not outcome.passed
    assert engine.stops == []
    assert holder.poll() is None
    assert log.events() == ["would stop container"]  # once per gate run, not per poll


def test_a_container_the_unit_does_not_name_is_never_stopped(
    engine: FakeEngine, containers: Containers
) -> None:
    """A tenant's container on the unit's GPU is reported, not stopped: the name is another's."""
    ours, theirs = "a1" * 32, "b2" * 32
    holder = containers.run(theirs)
    engine.containers["sglang"] = (ours, os.getpid())  # the unit's container is another one
    engine.containers["tenant"] = (theirs, holder.pid)
    log = Log()
    outcome = gate(f"{containers.gpu.parent}/nvidia*", stopper(engine, log, KEY), 0.3)
    assert not outcome.passed
    assert engine.stops == []
    assert holder.poll() is None
    assert log.events() == ["container not stopped"]
    assert f"is not {UNIT}'s container sglang" in str(log.lines[0][1]["reason"])


def test_a_hex_looking_name_never_stops_a_container_by_id_prefix(
    engine: FakeEngine, containers: Containers
) -> None:
    """The unit names ``cafe``; a tenant's container whose id begins so is not the unit's."""
    theirs = "cafe" + "b2" * 30
    holder = containers.run(theirs)
    engine.containers["tenant"] = (theirs, holder.pid)
    log = Log()
    claim = (Claim("cafe", "the unit's container key"),)
    outcome = gate(f"{containers.gpu.parent}/nvidia*", stopper(engine, log, claim), 0.3)
    assert not outcome.passed
    assert engine.stops == []
    assert holder.poll() is None
    assert log.events() == ["container not stopped"]


def test_the_running_units_live_container_is_kept(
    engine: FakeEngine, containers: Containers
) -> None:
    """Started during the running invocation: kept; started before it: stopped."""
    holder = containers.run(FULL_ID)
    engine.containers["sglang"] = (FULL_ID, holder.pid)
    log = Log()
    since = time.monotonic() - 60  # the run began before the container's init
    outcome = gate(
        f"{containers.gpu.parent}/nvidia*",
        stopper(engine, log, KEY, live=True, live_since_s=since),
        0.3,
    )
    assert not outcome.passed
    assert engine.stops == []
    assert "live container" in str(log.lines[0][1]["reason"]), log.lines
    # Started before the running invocation: left over.
    log = Log()
    outcome = gate(
        f"{containers.gpu.parent}/nvidia*",
        stopper(engine, log, KEY, live=True, live_since_s=time.monotonic() + 60),
    )
    assert outcome.passed, (outcome.blockers, log.lines)
    assert log.events() == ["container stopped"]


def test_an_engine_that_is_down_stops_nothing(engine: FakeEngine, containers: Containers) -> None:
    """No socket: the container is kept and the reason says why."""
    holder = containers.run(FULL_ID)
    engine.stop()
    engine.path.unlink()
    log = Log()
    outcome = gate(f"{containers.gpu.parent}/nvidia*", stopper(engine, log, KEY), 0.3)
    assert not outcome.passed
    assert holder.poll() is None
    assert "No such file" in str(log.lines[0][1]["reason"])


@pytest.mark.parametrize(
    ("names", "live", "reason"),
    [
        pytest.param(KEY, True, "cannot be read", id="live-unit-run-start-unreadable"),
        pytest.param((), False, "no name the unit gives", id="unit-names-no-container"),
    ],
)
def test_without_proof_of_a_left_over_the_container_is_kept(
    engine: FakeEngine,
    containers: Containers,
    names: tuple[Claim, ...],
    *,
    live: bool,
    reason: str,
) -> None:
    """A live unit whose run start systemd does not give: no container of its is stopped.

    A unit that names no container never has one stopped.
    """
    holder = containers.run(FULL_ID)
    engine.containers["sglang"] = (FULL_ID, holder.pid)
    log = Log()
    outcome = gate(f"{containers.gpu.parent}/nvidia*", stopper(engine, log, names, live=live), 0.3)
    assert not outcome.passed
    assert engine.stops == []
    assert holder.poll() is None
    assert reason in str(log.lines[0][1]["reason"])


def _owned_by_nobody(socket_path: Path) -> None:
    os.chown(socket_path, 65534, 65534)


def _directory_writable_by_all(socket_path: Path) -> None:
    socket_path.parent.chmod(0o777)


@pytest.mark.parametrize(
    ("spoil", "refusal"),
    [
        pytest.param(
            _owned_by_nobody,
            "owned by uid 65534",
            id="socket-of-another-user",
            marks=pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to nobody"),
        ),
        pytest.param(
            _directory_writable_by_all,
            "writable by group or others",
            id="socket-in-a-directory-others-write",
        ),
    ],
)
def test_a_socket_others_could_have_put_there_is_refused(
    engine: FakeEngine, spoil: Callable[[Path], None], refusal: str
) -> None:
    """A socket file another user owns could be anyone's engine.

    A directory others write lets them replace the socket.
    """
    spoil(engine.path)
    with pytest.raises(EngineError, match=refusal):
        EngineClient(Engine.DOCKER, engine.path).inspect("sglang")


_LISTEN_AS_NOBODY = """
import os, socket, sys
server = socket.socket(socket.AF_UNIX)
server.bind(sys.argv[1])
os.setgid(65534)
os.setuid(65534)
server.listen()
print("ready", flush=True)
connection, _ = server.accept()
connection.recv(1)
"""


def test_a_listener_that_is_not_root_is_refused(tmp_path: Path) -> None:
    """A root-owned socket file is not enough: the process answering must be root's too."""
    if os.geteuid() != 0:
        pytest.skip("needs root to listen as nobody on a root-owned socket")
    path = tmp_path / "d" / "docker.sock"
    path.parent.mkdir(mode=0o700)
    with subprocess.Popen(
        [sys.executable, "-c", _LISTEN_AS_NOBODY, str(path)], stdout=subprocess.PIPE
    ) as listener:
        assert listener.stdout is not None
        assert listener.stdout.readline() == b"ready\n"
        assert path.stat().st_uid == 0
        with pytest.raises(EngineError, match="listener runs as uid 65534"):
            EngineClient(Engine.DOCKER, path).inspect("sglang")
        listener.wait(5)


def test_an_oversized_answer_is_refused(engine: FakeEngine) -> None:
    """An answer is bounded: 1 MiB of inspect is no engine's answer."""
    engine.containers["sglang"] = (FULL_ID, os.getpid())
    RECORDED["Padding"] = "x" * (1024 * 1024)
    try:
        with pytest.raises(EngineError, match="answer over"):
            EngineClient(Engine.DOCKER, engine.path).inspect("sglang")
    finally:
        del RECORDED["Padding"]


@pytest.mark.parametrize(
    ("live_invocation", "problem", "live"),
    [(None, None, False), ("a" * 32, None, True), (None, "systemctl failed", True)],
)
def test_a_unit_systemd_cannot_describe_may_be_live(
    live_invocation: str | None, problem: str | None, *, live: bool
) -> None:
    """Only a request that knows the unit has no live run lets a container go unasked-for.

    When systemd's view is unknown the run's start is asked (and, unknown, keeps everything).
    """
    request = replace(
        plan_request(), live_invocation=live_invocation, provenance=UnitProvenance(problem)
    )
    built = for_unit(request, "sglang", grace_s=1.0, dry_run=False, logger=Log)
    assert built.live is live
    assert built.gpu_set == frozenset({0})
    assert built.unit == UNIT


def test_a_podman_units_left_over_container_is_stopped(
    engine: FakeEngine, containers: Containers
) -> None:
    """Podman's compatible API (its recorded 4.3 answer) and its ``libpod-<id>.scope`` cgroup.

    The name comes from a ``podman run`` ExecStart=, so only the podman engine is asked.
    """
    container_id = uuid.uuid4().hex * 2
    engine.recorded = json.loads((SAMPLES / "podman-4.3-compat-inspect-created.json").read_text())
    holder = containers.run(container_id, f"machine.slice/libpod-{container_id}.scope")
    engine.containers["sglang"] = (container_id, holder.pid)
    claim = claim_from_exec(["/usr/bin/podman", "run", "--name", "sglang", "img"])
    assert claim is not None
    assert claim.engine is Engine.PODMAN
    log = Log()
    outcome = gate(f"{containers.gpu.parent}/nvidia*", stopper(engine, log, (claim,)))
    assert outcome.passed, outcome.blockers
    assert engine.stops == [f"/containers/{container_id}/stop?t=2"]
    assert holder.wait(5) == -signal.SIGTERM
    assert [(e, f["container"]) for e, f in log.lines] == [
        ("container stopped", f"podman:{container_id[:12]}")
    ]
