"""`--since`: the window parser is total, linear and says what it accepts."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest

from gpuguard.core.since import USAGE, Since, parse_since, within

NOW = datetime(2026, 12, 1, 6, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("30m", 1800), ("1h", 3600), ("2d", 172800), ("0s", 0), ("1H", 3600)],
)
def test_relative_windows(text: str, seconds: int) -> None:
    """A whole number and a unit: that long before now."""
    since = parse_since(text)
    assert since.seconds == seconds
    assert since.start(NOW) == NOW - timedelta(seconds=seconds)


def test_iso_times_with_and_without_an_offset() -> None:
    """An offset is honoured; a time without one is the host's local time, as journalctl reads."""
    assert parse_since("2026-12-01T05:00:00+02:00").start(NOW) == datetime(
        2026, 12, 1, 3, 0, tzinfo=timezone.utc
    )
    local = parse_since("2026-12-01T05:00")
    assert local.at == datetime(2026, 12, 1, 5, 0).astimezone().astimezone(timezone.utc)
    assert local.start(NOW) == local.at


@pytest.mark.parametrize(
    "text",
    [
        "",
        "h",
        "1",
        "1x",
        "-1h",
        "1.5h",
        "1 h",
        "\u0661h",  # an Arabic-Indic digit: decimal to Python, not to an operator
        "yesterday",
        "2026-13-01",
        "1h\x1b[2J",
        "9" * 30 + "d",
        "99999999999s",
    ],
)
def test_anything_else_is_a_clear_error(text: str) -> None:
    """Never a crash or a guess: ValueError naming the accepted forms (or the limit)."""
    with pytest.raises(ValueError, match=r"is not a window like|more than ten years") as err:
        parse_since(text)
    assert "\x1b" not in str(err.value)
    if "ten years" not in str(err.value):
        assert USAGE in str(err.value)


def test_hostile_length_is_refused_in_constant_time() -> None:
    """A megabyte of digits is cut before any parsing: no quadratic path, no huge int."""
    started = time.perf_counter()
    for _ in range(100):
        with pytest.raises(ValueError, match="is not a window"):
            parse_since("9" * 1_000_000 + "d")
    assert time.perf_counter() - started < 1.0


def test_within_places_records_by_their_time() -> None:
    """In the window from its start on; unreadable or missing times fall outside a window."""
    start = parse_since("1h").start(NOW)
    assert within(start, "2026-12-01T05:00:00+00:00")
    assert within(start, "2026-12-01T05:30:00")  # gpuguard writes UTC
    assert not within(start, "2026-12-01T04:59:59+00:00")
    for bad in (None, 17, "", "soon", "x" * 10_000):
        assert not within(start, bad)
        assert within(None, bad)  # no window: everything


def test_since_keeps_its_text_for_people() -> None:
    """What the operator typed, for messages."""
    assert parse_since(" 2d ") == Since("2d", seconds=172800)


def test_status_since_is_a_usage_error_when_malformed(capsys: pytest.CaptureFixture[str]) -> None:
    """The parser exits 64 naming the accepted forms; a good window reaches the command."""
    from gpuguard.cli import build_parser  # noqa: PLC0415 - the CLI is only this test's subject
    from gpuguard.core.exits import EX_USAGE  # noqa: PLC0415

    parser = build_parser()
    assert parser.parse_args(["status", "--since", "2d"]).since == Since("2d", seconds=172800)
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["status", "--since", "1 fortnight"])
    assert stop.value.code == EX_USAGE == 64
    assert "argument --since: '1 fortnight' is not a window like 90s" in capsys.readouterr().err
