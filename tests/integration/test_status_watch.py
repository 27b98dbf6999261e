"""`gpuguard status --watch` as a person sees it: tmux runs it, capture-pane reads the screen.

tmux is a real terminal emulator: it tells which screen is shown (``alternate_on``), whether
the cursor is visible (``cursor_flag``) and whether the program has exited and how
(``pane_dead``, ``pane_dead_status``). The fake NVML and real holder processes change what the
screen must show between frames.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from clirunner import Cli
    from fakeholder import HolderSpawner

TMUX = shutil.which("tmux")
pytestmark = pytest.mark.skipif(
    TMUX is None,
    reason="SKIPPED LOUDLY: tmux is not installed (apt-get install tmux; .ci/run installs it): "
    "status --watch is not tested on a terminal",
)
COLUMNS, LINES = 110, 30


class Terminal:
    """One tmux server on a private socket with one pane running a command."""

    def __init__(self, tmp_path: Path) -> None:
        """Name the server; nothing runs until ``start``."""
        self.socket = f"gg-watch-{os.getpid()}-{id(self)}"
        self.tmp_path = tmp_path

    def tmux(self, *args: str) -> str:
        """Run a tmux command against this server; its output."""
        assert TMUX is not None
        done = subprocess.run(
            [TMUX, "-L", self.socket, "-f", "/dev/null", *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return done.stdout

    def start(self, argv: list[str], env: dict[str, str]) -> None:
        """Run ``argv`` with exactly ``env`` in a COLUMNS x LINES pane.

        A shell around it stays after it exits and prints its exit status on the normal
        screen, so what the terminal looks like afterwards is the program's doing, not that
        of tmux's dead-pane display. The shell's own trap keeps Ctrl-C from ending the shell
        and, being a handler, is not inherited across exec.
        """
        script = self.tmp_path / f"{self.socket}.sh"
        assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
        script.write_text(
            f"trap : INT\nenv -i {assignments} {shlex.join(argv)}\n"
            'echo "exited $?"\nexec sleep 600\n'
        )
        # Given as separate words, tmux runs the command itself, not through the user's
        # default shell: dash (useradd's default) forks for ``-c``, so the pane would be its PID.
        self.tmux("new-session", "-d", "-x", str(COLUMNS), "-y", str(LINES), "sh", str(script))

    def program_pid(self) -> int:
        """The PID of the program the pane's shell runs."""
        shell = int(self.flag("pane_pid"))
        children = Path(f"/proc/{shell}/task/{shell}/children").read_text().split()
        assert len(children) == 1, children
        return int(children[0])

    def screen(self) -> str:
        """The visible screen (the alternate one while it is on)."""
        return self.tmux("capture-pane", "-p")

    def flag(self, name: str) -> str:
        """A pane format variable: alternate_on, cursor_flag, pane_dead, pane_pid."""
        return self.tmux("display-message", "-p", f"#{{{name}}}").strip()

    def wait_for(self, check: Callable[[str], bool], what: str, timeout: float = 20) -> str:
        """Poll the screen until ``check`` holds; fail with the last screen."""
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline:
            screen = self.screen()
            if check(screen):
                return screen
            time.sleep(0.1)
        pytest.fail(f"{what}: not on the screen after {timeout} s:\n{screen}")

    def wait_exit(self, timeout: float = 10) -> int:
        """Wait until the program exited; its exit status (as the shell printed it)."""
        screen = self.wait_for(lambda s: "exited " in s, "the program's exit", timeout)
        return int(screen.split("exited ", 1)[1].split()[0])

    def close(self) -> None:
        """Stop the server (and whatever still runs in it)."""
        subprocess.run(
            [TMUX or "tmux", "-L", self.socket, "kill-server"], capture_output=True, check=False
        )


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[Terminal]:
    """A private tmux server, killed at teardown."""
    term = Terminal(tmp_path)
    yield term
    term.close()


def watching(terminal: Terminal, cli: Cli, interval: str = "0.3") -> str:
    """Start `gpuguard status --watch` in the terminal; the first full frame."""
    terminal.start(cli.command("status", "--watch", interval), cli.env)
    return terminal.wait_for(lambda s: "gpuguard status: OK" in s, "the first frame")


def assert_restored(terminal: Terminal) -> None:
    """Normal screen back, cursor visible, and no frame left on the normal screen."""
    assert terminal.flag("alternate_on") == "0"
    assert terminal.flag("cursor_flag") == "1"
    screen = terminal.screen()
    assert "gpuguard status" not in screen
    assert screen.startswith("exited 0")


def test_live_screen_follows_the_gpus_and_ctrl_c_restores_the_terminal(
    terminal: Terminal, cli: Cli, spawn_holder: HolderSpawner
) -> None:
    """One frame at the top of the alternate screen, redrawn in place as holders come and go."""
    first = watching(terminal, cli)
    lines = first.splitlines()
    assert lines[0].startswith("Every 0.3s: gpuguard status")
    assert lines[2].startswith("gpuguard status: OK - all 4 GPUs idle")
    assert terminal.flag("alternate_on") == "1"
    assert terminal.flag("cursor_flag") == "0"
    holder = spawn_holder(cli.state, gpus=(0,), mib=3000, name="watched-holder")
    busy = terminal.wait_for(
        lambda s: f"pid {holder.pid}" in s and "3000 MiB" in s, "the new holder with its MiB"
    )
    assert busy.count("gpuguard status:") == 1  # redrawn in place, never scrolled
    holder.kill()
    holder.wait()
    idle = terminal.wait_for(
        lambda s: f"pid {holder.pid}" not in s and "all 4 GPUs idle" in s, "the holder gone"
    )
    # The shorter frame left nothing of the longer one: no line below the last status line.
    shown = idle.rstrip("\n").splitlines()
    assert shown[-1].strip(), idle
    assert all(len(line) <= COLUMNS for line in shown)
    terminal.tmux("send-keys", "C-c")
    assert terminal.wait_exit() == 0
    assert_restored(terminal)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_hangup_restore_the_terminal(
    terminal: Terminal, cli: Cli, signum: signal.Signals
) -> None:
    """SIGTERM (systemd, kill) and SIGHUP (the terminal closed) end it cleanly, exit 0."""
    watching(terminal, cli)
    os.kill(terminal.program_pid(), signum)
    assert terminal.wait_exit() == 0
    assert_restored(terminal)


def test_a_small_terminal_gets_a_cut_frame_not_a_scrolled_one(terminal: Terminal, cli: Cli) -> None:
    """Resized to 8 lines, the frame says how many lines it left out; nothing wraps."""
    watching(terminal, cli)
    terminal.tmux("resize-window", "-x", "40", "-y", "8")
    small = terminal.wait_for(lambda s: "more lines" in s, "the cut marker")
    rows = small.rstrip("\n").splitlines()
    assert len(rows) <= 8
    assert all(len(row) <= 40 for row in rows)
    assert rows[0].startswith("Every 0.3s")


def test_not_a_terminal_is_refused(cli: Cli) -> None:
    """Standard output on a pipe: exit 64 and one line on standard error, no escape sequence."""
    result = cli("status", "--watch")
    assert result.code == 64
    assert "not a terminal" in result.err
    assert "\x1b" not in result.out + result.err


@pytest.mark.parametrize("bad", ["0", "-1", "abc", "100000"])
def test_bad_interval_is_a_usage_error(cli: Cli, bad: str) -> None:
    """--watch SECONDS outside 0.1-86400: the parser's usage error (exit 64)."""
    result = cli("status", f"--watch={bad}")
    assert result.code == 64
    assert "--watch" in result.err
