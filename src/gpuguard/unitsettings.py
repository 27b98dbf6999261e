"""One watched unit's section of the configuration file (``[units."NAME"]``).

Which server the unit runs, its GPUs, the names and cgroups its processes may carry, and what the
daemon does when its engine dies or its start is stuck. The patterns and scope globs are bounded
here: one too loose would make strangers look like the unit's processes.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from gpuguard.configmodel import ConfigModel
from gpuguard.core.adopt import MAX_GLOB_CHARS, glob_problem
from gpuguard.core.healthcheck import HealthTarget, parse_health_url
from gpuguard.core.unitcontainers import NAME as CONTAINER_NAME

ADOPT_GLOB = re.compile(r"[A-Za-z0-9:_.@*\\-]+\.scope")
_MIN_PATTERN_CHARS = 3  # non-space characters: " " or "py" would match nearly any command line
_MAX_PATTERN_CHARS = 256
HEALTH_TIMEOUT_MAX_S = 5.0
"""A probe runs in the daemon's loop: 5 s is a third of gpuguard.service's watchdog ping
interval (WatchdogSec=30, a ping every 15 s); the loop pings between two probes."""


SERVER_PATTERNS: dict[str, tuple[str, ...]] = {
    "sglang": ("sglang", "sglang::scheduler", "sglang::detokenizer"),
    # vLLM names its engine and worker processes by setproctitle: VLLM::EngineCore (one per
    # data-parallel rank; the kernel shows "VLLM::EngineCor", core.policy.name_shows),
    # VLLM::Worker_TP0… (one per tensor-parallel rank).
    "vllm": ("vllm", "VLLM::EngineCore", "VLLM::Worker"),
}
"""Default ``patterns`` of a unit by its ``server``: the names its orphaned workers carry."""


class UnitSettings(ConfigModel):
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

    health_url: str | None = Field(
        default=None,
        description="An HTTP health check of the server, once its start is ready: "
        "http://127.0.0.1:PORT/PATH, http://[::1]:PORT/PATH or http://localhost:PORT/PATH "
        "(TCP loopback only: a unix socket is refused, docs/liveness.md says why); a 2xx answer "
        "is healthy. It needs the health-loopback.conf drop-in for gpuguard.service. Unset: no "
        "check.",
    )
    health_every_s: float = Field(
        default=10.0, ge=1.0, le=3600.0, description="Seconds between health probes."
    )
    health_timeout_s: float = Field(
        default=2.0,
        gt=0,
        le=HEALTH_TIMEOUT_MAX_S,
        description="The most one probe may take (connect, send, the status line), below "
        "health_every_s; a probe that takes longer failed.",
    )
    health_failures: int = Field(
        default=3,
        ge=1,
        le=100,
        description="Refused connections or HTTP 5xx in a row that make the engine dead (a "
        "success resets the count; slow answers make it dead only after 300 s without a 2xx).",
    )

    adopt: tuple[str, ...] = Field(
        default=(),
        description="Other cgroups (scopes, by a glob where only * is special, e.g. "
        '"tp-worker-*.scope") the unit\'s processes legitimately move to: a GPU holder there '
        "that runs as the unit's user is the unit's left-over while nothing of the unit is live. "
        "A glob that can match session-*.scope or run-*.scope is refused.",
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
            if (problem := glob_problem(item)) is not None:
                raise ValueError(problem)
        return value

    @field_validator("health_url")
    @classmethod
    def _health_url(cls, value: str | None) -> str | None:
        if value is not None:
            parse_health_url(value)  # its ValueError says what is wrong
        return value

    @model_validator(mode="after")
    def _health_timeout_below_interval(self) -> UnitSettings:
        if self.health_timeout_s >= self.health_every_s:
            raise ValueError(
                f"health_timeout_s ({self.health_timeout_s}) must be below health_every_s "
                f"({self.health_every_s})"
            )
        return self

    @property
    def health(self) -> HealthTarget | None:
        """Where the unit's health check asks; None: it has none."""
        return None if self.health_url is None else parse_health_url(self.health_url)

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
