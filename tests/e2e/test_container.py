"""Smoke tests of the container harness: a real systemd boots, runs a unit, logs it, goes away."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from e2e.container import (
    PACKAGES,
    RELEASES,
    Bind,
    Container,
    ContainerCommandError,
    nspawn_processes,
    recipe,
    recipe_hash,
    rootfs_path,
)

if TYPE_CHECKING:
    from e2e.conftest import ContainerFactory

UNIT_STARTED = "39f53479d3a045ac8e11786248231fbf"

SMOKE_UNIT = """\
[Unit]
Description=gpuguard e2e smoke unit

[Service]
ExecStart=/bin/sh -c 'echo smoke-unit-says-hello; exec sleep 600'
"""


def test_a_tree_variant_has_its_own_recipe_and_cache_entry() -> None:
    """The docker variant adds its package to the plain recipe, under a name the release starts."""
    plain, docker = recipe("bookworm"), recipe("bookworm", "docker")
    assert "tree" not in plain  # the plain recipe, and so its hash and cached tree, as before
    assert docker["packages"] == [*PACKAGES, "docker.io"]
    assert str(docker["setup"]).startswith(str(plain["setup"]))
    assert recipe_hash("bookworm", "docker") != recipe_hash("bookworm")
    entry = rootfs_path("bookworm", Path("/cache"), "docker")
    assert entry.name == f"bookworm-docker-{recipe_hash('bookworm', 'docker')}"
    with pytest.raises(ValueError, match="unknown tree variant"):
        recipe("bookworm", "nonesuch")


def test_boots_to_running_with_the_release_systemd(booted: Container, release: str) -> None:
    """The container's systemd reaches running (or degraded) and is the release's version."""
    state = booted.run(["systemctl", "is-system-running"], check=False).stdout.strip()
    assert state in {"running", "degraded"}
    assert booted.systemd_version() == RELEASES[release]
    assert booted.run(["cat", "/proc/1/comm"]).stdout.strip() == "systemd"


def test_started_unit_is_logged_by_pid1_with_message_id_and_unit(booted: Container) -> None:
    """A written unit starts, and PID 1 logs "Started" with MESSAGE_ID, UNIT and INVOCATION_ID."""
    booted.write_file("/etc/systemd/system/e2e-smoke.service", SMOKE_UNIT)
    booted.systemctl("daemon-reload")
    booted.systemctl("start", "e2e-smoke.service")
    assert booted.systemctl("is-active", "e2e-smoke.service").stdout.strip() == "active"

    started = booted.wait_journal(
        ["_PID=1", "UNIT=e2e-smoke.service", f"MESSAGE_ID={UNIT_STARTED}"],
        lambda entries: len(entries) == 1,
    )[0]
    assert started["_UID"] == "0"
    assert started["_TRANSPORT"] == "journal"
    assert isinstance(started["INVOCATION_ID"], str)
    assert re.fullmatch(r"[0-9a-f]{32}", started["INVOCATION_ID"])
    assert isinstance(started["__CURSOR"], str)

    own = booted.wait_journal(["_SYSTEMD_UNIT=e2e-smoke.service"], lambda entries: len(entries) > 0)
    assert own[0]["MESSAGE"] == "smoke-unit-says-hello"
    assert own[0]["_SYSTEMD_INVOCATION_ID"] == started["INVOCATION_ID"]


def test_binds_files_and_unprivileged_commands(container: ContainerFactory) -> None:
    """Read-only binds, file round-trips, run_as and failing commands behave as documented."""
    here = Path(__file__).resolve().parent
    booted = container(binds=[Bind(here, "/src")])
    assert "def test_binds_files" in booted.read_file(f"/src/{Path(__file__).name}")
    denied = booted.run(["touch", "/src/new-file"], check=False)
    assert denied.returncode != 0
    assert "Read-only file system" in denied.stderr
    booted.write_file("/etc/gpuguard/e2e.txt", "hello\n", mode=0o600)
    assert booted.read_file("/etc/gpuguard/e2e.txt") == "hello\n"
    assert booted.run(["stat", "-c", "%a", "/etc/gpuguard/e2e.txt"]).stdout.strip() == "600"

    booted.run(["useradd", "--create-home", "e2e-user"])
    assert booted.run_as("e2e-user", ["id", "-u"]).stdout.strip() != "0"
    assert booted.run_as("e2e-user", ["sh", "-c", "echo $HOME"]).stdout.strip() == "/home/e2e-user"

    with pytest.raises(ContainerCommandError, match="No such file"):
        booted.run(["cat", "/nonexistent"])


def test_teardown_leaves_nothing_even_when_the_body_raises(rootfs: Path) -> None:
    """An exception in the body still stops nspawn and the container, and removes the temp dir."""
    box = Container(rootfs)
    seen: list[tuple[int, int, Path | None]] = []

    def failing_body() -> None:
        with box:
            seen.append((box.nspawn_pid, box.init_pid, box.workdir))
            assert box.nspawn_pid in nspawn_processes()
            raise RuntimeError("test body failed")

    with pytest.raises(RuntimeError, match="test body failed"):
        failing_body()

    [(nspawn_pid, init_pid, workdir)] = seen
    assert nspawn_pid not in nspawn_processes()
    assert not os.path.exists(f"/proc/{init_pid}")  # noqa: PTH110 - a /proc probe
    assert workdir is not None
    assert not workdir.exists()
    assert box.teardown_seconds is not None
    assert box.boot_seconds is not None
    box.stop()  # idempotent
