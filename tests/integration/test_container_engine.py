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

import contextlib
import http.server
import json
import os
import signal
import socketserver
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from clirunner import CGROUP2
from containergate import UNIT, Log, gate, plan_request

from gpuguard.adapters.containerstop import ContainerStopper, for_unit
from gpuguard.adapters.engineapi import EngineClient, EngineError
from gpuguard.core.unitcontainers import Claim, Engine
from gpuguard.core.values import UnitProvenance

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

RECORDED = json.loads(
    (Path(__file__).parents[1] / "engine_samples/docker-20.10-inspect-running.json").read_text()
)
FULL_ID = "5e1f" * 16


@dataclass
class FakeEngine:
    """The stand-in engine: recorded inspect answers for named containers, stop by SIGTERM."""

    path: Path
    containers: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> id, pid
    stops: list[str] = field(default_factory=list)
    server: socketserver.UnixStreamServer | None = None

    def start(self) -> None:
        """Serve on ``path`` in a thread."""
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_: object) -> None:
                pass

            def do_GET(self) -> None:
                name = self.path.removeprefix("/containers/").removesuffix("/json")
                found = engine.containers.get(name)
                if found is None:
                    self.answer(404, {"message": f"No such container: {name}"})
                    return
                answer = json.loads(json.dumps(RECORDED))
                answer["Id"], answer["Name"] = found[0], f"/{name}"
                answer["State"]["Pid"] = found[1]
                self.answer(200, answer)

            def do_POST(self) -> None:
                engine.stops.append(self.path)
                target = self.path.removeprefix("/containers/").partition("/stop")[0]
                for name, (container_id, pid) in list(engine.containers.items()):
                    if container_id == target:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGTERM)
                        del engine.containers[name]
                        self.answer(204, None)
                        return
                self.answer(404, {"message": "No such container"})

            def answer(self, status: int, body: object) -> None:
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        class Server(socketserver.ThreadingUnixStreamServer):
            def handle_error(self, *_: object) -> None:
                """A client that hung up mid-answer (the oversized test) is no test failure."""

        self.server = Server(str(self.path), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        """Stop serving."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[FakeEngine]:
    """The stand-in engine on a socket in a root-only directory."""
    fake = FakeEngine(tmp_path / "engine" / "docker.sock")
    fake.path.parent.mkdir(mode=0o700)
    fake.start()
    yield fake
    fake.stop()


@dataclass
class Containers:
    """Real processes in real ``/docker/<id>`` cgroups, holding the fake GPU file."""

    gpu: Path
    made: list[tuple[Path, subprocess.Popen[bytes]]] = field(default_factory=list)

    def run(self, container_id: str) -> subprocess.Popen[bytes]:
        """A holder of the fake GPU as the init of container ``container_id``."""
        cgroup = CGROUP2 / "docker" / container_id
        cgroup.mkdir(parents=True, exist_ok=True)
        holder = subprocess.Popen(
            [sys.executable, "-c", f"f = open({str(self.gpu)!r}); import time; time.sleep(600)"]
        )
        (cgroup / "cgroup.procs").write_text(f"{holder.pid}\n")
        self.made.append((cgroup, holder))
        deadline = time.monotonic() + 10
        while not any(
            self.gpu.name in str(fd.readlink()) for fd in Path(f"/proc/{holder.pid}/fd").iterdir()
        ):
            assert time.monotonic() < deadline, "the holder never opened the GPU file"
            time.sleep(0.02)
        return holder

    def remove(self) -> None:
        """Kill what is left and remove the cgroups."""
        for cgroup, holder in self.made:
            holder.kill()
            holder.wait()
            with contextlib.suppress(OSError):
                cgroup.rmdir()
        with contextlib.suppress(OSError):
            (CGROUP2 / "docker").rmdir()


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
        pytest.param(_owned_by_nobody, "owned by uid 65534", id="socket-of-another-user"),
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
