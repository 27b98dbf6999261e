"""Kernel Xid lines: every observed form parses, forgeries and garbage never become events."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.core.xid.events import MalformedXid, XidEvent, normalize_pci, parse_kernel_entry


def kernel(message: object, **fields: object) -> dict[str, object]:
    """A journal entry as journalctl prints one read from /dev/kmsg."""
    return {
        "_TRANSPORT": "kernel",
        "MESSAGE": message,
        "__CURSOR": "s=1;i=2",
        "__MONOTONIC_TIMESTAMP": "5000000",
        "__REALTIME_TIMESTAMP": "1790000000000000",
        "_BOOT_ID": "a" * 32,
        **fields,
    }


def event(message: object, **fields: object) -> XidEvent:
    """The event of a kernel entry with ``message``; fails the test when there is none."""
    parsed = parse_kernel_entry(kernel(message, **fields))
    assert isinstance(parsed, XidEvent), parsed
    return parsed


def test_current_form_with_pid_and_name() -> None:
    """The pid and name as drivers of recent years print them."""
    got = event(
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python3, GPU has fallen off the bus."
    )
    assert (got.pci_bus_id, got.code, got.pid, got.name) == ("0000:3b:00", 79, 4242, "python3")
    assert got.detail == "GPU has fallen off the bus."
    assert got.monotonic_s == 5.0
    assert got.boot_id == "a" * 32


def test_unknown_pid_is_never_a_pid() -> None:
    """'<unknown>' (with or without quotes) is no process; the name is still shown."""
    got = event("NVRM: Xid (PCI:0000:19:00): 119, pid='<unknown>', name=<unknown>, Timeout")
    assert got.pid is None
    assert got.name == "<unknown>"
    assert got.code == 119


@pytest.mark.parametrize(
    ("message", "pci", "code", "pid", "detail"),
    [
        (
            (
                "NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for "
                "remapping, reset gpu to activate."
            ),
            "0000:10:1c",
            63,
            1896,
            "Row Remapper: New row marked for remapping, reset gpu to activate.",
        ),
        (
            "NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.",
            "0000:2b:00",
            79,
            None,
            "GPU has fallen off the bus.",
        ),
        (
            "NVRM: Xid (0000:01:00): 3, C 00000005 SC 00000007",
            "0000:01:00",
            3,
            None,
            "C 00000005 SC 00000007",
        ),
    ],
)
def test_older_forms(message: str, pci: str, code: int, pid: int | None, detail: str) -> None:
    """No name, no pid, no ``PCI:`` prefix: all observed in public reports."""
    got = event(message)
    assert (got.pci_bus_id, got.code, got.pid, got.detail) == (pci, code, pid, detail)


def test_only_the_kernel_transport_counts() -> None:
    """The same text sent by a user (logger, syslog, stdout) is not an Xid."""
    line = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus."
    for transport in ("syslog", "journal", "stdout", None):
        assert parse_kernel_entry(kernel(line, _TRANSPORT=transport)) is None
    assert parse_kernel_entry(kernel(line, _TRANSPORT=["kernel", "kernel"])) is None


def test_a_byte_array_message_is_decoded_and_the_name_escaped() -> None:
    """The journal gives non-UTF-8 or control characters as bytes; the name comes out escaped."""
    raw = b"NVRM: Xid (PCI:0000:3b:00): 13, pid=7, name=ev\x1b[2Jil\n, Graphics Exception"
    got = event(list(raw))
    assert got.name == "ev\\x1b[2Jil\\n"
    assert got.detail == "Graphics Exception"


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ("NVRM: Xid (PCI:0000:3b:00: 79, x", "no '): '"),
        ("NVRM: Xid (PCI:zz:3b:00): 79, x", "not a PCI address"),
        ("NVRM: Xid (PCI:0000:3b:00): x79, y", "no Xid code"),
        ("NVRM: Xid (PCI:0000:3b:00): 1234567, y", "no Xid code"),
        ("NVRM: Xid (PCI:0000:3b:00): 79; y", "no ', '"),
        ("NVRM: Xid (PCI:0000:3b:00): 79, pid=12ab, name=x, y", "pid is neither"),
    ],
)
def test_malformed_lines_say_why(message: str, reason: str) -> None:
    """A line that names an Xid but does not parse is reported, not guessed."""
    parsed = parse_kernel_entry(kernel(message))
    assert isinstance(parsed, MalformedXid)
    assert parsed.reason.startswith(reason)


def test_lines_without_the_marker_are_not_xids() -> None:
    """Other kernel messages, and a marker buried deep in a long line, are not Xids."""
    assert parse_kernel_entry(kernel("NVRM: GPU at PCI:0000:3b:00: GPU-1234")) is None
    assert parse_kernel_entry(kernel("x" * 4096 + "NVRM: Xid (PCI:0000:3b:00): 79, y")) is None


def test_nvml_and_kernel_addresses_meet() -> None:
    """NVML's ``00000000:3B:00.0`` and the kernel's ``PCI:0000:3b:00`` are the same GPU."""
    assert normalize_pci("00000000:3B:00.0") == normalize_pci("PCI:0000:3b:00") == "0000:3b:00"
    assert normalize_pci("0000:3b") is None
    assert normalize_pci("0000:3b:00:00") is None


_PID = st.one_of(st.none(), st.integers(1, 4_194_304))
_NAME = st.text(st.characters(codec="utf-8", exclude_characters=","), max_size=15)
_DETAIL = st.text(st.characters(codec="ascii", min_codepoint=32, max_codepoint=126), max_size=150)


@given(st.integers(0, 0xFFFF), st.integers(0, 0xFF), st.integers(0, 0x1F), st.integers(0, 99999))
def test_every_well_formed_address_and_code_round_trips(
    domain: int, bus: int, device: int, code: int
) -> None:
    """What the driver prints (``%04x:%02x:%02x``, a decimal code) is read back exactly."""
    got = event(f"NVRM: Xid (PCI:{domain:04x}:{bus:02x}:{device:02x}): {code}, text")
    assert got.pci_bus_id == f"{domain:04x}:{bus:02x}:{device:02x}"
    assert got.code == code


@given(_PID, _NAME, _DETAIL)
def test_pid_name_and_detail_round_trip(pid: int | None, name: str, detail: str) -> None:
    """The pid (or its absence) and name come back; all text is escaped, control characters too."""
    who = "pid='<unknown>'" if pid is None else f"pid={pid}"
    got = event(f"NVRM: Xid (PCI:0000:3b:00): 31, {who}, name={name}, {detail}")
    assert got.pid == pid
    assert got.name is not None
    assert got.name.isprintable()
    assert got.detail.isprintable()


@given(st.text(max_size=2000), st.sampled_from(["kernel", "syslog"]))
def test_any_text_is_total(text: str, transport: str) -> None:
    """Any message, with or without the marker spliced in, parses or is refused, never raises."""
    for message in (text, "NVRM: Xid (" + text, "NVRM: Xid (PCI:0000:3b:00): " + text):
        parsed = parse_kernel_entry(kernel(message, _TRANSPORT=transport))
        assert parsed is None or isinstance(parsed, XidEvent | MalformedXid)


@given(st.dictionaries(st.text(max_size=20), st.one_of(st.none(), st.integers(), st.text())))
def test_any_entry_is_total(entry: dict[str, object]) -> None:
    """Any entry of any shape: no exception."""
    parse_kernel_entry(entry)


def test_a_huge_line_costs_its_first_characters_only() -> None:
    """A 16 MiB message (the largest the follower passes) is scanned in bounded time."""
    message = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=" + "n, " * 5_000_000
    began = time.perf_counter()
    for _ in range(100):
        parse_kernel_entry(kernel(message))
    assert time.perf_counter() - began < 1.0
