"""Run gpuguard's CLI as user ``nobody`` (uid 65534), the way an unprivileged operator would.

The interpreter and its standard library may live where ``nobody`` cannot read (a pyenv under
/root in CI; a checkout in a 0700 home, as Debian 13 makes them), so the child imports every
module of gpuguard, and what they import lazily, while still root, then drops its privileges and
only then calls ``gpuguard.cli.main``: what runs unprivileged is exactly gpuguard's code path,
with the same imports already loaded.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from clirunner import bind_prefix, over_hostless

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

_SCRIPT = r"""
import importlib, os, pkgutil, sys
import gpuguard
for name in sys.argv[1].split(","):
    importlib.import_module(name)
for module in pkgutil.walk_packages(gpuguard.__path__, "gpuguard."):
    if not module.name.endswith("__main__"):
        importlib.import_module(module.name)
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
from gpuguard.cli import main
sys.exit(main(sys.argv[2:]))
"""

# Besides every module of gpuguard's own (a hand-kept list of them went stale whenever a
# command gained a lazy import): what those import lazily from outside.
PREIMPORTS = ("pynvml", "psutil", "pickle", "selectors", "json", "encodings.idna")


@dataclass(frozen=True)
class Result:
    """Exit status and output of one unprivileged run."""

    code: int
    out: str
    err: str


def run_as_nobody(
    args: list[str], env: dict[str, str], timeout: float = 60, prefix: Sequence[str] | None = None
) -> Result:
    """Run ``gpuguard ARGS`` as nobody (needs root to drop to it) and capture the result.

    ``prefix`` runs first, as root, and execs the rest (Cli.prefix: doubles bound in place);
    by default it binds the tests' systemctl and journalctl (clirunner.HOSTLESS), never the
    host's.
    """
    if prefix is None:
        prefix = bind_prefix(over_hostless({}))
    done = subprocess.run(
        [*prefix, sys.executable, "-c", _SCRIPT, ",".join(PREIMPORTS), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
        cwd="/",
    )
    return Result(done.returncode, done.stdout, done.stderr)


@contextmanager
def public_dir() -> Iterator[Path]:
    """A directory user nobody can read (pytest's tmp_path is root's alone); removed after."""
    path = Path(tempfile.mkdtemp(prefix="gpuguard-nobody-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
