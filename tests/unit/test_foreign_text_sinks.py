"""Log fields carry foreign text (commands, units, reasons): escaped and bounded in both forms."""

from __future__ import annotations

import io
import json

import pytest
import structlog

from gpuguard.adapters.logs import FIELD_LIMIT, configure_logging, get_logger


@pytest.fixture(autouse=True)
def _restore_structlog() -> object:
    """configure_logging changes structlog globally: put the defaults back afterwards."""
    yield None
    structlog.reset_defaults()


@pytest.mark.parametrize("as_json", [False, True])
def test_log_fields_are_escaped_and_bounded_in_both_forms(as_json: bool) -> None:
    """A command, unit or reason field stays on its line, whatever it holds and however long."""
    out = io.StringIO()
    configure_logging(json=as_json, stream=out)
    get_logger().info(
        "signal",
        command="srv\nOK: nothing happened\x1b[2K",
        unit="gg-\u202e.service",
        evidence=["line\rone", 7],
        reason="x" * (FIELD_LIMIT * 3),
    )
    written = out.getvalue()
    assert written.endswith("\n")
    assert written.count("\n") == 1
    assert written.rstrip("\n").isprintable()
    assert "\x1b" not in written
    if as_json:
        record = json.loads(written)
        assert record["command"] == "srv\\nOK: nothing happened\\x1b[2K"
        assert record["unit"] == "gg-\\u202e.service"
        assert record["evidence"] == ["line\\rone", 7]
        assert len(record["reason"]) <= FIELD_LIMIT
        assert record["reason"].endswith(" chars]")
    else:  # the console renderer quotes the (escaped) value with repr()
        assert "srv\\\\nOK: nothing happened\\\\x1b[2K" in written
