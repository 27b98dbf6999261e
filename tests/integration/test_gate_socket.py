"""The gate through its socket: real UNIX sockets, real server processes, real cgroups.

A listening socket in a temporary directory stands in for gpuguard-gate.socket: each connection
is handed, as standard input, to a new `gpuguard serve-gate` process, exactly as systemd's
Accept=yes and StandardInput=socket do. Clients are real `gpuguard gate`/`reap` processes, moved
into cgroups named like units (the unit_cgroups fixture) where a test needs "a process of".
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from clirunner import CliResult

from gpuguard.adapters import unitenv
from gpuguard.core.gateproto import frame_exit, parse_frame

if TYPE_CHECKING:
    from collections.abc import Iterator

    from clirunner import Cli, UnitCgroups
    from fakeholder import HolderSpawner

NOBODY = 65534
_CLIENT = [sys.executable, "-m", "gpuguard"]


@dataclass
class GateServer:
    """A socket whose every connection is served by a fresh `gpuguard serve-gate` process."""

    path: Path
    cli: Cli
    listener: socket.socket
    log: Path
    served: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def accept_forever(self) -> None:
        """Serve every connection until the listener is closed."""
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn, self.log.open("ab") as log:
                argv = [sys.executable, "-m", "gpuguard", "--config", str(self.cli.config)]
                self.served.append(
                    subprocess.Popen(
                        [*argv, "serve-gate"],
                        stdin=conn.fileno(),
                        stdout=log,
                        stderr=log,
                        env=self.cli.env,
                    )
                )

    def said(self) -> str:
        """What the server instances wrote so far."""
        return self.log.read_text() if self.log.exists() else ""

    def journal(self) -> str:
        """What the server instances wrote to their own output (the journal, under systemd)."""
        for process in self.served:
            process.wait(timeout=60)
        return self.log.read_text()


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A directory every user can reach (pytest's tmp_path lies under a 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix="gpuguard-gate-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def server(cli: Cli, tmp_path: Path, public_dir: Path) -> Iterator[GateServer]:
    """A gate server listening on a gate.sock anyone can reach (mode 0666, like the unit's)."""
    path = public_dir / "gate.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    path.chmod(0o666)
    listener.listen(8)
    gate_server = GateServer(path, cli, listener, tmp_path / "server.log")
    thread = threading.Thread(target=gate_server.accept_forever, daemon=True)
    thread.start()
    yield gate_server
    listener.shutdown(socket.SHUT_RDWR)
    listener.close()
    thread.join(timeout=5)
    for process in gate_server.served:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)


def client(
    cli: Cli,
    *args: str,
    cgroup: Path | None = None,
    uid: int | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60,
) -> CliResult:
    """`gpuguard ARGS` as a client: optionally in a unit's cgroup (as ExecStartPre=), as ``uid``."""
    argv = ["--config", str(cli.config), *args]
    # The interpreter lives under /root here (mode 0700): a uid is taken after it has started and
    # has imported everything the client needs, as a service's User= would have it from the start.
    code = (
        "import os, sys, socket, json\n"
        "import gpuguard.cli, gpuguard.adapters.gateclient, gpuguard.config\n"
        "import gpuguard.commands.relay, gpuguard.commands.gate\n"
    )
    if uid is not None:
        code += f"os.setgroups([]); os.setgid({uid}); os.setuid({uid})\n"
    code += f"sys.exit(gpuguard.cli.main({argv!r}))\n"
    script = f"exec {shlex.join([sys.executable, '-c', code])}"
    if cgroup is not None:
        script = f"echo $$ > {shlex.quote(str(cgroup / 'cgroup.procs'))} && {script}"
    done = subprocess.run(
        ["sh", "-c", script],
        capture_output=True,
        text=True,
        env={**cli.env, **(env or {})},
        timeout=timeout,
        check=False,
    )
    return CliResult(done.returncode, done.stdout, done.stderr)


def unit_name() -> str:
    """A unit name unique to this test (cgroups are shared by the whole machine)."""
    return f"sglang-{uuid.uuid4().hex[:8]}.service"


def test_gate_of_a_unit_runs_in_the_server_with_the_units_real_environment(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups
) -> None:
    """ExecStartPre= in the unit: the server passes the start, using the caller's environ."""
    unit = unit_name()
    done = client(
        cli,
        "gate",
        "--unit",
        unit,
        "--socket",
        str(server.path),
        cgroup=unit_cgroups.ensure(unit),
        env={"CUDA_VISIBLE_DEVICES": "1,2"},
    )
    assert done.code == 0, done.err
    assert "gpuguard gate: " in done.err, done.err
    assert "[GPUs 1,2 (CUDA_VISIBLE_DEVICES=1,2)]" in done.err, done.err
    assert "no gate server" not in done.err
    journal = server.journal()
    assert f"gate for {unit} from PID " in journal, journal
    assert f"a process of {unit}): accepted" in journal, journal
    runtime = cli.config.parent / "run"
    assert unitenv.recorded(runtime, unit) == {"CUDA_VISIBLE_DEVICES": "1,2"}
    [decision] = json.loads((runtime / "gate" / f"{unit}.json").read_text())
    assert decision["result"] == "passed"
    assert decision["gpu_set"] == "GPUs 1,2 (CUDA_VISIBLE_DEVICES=1,2)"


def test_a_request_for_another_unit_is_refused_in_one_line(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups
) -> None:
    """A process of unit A asking for unit B: exit 1, one line, nothing done for B."""
    mine, other = unit_name(), unit_name()
    for command in (["gate"], ["reap", "--yes"]):
        done = client(
            cli,
            *command,
            "--unit",
            other,
            "--socket",
            str(server.path),
            cgroup=unit_cgroups.ensure(mine),
        )
        assert done.code == 1, done
        refused = f"{command[0]} request for {other} from a process of {mine}: refused"
        assert done.err.splitlines() == [f"gpuguard {command[0]}: {refused}"], done.err
        assert done.out == ""
    runtime = cli.config.parent / "run"
    assert not (runtime / "gate" / f"{other}.json").exists()
    assert unitenv.recorded(runtime, other) is None
    assert server.journal().count(f"request for {other} from a process of {mine}: refused") == 2


def test_the_server_ends_when_systemd_kills_its_client(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups, spawn_holder: HolderSpawner
) -> None:
    """A cancelled start kills the ExecStartPre= client: the waiting gate must not outlive it.

    Left running, it would take the unit's next run for left-overs of an earlier one.
    """
    spawn_holder(cli.state, gpus=(0,), mib=1000, name="nv-hostengine")  # protected: blocks
    unit = unit_name()
    procs = unit_cgroups.ensure(unit) / "cgroup.procs"
    argv = [*_CLIENT, "--config", str(cli.config), "gate", "--unit", unit]
    command = shlex.join([*argv, "--timeout", "60", "--socket", str(server.path)])
    client_process = subprocess.Popen(
        ["sh", "-c", f"echo $$ > {shlex.quote(str(procs))} && exec {command}"],
        env=cli.env,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while "accepted" not in server.said() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "accepted" in server.said()
    client_process.kill()
    client_process.wait()
    began = time.monotonic()
    server.served[-1].wait(timeout=10)
    assert time.monotonic() - began < 5
    assert "the client has gone: stopping" in server.said()


def test_the_installed_command_asks_without_the_full_parser(cli: Cli, server: GateServer) -> None:
    """The command's entry point sends a drop-in's gate request with the socket client alone.

    No argparse, no dataclasses, nothing of the CLI: the request before every start stays cheap
    (bench/gate.py). The verdict is the server's, so the lane changes nothing else.
    """
    argv = ["--config", str(cli.config), "gate", "--unit", "sglang.service"]
    code = (
        "import sys\n"
        f"sys.argv = ['gpuguard', *{[*argv, '--socket', str(server.path)]!r}]\n"
        "from gpuguard.entry import main\n"
        "code = main()\n"
        "loaded = {'argparse', 'dataclasses', 'gpuguard.cli', 'gpuguard.adapters.configfile'}\n"
        "print(sorted(loaded & set(sys.modules)))\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=cli.env, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]", done.stdout
    assert "gate for sglang.service from PID" in server.journal()


def test_the_client_loads_nothing_heavy(cli: Cli, server: GateServer) -> None:
    """The client runs before every start: no pydantic, structlog, NVML or psutil in it."""
    argv = ["--config", str(cli.config), "gate", "--unit", "sglang.service"]
    code = (
        "import sys\n"
        "from gpuguard.cli import main\n"
        f"code = main({[*argv, '--socket', str(server.path)]!r})\n"
        "heavy = {'pydantic', 'structlog', 'pynvml', 'psutil', 'gpuguard.adapters.nvml',\n"
        "         'gpuguard.config'}\n"
        "print(sorted(m for m in sys.modules if m in heavy or m.split('.')[0] in heavy))\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=cli.env, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[]\n", done.stdout


def test_the_unit_itself_may_not_widen_the_scope(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups
) -> None:
    """Scope "all" would reach other users' processes: only root outside any service asks it."""
    unit = unit_name()
    done = client(
        cli,
        "reap",
        "--unit",
        unit,
        "--yes",
        "--scope",
        "all",
        "--socket",
        str(server.path),
        cgroup=unit_cgroups.ensure(unit),
    )
    assert done.code == 1, done
    assert "(scope all only from root outside any service)" in done.err, done.err


def test_an_unprivileged_user_outside_any_unit_is_refused(cli: Cli, server: GateServer) -> None:
    """Any user can connect (mode 0666); the kernel's credentials decide, not the file mode.

    A caller in no system service could never be answered: it is hung up on before its request
    is read (so it cannot hold a server slot), in one line.
    """
    done = client(cli, "gate", "--unit", "sglang.service", "--socket", str(server.path), uid=NOBODY)
    assert done.code == 1, done
    assert done.err == (
        f"gpuguard: request from a process outside any service (uid {NOBODY}): refused\n"
    )


def test_root_outside_any_unit_is_an_operator(cli: Cli, server: GateServer) -> None:
    """An operator's `sudo gpuguard reap --yes` goes through the server for any unit."""
    done = client(cli, "reap", "--unit", "sglang.service", "--yes", "--socket", str(server.path))
    assert done.code == 0, done.err
    assert "GPU 0: 0 MiB used" in done.out, done.out
    assert "reap for sglang.service from PID" in server.journal()


def test_a_socket_nobody_answers_refuses_the_start(cli: Cli, tmp_path: Path) -> None:
    """The server unreachable: one line, exit 1; gate_unreachable = "allow" lets it start."""
    path = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))  # the file stays, nobody listens: ECONNREFUSED
    done = cli("gate", "--unit", "sglang.service", "--socket", str(path))
    assert done.code == 1
    assert done.err == (
        f"gpuguard gate: cannot reach the gate server at {path} (Connection refused): "
        "start refused\n"
    )
    reap = cli("reap", "--unit", "sglang.service", "--yes", "--socket", str(path))
    assert reap.code == 1
    assert reap.err.endswith("(Connection refused): nothing reaped\n"), reap.err
    cli.configure('gate_unreachable = "allow"\n')
    allowed = cli("gate", "--unit", "sglang.service", "--socket", str(path))
    assert allowed.code == 0, allowed.err
    assert "start allowed without the gate (gate_unreachable = allow)" in allowed.err


def test_no_socket_runs_in_process_for_root_only(cli: Cli, public_dir: Path) -> None:
    """A developer's install: root runs the gate here, with a note; others are refused."""
    path = public_dir / "absent.sock"
    done = cli("gate", "--unit", "sglang.service", "--socket", str(path))
    assert done.code == 0, done.err
    assert f"gpuguard gate: no gate server at {path}: runs here\n" in done.err
    assert "Start allowed" in done.err or "passed" in done.err or "idle" in done.err, done.err
    refused = client(cli, "gate", "--unit", "sglang.service", "--socket", str(path), uid=NOBODY)
    assert refused.code == 1
    assert refused.err == (
        f"gpuguard gate: cannot reach the gate server at {path} (no such socket): start refused\n"
    )


def test_a_malformed_request_gets_a_line_and_64(server: GateServer) -> None:
    """The server parses the peer's bytes totally: garbage gets one line and exit status 64."""
    for garbage in (b"\xff\xfe not json\n", b'{"v": 1, "command": "gate"}\n', b"x" * 5000):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(server.path))
            conn.sendall(garbage)
            conn.shutdown(socket.SHUT_WR)
            with conn.makefile("rb") as reader:
                frames = [parse_frame(line) for line in reader]
        assert frames[-1] is not None
        assert frames[-1].exit == 64, frames
        assert frames[0] is not None
        assert frames[0].text.startswith(f"gpuguard: bad request from PID {os.getpid()}: ")
        assert len(frames) == 2


def test_a_forged_verdict_in_the_output_is_only_text() -> None:
    """A holder's command line that looks like a verdict stays text: frames are JSON."""
    line = frame_exit(0).decode().strip()
    frame = parse_frame(json.dumps({"fd": 2, "text": line}).encode())
    assert frame is not None
    assert frame.exit is None
    assert frame.text == line
