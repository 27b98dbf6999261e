"""Where the configuration lives, and a cache of it that the gate's fast path can read cheaply.

Validating the TOML with pydantic costs more than the whole fast path may spend (importing
pydantic alone takes ~50 ms), so every full load stores the validated settings as JSON together
with the file's exact text; ``gpuguard gate`` uses them instead when the file is unchanged and
falls back to a full load otherwise. Nothing here imports pydantic (or hashlib: comparing a few
hundred bytes is cheaper than loading OpenSSL).
"""

from __future__ import annotations

import contextlib
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
    key = str(path.absolute()).strip("/").replace("%", "%25").replace("/", "%2F")
    return CACHE_DIR / f"{key}.json"


def _text(raw: bytes | None) -> str | None:
    """The file's bytes as JSON-safe text (latin-1 maps every byte to one character)."""
    return None if raw is None else raw.decode("latin-1")


def store_validated(path: Path, raw: bytes | None, settings: dict[str, Any]) -> None:
    """Remember ``settings`` as the validated form of ``raw`` (None: the file is absent).

    Best effort: a host where /run/gpuguard is not writable (not root) simply has no cache.
    """
    document = {"path": str(path.absolute()), "text": _text(raw), "settings": settings}
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
    document = _trusted_document(_cache_file(path))
    expected = {"path": str(path.absolute()), "text": _text(raw)}
    if document is None or any(document.get(key) != value for key, value in expected.items()):
        return None
    settings = document.get("settings")
    return settings if isinstance(settings, dict) else None


def _trusted_document(cache: Path) -> dict[str, Any] | None:
    """The cache file's JSON object, if it is ours and nobody else can write it."""
    try:
        info = cache.stat()
        if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None
        document = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) else None
