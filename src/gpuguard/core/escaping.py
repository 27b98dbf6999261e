r"""Show foreign text safely: every string another user chose is escaped before anyone sees it.

Process names, command lines, cgroup, unit and container names, unit output and the reasons
built from them are chosen by whoever runs the process. Printed raw, an ESC sequence could
rewrite root's terminal, a newline could forge a line ("OK: all idle") in status or split a
journal entry in two, and a bidi override could make text read backwards. Everything here is
pure and linear in the length of its input.

A character is escaped when Python does not call it printable: the C0 controls and DEL, the C1
controls, line and paragraph separators, format characters (bidi overrides, zero-width
characters), unassigned and private-use code points, the lone surrogates that
``surrogateescape`` makes of undecodable bytes, and every space but the ASCII one. ``\n``,
``\r`` and ``\t`` keep their C spelling; everything else becomes ``\xHH``, ``\uHHHH`` or
``\UHHHHHHHH``. A text holding a non-printable character above U+FFFF (tag characters, private
use) has all its non-ASCII characters escaped, printable ones included, to stay fast.

Backslashes are left alone, so escaping twice changes nothing (an escaped text is all
printable): a literal ``\x1b`` typed by the process looks like an escaped ESC, which is
harmless, and every layer may escape again without garbling what an earlier one produced.
"""

from __future__ import annotations

import functools

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(ch: str) -> str:
    """The visible spelling of one character that is not printable."""
    named = _NAMED.get(ch)
    if named is not None:
        return named
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


@functools.cache
def _bmp_table() -> dict[int, str]:
    """The escape of every non-printable character below U+10000, for ``str.translate``.

    About 10,000 entries, built on the first text that needs one (a few ms): translate then
    escapes in C, some 50 times faster than a loop in Python over a flood of ESC or surrogates.
    """
    return {code: _escape_char(chr(code)) for code in range(0x10000) if not chr(code).isprintable()}


def _escape_all(text: str) -> str:
    """``text`` with every non-printable character escaped, in C whatever the mix.

    The table covers everything below U+10000. What is left is above it (tag characters,
    private use, unassigned planes); then every non-ASCII character of the text is escaped,
    printable ones too: such text is rare and hostile more often than not, and a loop over its
    characters would let 2 MiB of alternating tags and letters cost seconds.
    """
    shown = text.translate(_bmp_table())
    if shown.isprintable():
        return shown
    return shown.encode("ascii", "backslashreplace").decode("ascii")


def escape(text: str, limit: int | None = None) -> str:
    """Return ``text`` with every non-printable character made visible, on one line.

    With ``limit``, the result is at most ``limit`` characters: a longer one is cut (never
    inside an escape) and ends with a marker saying how many characters were left out, such as
    ``...[+1234 chars]``. A result is returned unchanged by a second call with the same limit.
    """
    if limit is None or len(text) <= limit:
        shown = text if text.isprintable() else _escape_all(text)
        if limit is None or len(shown) <= limit:
            return shown
    return _cut(text, limit)


def _cut(text: str, limit: int) -> str:
    """The first characters of ``text``, escaped, and a marker, in ``limit`` characters at most.

    Walks at most ``limit`` characters of the input, whatever its length.
    """
    marker_room = len(f"...[+{len(text)} chars]")
    budget = max(limit - marker_room, 0)
    pieces: list[str] = []
    used = 0
    taken = 0
    for ch in text[:budget]:
        piece = ch if ch.isprintable() else _escape_char(ch)
        if used + len(piece) > budget:
            break
        pieces.append(piece)
        used += len(piece)
        taken += 1
    return "".join(pieces) + f"...[+{len(text) - taken} chars]"
