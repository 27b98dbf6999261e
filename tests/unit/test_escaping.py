"""The one escaper: foreign text is shown visibly, on one line, idempotently, within a bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.core.escaping import escape

# Characters an attacker reaches a terminal or a log with: C0 and C1 controls, DEL, line and
# paragraph separators, bidi overrides and isolates, zero-width characters, a BOM, lone
# surrogates (what surrogateescape makes of undecodable bytes), private use.
HOSTILE = (
    [chr(c) for c in range(0x20)]
    + ["\x7f"]
    + [chr(c) for c in range(0x80, 0xA0)]
    + ["\u2028", "\u2029", "\u202a", "\u202b", "\u202c", "\u202d", "\u202e"]
    + ["\u2066", "\u2067", "\u2068", "\u2069", "\u200b", "\u200e", "\u200f", "\ufeff"]
    + ["\udc80", "\udcff", "\ud800", "\ue000", "\U0010ffff", "\x85", "\xa0"]
)

_SIZES = st.integers(min_value=0, max_value=128 * 1024)
# Large hostile texts are built by repeating a short hostile piece: cheap to generate, and
# long runs of one prefix are what makes a careless scanner quadratic.
_PIECE = st.text(alphabet=st.sampled_from(HOSTILE + list("ab\\x[]0;")), min_size=1, max_size=8)
_BIG = st.builds(lambda piece, size: (piece * (size // len(piece) + 1))[:size], _PIECE, _SIZES)
_TEXT = st.one_of(st.text(max_size=200), _BIG)


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("\x1b]0;pwn\x07", "\\x1b]0;pwn\\x07"),
        ("a\nOK: all idle", "a\\nOK: all idle"),
        ("\r\t", "\\r\\t"),
        ("\x7f\x9b", "\\x7f\\x9b"),
        ("abc\u202eexe.txt", "abc\\u202eexe.txt"),
        ("zero\u200bwidth\ufeff", "zero\\u200bwidth\\ufeff"),
        ("bad byte \udcff", "bad byte \\udcff"),
        ("\U000e0001tag", "\\U000e0001tag"),
        ("é 中文 ✓ back\\slash", "é 中文 ✓ back\\slash"),
    ],
)
def test_each_kind_of_hostile_character_is_made_visible(raw: str, shown: str) -> None:
    """Controls, bidi and invisible characters, surrogates: an escape; printable text: itself."""
    assert escape(raw) == shown


@pytest.mark.parametrize("ch", HOSTILE)
def test_no_hostile_character_survives(ch: str) -> None:
    """Every character on the hostile list comes out as printable ASCII."""
    shown = escape(f"a{ch}b")
    assert shown.isprintable()
    assert shown.isascii()
    assert shown.startswith("a\\")
    assert shown.endswith("b")


def test_a_limit_cuts_with_a_marker_and_never_inside_an_escape() -> None:
    """A bounded result says how much it left out, and an escape is kept whole or not at all."""
    assert escape("x" * 100, 40) == "x" * 25 + "...[+75 chars]"
    assert len(escape("x" * 100, 40)) <= 40
    shown = escape("\x1b" * 100, 40)
    assert shown == "\\x1b" * 6 + "...[+94 chars]"
    assert escape("short", 40) == "short"


def test_a_limit_bounds_the_work_too() -> None:
    """A 2 MiB hostile text with a limit is cut from its first characters only."""
    shown = escape("\x1b" * (2 * 1024 * 1024), 100)
    assert len(shown) <= 100
    assert shown.endswith(" chars]")


@settings(max_examples=60, deadline=None)
@given(_TEXT)
def test_escaped_text_is_one_printable_line(text: str) -> None:
    """Whatever comes in, what goes out is printable: no newline, no control, no surrogate."""
    shown = escape(text)
    assert shown.isprintable()
    assert len(shown.splitlines()) <= 1
    shown.encode("utf-8")  # no lone surrogate left: writing it cannot raise


@settings(max_examples=60, deadline=None)
@given(_TEXT, st.one_of(st.none(), st.integers(min_value=30, max_value=5000)))
def test_escaping_is_idempotent(text: str, limit: int | None) -> None:
    """Escaping escaped text changes nothing: every layer may escape again safely."""
    once = escape(text, limit)
    assert escape(once, limit) == once
    assert escape(once) == once


@settings(max_examples=60, deadline=None)
@given(_TEXT, st.integers(min_value=30, max_value=5000))
def test_a_limited_result_fits_its_limit(text: str, limit: int) -> None:
    """With a limit, the result (marker included) is never longer than the limit."""
    shown = escape(text, limit)
    assert len(shown) <= limit
    assert shown.isprintable()
    if len(text) <= limit and text.isprintable():
        assert shown == text


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=200))
def test_printable_text_is_kept_as_it_is(text: str) -> None:
    """Text with nothing to escape passes unchanged; anything else only gains escapes."""
    shown = escape(text)
    if text.isprintable():
        assert shown == text
    else:
        assert len(shown) > len(text)
