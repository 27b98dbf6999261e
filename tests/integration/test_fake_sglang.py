"""The fake SGLang of the end-to-end tests takes the shapes of SGLang's source (issue 34).

Each run here is the real fake: its server, its TP worker and the fake GPU driver as processes,
over the fake NVML. What gpuguard reads of them (their lines, their exit, who their parent is)
must be what SGLang gives: an exit 137 of its own after a clean drain
(``python/sglang/srt/managers/tokenizer_manager.py``, ``sigterm_watchdog``), the scheduler
watchdog's line and the server's SIGQUIT line (``python/sglang/srt/utils/watchdog.py``,
``SignalHandler.running_phase_sigquit_handler``), schedulers reparented away from the server.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gpuguard.core.enginelines import match_line

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from fakestate import NvmlEnv

FAKE = Path(__file__).resolve().parents[1] / "e2e" / "fakesglang"
READY = "The server is fired up and ready to roll!"
# pynvml finds the fake libnvidia-ml.so.1 by soname once it is loaded by path (fakestate.py).
RUNNER = (
    "import ctypes, os, runpy, sys; "
    "ctypes.CDLL(os.environ['FAKENVML_LIBRARY'], mode=ctypes.RTLD_GLOBAL); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)
TIMEOUT_S = 60.0


class Lines:
    """A process's merged output, line by line as it comes (a thread reads it into a queue)."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        """Follow ``process``'s stdout until it ends."""
        assert process.stdout is not None
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        stream = process.stdout

        def read() -> None:
            for line in stream:
                self.queue.put(line.rstrip("\n"))
            self.queue.put(None)

        threading.Thread(target=read, daemon=True).start()

    def until(self, wanted: str) -> str:
        """The first line from now on that contains ``wanted``; fails when the output ends."""
        deadline = time.monotonic() + TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                self.queue.put(None)
                break
            self.seen.append(line)
            if wanted in line:
                return line
        raise AssertionError(f"no line with {wanted!r}; seen: {self.seen[-20:]}")

    def rest(self) -> list[str]:
        """Every line seen, once the output ended."""
        while (line := self.queue.get(timeout=TIMEOUT_S)) is not None:
            self.seen.append(line)
        self.queue.put(None)
        return self.seen


@pytest.fixture
def driver(fake_state: Path, tmp_path: Path) -> Iterator[Path]:
    """The fake GPU driver serving ``fake_state`` on a socket of its own."""
    sock = tmp_path / "driver.sock"
    argv = [sys.executable, str(FAKE / "fakegpu_driver.py"), "--state", str(fake_state)]
    process = subprocess.Popen(
        [*argv, "--socket", str(sock)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    with process:
        Lines(process).until("serving")
        yield sock
        process.terminate()


def start(
    fake_state: Path, driver: Path, nvml_env: NvmlEnv, *flags: str, ready: bool = True
) -> tuple[subprocess.Popen[str], Lines]:
    """The fake server with one TP worker on GPU 0, up and ready (its ready line read).

    ``ready=False``: returned at once, for a server that may never say it is ready. A server
    that never says so when it should is killed and waited for before the test fails.
    """
    env = nvml_env(fake_state) | {"CUDA_VISIBLE_DEVICES": "0"}
    for name in [n for n in env if n.startswith("FAKE_SGLANG_")]:
        del env[name]
    argv = [sys.executable, "-c", RUNNER, str(FAKE / "fake_sglang.py"), "--model-path", "m"]
    argv += ["--fake-load-s", "0", "--fake-state", str(fake_state), "--fake-driver", str(driver)]
    argv += ["--port", "0", *flags]
    process = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = Lines(process)
    if ready:
        try:
            lines.until(READY)
        except BaseException:
            process.kill()
            process.wait()
            raise
    return process, lines


def released(fake_state: Path) -> bool:
    """Whether every context the fake driver handed out was freed (its holders are gone)."""
    allocs = list((fake_state / "allocs").glob("*.alloc"))
    return bool(allocs) and all("released_at_ms" in a.read_text() for a in allocs)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition()`` until it holds, for at most TIMEOUT_S."""
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def workers_of(fake_state: Path) -> list[tuple[int, int]]:
    """(PID, parent PID) of each fake TP worker of this test (its command line names the state)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        if b"--fake-worker" in cmdline and str(fake_state).encode() in cmdline:
            found.append((int(proc.name), int(stat.rpartition(")")[2].split()[1])))
    return found


def test_a_clean_drain_ends_in_sglangs_own_sigkill(
    fake_state: Path, driver: Path, nvml_env: NvmlEnv
) -> None:
    """SIGTERM: the drain empties, then the server SIGKILLs its tree and itself: exit 137."""
    server, lines = start(fake_state, driver, nvml_env, "--fake-exit-137-after-drain")
    with server:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=TIMEOUT_S) == -signal.SIGKILL  # a shell's exit 137
    output = lines.rest()
    assert "Gracefully exiting... Remaining number of requests 0." in output[-1]
    assert not any("Server shut down." in line for line in output)
    wait_for(lambda: released(fake_state), "the worker's GPU memory was never freed")


def test_a_hung_scheduler_s_watchdog_sigquits_the_server_which_kills_its_tree(
    fake_state: Path, driver: Path, nvml_env: NvmlEnv
) -> None:
    """The watchdog's line, the server's SIGQUIT line, exit 137: each a line gpuguard reads.

    The watchdog fires 2 s after the worker is up, which on a loaded machine may still be before
    the server says it is ready: its ready line is not waited for. (At 0 s it could fire while
    the server was still taking the worker in, and the server's handler then killed only itself,
    leaving the worker running.)
    """
    server, lines = start(fake_state, driver, nvml_env, "--fake-watchdog-s", "2", ready=False)
    with server:
        watchdog = lines.until("Scheduler watchdog timeout")
        sigquit = lines.until("SIGQUIT received.")
        assert server.wait(timeout=TIMEOUT_S) == -signal.SIGKILL
    assert "(self.watchdog_timeout=300, self.soft=False)" in watchdog
    assert f"signum={int(signal.SIGQUIT)}" in sigquit
    assert "It usually means one child failed." in sigquit
    assert [getattr(match_line(line), "key", None) for line in (watchdog, sigquit)] == [
        "sglang-scheduler-watchdog",
        "sglang-sigquit-received",
    ]
    wait_for(lambda: released(fake_state), "the worker's GPU memory was never freed")


def test_orphaned_schedulers_run_away_from_the_server_and_still_stop_with_it(
    fake_state: Path, driver: Path, nvml_env: NvmlEnv
) -> None:
    """--fake-orphan-workers: the TP worker's parent is not the server; a stop still ends it."""
    server, lines = start(fake_state, driver, nvml_env, "--fake-orphan-workers")
    found = workers_of(fake_state)
    try:
        with server:
            [(worker, parent)] = found
            assert parent not in {server.pid, os.getpid()}
            server.send_signal(signal.SIGTERM)
            assert server.wait(timeout=TIMEOUT_S) == 0
    finally:
        for pid, _ in found:  # no parent of ours reaps an orphan: end it should the stop fail
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert "Server shut down." in lines.rest()[-1]
    wait_for(lambda: not Path(f"/proc/{worker}/cmdline").read_bytes(), "the worker outlived it")
