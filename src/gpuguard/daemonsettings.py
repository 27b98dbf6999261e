"""The daemon's sections of the configuration file: ``[daemon]`` and ``[metrics]``.

How `gpuguard run` tells a restart loop, when and how often it recovers, what it reads of a
unit's output, and where it publishes its Prometheus metrics. Only the daemon (and `explain`,
which replays its decisions) reads them.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import Field, field_validator

from gpuguard.configmodel import DAY_S, ConfigModel
from gpuguard.core.breaker import BreakerLimits
from gpuguard.core.detector import LoopSettings
from gpuguard.core.recovery import RecoveryLimits


class DaemonSettings(ConfigModel):
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
    loop_window_s: float = Field(default=600.0, gt=0, le=DAY_S, description="The detection window.")
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
        le=DAY_S,
        description="Minimum time between two recoveries of one unit; doubles after each one "
        "that did not help.",
    )
    stable_s: float = Field(
        default=300.0,
        gt=0,
        le=DAY_S,
        description="A recovered unit that runs this long without failing counts as healed.",
    )
    breaker_max_recoveries: int = Field(
        default=6,
        ge=1,
        le=1000,
        description="The host-wide breaker: at most this many recoveries and sweeps that reap, "
        "across all units, in breaker_window_s; the next one opens the breaker and the daemon "
        "only reports until `gpuguard breaker --close` (docs/daemon.md).",
    )
    breaker_window_s: float = Field(
        default=1800.0,
        gt=0,
        le=DAY_S,
        description="The breaker's sliding window.",
    )
    reap_stopped_survivors: bool = Field(
        default=False,
        description="Also reap the GPU-holding survivors of a run that a stop job ended (an "
        "operator's systemctl stop); off: they are only reported.",
    )
    ledger_every_s: float = Field(
        default=30.0,
        ge=1.0,
        le=DAY_S,
        description="How often the provenance ledger re-reads each running watched unit's "
        "processes (also at each start and stop), skipped while no process or thread was "
        "created since its last full read; a process forked and moved out between two "
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

    def breaker_limits(self) -> BreakerLimits:
        """The host-wide breaker's limit (the daemon's, status's and the metrics', alike)."""
        return BreakerLimits(self.breaker_max_recoveries, self.breaker_window_s)

    def recovery_limits(self) -> RecoveryLimits:
        """How often and how soon a recovery is tried (the daemon's and explain's, alike)."""
        return RecoveryLimits(
            max_attempts=self.recovery_max_attempts,
            backoff_s=self.recovery_backoff_s,
            stable_s=self.stable_s,
        )


DEFAULT_TEXTFILE = "/var/lib/prometheus/node-exporter/gpuguard.prom"
"""Where Debian's prometheus-node-exporter reads textfiles: the directory exists only with it."""


class MetricsSettings(ConfigModel):
    """Prometheus metrics of the daemon (docs/metrics.md)."""

    textfile: str = Field(
        default=DEFAULT_TEXTFILE,
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
