"""The gate through its socket: real UNIX sockets, a real forking server, real cgroups.

A listening socket in a temporary directory stands in for gpuguard-gate.socket: it is passed
to one `gpuguard serve-gate` as fd 3 with LISTEN_PID and LISTEN_FDS, exactly as systemd's
Accept=no does (tests/support/socketactivate.py), and that server forks a child per connection.
Clients are real `gpuguard gate`/`reap` processes, moved into cgroups named like units (the
unit_cgroups fixture) where a test needs "a process of". The server asks a double of systemctl
(fake_systemd), which names as a unit's ControlPID= the PID written in ``controls(cli)/UNIT``:
a client started as the unit's ExecStartPre= writes its own there first, as systemd would name
it; any other process of the unit's cgroup does not.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from clirunner import CliResult, gpuguard_argv
from fakeholder import process_gone
from pidreuse import reuse_pid
from slotflood import Hammer, hammer
from socketactivate import activate, await_sigterm_handler, listen

from gpuguard.adapters import unitenv
from gpuguard.core import timeline
from gpuguard.core.gate.proto import CLIENT_GONE, frame_exit, parse_frame

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from clirunner import Cli, FakeSystemd, UnitCgroups
    from fakeholder import HolderSpawner

NOBODY = 65534
_CLIENT = gpuguard_argv()  # the tests' systemctl and journalctl, not this host's


@dataclass
class GateServer:
    """One `gpuguard serve-gate` on a socket it was passed, as gpuguard-gate.service runs."""

    path: Path
    process: subprocess.Popen[bytes]
    log: Path

    def said(self) -> str:
        """What the server and its children wrote so far (the journal, under systemd)."""
        return self.log.read_text() if self.log.exists() else ""

    def children(self) -> list[int]:
        """The request processes running now (the kernel's list of the server's children)."""
        pid = self.process.pid
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]

    def idle(self, timeout: float = 60) -> None:
        """Wait until every request process has ended and been reaped."""
        deadline = time.monotonic() + timeout
        while self.children():
            assert time.monotonic() < deadline, self.said()
            time.sleep(0.02)

    def journal(self) -> str:
        """What was written once every request has ended."""
        self.idle()
        return self.said()


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A directory every user can reach (pytest's tmp_path lies under a 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix="gpuguard-gate-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def controls(cli: Cli) -> Path:
    """Where a unit's control process writes its PID for the systemctl double to name it."""
    return cli.config.parent / "controlpid"


def as_control(cli: Cli, unit: str) -> str:
    """A shell command that makes the shell (and what it execs) the unit's control process."""
    return f"echo $$ > {shlex.quote(str(controls(cli) / unit))} && "


@pytest.fixture
def server(
    cli: Cli, tmp_path: Path, public_dir: Path, fake_systemd: FakeSystemd
) -> Iterator[GateServer]:
    """A gate server listening on a gate.sock anyone can reach (mode 0666, like the unit's).

    systemd, as its double says, is running every unit's ExecStartPre= (start-pre), whose
    process is the one that wrote its PID in ``controls(cli)``.
    """
    if os.geteuid() != 0:
        pytest.skip("the gate server is root's side: as another user it answers no one (root)")
    controls(cli).mkdir()
    fake_systemd("any.service", sub_state="start-pre", control_dir=controls(cli))
    path = public_dir / "gate.sock"
    log = tmp_path / "server.log"
    with listen(path) as listener, log.open("wb") as out:
        argv = [*gpuguard_argv(cli.doubles), "--config", str(cli.config), "serve-gate"]
        process = activate(listener, argv, cli.env, out)
    gate_server = GateServer(path, process, log)
    yield gate_server
    await_sigterm_handler(process)
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    assert process.returncode == 0, gate_server.said()


def client(
    cli: Cli,
    *args: str,
    cgroup: Path | None = None,
    uid: int | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60,
    control: bool = True,
) -> CliResult:
    """`gpuguard ARGS` as a client: optionally in a unit's cgroup (as ExecStartPre=), as ``uid``.

    ``control``: in a unit's cgroup, it is the unit's control process (it writes its PID where
    the systemctl double reads ControlPID=); else just a process of the unit.
    """
    argv = ["--config", str(cli.config), *args]
    # The interpreter lives under /root here (mode 0700): a uid is taken after it has started and
    # has imported everything the client needs, as a service's User= would have it from the start.
    code = (
        "import os, sys, socket, json\n"
        "import gettext, locale\n"  # argparse imports them on its first parser (Python 3.13)
        "import gpuguard.cli, gpuguard.adapters.gateclient, gpuguard.config\n"
        "import gpuguard.commands.relay, gpuguard.commands.gate\n"
    )
    if uid is not None:
        code += f"os.setgroups([]); os.setgid({uid}); os.setuid({uid})\n"
    code += f"sys.exit(gpuguard.cli.main({argv!r}))\n"
    script = f"exec {shlex.join([*cli.prefix(), sys.executable, '-c', code])}"
    if cgroup is not None and control:
        script = f"echo $$ > {shlex.quote(str(controls(cli) / cgroup.name))} && {script}"
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


def watched_unit(cli: Cli) -> str:
    """A unique unit named in the configuration: the server serves only watched units.

    The file is replaced, not rewritten in place: a request in flight reading it meanwhile must
    see the old whole file or the new one, never an empty or half-written one.
    """
    unit = unit_name()
    fresh = cli.config.with_name(f".{cli.config.name}.{unit}")
    fresh.write_text(cli.config.read_text() + f'\n[units."{unit}"]\n')
    fresh.replace(cli.config)
    return unit


def operator_cgroup(unit_cgroups: UnitCgroups, uid: int = 0) -> Path:
    """A login session's scope (unique: cgroups are shared by the whole machine)."""
    session = f"session-t{uuid.uuid4().hex[:8]}.scope"
    return unit_cgroups.ensure(session, f"user.slice/user-{uid}.slice")


def test_gate_of_a_unit_runs_in_the_server_with_the_units_real_environment(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups
) -> None:
    """ExecStartPre= in the unit: the server passes the start, using the caller's environ."""
    unit = watched_unit(cli)
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
    # The root side logs the verdict itself (explain believes only these lines, never the
    # unit's own output, which can print the same words).
    said = rf"gate for {re.escape(unit)} from PID \d+: "
    assert re.search(said + r"gpuguard gate: .*\[GPUs 1,2 \(CUDA_VISIBLE", journal), journal
    assert re.search(said + r"exit 0$", journal, re.MULTILINE), journal
    runtime = cli.config.parent / "run"
    assert unitenv.recorded(runtime, unit) == {"CUDA_VISIBLE_DEVICES": "1,2"}
    [decision] = json.loads((runtime / "gate" / f"{unit}.json").read_text())
    assert decision["result"] == "passed"
    assert decision["gpu_set"] == "GPUs 1,2 (CUDA_VISIBLE_DEVICES=1,2)"


def test_a_request_for_another_unit_is_refused_in_one_line(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups
) -> None:
    """A process of unit A asking for unit B: exit 1, one line, nothing done for B."""
    mine, other = watched_unit(cli), watched_unit(cli)
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
    unit = watched_unit(cli)
    procs = unit_cgroups.ensure(unit) / "cgroup.procs"
    argv = [*_CLIENT, "--config", str(cli.config), "gate", "--unit", unit]
    command = shlex.join([*argv, "--timeout", "60", "--socket", str(server.path)])
    client_process = subprocess.Popen(
        [
            "sh",
            "-c",
            f"{as_control(cli, unit)}echo $$ > {shlex.quote(str(procs))} && exec {command}",
        ],
        env=cli.env,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while "accepted" not in server.said() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "accepted" in server.said()
    [request] = server.children()
    client_process.kill()
    client_process.wait()
    began = time.monotonic()
    while request in server.children() and time.monotonic() - began < 10:
        time.sleep(0.02)
    assert time.monotonic() - began < 5
    assert f"gate for {unit} from PID {client_process.pid}: {CLIENT_GONE}\n" in server.said()


def test_a_stop_reap_whose_client_dies_mid_way_is_recorded_with_its_outcome_unknown(
    cli: Cli,
    fake_systemd: FakeSystemd,
    unit_cgroups: UnitCgroups,
    spawn_holder: HolderSpawner,
    tmp_path: Path,
    public_dir: Path,
) -> None:
    """The unit's ExecStopPost= reap is killed while it waits out a SIGTERM: told as cut short.

    The request ends with its client (as before), and its own last journal line, under its
    prefix and in place of "exit N", says its outcome is unknown; explain shows that, and no
    outcome for the process it had only SIGTERMed. Before, the server wrote an unprefixed line
    that explain dropped: the stop-reap read as accepted, a SIGTERM, and nothing more.
    """
    unit = watched_unit(cli)
    # Its ExecStopPost= runs: everything in its cgroup is left over (User= unset: root).
    controls(cli).mkdir()
    fake_systemd(unit, sub_state="stop-post", control_dir=controls(cli))
    stubborn = spawn_holder(cli.state, gpus=(0,), mib=1000, ignore_sigterm=True)
    unit_cgroups.move(stubborn.pid, unit)
    path = public_dir / "gate.sock"
    log = tmp_path / "doubled-server.log"
    with listen(path) as listener, log.open("wb") as out:
        argv = [*gpuguard_argv(cli.doubles), "--config", str(cli.config), "serve-gate"]
        process = activate(listener, argv, cli.env, out)
    server = GateServer(path, process, log)
    try:
        procs = shlex.quote(str(unit_cgroups.ensure(unit) / "cgroup.procs"))
        reap = shlex.join([*_CLIENT, "--config", str(cli.config), "reap", "--unit", unit])
        client_process = subprocess.Popen(
            [
                "sh",
                "-c",
                (
                    f"{as_control(cli, unit)}echo $$ > {procs} && exec {reap} --yes --grace 60 "
                    f"--socket {path}"
                ),
            ],
            env=cli.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        sigterm = re.compile(rf"\] signal +pid={stubborn.pid} .*signal=SIGTERM")
        while not sigterm.search(server.said()):
            assert time.monotonic() < deadline, server.said()
            time.sleep(0.05)
        client_process.kill()  # systemd's stop timeout ends the ExecStopPost= mid-way
        client_process.wait()
        server.idle()
    finally:
        process.terminate()
        process.wait(timeout=30)
    prefix = f"reap for {unit} from PID {client_process.pid}: "
    lines = server.said().splitlines()
    assert f"{prefix}{CLIENT_GONE}" in lines
    assert not [line for line in lines if line.startswith(prefix + "exit ")]
    entries = [
        {
            "__MONOTONIC_TIMESTAMP": str(1_000_000 + step),
            "_BOOT_ID": "b" * 32,
            "MESSAGE": line,
            "_SYSTEMD_UNIT": "gpuguard-gate.service",
            "_TRANSPORT": "stdout",
            "_PID": "77",
            "_UID": "0",
        }
        for step, line in enumerate(lines)
    ]
    found = timeline.build(entries, unit)
    assert [row.kind for row in found.rows if row.kind.startswith("reap-a")] == ["reap-abandoned"]
    assert f"{prefix}{CLIENT_GONE}" in found.story.gpuguard
    assert not [row for row in found.rows if row.kind == "reap-outcome"]
    assert not process_gone(stubborn.pid)  # SIGTERMed, never SIGKILLed: the next gate's to free


def in_cgroup(argv: list[str], cgroup: Path) -> list[str]:
    """``argv`` run from ``cgroup`` (a shell moves itself there, then execs it)."""
    procs = shlex.quote(str(cgroup / "cgroup.procs"))
    return ["sh", "-c", f"echo $$ > {procs} && exec {shlex.join(argv)}"]


def test_the_installed_command_asks_without_the_full_parser(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups
) -> None:
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
        in_cgroup([sys.executable, "-c", code], operator_cgroup(unit_cgroups)),
        capture_output=True,
        text=True,
        env=cli.env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]", done.stdout
    assert "gate for sglang.service from PID" in server.journal()


def test_the_client_loads_nothing_heavy(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups
) -> None:
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
        in_cgroup([sys.executable, "-c", code], operator_cgroup(unit_cgroups)),
        capture_output=True,
        text=True,
        env=cli.env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[]\n", done.stdout


def test_the_unit_itself_may_not_widen_the_scope(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups
) -> None:
    """Scope "all" would reach other users' processes: only root outside any service asks it."""
    unit = watched_unit(cli)
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
    assert "(scope all only from root in a login session (ssh, or sudo from one))" in done.err, (
        done.err
    )


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


def test_root_in_a_login_session_is_an_operator(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups
) -> None:
    """`sudo gpuguard reap --yes` from anyone's session (its scope kept) works for any unit."""
    for uid in (0, 1000):
        done = client(
            cli,
            "reap",
            "--unit",
            "sglang.service",
            "--yes",
            "--socket",
            str(server.path),
            cgroup=operator_cgroup(unit_cgroups, uid),
        )
        assert done.code == 0, done.err
        assert "GPU 0: 0 MiB used" in done.out, done.out
    assert server.journal().count("): accepted") == 2


def test_root_in_a_scope_that_is_no_login_session_is_refused(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups
) -> None:
    """Root in `systemd-run --scope` or a container runtime's scope is no operator: one line."""
    for scope in ("run-r0123456789abcdef.scope", "nerdctl-0123456789abcdef0123.scope"):
        done = client(
            cli,
            "reap",
            "--unit",
            "sglang.service",
            "--yes",
            "--scope",
            "all",
            "--socket",
            str(server.path),
            cgroup=unit_cgroups.ensure(f"{uuid.uuid4().hex[:6]}-{scope}"),
        )
        assert done.code == 1, done
        [line] = done.err.splitlines()
        operator = "root in a login session (ssh, or sudo from one)"
        assert line.endswith(f": refused (root is an operator only as {operator})"), line
        assert done.out == ""
    assert "reap for sglang.service from PID" not in server.journal()


def test_an_unwatched_units_request_is_refused_in_one_line(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups
) -> None:
    """A shared service nobody configured (cron.service): its jobs' gate and reap are refused."""
    unit = unit_name()
    for command in (["gate"], ["reap", "--yes"]):
        for uid in (0, NOBODY):
            done = client(
                cli,
                *command,
                "--unit",
                unit,
                "--socket",
                str(server.path),
                cgroup=unit_cgroups.ensure(unit),
                uid=None if uid == 0 else uid,
            )
            assert done.code == 1, done
            said = (
                f"gpuguard: request from a process of {unit}: refused ({unit} is not watched by "
                "gpuguard: neither configured nor with its gate drop-in installed)"
            )
            assert done.err.splitlines() == [said], done.err
    runtime = cli.config.parent / "run"
    assert not (runtime / "gate" / f"{unit}.json").exists()
    assert f"{command[0]} for {unit} from PID" not in server.journal()


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


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the gate as root and drops to nobody (root)")
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


def test_a_request_imports_nothing_the_server_has_not(
    cli: Cli,
    tmp_path: Path,
    public_dir: Path,
    unit_cgroups: UnitCgroups,
    fake_systemd: FakeSystemd,
) -> None:
    """Everything a request runs is imported once, before the first fork (the warm server).

    The server here is the real command with gaterequest.serve wrapped to log the modules each
    child imported while serving: the fast-path gate, the full gate and the reap import none.
    """
    probe = (
        "import sys\n"
        "from gpuguard.adapters import gaterequest\n"
        "serve = gaterequest.serve\n"
        "def counted(conn, handle, log, **options):\n"
        "    before = set(sys.modules)\n"
        "    code = serve(conn, handle, log, **options)\n"
        "    log.write(f'imported {sorted(set(sys.modules) - before)}\\n')\n"
        "    return code\n"
        "gaterequest.serve = counted\n"
        "from gpuguard.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    controls(cli).mkdir()
    fake_systemd("any.service", sub_state="start-pre", control_dir=controls(cli))
    path, log = public_dir / "gate.sock", tmp_path / "server.log"
    with listen(path) as listener, log.open("wb") as out:
        argv = [
            *cli.prefix(),
            *[sys.executable, "-c", probe, "--config", str(cli.config), "serve-gate"],
        ]
        process = activate(listener, argv, cli.env, out)
    try:
        unit = watched_unit(cli)
        cgroup = unit_cgroups.ensure(unit)
        # A changed file misses the validated-config cache: the first gate takes the full path.
        cli.config.write_text(cli.config.read_text() + "# changed\n")
        for command in (["gate"], ["gate"], ["reap", "--yes"]):
            done = client(cli, *command, "--unit", unit, "--socket", str(path), cgroup=cgroup)
            assert done.code == 0, done.err
    finally:
        process.terminate()
        process.wait(timeout=30)
    imported = [line for line in log.read_text().splitlines() if line.startswith("imported")]
    assert imported == ["imported []"] * 3, log.read_text()


FLOODER = """
import json, os, socket, sys
path, uid, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.setgroups([]); os.setgid(uid); os.setuid(uid)
held = []
for _ in range(count):
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    held.append(conn)
print("connected", flush=True)
sys.stdin.readline()  # the test's event: the server has dealt with every connection
answers = []
for conn in held:
    try:
        answers.append(conn.recv(4096, socket.MSG_DONTWAIT).decode())
    except BlockingIOError:
        answers.append(None)
print(json.dumps(answers), flush=True)
sys.stdin.read()
"""


@dataclass
class Flood:
    """A process of a unit, as one user, holding connections it sends nothing on."""

    process: subprocess.Popen[str]

    def answers(self) -> list[str | None]:
        """What each connection has been told so far (None: nothing yet, it is held)."""
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write("report\n")
        self.process.stdin.flush()
        answers: list[str | None] = json.loads(self.process.stdout.readline())
        return answers


def flood(path: Path, cgroup: Path, uid: int, count: int) -> Flood:
    """Open ``count`` connections as ``uid`` from ``cgroup``; they stay open until stopped."""
    script = f"exec {shlex.join([sys.executable, '-c', FLOODER, str(path), str(uid), str(count)])}"
    process = subprocess.Popen(
        ["sh", "-c", f"echo $$ > {shlex.quote(str(cgroup / 'cgroup.procs'))} && {script}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline() == "connected\n"
    return Flood(process)


def _told(answer: str | None) -> str | None:
    """The first line a connection was told, None when it was told nothing yet."""
    if answer is None:
        return None
    frame = parse_frame(answer.splitlines()[0].encode())
    assert frame is not None, answer
    return frame.text


def test_a_flood_from_one_user_leaves_other_units_their_gate(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups
) -> None:
    """Four users' 64 connections that send nothing: a watched unit's gate passes meanwhile.

    Only a watched unit's control process and operators get a slot: a watched unit's other
    processes are each told so in one line, nothing forked for them; an unwatched unit's and a
    login session's connections get their one refusal line before a process is forked. The
    parent survives it, starts no thread and reaps every child. Event-bound: the answers are
    read once the gate that connected after the whole flood has been served (the parent takes
    connections in order).
    """
    flooding = watched_unit(cli)
    unwatched = unit_name()
    sessions = (operator_cgroup(unit_cgroups, NOBODY - 2), operator_cgroup(unit_cgroups, 0))
    floods = [
        flood(server.path, unit_cgroups.ensure(flooding), NOBODY, 16),
        flood(server.path, unit_cgroups.ensure(unwatched), NOBODY - 1, 16),
        flood(server.path, sessions[0], NOBODY - 2, 16),
        flood(server.path, unit_cgroups.ensure(flooding), NOBODY - 3, 16),
    ]
    unit = watched_unit(cli)
    try:
        done = client(
            cli,
            "gate",
            "--unit",
            unit,
            "--socket",
            str(server.path),
            cgroup=unit_cgroups.ensure(unit),
        )
        assert done.code == 0, done.err
        told = [[_told(answer) for answer in each.answers()] for each in floods]
        flooded = told[0] + told[3]
        for line in flooded:
            assert line is not None, told
            assert f"of {flooding}: refused (only the unit's control process" in line, line
        not_watched = f"{unwatched} is not watched by gpuguard"
        assert all(line is not None and not_watched in line for line in told[1]), told[1]
        session = f"request from a process of {sessions[0].name}: refused"
        assert told[2] == [f"gpuguard: {session}"] * 16, told[2]
        assert len(server.children()) <= 2
        # The operator is never crowded out: root in a login session is served at once.
        root = client(
            cli, "reap", "--unit", unit, "--yes", "--socket", str(server.path), cgroup=sessions[1]
        )
        assert root.code == 0, root.err
    finally:
        for each in floods:
            each.process.kill()
            each.process.communicate()  # waits, closes the pipes
    server.idle(timeout=30)
    assert "turned away" in server.said()
    threads = list(Path(f"/proc/{server.process.pid}/task").iterdir())
    assert len(threads) == 1, "the parent starts no thread (it forks)"


def test_a_waiting_gate_does_not_hold_up_the_next_request(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups, spawn_holder: HolderSpawner
) -> None:
    """One request's process may wait for minutes; the parent answers the next one meanwhile."""
    spawn_holder(cli.state, gpus=(0,), mib=1000, name="nv-hostengine")  # protected: blocks
    unit = watched_unit(cli)
    procs = unit_cgroups.ensure(unit) / "cgroup.procs"
    argv = [*_CLIENT, "--config", str(cli.config), "gate", "--unit", unit, "--timeout", "60"]
    command = shlex.join([*argv, "--socket", str(server.path)])
    waiting = subprocess.Popen(
        [
            "sh",
            "-c",
            f"{as_control(cli, unit)}echo $$ > {shlex.quote(str(procs))} && exec {command}",
        ],
        env=cli.env,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while "accepted" not in server.said() and time.monotonic() < deadline:
            time.sleep(0.1)
        other = watched_unit(cli)
        done = client(
            cli,
            "gate",
            "--unit",
            other,
            "--socket",
            str(server.path),
            cgroup=unit_cgroups.ensure(other),
            env={"CUDA_VISIBLE_DEVICES": "1"},
        )
        assert done.code == 0, done.err
        assert waiting.poll() is None, "the first gate still waits"
    finally:
        waiting.kill()
        waiting.wait()


FORK_SERVER = """
import os, socket, subprocess, sys, time
from gpuguard.adapters import controlasks, gateserver
class Everyone(controlasks.ControlAsks):  # the counting alone: every caller is its unit's
    def decide(self, unit, pid, started):
        return True
listener = gateserver.take_listener(os.environ)
work, limit, requests, mode = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def serve_one(conn, pidfd):
    if mode == "helper":  # a helper in the request's group, as an NVML worker or systemctl
        helper = subprocess.Popen(["sleep", "600"])
        conn.sendall(f"helper {helper.pid}\\n".encode())
    conn.sendall(b"serving\\n")
    if mode == "wait":  # until the client says so: tests wait for events, not for time
        conn.recv(1)
    else:
        time.sleep(work)
    conn.sendall(b"done\\n")
    return 0
def who(pid, uid):  # uid 0 is the operator, uid N a process of the watched unit uN.service
    return gateserver.OPERATOR if uid == 0 else f"u{uid}.service"
limits = gateserver.Limits(requests=requests, seconds=limit, operator_slots=1)
if mode == "emfile":  # no descriptor left for accept() once the server's own pipe is made
    import resource
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, hard))
    filled = []
    try:
        while True:
            filled.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 3, hard))
    filled += [os.open(os.devnull, os.O_RDONLY) for _ in range(2)]
    os.close(filled.pop()); os.close(filled.pop())  # the server's own wake-up pipe
every = Everyone()
sys.exit(gateserver.serve_forever(listener, serve_one, sys.stderr, limits, who=who, controls=every))
"""


def fork_server(
    public_dir: Path,
    tmp_path: Path,
    cli: Cli,
    work_s: float,
    limit_s: float,
    *,
    requests: int = 64,
    mode: str = "sleep",
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """serve_forever with a request that takes ``work_s``, killed after ``limit_s``.

    ``mode`` "wait": a request ends when its client sends a byte; "helper": it starts a
    ``sleep`` in its group first and says its PID. Peers are classified by uid (FORK_SERVER).
    """
    path, log = public_dir / "fork.sock", tmp_path / "fork.log"
    with listen(path) as listener, log.open("wb") as out:
        argv = [sys.executable, "-c", FORK_SERVER, str(work_s), str(limit_s), str(requests), mode]
        return activate(listener, argv, cli.env, out), path, log


HOLDER = """
import os, socket, sys
path, uid = sys.argv[1], int(sys.argv[2])
if uid:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
conn = socket.socket(socket.AF_UNIX)
conn.connect(path)
print("connected", flush=True)
reader = conn.makefile("rb")
for line in iter(reader.readline, b""):
    print(line.decode().rstrip("\\n"), flush=True)
    if line == b"serving\\n":
        sys.stdin.readline()  # until the test says the request may end
        conn.sendall(b"x")
print("closed", flush=True)
"""


@dataclass
class Held:
    """A client of the fork server as ``uid``, holding its request until told to end it."""

    process: subprocess.Popen[str]

    def line(self) -> str:
        """The next line it printed (what the server sent, "connected", "closed")."""
        assert self.process.stdout is not None
        return self.process.stdout.readline().rstrip("\n")

    def end(self) -> None:
        """Let its request end (the server's child answers "done" and exits)."""
        assert self.process.stdin is not None
        self.process.stdin.write("end\n")
        self.process.stdin.flush()


def hold(path: Path, uid: int) -> Held:
    """Connect as ``uid`` and return once connected (the parent has queued the connection)."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), str(uid)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    held = Held(process)
    assert held.line() == "connected"
    return held


def answer(path: Path) -> bytes:
    """Everything the server sends on one connection, until it closes it."""
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(path))
        conn.settimeout(20)
        with conn.makefile("rb") as reader:
            return reader.read()


def test_a_request_past_its_time_limit_is_killed_with_its_group(
    cli: Cli, tmp_path: Path, public_dir: Path
) -> None:
    """RuntimeMaxSec= of the per-connection unit, now the parent's: the child's group dies."""
    server, path, log = fork_server(public_dir, tmp_path, cli, work_s=60, limit_s=1)
    try:
        began = time.monotonic()
        assert answer(path) == b"serving\n"
        assert time.monotonic() - began < 10
        assert answer(path) == b"serving\n", "the parent serves on"
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert log.read_text().count("ran 1 s: killed") == 2, log.read_text()


def test_sigterm_stops_accepting_and_lets_requests_finish(
    cli: Cli, tmp_path: Path, public_dir: Path
) -> None:
    """Stopping the service: no new connection is taken, the one in progress gets its answer."""
    server, path, log = fork_server(public_dir, tmp_path, cli, work_s=2, limit_s=60)
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(path))
        conn.settimeout(20)
        with conn.makefile("rb") as reader:
            assert reader.readline() == b"serving\n"
            server.terminate()
            deadline = time.monotonic() + 10
            while "stopping" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert "stopping" in log.read_text()
            with pytest.raises(ConnectionRefusedError), socket.socket(socket.AF_UNIX) as late:
                late.connect(str(path))
            assert reader.read() == b"done\n"
    assert server.wait(timeout=10) == 0
    assert "stopping: waiting for 1 request(s) in progress" in log.read_text()


@pytest.mark.parametrize(
    ("environment", "said"),
    [
        ({}, "no socket passed to this process (LISTEN_PID is not its PID)"),
        ({"LISTEN_PID": "1", "LISTEN_FDS": "1"}, "no socket passed to this process"),
    ],
)
def test_serve_gate_runs_only_on_a_socket_systemd_passed(
    cli: Cli, environment: dict[str, str], said: str
) -> None:
    """Started by hand (or with inherited LISTEN_* variables) it serves nothing: exit 71."""
    done = subprocess.run(
        [*_CLIENT, "--config", str(cli.config), "serve-gate"],
        env={**cli.env, **environment},
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 71
    assert said in done.stderr
    assert done.stderr.endswith(": run by gpuguard-gate.socket only\n")


def test_a_passed_socket_that_is_not_listening_is_refused(cli: Cli) -> None:
    """The fd 3 must be a listening UNIX stream socket: a connected one is not served."""
    left, right = socket.socketpair()
    with left, right:
        done = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).parents[1] / "support" / "socketactivate.py"),
                str(left.fileno()),
                *_CLIENT,
                "--config",
                str(cli.config),
                "serve-gate",
            ],
            pass_fds=(left.fileno(),),
            env=cli.env,
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
    assert done.returncode == 71
    assert "fd 3 is not a listening UNIX stream socket" in done.stderr


def test_a_caller_whose_proc_files_block_cannot_hold_a_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller whose /proc files block (environ in a FUSE mapping) holds no request slot.

    The request's process ends at the unauthorized limit (SIGALRM) instead of blocking.

    The blocking read is a FIFO nobody writes, standing in for the caller's ``environ`` in a
    /proc tree whose other files link to the real ones (FUSE cannot be mounted here).
    """
    from gpuguard.adapters import gaterequest  # noqa: PLC0415 - the module under test

    me = os.getpid()
    caller_dir = tmp_path / "proc" / str(me)
    caller_dir.mkdir(parents=True)
    for name in ("stat", "cgroup"):
        (caller_dir / name).symlink_to(f"/proc/{me}/{name}")
    os.mkfifo(caller_dir / "environ")
    monkeypatch.setattr(gaterequest, "UNAUTHORIZED_LIMIT_S", 1)
    ours, theirs = socket.socketpair()
    child = os.fork()
    if child == 0:  # pragma: no cover - the request's process
        ours.close()
        own = os.getpid()
        (tmp_path / "proc" / str(own)).symlink_to(f"/proc/{own}")
        proc = tmp_path / "proc"
        gaterequest.serve(theirs, lambda *_: 0, sys.stderr, watched=lambda _: True, proc_root=proc)
        os._exit(0)
    theirs.close()
    deadline = time.monotonic() + 10
    ended, status = 0, 0
    while not ended and time.monotonic() < deadline:
        ended, status = os.waitpid(child, os.WNOHANG)
        time.sleep(0.05)
    if not ended:
        os.kill(child, 9)
        os.waitpid(child, 0)
    ours.close()
    assert ended, "the request's process was still blocked after 10 s"
    assert os.WIFSIGNALED(status)
    assert os.WTERMSIG(status) == 14  # SIGALRM


def test_one_request_per_unit_and_the_operators_slots(
    cli: Cli, tmp_path: Path, public_dir: Path
) -> None:
    """Three slots, one the operator's: two units hold two, a third unit is told, root is served.

    A unit's second request waits for its first and runs when it ends; a third is told why.
    """
    if os.geteuid() != 0:
        pytest.skip("needs root: clients connect as several uids")
    server, path, _ = fork_server(public_dir, tmp_path, cli, 0, 60, requests=3, mode="wait")
    clients: list[Held] = []
    try:
        first = hold(path, 1001)
        clients.append(first)
        assert first.line() == "serving"
        second = hold(path, 1001)  # the same unit: waits
        clients.append(second)
        other = hold(path, 1002)
        clients.append(other)
        assert other.line() == "serving"  # taken after `second`: that one is queued by now
        third = hold(path, 1001)
        clients.append(third)
        assert _told(third.line()) == (
            "gpuguard: the gate server is busy (a request of u1001.service is in progress and "
            "another waits): request refused"
        )
        crowd = hold(path, 1003)
        clients.append(crowd)
        assert _told(crowd.line()) == (
            "gpuguard: the gate server is busy (2 units' requests in progress; the other slots "
            "are the operator's): request refused"
        )
        operator = hold(path, 0)
        clients.append(operator)
        assert operator.line() == "serving"
        first.end()
        assert [first.line(), first.line()] == ["done", "closed"]
        assert second.line() == "serving", "it ran once the first had ended"
    finally:
        for each in clients:
            each.process.kill()
            each.process.communicate()
        server.terminate()
        server.wait(timeout=30)


def test_a_requests_helpers_end_with_it(cli: Cli, tmp_path: Path, public_dir: Path) -> None:
    """A request that ends leaves nothing behind: its group is killed before it is reaped."""
    server, path, _ = fork_server(public_dir, tmp_path, cli, 0, 60, mode="helper")
    helper = 0
    try:
        said = answer(path).decode().splitlines()
        assert said[1:] == ["serving", "done"], said
        helper = int(said[0].removeprefix("helper "))
        deadline = time.monotonic() + 10
        while not _gone(helper) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _gone(helper), "the request's helper outlived it"
    finally:
        if helper and not _gone(helper):
            os.kill(helper, 9)
        server.terminate()
        server.wait(timeout=30)


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie counts: it is only waiting for its reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_accept_out_of_descriptors_backs_off_instead_of_spinning(
    cli: Cli, tmp_path: Path, public_dir: Path
) -> None:
    """EMFILE from accept(): the parent pauses 0.05, 0.1, 0.2, 0.4 s (a line each), never spins.

    The connection stays queued in the socket meanwhile; on main each failure returned to
    poll(), which answered at once, for as long as the descriptors were short.
    """
    server, path, log = fork_server(public_dir, tmp_path, cli, 0, 60, mode="emfile")
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(path))
        try:
            deadline = time.monotonic() + 30
            while "backing off 0.4 s" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.02)
            failed = [line for line in log.read_text().splitlines() if "accept failed" in line]
            pauses = [line.rsplit(" ", 2)[-2] for line in failed[:4]]
            assert pauses == ["0.05", "0.1", "0.2", "0.4"], log.read_text()
            assert len(failed) <= 5, failed  # the next pause (0.8 s) may have begun
            assert failed[0].startswith("accept failed: Too many open files: backing off")
        finally:
            server.terminate()
            server.wait(timeout=30)


def test_a_units_own_gate_waits_no_longer_than_gate_timeout_s(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups, spawn_holder: HolderSpawner
) -> None:
    """A unit's request asking --timeout 3600 is held to gate_timeout_s (here 1 s): no slot-hog."""
    spawn_holder(cli.state, gpus=(0,), mib=1000, name="nv-hostengine")  # protected: blocks
    cli.configure("gate_timeout_s = 1\n")
    unit = watched_unit(cli)
    done = client(
        cli,
        "gate",
        "--unit",
        unit,
        "--timeout",
        "3600",
        "--socket",
        str(server.path),
        cgroup=unit_cgroups.ensure(unit),
    )
    assert done.code == 1, done
    assert f"GPUs of {unit} still busy after 1." in done.err, done.err


def test_strangers_hammering_the_socket_never_take_the_units_slot(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups
) -> None:
    """96 requests in flight from two users outside any watched unit: the unit is served.

    Each stranger asks again the moment it is answered (a login session's and an unwatched
    service's processes, 48 in flight each, every one asking the longest gate): all are told
    their one refusal line before a process is forked, none is told the server is busy, and
    the watched unit's start and stop-reap are both served - the second only once the parent
    has reaped the first, which a queue the flood keeps full must not prevent.
    """
    unwatched = unit_name()
    strangers = (
        (operator_cgroup(unit_cgroups, NOBODY - 1), NOBODY - 1),
        (unit_cgroups.ensure(unwatched), NOBODY - 2),
    )
    unit = watched_unit(cli)
    cgroup = unit_cgroups.ensure(unit)
    floods: list[Hammer] = []
    try:
        for where, uid in strangers:
            floods.append(hammer(server.path, where, uid, 48, unit))
        done = [
            client(cli, *command, "--unit", unit, "--socket", str(server.path), cgroup=cgroup)
            for command in (["gate"], ["reap", "--yes"])
        ]
        tallies = [each.stop() for each in floods]
    finally:
        for each in floods:
            each.kill()
    for result in done:
        assert result.code == 0, result.err
        assert "busy" not in result.err, result.err
    for tally in tallies:
        assert tally["answers"], tally
        assert tally["answers"] == tally["refused"], tally
        assert tally["busy"] == 0, tally
    journal = server.journal()
    assert f"gate for {unit} from PID" in journal
    assert f"reap for {unit} from PID" in journal


QUEUED = """
import os, socket, sys
path, line = sys.argv[1], sys.argv[2].encode() + b"\\n"
conn = socket.socket(socket.AF_UNIX)
conn.connect(path)
conn.sendall(line)
print("connected", flush=True)
sys.stdin.readline()  # the test: the server has taken the connection
if os.fork():
    os._exit(0)  # the caller exits; its child keeps the connection and reads the answer
data = b""
while chunk := conn.recv(65536):
    data += chunk
print(data.decode(errors="replace"), flush=True)
"""


def _sockets(pid: int) -> int:
    """How many sockets ``pid`` holds open."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            count += str(fd.readlink()).startswith("socket:")
    return count


def test_a_pid_reused_while_its_connection_waits_is_not_the_caller(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups, spawn_holder: HolderSpawner
) -> None:
    """A unit's caller exits while queued and its PID goes to root in a session: refused.

    The second request of a unit waits for the first; its caller asked for `reap --scope all`,
    then exited, leaving the connection to its child, and the kernel gave its PID to a root
    process in a login session (an operator's cgroup). The parent pinned the caller as it took
    the connection, so the request's process sees that the caller has gone, instead of taking
    the PID's new owner for the one that asked (the operator, who may order scope all).
    """
    spawn_holder(cli.state, gpus=(0,), mib=1000, name="nv-hostengine")  # protected: blocks
    unit = watched_unit(cli)
    cgroup = unit_cgroups.ensure(unit)
    procs = shlex.quote(str(cgroup / "cgroup.procs"))
    gate = shlex.join([*_CLIENT, "--config", str(cli.config), "gate", "--unit", unit])
    first = subprocess.Popen(
        [
            "sh",
            "-c",
            (
                f"{as_control(cli, unit)}echo $$ > {procs} && exec {gate} --timeout 60 "
                f"--socket {server.path}"
            ),
        ],
        env=cli.env,
        stderr=subprocess.DEVNULL,
    )
    reused: subprocess.Popen[bytes] | None = None
    caller: subprocess.Popen[str] | None = None
    line = json.dumps({"v": 1, "command": "reap", "unit": unit, "scope": "all"})
    queued_argv = shlex.join([sys.executable, "-c", QUEUED, str(server.path), line])
    try:
        deadline = time.monotonic() + 30
        while "accepted" not in server.said():
            assert time.monotonic() < deadline, server.said()
            time.sleep(0.05)
        held = _sockets(server.process.pid)
        caller = subprocess.Popen(
            ["sh", "-c", f"{as_control(cli, unit)}echo $$ > {procs} && exec {queued_argv}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert caller.stdout is not None
        assert caller.stdin is not None
        assert caller.stdout.readline() == "connected\n"
        while _sockets(server.process.pid) <= held:  # taken: classified, queued, pinned
            assert time.monotonic() < deadline, server.said()
            time.sleep(0.01)
        caller.stdin.write("go\n")
        caller.stdin.close()
        assert caller.wait(timeout=30) == 0
        reused = reuse_pid(caller.pid, ["sleep", "600"])
        session = operator_cgroup(unit_cgroups)
        (session / "cgroup.procs").write_text(str(reused.pid))
        first.kill()  # the first request ends with its client; the queued one runs
        answer = caller.stdout.read()
        caller.stdout.close()
    finally:
        first.kill()
        first.wait()
        if reused is not None:
            reused.kill()
            reused.wait()
        if caller is not None:  # a failure above must not leave its pipes for the collector
            for pipe in (caller.stdin, caller.stdout):
                if pipe is not None:
                    pipe.close()
    assert "request refused: the caller has gone" in answer, answer
    assert f"reap for {unit}" not in server.journal()


def _settled(process: subprocess.Popen[bytes], taken: Callable[[], bool]) -> None:
    """Wait until ``process`` (a client) has been answered and ended, or ``taken`` holds."""
    deadline = time.monotonic() + 30
    while process.poll() is None and not taken():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _taken(server: GateServer, said: int, held: int) -> bool:
    """Whether the server served a new request or holds a new connection since the counts."""
    return server.said().count("accepted") > said or _sockets(server.process.pid) > held


def test_other_processes_of_the_unit_never_crowd_out_its_control_process(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups, spawn_holder: HolderSpawner
) -> None:
    """Two gates from the unit's other processes: its ExecStartPre='s gate is served, not busy.

    Before, any process of the cgroup took the unit's one request (a gate that waits for a
    blocked GPU) and its one waiting place, and the unit's own gate was refused "busy"; now
    each of them is told it is not the unit's control process, and nothing is forked for it.
    """
    spawn_holder(cli.state, gpus=(0,), mib=1000, name="nv-hostengine")  # protected: blocks
    unit = watched_unit(cli)
    procs = shlex.quote(str(unit_cgroups.ensure(unit) / "cgroup.procs"))
    gate = shlex.join([*_CLIENT, "--config", str(cli.config), "gate", "--unit", unit])
    others: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(2):
            held = _sockets(server.process.pid)
            said = server.said().count("accepted")
            other = subprocess.Popen(
                [
                    "sh",
                    "-c",
                    f"echo $$ > {procs} && exec {gate} --timeout 60 --socket {server.path}",
                ],
                env={**cli.env, "CUDA_VISIBLE_DEVICES": "0"},
                stderr=subprocess.PIPE,
            )
            others.append(other)
            # Answered and gone (now), or served or queued in the parent (before).
            _settled(other, functools.partial(_taken, server, said, held))
        done = client(
            cli,
            "gate",
            "--unit",
            unit,
            "--socket",
            str(server.path),
            cgroup=unit_cgroups.ensure(unit),
            env={"CUDA_VISIBLE_DEVICES": "1"},
        )
        assert "busy" not in done.err, done.err
        assert done.code == 0, done.err
        for other in others:
            _, err = other.communicate(timeout=30)
            assert other.returncode == 1
            assert b"refused (only the unit's control process" in err, err
    finally:
        for other in others:
            other.kill()
            other.communicate()


def _own_then_another(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups, spawn_holder: HolderSpawner
) -> tuple[str, list[CliResult]]:
    """The unit's ExecStartPre= gate with GPUs 0,1, then another user's process of the unit.

    The other process asks for a gate (``--timeout 1``) and a reap with CUDA_VISIBLE_DEVICES=3,
    where a protected holder makes a gate fail. Returns the unit and their two answers.
    """
    spawn_holder(cli.state, gpus=(3,), mib=1000, name="nv-hostengine")  # protected: blocks
    unit = watched_unit(cli)
    cgroup = unit_cgroups.ensure(unit)
    own = client(
        cli,
        "gate",
        "--unit",
        unit,
        "--socket",
        str(server.path),
        cgroup=cgroup,
        env={"CUDA_VISIBLE_DEVICES": "0,1"},
    )
    assert own.code == 0, own.err
    others = [
        client(
            cli,
            *command,
            "--unit",
            unit,
            "--socket",
            str(server.path),
            cgroup=cgroup,
            uid=NOBODY,
            env={"CUDA_VISIBLE_DEVICES": "3"},
            control=False,
        )
        for command in (["gate", "--timeout", "1"], ["reap", "--yes"])
    ]
    server.idle()
    return unit, others


def test_another_process_of_the_unit_never_rewrites_its_recorded_environment(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups, spawn_holder: HolderSpawner
) -> None:
    """Another user's process of the unit is refused; root's record keeps the unit's GPUs 0,1.

    Before, its gate rewrote unit-env/UNIT.json to CUDA_VISIBLE_DEVICES=3, the GPU set the
    daemon's sweeps and recoveries then used.
    """
    unit, others = _own_then_another(cli, server, unit_cgroups, spawn_holder)
    assert unitenv.recorded(cli.config.parent / "run", unit) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    for other in others:
        assert other.code == 1, other
        assert "refused (only the unit's control process" in other.err, other.err


def test_another_process_of_the_unit_forges_no_decision_counter_or_verdict(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups, spawn_holder: HolderSpawner
) -> None:
    """What another process of the unit asks lands in no history, metric or journal verdict.

    Before, its failing gate was recorded as the unit's "refused" decision (the
    GpuguardGateRefused alert, the decision counters) and the server logged its verdict lines,
    which explain believes.
    """
    unit, _ = _own_then_another(cli, server, unit_cgroups, spawn_holder)
    history = json.loads((cli.config.parent / "run" / "gate" / f"{unit}.json").read_text())
    assert [entry["result"] for entry in history] == ["passed"], history
    prometheus = cli("status", "--prometheus")
    refused = f'gpuguard_gate_last_decision_refused{{unit="{unit}"}} 0.0'
    assert refused in prometheus.out, prometheus.out
    journal = server.journal()
    verdicts = re.findall(rf"(?:gate|reap) for {re.escape(unit)} from PID (\d+): ", journal)
    assert len(set(verdicts)) == 1, journal  # the unit's own gate alone


def test_the_gate_history_says_who_asked(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups
) -> None:
    """Each recorded decision names its caller: PID, UID, control process or operator."""
    unit = watched_unit(cli)
    own = client(
        cli, "gate", "--unit", unit, "--socket", str(server.path), cgroup=unit_cgroups.ensure(unit)
    )
    assert own.code == 0, own.err
    [decision] = json.loads((cli.config.parent / "run" / "gate" / f"{unit}.json").read_text())
    caller = decision["caller"]
    assert (caller["uid"], caller["control_process"], caller["operator"]) == (0, True, False)
    journal = server.journal()
    assert f"gate for {unit} from PID {caller['pid']}: exit 0" in journal, journal


def test_a_non_root_units_gate_names_no_other_users_process(
    cli: Cli, server: GateServer, unit_cgroups: UnitCgroups, spawn_holder: HolderSpawner
) -> None:
    """The unit's gate and stop-reap as uid 65534: root's holder is "another user's process".

    Before, their answers, which the unit's journal keeps, named the PID and name of every
    process on the unit's GPUs, whoever's it was.
    """
    holder = spawn_holder(cli.state, gpus=(0,), mib=1000, name="nv-hostengine")  # root's
    unit = watched_unit(cli)
    done = client(
        cli,
        "gate",
        "--unit",
        unit,
        "--timeout",
        "1",
        "--socket",
        str(server.path),
        cgroup=unit_cgroups.ensure(unit),
        uid=NOBODY,
        env={"CUDA_VISIBLE_DEVICES": "0"},
    )
    assert done.code == 1, done.err
    assert "held by another user's process" in done.err, done.err
    assert f"PID {holder.pid}" not in done.err, done.err
    assert "nv-hostengine" not in done.err, done.err
    reap = client(
        cli,
        "reap",
        "--unit",
        unit,
        "--yes",
        "--timeout",
        "1",
        "--socket",
        str(server.path),
        cgroup=unit_cgroups.ensure(unit),
        uid=NOBODY,
        env={"CUDA_VISIBLE_DEVICES": "0"},
    )
    said = reap.out + reap.err
    assert reap.code == 1, said
    assert "spare 1 process(es) of other users (named to root only)" in said, said
    assert "held by another user's process" in said, said
    assert f"pid {holder.pid}" not in said.lower(), said
    assert "nv-hostengine" not in said, said
