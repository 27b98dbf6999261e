"""One rule for a service's name: the configuration and a gate request accept the same names.

systemd's longest unit name is 255 characters; both parsers take exactly those, and the
follower's and drop-in's any-unit syntax has the same bound.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuguard.config import ConfigError, parse_settings
from gpuguard.core.gate.proto import Request, parse_request
from gpuguard.core.unitname import UNIT_NAME, unit_syntax_problem

LONGEST = "a" * (255 - len(".service")) + ".service"
TOO_LONG = "a" + LONGEST


def _config_takes(name: str) -> bool:
    try:
        parse_settings(f'[units."{name}"]\n'.encode(), Path("gpuguard.toml"))
    except ConfigError:
        return False
    return True


def _gate_takes(name: str) -> bool:
    line = json.dumps({"v": 1, "command": "gate", "unit": name}).encode()
    return isinstance(parse_request(line), Request)


@pytest.mark.parametrize(
    ("name", "taken"),
    [
        ("sglang.service", True),
        ("vllm@0.service", True),
        (LONGEST, True),
        (TOO_LONG, False),
        ("sglang.socket", False),
        ("-x.service", True),  # a leading dash is syntax systemd allows; argv users check it
        ("a b.service", False),
        ("../x.service", False),
    ],
)
def test_the_configuration_and_a_gate_request_agree_on_a_services_name(
    name: str, *, taken: bool
) -> None:
    """Each name is taken by both parsers or refused by both."""
    assert len(LONGEST) == 255
    assert _config_takes(name) is taken
    assert _gate_takes(name) is taken


def test_any_units_name_has_systemds_bound() -> None:
    """255 characters are a unit name, 256 are not."""
    assert UNIT_NAME.fullmatch(LONGEST)
    assert not UNIT_NAME.fullmatch(TOO_LONG)


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("sglang.service", None),
        ("vllm@0.service", None),
        ("run-u12.scope", None),
        ("bars.servce", ".servce is no unit type (a service's name ends in .service)"),
        ("sglang", "not a unit's name (NAME.service)"),
        (".service", "not a unit's name (NAME.service)"),
        ("a b.service", "not a unit's name (NAME.service)"),
        ("x" * 250 + ".service", "not a unit's name (NAME.service)"),
    ],
)
def test_a_name_no_unit_can_have_is_told_without_systemd(name: str, problem: str | None) -> None:
    """The characters, the length and the type suffix decide; systemd is not asked."""
    assert unit_syntax_problem(name) == problem
