"""Where the driver's libnvidia-ml.so.1 is, and loading it so nothing else can be loaded instead.

gpuguard runs as root and loads a vendor library into its NVML worker: the file is found by
absolute path (ldconfig's cache, then the distributions' directories, never LD_LIBRARY_PATH),
opened with the checks of files.open_file, loaded through that descriptor, and the worker's
environment is scrubbed of what could steer the library's own loading first.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from pathlib import Path

from gpuguard.adapters import files, programs

LIBRARY = "libnvidia-ml.so.1"
# Where drivers install it when ldconfig's cache does not name it (Debian/Ubuntu, RHEL, Arch).
LIBRARY_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/lib64",
)
# glibc ignores these for setuid programs (unsecvars.h); the worker drops them, and every LD_*.
_UNSAFE_ENVIRONMENT = frozenset(
    {
        "GCONV_PATH",
        "GETCONF_DIR",
        "GLIBC_TUNABLES",
        "HOSTALIASES",
        "LOCALDOMAIN",
        "LOCPATH",
        "MALLOC_ARENA_MAX",
        "MALLOC_TRACE",
        "NIS_PATH",
        "NLSPATH",
        "RESOLV_HOST_CONF",
        "RES_OPTIONS",
        "TMPDIR",
        "TZDIR",
    }
)


def library_candidates(configured: str | None) -> tuple[str, ...]:
    """Absolute paths to try for libnvidia-ml.so.1, best first; never LD_LIBRARY_PATH.

    The configured file alone when set; else what ldconfig's cache names (what the dynamic
    linker itself would load without LD_LIBRARY_PATH), then the distributions' directories.
    Asked once per process: a driver upgrade keeps the soname link's path.
    """
    if configured is not None:
        return (configured,)
    found: list[str] = []
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        listing = programs.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=5)
        for line in listing.stdout.splitlines():
            name, _, target = line.strip().partition(" => ")
            if name.split(" ", 1)[0] == LIBRARY and target.startswith("/"):
                found.append(target)
    for directory in LIBRARY_DIRS:
        candidate = f"{directory}/{LIBRARY}"
        if candidate not in found and Path(candidate).exists():
            found.append(candidate)
    return tuple(found)


def _scrub_environment() -> None:
    """Drop what could steer the driver library's own loading (dlopen of its helpers, iconv)."""
    for name in [n for n in os.environ if n.startswith("LD_") or n in _UNSAFE_ENVIRONMENT]:
        del os.environ[name]


def load_library(candidates: tuple[str, ...]) -> str | None:
    """Load libnvidia-ml.so.1 by absolute path in this (worker) process; None, or why not.

    The file must pass files.open_file's checks (ours or root's, under directories nobody else
    writes), and is loaded through the checked descriptor itself, so it cannot be swapped.
    pynvml's own ``dlopen("libnvidia-ml.so.1")`` then finds this object by its soname and
    searches nothing: LD_LIBRARY_PATH, cached by the dynamic linker when the interpreter
    started, never gets a say. Call it in the forked worker only.
    """
    _scrub_environment()
    problems: list[str] = []
    for candidate in candidates:
        try:
            fd = files.open_file(Path(candidate))
        except OSError as err:
            problems.append(f"{candidate}: {err.strerror or err}")
            continue
        try:
            ctypes.CDLL(f"/proc/self/fd/{fd}")
            ctypes.CDLL(LIBRARY, mode=os.RTLD_NOLOAD)  # answered by soname, or the file is wrong
        except OSError as err:
            problems.append(f"{candidate}: {err}")
            continue
        finally:
            os.close(fd)
        return None
    if not candidates:
        # Short: status shows it twice (headline, finding); configuration.md lists LIBRARY_DIRS.
        return f"{LIBRARY} not in ldconfig's cache nor under /usr/lib, /lib (no NVIDIA driver?)"
    return "; ".join(problems)
