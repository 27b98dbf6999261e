"""Where the configuration lives, and a cache of it that the gate's fast path can read cheaply.

Validating the TOML with pydantic costs more than the whole fast path may spend (importing
pydantic alone takes ~50 ms), so every full load stores the validated settings as JSON together
with the file's exact text; ``gpuguard gate`` uses them instead when the file is unchanged and
falls back to a full load otherwise. Nothing here imports pydantic (or hashlib: comparing a few
hundred bytes is cheaper than loading OpenSSL). The cache is stamped with gpuguard's version
and a format number, and checked key by key: a cache another gpuguard wrote is a miss.

The cache lives in ``runtime_dir/config-cache``, so a configuration that moves its runtime
directory (every test does) keeps its cache there too. The directory must be known before the
settings are, so it is read from the file's text: a file that does not mention ``runtime_dir``
uses the default, one that sets it on a plain top-level line (``runtime_dir = "/path"``) is read
by a line match, and only anything else is parsed with tomllib (importing it costs the gate's
fast path about 8 ms). Reading and writing find the cache the same way, and the
cached text must equal the file's, so a line match that TOML would read differently can only
move the cache, never make it wrong.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from gpuguard import __version__
from gpuguard.adapters import files

DEFAULT_CONFIG_PATH = Path("/etc/gpuguard/gpuguard.toml")
CONFIG_ENV = "GPUGUARD_CONFIG"
# The default of the runtime_dir setting (config.Settings uses it too).
DEFAULT_RUNTIME_DIR = Path("/run/gpuguard")
CACHE_SUBDIR = "config-cache"
# `runtime_dir = "/abs/path"` alone on a line (a comment may follow), before any [table].
_RUNTIME_DIR_LINE = re.compile(rb'[ \t]*runtime_dir[ \t]*=[ \t]*"(/[^"\\\n]*)"[ \t]*(?:#[^\n]*)?')
# Bumped whenever the cached settings change shape; with the version, any other stamp is a miss.
CACHE_FORMAT = 2
CONFIG_MAX = 1024 * 1024  # a configuration file is a few KiB; more is not one


def config_path(cli_path: Path | None) -> tuple[Path, bool]:
    """Which file to read and whether it was named explicitly (an explicit file must exist)."""
    if cli_path is not None:
        return cli_path, True
    env = os.environ.get(CONFIG_ENV)
    if env:
        return Path(env), True
    return DEFAULT_CONFIG_PATH, False


def read_config(path: Path) -> bytes:
    """The configuration file's bytes; as root, only from a file only root can change.

    sshd's StrictModes: root's configuration decides which processes get killed, so it must be
    owned by root and not writable by group or others, nor may any directory above it be (a
    root-owned sticky directory such as /tmp excepted, see docs/security.md). Raises
    files.UnsafePathError naming the file and the reason, FileNotFoundError, or OSError.
    """
    if os.geteuid() != 0:
        return path.read_bytes()
    return files.read_file(path, max_bytes=CONFIG_MAX)


def cache_file(path: Path, raw: bytes | None) -> Path | None:
    """Where the cache of the configuration file ``path`` with bytes ``raw`` lives.

    None when the text names a runtime_dir that cannot be read from it (not TOML, not a
    string): then there is no cache, and the full load says what is wrong.
    """
    runtime_dir = _runtime_dir(raw)
    if runtime_dir is None:
        return None
    key = str(path.absolute()).strip("/").replace("%", "%25").replace("/", "%2F")
    return runtime_dir / CACHE_SUBDIR / f"{key}.json"


def _runtime_dir(raw: bytes | None) -> Path | None:
    """The runtime_dir a configuration's text sets, the default when it does not mention it."""
    if raw is None or b"runtime_dir" not in raw:
        return DEFAULT_RUNTIME_DIR
    if raw.count(b"runtime_dir") == 1 and b'"""' not in raw and b"'''" not in raw:
        for line in raw.splitlines():
            if line.lstrip().startswith(b"["):
                break  # a table: its keys are not top-level
            match = _RUNTIME_DIR_LINE.fullmatch(line)
            if match:
                try:
                    return Path(match.group(1).decode())
                except UnicodeDecodeError:
                    return None
    # Only for a file the line match cannot read; Python 3.10 (Ubuntu 22.04) has it as tomli.
    if sys.version_info >= (3, 11):
        import tomllib  # noqa: PLC0415
    else:
        import tomli as tomllib  # noqa: PLC0415

    try:
        value = tomllib.loads(raw.decode()).get("runtime_dir", str(DEFAULT_RUNTIME_DIR))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
        return None
    return Path(value) if isinstance(value, str) and value.startswith("/") else None


def _text(raw: bytes | None) -> str | None:
    """The file's bytes as JSON-safe text (latin-1 maps every byte to one character)."""
    return None if raw is None else raw.decode("latin-1")


def _stamp() -> dict[str, object]:
    return {"format": CACHE_FORMAT, "version": __version__}


def store_validated(path: Path, raw: bytes | None, settings: dict[str, Any]) -> None:
    """Remember ``settings`` as the validated form of ``raw`` (None: the file is absent).

    Best effort: a host where /run/gpuguard is not writable (not root) simply has no cache.
    """
    cache = cache_file(path, raw)
    if cache is None:
        return
    document = {
        **_stamp(),
        "path": str(path.absolute()),
        "text": _text(raw),
        "settings": settings,
    }
    with contextlib.suppress(OSError):
        files.write_file(cache, json.dumps(document).encode(), mode=0o600)


def load_validated(cli_path: Path | None) -> dict[str, Any] | None:
    """The cached validated settings if the configuration file is byte-for-byte unchanged.

    Anything unexpected (another gpuguard's stamp, a missing key, a wrong type, a file that is
    not safely ours) is a miss, never an error: the caller then does the full load.
    """
    path, explicit = config_path(cli_path)
    try:
        raw: bytes | None = read_config(path)
    except FileNotFoundError:
        if explicit:
            return None  # let the full load say "no such file"
        raw = None
    except OSError:
        return None  # the full load says why
    cache = cache_file(path, raw)
    if cache is None:
        return None
    try:
        document = json.loads(files.read_file(cache, max_bytes=CONFIG_MAX * 4))
    except (OSError, ValueError, RecursionError):
        return None
    expected = {**_stamp(), "path": str(path.absolute()), "text": _text(raw)}
    if not isinstance(document, dict) or any(document.get(k) != v for k, v in expected.items()):
        return None
    settings = document.get("settings")
    return settings if _fast_path_usable(settings) else None


def _fast_path_usable(settings: object) -> bool:
    """Whether ``settings`` has every key the gate's fast path reads, each of the right type."""
    if not isinstance(settings, dict):
        return False
    units = settings.get("units")
    library = settings.get("nvml_library")
    timeout = settings.get("nvml_timeout_s")
    threshold = settings.get("idle_threshold_mib")
    return (
        isinstance(units, dict)
        and all(_unit_usable(unit) for unit in units.values())
        and isinstance(timeout, int | float)
        and not isinstance(timeout, bool)
        and timeout > 0
        and isinstance(threshold, int)
        and not isinstance(threshold, bool)
        and isinstance(settings.get("runtime_dir"), str)
        and (library is None or isinstance(library, str))
    )


def _unit_usable(unit: object) -> bool:
    if not isinstance(unit, dict):
        return False
    gpus = unit.get("gpus", False)
    return gpus is None or (isinstance(gpus, list) and all(_gpu_usable(gpu) for gpu in gpus))


def _gpu_usable(gpu: object) -> bool:
    return isinstance(gpu, str) or (isinstance(gpu, int) and not isinstance(gpu, bool))
