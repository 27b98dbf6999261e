"""The Xid catalogue: NVIDIA's buckets map onto gpuguard's classes, unknown codes stay unknown."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.core.xid import CATALOGUE, XidClass, lookup

# NVIDIA's immediate-action bucket -> the class it must give (WORKFLOW_* are read in docs/xid.md).
_BUCKETS = {
    "RESTART_APP": XidClass.APPLICATION,
    "RESET_GPU": XidClass.RESET_GPU,
    "RESTART_BM": XidClass.REBOOT,
    "CONTACT_SUPPORT": XidClass.OPERATOR,
}


@pytest.mark.parametrize("code", [13, 31, 43, 45, 94])
def test_application_faults_are_cured_by_a_kill(code: int) -> None:
    """The process is at fault: reaping it leaves a usable GPU."""
    assert lookup(code).xid_class is XidClass.APPLICATION
    assert lookup(code).kill_helps


@pytest.mark.parametrize("code", [46, 48, 62, 64, 79, 95, 119, 120, 140, 143])
def test_reset_faults_are_not_cured_by_a_kill(code: int) -> None:
    """A reset or a reboot is needed; Xid 79 needs the reboot."""
    info = lookup(code)
    assert info.xid_class in (XidClass.RESET_GPU, XidClass.REBOOT)
    assert not info.kill_helps
    assert (info.xid_class is XidClass.REBOOT) == (code == 79)


def test_every_plain_bucket_maps_to_its_class() -> None:
    """Where NVIDIA's bucket is not a workflow, gpuguard's class follows it exactly."""
    for info in CATALOGUE.values():
        expected = _BUCKETS.get(info.nvidia_action)
        if expected is not None:
            assert info.xid_class is expected, info


@given(st.integers(min_value=0, max_value=2**32))
def test_unknown_codes_are_unknown_and_never_harmless(code: int) -> None:
    """A code not catalogued is UNKNOWN, and a kill is not assumed to help."""
    info = lookup(code)
    assert info.code == code
    if code not in CATALOGUE:
        assert info.xid_class is XidClass.UNKNOWN
        assert not info.kill_helps
