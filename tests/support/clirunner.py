"""Helpers for integration tests: the gpuguard CLI over the fake NVML, and real cgroups."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gpuguard.adapters import programs

if TYPE_CHECKING:
    from collections.abc import Mapping

CGROUP2 = Path("/sys/fs/cgroup/unified")
ENDED = "0123456789abcdef0123456789abcdef"  # an earlier run of a unit, as PID 1 logged it
LAST = "fedcba9876543210fedcba9876543210"  # a unit's current or last run
HOSTLESS = Path(__file__).resolve().parent / "hostless"
"""The tests' systemctl and journalctl unless a test gives its own: no bus, an empty journal."""
_LAUNCHER = Path(__file__).resolve().parent / "hostless.py"


def gpuguard_argv(doubles: Mapping[str, Path] | None = None) -> list[str]:
    """The argv that starts gpuguard (its arguments follow), its programs replaced by doubles.

    ``doubles`` (name → a script of that name) stand in for the system's programs, over
    HOSTLESS's systemctl and journalctl, so that no test's gpuguard asks the machine's own
    systemd or journal, whether or not its PID 1 is systemd: root binds them over the real ones
    in a private mount namespace (``unshare`` without ``--fork`` execs in place: the PID, and so
    its cgroup, stay the same); a normal user, who cannot mount, starts gpuguard through
    hostless.py, which looks in their directories first.
    """
    merged = over_hostless(doubles or {})
    return [*bind_prefix(merged), sys.executable, *_entry(merged)]


def over_hostless(doubles: Mapping[str, Path]) -> dict[str, Path]:
    """HOSTLESS's systemctl and journalctl, with ``doubles`` in place of any of them."""
    return {**{name: HOSTLESS / name for name in ("systemctl", "journalctl")}, **doubles}


def bind_prefix(doubles: Mapping[str, Path]) -> list[str]:
    """As root, what binds ``doubles`` in a private mount namespace and execs the rest; else []."""
    if os.geteuid() != 0:
        return []
    binds: list[str] = []
    for name, double in doubles.items():
        try:
            binds += [str(double), programs.resolve(name)]
        except FileNotFoundError:  # a tree without systemd: nothing to bind the double over
            if double.parent == HOSTLESS:
                continue  # nor anything of this host's to hide
            pytest.skip(f"a double is bound over the system's {name}, and there is none")
    if not binds:
        return []
    script = 'while [ "$1" != -- ]; do mount --bind "$1" "$2" || exit 97; shift 2; done'
    script += '; shift; exec "$@"'
    unshare = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script]
    return [*unshare, "sh", *binds, "--"]


def _entry(doubles: Mapping[str, Path]) -> list[str]:
    """How the interpreter starts gpuguard: ``-m gpuguard`` as root (bound), else hostless.py.

    hostless.py finds programs by directory: a test's own doubles' first, HOSTLESS last.
    """
    if os.geteuid() == 0:
        return ["-m", "gpuguard"]
    for name, double in doubles.items():
        assert double.name == name, f"the double of {name} is found by its name, not {double}"
    own = [str(d.parent) for d in doubles.values() if d.parent != HOSTLESS]
    directories = [*dict.fromkeys(own), str(HOSTLESS)]
    return [str(_LAUNCHER), os.pathsep.join(directories)]


@dataclass(frozen=True)
class CliResult:
    """One gpuguard run: exit status, stdout, stderr."""

    code: int
    out: str
    err: str

    def json(self) -> Any:
        """The stdout parsed as JSON."""
        return json.loads(self.out)


@dataclass(frozen=True)
class Cli:
    """Runs ``python -m gpuguard`` with the fake NVML and a config pointing at its devices."""

    state: Path
    config: Path
    env: dict[str, str]
    library: Path
    doubles: dict[str, Path] = field(default_factory=dict)
    """A test's doubles of programs gpuguard runs (``systemctl`` → script), over HOSTLESS's."""

    def command(self, *args: str) -> list[str]:
        """The argv of one gpuguard run, with ``doubles`` in place of the system's programs."""
        return [*gpuguard_argv(self.doubles), "--config", str(self.config), *args]

    def prefix(self) -> list[str]:
        """As root, what binds the doubles in place and execs the rest (see gpuguard_argv)."""
        return bind_prefix(over_hostless(self.doubles))

    def __call__(self, *args: str, timeout: float = 60) -> CliResult:
        """Run one command and capture it."""
        done = subprocess.run(
            self.command(*args),
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            check=False,
        )
        return CliResult(done.returncode, done.stdout, done.stderr)

    def configure(self, extra: str = "") -> None:
        """Rewrite the config: the fake library and devices, private state dirs, then ``extra``."""
        self.config.write_text(
            "allow_plain_device_files = true\n"
            f'nvml_library = "{self.library}"\n'
            f'device_glob = "{self.state}/dev/nvidia*"\n'
            f'runtime_dir = "{self.config.parent}/run"\n'
            f'state_dir = "{self.config.parent}/lib"\n' + extra
        )


@dataclass
class UnitCgroups:
    """Creates real cgroup v2 directories named like systemd units and moves processes in."""

    made: list[Path]

    def ensure(self, unit: str, slice_: str = "system.slice") -> Path:
        """The cgroup directory of ``unit``, created (and later removed) if needed."""
        path = CGROUP2 / slice_ / unit
        if not path.exists():
            path.mkdir(parents=True)
            self.made.append(path)
        return path

    def move(self, pid: int, unit: str, slice_: str = "system.slice") -> None:
        """Put ``pid`` (and not its existing children) into ``/<slice>/<unit>``."""
        (self.ensure(unit, slice_) / "cgroup.procs").write_text(f"{pid}\n")


@dataclass
class Openers:
    """Starts processes that only open device files (no allocation), like an exporter."""

    processes: list[subprocess.Popen[bytes]]

    def __call__(self, state: Path, name: str, *minors: int) -> int:
        """Start ``name`` (its argv[0]) holding ``state/dev/nvidia<minor>`` open; its PID."""
        paths = [str(state / "dev" / f"nvidia{minor}") for minor in minors]
        code = "import sys, time\nfiles = [open(p) for p in sys.argv[1:]]\nprint(1, flush=True)\n"
        code += "time.sleep(600)\n"
        process = subprocess.Popen(
            [name, "-c", code, *paths], executable=sys.executable, stdout=subprocess.PIPE
        )
        self.processes.append(process)
        assert process.stdout is not None  # a PIPE
        process.stdout.readline()
        process.stdout.close()
        return process.pid

    def stop(self) -> None:
        """Kill and reap every process started."""
        while self.processes:
            process = self.processes.pop()
            process.kill()
            process.wait()


@dataclass(frozen=True)
class FakeSystemd:
    """Test doubles of ``systemctl`` and ``journalctl`` in ``bin_dir``.

    systemd cannot run in this container (its PID 1 is not systemd), so what it would say about
    a unit comes from these; the end-to-end suite runs the real one.
    """

    bin_dir: Path

    def __call__(
        self,
        unit: str | None,
        *,
        state: str = "inactive",
        last: str = LAST,
        logged: tuple[str, ...] = (ENDED,),
        user: str = "",
        load_state: str = "loaded",
        known: tuple[str, ...] = (),
        sub_state: str = "x",
        control_group: str = "",
        control: bool = False,
        environment: str = "",
        control_dir: Path | None = None,
        timeout_stop: str = "1min 30s",
    ) -> None:
        """Make the doubles describe ``unit``; ``unit=None``: systemctl fails as without a bus.

        ``systemctl show`` reports ``unit`` in ``state`` with ``last`` as its invocation,
        ``user`` as its User= and ``load_state`` as its LoadState= (``not-found``: no such
        unit); ``list-units`` lists ``known``; ``journalctl`` prints PID 1's entries naming
        ``logged``. ``sub_state`` is its SubState=, ``control_group`` its ControlGroup=;
        ``control``: its ControlPID= is the process that ran systemctl (the gpuguard command
        asking is the unit's ExecStopPost=, say); ``environment`` its Environment= as systemctl
        prints it (shell-quoted words); ``control_dir``: its ControlPID= is the PID written in
        ``control_dir/UNIT`` for whichever unit is asked about (0 when none), as the tests'
        ExecStartPre= stand-ins write theirs; ``timeout_stop`` its TimeoutStopUSec= (systemd's
        default 1min 30s).
        """
        if unit is None:
            systemctl = 'echo "Failed to connect to bus: No such file or directory" >&2\nexit 1\n'
            journal = ""
        else:
            show = (
                f"LoadState={load_state}\n"
                f"ActiveState={state}\nSubState={sub_state}\nMainPID=0\nInvocationID={last}\n"
                f"Environment={environment}\nNRestarts=0\nUser={user}\nDynamicUser=no\n"
                f"ControlGroup={control_group}\nTimeoutStopUSec={timeout_stop}\n"
            )
            listed = "".join(f"{name} loaded active running x\n" for name in known)
            systemctl = (
                f'[ "$1" = list-units ] && printf %s {shlex.quote(listed)} && exit 0\n'
                f'[ "$1" = show ] || exit 1\nprintf %s {shlex.quote(show)}\n'
                + ('echo "ControlPID=$PPID"\n' if control else "")
                + (
                    f'echo "ControlPID=$(cat {shlex.quote(str(control_dir))}/"$2" 2>/dev/null)"\n'
                    if control_dir is not None
                    else ""
                )
            )
            journal = "".join(
                json.dumps({"__CURSOR": f"s={i}", "_PID": "1", "UNIT": unit, "INVOCATION_ID": x})
                + "\n"
                for i, x in enumerate(logged)
            )
        for name, body in (
            ("systemctl", systemctl),
            ("journalctl", f"printf %s {shlex.quote(journal)}\n"),
        ):
            path = self.bin_dir / name
            path.write_text(f"#!/bin/sh\n{body}")
            path.chmod(0o755)


def unit_name() -> str:
    """A unit name unique to one test (cgroups are shared by the whole machine)."""
    return f"sglang-{uuid.uuid4().hex[:8]}.service"


def gate_in_unit(
    cli: Cli, cgroups: UnitCgroups, unit: str, *args: str, timeout: float = 60
) -> CliResult:
    """Run the gate the way systemd runs ExecStartPre=: as a process inside the unit's cgroup.

    Without a gate server the gate runs in-process after a note about where it runs; the note
    is not part of its answer and is left out of ``err``.
    """
    procs = cgroups.ensure(unit) / "cgroup.procs"
    command = shlex.join(cli.command("gate", "--unit", unit, *args))
    done = subprocess.run(
        ["sh", "-c", f"echo $$ > {shlex.quote(str(procs))} && exec {command}"],
        capture_output=True,
        text=True,
        env={**cli.env, "INVOCATION_ID": uuid.uuid4().hex},
        timeout=timeout,
        check=False,
    )
    err = "".join(
        line
        for line in done.stderr.splitlines(keepends=True)
        if not line.startswith("gpuguard gate: no gate server at ")
    )
    return CliResult(done.returncode, done.stdout, err)
