"""A command's typed arguments, and their way to the gate server and back."""

from __future__ import annotations

import pytest

from gpuguard.commands.arguments import REAP_TIMEOUT_S, GateArgs, ReapArgs, from_request, to_request
from gpuguard.core.gate.proto import Request, encode_request, parse_request

UNIT = "sglang.service"


def _through_the_socket(request: Request) -> Request:
    """The request as the server parses it from the line the client sends."""
    parsed = parse_request(encode_request(request))
    assert isinstance(parsed, Request), parsed
    return parsed


def test_a_gates_arguments_reach_the_server_unchanged() -> None:
    """The unit, scope, grace and timeout of a gate are what the server's gate runs with."""
    args = GateArgs(UNIT, "patterns", grace=2.5, timeout=30.0)
    request = to_request(args)
    assert request is not None
    assert from_request(_through_the_socket(request)) == args


def test_a_reap_the_server_runs_never_asks_and_never_dry_runs() -> None:
    """A --yes reap keeps its options; the server's copy answers yes and signals for real."""
    args = ReapArgs(UNIT, "all", grace=1.0, timeout=5.0, json=True, yes=True)
    request = to_request(args)
    assert request is not None
    assert from_request(_through_the_socket(request)) == args


def test_a_request_without_a_timeout_reaps_as_long_as_the_command_line() -> None:
    """A reap request with no timeout waits REAP_TIMEOUT_S, the command line's default."""
    served = from_request(Request("reap", UNIT))
    assert served == ReapArgs(UNIT, timeout=REAP_TIMEOUT_S, yes=True)
    assert from_request(Request("gate", UNIT)) == GateArgs(UNIT)


@pytest.mark.parametrize(
    "args",
    [
        ReapArgs(UNIT),  # asks on the terminal first
        ReapArgs(UNIT, yes=True, dry_run=True),  # signals nothing
        ReapArgs(None, yes=True),  # the server chooses no unit
    ],
)
def test_a_reap_that_asks_dry_runs_or_names_no_unit_is_not_the_servers(args: ReapArgs) -> None:
    """Only a reap that signals without asking, for a named unit, goes to the gate server."""
    assert to_request(args) is None
