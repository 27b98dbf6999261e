"""Shared pytest fixtures for gpuguard's tests.

Fake NVML (tests/fakenvml/README.md): ``fake_nvml_dir``, ``fake_nvml_old_dir``, ``fake_state``,
``nvml_env`` and ``spawn_holder``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import settings

# The fake NVML helpers live beside their C source in tests/fakenvml, other shared helpers in
# tests/support (neither is a package).
sys.path.insert(0, str(Path(__file__).resolve().parent / "fakenvml"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from fakeholder import HolderSpawner
from fakestate import NvmlEnv, build_fake_nvml, nvml_environ, write_state
from skipsummary import report_skips

if TYPE_CHECKING:
    from collections.abc import Iterator

    from _pytest.terminal import TerminalReporter


# The files the tests write (configurations, fake GPUs' state, scripts) are gpuguard's inputs,
# and gpuguard refuses one that group or others may write: under a user's umask 0002 (Debian
# 13's default) they would be. Every test and every process it starts writes with umask 022.
os.umask(0o022)

# No deadline per example: how long one takes says how loaded the machine is, not whether the
# property holds (a 200 ms deadline failed a suite run beside three others on 2 cores).
# "gpuguard", the default and what CI runs: hypothesis's 100 examples per property. "dev", for
# the edit-test loop (``make unit`` uses it; ``HYPOTHESIS_PROFILE=dev`` for any pytest run): 10
# examples, a quick look rather than CI's search; a test's own ``@settings(max_examples=…)``
# wins over either. An unknown name fails the run at once.
settings.register_profile("gpuguard", deadline=None)
settings.register_profile("dev", deadline=None, max_examples=10)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gpuguard"))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter: TerminalReporter) -> Iterator[None]:
    """End a run that skipped tests loudly: how many, why, and ``sudo make deps``.

    Around pytest's own summary, so it comes after the list of failures (``-r``): the last
    screen shows it, just above the counts.
    """
    yield
    report_skips(terminalreporter)


# ---------------------------------------------------------------------------------------------
# Fake NVML
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def fake_nvml_dir() -> Path:
    """The directory holding the fake ``libnvidia-ml.so.1`` (a driver >= 515), built once."""
    return build_fake_nvml()


@pytest.fixture(scope="session")
def fake_nvml_old_dir() -> Path:
    """The directory holding the fake ``libnvidia-ml.so.1`` of a driver < 510, built once."""
    return build_fake_nvml(old=True)


@pytest.fixture
def fake_state(tmp_path: Path) -> Path:
    """A fresh state directory with four idle H200s (minors 0-3, no allocations)."""
    return write_state(tmp_path / "nvml-state")


@pytest.fixture
def nvml_env(fake_nvml_dir: Path) -> NvmlEnv:
    """Factory: ``nvml_env(state, old=False)`` gives the environment for a subprocess."""
    del fake_nvml_dir  # requested so the build happens (and fails) once, up front

    def make(state: Path, old: bool = False) -> dict[str, str]:
        return nvml_environ(state, old=old)

    return make


@pytest.fixture
def spawn_holder() -> Iterator[HolderSpawner]:
    """Factory that starts ``gpu_hold.py`` holders; every process they started dies at teardown.

    ``spawn_holder(state, gpus=(0,), mib=1000, kind="compute", name=None, children=0,
    child_name=None, leave_child=False, ignore_sigterm=False, drain=None, no_usage=False,
    timeout=10.0) -> Holder`` (pid, children, allocs, watcher; terminate/kill/wait/
    wait_released).
    """
    spawner = HolderSpawner()
    yield spawner
    spawner.cleanup()
