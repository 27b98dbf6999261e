"""Kernel Xid lines from the journal → typed events (pure: no I/O, no clock).

The NVIDIA driver logs each fault as a kernel message, ``NVRM: Xid (PCI:0000:3b:00): 79,
pid=1234, name=python3, GPU has fallen off the bus.`` Only ``_TRANSPORT=kernel`` counts: journald
sets it for what it reads from /dev/kmsg, and no client can send it, so a user's ``logger "NVRM:
Xid …"`` is never an Xid. The text is still written by a driver about processes a user names:
the PID is kept only when it is a plain decimal (the driver writes ``'<unknown>'`` when there is
none), the process name and the rest are escaped and cut for display, and the scanner is a hand
loop over bounded slices: linear, total, never raising. A line that names an Xid but does not
parse is reported as malformed (and counted by the caller), never guessed at.

Observed forms: ``Xid (PCI:0000:3b:00): 79, pid=…, name=…, text`` (drivers of recent years),
``Xid (PCI:0000:10:1c): 63, pid=1896, text`` (no name), ``Xid (PCI:0000:2b:00): 79, text`` (no
pid) and ``Xid (0000:01:00): 3, text`` (old drivers, no ``PCI:``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from gpuguard.core.escaping import escape

MARKER: Final = "NVRM: Xid ("
"""What a kernel Xid line contains; also the journalctl ``--grep`` pre-filter (a literal)."""
SCAN_CHARS: Final = 512
"""Where the marker may start: the kernel prefixes only a few characters (a timestamp)."""
_NAME_CHARS: Final = 64
_DETAIL_CHARS: Final = 200
_HEX: Final = frozenset("0123456789abcdefABCDEF")
_UNKNOWN_PID: Final = frozenset({"'<unknown>'", "<unknown>"})


@dataclass(frozen=True, slots=True)
class XidEvent:
    """One Xid the kernel logged. ``pid`` is None when the driver named no process."""

    pci_bus_id: str
    """Normalised ``dddd:bb:dd`` (lower-case hex): compare with ``normalize_pci`` of NVML's."""
    code: int
    pid: int | None
    name: str | None
    """The process name the driver printed, escaped and cut: for people only."""
    detail: str
    """The rest of the line, escaped and cut: for people only."""
    monotonic_s: float | None
    realtime_s: float | None
    boot_id: str | None
    cursor: str | None


@dataclass(frozen=True, slots=True)
class MalformedXid:
    """A kernel line that names an Xid but could not be read; ``excerpt`` is escaped."""

    reason: str
    excerpt: str


def parse_kernel_entry(entry: Mapping[str, object]) -> XidEvent | MalformedXid | None:
    """The Xid a journal entry reports, a MalformedXid, or None (not a kernel Xid line)."""
    if not isinstance(entry, Mapping) or entry.get("_TRANSPORT") != "kernel":
        return None
    message = entry.get("MESSAGE")
    if isinstance(message, list) and all(isinstance(b, int) and 0 <= b <= 255 for b in message):
        message = bytes(message[: 4 * SCAN_CHARS + 1024]).decode("utf-8", errors="replace")
    if not isinstance(message, str):
        return None
    text = message[: SCAN_CHARS + 1024]
    start = text.find(MARKER, 0, SCAN_CHARS + len(MARKER))
    if start < 0:
        return None
    parsed = parse_xid_text(text[start + len(MARKER) :])
    if isinstance(parsed, MalformedXid):
        return parsed
    pci, code, pid, name, detail = parsed
    return XidEvent(
        pci_bus_id=pci,
        code=code,
        pid=pid,
        name=name,
        detail=detail,
        monotonic_s=_seconds(entry.get("__MONOTONIC_TIMESTAMP")),
        realtime_s=_seconds(entry.get("__REALTIME_TIMESTAMP")),
        boot_id=_short_string(entry.get("_BOOT_ID")),
        cursor=_short_string(entry.get("__CURSOR"), 512),
    )


def parse_xid_text(
    rest: str,
) -> tuple[str, int, int | None, str | None, str] | MalformedXid:
    """What follows ``NVRM: Xid (``: PCI address, code, pid, name, detail; or why not."""
    close = rest.find("): ", 0, 40)
    if close < 0:
        return _malformed("no '): ' after the PCI address", rest)
    pci = normalize_pci(rest[:close])
    if pci is None:
        return _malformed("not a PCI address", rest)
    tail = rest[close + 3 : close + 3 + 1024]
    digits = 0
    while digits < len(tail) and digits < 6 and tail[digits].isascii() and tail[digits].isdigit():
        digits += 1
    if digits == 0 or digits > 5:
        return _malformed("no Xid code", rest)
    code = int(tail[:digits])
    tail = tail[digits:]
    if tail and not tail.startswith(", "):
        return _malformed("no ', ' after the Xid code", rest)
    tail = tail[2:]
    pid: int | None = None
    name: str | None = None
    if tail.startswith("pid="):
        value, tail = _field(tail[4:], 32)
        if value.isascii() and value.isdigit() and 0 < len(value) <= 10:
            pid = int(value)
        elif value not in _UNKNOWN_PID:
            return _malformed("pid is neither a number nor '<unknown>'", rest)
        if tail.startswith("name="):
            raw, tail = _field(tail[5:], _NAME_CHARS)
            name = escape(raw)
    return pci, code, pid, name, escape(tail[:_DETAIL_CHARS])


def normalize_pci(text: str) -> str | None:
    """``[PCI:]domain:bus:device[.function]`` (any case, 4 or 8 domain digits) → ``dddd:bb:dd``.

    NVML writes ``00000000:3B:00.0``, the kernel ``PCI:0000:3b:00``: both become ``0000:3b:00``.
    None when it is not such an address.
    """
    if len(text) > 32:
        return None
    text = text.removeprefix("PCI:")
    parts = text.split(":")
    if len(parts) != 3:
        return None
    domain, bus, device = parts
    device = device.split(".", 1)[0]
    if not (0 < len(domain) <= 8 and len(bus) == 2 and len(device) == 2):
        return None
    if not all(ch in _HEX for ch in domain + bus + device):
        return None
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}"


def _field(text: str, limit: int) -> tuple[str, str]:
    """A ``value, rest`` pair: the value ends at the first ', ' within ``limit`` characters."""
    end = text.find(", ", 0, limit + 2)
    if end < 0:
        return text[:limit], ""
    return text[:end], text[end + 2 :]


def _malformed(reason: str, rest: str) -> MalformedXid:
    return MalformedXid(reason, escape(MARKER + rest[:80]))


def _seconds(value: object) -> float | None:
    """A journal µs timestamp in seconds; None when malformed."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 19:
        return int(value) / 1_000_000
    return None


def _short_string(value: object, limit: int = 64) -> str | None:
    return value if isinstance(value, str) and len(value) <= limit else None
