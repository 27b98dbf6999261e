"""``python hostless.py DIRS ARGS...``: ``python -m gpuguard ARGS...``, its programs in DIRS first.

gpuguard runs systemctl and journalctl by absolute path from the system's directories only
(adapters/programs.py), never through PATH: a stand-in on PATH is never run. On a host whose
PID 1 is systemd the real ones answer for that machine (a unit a test's configuration names is
``LoadState=not-found`` there, only unknown where systemd does not run), so every test's gpuguard
hears the tests' own: root binds them over the system's programs in a private mount namespace
(clirunner.gpuguard_argv); a normal user, who cannot mount, starts gpuguard through this file,
which puts DIRS (``:``-separated: a test's own doubles' directories, then tests/support/hostless)
first in that search. Nothing else of gpuguard changes: the same module runs as with ``-m``.
"""

from __future__ import annotations

import runpy
import sys

from gpuguard.adapters import programs

# As many directories as the test has doubles in: more than the four system ones it replaces.
programs.SYSTEM_DIRS = (*sys.argv.pop(1).split(":"), *programs.SYSTEM_DIRS)  # type: ignore[assignment]
runpy.run_module("gpuguard", run_name="__main__", alter_sys=True)
