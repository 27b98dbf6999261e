"""One test per attack of issue 9 that gpuguard itself must stop (the socket split aside).

Each plants what a service user could plant, runs gpuguard as root the way the unit's
ExecStartPre=/ExecStopPost= would, and checks that root neither ran, loaded, trusted, wrote nor
kept what the attacker meant it to.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from clirunner import gpuguard_argv

from gpuguard.adapters import configfile, files, state
from gpuguard.config import load_settings
from gpuguard.core.records import RECORD_MAX, TEXT_MAX

if TYPE_CHECKING:
    from clirunner import Cli

ATTACKER = 65534  # nobody: owner of everything the attacker plants


def _gpuguard(
    env: dict[str, str], *args: str, umask: int = -1, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*gpuguard_argv(), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        umask=umask,
    )


def _plant(path: Path) -> None:
    """Make ``path`` the attacker's (symlinks included, not what they point at)."""
    os.chown(path, ATTACKER, ATTACKER, follow_symlinks=False)


def _victim(directory: Path, name: str = "victim") -> Path:
    """A root-only file the attacker wants overwritten or chmodded."""
    directory.mkdir(exist_ok=True)
    victim = directory / name
    victim.write_text("root's secret\n")
    victim.chmod(0o600)
    return victim


def _intact(victim: Path) -> bool:
    info = victim.lstat()
    return (
        stat.S_ISREG(info.st_mode)
        and stat.S_IMODE(info.st_mode) == 0o600
        and victim.read_text() == "root's secret\n"
    )


def test_planted_systemctl_on_the_units_path_never_runs(cli: Cli, tmp_path: Path) -> None:
    """An executable ``systemctl`` first on PATH: reap and status run /usr/bin's, never it."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    marker = tmp_path / "planted-systemctl-ran"
    planted = bin_dir / "systemctl"
    planted.write_text(f"#!/bin/sh\nid -u >> {shlex.quote(str(marker))}\n")
    planted.chmod(0o755)
    _plant(planted)
    _plant(bin_dir)
    env = {**cli.env, "PATH": f"{bin_dir}:{cli.env.get('PATH', '/usr/bin:/bin')}"}
    config = ("--config", str(cli.config))
    reap = _gpuguard(env, *config, "reap", "--unit", "sglang.service", "--dry-run")
    status = _gpuguard(env, *config, "status")
    assert "Traceback" not in reap.stderr + status.stderr
    assert "GPU 0" in status.stdout
    assert not marker.exists(), f"the planted systemctl ran as uid {marker.read_text()}"


def test_planted_libnvidia_ml_on_ld_library_path_is_never_loaded(cli: Cli, tmp_path: Path) -> None:
    """A libnvidia-ml.so.1 first on LD_LIBRARY_PATH: its constructor never runs as root."""
    planted_dir = tmp_path / "venv" / "lib"
    planted_dir.mkdir(parents=True)
    marker = tmp_path / "planted-library-loaded"
    source = tmp_path / "planted.c"
    source.write_text(
        "#include <stdio.h>\n#include <unistd.h>\n"
        "__attribute__((constructor)) static void planted(void) {\n"
        f'    FILE *f = fopen("{marker}", "a");\n'
        '    if (f) { fprintf(f, "%d\\n", (int)geteuid()); fclose(f); }\n'
        "}\n"
    )
    library = planted_dir / "libnvidia-ml.so.1"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-Wl,-soname,libnvidia-ml.so.1", "-o", str(library), source],
        check=True,
    )
    _plant(library)
    _plant(planted_dir)
    env = {**cli.env, "LD_LIBRARY_PATH": str(planted_dir)}
    status = _gpuguard(env, "--config", str(cli.config), "status", "--json")
    assert not marker.exists(), f"the planted library ran as uid {marker.read_text()}"
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["nvml"]["health"] == "ok"  # the configured fake answered


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("file owned by the user", "owned by uid 65534, not root"),
        ("file writable by others", "writable by group or others"),
        ("directory owned by the user", "directory owned by uid 65534, not root"),
        ("directory writable by others", "directory writable by group or others"),
    ],
)
def test_gpuguard_config_naming_a_users_file_exits_78(
    cli: Cli, tmp_path: Path, how: str, reason: str
) -> None:
    """GPUGUARD_CONFIG in the unit's environment naming a file the user controls: exit 78."""
    directory = tmp_path / "user-config"
    directory.mkdir()
    config = directory / "gpuguard.toml"
    config.write_text(cli.config.read_text() + '[units."sglang.service"]\npatterns = ["python"]\n')
    if how == "file owned by the user":
        _plant(config)
    elif how == "file writable by others":
        config.chmod(0o666)
    elif how == "directory owned by the user":
        _plant(directory)
    else:
        directory.chmod(0o777)
    result = _gpuguard({**cli.env, "GPUGUARD_CONFIG": str(config)}, "status")
    assert result.returncode == 78
    (line,) = result.stderr.splitlines()
    assert reason in line
    assert str(config if how.startswith("file") else directory) in line


def test_symlink_spray_over_state_names_overwrites_nothing(cli: Cli, tmp_path: Path) -> None:
    """Symlinks to a root-only file at every temporary and final name the gate might write."""
    victim = _victim(tmp_path / "root-only")
    gate_dir = tmp_path / "run" / "gate"
    gate_dir.mkdir(parents=True)
    gate_dir.chmod(0o1777)  # shared like /tmp: anyone may add names, none may replace others'
    names = ["sglang.service.json"]
    last = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
    names += [f".sglang.service.json.{pid}.tmp" for pid in range(last, last + 3000)]
    for name in names:
        (gate_dir / name).symlink_to(victim)
        _plant(gate_dir / name)
    result = _gpuguard(
        cli.env, "--config", str(cli.config), "gate", "--unit", "sglang.service", "--timeout", "5"
    )
    assert result.returncode == 0, result.stderr
    assert _intact(victim)
    record = gate_dir / "sglang.service.json"
    assert stat.S_ISREG(record.lstat().st_mode)  # the planted link was replaced, not followed
    assert state.gate_decisions(tmp_path / "run", "sglang.service")[-1]["result"] == "passed"


def test_symlinked_state_directory_is_refused(cli: Cli, tmp_path: Path) -> None:
    """The gate's directory replaced by a user's symlink into a root-only directory."""
    victim = _victim(tmp_path / "root-only", "sglang.service.json")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0o1777)
    (run_dir / "gate").symlink_to(victim.parent)
    _plant(run_dir / "gate")
    result = _gpuguard(
        cli.env, "--config", str(cli.config), "gate", "--unit", "sglang.service", "--timeout", "5"
    )
    assert result.returncode == 0, result.stderr  # the start is not refused for it...
    assert "symlink owned by uid 65534" in result.stderr  # ...but the write is, and says why
    assert _intact(victim)


def test_umask_0000_never_makes_a_writable_file(cli: Cli, tmp_path: Path) -> None:
    """UMask=0000 in the unit: every file and directory root writes keeps its own mode."""
    run_dir = tmp_path / "run"
    result = _gpuguard(
        cli.env,
        "--config",
        str(cli.config),
        "gate",
        "--unit",
        "sglang.service",
        "--timeout",
        "5",
        umask=0,
    )
    assert result.returncode == 0, result.stderr
    modes = {path: stat.S_IMODE(path.lstat().st_mode) for path in [run_dir, *run_dir.rglob("*")]}
    cache = configfile.cache_file(cli.config, cli.config.read_bytes())
    assert cache is not None
    assert cache.is_relative_to(run_dir)  # the cache follows runtime_dir, never /run/gpuguard
    assert modes[run_dir / "gate" / "sglang.service.json"] == 0o644
    assert modes[run_dir / "gate"] == 0o755
    assert modes[cache] == 0o600
    assert all(not mode & 0o022 for mode in modes.values()), modes


def test_cache_from_an_older_gpuguard_means_a_full_load(
    cli: Cli, unit_cgroup: tuple[str, Path]
) -> None:
    """A cache missing a key (written by an older gpuguard) is a miss, never a KeyError."""
    unit, cgroup = unit_cgroup
    settings = load_settings(cli.config).model_dump(mode="json")
    del settings["nvml_timeout_s"]
    text = cli.config.read_bytes().decode()
    older = {"path": str(cli.config), "text": text, "settings": settings}
    cache = configfile.cache_file(cli.config, cli.config.read_bytes())
    assert cache is not None
    files.write_file(cache, json.dumps(older).encode(), mode=0o600)
    command = shlex.join(cli.command("gate", "--unit", unit))
    result = subprocess.run(
        ["sh", "-c", f"echo $$ > {cgroup / 'cgroup.procs'} && exec {command}"],
        env={**cli.env, "INVOCATION_ID": uuid.uuid4().hex},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert state.gate_decisions(cli.config.parent / "run", unit)[-1]["result"] == "passed"
    refreshed = json.loads(cache.read_bytes())  # by the full load, for the next fast path
    assert refreshed["format"] == configfile.CACHE_FORMAT
    assert configfile.load_validated(cli.config) is not None


def test_two_mib_command_line_is_capped_in_the_history(tmp_path: Path) -> None:
    """A holder with a 2 MiB command line: each record, and the history, stay bounded."""
    command = "python -m sglang.launch_server " + "A" * (2 * 1024 * 1024)
    holders = [{"pid": 1000 + n, "command": command, "reason": "foreign"} for n in range(50)]
    decision = {"time": "now", "unit": "u.service", "result": "refused", "spared": holders}
    for _ in range(state.GATE_HISTORY + 5):
        state.record_gate_decision(tmp_path, "u.service", decision)
    path = state.gate_log_path(tmp_path, "u.service")
    assert path.stat().st_size <= state.GATE_HISTORY * (RECORD_MAX + 1024)
    newest = state.gate_decisions(tmp_path, "u.service")[-1]
    assert newest["result"] == "refused"
    kept = newest["spared"]
    assert kept, "at least the first holder survives, cut"
    assert len(kept[0]["command"]) < TEXT_MAX + 100
    assert "more characters cut" in kept[0]["command"]
    assert newest["omitted"] == {"spared": len(holders) - len(kept)}
