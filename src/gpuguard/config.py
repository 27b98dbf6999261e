"""The one configuration file, parsed into validated, defaulted models.

Every field has a default, so a host without ``/etc/gpuguard/gpuguard.toml`` runs as documented.
A bad file is refused whole with one message naming the file, the key and the reason: guessing
at a typo in a tool that kills processes is worse than not starting. Values a root process acts
on are bounded (no infinity, no NaN, no timeout of a year), the device glob must name character
devices, and the protected list can only grow unless the file says otherwise in its own key.
"""

from __future__ import annotations

import glob
import ipaddress
import re
import stat
import sys
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (Ubuntu 22.04): the same parser, before it joined the standard library
    import tomli as tomllib

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gpuguard.adapters.configfile import (
    DEFAULT_RUNTIME_DIR,
    config_path,
    read_config,
    store_validated,
)
from gpuguard.adapters.files import UnsafePathError
from gpuguard.core.adopt import MAX_GLOB_CHARS
from gpuguard.core.detector import LoopSettings
from gpuguard.core.exits import EX_CONFIG
from gpuguard.core.recovery import RecoveryLimits
from gpuguard.core.unitcontainers import NAME as CONTAINER_NAME
from gpuguard.core.unitname import SERVICE_NAME

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

ADOPT_GLOB = re.compile(r"[A-Za-z0-9:_.@*\\-]+\.scope")
_MIN_PATTERN_CHARS = 3  # non-space characters: " " or "py" would match nearly any command line
_MAX_PATTERN_CHARS = 256
_DAY_S = 86400.0
_GLOB_CHECKED = 4096  # existing matches of device_glob checked at load (/dev is small)


class ConfigError(Exception):
    """The configuration file cannot be used; the message names file, key and reason."""

    exit_code = EX_CONFIG


class _Strict(BaseModel):
    """Strict types (no "16" for 16) but TOML arrays become tuples and strings become paths."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _from_toml(cls, value: object, info: ValidationInfo) -> object:
        annotation = cls.model_fields[info.field_name].annotation if info.field_name else None
        if isinstance(value, list):
            return tuple(value)
        if isinstance(value, str) and annotation in (Path, Path | None):
            return Path(value)
        return value


SERVER_PATTERNS: dict[str, tuple[str, ...]] = {
    "sglang": ("sglang", "sglang::scheduler", "sglang::detokenizer"),
    # vLLM names its engine and worker processes by setproctitle: VLLM::EngineCore (one per
    # data-parallel rank), VLLM::Worker_TP0… (one per tensor-parallel rank).
    "vllm": ("vllm", "VLLM::EngineCore", "VLLM::Worker"),
}
"""Default ``patterns`` of a unit by its ``server``: the names its orphaned workers carry."""


class UnitSettings(_Strict):
    """How gpuguard treats one watched unit."""

    server: Literal["sglang", "vllm"] = Field(
        default="sglang",
        description="Which server the unit runs; picks the default patterns.",
    )

    gpus: tuple[int | str, ...] | None = Field(
        default=None,
        description="GPUs the unit owns (NVML indices or UUIDs); unset: CUDA_VISIBLE_DEVICES of "
        "the unit, else all GPUs.",
    )
    patterns: tuple[str, ...] = Field(
        default=SERVER_PATTERNS["sglang"],
        description="Command-line substrings that look like this unit's processes; a match alone "
        "never makes a process the unit's (scope patterns reaches them explicitly); default: "
        "those of `server`.",
    )

    container: str | None = Field(
        default=None,
        description="Name of the docker/podman container the unit runs its server in; unset: "
        "the --name of a `docker run`/`podman run` ExecStart=.",
    )

    on_engine_dead: Literal["report", "recover"] = Field(
        default="report",
        description="What the daemon does when the unit's engine is dead while the unit lives "
        "(a fatal line in its output, or an exit 0 no stop job asked for): report it in status, "
        "the journal and the metrics, or also recover the unit the usual way (stop, reap, wait "
        "for idle GPUs, start; with its backoff, dry_run and needs-operator).",
    )
    on_start_stuck: Literal["report", "recover"] = Field(
        default="report",
        description="What the daemon does when a start of the unit is stuck: in one phase past "
        "the budget its learned starts taught (at least 3), with no phase line since: report it "
        "(status WARNING, the journal, the metrics), or also recover the unit as for a dead "
        "engine (the same backoff, dry_run and needs-operator), only while that run is still "
        "the unit's.",
    )

    adopt: tuple[str, ...] = Field(
        default=(),
        description="Other cgroups (scopes, by a glob where only * is special, e.g. "
        '"tp-worker-*.scope") the unit\'s processes legitimately move to: a GPU holder there '
        "that runs as the unit's user is the unit's left-over while nothing of the unit is live.",
    )

    @field_validator("adopt")
    @classmethod
    def _adopt_scopes(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for item in value:
            if not ADOPT_GLOB.fullmatch(item) or len(item) > MAX_GLOB_CHARS:
                raise ValueError(
                    f"{item!r} is not a scope glob: [A-Za-z0-9:_.@\\-*] ending in .scope, "
                    f"at most {MAX_GLOB_CHARS} characters"
                )
            if item.replace("*", "") == ".scope":
                raise ValueError(f"{item!r} would adopt every scope (user sessions too)")
        return value

    @field_validator("container")
    @classmethod
    def _container_name(cls, value: str | None) -> str | None:
        if value is not None and not CONTAINER_NAME.fullmatch(value):
            raise ValueError(f"{value!r} is not a container name ([a-zA-Z0-9][a-zA-Z0-9_.-]*)")
        return value

    @field_validator("patterns")
    @classmethod
    def _patterns_specific(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in value:
            if len("".join(pattern.split())) < _MIN_PATTERN_CHARS:
                raise ValueError(
                    f"{pattern!r} is too short: a pattern needs at least {_MIN_PATTERN_CHARS} "
                    "non-space characters"
                )
            if len(pattern) > _MAX_PATTERN_CHARS:
                raise ValueError(f"a pattern is longer than {_MAX_PATTERN_CHARS} characters")
        return value

    @model_validator(mode="before")
    @classmethod
    def _patterns_of_server(cls, data: Any) -> Any:  # noqa: ANN401 - pydantic's raw input
        """Without ``patterns``, a unit takes its server's: setting ``server`` is enough."""
        if isinstance(data, dict) and "patterns" not in data:
            server = data.get("server", "sglang")
            if isinstance(server, str) and server in SERVER_PATTERNS:
                return {**data, "patterns": SERVER_PATTERNS[server]}
        return data

    @field_validator("gpus")
    @classmethod
    def _gpus_named(cls, value: tuple[int | str, ...] | None) -> tuple[int | str, ...] | None:
        if value is None:
            return None
        for gpu in value:
            if isinstance(gpu, int) and gpu < 0:
                raise ValueError(f"GPU index {gpu} is negative")
            if isinstance(gpu, str) and not gpu.startswith(("GPU-", "MIG-")):
                raise ValueError(f"{gpu!r} is neither an index nor a UUID (GPU-…)")
        if len(set(value)) != len(value):
            raise ValueError("lists a GPU twice")
        return value


class DaemonSettings(_Strict):
    """How `gpuguard run` detects restart loops and recovers from them."""

    dry_run: bool = Field(
        default=False,
        description="Log what a recovery would do instead of doing it.",
    )
    loop_min_starts: int = Field(
        default=3,
        ge=2,
        le=1000,
        description="Starts (distinct runs) inside loop_window_s that, ending in failure, make a "
        "restart loop.",
    )
    loop_window_s: float = Field(
        default=600.0, gt=0, le=_DAY_S, description="The detection window."
    )
    restart_counter_threshold: int = Field(
        default=5,
        ge=1,
        le=100000,
        description="A 'Scheduled restart job' with at least this N_RESTARTS, after at least two "
        "failed runs, is a loop.",
    )
    recovery_max_attempts: int = Field(
        default=3,
        ge=1,
        le=100,
        description="Recoveries that did not help before the unit is marked 'needs operator'.",
    )
    recovery_backoff_s: float = Field(
        default=120.0,
        ge=0,
        le=_DAY_S,
        description="Minimum time between two recoveries of one unit; doubles after each one "
        "that did not help.",
    )
    stable_s: float = Field(
        default=300.0,
        gt=0,
        le=_DAY_S,
        description="A recovered unit that runs this long without failing counts as healed.",
    )
    reap_stopped_survivors: bool = Field(
        default=False,
        description="Also reap the GPU-holding survivors of a run that a stop job ended (an "
        "operator's systemctl stop); off: they are only reported.",
    )
    ledger_every_s: float = Field(
        default=30.0,
        ge=1.0,
        le=_DAY_S,
        description="How often the provenance ledger re-reads each running watched unit's "
        "processes (also at each start and stop); a process forked and moved out between two "
        "records is not in it.",
    )
    watch_output: bool = Field(
        default=True,
        description="Also read the unit's own output for CUDA out-of-memory lines at start "
        "(filtered by journalctl before gpuguard parses anything).",
    )

    watch_engine_lines: bool = Field(
        default=True,
        description="Also read the unit's own output for its server's fatal lines (engine dead "
        "while the unit lives) and start-phase lines (filtered by journalctl; docs/liveness.md).",
    )
    clean_exit_is_death: bool = Field(
        default=True,
        description="Count a main-process exit with status 0 that no stop job asked for as a "
        "dead engine (Restart=on-failure never restarts it).",
    )

    def loop(self) -> LoopSettings:
        """What the detector calls a restart loop (the daemon's and explain's, alike)."""
        return LoopSettings(
            min_starts=self.loop_min_starts,
            window_s=self.loop_window_s,
            restart_counter_threshold=self.restart_counter_threshold,
            stable_s=self.stable_s,
        )

    def recovery_limits(self) -> RecoveryLimits:
        """How often and how soon a recovery is tried (the daemon's and explain's, alike)."""
        return RecoveryLimits(
            max_attempts=self.recovery_max_attempts,
            backoff_s=self.recovery_backoff_s,
            stable_s=self.stable_s,
        )


class MetricsSettings(_Strict):
    """Prometheus metrics of the daemon (docs/metrics.md)."""

    textfile: str = Field(
        default="/var/lib/prometheus/node-exporter/gpuguard.prom",
        max_length=4096,
        description="The file the daemon writes for node_exporter's textfile collector (an "
        'absolute path ending in .prom, in an existing directory); "" writes none.',
    )
    listen: str = Field(
        default="",
        max_length=64,
        description='Serve the metrics over HTTP on this "IP:PORT" (e.g. "127.0.0.1:9835"); '
        '"" (the default) serves none. gpuguard.service needs a drop-in to open the network.',
    )

    @field_validator("textfile")
    @classmethod
    def _textfile(cls, value: str) -> str:
        if not value:
            return value
        parts = Path(value).parts
        if not value.startswith("/") or not value.endswith(".prom") or len(parts) < 3:
            raise ValueError("must be an absolute path in a directory, ending in .prom")
        if "\0" in value or ".." in parts or "." in value.split("/"):
            raise ValueError("must be a plain absolute path (no NUL, '.' or '..')")
        return value

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        if value:
            listen_address(value)
        return value


def listen_address(value: str) -> tuple[str, int]:
    """``"IP:PORT"`` (IPv6 in brackets) as (IP, port); ValueError names what is wrong."""
    host, colon, port = value.rpartition(":")
    host = host.removeprefix("[").removesuffix("]") if host.startswith("[") else host
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{value!r} is not IP:PORT with an IP address such as 127.0.0.1") from None
    if not colon or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{value!r} has no port between 1 and 65535")
    return host, int(port)


def _default_units() -> dict[str, UnitSettings]:
    return {"sglang.service": UnitSettings()}


class Settings(_Strict):
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
