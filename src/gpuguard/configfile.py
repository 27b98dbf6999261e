"""Where the configuration lives, and a cache of it that the gate's fast path can read cheaply.

Validating the TOML with pydantic costs more than the whole fast path may spend (importing
pydantic alone takes ~50 ms), so every full load stores the validated settings as JSON, keyed
by the file's exact bytes; ``gpuguard gate`` reads that instead when the file is unchanged and
falls back to a full load otherwise. Nothing here imports pydantic.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

DEFAULT_CONFIG_PATH = Path("/etc/gpuguard/gpuguard.toml")
CONFIG_ENV = "GPUGUARD_CONFIG"
EX_CONFIG = 78
# Fixed, not configurable: the cache must be found before the configuration is read.
CACHE_DIR = Path("/run/gpuguard/config-cache")


def config_path(cli_path: Path | None) -> tuple[Path, bool]:
    """Which file to read and whether it was named explicitly (an explicit file must exist)."""
    if cli_path is not None:
        return cli_path, True
    env = os.environ.get(CONFIG_ENV)
    if env:
        return Path(env), True
    return DEFAULT_CONFIG_PATH, False


def _cache_file(path: Path) -> Path:
    key = hashlib.sha256(os.fsencode(path.absolute())).hexdigest()[:32]
    return CACHE_DIR / f"{key}.json"


def _digest(raw: bytes | None) -> str | None:
    return None if raw is None else hashlib.sha256(raw).hexdigest()


def store_validated(path: Path, raw: bytes | None, settings: dict[str, Any]) -> None:
    """Remember ``settings`` as the validated form of ``raw`` (None: the file is absent).

    Best effort: a host where /run/gpuguard is not writable (not root) simply has no cache.
    """
    document = {"path": str(path.absolute()), "sha256": _digest(raw), "settings": settings}
    target = _cache_file(path)
    with contextlib.suppress(OSError):
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        temp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        temp.write_text(json.dumps(document), encoding="utf-8")
        temp.replace(target)


def load_validated(cli_path: Path | None) -> dict[str, Any] | None:
    """The cached validated settings if the configuration file is byte-for-byte unchanged.

    Only a cache file owned by us and not writable by others is trusted: it decides which GPUs
    the gate looks at.
    """
    path, explicit = config_path(cli_path)
    try:
        raw: bytes | None = path.read_bytes()
    except FileNotFoundError:
        if explicit:
            return None  # let the full load say "no such file"
        raw = None
    except OSError:
        return None
    cache = _cache_file(path)
    try:
        info = cache.stat()
        if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None
        document = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict) or document.get("sha256") != _digest(raw):
        return None
    settings = document.get("settings")
    return settings if isinstance(settings, dict) else None
