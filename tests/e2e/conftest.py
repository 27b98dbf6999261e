"""Fixtures for tests that boot a real systemd in a container (see container.py).

`release` is parametrized from `$GPUGUARD_E2E_RELEASES` (default: bookworm; e.g.
`GPUGUARD_E2E_RELEASES=bookworm,trixie`), `rootfs` is the cached tree of that release (built on
first use, about a minute; `docker_rootfs` is its variant with Debian's docker engine, for
test_docker_unit.py), `container(...)` boots one and tears it down after the test;
`booted` is one booted container. `GPUGUARD_E2E_MODE=copy` boots copies instead of overlays,
`GPUGUARD_E2E_CACHE` moves the cache (default /var/cache/gpuguard-e2e).

gpuguard inside (gpubox.py, docs/e2e.md): `e2e_artifacts` are the wheels and the fake NVML,
prepared once per release and cached; `gpubox` is a booted container with gpuguard, the fake
NVML, the fake GPU driver and the fake SGLang installed. Scenario results (measure.py) are
printed, timeline and table, at the end of the run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import pytest

# The harness is `e2e.container` (tests/ is the base of the test helpers; tests/conftest.py puts
# it on sys.path too, this keeps `pytest tests/e2e` working on its own).
if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.container import RELEASES, Bind, Container, ensure_rootfs
from e2e.gpubox import INSTALL_SECONDS, Artifacts, GpuBox, host_env_ok, install, prepare_artifacts
from e2e.measure import SESSION_NOTES, SESSION_RESULTS, render_report
from e2e.real_engine import REQUIRE_ENV, Engine, EngineError, engine_required, ensure_engine
from e2e.real_engine import TREE as ENGINE_TREE
from e2e.real_engine import install_engine as install_real_engine

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from _pytest.reports import TestReport
    from _pytest.terminal import TerminalReporter

RELEASES_ENV = "GPUGUARD_E2E_RELEASES"
MODE_ENV = "GPUGUARD_E2E_MODE"  # "overlay" (default) or "copy", for a kernel without overlayfs
REQUIRED_TOOLS = ("debootstrap", "systemd-nspawn", "nsenter", "chroot")
SUMMARY_ENV = "GPUGUARD_E2E_SUMMARY"  # "0": no scenario summary at the end (make demo prints it)
_STARTED = time.monotonic()


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


def _progress(config: pytest.Config, line: str) -> None:
    """One progress line on the terminal, even from inside a fixture (capture off for it).

    The e2e phase takes minutes (a cold debootstrap several): CI shows where it is.
    """
    capture = config.pluginmanager.getplugin("capturemanager")
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if capture is None or reporter is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(f"e2e +{time.monotonic() - _STARTED:.0f} s: {line}")


@contextlib.contextmanager
def _phase(config: pytest.Config, what: str) -> Iterator[None]:
    """Say that a long preparation starts, then how long it took."""
    began = time.monotonic()
    _progress(config, f"{what} ...")
    yield
    _progress(config, f"{what}: done in {time.monotonic() - began:.1f} s")


_CONFIG: list[pytest.Config] = []


def pytest_configure(config: pytest.Config) -> None:
    """Keep the config for the per-test progress lines (logreport hooks do not get it)."""
    _CONFIG.append(config)


def pytest_runtest_logreport(report: TestReport) -> None:
    """One line per e2e test when it ends, with its outcome and duration.

    None for a test skipped at setup (a machine that cannot boot the trees skips all ~160):
    the run's skip summary counts them with their reason, rather than a screen of lines before
    the first result.
    """
    if _CONFIG and (report.when == "call" or (report.when == "setup" and report.failed)):
        took = f"in {report.duration:.1f} s" if report.when == "call" else "at setup"
        _progress(_CONFIG[0], f"{report.nodeid} {report.outcome} {took}")


@pytest.fixture(scope="session")
def rootfs(release: str, request: pytest.FixtureRequest) -> Path:
    """The cached root file system of `release` (debootstrapped on first use)."""
    with _phase(request.config, f"{release} root file system (debootstrap when not cached)"):
        return ensure_rootfs(release)


@pytest.fixture(scope="session")
def docker_rootfs(release: str, request: pytest.FixtureRequest) -> Path:
    """The tree of `release` with Debian's docker engine (variant "docker"), for one scenario."""
    with _phase(request.config, f"{release} root file system with docker.io (when not cached)"):
        return ensure_rootfs(release, variant="docker")


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


@pytest.fixture(scope="session")
def e2e_artifacts(release: str, request: pytest.FixtureRequest) -> Artifacts:
    """The checkout's wheel, its dependencies' wheels for `release` and the fake NVML (cached)."""
    reason = host_env_ok()
    if reason is not None:
        pytest.skip(reason)
    with _phase(request.config, f"{release} wheels and fake NVML"):
        artifacts = prepare_artifacts(release)
    timings = ", ".join(f"{name} {seconds:.1f}" for name, seconds in artifacts.timings.items())
    SESSION_NOTES.append(f"host artifacts for {release} (s): {timings}")
    return artifacts


@pytest.fixture
def gpubox(container: ContainerFactory, e2e_artifacts: Artifacts) -> Iterator[GpuBox]:
    """A booted container with gpuguard, the fake NVML and the fake SGLang installed."""
    booted = container(binds=e2e_artifacts.binds())
    box = GpuBox(booted, install_s=install(booted))
    yield box
    box.kill_server()  # the halt would otherwise wait out the server's stop timeout


@pytest.fixture(scope="session")
def vllm_rootfs(release: str, request: pytest.FixtureRequest) -> Path:
    """The tree of `release` with what the real vLLM needs from apt (variant "vllm": libnuma)."""
    with _phase(request.config, f"{release} root file system for vLLM (when not cached)"):
        return ensure_rootfs(release, variant=ENGINE_TREE)


@pytest.fixture(scope="session")
def real_engine(vllm_rootfs: Path, release: str, request: pytest.FixtureRequest) -> Engine:
    """The real vLLM's venv and tiny model for `release` (real_engine.py; built on first use).

    Cannot be built: a skip with the reason, or a failure under GPUGUARD_REQUIRE_REAL_ENGINE=1.
    """
    try:
        with _phase(request.config, f"{release} real vLLM venv and tiny model (when not cached)"):
            engine = ensure_engine(vllm_rootfs, release)
    except EngineError as exc:
        if engine_required():
            pytest.fail(f"{REQUIRE_ENV}=1 and the real engine cannot be installed: {exc}")
        pytest.skip(f"the real engine cannot be installed ({REQUIRE_ENV}=1 fails instead): {exc}")
    timings = ", ".join(f"{name} {seconds:.1f}" for name, seconds in engine.timings.items())
    SESSION_NOTES.append(f"real vLLM for {release} (s): {timings}")
    return engine


@pytest.fixture
def vllm_box(vllm_rootfs: Path, e2e_artifacts: Artifacts, real_engine: Engine) -> Iterator[GpuBox]:
    """A gpubox of the "vllm" tree with the real vLLM too: vllm.service on fake GPU 0, stopped."""
    booted = Container(
        vllm_rootfs,
        binds=[*e2e_artifacts.binds(), *real_engine.binds()],
        mode="copy" if os.environ.get(MODE_ENV) == "copy" else "overlay",
    )
    with booted:
        box = GpuBox(booted, install_s=install(booted))
        box.install_s += install_real_engine(booted)
        yield box
        booted.systemctl("kill", "--signal=SIGKILL", "vllm.service", check=False)


def pytest_terminal_summary(terminalreporter: TerminalReporter) -> None:
    """Print the scenarios measured in this run: each timeline, then the table."""
    if os.environ.get(SUMMARY_ENV) == "0" or not (SESSION_RESULTS or SESSION_NOTES):
        return
    terminalreporter.section("gpuguard end-to-end scenarios (tests/e2e, docs/e2e.md)")
    notes = list(SESSION_NOTES)
    if INSTALL_SECONDS:
        notes.append(
            f"install in a container: {len(INSTALL_SECONDS)} times, "
            f"{min(INSTALL_SECONDS):.1f}-{max(INSTALL_SECONDS):.1f} s"
        )
    for line in render_report(SESSION_RESULTS, notes=notes):
        terminalreporter.write_line(line)
