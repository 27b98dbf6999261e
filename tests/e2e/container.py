"""A real systemd booted with systemd-nspawn, for end-to-end tests.

Two parts: `ensure_rootfs` debootstraps a Debian tree once per release and recipe into a cache
outside the checkout; `Container` boots a throw-away instance of it (an overlay with a tmpfs upper
layer, so the cached tree stays pristine), runs commands inside with nsenter and always tears it
down. What is at risk: a container that outlives the test run (it holds a systemd, a journal and
whatever a test started), or a half-built tree that is reused; both are guarded against here.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from typing_extensions import Self

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping, Sequence
    from types import FrameType, TracebackType

# --- the root file system --------------------------------------------------------------------

#: Releases we boot, with the systemd major version each ships.
RELEASES: dict[str, int] = {"bookworm": 252, "trixie": 257}

DEFAULT_CACHE = Path("/var/cache/gpuguard-e2e")
CACHE_ENV = "GPUGUARD_E2E_CACHE"
MIRROR_ENV = "GPUGUARD_E2E_MIRROR"
FALLBACK_MIRROR = "http://deb.debian.org/debian"

#: Installed on top of `--variant=minbase` (which already brings bsdutils' `logger`, passwd's
#: `useradd` and util-linux' `setpriv`/`nsenter`). Changing this list changes the recipe hash.
PACKAGES: tuple[str, ...] = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "python3",
    "procps",
    "util-linux",
    "psmisc",
)

#: Run once in a chroot after debootstrap; part of the recipe hash.
SETUP_SCRIPT = """\
set -eu
# No root password: `machinectl login`-style debugging on the console needs no secret.
passwd -d root >/dev/null
echo gpuguard-e2e >/etc/hostname
# Empty machine-id: systemd generates a fresh one on every boot, so no two containers (and no
# journal) share an identity baked into the cached tree.
: >/etc/machine-id
# Nothing is masked: on Debian 12 and 13 under systemd-nspawn 252 (this host) every unit of the
# minbase+systemd set starts, and `systemctl --failed` is empty (checked when this recipe was
# written). Mask here, with the reason, if a release starts failing units in nspawn.
"""

#: Variants of the tree for one scenario each: packages added to PACKAGES (by release) and a
#: script run after SETUP_SCRIPT. The plain tree (no variant) keeps its recipe, hash and name.
VARIANTS: dict[str, tuple[dict[str, tuple[str, ...]], str]] = {
    # test_docker_unit.py: Debian's docker engine. Its daemon, started by that test only, keeps
    # images and containers in plain directories (vfs: no overlay on the container's overlay
    # root), makes no bridge and no firewall rules (the containers use the host's network), and
    # logs containers to the journal, so a left-over's output outlives its `docker run` client.
    # Debian 13 ships the client apart, in docker-cli (only recommended by docker.io).
    "docker": (
        {"bookworm": ("docker.io",), "trixie": ("docker.io", "docker-cli")},
        """\
set -eu
mkdir -p /etc/docker
cat >/etc/docker/daemon.json <<'JSON'
{"storage-driver": "vfs", "bridge": "none", "iptables": false, "ip6tables": false,
 "ip-masq": false, "log-driver": "journald"}
JSON
# Not at boot: only the docker scenario starts the engine (and waits for it).
systemctl disable docker.service docker.socket containerd.service >/dev/null 2>&1 || true
""",
    ),
    # test_real_vllm.py and the real engine's venv (real_engine.py): vLLM's CPU kernels
    # (vllm._C) link libnuma.so.1; without it the Worker dies at its start with
    # "ImportError('libnuma.so.1: cannot open shared object file')".
    "vllm": ({"bookworm": ("libnuma1",), "trixie": ("libnuma1",)}, "true\n"),
}

RECIPE_FORMAT = 1
RECIPE_STAMP = "etc/gpuguard-e2e/recipe.json"
BUILD_TIMEOUT_S = 1200.0

PATH_INSIDE = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CLEAN_ENV: dict[str, str] = {"PATH": PATH_INSIDE, "LANG": "C.UTF-8", "SYSTEMD_PAGER": ""}


class ContainerError(RuntimeError):
    """Building, booting or driving a container failed; the message says what and where."""


class ContainerCommandError(ContainerError):
    """A command inside the container exited non-zero (`check=True`)."""

    def __init__(self, cmd: Sequence[str], returncode: int, stdout: str, stderr: str) -> None:
        """Keep the outcome; the message shows the command and the tails of both streams."""
        self.cmd = list(cmd)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(
            f"command {self.cmd!r} exited {returncode} in the container\n"
            f"--- stdout (tail) ---\n{stdout[-2000:]}\n--- stderr (tail) ---\n{stderr[-2000:]}"
        )


def recipe(release: str, variant: str | None = None) -> dict[str, object]:
    """Everything that decides the content of a cached tree; its hash names the cache entry."""
    if release not in RELEASES:
        raise ValueError(f"unknown release {release!r}; known: {', '.join(RELEASES)}")
    made: dict[str, object] = {
        "format": RECIPE_FORMAT,
        "release": release,
        "variant": "minbase",
        "packages": list(PACKAGES),
        "setup": SETUP_SCRIPT,
    }
    if variant is not None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown tree variant {variant!r}; known: {', '.join(VARIANTS)}")
        extra, setup = VARIANTS[variant]
        made |= {
            "tree": variant,
            "packages": [*PACKAGES, *extra[release]],
            "setup": SETUP_SCRIPT + setup,
        }
    return made


def recipe_hash(release: str, variant: str | None = None) -> str:
    """A short stable hash of `recipe(release, variant)`."""
    text = json.dumps(recipe(release, variant), sort_keys=True).encode()
    return hashlib.sha256(text).hexdigest()[:12]


def cache_dir() -> Path:
    """Where cached trees live: `$GPUGUARD_E2E_CACHE`, else /var/cache/gpuguard-e2e."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def rootfs_path(release: str, cache: Path | None = None, variant: str | None = None) -> Path:
    """The cache entry for the current recipe of `release` (it may not exist yet).

    A variant's is `<release>-<variant>-<hash>`: the name still starts with the release.
    """
    name = release if variant is None else f"{release}-{variant}"
    return (cache or cache_dir()) / f"{name}-{recipe_hash(release, variant)}"


_APT_POLICY_LINE = re.compile(r"^\s*-?\d+\s+(\S+)\s+(\S+)/\S+\s+\S+\s+Packages\s*$")


def pick_mirror() -> str:
    """A Debian mirror this machine reaches.

    `$GPUGUARD_E2E_MIRROR`, else the first non-security archive apt on this host uses
    (`apt-cache policy`), else deb.debian.org.
    """
    if override := os.environ.get(MIRROR_ENV):
        return override
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["apt-cache", "policy"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
        for line in out.splitlines():
            match = _APT_POLICY_LINE.match(line)
            if match is None:
                continue
            uri, suite = match.groups()
            if uri.rstrip("/").endswith("/debian") and "security" not in suite:
                return uri.rstrip("/")
    return FALLBACK_MIRROR


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock on `path`, so two test runs never build the same tree at once."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path` in our mount namespace, deepest first."""
    prefix = str(path).rstrip("/")
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        # Field 5 is the mount point, octal-escaped (space = \040).
        point = line.split()[4].encode().decode("unicode_escape")
        if point == prefix or point.startswith(prefix + "/"):
            found.append(point)
    return sorted(found, key=len, reverse=True)


def remove_tree(path: Path) -> None:
    """Remove a (possibly half-built) tree.

    Unmounts what an interrupted debootstrap left mounted inside (its /proc, /sys) first, then
    deletes without crossing into any other file system.
    """
    if not path.exists():
        return
    for point in _mounts_under(path):
        subprocess.run(["umount", "--lazy", point], check=False, capture_output=True)
    subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)], check=True)


def ensure_rootfs(
    release: str,
    *,
    cache: Path | None = None,
    mirror: str | None = None,
    variant: str | None = None,
) -> Path:
    """The cached root file system of `release`, debootstrapped first if this recipe has none.

    The tree is built in a temporary directory beside the cache entry and renamed into place only
    once complete, under a lock file, so an interrupted build is never reused and two runs never
    build at once. Trees of older recipes are left alone (another checkout may still use them).
    A variant's lock, build directory and log are named `<variant>+<release>`, which the plain
    tree's sweep of half-built `.build-<release>-*` directories never matches.
    """
    cache = cache or cache_dir()
    final = rootfs_path(release, cache, variant)
    if (final / RECIPE_STAMP).is_file():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    tag = release if variant is None else f"{variant}+{release}"
    with _locked(cache / f".{tag}.lock"):
        if (final / RECIPE_STAMP).is_file():
            return final
        for stale in cache.glob(f".build-{tag}-*"):
            remove_tree(stale)
        if final.exists():  # a tree without a stamp was not made by us; do not trust it
            remove_tree(final)
        build = Path(tempfile.mkdtemp(prefix=f".build-{tag}-", dir=cache))
        made = recipe(release, variant)
        try:
            build.chmod(0o755)  # it becomes the container's /; mkdtemp made it 0700
            _debootstrap(made, build, cache / f".build-{tag}.log", mirror or pick_mirror())
            (build / RECIPE_STAMP).parent.mkdir(parents=True, exist_ok=True)
            (build / RECIPE_STAMP).write_text(json.dumps(made, indent=2) + "\n")
            build.rename(final)
        except BaseException:
            remove_tree(build)
            raise
    return final


def _debootstrap(made: dict[str, object], target: Path, log: Path, mirror: str) -> None:
    """Run debootstrap and the setup script of recipe `made` into `target`, logging to `log`.

    Raises with the log's tail on failure.
    """
    release, packages, setup = str(made["release"]), made["packages"], str(made["setup"])
    assert isinstance(packages, list)
    debs = log.parent / "debs"  # downloaded .debs, shared by all builds: rebuilds mostly offline
    debs.mkdir(exist_ok=True)
    argv = [
        "debootstrap",
        "--variant=minbase",
        f"--include={','.join(packages)}",
        f"--cache-dir={debs}",
        release,
        str(target),
        mirror,
    ]
    with log.open("w") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        done = subprocess.run(
            argv, stdout=out, stderr=subprocess.STDOUT, env=CLEAN_ENV, timeout=BUILD_TIMEOUT_S,
            check=False,
        )  # fmt: skip
        if done.returncode == 0:
            done = subprocess.run(
                ["chroot", str(target), "/bin/sh", "-c", setup],
                stdout=out, stderr=subprocess.STDOUT, env=CLEAN_ENV, timeout=120, check=False,
            )  # fmt: skip
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise ContainerError(
            f"building the {release} root file system failed (exit {done.returncode}, "
            f"mirror {mirror}); full log in {log}, tail:\n{tail}"
        )


# --- host /proc helpers ----------------------------------------------------------------------


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def _nspid(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """The NSpid line of /proc/PID/status: the pid in each nested pid namespace, outermost first."""
    try:
        status = (proc / str(pid) / "status").read_text()
    except OSError:
        return []
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            return [int(x) for x in line.split()[1:]]
    return []


def _host_pids() -> list[int]:
    # A list, not a generator over the scandir: a caller that stops early (host_pid) would
    # leave the directory open until the collector finds it (an unraisable warning).
    with os.scandir("/proc") as entries:
        return [int(entry.name) for entry in entries if entry.name.isdigit()]


def _children(pid: int) -> list[int]:
    # /proc/PID/task/TID/children needs CONFIG_PROC_CHILDREN, which this kernel lacks.
    return [child for child in _host_pids() if _ppid(child) == pid]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks): with the pid, a process identity."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]


OWNER_FILE = "owner"


def _claim_workdir(workdir: Path) -> None:
    """Record which process owns `workdir`, so a later run can sweep it if that process died."""
    (workdir / OWNER_FILE).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")


def sweep_stale_workdirs(tmp: Path | None = None) -> list[Path]:
    """Remove work directories left by a test process that died without teardown (SIGKILL).

    The containers themselves died with that process (parent-death signal).
    """
    removed = []
    for workdir in Path(tmp or tempfile.gettempdir()).glob("gpuguard-e2e-*-*"):
        try:
            pid, started = (workdir / OWNER_FILE).read_text().split()
        except (OSError, ValueError):
            continue  # not ours, or being created right now
        if _start_time(int(pid)) != started:
            remove_tree(workdir)
            removed.append(workdir)
    return removed


def _set_parent_death_signal() -> None:  # pragma: no cover - runs in the forked child
    """In the child before exec: nspawn gets SIGTERM (and halts) when the test process dies.

    This covers the one death no handler sees: SIGKILL of the test process.
    """
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


# --- the safety net --------------------------------------------------------------------------

_LIVE: set[Container] = set()
_LIVE_LOCK = threading.Lock()
_NET_INSTALLED = False


def stop_all_containers() -> None:
    """Tear down every container this process started and has not stopped yet."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for container in live:
        container.stop(graceful=False)


def _install_safety_net() -> None:
    """Stop live containers at exit and on SIGTERM/SIGHUP.

    The handlers then behave as before: call the previous handler, or re-raise the signal with
    its default action.
    """
    global _NET_INSTALLED  # noqa: PLW0603 - one process-wide net, installed once
    if _NET_INSTALLED:
        return
    _NET_INSTALLED = True
    atexit.register(stop_all_containers)
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(signum)
        if previous is signal.SIG_IGN:
            continue

        def handler(
            signum: int, frame: FrameType | None, previous: object = previous
        ) -> None:  # fmt: skip
            stop_all_containers()
            if callable(previous):
                previous(signum, frame)
                return
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(signum, handler)


# --- the container ---------------------------------------------------------------------------

JournalValue = str | list[int] | list[str | list[int]] | None
JournalEntry = dict[str, JournalValue]


@dataclass(frozen=True)
class Bind:
    """A host path made visible in the container (`--bind-ro=` by default, `--bind=` if not)."""

    source: Path
    target: str | None = None
    read_only: bool = True

    def option(self) -> str:
        """The systemd-nspawn option for this bind."""
        target = self.target or str(self.source)
        if ":" in str(self.source) or ":" in target:
            raise ValueError(f"nspawn bind paths cannot contain ':': {self.source} -> {target}")
        flag = "--bind-ro" if self.read_only else "--bind"
        return f"{flag}={self.source}:{target}"


class Container:
    """One booted container; use as a context manager (teardown is unconditional).

    `mode="overlay"` boots the cached tree read-only under a tmpfs upper layer
    (nspawn `--volatile=overlay`: fast, nothing to copy, nothing written back); `mode="copy"`
    boots a `cp -a --reflink=auto` copy in a temporary directory, for a kernel without overlayfs.
    """

    def __init__(
        self,
        rootfs: Path,
        *,
        binds: Sequence[Bind] = (),
        mode: Literal["overlay", "copy"] = "overlay",
        boot_timeout: float = 90.0,
        stop_timeout: float = 10.0,
        nspawn_args: Sequence[str] = (),
        nspawn_env: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> None:
        """Prepare, not boot: `start()` or `with` boots.

        `nspawn_env`: variables for systemd-nspawn itself (its `SYSTEMD_NSPAWN_*` switches).
        """
        self.rootfs = rootfs
        self.binds = tuple(binds)
        self.mode = mode
        self.boot_timeout = boot_timeout
        self.stop_timeout = stop_timeout
        self.nspawn_args = tuple(nspawn_args)
        self.nspawn_env = dict(nspawn_env or {})
        self.name = name or f"gpuguard-e2e-{secrets.token_hex(4)}"
        self.workdir: Path | None = None
        self.boot_seconds: float | None = None
        self.teardown_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._init_pid: int | None = None
        self._init_pidfd: int | None = None
        self._console_text = ""
        self._nsenter = shutil.which("nsenter") or "nsenter"

    # -- lifecycle --

    def __enter__(self) -> Self:
        """Boot (tearing down again if booting fails)."""
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Tear down, whatever happened in the body."""
        self.stop()

    @property
    def nspawn_pid(self) -> int:
        """The host pid of systemd-nspawn."""
        if self._proc is None:
            raise ContainerError(f"container {self.name} is not started")
        return self._proc.pid

    @property
    def init_pid(self) -> int:
        """The host pid of the container's systemd (PID 1 inside)."""
        if self._init_pid is None:
            raise ContainerError(f"container {self.name} has no systemd yet")
        return self._init_pid

    @property
    def console_log(self) -> Path:
        """The file that receives systemd-nspawn's stdout and stderr (the console)."""
        if self.workdir is None:
            raise ContainerError(f"container {self.name} is not started")
        return self.workdir / "console.log"

    def console(self) -> str:
        """The console output so far (kept after teardown)."""
        if self.workdir is not None and self.console_log.exists():
            self._console_text = self.console_log.read_text(errors="replace")
        return self._console_text

    def start(self) -> None:
        """Boot and wait until `systemctl is-system-running` says running or degraded."""
        if self._proc is not None:
            raise ContainerError(f"container {self.name} was already started")
        _install_safety_net()
        sweep_stale_workdirs()
        began = time.monotonic()
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        try:
            _claim_workdir(self.workdir)
            argv = ["systemd-nspawn", *self._root_options()]
            argv += ["--register=no", "--keep-unit", "-b", "--console=pipe", "-M", self.name]
            argv += [bind.option() for bind in self.binds]
            argv += self.nspawn_args
            with self.console_log.open("wb") as console:
                self._proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=console,
                    stderr=subprocess.STDOUT,
                    env={**CLEAN_ENV, "SYSTEMD_LOG_COLOR": "0", **self.nspawn_env},
                    start_new_session=True,  # a terminal's Ctrl-C reaches us, not nspawn
                    preexec_fn=_set_parent_death_signal,  # noqa: PLW1509 - one prctl
                )
            with _LIVE_LOCK:
                _LIVE.add(self)
            self._wait_for_init(began + self.boot_timeout)
            self._wait_until_booted(began + self.boot_timeout)
        except BaseException:
            self.stop(graceful=False)
            raise
        self.boot_seconds = time.monotonic() - began

    def _root_options(self) -> list[str]:
        if self.mode == "overlay":
            return ["-D", str(self.rootfs), "--volatile=overlay"]
        assert self.workdir is not None
        copy = self.workdir / "root"
        subprocess.run(
            ["cp", "-a", "--reflink=auto", f"{self.rootfs}/.", str(copy)],
            check=True,
            capture_output=True,
        )
        return ["-D", str(copy)]

    def _check_nspawn_alive(self, what: str) -> None:
        assert self._proc is not None
        if self._proc.poll() is not None:
            raise ContainerError(
                f"systemd-nspawn for {self.name} exited {self._proc.returncode} while {what}; "
                f"console:\n{self.console()[-4000:]}"
            )

    def _wait_for_init(self, deadline: float) -> None:
        """The container's systemd is the child of nspawn that is PID 1 in its own namespace."""
        while True:
            self._check_nspawn_alive("waiting for the container's systemd")
            for child in _children(self.nspawn_pid):
                nspid = _nspid(child)
                if len(nspid) > 1 and nspid[-1] == 1 and _comm(child) == "systemd":
                    self._init_pid = child
                    self._init_pidfd = os.pidfd_open(child)
                    return
            if time.monotonic() > deadline:
                raise ContainerError(
                    f"no systemd appeared under systemd-nspawn (pid {self.nspawn_pid}) for "
                    f"{self.name}; console:\n{self.console()[-4000:]}"
                )
            time.sleep(0.05)

    def _wait_until_booted(self, deadline: float) -> None:
        state = "unknown"
        while time.monotonic() < deadline:
            self._check_nspawn_alive("booting")
            done = self.run(["systemctl", "is-system-running"], check=False, timeout=30)
            state = done.stdout.strip() or done.stderr.strip()
            if state in {"running", "degraded"}:
                return
            if state in {"maintenance", "stopping"}:
                break
            time.sleep(0.2)
        jobs = self.run(["systemctl", "list-jobs", "--no-pager"], check=False, timeout=30)
        raise ContainerError(
            f"container {self.name} did not reach running/degraded within {self.boot_timeout} s "
            f"(last state: {state!r}); pending jobs:\n{jobs.stdout}\n"
            f"console:\n{self.console()[-4000:]}"
        )

    def stop(self, *, graceful: bool = True) -> None:
        """Halt and remove the container; idempotent and never raises for a dead container.

        SIGTERM asks nspawn to halt the container (`systemctl poweroff` inside would need a D-Bus
        daemon); a second SIGTERM makes nspawn end it at once; then SIGKILL to nspawn and to the
        container's systemd (a pid namespace dies with its init). Graceful stops wait
        `stop_timeout` for the halt; non-graceful ones (the safety net) wait 2 s.
        """
        began = time.monotonic()
        proc = self._proc
        try:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                if not _waited(proc, self.stop_timeout if graceful else 2.0):
                    proc.send_signal(signal.SIGTERM)
                    if not _waited(proc, 3.0):
                        self._kill_init()
                        proc.kill()
                        _waited(proc, 10.0)
            if proc is not None and proc.poll() is None:  # pragma: no cover - kernel trouble
                raise ContainerError(f"systemd-nspawn {proc.pid} ({self.name}) survived SIGKILL")
            self._kill_init()  # if nspawn died first, its container must not linger
        finally:
            self.console()
            if self._init_pidfd is not None:
                os.close(self._init_pidfd)
                self._init_pidfd = None
            if self.workdir is not None:
                remove_tree(self.workdir)
            with _LIVE_LOCK:
                _LIVE.discard(self)
            if proc is not None and self.teardown_seconds is None:
                self.teardown_seconds = time.monotonic() - began

    def _kill_init(self) -> None:
        if self._init_pidfd is None:
            return
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._init_pidfd, signal.SIGKILL)

    # -- driving it --

    def run(
        self,
        cmd: Sequence[str],
        *,
        check: bool = True,
        timeout: float = 60.0,
        input: str | None = None,  # noqa: A002 - the name subprocess.run uses
        user: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `cmd` inside (all namespaces of the container's systemd), as root or `user`.

        The environment is a clean one (`CLEAN_ENV` plus `env`), never the test process's.
        """
        argv = [self._nsenter, "-t", str(self.init_pid), "-a", "--"]
        if user is not None:
            argv += ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups"]
            argv += ["--reset-env", "--"]
        argv += list(cmd)
        done = subprocess.run(
            argv,
            input=input,
            capture_output=True,
            text=True,
            errors="backslashreplace",
            timeout=timeout,
            env={**CLEAN_ENV, **(env or {})},
            check=False,
        )
        if check and done.returncode != 0:
            raise ContainerCommandError(cmd, done.returncode, done.stdout, done.stderr)
        return done

    def run_as(
        self,
        user: str,
        cmd: Sequence[str],
        *,
        check: bool = True,
        timeout: float = 60.0,
        input: str | None = None,  # noqa: A002 - the name subprocess.run uses
    ) -> subprocess.CompletedProcess[str]:
        """Run `cmd` inside as `user` (setpriv: its uid, gid and groups; HOME/PATH reset)."""
        return self.run(cmd, check=check, timeout=timeout, input=input, user=user)

    def write_file(self, path: str, text: str, *, mode: int = 0o644) -> None:
        """Write `text` to `path` inside (parents created), as root."""
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat >"$1" && chmod "$2" -- "$1"'
        self.run(["sh", "-c", script, "sh", path, f"{mode:o}"], input=text)

    def read_file(self, path: str) -> str:
        """The text of `path` inside."""
        return self.run(["cat", "--", path]).stdout

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`systemctl --no-pager ARGS` inside."""
        return self.run(["systemctl", "--no-pager", *args], check=check)

    def journal(self, args: Sequence[str] = ()) -> list[JournalEntry]:
        """`journalctl -o json ARGS` inside, one dict per entry, as journalctl printed it.

        No match gives an empty list (journalctl exits 0 then, on both 252 and 257).
        """
        done = self.run(["journalctl", "--no-pager", "-o", "json", *args])
        return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]

    def wait_journal(
        self,
        args: Sequence[str],
        until: Callable[[list[JournalEntry]], bool],
        *,
        timeout: float = 20.0,
    ) -> list[JournalEntry]:
        """Poll `journal(args)` until `until(entries)` holds (journald stores asynchronously)."""
        deadline = time.monotonic() + timeout
        while True:
            entries = self.journal(args)
            if until(entries):
                return entries
            if time.monotonic() > deadline:
                lines = [str(e.get("MESSAGE")) for e in entries[-20:]]
                raise ContainerError(
                    f"journal {list(args)!r} in {self.name} did not reach the expected state "
                    f"within {timeout} s; last messages:\n" + "\n".join(lines)
                )
            time.sleep(0.2)

    def wait_for(
        self, what: str, check: Callable[[], bool], *, timeout: float = 20.0
    ) -> None:  # fmt: skip
        """Poll `check()` until it holds; raise naming `what` on timeout."""
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise ContainerError(f"{what}: not reached within {timeout} s in {self.name}")
            time.sleep(0.1)

    def host_pid(self, pid: int) -> int:
        """The host pid of the process that is `pid` inside the container.

        Also for a process of a container nested in this one (docker's): the host process whose
        NSpid ends in the one the container's procfs shows for `pid`, in the same PID namespace
        (a namespace's inode is the same in every view).
        """
        inside = Path(f"/proc/{self.init_pid}/root/proc")
        inner = _nspid(pid, inside)
        try:
            ns = (inside / str(pid) / "ns" / "pid").stat().st_ino
        except OSError:
            inner = []
        for candidate in _host_pids() if inner else []:
            nspid = _nspid(candidate)
            if len(nspid) > len(inner) and nspid[-len(inner) :] == inner:
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{candidate}/ns/pid").stat().st_ino == ns:
                        return candidate
        raise ContainerError(f"no process {pid} in container {self.name}")

    def systemd_version(self) -> int:
        """The major version of the container's systemd (`systemctl --version`)."""
        first = self.run(["systemctl", "--version"]).stdout.split()
        return int(first[1])


def _waited(proc: subprocess.Popen[bytes], seconds: float) -> bool:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


def nspawn_processes() -> list[int]:
    """Host pids of every systemd-nspawn process (for teardown checks)."""
    return [pid for pid in _host_pids() if _comm(pid) == "systemd-nspawn"]
