"""One-shot journal queries for ``gpuguard explain``: each source of an incident, read once.

Four ``journalctl`` runs (through ``adapters.programs``: absolute path, fixed environment), each
filtered by journalctl so that Python parses only what can become a row: PID 1 about the unit;
the unit's output matching a start-failure signature, an engine's fatal line or its ready line
(``--grep``, so a chatty server's request log never reaches Python); gpuguard's own units (the
daemon, and the gate server, which logs each verdict itself); kernel Xid lines. Trust
is judged by ``core.timeline`` from journald's fields, never from these filters. Each run is
bounded in time, in entries (the newest ``MAX_ENTRIES``) and in bytes (``MAX_BYTES``). The
follower the daemon uses is ``adapters.journal``; this one reads history only.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import subprocess
import time
from typing import Final

from gpuguard.adapters import programs, signals
from gpuguard.core import timeline
from gpuguard.core.enginelines import FATAL_REGEX, READY_REGEX
from gpuguard.core.escaping import escape
from gpuguard.core.events import FIELDS_READ, GPU_OOM_REGEX
from gpuguard.core.xid.events import MARKER
from gpuguard.core.xid.hung import MARKERS as HUNG_MARKERS

MAX_ENTRIES: Final = 20_000
"""Entries read per journalctl run: the newest ones when there are more."""
MAX_BYTES: Final = 64 << 20
"""Output read per journalctl run; past it the run is stopped and its rest left out."""
_TIMEOUT_S: Final = 60.0
_CHUNK: Final = 1 << 16
_FIELDS: Final = ",".join(FIELDS_READ)


def queries(unit: str, since: str | None) -> list[list[str]]:
    """The journalctl command lines, one per source (pure; tested as such)."""
    base = [
        "journalctl",
        "--output=json",
        "--all",
        "--no-pager",
        "--quiet",
        f"--output-fields={_FIELDS}",
        f"--lines={MAX_ENTRIES}",
    ]
    base.append(f"--since={since}" if since else "--boot")
    units = [f"UNIT={unit}"]
    grep_unit = f"{GPU_OOM_REGEX}|{FATAL_REGEX}|{READY_REGEX}"
    return [
        [*base, "_PID=1", *units, "+", "_SYSTEMD_CGROUP=/init.scope", *units],
        [*base, f"--grep={grep_unit}", "--case-sensitive=yes", f"_SYSTEMD_UNIT={unit}"],
        [
            *base,
            f"--unit={timeline.DAEMON_UNIT}",
            f"--unit={timeline.GATE_SERVER_UNIT}",
            f"--unit={timeline.GATE_SERVER_PREFIX}*.service",
        ],
        [*base, f"--grep={_KERNEL_GREP}", "--case-sensitive=yes", "_TRANSPORT=kernel"],
    ]


# Xids, and the driver's lines that say a GPU hangs (core.xid.hung).
_KERNEL_GREP = "|".join(re.escape(marker) for marker in (MARKER, *HUNG_MARKERS))


def parse_lines(out: bytes) -> list[dict[str, object]]:
    """The JSON lines journalctl printed, as objects; what is not a JSON object is skipped."""
    entries: list[dict[str, object]] = []
    for line in out.splitlines():
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(value, dict):
            entries.append(value)
    return entries


def read(unit: str, since: str | None) -> tuple[list[dict[str, object]], list[str]]:
    """Every entry the queries find, and a problem line for each journalctl that failed."""
    entries: list[dict[str, object]] = []
    problems: list[str] = []
    for command in queries(unit, since):
        try:
            out, code, said = _capped(command)
        except OSError as err:
            problems.append(f"journalctl: {escape(str(err), 300)}")
            continue
        grep = any(arg.startswith("--grep=") for arg in command)
        # With --grep, journalctl exits 1 when nothing matched, as grep does.
        if code is None:
            problems.append(f"journalctl: {said}; the rest of this source is left out")
        elif code != 0 and not (grep and code == 1 and not out):
            problems.append(f"journalctl exited {code}: {said}")
        entries += parse_lines(out)
    return entries, problems


def _capped(command: list[str]) -> tuple[bytes, int | None, str]:
    """Run ``command``: its output up to ``MAX_BYTES``, its exit status, its last words.

    The status is None when it was stopped: past ``MAX_BYTES`` (a unit can send huge lines
    through the native protocol, and they match a --grep) or past ``_TIMEOUT_S``.
    """
    with programs.popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:
        assert proc.stdout is not None  # noqa: S101 - stdout=PIPE
        assert proc.stderr is not None  # noqa: S101 - stderr=PIPE
        out, err = bytearray(), bytearray()
        deadline = time.monotonic() + _TIMEOUT_S
        stopped = ""
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ, out)
            selector.register(proc.stderr, selectors.EVENT_READ, err)
            while selector.get_map() and not stopped:
                left = deadline - time.monotonic()
                for key, _ in selector.select(max(left, 0)):
                    chunk = os.read(key.fd, _CHUNK)
                    if not chunk:
                        selector.unregister(key.fileobj)
                    elif key.data is err:
                        err[:] = (err + chunk)[-_CHUNK:]  # only its last words matter
                    else:
                        out += chunk
                if len(out) > MAX_BYTES:
                    stopped = f"output over {MAX_BYTES >> 20} MiB"
                elif time.monotonic() >= deadline:
                    stopped = f"no end after {_TIMEOUT_S:g} s"
        if stopped:
            signals.kill_own_child(proc.pid)  # not reaped yet: the PID is still ours
        code = proc.wait()
    last = err.decode("utf-8", "replace").strip().splitlines()[-1:]
    said = stopped or (escape(last[0], 300) if last else "")
    return bytes(out[:MAX_BYTES]), None if stopped else code, said
