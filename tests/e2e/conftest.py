"""Fixtures for tests that boot a real systemd in a container (see container.py).

`release` is parametrized from `$GPUGUARD_E2E_RELEASES` (default: bookworm; e.g.
`GPUGUARD_E2E_RELEASES=bookworm,trixie`), `rootfs` is the cached tree of that release (built on
first use, about a minute), `container(...)` boots one and tears it down after the test;
`booted` is one booted container. `GPUGUARD_E2E_MODE=copy` boots copies instead of overlays,
`GPUGUARD_E2E_CACHE` moves the cache (default /var/cache/gpuguard-e2e).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import pytest

# The harness is `e2e.container` (tests/ is the base of the test helpers; tests/conftest.py puts
# it on sys.path too, this keeps `pytest tests/e2e` working on its own).
if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.container import RELEASES, Bind, Container, ensure_rootfs

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

RELEASES_ENV = "GPUGUARD_E2E_RELEASES"
MODE_ENV = "GPUGUARD_E2E_MODE"  # "overlay" (default) or "copy", for a kernel without overlayfs
REQUIRED_TOOLS = ("debootstrap", "systemd-nspawn", "nsenter", "chroot")


def selected_releases() -> list[str]:
    """The releases to boot: `$GPUGUARD_E2E_RELEASES` (comma-separated) or bookworm."""
    names = [r.strip() for r in os.environ.get(RELEASES_ENV, "bookworm").split(",") if r.strip()]
    unknown = [r for r in names if r not in RELEASES]
    if unknown:
        raise pytest.UsageError(f"{RELEASES_ENV}: unknown release(s) {unknown}; known: {RELEASES}")
    return names


def missing_requirement() -> str | None:
    """Why e2e tests cannot run on this machine, or None when they can."""
    if os.geteuid() != 0:
        return "e2e tests boot systemd-nspawn containers and need root"
    missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing:
        return (
            f"e2e tests need {', '.join(missing)} "
            "(apt-get install debootstrap systemd-container util-linux coreutils)"
        )
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test under tests/e2e as `e2e`; skip them, with the reason, if we cannot boot."""
    reason = missing_requirement()
    here = os.path.dirname(__file__)  # noqa: PTH120 - compared with item paths as strings
    for item in items:
        if str(item.path).startswith(here + os.sep):
            item.add_marker(pytest.mark.e2e)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run each test that asks for `release` once per selected release.

    Session-scoped, so the rootfs fixture is prepared once per release.
    """
    if "release" in metafunc.fixturenames:
        metafunc.parametrize("release", selected_releases(), scope="session")


@pytest.fixture(scope="session")
def rootfs(release: str) -> Path:
    """The cached root file system of `release` (debootstrapped on first use)."""
    return ensure_rootfs(release)


class ContainerFactory(Protocol):
    """Boots a container from the test's release; the fixture tears it down afterwards."""

    def __call__(
        self,
        *,
        binds: Sequence[Bind] = (),
        boot_timeout: float = 90.0,
        nspawn_args: Sequence[str] = (),
    ) -> Container:
        """Boot one (waits until running/degraded)."""
        ...


@pytest.fixture
def container(rootfs: Path) -> Iterator[ContainerFactory]:
    """A factory: `container(binds=[Bind(Path.cwd(), "/src")])` gives a booted Container."""
    with contextlib.ExitStack() as stack:

        def make(
            *,
            binds: Sequence[Bind] = (),
            boot_timeout: float = 90.0,
            nspawn_args: Sequence[str] = (),
        ) -> Container:
            booted = Container(
                rootfs,
                binds=binds,
                mode="copy" if os.environ.get(MODE_ENV) == "copy" else "overlay",
                boot_timeout=boot_timeout,
                nspawn_args=nspawn_args,
            )
            return stack.enter_context(booted)

        yield make


@pytest.fixture
def booted(container: ContainerFactory) -> Container:
    """One booted container with no binds."""
    return container()
