"""The --watch frame (pure): in place, cut to the terminal, nothing of the last frame left."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from gpuguard.core import watchframe


def test_frame_homes_overwrites_and_clears() -> None:
    """Home first; each line cleared to its end; the rest of the screen cleared after the last."""
    frame = watchframe.compose("a\nb\n", "head", 80, 24)
    assert frame == "\x1b[H" + "head\x1b[K\n\x1b[K\na\x1b[K\nb\x1b[K\x1b[J"
    assert "\x1b[2J" not in frame  # never a full clear: that is the flicker


def test_frame_is_cut_to_the_terminal() -> None:
    """Lines longer than the width end in '…'; past the height a marker says how many were cut."""
    text = "\n".join(f"line {n} " + "x" * 100 for n in range(50))
    frame = watchframe.compose(text, "head", 40, 10)
    rows = frame.removeprefix("\x1b[H").removesuffix("\x1b[J").split("\x1b[K\n")
    rows[-1] = rows[-1].removesuffix("\x1b[K")
    assert len(rows) == 10
    assert all(len(row) <= 40 for row in rows)
    assert rows[2].endswith("…")
    assert rows[-1] == "… 43 more lines (enlarge the terminal)"


def test_header_escapes_the_host_name() -> None:
    """A host name is foreign text on a root terminal: escaped like everything else."""
    line = watchframe.header(
        2.0, datetime(2026, 12, 1, 5, 27, 35, tzinfo=timezone.utc), "evil\x1b]0;x\x07"
    )
    assert "\x1b" not in line
    assert "\x07" not in line
    assert line.startswith("Every 2s: gpuguard status   evil\\x1b]0;x\\x07: 2026-12-01 05:27:35")


@pytest.mark.parametrize(("text", "seconds"), [("2", 2.0), ("0.1", 0.1), ("86400", 86400.0)])
def test_interval_bounds(text: str, seconds: float) -> None:
    """0.1 s to a day."""
    assert watchframe.interval(text) == seconds


@pytest.mark.parametrize("text", ["0.05", "0", "-2", "nan", "inf", "1e9", "two"])
def test_interval_refused(text: str) -> None:
    """Anything else is a ValueError (argparse turns it into a usage error)."""
    with pytest.raises(ValueError, match="seconds"):
        watchframe.interval(text)


def _rows(frame: str) -> list[str]:
    rows = frame.removeprefix("\x1b[H").removesuffix("\x1b[J").split("\x1b[K\n")
    rows[-1] = rows[-1].removesuffix("\x1b[K")
    return rows


def test_wide_characters_are_cut_by_terminal_cells() -> None:
    """Wide East-Asian characters are cut at the terminal's width in cells, not code points."""
    frame = watchframe.compose("漢" * 30, "head", 40, 10)
    line = _rows(frame)[2]
    assert line == "漢" * 19 + "…"
    assert watchframe.width(line) <= 40


def test_combining_marks_take_no_cells() -> None:
    """Combining marks add no width: a line of 30 cells with accents on each letter is not cut."""
    text = "e\u0301" * 30
    assert _rows(watchframe.compose(text, "head", 30, 10))[2] == text
    assert watchframe.width(text) == 30


def test_a_wide_character_never_straddles_the_edge() -> None:
    """A wide character that would end past the last cell before '…' is left out whole."""
    line = _rows(watchframe.compose("a" + "漢" * 30, "head", 20, 10))[2]
    assert line == "a" + "漢" * 9 + "…"
    assert watchframe.width(line) == 20
