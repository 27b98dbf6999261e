"""A unit's state in words has one home: status and the daemon's snapshot say the same."""

from __future__ import annotations

from gpuguard.core.unitstate import UnitState

UNIT = "sglang.service"


def test_a_known_unit_is_its_active_and_sub_state() -> None:
    """Its ActiveState and SubState, as systemctl shows them."""
    state = UnitState(UNIT, active_state="active", sub_state="running", load_state="loaded")
    assert state.in_words() == "active (running)"


def test_an_unknown_unit_is_not_found_rather_than_inactive() -> None:
    """ActiveState=inactive comes for any name: LoadState=not-found decides."""
    state = UnitState(UNIT, active_state="inactive", sub_state="dead", load_state="not-found")
    assert state.in_words() == "not found (LoadState=not-found: systemd has no such unit)"


def test_a_unit_systemd_could_not_be_asked_about_says_why() -> None:
    """No bus, a timeout: the state is unknown, with the reason (the daemon said "unknown")."""
    state = UnitState(UNIT, error="systemctl timed out")
    assert state.in_words() == "state unknown (systemctl timed out)"
