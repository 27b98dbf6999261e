"""packaging/make-env (postinst): an environment from the shipped wheels, switched atomically.

Real runs of the script with the host's python3 and pip (run from a wheel, as on a host) into a
temporary LIB, with a small "gpuguard" wheel made here. What is at risk: an upgrade that changes
the code under a running gpuguard (a gate waiting for its GPUs imports modules late), deletes an
environment a process still runs from, or leaves a half-made one in use; and an install that
takes files the shipped hashes do not name.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import zipfile
from pathlib import Path

import pip
import pytest
from floods import Flood

ROOT = Path(__file__).resolve().parents[2]
MAKE_ENV = ROOT / "packaging/make-env"
WRAPPER = ROOT / "packaging/gpuguard"
PYTHON = "/usr/bin/python3"

# The fake gpuguard.entry: main() waits for a line, then imports a module of its environment late.
_CLI = """\
import sys


def main():
    print("ready", flush=True)
    sys.stdin.readline()
    from gpuguard import late

    print(late.VERSION)
    return 0
"""


def _wheel(directory: Path, version: str) -> Path:
    """A pure-Python wheel of `gpuguard` VERSION whose late-imported module names its version."""
    files = {
        "gpuguard/__init__.py": "",
        "gpuguard/entry.py": _CLI,
        "gpuguard/late.py": f"VERSION = {version!r}\n",
        "gpuguard/blob.bin": "x" * 4096,
        f"gpuguard-{version}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: gpuguard\nVersion: {version}\n"
        ),
        f"gpuguard-{version}.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"gpuguard-{version}.dist-info/RECORD,,")
    files[f"gpuguard-{version}.dist-info/RECORD"] = "\n".join(record) + "\n"
    path = directory / f"gpuguard-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return path


@pytest.fixture(scope="module")
def pip_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pip of the tests as a wheel file (zipped): make-env runs pip from it."""
    source = Path(pip.__file__).parent
    path = tmp_path_factory.mktemp("pip") / f"pip-{pip.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for file in sorted(source.rglob("*")):
            if file.is_file() and "__pycache__" not in file.parts:
                archive.write(file, Path("pip") / file.relative_to(source))
    return path


def ship(lib: Path, pip_wheel: Path, version: str) -> None:
    """LIB/wheels as a package of gpuguard VERSION ships it: wheels and hashed requirements."""
    wheels = lib / "wheels"
    if wheels.exists():
        for old in wheels.iterdir():
            old.unlink()
    wheels.mkdir(parents=True, exist_ok=True)
    (wheels / pip_wheel.name).write_bytes(pip_wheel.read_bytes())
    wheel = _wheel(wheels, version)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (wheels / "requirements.txt").write_text(f"gpuguard=={version} --hash=sha256:{digest}\n")


def make_env(lib: Path) -> subprocess.CompletedProcess[str]:
    """Run packaging/make-env LIB /usr/bin/python3, as postinst does."""
    done = subprocess.run(
        ["sh", str(MAKE_ENV), str(lib), PYTHON],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done


def environments(lib: Path) -> set[str]:
    """The names of the environments in LIB/envs."""
    return {path.name for path in (lib / "envs").iterdir()}


def test_environment_from_the_shipped_wheels_without_pip(tmp_path: Path, pip_wheel: Path) -> None:
    """LIB/venv links to a complete environment of the host's python3 holding exactly the wheels."""
    ship(tmp_path, pip_wheel, "1.0")
    make_env(tmp_path)
    link = (tmp_path / "venv").readlink()
    assert str(link).startswith("envs/py3.")
    assert (tmp_path / link / ".complete").is_file()
    python = tmp_path / "venv/bin/gpuguard-python"
    probe = "import gpuguard.late as m, importlib.util as u; print(m.VERSION, u.find_spec('pip'))"
    done = subprocess.run([python, "-I", "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["1.0", "None"], "gpuguard installed, pip not"


def test_a_wheel_the_hashes_do_not_name_is_refused(tmp_path: Path, pip_wheel: Path) -> None:
    """A wheel replaced after the build fails the install, and no environment is switched to."""
    ship(tmp_path, pip_wheel, "1.0")
    wheel = tmp_path / "wheels/gpuguard-1.0-py3-none-any.whl"
    wheel.write_bytes(_wheel(tmp_path, "1.0").read_bytes() + b"tampered")
    done = subprocess.run(
        ["sh", str(MAKE_ENV), str(tmp_path), PYTHON], capture_output=True, text=True, check=False
    )
    assert done.returncode != 0
    assert "HASHES" in done.stderr.upper()
    assert not (tmp_path / "venv").exists()


def test_upgrade_switches_atomically_and_keeps_what_processes_run_from(
    tmp_path: Path, pip_wheel: Path
) -> None:
    """A running gpuguard keeps importing from its environment, which is not deleted under it.

    The process is /usr/bin/gpuguard (packaging/gpuguard) started through LIB/venv; it imports
    gpuguard.late only after two upgrades, and maps no file of its environment (pure Python):
    its lock on the environment, not /proc, keeps it.
    """
    ship(tmp_path, pip_wheel, "1.0")
    make_env(tmp_path)
    first = tmp_path / (tmp_path / "venv").readlink()
    python = tmp_path / "venv/bin/gpuguard-python"
    running = subprocess.Popen(
        [python, "-IB", WRAPPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert running.stdout is not None
        assert running.stdout.readline() == "ready\n", "the wrapper pinned its path, waits"
        ship(tmp_path, pip_wheel, "2.0")
        make_env(tmp_path)
        second = (tmp_path / "venv").readlink()
        ship(tmp_path, pip_wheel, "3.0")
        done = make_env(tmp_path)
        assert f"keeping {first}" in done.stderr, "the first environment in use stays"
        third = (tmp_path / "venv").readlink()
        assert environments(tmp_path) == {first.name, Path(second).name, Path(third).name}
        out, _ = running.communicate("\n", timeout=60)
        assert out.strip() == "1.0", "the running process imports from the environment it began in"
    finally:
        running.kill()
        running.communicate()
    make_env(tmp_path)  # the same package again: reuses its environment, deletes unused ones
    assert environments(tmp_path) == {Path((tmp_path / "venv").readlink()).name}


def test_another_users_mappings_neither_slow_nor_steer_the_cleanup(
    tmp_path: Path, pip_wheel: Path
) -> None:
    """A process that maps a file of an old environment, and maps 20,000 regions, keeps nothing.

    make-env reads no process's maps (a user decides their size, up to 262 MB): an old
    environment goes unless a gpuguard process holds its lock.
    """
    ship(tmp_path, pip_wheel, "1.0")
    make_env(tmp_path)
    first = tmp_path / (tmp_path / "venv").readlink()
    blob = next(first.glob("lib/python3*/site-packages/gpuguard/blob.bin"))
    flood = Flood("maps", 20_000, blob)
    try:
        ship(tmp_path, pip_wheel, "2.0")
        make_env(tmp_path)
        ship(tmp_path, pip_wheel, "3.0")
        done = make_env(tmp_path)
        assert "keeping" not in done.stderr
        assert not first.exists()
    finally:
        flood.kill()


def test_a_half_made_environment_is_made_again(tmp_path: Path, pip_wheel: Path) -> None:
    """An install interrupted before the environment was complete starts it over next time."""
    ship(tmp_path, pip_wheel, "1.0")
    make_env(tmp_path)
    env = tmp_path / (tmp_path / "venv").readlink()
    (env / ".complete").unlink()
    (env / "lib").rename(env / "broken")
    make_env(tmp_path)
    assert (env / ".complete").is_file()
    assert not (env / "broken").exists()
    assert (tmp_path / "venv").resolve() == env.resolve()
