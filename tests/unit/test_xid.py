"""The Xid catalogue: NVIDIA's buckets map onto gpuguard's classes, unknown codes stay unknown."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.core.xid.catalogue import CATALOGUE, CATALOGUE_SOURCE, DEVIATIONS, XidClass, lookup
from gpuguard.core.xid.faults import needs_reset

# NVIDIA's immediate-action bucket -> the class it must give (WORKFLOW_* are read in docs/xid.md).
_BUCKETS = {
    "RESTART_APP": XidClass.APPLICATION,
    "RESET_GPU": XidClass.RESET_GPU,
    "RESTART_BM": XidClass.REBOOT,
    "CONTACT_SUPPORT": XidClass.OPERATOR,
    "RESTART_VM": XidClass.REBOOT,
    "IGNORE": XidClass.INFORMATIONAL,
    "CHECK_MECHANICALS": XidClass.OPERATOR,
    "UPDATE_SWFW": XidClass.OPERATOR,
}


@pytest.mark.parametrize("code", [13, 31, 43, 45, 94])
def test_application_faults_are_cured_by_a_kill(code: int) -> None:
    """The process is at fault: reaping it leaves a usable GPU."""
    assert lookup(code).xid_class is XidClass.APPLICATION
    assert not needs_reset(code)


@pytest.mark.parametrize("code", [46, 48, 62, 64, 79, 95, 119, 120, 140, 143])
def test_reset_faults_are_not_cured_by_a_kill(code: int) -> None:
    """A reset or a reboot is needed; Xid 79 needs the reboot."""
    info = lookup(code)
    assert info.xid_class in (XidClass.RESET_GPU, XidClass.REBOOT)
    assert needs_reset(code)
    assert (info.xid_class is XidClass.REBOOT) == (code == 79)


def test_every_plain_bucket_maps_to_its_class() -> None:
    """Where NVIDIA's bucket is not a workflow, gpuguard's class follows it exactly."""
    for info in CATALOGUE.values():
        expected = _BUCKETS.get(info.nvidia_action)
        if expected is not None and info.code not in DEVIATIONS:
            assert info.xid_class is expected, info


def test_the_whole_ampere_and_newer_catalogue_is_there_with_its_source() -> None:
    """Codes 1-172, each with NVIDIA's bucket; the catalogue's date is named."""
    assert sorted(CATALOGUE) == list(range(1, 173))
    assert "2025-10-29" in CATALOGUE_SOURCE
    assert "analyzing-xid-catalog" in CATALOGUE_SOURCE
    unbucketed = [code for code, info in CATALOGUE.items() if not info.nvidia_action]
    assert unbucketed == list(range(162, 173))  # listed by NVIDIA without a bucket
    assert all(CATALOGUE[code].xid_class is XidClass.UNKNOWN for code in unbucketed)
    assert DEVIATIONS == {
        43: XidClass.APPLICATION,
        45: XidClass.APPLICATION,
        48: XidClass.RESET_GPU,
    }


# The 26 codes NVIDIA buckets as RESTART_APP that an earlier, partial table left "unknown".
_ONCE_MISSING_APP: tuple[int, ...] = (39, 40, 41, 60, 70, 71, 72, 75, 76, 77, 80, 82, 83, 84)
_ONCE_MISSING_APP += (85, 86, 88, 89, *range(96, 106))


@pytest.mark.parametrize("code", _ONCE_MISSING_APP)
def test_every_restart_app_code_is_an_application_fault(code: int) -> None:
    """Copy-engine, video and JPEG engine faults: the stuck-after-Xid rule applies to them."""
    assert lookup(code).nvidia_action == "RESTART_APP"
    assert lookup(code).xid_class is XidClass.APPLICATION


@pytest.mark.parametrize(
    ("code", "bucket", "xid_class"),
    [
        (54, "CHECK_MECHANICALS", XidClass.OPERATOR),
        (78, "UPDATE_SWFW", XidClass.OPERATOR),
        (92, "IGNORE", XidClass.INFORMATIONAL),
        (151, "RESTART_VM", XidClass.REBOOT),
        (144, "WORKFLOW_NVLINK5_ERR", XidClass.OPERATOR),
        (159, "CHECK_UVM", XidClass.OPERATOR),
    ],
)
def test_the_other_buckets_are_classed_not_unknown(
    code: int, bucket: str, xid_class: XidClass
) -> None:
    """IGNORE, CHECK_MECHANICALS, UPDATE_SWFW, RESTART_VM and workflows have a class."""
    assert lookup(code).nvidia_action == bucket
    assert lookup(code).xid_class is xid_class


@given(st.integers(min_value=0, max_value=2**32))
def test_unknown_codes_are_unknown_and_never_harmless(code: int) -> None:
    """A code not catalogued is UNKNOWN: never an application fault a kill would cure."""
    info = lookup(code)
    assert info.code == code
    if code not in CATALOGUE:
        assert info.xid_class is XidClass.UNKNOWN


def test_docs_table_is_the_catalogue() -> None:
    """docs/xid.md lists every code with the bucket and class the code has."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "xid.md").read_text()
    rows = [
        line.split(" | ") for line in doc.splitlines() if line[:2] == "| " and line[2:3].isdigit()
    ]
    assert len(rows) == len(CATALOGUE)
    for cells in rows:
        info = CATALOGUE[int(cells[0].removeprefix("| "))]
        assert cells[1] == f"`{info.mnemonic}`"
        assert cells[3] == (f"`{info.nvidia_action}`" if info.nvidia_action else "(none given)")
        assert cells[4].removesuffix(" |").removesuffix(" (deviation)") == info.xid_class.value
