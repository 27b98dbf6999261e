"""The one configuration file, parsed into validated, defaulted models.

Every field has a default, so a host without ``/etc/gpuguard/gpuguard.toml`` runs as documented.
A bad file is refused whole with one message naming the file, the key and the reason: guessing
at a typo in a tool that kills processes is worse than not starting. Values a root process acts
on are bounded (no infinity, no NaN, no timeout of a year), the device glob must name character
devices, and the protected list can only grow unless the file says otherwise in its own key.
"""

from __future__ import annotations

import glob
import stat
import sys
from pathlib import Path
from typing import Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (Ubuntu 22.04): the same parser, before it joined the standard library
    import tomli as tomllib

from pydantic import Field, ValidationError, ValidationInfo, field_validator

from gpuguard.adapters.configfile import (
    DEFAULT_RUNTIME_DIR,
    config_path,
    read_config,
    store_validated,
)
from gpuguard.adapters.files import UnsafePathError
from gpuguard.configmodel import ConfigModel
from gpuguard.core.exits import EX_CONFIG
from gpuguard.core.unitname import SERVICE_NAME
from gpuguard.daemonsettings import DaemonSettings, MetricsSettings
from gpuguard.unitsettings import UnitSettings

DEFAULT_PROTECTED = (
    "nvidia-persistenced",
    "nv-hostengine",
    "dcgm",
    "dcgm-exporter",
    "nvidia-smi",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "Xorg",
    "X",
    "Xwayland",
    "gnome-shell",
    "kwin_wayland",
    "kwin_x11",
    "sway",
    "weston",
    "gdm",
    "sddm",
    "lightdm",
    "gpuguard",
)

_GLOB_CHECKED = 4096  # existing matches of device_glob checked at load (/dev is small)


class ConfigError(Exception):
    """The configuration file cannot be used; the message names file, key and reason."""

    exit_code = EX_CONFIG


def _default_units() -> dict[str, UnitSettings]:
    return {"sglang.service": UnitSettings()}


class Settings(ConfigModel):
    """Everything gpuguard can be told; see docs/configuration.md for each key."""

    units: dict[str, UnitSettings] = Field(
        default_factory=_default_units,
        description="Watched units, keyed by unit name.",
    )
    idle_threshold_mib: int = Field(
        default=16,
        ge=0,
        le=4096,
        description="A GPU with no holders is idle when NVML's used memory is at most this many "
        "MiB (idle GPUs are rarely exactly 0).",
    )
    v1_reserved_mib: int | None = Field(
        default=None,
        ge=0,
        description="Drivers < 515 have only the v1 memory API, whose used memory includes what "
        "the driver reserves for itself: this many MiB per GPU are not counted as use. Unset: "
        "learned per GPU while nothing holds it.",
    )
    allow_plain_device_files: bool = Field(
        default=False,
        description="For tests only: let device_glob name plain files (fake GPUs) anywhere.",
    )
    device_glob: str = Field(
        default="/dev/nvidia*",
        min_length=1,
        max_length=4096,
        description="Character devices whose holders count as GPU users.",
    )
    replace_protected_processes: bool = Field(
        default=False,
        description="Let protected_processes replace the built-in list instead of extending it.",
    )
    protected_processes: tuple[str, ...] = Field(
        default=DEFAULT_PROTECTED,
        description="Process names (comm or argv[0] basename) gpuguard never signals, added to "
        "the built-in list.",
    )
    nvml_library: Path | None = Field(
        default=None,
        description="The driver's libnvidia-ml.so.1 by absolute path; unset: found in ldconfig's "
        "cache or the distribution's library directories (never through LD_LIBRARY_PATH).",
    )
    nvml_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description="Deadline for one NVML snapshot; a wedged driver cannot hang gpuguard.",
    )
    reap_grace_s: float = Field(
        default=10.0,
        ge=0,
        le=600,
        description="Seconds between SIGTERM and SIGKILL when reaping stale holders.",
    )
    gate_timeout_s: float = Field(
        default=300.0,
        gt=0,
        le=3600,
        description="How long `gpuguard gate` waits for the unit's GPUs to become idle before "
        "refusing the start; keep TimeoutStartSec above it.",
    )
    gate_unreachable: Literal["refuse", "allow"] = Field(
        default="refuse",
        description="What the unprivileged gate does when it cannot reach the root gate "
        'server (gpuguard-gate.socket): "refuse" the start (exit 1), or "allow" it without the '
        "gate.",
    )
    daemon: DaemonSettings = Field(
        default_factory=DaemonSettings,
        description="The watchdog daemon (`gpuguard run`).",
    )
    metrics: MetricsSettings = Field(
        default_factory=MetricsSettings,
        description="Prometheus metrics of the daemon.",
    )
    state_dir: Path = Field(
        default=Path("/var/lib/gpuguard"),
        description="Persistent state (journal cursor, history).",
    )
    runtime_dir: Path = Field(
        default=DEFAULT_RUNTIME_DIR,
        description="Volatile state (daemon snapshot, gate decisions, the config cache).",
    )

    @field_validator("device_glob")
    @classmethod
    def _device_glob(cls, value: str, info: ValidationInfo) -> str:
        if not value.startswith("/"):
            raise ValueError("must be an absolute path pattern such as /dev/nvidia*")
        if "\0" in value or "/../" in f"{value}/" or "/./" in f"{value}/":
            raise ValueError("must be a plain absolute path pattern (no NUL, '.' or '..')")
        literal = value[: next((i for i, ch in enumerate(value) if ch in "*?["), len(value))]
        if literal.endswith("/"):
            raise ValueError(
                "must start its file name with literal characters (/dev/nvidia*, not /dev/*): "
                "otherwise every open file is a GPU"
            )
        if info.data.get("allow_plain_device_files"):
            return value
        if not literal.startswith("/dev/"):
            raise ValueError(
                "must name character devices under /dev/ (allow_plain_device_files = true is "
                "for tests with fake devices only)"
            )
        for index, match in enumerate(glob.iglob(value)):  # noqa: PTH207 - an absolute glob
            if index >= _GLOB_CHECKED:
                break
            try:
                mode = Path(match).stat().st_mode
            except OSError:
                continue  # vanished or dangling: nothing to hold
            if not (stat.S_ISCHR(mode) or stat.S_ISDIR(mode)):
                raise ValueError(f"matches {match!r}, which is not a character device")
        return value

    @field_validator("protected_processes")
    @classmethod
    def _protected(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        """``protected_processes = []`` must not unprotect nvidia-persistenced: it only adds."""
        if any(not name.strip() for name in value):
            raise ValueError("a protected process name is empty")
        if info.data.get("replace_protected_processes"):
            return value
        added = dict.fromkeys(value)
        return DEFAULT_PROTECTED + tuple(name for name in added if name not in DEFAULT_PROTECTED)

    @field_validator("nvml_library")
    @classmethod
    def _absolute_library(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_absolute():
            raise ValueError("must be an absolute path such as /usr/lib/x86_64-linux-gnu/…")
        return value

    @field_validator("units")
    @classmethod
    def _units_named(cls, value: dict[str, UnitSettings]) -> dict[str, UnitSettings]:
        if not value:
            raise ValueError("at least one watched unit is needed")
        for name in value:
            if not SERVICE_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a service unit name such as sglang.service")
        return value


def warnings(settings: Settings) -> tuple[str, ...]:
    """What is valid but probably wrong: units whose configured GPU lists overlap.

    Two units on one GPU wait on each other's processes at every gate; neither is reaped by the
    other (provenance), so the start that comes second is refused. A unit without ``gpus`` may
    still have its own set from ``CUDA_VISIBLE_DEVICES``, which only systemd knows: ``status``
    judges the sets as the gate resolves them (core/status/holderfindings.py, shared GPUs).
    """
    found: list[str] = []
    units = list(settings.units.items())
    for index, (name, unit) in enumerate(units):
        for other, other_unit in units[index + 1 :]:
            if unit.gpus is None or other_unit.gpus is None:
                continue
            shared = [gpu for gpu in unit.gpus if gpu in other_unit.gpus]
            if shared:
                listed = ", ".join(str(gpu) for gpu in shared)
                found.append(f"units: {name} and {other} both list GPU {listed}")
    return tuple(found)


def load_settings(cli_path: Path | None = None) -> Settings:
    """Read the configuration; a missing default file means all defaults."""
    path, explicit = config_path(cli_path)
    try:
        raw = read_config(path)
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"{path}: no such file") from None
        settings = Settings()
        store_validated(path, None, settings.model_dump(mode="json"))
        return settings
    except UnsafePathError as err:
        raise ConfigError(f"{path}: not trusted: {err}") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror}") from None
    settings = parse_settings(raw, path)
    store_validated(path, raw, settings.model_dump(mode="json"))
    return settings


def parse_settings(raw: bytes, path: Path) -> Settings:
    """Parse and validate TOML text; every problem becomes one ConfigError message."""
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None
    try:
        return Settings.model_validate(data)
    except ValidationError as err:
        problems = [_describe(error) for error in err.errors()]
        raise ConfigError(f"{path}: " + "; ".join(problems)) from None


def _describe(error: object) -> str:
    """One ``key: reason`` phrase for a pydantic error, in the file's own key spelling."""
    assert isinstance(error, dict)  # noqa: S101 - pydantic's ErrorDetails is a TypedDict
    location = ".".join(_key_text(part) for part in error["loc"] if part not in _INTERNAL_LOCS)
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"{location}: unknown key"
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{location or '(top level)'}: {message}"


# pydantic names union branches and dict keys in error locations; a TOML author never wrote them.
_INTERNAL_LOCS = frozenset({"int", "str", "[key]"})


def _key_text(part: object) -> str:
    text = str(part)
    return f'"{text}"' if "." in text else text
