"""Provenance before pattern, with real processes, real cgroups, real uids and the fake NVML.

systemd cannot run in this container (its own PID 1 is not systemd), so what it would say about
a unit comes from two test doubles on PATH: a ``systemctl`` that answers ``show`` and a
``journalctl`` that prints PID 1's entries for the unit. Everything else is real: processes
double-forked to PID 1, their environments, their uids, their cgroups and the signals.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from clirunner import ENDED
from fakeholder import process_gone
from fakestate import add_alloc, allocated_mib

from gpuguard.adapters import ledgerstore
from gpuguard.adapters.procfs import read_identity
from gpuguard.core.ledger import Ledger, SeenProcess

if TYPE_CHECKING:
    from collections.abc import Iterator

    from clirunner import Cli, FakeSystemd, UnitCgroups
    from fakeholder import HolderSpawner

NOBODY = 65534

# A process that opens fake GPU device files, optionally drops to another uid, double-forks so
# that it is reparented (to PID 1 unless a subreaper is in the way) and then only waits.
_DETACHED = """\
import os, sys, time
state, uid, paths = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
if os.fork():
    os._exit(0)
os.setsid()
if os.fork():
    os._exit(0)
files = [open(os.path.join(state, "dev", p)) for p in paths]
if uid >= 0:
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
print(os.getpid(), flush=True)
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
time.sleep(600)
"""


def unit_name() -> str:
    """A unit name unique to this test."""
    return f"sglang-{uuid.uuid4().hex[:8]}.service"


@dataclass
class Detached:
    """Starts processes detached from the test (PPID 1) and kills them at teardown."""

    pids: list[int]

    def __call__(
        self, state: Path, *minors: int, uid: int = -1, invocation: str | None = None
    ) -> int:
        """Start one holding ``state/dev/nvidia<minor>``; it looks like an SGLang server."""
        env = {k: v for k, v in os.environ.items() if k != "INVOCATION_ID"}
        if invocation is not None:
            env["INVOCATION_ID"] = invocation
        paths = ",".join(f"nvidia{minor}" for minor in minors)
        argv = ["python3", "-c", _DETACHED, str(state), str(uid), paths, "-m", "sglang"]
        done = subprocess.run(
            argv, executable=sys.executable, env=env, capture_output=True, check=True, timeout=10
        )
        pid = int(done.stdout)
        self.pids.append(pid)
        return pid

    def stop(self) -> None:
        """SIGKILL every process still alive."""
        for pid in self.pids:
            if not process_gone(pid):
                os.kill(pid, 9)


@pytest.fixture
def detached() -> Iterator[Detached]:
    """Factory for detached device holders, killed at teardown."""
    made = Detached([])
    yield made
    made.stop()


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _plan_line(out: str, pid: int) -> str:
    return next(line for line in out.splitlines() if f"pid {pid} " in line)


def test_tenants_server_is_spared_and_the_units_orphan_is_reaped(
    cli: Cli,
    spawn_holder: HolderSpawner,
    detached: Detached,
    fake_systemd: FakeSystemd,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Attack: another user's `nohup python -m sglang …` (PPID 1) was SIGTERMed as an orphan.

    Three processes outside the unit's cgroup, all matching 'sglang', on the unit's GPUs: the
    unit's real orphan (an ended run's INVOCATION_ID, the unit's user) is reaped; a tenant's
    server (no INVOCATION_ID, uid nobody) and a tenant who copied the id are spared, with the
    missing provenance as the reason.
    """
    unit = unit_name()
    fake_systemd(unit)
    monkeypatch.setenv("INVOCATION_ID", ENDED)  # inherited by the server and its worker
    server = spawn_holder(
        cli.state, gpus=(0,), mib=4000, children=1, leave_child=True, name="sglang::scheduler"
    )
    monkeypatch.delenv("INVOCATION_ID")
    server.terminate()  # the parent exits, its worker stays behind holding GPU 0
    server.wait()
    orphan = server.children[0]
    tenant = detached(cli.state, 1, uid=NOBODY)
    copier = detached(cli.state, 2, uid=NOBODY, invocation=ENDED)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _ppid(orphan) == server.pid:
        time.sleep(0.05)
    assert _ppid(tenant) == _ppid(copier) != os.getpid()  # detached: nobody's child here

    result = cli("reap", "--unit", unit, "--yes", "--grace", "1")

    assert process_gone(orphan), result.out + result.err
    assert not process_gone(tenant)
    assert not process_gone(copier)
    assert allocated_mib(cli.state, 0) == 0
    assert "left over from an earlier run of" in _plan_line(result.out, orphan)
    tenant_line = _plan_line(result.out, tenant)
    assert "matching 'sglang' is no evidence" in tenant_line
    assert "its environment names no INVOCATION_ID" in tenant_line
    assert "runs as uid 65534/65534/65534/65534" in _plan_line(result.out, copier)


def test_an_id_of_another_unit_is_no_provenance(
    cli: Cli, detached: Detached, fake_systemd: FakeSystemd
) -> None:
    """A root process whose INVOCATION_ID is no run of this unit is not its left-over."""
    unit = unit_name()
    fake_systemd(unit, logged=(ENDED,))
    stranger = detached(cli.state, 0, invocation="9" * 32)
    result = cli("reap", "--unit", unit, "--yes", "--grace", "1")
    assert not process_gone(stranger)
    assert f"names no ended run of {unit}" in _plan_line(result.out, stranger)


def test_nothing_in_the_cgroup_is_reaped_when_systemd_cannot_be_asked(
    cli: Cli,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    fake_systemd: FakeSystemd,
) -> None:
    """Attack: with systemctl failing, `reap --unit U --yes` killed U's live server on main."""
    unit = unit_name()
    fake_systemd(None)
    server = spawn_holder(cli.state, gpus=(0,), mib=4000, name="python3 -m sglang.launch_server")
    unit_cgroups.move(server.pid, unit)
    result = cli("reap", "--unit", unit, "--yes", "--grace", "1")
    assert not process_gone(server.pid)
    assert allocated_mib(cli.state, 0) == 4000
    line = _plan_line(result.out, server.pid)
    assert f"systemd's view of {unit} is unknown" in line
    assert "nothing in its cgroup is reaped" in line
    assert "cannot ask systemd" in result.out


def test_a_carriage_return_in_a_cgroup_name_does_not_claim_the_unit(
    cli: Cli,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    fake_systemd: FakeSystemd,
) -> None:
    r"""Attack: a cgroup named ``x\r0::UNIT`` was read as the unit's own cgroup on main.

    ``str.splitlines`` split the real /proc/PID/cgroup line at the ``\r``; the process counted
    as a left-over inside the (stopped) unit and was reaped.
    """
    unit = unit_name()
    fake_systemd(unit)
    forger = spawn_holder(cli.state, gpus=(0,), mib=4000, name="python3 -m sglang.launch_server")
    unit_cgroups.move(forger.pid, f"x\r0::{unit}", slice_=f"tenant-{uuid.uuid4().hex[:8]}")
    assert f"\r0::{unit}".encode() in Path(f"/proc/{forger.pid}/cgroup").read_bytes()
    result = cli("reap", "--unit", unit, "--yes", "--grace", "1")
    assert not process_gone(forger.pid)
    assert "left over" not in _plan_line(result.out, forger.pid)


def test_a_shared_services_other_user_is_never_signalled(
    cli: Cli,
    detached: Detached,
    unit_cgroups: UnitCgroups,
    fake_systemd: FakeSystemd,
    tmp_path: Path,
) -> None:
    """Attack: in a shared service, one user's job made root SIGTERM another user's GPU job.

    cron.service (KillMode=process) holds every user's jobs; after a stop both were reaped as
    left over. Both sit in the root service's cgroup with its ended run's INVOCATION_ID; only
    the unit's own (root) process is its left-over. Neither the reap nor the gate signals the
    other user's job, which keeps the gate closed and says why.
    """
    if os.geteuid() != 0:
        pytest.skip("needs root: the other user's job runs as another uid")
    unit = f"cron-{uuid.uuid4().hex[:8]}.service"
    fake_systemd(unit)  # stopped, User= unset: root
    own = detached(cli.state, 0, invocation=ENDED)
    tenant = detached(cli.state, 1, uid=NOBODY, invocation=ENDED)
    for minor, pid in enumerate((own, tenant)):
        unit_cgroups.move(pid, unit)
        add_alloc(cli.state, pid=pid, minor=minor, mib=4000)
    absent = str(tmp_path / "absent.sock")  # in this process, as root: no server

    gate = cli("gate", "--unit", unit, "--timeout", "2", "--grace", "1", "--socket", absent)
    assert gate.code == 1, gate.out + gate.err
    assert process_gone(own), gate.err
    assert not process_gone(tenant)
    assert "runs as uid 65534/65534/65534/65534, not as" in gate.err + gate.out
    reap = cli("reap", "--unit", unit, "--yes", "--grace", "1", "--socket", absent)
    assert not process_gone(tenant)
    assert f"not as {unit}'s user (uid 0)" in _plan_line(reap.out, tenant)
    assert allocated_mib(cli.state, 1) > 0


def test_the_gate_alone_records_a_worker_that_escaped_and_its_stop_reap_takes_it(
    cli: Cli,
    spawn_holder: HolderSpawner,
    fake_systemd: FakeSystemd,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No daemon: the unit's ExecStopPost= reap records its run and reaps the escaped worker.

    A left-over server in the unit's cgroup whose TP worker (holding GPU 0) moved into a
    transient scope with that scope's own INVOCATION_ID: nothing but its parent ties the worker
    to the run. The stop-reap (the unit's control process, systemd in stop-post) records the
    cgroup and its descendants as the ending run's, so the worker is reaped by that record; a
    run another writer (the daemon) recorded stays in the file. On main the worker was kept.
    """
    unit = unit_name()
    scope = f"run-u{uuid.uuid4().hex[:8]}.scope"
    group = f"/system.slice/{unit}"
    fake_systemd(
        unit, state="deactivating", sub_state="stop-post", control_group=group, control=True
    )
    runtime = cli.config.parent / "run"
    mine = (os.getpid(), read_identity(os.getpid()))
    assert mine[1] is not None
    daemons = Ledger().record(
        "other.service", ENDED, [SeenProcess(mine[0], mine[1].start_time, (0,), "pytest", "/")], 1.0
    )
    ledgerstore.save(runtime, daemons)
    monkeypatch.setenv("INVOCATION_ID", "d" * 32)  # the scope's own id, as systemd-run gives
    server = spawn_holder(
        cli.state, gpus=(0,), mib=30000, children=1, leave_child=True, name="sglang::server"
    )
    monkeypatch.delenv("INVOCATION_ID")
    worker = server.children[0]
    unit_cgroups.move(server.pid, unit)
    unit_cgroups.move(worker, scope)

    procs = unit_cgroups.ensure(unit) / "cgroup.procs"
    command = shlex.join(cli.command("reap", "--unit", unit, "--yes", "--grace", "1"))
    done = subprocess.run(
        ["sh", "-c", f"echo $$ > {shlex.quote(str(procs))} && exec {command}"],
        capture_output=True,
        text=True,
        env=cli.env,
        timeout=120,
        check=False,
    )

    assert process_gone(worker), done.stdout + done.stderr
    assert "the ledger saw it descend from run" in _plan_line(done.stdout, worker)
    assert allocated_mib(cli.state, 0) == 0
    assert done.returncode == 0, done.stdout + done.stderr
    ledger, problems = ledgerstore.load(runtime)
    assert problems == ()
    assert ledger.claims("other.service") == daemons.claims("other.service")
