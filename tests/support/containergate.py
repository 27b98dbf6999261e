"""The gate with a container stopper, over the real /proc scan and an NVML stand-in.

Shared by the stand-in engine's tests, the daemon's and the real dockerd's. NVML is a stand-in
(values, not the library): a fake GPU file has no fake-NVML memory behind it, so the reading
lists each live holder of ``nvidia0`` with 1 GiB, as the driver lists a container's processes
by host PID. The engine's stand-in (``FakeEngine``) answers a ``container inspect`` recorded
from docker 20.10 (tests/engine_samples) for the test's containers (``Containers``: real
processes in real ``/docker/<id>`` cgroups) and stops them as the engine would (SIGTERM to
their init).
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
from typing import TYPE_CHECKING, Any

import builders
from builders import gpu, nvml
from clirunner import CGROUP2

from gpuguard.adapters import procfs
from gpuguard.core.gate.run import GateOutcome, GateSettings, run_gate
from gpuguard.core.inventory import Inventory, build_inventory
from gpuguard.core.values import UnitProvenance

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gpuguard.adapters.containerstop import ContainerStopper
    from gpuguard.core.policy import PlanRequest
    from gpuguard.core.values import ReapResult, ReapTarget

UNIT = "sglang.service"


class Log:
    """Collects the stopper's log lines (event, fields)."""

    def __init__(self) -> None:
        """No lines yet."""
        self.lines: list[tuple[str, dict[str, object]]] = []

    def info(self, event: str, **kw: object) -> object:
        """Record an info line."""
        self.lines.append((event, kw))
        return None

    def warning(self, event: str, **kw: object) -> object:
        """Record a warning line."""
        self.lines.append((event, kw))
        return None

    def debug(self, event: str, **kw: object) -> object:
        """Record a debug line."""
        self.lines.append((event, kw))
        return None

    def error(self, event: str, **kw: object) -> object:
        """Record an error line."""
        self.lines.append((event, kw))
        return None

    def critical(self, event: str, **kw: object) -> object:
        """Record a critical line."""
        self.lines.append((event, kw))
        return None

    def events(self) -> list[str]:
        """The events logged, in order."""
        return [event for event, _ in self.lines]


def gather_for(glob: str) -> Inventory:
    """An inventory from the real /proc scan and the NVML stand-in."""
    scan = procfs.scan_device_holders(glob)
    stand_in = gpu(0, *((p.identity.pid, 1024) for p in scan.processes))
    return build_inventory(nvml(stand_in), scan, 0)


def plan_request() -> PlanRequest:
    """The gate's plan request for the unit on GPU 0, as at its ExecStartPre=."""
    request = builders.plan_request(
        gpu_set=frozenset({0}), provenance=UnitProvenance(None, frozenset(), 0)
    )
    return replace(request, untouchable_pids=frozenset({os.getpid()}))


def gate(glob: str, stopper: ContainerStopper, timeout_s: float = 5.0) -> GateOutcome:
    """One gate run with the stopper; the process reaper must never be called."""

    def no_reap(targets: Sequence[ReapTarget]) -> tuple[ReapResult, ...]:
        raise AssertionError(f"nothing in a container is signalled by the reaper: {targets}")

    return run_gate(
        GateSettings(plan_request(), 0, timeout_s, poll_s=0.05),
        lambda: gather_for(glob),
        no_reap,
        time.monotonic,
        time.sleep,
        containers=stopper,
    )


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
    recorded: dict[str, Any] = field(default_factory=lambda: RECORDED)
    """The recorded inspect answer each container's is made from (docker 20.10's; podman's)."""
    server: socketserver.UnixStreamServer | None = None

    def start(self) -> None:
        """Serve on ``path`` in a thread."""
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_: object) -> None:
                pass

            def do_GET(self) -> None:
                asked = self.path.removeprefix("/containers/").removesuffix("/json")
                # As dockerd resolves it: the exact name, else a unique id prefix.
                by_prefix = [
                    n for n, (cid, _) in engine.containers.items() if cid.startswith(asked)
                ]
                name = asked if asked in engine.containers else "".join(by_prefix[:1])
                found = (
                    engine.containers.get(name) if len(by_prefix) <= 1 or name == asked else None
                )
                if found is None:
                    self.answer(404, {"message": f"No such container: {asked}"})
                    return
                answer = json.loads(json.dumps(engine.recorded))
                answer["State"]["Running"] = True
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


@dataclass
class Containers:
    """Real processes in real ``/docker/<id>`` cgroups, holding the fake GPU file."""

    gpu: Path
    made: list[tuple[list[Path], subprocess.Popen[bytes]]] = field(default_factory=list)
    """Each holder, and the cgroup directories made for it."""

    def run(self, container_id: str, cgroup_path: str | None = None) -> subprocess.Popen[bytes]:
        """A holder of the fake GPU as the init of container ``container_id``.

        Its cgroup is ``cgroup_path`` (default ``docker/<id>``, docker's cgroupfs driver).
        """
        cgroup = CGROUP2 / (cgroup_path or f"docker/{container_id}")
        made = [d for d in (cgroup, *cgroup.parents) if CGROUP2 in d.parents and not d.exists()]
        cgroup.mkdir(parents=True, exist_ok=True)
        holder = subprocess.Popen(
            [sys.executable, "-c", f"f = open({str(self.gpu)!r}); import time; time.sleep(600)"]
        )
        (cgroup / "cgroup.procs").write_text(f"{holder.pid}\n")
        self.made.append((made, holder))
        deadline = time.monotonic() + 10
        while not self._holds_gpu(holder.pid):
            assert time.monotonic() < deadline, "the holder never opened the GPU file"
            time.sleep(0.02)
        return holder

    def _holds_gpu(self, pid: int) -> bool:
        """Whether ``pid`` has the fake GPU open; its other fds come and go while it starts."""
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if self.gpu.name in str(fd.readlink()):
                    return True
            except FileNotFoundError:  # closed between the listing and the readlink
                continue
        return False

    def remove(self) -> None:
        """Kill what is left and remove the cgroups."""
        for _, holder in self.made:
            holder.kill()
            holder.wait()
        made = {directory for directories, _ in self.made for directory in directories}
        for directory in sorted(made, key=lambda d: len(d.parts), reverse=True):
            with contextlib.suppress(OSError):
                directory.rmdir()
