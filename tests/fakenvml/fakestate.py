"""Write and read the fake NVML's state directory (the format is in README.md).

The fake ``libnvidia-ml.so.1`` reads ``$FAKENVML_STATE/gpus.json`` and ``$FAKENVML_STATE/allocs/``
at every NVML call, so a test changes the world by calling these helpers while processes run.
Every write is atomic (temporary file + rename).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import secrets
import stat
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypedDict

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    # Annotations only: this file also runs under a container's bare python3 (tests/e2e).
    from typing_extensions import Unpack

FAKENVML_DIR = Path(__file__).resolve().parent
"""``tests/fakenvml``: the C source, the Makefile and these helpers."""
LIB_NAME = "libnvidia-ml.so.1"
GPU_HOLD = FAKENVML_DIR / "gpu_hold.py"
"""The standalone holder script (see README.md for its options)."""

H200_NAME = "NVIDIA H200"
H200_TOTAL_MIB = 143771
DEFAULT_GPU_COUNT = 4
MIB = 1048576

AllocKind = Literal["compute", "graphics", "mps"]

# Bus numbers of an 8-GPU HGX board (the C library uses the same table for its defaults).
_HGX_BUSES = (0x19, 0x3B, 0x4C, 0x5D, 0x9B, 0xBB, 0xCB, 0xDB)


def fake_uuid(index: int) -> str:
    """The deterministic ``GPU-…`` UUID ``write_state`` gives GPU ``index`` by default."""
    digest = hashlib.sha256(f"fakenvml-gpu-{index}".encode()).hexdigest()
    return f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


def fake_pci_bus_id(index: int) -> str:
    """The default PCI bus id of GPU ``index``, e.g. ``00000000:19:00.0``."""
    bus = _HGX_BUSES[index] if index < len(_HGX_BUSES) else 0x10 + index
    return f"00000000:{bus:02X}:00.0"


@dataclass(frozen=True)
class FakeGpu:
    """One GPU in ``gpus.json``; ``None`` identity fields are derived from the GPU's index."""

    name: str = H200_NAME
    uuid: str | None = None
    pci_bus_id: str | None = None
    minor: int | None = None
    total_mib: int = H200_TOTAL_MIB
    used_mib: int = 0
    reserved_mib: int = 0
    release_delay_ms: int = 0
    unattributed_mib: int = 0
    lost: bool = False
    no_permission: bool = False
    memory_not_supported: bool = False
    process_list_race: int = 0
    reset_required: bool = False
    retired_pages_pending: int = -1
    """-1: NOT_SUPPORTED, as on an H200 (it remaps rows instead); 0 or 1 otherwise."""
    persistence_mode: int = 0
    """-1: NOT_SUPPORTED; 0: disabled (the driver's default); 1: enabled."""
    remapped_rows_pending: int = 0
    """-1: NOT_SUPPORTED (before Ampere); 1: a remap waits for a GPU reset."""
    remapped_rows_failure: int = 0
    ecc_volatile_uncorrected: int = 0
    """-1: NOT_SUPPORTED (ECC off); else the volatile uncorrected count."""
    recovery_action: int = 0
    """-1: the field is NOT_SUPPORTED (older driver); else an nvmlDeviceGpuRecoveryAction_t."""
    mig_mode: int = 0
    """nvmlDeviceGetMigMode's current mode: -1 NOT_SUPPORTED (no MIG); 0 disabled; 1 enabled."""
    mig_pending: int = -1
    """The pending mode: -1 the same as ``mig_mode``; else 0 or 1 (after the next reset)."""

    def to_json(self, index: int) -> dict[str, Any]:
        """The ``gpus.json`` object for this GPU at position ``index`` (all keys explicit)."""
        data = asdict(self)
        data["uuid"] = self.uuid if self.uuid is not None else fake_uuid(index)
        data["pci_bus_id"] = (
            self.pci_bus_id if self.pci_bus_id is not None else fake_pci_bus_id(index)
        )
        data["minor"] = self.minor if self.minor is not None else index
        return data


class StateKnobs(TypedDict, total=False):
    """Top-level ``gpus.json`` keys besides ``gpus``."""

    driver_version: str
    init_error: int
    block_call: str
    block_ms: int


class GpuChanges(TypedDict, total=False):
    """Per-GPU ``gpus.json`` keys, for ``update_gpu``."""

    name: str
    uuid: str
    pci_bus_id: str
    minor: int
    total_mib: int
    used_mib: int
    reserved_mib: int
    release_delay_ms: int
    unattributed_mib: int
    lost: bool
    no_permission: bool
    memory_not_supported: bool
    process_list_race: int
    reset_required: bool
    retired_pages_pending: int
    persistence_mode: int
    remapped_rows_pending: int
    remapped_rows_failure: int
    ecc_volatile_uncorrected: int
    recovery_action: int
    mig_mode: int
    mig_pending: int


# driver_version is left out unless given: each library then answers its own default
# (550.54.15, or 470.256.02 for the old-driver build).
_DEFAULT_KNOBS: StateKnobs = {
    "init_error": 0,
    "block_call": "",
    "block_ms": 0,
}


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _ensure_layout(state_dir: Path, minors: Sequence[int]) -> None:
    dev = state_dir / "dev"
    dev.mkdir(parents=True, exist_ok=True)
    (state_dir / "allocs").mkdir(exist_ok=True)
    for name in ("nvidiactl", "nvidia-uvm", *(f"nvidia{minor}" for minor in minors)):
        (dev / name).touch(exist_ok=True)


def _save(state_dir: Path, data: Mapping[str, Any]) -> None:
    minors = [int(gpu["minor"]) for gpu in data.get("gpus", [])]
    _ensure_layout(state_dir, minors)
    _write_atomically(state_dir / "gpus.json", json.dumps(data, indent=2) + "\n")


def write_state(
    state_dir: Path, gpus: Sequence[FakeGpu] | None = None, **knobs: Unpack[StateKnobs]
) -> Path:
    """Create (or overwrite) a state directory; returns ``state_dir``.

    ``gpus`` defaults to four H200s. Writes ``gpus.json`` with every key explicit and creates
    ``dev/nvidiactl``, ``dev/nvidia-uvm``, ``dev/nvidia<minor>`` per GPU and ``allocs/``.
    Existing allocation files are kept.
    """
    if gpus is None:
        gpus = [FakeGpu()] * DEFAULT_GPU_COUNT
    data: dict[str, Any] = {**_DEFAULT_KNOBS, **knobs}
    data["gpus"] = [gpu.to_json(index) for index, gpu in enumerate(gpus)]
    _save(state_dir, data)
    return state_dir


def read_state(state_dir: Path) -> dict[str, Any]:
    """The parsed ``gpus.json``."""
    data: dict[str, Any] = json.loads((state_dir / "gpus.json").read_text(encoding="utf-8"))
    return data


def update_state(
    state_dir: Path, gpus: Sequence[FakeGpu] | None = None, **knobs: Unpack[StateKnobs]
) -> None:
    """Change top-level knobs (and replace the GPU list when ``gpus`` is given)."""
    data = read_state(state_dir)
    data.update(knobs)
    if gpus is not None:
        data["gpus"] = [gpu.to_json(index) for index, gpu in enumerate(gpus)]
    _save(state_dir, data)


def update_gpu(state_dir: Path, index: int, **changes: Unpack[GpuChanges]) -> None:
    """Change keys of GPU ``index`` (its position in ``gpus``), e.g. ``lost=True``."""
    data = read_state(state_dir)
    data["gpus"][index].update(changes)
    _save(state_dir, data)


# --------------------------------------------------------------------------------------------
# Allocations
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Alloc:
    """One well-formed allocation file, as the fake library reads it."""

    path: Path
    pid: int
    minor: int
    mib: int
    kind: str = "compute"
    report_usage: bool = True
    released_at_ms: int | None = None


def add_alloc(
    state_dir: Path,
    *,
    pid: int,
    minor: int,
    mib: int,
    kind: AllocKind = "compute",
    report_usage: bool = True,
    released_at_ms: int | None = None,
) -> Path:
    """Register an allocation without a process (e.g. to model a PID that no longer exists)."""
    lines = [f"pid={pid}", f"minor={minor}", f"mib={mib}", f"kind={kind}"]
    if not report_usage:
        lines.append("report_usage=0")
    if released_at_ms is not None:
        lines.append(f"released_at_ms={released_at_ms}")
    path = state_dir / "allocs" / f"{pid}-gpu{minor}-{secrets.token_hex(4)}.alloc"
    _write_atomically(path, "\n".join(lines) + "\n")
    return path


def release_alloc(path: Path, at_ms: int | None = None) -> None:
    """Mark an allocation released (at ``at_ms``, default now), as the holder's watcher does."""
    stamp = now_ms() if at_ms is None else at_ms
    with path.open("a", encoding="ascii") as file:
        file.write(f"released_at_ms={stamp}\n")


def now_ms() -> int:
    """CLOCK_REALTIME in milliseconds, the clock of ``released_at_ms``."""
    return time.time_ns() // 1_000_000


_INTEGER = re.compile(r"-?[0-9]+")
_KINDS = ("compute", "graphics", "mps")


def _integer(value: str) -> int | None:
    """A decimal integer exactly as the C parser accepts it (no spaces, no ``+``, no ``_``)."""
    return int(value) if _INTEGER.fullmatch(value) else None


def _parse_alloc(path: Path, text: str) -> Alloc | None:
    """Mirror of the C parser: newline-terminated ``key=value`` lines; None if malformed.

    A bad ``pid``/``minor``/``mib``/``kind``/``report_usage`` on any line rejects the file; the
    last valid line of a key wins, except ``released_at_ms`` where the first valid one does.
    """
    values: dict[str, int] = {}
    kind = "compute"
    released: int | None = None
    for line in text.split("\n")[:-1]:  # an unterminated last line is still being written
        key, sep, value = line.partition("=")
        if not sep:
            continue
        number = _integer(value)
        if key in ("pid", "minor", "mib", "report_usage"):
            if number is None:
                return None
            values[key] = number
        elif key == "kind":
            if value not in _KINDS:
                return None
            kind = value
        elif key == "released_at_ms" and released is None and number is not None:
            released = number
    pid, minor, mib = values.get("pid"), values.get("minor"), values.get("mib")
    if pid is None or minor is None or mib is None:
        return None
    if not 0 < pid <= 0xFFFFFFFF or minor < 0 or mib < 0:
        return None
    return Alloc(path, pid, minor, mib, kind, values.get("report_usage", 1) != 0, released)


def allocations(state_dir: Path) -> list[Alloc]:
    """Every well-formed allocation file (released or not), sorted by file name."""
    found = []
    for path in sorted((state_dir / "allocs").iterdir()):
        if path.name.startswith(".") or path.name.endswith(".tmp"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        alloc = _parse_alloc(path, text)
        if alloc is not None:
            found.append(alloc)
    return found


def _release_delay_ms(state_dir: Path, minor: int) -> int:
    for gpu in read_state(state_dir).get("gpus", []):
        if int(gpu.get("minor", -1)) == minor:
            return max(0, int(gpu.get("release_delay_ms", 0)))
    return 0


def counted_allocations(state_dir: Path, minor: int, at_ms: int | None = None) -> list[Alloc]:
    """Allocations on GPU ``minor`` that count toward ``used`` (and are listed) at ``at_ms``."""
    moment = now_ms() if at_ms is None else at_ms
    delay = _release_delay_ms(state_dir, minor)
    return [
        alloc
        for alloc in allocations(state_dir)
        if alloc.minor == minor
        and (alloc.released_at_ms is None or moment < alloc.released_at_ms + delay)
    ]


def allocated_mib(state_dir: Path, minor: int) -> int:
    """MiB of allocations that currently count on GPU ``minor``.

    This is what the fake adds to the GPU's idle baseline: NVML v2 ``used`` is
    ``used_mib + allocated_mib + unattributed_mib``.
    """
    return sum(alloc.mib for alloc in counted_allocations(state_dir, minor))


# --------------------------------------------------------------------------------------------
# Building and pointing at the library
# --------------------------------------------------------------------------------------------


def build_dir() -> Path:
    """Where the fake libraries are built: ``tests/fakenvml/build``, unless gpuguard refuses it.

    gpuguard loads ``libnvidia-ml.so.1`` only from a file and directories that are root's or its
    own user's alone (files.open_file). Root testing a checkout another user owns (``sudo make
    check`` on a clone in /home) would refuse the in-tree build, so it builds into a directory
    of its own under /tmp instead (made 0755, for tests that drop to nobody; refused if it is
    someone else's or others may write it).
    """
    inside = FAKENVML_DIR / "build"
    if all(_trusted(path) for path in (inside, FAKENVML_DIR, *FAKENVML_DIR.parents)):
        return inside
    digest = hashlib.sha256(str(FAKENVML_DIR).encode()).hexdigest()[:12]
    private = Path(tempfile.gettempdir()) / f"gpuguard-fakenvml-{os.geteuid()}-{digest}"
    private.mkdir(mode=0o755, exist_ok=True)
    info = private.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise RuntimeError(f"{private} is not a directory that only uid {os.geteuid()} writes")
    return private


def _trusted(path: Path) -> bool:
    """Whether gpuguard would load a library under ``path``: ours or root's, nobody else writes."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return True  # made by us when built
    sticky_root = info.st_uid == 0 and info.st_mode & stat.S_ISVTX
    writable = info.st_mode & 0o022 and not sticky_root
    return info.st_uid in {0, os.geteuid()} and not writable


def _lib_dir(old: bool) -> Path:
    return build_dir() / "old" if old else build_dir()


def _is_stale(lib: Path) -> bool:
    if not lib.exists():
        return True
    inputs = (FAKENVML_DIR / "fakenvml.c", FAKENVML_DIR / "Makefile")
    return lib.stat().st_mtime < max(path.stat().st_mtime for path in inputs)


def build_fake_nvml(old: bool = False) -> Path:
    """Build the fake libraries if missing or older than their source; return the lib's dir.

    The directory holds ``libnvidia-ml.so.1``: ``build_dir()`` for a current driver, its
    ``old/`` (``old=True``) for a driver < 510. Safe to call from concurrent processes (file
    lock).
    """
    lib = _lib_dir(old) / LIB_NAME
    if _is_stale(lib) or _others_write(lib):
        build = build_dir()
        build.mkdir(mode=0o755, exist_ok=True)
        with (build / ".lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if _is_stale(lib):
                result = subprocess.run(
                    ["make", "-C", str(FAKENVML_DIR), f"BUILD={build}"],
                    capture_output=True,
                    text=True,
                    check=False,
                    preexec_fn=_umask_022,
                )
                if result.returncode != 0 or _is_stale(lib):
                    raise RuntimeError(
                        f"building the fake libnvidia-ml failed:\n{result.stdout}{result.stderr}"
                    )
            _forbid_others(build, lib)
    return lib.parent


def _umask_022() -> None:
    """The build's umask: gpuguard refuses a library group or others may write (files.py).

    A user's umask may be 0002 (Debian 13's default): the library, and the directories make
    creates, would come out group-writable and every test using them would fail.
    """
    os.umask(0o022)


def _others_write(lib: Path) -> bool:
    """Whether group or others may write ``lib`` or its directory (a build under umask 0002)."""
    return any(path.exists() and path.stat().st_mode & 0o022 for path in (lib, lib.parent))


def _forbid_others(build: Path, lib: Path) -> None:
    """Take group and others' write bit off ``lib`` and the directories from it up to ``build``.

    For a build made before the build's own umask (above) was set: make leaves an up-to-date
    library alone, modes and all.
    """
    for path in (lib, *lib.parents):
        info = path.stat()
        if info.st_mode & 0o022:
            path.chmod(stat.S_IMODE(info.st_mode) & ~0o022)
        if path == build:
            break


def fake_library(old: bool = False) -> Path:
    """The fake ``libnvidia-ml.so.1`` by absolute path (built if needed).

    gpuguard is told it through ``nvml_library`` in its configuration; it never follows
    ``LD_LIBRARY_PATH``, and neither do these helpers.
    """
    return build_fake_nvml(old=old) / LIB_NAME


def nvml_environ(
    state_dir: Path, old: bool = False, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """An environment for a subprocess that uses the fake NVML reading ``state_dir``.

    ``FAKENVML_LIBRARY`` names the library (for raw pynvml scripts, which load it by that path
    before pynvml's own ``dlopen("libnvidia-ml.so.1")`` finds it by soname). ``LD_LIBRARY_PATH``
    is removed: nothing may depend on it. ``base`` defaults to ``os.environ``.
    """
    env = dict(os.environ if base is None else base)
    env.pop("LD_LIBRARY_PATH", None)
    env["FAKENVML_LIBRARY"] = str(fake_library(old=old))
    env["FAKENVML_STATE"] = str(state_dir)
    return env


class NvmlEnv(Protocol):
    """The ``nvml_env`` fixture: an environment for subprocesses that use the fake NVML."""

    def __call__(self, state: Path, old: bool = False) -> dict[str, str]:
        """``os.environ`` plus ``FAKENVML_LIBRARY`` and ``FAKENVML_STATE``, no LD_LIBRARY_PATH."""
        ...


if __name__ == "__main__":  # `make fakenvml`: build both libraries where the tests look for them
    print(build_fake_nvml(), build_fake_nvml(old=True))  # noqa: T201 - the Makefile shows it
