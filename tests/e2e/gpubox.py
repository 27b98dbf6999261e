"""gpuguard installed in a booted container, on fake GPUs, beside a fake SGLang (issue 6).

Two halves:

* **On the host, once and cached** (`prepare_artifacts`): a wheel of this checkout (keyed by
  its sources), the wheels of its dependencies *for the container's Python* (keyed by
  pyproject.toml and the lock, packaging/requirements/runtime.txt when present), and the fake
  `libnvidia-ml.so.1` (`make -C tests/fakenvml`; the host and the container are both glibc
  Debian). Caches live in `$GPUGUARD_E2E_CACHE/wheels/` (default /var/cache/gpuguard-e2e), never
  in the checkout; `rm -rf` them at any time.
* **In each container** (`install`, a few seconds): the wheels, `tests/fakenvml` and
  `tests/e2e/fakesglang` are bound in read-only (`binds()`); a script makes
  `/opt/gpuguard` (`python3 -m venv` + `pip install --no-index --find-links /wheels gpuguard`,
  `/usr/bin/gpuguard` a symlink), `/opt/sglang` (the fake server's own venv: pynvml), installs
  the fake NVML as the system's library (ldconfig), sets `FAKENVML_STATE` for every unit
  (`DefaultEnvironment=` + `daemon-reexec`), writes 4 fake H200s, the fake GPU driver and the
  fake `sglang.service`, installs and enables gpuguard's gate socket (`systemd/`, bound in at
  /e2e/systemd), and writes `/etc/gpuguard/gpuguard.toml`.

Debian's `python3` has no `ensurepip` without `python3-venv` (not in the cached root file
system), so the venvs are made `--without-pip` and pip runs from its own wheel in /wheels.
`GpuBox` wraps a `Container` with what scenarios need: gpuguard commands, the fake GPUs' memory,
the server's processes, moving a worker out of the unit's cgroup, the gate drop-in, the daemon.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from fakestate import allocated_mib, build_fake_nvml

from e2e.container import Bind, Container, ContainerError, cache_dir
from e2e.measure import SESSION_NOTES

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

CHECKOUT = Path(__file__).resolve().parents[2]
FAKENVML_DIR = CHECKOUT / "tests" / "fakenvml"
FAKESGLANG_DIR = Path(__file__).resolve().parent / "fakesglang"
LOCK_FILE = CHECKOUT / "packaging" / "requirements" / "runtime.txt"
SYSTEMD_DIR = CHECKOUT / "systemd"
GATE_DROPIN = SYSTEMD_DIR / "gpuguard-gate.conf"
DAEMON_UNIT = CHECKOUT / "systemd" / "gpuguard.service"

#: The interpreter of each release's python3 (the wheels must fit it, not the host's).
TARGET_PYTHON: dict[str, str] = {"bookworm": "3.11", "trixie": "3.13"}
#: Highest glibc of the releases we boot (bookworm 2.36, trixie 2.41): manylinux tags up to it.
_GLIBC_MINOR = {"bookworm": 36, "trixie": 41}
WHEELS_FORMAT = 1

STATE = "/var/lib/fakenvml"
#: Where the host's procfs is bound in (see Artifacts.binds).
HOST_PROC = "/e2e/host-proc"
UNIT = "sglang.service"
DAEMON = "gpuguard.service"
ENV = {"FAKENVML_STATE": STATE}
FIRED_UP = "The server is fired up and ready to roll!"

#: The test configuration: short grace and backoff so scenarios take seconds, not minutes.
CONFIG = f"""\
# gpuguard e2e configuration (tests/e2e/gpubox.py)
allow_plain_device_files = true
device_glob = "{STATE}/dev/nvidia*"
reap_grace_s = 1.0
gate_timeout_s = 60.0

[daemon]
loop_min_starts = 3
loop_window_s = 120.0
recovery_backoff_s = 5.0
stable_s = 5.0

[units."{UNIT}"]
# GPUs from CUDA_VISIBLE_DEVICES of the unit (0,1,2,3); default patterns
"""

#: gpuguard.service for a checkout that has no packaged one yet (systemd/gpuguard.service).
MINIMAL_DAEMON_UNIT = """\
[Unit]
Description=gpuguard GPU restart-loop watchdog (e2e minimal unit)

[Service]
Type=notify
ExecStart=/usr/bin/gpuguard run
WatchdogSec=30
Restart=always
RestartSec=10
RestartPreventExitStatus=64 78
"""


INSTALL_SCRIPT = f"""\
set -eu
pip_whl=$(ls /wheels/pip-*.whl | head -n 1)
python3 -m venv --without-pip /opt/gpuguard
/opt/gpuguard/bin/python "$pip_whl/pip" install --quiet --no-index --disable-pip-version-check \\
    --find-links /wheels --find-links /wheels-gpuguard gpuguard
ln -sf /opt/gpuguard/bin/gpuguard /usr/bin/gpuguard
python3 -m venv --without-pip /opt/sglang
/opt/gpuguard/bin/python "$pip_whl/pip" --python /opt/sglang/bin/python install --quiet \\
    --no-index --disable-pip-version-check --find-links /wheels nvidia-ml-py
install -m 0644 /e2e/fakenvml-build/libnvidia-ml.so.1 /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1
ldconfig
mkdir -p /etc/systemd/system.conf.d
printf '[Manager]\\nDefaultEnvironment=FAKENVML_STATE={STATE}\\n' \\
    >/etc/systemd/system.conf.d/fakenvml.conf
install -m 0755 /e2e/fakenvml/gpu_hold.py /usr/local/bin/gpu_hold.py
install -d /opt/fakesglang
install -m 0755 /e2e/fakesglang/fake_sglang.py /e2e/fakesglang/fakegpu_driver.py /opt/fakesglang/
install -m 0644 /e2e/fakesglang/sglang.service /e2e/fakesglang/fakegpu-driver.service \\
    /etc/systemd/system/
cd /e2e/fakenvml
python3 -c 'import sys; from pathlib import Path; from fakestate import FakeGpu, write_state
write_state(Path(sys.argv[1]), [FakeGpu(release_delay_ms=int(sys.argv[2]))] * 4)' \\
    {STATE} "$1"
ln -s {HOST_PROC} {STATE}/host-proc
install -m 0644 /e2e/systemd/gpuguard-gate.socket /e2e/systemd/gpuguard-gate.service \\
    /etc/systemd/system/
systemctl daemon-reexec
systemctl enable --now --quiet gpuguard-gate.socket
systemctl start fakegpu-driver.service
"""


class ArtifactError(RuntimeError):
    """The wheels or the fake library could not be prepared; the message says what and how."""


# --- the host side: wheels and the fake library, cached --------------------------------------


@dataclass(frozen=True)
class Artifacts:
    """What a container needs from the host, and what preparing it cost this time."""

    deps: Path
    gpuguard: Path
    fakenvml: Path
    timings: dict[str, float] = field(default_factory=dict)

    def binds(self) -> list[Bind]:
        """Read-only binds: /wheels, /wheels-gpuguard, /e2e/{fakenvml,fakenvml-build,...}.

        /e2e/fakenvml-build is the fake library's build directory (fakestate.build_dir).
        And the host's procfs at HOST_PROC, linked as ``STATE/host-proc``: through it the fake
        driver reports a process's host PID, as NVIDIA's driver does (it ignores PID namespaces).
        """
        return [
            Bind(self.deps, "/wheels"),
            Bind(self.gpuguard, "/wheels-gpuguard"),
            Bind(FAKENVML_DIR, "/e2e/fakenvml"),
            Bind(self.fakenvml, "/e2e/fakenvml-build"),  # fakestate.build_dir(): maybe not in-tree
            Bind(FAKESGLANG_DIR, "/e2e/fakesglang"),
            Bind(SYSTEMD_DIR, "/e2e/systemd"),
            Bind(Path("/proc"), HOST_PROC),
        ]


def _say(line: str) -> None:
    """A note for the test's output (shown with a failure) and the session's closing notes."""
    sys.stderr.write(f"e2e: {line}\n")
    SESSION_NOTES.append(line)


def wheels_root() -> Path:
    """`$GPUGUARD_E2E_CACHE/wheels` (default /var/cache/gpuguard-e2e/wheels)."""
    return cache_dir() / "wheels"


def _digest(parts: Sequence[bytes]) -> str:
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(len(part).to_bytes(8, "little"))
        hasher.update(part)
    return hasher.hexdigest()[:12]


def deps_key(release: str) -> str:
    """Hash of what decides the dependency wheels: pyproject, lock, target Python, format."""
    lock = LOCK_FILE.read_bytes() if LOCK_FILE.is_file() else b""
    return _digest(
        [
            str(WHEELS_FORMAT).encode(),
            (CHECKOUT / "pyproject.toml").read_bytes(),
            lock,
            TARGET_PYTHON[release].encode(),
            str(_GLIBC_MINOR[release]).encode(),
        ]
    )


def _source_files() -> list[Path]:
    """The files a wheel of the checkout is built from (tracked or not: work in progress too)."""
    package = CHECKOUT / "src" / "gpuguard"
    files = sorted(p for p in package.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    extra = [CHECKOUT / name for name in ("pyproject.toml", "README.md", "LICENSE")]
    return [*files, *(p for p in extra if p.is_file())]


def source_key() -> str:
    """Hash of the checkout's package sources (names and contents)."""
    parts: list[bytes] = []
    for path in _source_files():
        parts += [str(path.relative_to(CHECKOUT)).encode(), path.read_bytes()]
    return _digest(parts)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _pip(*args: str, cwd: Path | None = None) -> None:
    """Run this interpreter's pip; raise with its output on failure."""
    argv = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, check=False)
    if done.returncode != 0:
        raise ArtifactError(
            f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
            f"{done.stderr[-3000:]}"
        )


def _cached_dir(final: Path, build: Callable[[Path], None]) -> tuple[Path, bool]:
    """`final` if complete, else made by `build(tmp)` and renamed into place (under a lock)."""
    stamp = final / ".complete"
    if stamp.is_file():
        return final, True
    with _locked(final.parent / f".{final.name}.lock"):
        if stamp.is_file():
            return final, True
        shutil.rmtree(final, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        try:
            build(tmp)
            (tmp / ".complete").write_text(time.strftime("%Y-%m-%dT%H:%M:%S%z\n"))
            tmp.chmod(0o755)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final, False


def _platform_args(release: str) -> list[str]:
    """Arguments for pip download: --platform takes exact tags, so every manylinux up to glibc."""
    tags = [f"manylinux_2_{minor}_x86_64" for minor in range(_GLIBC_MINOR[release], 4, -1)]
    tags += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    return [arg for tag in tags for arg in ("--platform", tag)]


def _build_deps(release: str, out: Path) -> None:
    """Wheels of every runtime dependency (and pip) for the release's CPython."""
    version = TARGET_PYTHON[release]
    target = ["--python-version", version, "--implementation", "cp"]
    target += ["--abi", f"cp{version.replace('.', '')}", *_platform_args(release)]
    if LOCK_FILE.is_file():
        # Pinned and hash-checked; --no-deps because the lock lists every package, and so that
        # a package published only as an sdist (sdnotify) may come as one: built below.
        _pip("download", "--quiet", "--no-deps", "--prefer-binary", "--require-hashes",
             *target, "--dest", str(out), "-r", str(LOCK_FILE))  # fmt: skip
    else:
        # No lock in this checkout yet: resolve the pyproject dependencies with this
        # interpreter, which must then be the release's Python version.
        here = f"{sys.version_info.major}.{sys.version_info.minor}"
        if here != version:
            raise ArtifactError(
                f"no lock file ({LOCK_FILE}) and this Python is {here}, not {release}'s "
                f"{version}: cannot pick wheels for the container"
            )
        pyproject = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())
        _pip("wheel", "--quiet", "--wheel-dir", str(out), *pyproject["project"]["dependencies"])
    for sdist in [*out.glob("*.tar.gz"), *out.glob("*.zip")]:
        _pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(sdist))
        sdist.unlink()
    _pip("download", "--quiet", "--no-deps", "--only-binary=:all:", *target, "--dest", str(out),
         "pip")  # fmt: skip


def _build_gpuguard(out: Path) -> None:
    """A wheel of the checkout, built from a copy (no build/ or egg-info left in the checkout)."""
    with tempfile.TemporaryDirectory(prefix="gpuguard-e2e-src-") as tmp:
        for path in _source_files():
            dest = Path(tmp) / path.relative_to(CHECKOUT)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
        _pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), tmp)


def _prune(pattern: str, keep: Path, count: int = 3) -> None:
    """Remove all but the newest `count` cache entries matching `pattern` (never `keep`).

    Entries made within the last hour stay: another checkout's test run may be installing them.
    """
    entries = sorted(wheels_root().glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True)
    recent = time.time() - 3600
    for old in entries[count:]:
        if old != keep and old.stat().st_mtime < recent:
            shutil.rmtree(old, ignore_errors=True)


def prepare_artifacts(release: str) -> Artifacts:
    """The wheels and the fake library for `release`, built on first use, then cached."""
    if release not in TARGET_PYTHON:
        raise ArtifactError(f"no wheel recipe for {release}; known: {', '.join(TARGET_PYTHON)}")
    timings: dict[str, float] = {}
    began = time.monotonic()
    deps, cached = _cached_dir(
        wheels_root() / f"{release}-{deps_key(release)}", lambda out: _build_deps(release, out)
    )
    timings["deps_s" if not cached else "deps_cached_s"] = time.monotonic() - began
    began = time.monotonic()
    wheel, cached = _cached_dir(wheels_root() / f"gpuguard-{source_key()}", _build_gpuguard)
    timings["gpuguard_wheel_s" if not cached else "gpuguard_wheel_cached_s"] = (
        time.monotonic() - began
    )
    _prune("gpuguard-*", wheel)
    began = time.monotonic()
    lib_dir = build_fake_nvml()
    timings["fakenvml_s"] = time.monotonic() - began
    return Artifacts(deps=deps, gpuguard=wheel, fakenvml=lib_dir, timings=timings)


# --- the container side ----------------------------------------------------------------------


INSTALL_SECONDS: list[float] = []
"""How long each `install` of this process took (for the end-of-run summary)."""


def install(box: Container, *, release_delay_ms: int = 500, config: str = CONFIG) -> float:
    """Install gpuguard, the fake NVML, the fake driver and the fake SGLang; return seconds.

    `box` must have been booted with `Artifacts.binds()`. `release_delay_ms`: how long the fake
    driver takes to free a dead process's memory (each GPU's release_delay_ms).
    """
    began = time.monotonic()
    box.run(["sh", "-c", INSTALL_SCRIPT, "install", str(release_delay_ms)], timeout=180)
    box.write_file("/etc/gpuguard/gpuguard.toml", config)
    seconds = time.monotonic() - began
    INSTALL_SECONDS.append(seconds)
    return seconds


@dataclass
class GpuBox:
    """A booted container with gpuguard installed (`install`), and what scenarios do with it."""

    box: Container
    install_s: float = 0.0

    # -- gpuguard and the fake GPUs --

    def gpuguard(self, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        """`/usr/bin/gpuguard ARGS` inside, as root, with FAKENVML_STATE set."""
        return self.box.run(["/usr/bin/gpuguard", *args], check=check, env=ENV, timeout=120)

    def status_json(self) -> dict[str, Any]:
        """`gpuguard status --json`, parsed."""
        done = self.gpuguard("status", "--json")
        document: dict[str, Any] = json.loads(done.stdout)
        return document

    @property
    def state_on_host(self) -> Path:
        """The container's fake NVML state directory, seen from the host (root only)."""
        return Path(f"/proc/{self.box.init_pid}/root{STATE}")

    def allocated_mib(self, minor: int) -> int:
        """MiB that currently count on fake GPU `minor` (fakestate's reading of the state)."""
        return allocated_mib(self.state_on_host, minor)

    def allocated(self) -> list[int]:
        """Allocated MiB of the four fake GPUs."""
        return [self.allocated_mib(minor) for minor in range(4)]

    # -- units --

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`systemctl ARGS` inside."""
        return self.box.systemctl(*args, check=check)

    def kill_unit(self, unit: str) -> None:
        """`systemctl kill --signal=SIGKILL UNIT`, surviving the kernel's EIO from cgroup.kill.

        On a loaded machine systemd's cgroup.kill has failed with "Failed to send signal SIGKILL
        to auxiliary processes: Input/output error". Then it is tried twice more, and after that
        every process in the unit's cgroup gets SIGKILL one by one (what systemd does where
        cgroup.kill is missing). Each fallback is said in the test's output and session notes.
        """
        for attempt in (1, 2, 3):
            done = self.systemctl("kill", "--signal=SIGKILL", unit, check=False)
            if done.returncode == 0:
                return
            if "Input/output error" not in done.stderr:
                raise ContainerError(f"systemctl kill {unit}: {done.stderr.strip()}")
            _say(f"systemctl kill {unit}, try {attempt}: {done.stderr.strip()}")
        cgroup = self.show(unit, "ControlGroup")
        script = (
            'for f in /sys/fs/cgroup/unified"$1"/cgroup.procs /sys/fs/cgroup"$1"/cgroup.procs; do '
            '[ -r "$f" ] && for p in $(cat "$f"); do kill -KILL "$p"; done; done; true'
        )
        self.box.run(["sh", "-c", script, "sh", cgroup])
        _say(f"systemctl kill {unit}: SIGKILLed each process of {cgroup} instead")

    def show(self, unit: str, prop: str) -> str:
        """One property of a unit (`systemctl show -P`)."""
        return self.box.systemctl("show", "-P", prop, unit).stdout.strip()

    def drop_in(self, unit: str, name: str, text: str) -> None:
        """Write /etc/systemd/system/UNIT.d/NAME and reload."""
        self.box.write_file(f"/etc/systemd/system/{unit}.d/{name}", text)
        self.box.systemctl("daemon-reload")

    def pids(self, pattern: str) -> list[int]:
        """PIDs (inside) of processes whose command line matches `pattern` (pgrep -f)."""
        done = self.box.run(["pgrep", "-f", pattern], check=False)
        return [int(pid) for pid in done.stdout.split()]

    def unit_line_at(self, text: str, *, since_s: float, what: str) -> float:
        """When the unit's output first said ``text`` since ``since_s`` (the journal's wall clock).

        Waited for up to 30 s; ``what`` names the line in a timeout's message.
        """
        found: list[float] = []

        def said() -> bool:
            for entry in self.box.journal([f"_SYSTEMD_UNIT={UNIT}", f"--since=@{int(since_s)}"]):
                if text in str(entry.get("MESSAGE")):
                    found.append(int(str(entry["__REALTIME_TIMESTAMP"])) / 1e6)
                    return True
            return False

        self.box.wait_for(what, said, timeout=30)
        return found[0]

    def daemon_said(self, since_s: float, event: str) -> list[tuple[float, dict[str, Any]]]:
        """The daemon's log lines named ``event`` since ``since_s``, with their journal time."""
        said = []
        for entry in self.box.journal([f"_SYSTEMD_UNIT={DAEMON}", f"--since=@{int(since_s)}"]):
            try:
                line = json.loads(str(entry.get("MESSAGE")))
            except ValueError:
                continue
            if isinstance(line, dict) and line.get("event") == event:
                said.append((int(str(entry["__REALTIME_TIMESTAMP"])) / 1e6, line))
        return said

    def wait_daemon_said(
        self, since_s: float, event: str, timeout: float
    ) -> tuple[float, dict[str, Any]]:
        """The first daemon line named ``event`` since ``since_s``, waited for."""
        found: list[tuple[float, dict[str, Any]]] = []

        def said() -> bool:
            found.extend(self.daemon_said(since_s, event)[:1])
            return bool(found)

        self.box.wait_for(f"the daemon's {event!r}", said, timeout=timeout)
        return found[0]

    def wait_fired_up(self, *, after_s: float, timeout: float = 30.0) -> str:
        """Wait for the server's "fired up" line logged after `after_s`; its invocation ID."""
        found: list[str] = []

        def fired() -> bool:
            entries = self.box.journal([f"_SYSTEMD_UNIT={UNIT}", f"--since=@{int(after_s)}"])
            for entry in entries:
                stamp = int(str(entry.get("__REALTIME_TIMESTAMP"))) / 1e6
                if stamp >= after_s and FIRED_UP in str(entry.get("MESSAGE")):
                    found.append(str(entry.get("_SYSTEMD_INVOCATION_ID")))
                    return True
            return False

        self.box.wait_for("the fake SGLang fired up", fired, timeout=timeout)
        return found[0]

    def start_server(self, timeout: float = 30.0) -> str:
        """Start sglang.service and wait until it serves; its invocation ID."""
        began = time.time()
        self.systemctl("start", UNIT)
        return self.wait_fired_up(after_s=began - 1, timeout=timeout)

    def kill_server(self) -> None:
        """SIGKILL everything of sglang.service and its escaped workers (fast teardown)."""
        script = (
            f"systemctl --no-block stop {UNIT} {DAEMON}; "
            f"systemctl kill --signal=SIGKILL {UNIT}; pkill -KILL -f sglang::scheduler; true"
        )
        with contextlib.suppress(ContainerError, subprocess.SubprocessError):
            self.box.run(["sh", "-c", script], check=False, timeout=10)

    def escape_to_scope(self, pid: int, scope: str = "operator-shell") -> str:
        """Move process `pid` (inside) out of its unit into a scope, as a stray worker would be.

        The scope is a real transient unit (`systemd-run --scope`, holding a `sleep`), like the
        session scope of an operator's shell; `pid` is written into its cgroup in the systemd
        hierarchy and, when mounted (hybrid/v2), the unified one, so neither systemd's stop
        nor gpuguard sees it in the old unit any more. Returns the scope's cgroup path.
        """
        start = f"systemd-run --scope --quiet --unit={scope} sleep infinity >/dev/null 2>&1 &"
        self.box.run(["sh", "-c", start])
        self.box.wait_for(
            f"{scope}.scope active",
            lambda: self.show(f"{scope}.scope", "ActiveState") == "active",
            timeout=10,
        )
        path = self.show(f"{scope}.scope", "ControlGroup")
        script = f"""
set -eu
for root in /sys/fs/cgroup/systemd /sys/fs/cgroup/unified /sys/fs/cgroup; do
    if [ -f "$root{path}/cgroup.procs" ]; then echo {pid} >"$root{path}/cgroup.procs"; fi
done
cat /proc/{pid}/cgroup
"""
        text = self.box.run(["sh", "-c", script]).stdout
        if f"{scope}.scope" not in text:
            raise AssertionError(f"PID {pid} did not move to {path}:\n{text}")
        return path

    def install_gate(self, extra: str | None = None) -> None:
        """The shipped gate drop-in (systemd/gpuguard-gate.conf) for sglang.service, verbatim."""
        self.box.write_file(
            f"/etc/systemd/system/{UNIT}.d/gpuguard-gate.conf", GATE_DROPIN.read_text()
        )
        if extra is not None:
            self.box.write_file(f"/etc/systemd/system/{UNIT}.d/zz-e2e.conf", extra)
        self.box.systemctl("daemon-reload")

    def start_daemon(self, *, as_shipped: bool = False, timeout: float = 30.0) -> str:
        """Install gpuguard.service (the packaged unit when the checkout has one) and start it.

        Returns which unit file was used. Type=notify: `systemctl start` returns once the daemon
        sent READY=1 (first inventory taken, journal attached). The packaged unit is used as
        shipped (``as_shipped`` is kept for the test that says so explicitly).
        """
        packaged = DAEMON_UNIT.is_file()
        text = DAEMON_UNIT.read_text() if packaged else MINIMAL_DAEMON_UNIT
        self.box.write_file(f"/etc/systemd/system/{DAEMON}", text)
        del as_shipped
        self.box.systemctl("daemon-reload")
        done = self.box.run(["systemctl", "start", DAEMON], check=False, timeout=timeout)
        if done.returncode != 0:
            log = self.box.run(["journalctl", "--no-pager", "-u", DAEMON, "-n", "40"]).stdout
            raise AssertionError(f"{DAEMON} did not start ({done.stderr.strip()}):\n{log}")
        if not packaged:
            return "minimal e2e unit (no systemd/gpuguard.service in this checkout)"
        return str(DAEMON_UNIT.relative_to(CHECKOUT))

    def daemon_log(self, since_s: float) -> list[dict[str, Any]]:
        """The daemon's JSON log lines since `since_s` (wall clock), parsed; others skipped."""
        events = []
        for entry in self.box.journal([f"_SYSTEMD_UNIT={DAEMON}", f"--since=@{int(since_s)}"]):
            with contextlib.suppress(ValueError, TypeError):
                event = json.loads(str(entry.get("MESSAGE")))
                if isinstance(event, dict):
                    events.append(event)
        return events


def daemon_events(events: Sequence[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The daemon log lines whose `event` is `name`."""
    return [event for event in events if event.get("event") == name]


def host_env_ok() -> str | None:
    """Why artifacts cannot be prepared here (no pip, no make), or None."""
    if shutil.which("make") is None or shutil.which("gcc") is None:
        return "building the fake libnvidia-ml needs make and gcc"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--version"], capture_output=True, check=False
    )
    if done.returncode != 0:
        return f"{sys.executable} has no pip to build wheels with"
    return None
