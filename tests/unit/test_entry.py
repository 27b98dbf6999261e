"""The gate client's fast lane reads exactly what argparse reads, or hands the argv over."""

from __future__ import annotations

import argparse

import pytest

from gpuguard import cli
from gpuguard.entry import gate_options


def _argparse_view(argv: list[str]) -> dict[str, object]:
    """What the full parser makes of a gate command line (the fields the request carries)."""
    args = cli.build_parser().parse_args(argv)
    return {
        "unit": args.unit,
        "scope": args.scope,
        "grace": args.grace,
        "timeout": args.timeout,
        "socket": args.socket,
        "config": None if args.config is None else str(args.config),
    }


def _lane_view(options: dict[str, str]) -> dict[str, object]:
    grace, timeout, config = (
        options.get("--grace"),
        options.get("--timeout"),
        options.get("--config"),
    )
    return {
        "unit": options["--unit"],
        "scope": options.get("--scope", "unit"),
        "grace": None if grace is None else float(grace),
        "timeout": None if timeout is None else float(timeout),
        "socket": options.get("--socket", "/run/gpuguard/gate.sock"),
        "config": config,
    }


@pytest.mark.parametrize(
    "argv",
    [
        ["gate", "--unit", "sglang.service"],
        ["--config", "/etc/g.toml", "gate", "--unit", "a.service", "--scope", "patterns"],
        ["gate", "--unit", "a.service", "--grace", "5", "--timeout", "1e2", "--socket", "/s"],
        ["gate", "--config", "/a.toml", "--unit", "a.service"],
        ["--config", "/a.toml", "gate", "--unit", "a.service", "--config", "/b.toml"],
        ["gate", "--unit", "a.service", "--unit", "b.service"],
        ["gate", "--unit", "gate", "--timeout", "inf"],
    ],
)
def test_the_lane_reads_a_gate_command_as_argparse_does(argv: list[str]) -> None:
    """Every form the lane accepts means the same request as through the full parser."""
    options = gate_options(argv)
    assert options is not None
    assert _lane_view(options) == _argparse_view(argv)


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--help"],
        ["gate", "--help"],
        ["gate"],
        ["status"],
        ["reap", "--unit", "a.service", "--yes"],
        ["serve-gate"],
        ["gate", "--unit=a.service"],
        ["gate", "--uni", "a.service"],
        ["gate", "--unit", "-a.service"],
        ["gate", "--unit", "a.service", "--grace", "-1"],
        ["gate", "--unit", "a.service", "--grace", "soon"],
        ["gate", "--unit", "a.service", "--scope", "everything"],
        ["gate", "--unit", "a.service", "--timeout"],
        ["--unit", "a.service", "gate"],
        ["gate", "gate", "--unit", "a.service"],
        ["gate", "--unit", "a.service", "extra"],
    ],
)
def test_anything_else_goes_to_the_full_parser(argv: list[str]) -> None:
    """Help, other commands, other spellings and bad values are not the lane's to judge."""
    assert gate_options(argv) is None


def test_what_the_lane_refuses_argparse_refuses_or_reads_otherwise() -> None:
    """A positive control: the lane's refusals include forms argparse rejects with 64."""
    with pytest.raises(SystemExit) as raised:
        cli.build_parser().parse_args(["gate", "--unit", "a.service", "--scope", "everything"])
    assert raised.value.code == 64
    assert isinstance(
        cli.build_parser().parse_args(["gate", "--unit=a.service"]), argparse.Namespace
    )


@pytest.mark.parametrize("value", ["-1", "3601", "inf", "nan", "an hour"])
def test_reap_timeout_outside_its_range_is_a_usage_error(value: str) -> None:
    """A reap --timeout takes 0 to 3600 s, as the gate server does; anything else exits 64."""
    with pytest.raises(SystemExit) as raised:
        cli.build_parser().parse_args(["reap", "--timeout", value])
    assert raised.value.code == 64


def test_reap_timeout_within_its_range_is_read() -> None:
    """The bounds themselves are accepted."""
    for value, seconds in (("0", 0.0), ("3600", 3600.0), ("1e2", 100.0)):
        assert cli.build_parser().parse_args(["reap", "--timeout", value]).timeout == seconds
